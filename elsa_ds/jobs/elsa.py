"""The ELSA job: ADMM on the model's own loss under ZeRO-3, z and u updated inside the optimizer step.

    setup -> load_checkpoint (resume, or measure dense + one-shot baseline) -> train (checkpoints)
          -> finish (validation, export, report, evaluation of the saved model) -> cleanup

Every rank runs this; only rank 0 prints and writes. Collectives are marked where they happen.
"""
from __future__ import annotations

import gc
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from elsa_ds import machine
from elsa_ds.admm.optimizer import summarize_metrics
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.config import RESUME_DEFAULTS, ElsaConfig, JobOptions
from elsa_ds.data import GlobalBatches, is_gemma, training_blocks, validation_windows
from elsa_ds.errors import ElsaError
from elsa_ds.jobs import checks, report
from elsa_ds.jobs.defaults_applied import apply_defaults
from elsa_ds.jobs.interface import Printer
from elsa_ds.jobs.phases import PhaseLog, step_phase
from elsa_ds.jobs.selection import Selector, snapshot_dir
from elsa_ds.jobs.warm_start import warm_start, warm_start_path, warm_start_weights_dir
from elsa_ds.models import freeze_embeddings
from elsa_ds.monitor import MONITOR_DIR, Monitor, default_output_paths
from elsa_ds.output import REPORT_NAME, fresh_staging, publish, staging_dir
from elsa_ds.targets import select_targets
from elsa_ds.zero import checkpoint, steps
from elsa_ds.zero.dist import init_distributed
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import build_admm_engine, full_shapes, load_partitioned
from elsa_ds.zero.export import export_model
from elsa_ds.zero.partitions import distributed_nll, magnitude_pruned


@dataclass
class RunState:
    """Everything of the loop a checkpoint must bring back (the data position is ``next_step`` itself)."""

    next_step: int = 0
    lam: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    dense_ppl: float | None = None
    baseline_ppl: float | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    selection: dict[str, Any] | None = None  # the validation-driven selection's curve and best (--select_every)


