"""The ELSA job: ADMM on the model's own loss under ZeRO-3, z and u updated inside the optimizer step.

    setup -> load_checkpoint (resume, or measure dense + one-shot baseline) -> train (checkpoints)
          -> finish (validation, export, report, evaluation of the saved model) -> cleanup

Every rank runs this; only rank 0 prints and writes. Collectives are marked where they happen.
"""
from __future__ import annotations

import gc
import os
import shutil
import time
from typing import Any

import torch

from elsa_ds.admm.optimizer import AdmmOptimizer, summarize_metrics
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.config import ElsaConfig
from elsa_ds.options import JobOptions
from elsa_ds.jobs import checks, report
from elsa_ds.jobs.defaults_applied import apply_defaults
from elsa_ds.jobs.interface import Printer
from elsa_ds.jobs.phases import PhaseLog, step_phase
from elsa_ds.jobs.selection import Selector, snapshot_dir
from elsa_ds.jobs.training import (Checkpoints, RunState, TrainingData, launched_world_size, load_data, start_process_group,
                                   train_loop, windows_ppl)
from elsa_ds.jobs.warm_start import WarmStart, warm_start, warm_start_path, warm_start_weights_dir
from elsa_ds.models import ModelSource, freeze_embeddings
from elsa_ds.monitor import Monitor
from elsa_ds.output import fresh_staging, staging_dir
from elsa_ds.targets import LayerGoal, select_targets
from elsa_ds.zero import checkpoint, steps
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import PartitionedModel, ZeroEngine, build_admm_engine, full_shapes, load_partitioned
from elsa_ds.zero.export import export_model
from elsa_ds.zero.partitions import magnitude_pruned