class ElsaJob:
    """Prune ``cfg.model`` with ELSA under ZeRO-3 (see the module docstring for the lifecycle)."""

    def __init__(self, cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig):
        self.cfg, self.opts, self.ds_config = cfg, opts, ds_config
        self.started = time.time()
        self.job = None
        self.state = RunState()
        self.ckpt_dir = opts.output_dir / "checkpoints"
        self.source = checks.model_source(cfg, opts)
        self.phases = PhaseLog(int(os.environ.get("RANK", "0")))

    # ---- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Every check that needs no weights (on every rank, before any collective), then the process group, the
        data, the warm-start masks and the engine."""
        self.cfg, self.defaults = apply_defaults(self.cfg, self.source.config())
        cfg, opts = self.cfg, self.opts
        self.phases.mark("load")
        self.ds = checks.before_work(cfg, opts, self.ds_config, int(os.environ.get("WORLD_SIZE", "1")), self.source)
        if cfg.select_every and self.ds_config.optimizer_on_nvme:
            raise ElsaError("--select_every scores Π(x) from resident fp32 masters and Adam moments, which NVMe optimizer "
                            "offload swaps out; use zero3_offload or drop --select_every")
        monitor_dir = opts.output_dir / MONITOR_DIR if default_output_paths(self.ds, opts.output_dir) else None
        self.rank, self.world = init_distributed()
        self.say = Printer(self.rank)
        for warning in machine.stale_build_locks():
            self.say(warning)
        if monitor_dir is not None and self.rank == 0 and not opts.resume and monitor_dir.exists():
            shutil.rmtree(monitor_dir)  # an overwritten run's logs; DeepSpeed's csv monitor would append to them
        self.say("[elsa_ds] resolved ELSA config:\n" + json.dumps(cfg.model_dump(mode="json"), indent=2))
        if self.defaults["applied"]:
            self.say("[elsa_ds] from the defaults rule (elsa_ds/defaults.py): "
                     + "; ".join(f"{k} {v} ({self.defaults['why'][k]})" for k, v in self.defaults["applied"].items()))
        self.say("[elsa_ds] DeepSpeed config:\n" + json.dumps(self.ds, indent=2))
        self._setup_data()
        warm = (warm_start(cfg, self.source, opts.output_dir, self.tokenizer, self.rank, self.say, self.validation.ids)
                if cfg.init_mask and not opts.resume else None)
        self.init_masks, self.start = (warm.masks, warm.start) if warm else (None, None)
        self.dense_nll = warm.dense_nll if warm else None
        torch.manual_seed(cfg.seed)
        self._setup_engine()
        self.monitor = Monitor(self.job.engine, self.rank)
        self.selector = (Selector(cfg.select_every, cfg.select_patience, snapshot_dir(opts.output_dir), self.rank)
                         if cfg.select_every else None)

    def _setup_data(self) -> None:
        """Training sequences (identical on every rank: each computes them from the seed) and validation windows."""
        cfg, ds = self.cfg, self.ds
        self.tokenizer = self.source.load_tokenizer()
        global_batch, micro = ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]
        train_blocks, self.train_data = training_blocks(cfg.dataset, self.tokenizer, cfg.seqlen, cfg.steps * global_batch, cfg.sampling,
                                                        cfg.seed, is_gemma(self.source.config()), holdout_part=cfg.val_dataset is None)
        self.batches = GlobalBatches(train_blocks, global_batch, micro, self.world, self.rank, cfg.seed)
        self.validation = validation_windows(cfg.dataset, cfg.val_dataset, self.tokenizer, cfg.seqlen, cfg.ppl_protocol,
                                             self.source.config(), cfg.val_windows)
        self.say(f"[elsa_ds] training data {cfg.dataset} ({self.train_data['sampling']}): {train_blocks.shape[0]} sequences x {cfg.seqlen} "
                 f"tokens; global batch {global_batch} = {micro} micro x {self.world} ranks x {self.batches.grad_accum} accumulation")
        self.say(f"[elsa_ds] validation {self.validation.source}: {self.validation.count} windows ({self.validation.protocol.value} "
                 f"protocol) from {self.validation.documents} documents ({self.validation.rule})")

    def _setup_engine(self) -> None:
        cfg = self.cfg
        start = self.start or self.source  # a resumed run loads the dense model: its checkpoint brings x back
        self._partitioned = load_partitioned(start, self.ds, cfg.gradient_checkpointing, cfg.random_init and self.start is None)
        model = self._partitioned.model
        if self.start is not None and self.start.name == str(warm_start_weights_dir(self.opts.output_dir)):
            torch.distributed.barrier()  # every rank has read it
            if self.rank == 0:
                shutil.rmtree(self.start.name)  # partitioned now; a resumed run restores x from its checkpoint
        if cfg.freeze_embeddings:
            freeze_embeddings(model)
        pruned = select_targets(model, cfg.targets)
        self.goals = cfg.layer_goals(full_shapes(model, pruned))
        self.job = build_admm_engine(model, cfg, self.ds, pruned, self.goals, self.init_masks)
        n_pruned = sum(sl.numel for sg in self.job.layout for sl in sg.slices if sl.start == 0)
        goal = cfg.pattern if cfg.nm else f"{cfg.sparsity:.0%}" + (f" (profile {cfg.sparsity_profile})" if cfg.sparsity_profile else "")
        self.say(f"[elsa_ds] pruning {len(pruned)} layers ({n_pruned:,} weights) to {goal} with ELSA "
                 f"(projection {cfg.projection.value}, λ {cfg.lmda} {cfg.lmda_schedule.value}, interval {cfg.interval}, {cfg.steps} steps"
                 f"{', z warm-started from ' + cfg.init_mask if self.init_masks else ''}"
                 f"{', x too (its pruned weights)' if self.start is not None else ''})")

    # ---- load_checkpoint ----------------------------------------------------------------------------------------
    def load_checkpoint(self) -> None:
        """Continue from the latest loadable checkpoint (--resume), or start fresh. Collective."""
        if self.opts.overwrite and self.rank == 0 and self.ckpt_dir.exists():
            shutil.rmtree(self.ckpt_dir)  # a fresh run never mixes its checkpoints with an older run's
        fingerprint = self.cfg.resume_fingerprint(self.world)
        self.state = RunState(fingerprint=fingerprint)
        if not self.opts.resume:
            if self.rank == 0:
                if self.selector is not None:
                    self.selector.clean()  # a crashed run's snapshots
                # a crashed warm start's x₀ copy (this run's own was deleted once partitioned): nothing reads it now
                shutil.rmtree(warm_start_weights_dir(self.opts.output_dir), ignore_errors=True)
            self._measure_references()
            return
        client = checkpoint.load_latest(self.job.engine, self.ckpt_dir, self.say, self.job.comm)
        if client is None:
            raise ElsaError(f"--resume: no loadable checkpoint in {self.ckpt_dir}; run without --resume to start over")
        written = {**RESUME_DEFAULTS, **client["fingerprint"]}  # a setting added since that checkpoint: as it was then
        changed = {k: (v, fingerprint.get(k)) for k, v in written.items() if fingerprint.get(k) != v}
        if changed:
            raise ElsaError("--resume with changed settings is not supported (checkpoint vs now): "
                            + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in changed.items()))
        checkpoint.set_rng_state(client.pop("rng"))
        self.state = RunState(**client)
        if self.selector is not None:
            self.selector.record = self.state.selection or self.selector.record
        self.say(f"[elsa_ds] continuing at step {self.state.next_step} of {self.cfg.steps}")

    def _measure_references(self) -> None:
        """Validation perplexity of the dense model and of one-shot magnitude pruning, on the same windows -- or, when x
        starts pruned (--init_weights), of that start (the dense model was measured on rank 0 before pruning). Collective."""
        if self.start is not None:
            self.state.dense_ppl = self.validation.perplexity(*self.dense_nll) if self.dense_nll else None
            if self.selector is not None and self.validation.count:  # the start is a candidate for the export: step 0
                self.state.baseline_ppl = self.selector.score(self.job, self.validation, self.ds["train_micro_batch_size_per_gpu"],
                                                              0, project=False)
                self.state.selection = self.selector.record
            else:
                self.state.baseline_ppl = self.validation_ppl()
            self.say(f"[elsa_ds] validation ppl: dense {self.state.dense_ppl}, the warm start ({self.cfg.init_mask}) "
                     f"{self.state.baseline_ppl}")
            return
        self.state.dense_ppl = self.validation_ppl()
        if self.cfg.baseline == "magnitude" and self.validation.count and self.ds_config.uses_nvme:
            self.say("[elsa_ds] one-shot magnitude baseline skipped: it edits resident partitions, which NVMe offload swaps out")
        elif self.cfg.baseline == "magnitude" and self.validation.count:
            with magnitude_pruned(self.job, self.cfg.nm):
                self.state.baseline_ppl = self.validation_ppl()
        self.say(f"[elsa_ds] validation ppl: dense {self.state.dense_ppl}, one-shot magnitude {self.state.baseline_ppl}")

    def validation_ppl(self) -> float | None:
        """Perplexity of the engine's current weights on the validation windows (None without windows). Collective."""
        if self.validation.count == 0:
            return None
        return self.validation.perplexity(*distributed_nll(self.job, self.validation.ids, self.ds["train_micro_batch_size_per_gpu"]))

    # ---- train ----------------------------------------------------------------------------------------------------
    def train(self) -> None:
        """The ADMM loop from ``state.next_step``: one engine step per global batch; z, u update inside the step."""
        from tqdm import tqdm

        cfg, state = self.cfg, self.state
        self._resume_loop()
        bar = tqdm(range(state.next_step, cfg.steps), desc=cfg.method.value, unit="step", disable=self.rank != 0,
                   dynamic_ncols=True, initial=state.next_step, total=cfg.steps)
        for step in bar:
            t0 = time.perf_counter()
            loss = self.train_step(step)
            state.step_times.append(time.perf_counter() - t0)
            if not math.isfinite(loss):
                raise ElsaError(f"the loss became {loss} at step {step}; the run stopped there (the last checkpoint, if any, "
                                f"is intact; resume with a lower --lr or --lmda)")
            state.losses.append(loss)
            state.next_step = step + 1
            if self._after_step(bar, step, loss):
                break
            if cfg.save_interval and (step + 1) % cfg.save_interval == 0 and step + 1 < cfg.steps:
                self.save_checkpoint()

    def train_step(self, step: int) -> float:
        """One global batch: λ and the projection flags for this step, then the engine step. Returns the global mean loss."""
        cfg, job = self.cfg, self.job
        job.admm.begin_step(step)
        self.phases.mark(step_phase(step, job.admm.projected_this_step, step == cfg.steps - 1), step)
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        return steps.train_step(job.engine, job.admm, job.comm, self.batches.micro_batches(step), lr)

    def _resume_loop(self) -> None:
        self.job.admm.lam = self.state.lam

    def _after_step(self, bar, step: int, loss: float) -> bool:
        """Log the step and a projection's metrics; score Π(x) when the selection is due. True: stop early."""
        admm, lr = self.job.admm, self.job.admm.param_groups[0]["lr"]
        self.state.lam = admm.lam
        if step % self.cfg.log_interval == 0:
            bar.set_postfix(loss=f"{loss:.4f}", lmda=f"{admm.lam:.3g}", lr=f"{lr:.2e}")
        self.monitor.write(step + 1, {"loss": loss, "lambda": admm.lam, "lr": lr, "step_time_s": self.state.step_times[-1]})
        if not admm.projected_this_step:
            return False
        sums = self.job.comm.all_reduce_sum(admm.local_metrics())  # collective
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
        if self.selector is None or self.validation.count == 0 or not self.selector.due(projections):
            return False
        value = self.selector.score(self.job, self.validation, self.ds["train_micro_batch_size_per_gpu"], step + 1)
        self.state.selection = self.selector.record
        if self.rank == 0:
            best = self.selector.record["best"]
            bar.write(f"[selection] step {step + 1}: validation ppl of Π(x) {value:.3f} (best {best['ppl']:.3f} at step {best['step']})")
        if self.selector.stop:
            self.selector.record["stopped_at"] = step + 1
            self.say(f"[elsa_ds] stopping early at step {step + 1}: {self.selector.patience} scored projections without improvement")
            return True
        return False

    def save_checkpoint(self) -> None:
        """A DeepSpeed checkpoint with the ADMM state, published as ``latest`` once every rank wrote it. Collective."""
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        st = self.state
        tag = checkpoint.save(self.job.engine, self.ckpt_dir, st.next_step - 1, {**asdict(st), "rng": checkpoint.rng_state()},
                              self.cfg.keep_checkpoints, self.rank)
        self.say(f"[elsa_ds] checkpoint {self.ckpt_dir / tag}")

    # ---- finish -----------------------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any] | None:
        """Validation of the pruned model, the export, the report; then rank 0 evaluates the saved model alone."""
        cfg, opts = self.cfg, self.opts
        self.phases.mark("validation")
        stopped = self.selector is not None and self.selector.record["stopped_at"] is not None
        pruned_ppl = None if stopped else self.validation_ppl()
        if self.selector is not None and self.validation.count:
            pruned_ppl = self.selector.choose(self.job, pruned_ppl, self.state.next_step)  # collective
            self.state.selection = self.selector.record
        staging = staging_dir(opts.output_dir)
        if self.rank == 0:
            fresh_staging(opts.output_dir)
            if self.init_masks is not None and self.init_masks.source == warm_start_path(opts.output_dir):
                self.init_masks.source.unlink()  # read at the first step; a resumed run restores z from its checkpoint
        self.phases.mark("export")
        export_model(self.job.engine.module, self.tokenizer, staging, self.rank)  # collective
        result = None
        if self.rank == 0:
            self.phases.mark("verify")
            result = report.elsa_report(self, staging, pruned_ppl)
            report.write(staging / REPORT_NAME, result)
            publish(staging, opts.output_dir, keep_checkpoints=bool(opts.resume or cfg.save_interval))
            report.print_summary(self.say, result, opts.output_dir)
            self.phases.mark("done")
        torch.distributed.barrier()  # the last collective: the other ranks may leave now, rank 0 evaluates alone
        if self.selector is not None and self.rank == 0:
            self.selector.clean()
        if self.rank == 0 and (cfg.eval_ppl or cfg.eval_tasks):
            self.job = self._partitioned = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            report.evaluate_saved_model(opts.output_dir, cfg)
        return result

    def cleanup(self) -> None:
        """Drop the engine and the model; the process group lives until the process exits (``zero/dist.py``)."""
        self.job = self._partitioned = None
        gc.collect()