class ElsaJob:
    """Prune ``cfg.model`` with ELSA under ZeRO-3 (see the module docstring for the lifecycle)."""

    def __init__(self, cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig):
        self.cfg: ElsaConfig = cfg  # setup applies the defaults rule to the fields the user left unset
        self.opts: JobOptions = opts
        self.ds_config: DsConfig = ds_config  # the DeepSpeed JSON as read; setup resolves it into ds
        self.started: float = time.time()
        self.source: ModelSource = checks.model_source(cfg, opts)
        self.phases: PhaseLog = PhaseLog(int(os.environ.get("RANK", "0")))
        self.checkpoints: Checkpoints = Checkpoints(opts, cfg.keep_checkpoints)
        self.state: RunState = RunState()  # set by the checkpoint loader: fresh, or the checkpoint's
        self.defaults: dict[str, Any] = {}  # set by setup: what the defaults rule filled in, and why
        self.ds: DsConfig | None = None  # set by setup: the engine's DeepSpeed config (ds_config checked, resolved)
        self.rank: int = 0  # set by setup (the process group)
        self.world: int = 1  # set by setup (the process group)
        self.say: Printer | None = None  # set by setup: rank-0 output
        self.data: TrainingData | None = None  # set by setup
        self.warm: WarmStart | None = None  # set by setup: --init_mask's z₀ masks (and x₀), on a fresh run
        self.partitioned: PartitionedModel | None = None  # set by setup: the model in ZeRO-3 partitions
        self.goals: dict[str, LayerGoal] = {}  # set by setup: each pruned layer's sparsity or N:M goal
        self.zero: ZeroEngine | None = None  # set by setup: the DeepSpeed engine, the slice layout, the comm
        self.admm: AdmmOptimizer | None = None  # set by setup: ZeRO-3's basic optimizer, z and u in its state
        self.monitor: Monitor | None = None  # set by setup
        self.selector: Selector | None = None  # set by setup with --select_every

    # ---- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Every check that needs no weights (on every rank, before any collective), then the process group, the
        data, the warm-start masks and the engine."""
        resumed = checkpoint.resumed_fingerprint(self.opts.output_dir, self.opts.resume)
        self.cfg, self.defaults = apply_defaults(self.cfg, self.source.config(), resumed)
        cfg = self.cfg
        self.phases.mark("load")
        self.ds = checks.before_work(cfg, self.opts, self.ds_config, launched_world_size(), self.source)
        self.rank, self.world, self.say = start_process_group(cfg, self.opts, self.ds, self.defaults)
        self.data = load_data(cfg, self.source, self.ds, self.rank, self.world, self.say)
        self.warm = (warm_start(cfg, self.source, self.opts.output_dir, self.data.tokenizer, self.rank, self.say,
                                self.data.validation.ids) if cfg.init_mask and not self.opts.resume else None)
        torch.manual_seed(cfg.seed)
        self.partitioned, self.goals, self.zero, self.admm = self._build_engine()
        self.monitor = Monitor(self.zero.engine, self.rank)
        self.selector = (Selector(cfg.select_every, cfg.select_patience, snapshot_dir(self.opts.output_dir), self.rank)
                         if cfg.select_every else None)

    def _build_engine(self) -> tuple[PartitionedModel, dict[str, LayerGoal], ZeroEngine, AdmmOptimizer]:
        cfg, warm = self.cfg, self.warm
        masks, start = (warm.masks, warm.start) if warm else (None, None)
        # a resumed run loads the dense model: its checkpoint brings x back
        partitioned = load_partitioned(start or self.source, self.ds, cfg.gradient_checkpointing, cfg.random_init and start is None)
        model = partitioned.model
        if start is not None and start.name == str(warm_start_weights_dir(self.opts.output_dir)):
            torch.distributed.barrier()  # every rank has read it
            if self.rank == 0:
                shutil.rmtree(start.name)  # partitioned now; a resumed run restores x from its checkpoint
        if cfg.freeze_embeddings:
            freeze_embeddings(model)
        pruned = select_targets(model, cfg.targets)
        goals = cfg.layer_goals(full_shapes(model, pruned))
        zero, admm = build_admm_engine(model, cfg, self.ds, pruned, goals, masks)
        n_pruned = sum(sl.numel for sg in zero.layout for sl in sg.slices if sl.start == 0)
        goal = cfg.pattern if cfg.nm else f"{cfg.sparsity:.0%}" + (f" (profile {cfg.sparsity_profile})" if cfg.sparsity_profile else "")
        self.say(f"[elsa_ds] pruning {len(pruned)} layers ({n_pruned:,} weights) to {goal} with ELSA "
                 f"(projection {cfg.projection.value}, λ {cfg.lmda} {cfg.lmda_schedule.value}, interval {cfg.interval}, "
                 f"{cfg.steps} steps{', z warm-started from ' + cfg.init_mask if masks else ''}"
                 f"{', x too (its pruned weights)' if start is not None else ''})")
        return partitioned, goals, zero, admm

    # ---- load_checkpoint ----------------------------------------------------------------------------------------
    def load_checkpoint(self) -> None:
        """Continue from the latest loadable checkpoint (--resume), or start fresh. Collective."""
        fingerprint = self.cfg.resume_fingerprint(self.world)
        self.state = self.checkpoints.load(self.zero.engine, self.zero.comm, fingerprint, self.rank, self.say)
        if self.opts.resume:
            if self.selector is not None:
                self.selector.record = self.state.selection or self.selector.record
            self.say(f"[elsa_ds] continuing at step {self.state.next_step} of {self.cfg.steps}")
            return
        if self.rank == 0:
            if self.selector is not None:
                self.selector.clean()  # a crashed run's snapshots
            # a crashed warm start's x₀ copy (this run's own was deleted once partitioned): nothing reads it now
            shutil.rmtree(warm_start_weights_dir(self.opts.output_dir), ignore_errors=True)
        self._measure_references()

    def _measure_references(self) -> None:
        """Validation perplexity of the dense model and of one-shot magnitude pruning, on the same windows -- or, when x
        starts pruned (--init_weights), of that start (the dense model was measured on rank 0 before pruning). Collective."""
        state, validation = self.state, self.data.validation
        if self.warm is not None and self.warm.start is not None:
            state.dense_ppl = validation.perplexity(*self.warm.dense_nll) if self.warm.dense_nll else None
            if self.selector is not None and validation.count:  # the start is a candidate for the export: step 0
                state.baseline_ppl = self.selector.score(self.zero, self.admm, validation, self.ds.micro_batch_size, 0,
                                                         project=False)
                state.selection = self.selector.record
            else:
                state.baseline_ppl = self.validation_ppl()
            self.say(f"[elsa_ds] validation ppl: dense {state.dense_ppl}, the warm start ({self.cfg.init_mask}) "
                     f"{state.baseline_ppl}")
            return
        state.dense_ppl = self.validation_ppl()
        if self.cfg.baseline == "magnitude" and validation.count and self.ds.uses_nvme:
            self.say("[elsa_ds] one-shot magnitude baseline skipped: it edits resident partitions, which NVMe offload swaps out")
        elif self.cfg.baseline == "magnitude" and validation.count:
            with magnitude_pruned(self.zero, self.cfg.nm):
                state.baseline_ppl = self.validation_ppl()
        self.say(f"[elsa_ds] validation ppl: dense {state.dense_ppl}, one-shot magnitude {state.baseline_ppl}")

    def validation_ppl(self) -> float | None:
        """Perplexity of the engine's current weights on the validation windows (None without windows). Collective."""
        return windows_ppl(self.zero, self.data.validation, self.ds.micro_batch_size)

    # ---- train ----------------------------------------------------------------------------------------------------
    def train(self) -> None:
        """The ADMM loop from ``state.next_step``: one engine step per global batch; z, u update inside the step."""
        self.admm.lam = self.state.lam
        train_loop(self.cfg, self.state, self.rank, self.train_step, self._after_step, self.save_checkpoint)

    def train_step(self, step: int) -> float:
        """One global batch: λ and the projection flags for this step, then the engine step. Returns the global mean loss."""
        cfg, admm = self.cfg, self.admm
        admm.begin_step(step)
        self.phases.mark(step_phase(step, admm.projected_this_step, step == cfg.steps - 1), step)
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        return steps.train_step(self.zero.engine, admm, self.zero.comm, self.data.batches.micro_batches(step), lr)

    def _after_step(self, bar, step: int, loss: float) -> bool:
        """Log the step and a projection's metrics; score Π(x) when the selection is due. True: stop early."""
        admm, lr = self.admm, self.admm.param_groups[0]["lr"]
        self.state.lam = admm.lam
        if step % self.cfg.log_interval == 0:
            bar.set_postfix(loss=f"{loss:.4f}", lmda=f"{admm.lam:.3g}", lr=f"{lr:.2e}")
        self.monitor.write(step + 1, {"loss": loss, "lambda": admm.lam, "lr": lr, "step_time_s": self.state.step_times[-1]})
        if not admm.projected_this_step:
            return False
        sums = self.zero.comm.all_reduce_sum(admm.local_metrics())  # collective
        entry = {"step": step + 1, "loss": loss, **summarize_metrics(sums, admm.lam), "final": admm.finalized_this_step}
        self.state.history.append(entry)
        if entry["final"]:
            return False
        self.monitor.write(step + 1, {k: entry[k] for k in ("residual", "mask_flip_frac", "admm_state_bytes_per_param")})
        if self.rank == 0:
            bar.write(f"[projection] step {step + 1}: loss {loss:.4f}  λ {entry['lambda']:.4g}  "
                      f"residual ‖x−z‖/‖x‖ {entry['residual']:.4f}  mask flips {entry['mask_flip_frac']:.4%}")
        return self._select(bar, step, sum(1 for h in self.state.history if not h["final"]))

    def _select(self, bar, step: int, projections: int) -> bool:
        """Score Π(x) on the validation windows when due (collective); True once the patience ran out."""
        validation = self.data.validation
        if self.selector is None or validation.count == 0 or not self.selector.due(projections):
            return False
        value = self.selector.score(self.zero, self.admm, validation, self.ds.micro_batch_size, step + 1)
        self.state.selection = self.selector.record
        if self.rank == 0:
            best = self.selector.record["best"]
            bar.write(f"[selection] step {step + 1}: validation ppl of Π(x) {value:.3f} "
                      f"(best {best['ppl']:.3f} at step {best['step']})")
        if self.selector.stop:
            self.selector.record["stopped_at"] = step + 1
            self.say(f"[elsa_ds] stopping early at step {step + 1}: {self.selector.patience} scored projections without improvement")
            return True
        return False

    def save_checkpoint(self) -> None:
        """A DeepSpeed checkpoint with the ADMM state, published as ``latest`` once every rank wrote it. Collective."""
        self.checkpoints.save(self.zero.engine, self.state, self.rank, self.say)

    # ---- finish -----------------------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any] | None:
        """Validation of the pruned model, the export, the report; then rank 0 evaluates the saved model alone."""
        cfg, opts = self.cfg, self.opts
        self.phases.mark("validation")
        pruned_ppl = self._exported_ppl()
        staging = staging_dir(opts.output_dir)
        if self.rank == 0:
            fresh_staging(opts.output_dir)
            masks = self.warm.masks if self.warm is not None else None
            if masks is not None and masks.source == warm_start_path(opts.output_dir):
                masks.source.unlink()  # read at the first step; a resumed run restores z from its checkpoint
        self.phases.mark("export")
        export_model(self.zero.engine.module, self.data.tokenizer, staging, self.rank)  # collective
        result = None
        if self.rank == 0:
            self.phases.mark("verify")
            result = report.elsa_report(self._record(pruned_ppl), staging)
            report.publish_report(result, staging, opts, bool(opts.resume or cfg.save_interval), self.say)
            self.phases.mark("done")
        torch.distributed.barrier()  # the last collective: the other ranks may leave now, rank 0 evaluates alone
        if self.selector is not None and self.rank == 0:
            self.selector.clean()
        if self.rank == 0 and (cfg.eval_ppl or cfg.eval_tasks):
            self._drop_engine()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            report.evaluate_saved_model(opts.output_dir, cfg)
        return result

    def _exported_ppl(self) -> float | None:
        """Validation perplexity of the model the export will hold: the final projection, or the selection's best
        snapshot written back into the shards when it was better (--select_every). Collective."""
        stopped = self.selector is not None and self.selector.record["stopped_at"] is not None
        pruned_ppl = None if stopped else self.validation_ppl()
        if self.selector is not None and self.data.validation.count:
            pruned_ppl = self.selector.choose(self.zero, pruned_ppl, self.state.next_step)  # collective
            self.state.selection = self.selector.record
        return pruned_ppl

    def _record(self, pruned_ppl: float | None) -> report.ReportRecord:
        """What the report says: this run's measurements and the layout's summary (rank 0)."""
        st = self.state
        return report.ReportRecord(
            cfg=self.cfg, method="elsa", deepspeed=self.opts.deepspeed, world=self.world, started=self.started,
            validation=self.data.validation.describe(), goals=self.goals,
            expected_zeros={sl.layer: sl.numel - sl.keep for sg in self.zero.layout for sl in sg.slices},
            final_ppl=pruned_ppl, dense_ppl=st.dense_ppl, baseline_ppl=st.baseline_ppl, losses=st.losses,
            step_times=st.step_times, history=st.history, selection=st.selection, defaults=self.defaults,
            global_batch=self.ds.train_batch_size, offload=report.offload(self.ds), training_data=self.data.sampling,
            kernels=self.admm.kernel_report())

    def _drop_engine(self) -> None:
        self.zero = self.admm = self.partitioned = None

    def cleanup(self) -> None:
        """Drop the engine and the model; the process group lives until the process exits (``zero/dist.py``)."""
        self._drop_engine()
        gc.collect()
