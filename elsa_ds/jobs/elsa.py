"""The ELSA job: ADMM on the model's own loss under ZeRO-3, z and u updated inside the optimizer step.

    plan -> setup (process group, data, warm start, engine) -> load_checkpoint (resume, or measure dense + one-shot
         baseline) -> train (checkpoints) -> finish (validation, export, report) -> evaluate (the saved model) -> cleanup

Every rank runs this; only rank 0 prints and writes. Collectives are marked where they happen.
"""
from __future__ import annotations

import gc
import shutil
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from elsa_ds import launch_env
from elsa_ds.admm.optimizer import AdmmOptimizer, summarize_metrics
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.files.output import fresh_staging, staging_dir
from elsa_ds.jobs import report
from elsa_ds.jobs.phases import PhaseLog, step_phase
from elsa_ds.jobs.selection import Selector, snapshot_dir
from elsa_ds.jobs.training import (Checkpoints, RunState, TrainingData, load_for_training, open_training, train_loop,
                                   windows_ppl)
from elsa_ds.jobs.warm_start import WarmStart, warm_start, warm_start_path, warm_start_weights_dir
from elsa_ds.log import get_logger
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.pipeline import saved_dtype
from elsa_ds.monitor import Monitor
from elsa_ds.plan import Plan
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.options import JobOptions
from elsa_ds.targets import LayerGoal, goal_text
from elsa_ds.zero import steps
from elsa_ds.zero.dist import agreed
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import PartitionedModel, ZeroEngine, build_admm_engine
from elsa_ds.zero.export import export_model
from elsa_ds.zero.partitions import magnitude_pruned

log = get_logger(__name__)


@dataclass(frozen=True)
class ElsaRun:
    """What :meth:`ElsaJob.setup` builds, from the process group on; the later stages take it."""

    rank: int
    world: int
    data: TrainingData
    warm: WarmStart | None            # --init_mask's z₀ masks (and x₀) on a fresh run; None without a warm start
    partitioned: PartitionedModel     # the model in ZeRO-3 partitions
    goals: dict[str, LayerGoal]       # each pruned layer's sparsity or N:M goal
    zero: ZeroEngine                  # the DeepSpeed engine, the slice layout, the comm
    admm: AdmmOptimizer               # ZeRO-3's basic optimizer, z and u in its state
    monitor: Monitor
    selector: Selector | None         # with --select_every


class ElsaJob:
    """Prune ``plan.cfg.model`` with ELSA under ZeRO-3 (see the module docstring for the lifecycle)."""

    def __init__(self, plan: Plan):
        self.plan: Plan = plan
        self.cfg: ElsaConfig = plan.cfg
        self.opts: JobOptions = plan.opts
        self.ds: DsConfig = plan.ds  # the engine's DeepSpeed config
        self.source: ModelSource = plan.source
        self.started: float = time.time()
        self.first_step: int = 0  # the step this attempt began at (--resume: the checkpoint's)
        self.phases: PhaseLog = PhaseLog(launch_env.rank())
        self.checkpoints: Checkpoints = Checkpoints(plan.opts, plan.cfg.keep_checkpoints)
        self.state: RunState = RunState()  # set by the checkpoint loader: fresh, or the checkpoint's

    # ---- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> ElsaRun:
        """The process group and the data, the warm-start masks (rank 0, the others wait) and the engine. Collective."""
        cfg, opts = self.cfg, self.opts
        self.phases.mark("load")
        opened = open_training(self.plan)
        warm = (warm_start(cfg, self.source, opts.output_dir, opened.data.tokenizer, opened.rank, opened.data.validation.ids,
                           saved_dtype(self.ds.raw)) if cfg.init_mask and not opts.resume else None)
        torch.manual_seed(cfg.seed)
        partitioned, goals, zero, admm = self._build_engine(warm, opened.rank)
        selector = Selector(cfg.select_every, cfg.select_patience, snapshot_dir(opts.output_dir), opened.rank) if cfg.select_every else None
        return ElsaRun(opened.rank, opened.world, opened.data, warm, partitioned, goals, zero, admm, Monitor(zero.engine, opened.rank),
                       selector)

    def _build_engine(self, warm: WarmStart | None, rank: int,
                      ) -> tuple[PartitionedModel, dict[str, LayerGoal], ZeroEngine, AdmmOptimizer]:
        cfg = self.cfg
        masks, start = (warm.masks, warm.start) if warm else (None, None)
        # a resumed run loads the dense model: its checkpoint brings x back
        partitioned, pruned, goals = load_for_training(cfg, self.ds, self.source, start)
        if start is not None and start.name == str(warm_start_weights_dir(self.opts.output_dir)):
            torch.distributed.barrier()  # every rank has read it
            if rank == 0:
                shutil.rmtree(start.name)  # partitioned now; a resumed run restores x from its checkpoint
        zero, admm = build_admm_engine(partitioned.model, cfg, self.ds, pruned, goals, masks)
        n_pruned = sum(sl.numel for sg in zero.layout for sl in sg.slices if sl.start == 0)
        goal = goal_text(cfg.sparsity, cfg.pattern if cfg.nm else None, cfg.sparsity_profile)
        log.info(f"pruning {len(pruned)} layers ({n_pruned:,} weights) to {goal} with ELSA "
                 f"(projection {cfg.projection.value}, λ {cfg.lmda} {cfg.lmda_schedule.value}, interval {cfg.interval}, "
                 f"{cfg.steps} steps{f', z warm-started from {cfg.init_mask}' if masks else ''}"
                 f"{', x too (its pruned weights)' if start is not None else ''})")
        return partitioned, goals, zero, admm

    # ---- load_checkpoint ----------------------------------------------------------------------------------------
    def load_checkpoint(self, run: ElsaRun) -> None:
        """Continue from the latest loadable checkpoint (--resume), or start fresh. Collective."""
        fingerprint = self.cfg.resume_fingerprint(run.world)
        self.state = self.checkpoints.load(run.zero.engine, run.zero.comm, fingerprint)
        self.first_step = self.state.next_step
        if self.opts.resume:
            if run.selector is not None:
                run.selector.resumed(self.state.selection)
            log.info(f"continuing at step {self.state.next_step} of {self.cfg.steps}")
            return
        if run.rank == 0:
            if run.selector is not None:
                run.selector.clean()  # a crashed run's snapshots
            # a crashed warm start's x₀ copy (this run's own was deleted once partitioned): nothing reads it now
            shutil.rmtree(warm_start_weights_dir(self.opts.output_dir), ignore_errors=True)
        self._measure_references(run)

    def _measure_references(self, run: ElsaRun) -> None:
        """Validation perplexity of the dense model and of one-shot magnitude pruning, on the same windows -- or, when x
        starts pruned (--init_weights), of that start (the dense model was measured on rank 0 before pruning). Collective."""
        state, validation, warm, selector = self.state, run.data.validation, run.warm, run.selector
        if warm is not None and warm.start is not None:
            state.dense_ppl = validation.perplexity(*warm.dense_nll) if warm.dense_nll else None
            state.computed_in = {"dense": report.on_host(), "warm_start": report.on_engine(self.ds)}
            # the start is a candidate for the export (step 0) only where its zeros are the goals' (a thirteenth audit: a
            # folder's 50 % start was restored into a 70 % job's export, which then failed its check after the whole run)
            if selector is not None and validation.count and warm.at_goals:
                state.baseline_ppl = selector.score(run.zero, run.admm, validation, self.ds.micro_batch_size, 0, project=False)
                state.selection = selector.record
            else:
                if selector is not None and validation.count and run.rank == 0:
                    log.info("--select_every: the pruned start is scored, not a candidate for the export (its zeros are not "
                             "exactly the goals': a folder's, or a model already sparser than a goal)")
                state.baseline_ppl = self.validation_ppl(run)
            _log_references(state.dense_ppl, f"the warm start ({self.cfg.init_mask})", state.baseline_ppl)
            return
        state.dense_ppl = self.validation_ppl(run)
        state.computed_in = dict.fromkeys(("dense", "magnitude_oneshot"), report.on_engine(self.ds))
        if self.cfg.baseline == "magnitude" and validation.count and self.ds.uses_nvme:
            log.info("one-shot magnitude baseline skipped: it edits resident partitions, which NVMe offload swaps out")
        elif self.cfg.baseline == "magnitude" and validation.count:
            with magnitude_pruned(run.zero, self.cfg.nm):
                state.baseline_ppl = self.validation_ppl(run)
        _log_references(state.dense_ppl, "one-shot magnitude", state.baseline_ppl)

    def validation_ppl(self, run: ElsaRun) -> float | None:
        """Perplexity of the engine's current weights on the validation windows (None without windows). Collective."""
        return windows_ppl(run.zero, run.data.validation, self.ds.micro_batch_size)

    # ---- train ----------------------------------------------------------------------------------------------------
    def train(self, run: ElsaRun) -> None:
        """The ADMM loop from ``state.next_step``: one engine step per global batch; z, u update inside the step."""
        run.admm.lam = self.state.lam
        train_loop(self.cfg, self.state, run.rank, partial(self.train_step, run), partial(self._after_step, run),
                   partial(self.save_checkpoint, run))

    def train_step(self, run: ElsaRun, step: int) -> float:
        """One global batch: λ and the projection flags for this step, then the engine step. Returns the global mean loss."""
        cfg, admm = self.cfg, run.admm
        admm.begin_step(step)
        self.phases.mark(step_phase(step, admm.projected_this_step, step == cfg.steps - 1), step)
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        return steps.train_step(run.zero.engine, admm, run.zero.comm, run.data.batches.micro_batches(step), lr)

    def _after_step(self, run: ElsaRun, bar, step: int, loss: float) -> bool:
        """Log the step and a projection's metrics; score Π(x) when the selection is due. True: stop early."""
        admm, lr = run.admm, run.admm.param_groups[0]["lr"]
        self.state.lam = admm.lam
        if step % self.cfg.log_interval == 0:
            bar.set_postfix(loss=f"{loss:.4f}", lmda=f"{admm.lambda_now():.3g}", lr=f"{lr:.2e}")
        run.monitor.write(step + 1, {"loss": loss, "lambda": admm.lambda_now(), "lr": lr, "step_time_s": self.state.step_times[-1]})
        if not admm.projected_this_step:
            return False
        sums = run.zero.comm.all_reduce_sum(admm.local_metrics())  # collective
        spread = admm.lambda_range()  # the adaptive schedule: λ per layer, logged as their mean and range
        entry: dict = {"step": step + 1, "loss": loss, **summarize_metrics(sums, admm.lambda_now()), "final": admm.finalized_this_step,
                       **({"lambda_range": list(spread)} if spread is not None else {})}
        self.state.history.append(entry)
        if entry["final"]:
            return False
        run.monitor.write(step + 1, {k: entry[k] for k in ("residual", "mask_flip_frac", "admm_state_bytes_per_param")})
        if run.rank == 0:
            by_layer = f" ({spread[0]:.3g}-{spread[1]:.3g} by layer)" if spread is not None else ""
            bar.write(f"[projection] step {step + 1}: loss {loss:.4f}  λ {entry['lambda']:.4g}{by_layer}  "
                      f"residual ‖x−z‖/‖x‖ {entry['residual']:.4f}  mask flips {entry['mask_flip_frac']:.4%}")
        return self._select(run, bar, step, sum(1 for h in self.state.history if not h["final"]))

    def _select(self, run: ElsaRun, bar, step: int, projections: int) -> bool:
        """Score Π(x) on the validation windows when due (collective); True once the patience ran out."""
        validation, selector = run.data.validation, run.selector
        if selector is None or validation.count == 0 or not selector.due(projections):
            return False
        value = selector.score(run.zero, run.admm, validation, self.ds.micro_batch_size, step + 1)
        self.state.selection = selector.record
        if run.rank == 0:
            best = selector.record["best"]
            bar.write(f"[selection] step {step + 1}: validation ppl of Π(x) {value:.3f} "
                      f"(best {best['ppl']:.3f} at step {best['step']})")
        if selector.stop:
            selector.record["stopped_at"] = step + 1
            log.info(f"stopping early at step {step + 1}: {selector.patience} scored projections without improvement")
            return True
        return False

    def save_checkpoint(self, run: ElsaRun) -> None:
        """A DeepSpeed checkpoint with the ADMM state, published as ``latest`` once every rank wrote it. Collective."""
        self.checkpoints.save(run.zero.engine, self.state, run.rank)

    # ---- finish -----------------------------------------------------------------------------------------------------
    def finish(self, run: ElsaRun) -> dict[str, Any] | None:
        """Validation of the pruned model, the export, the report (rank 0 returns it). Collective."""
        cfg, opts = self.cfg, self.opts
        self.phases.mark("validation")
        pruned_ppl = self._exported_ppl(run)
        staging = staging_dir(opts.output_dir)
        with agreed(f"the output {opts.output_dir}"):
            if run.rank == 0:
                fresh_staging(opts.output_dir, opts.overwrite)
                masks = run.warm.masks if run.warm is not None else None
                if masks is not None and masks.source == warm_start_path(opts.output_dir):
                    masks.source.unlink()  # read at the first step; a resumed run restores z from its checkpoint
        self.phases.mark("export")
        export_model(run.zero.engine.module, run.data.tokenizer, staging, run.rank)  # collective
        result = None
        with agreed(f"the output {opts.output_dir}"):  # the last collective: the other ranks may leave, rank 0 evaluates
            if run.rank == 0:
                self.phases.mark("verify")
                result = report.elsa_report(self._record(run, pruned_ppl), staging)
                report.publish_report(result, staging, opts, bool(opts.resume or cfg.save_interval), self.phases.mark)
                self.phases.mark("done")
        if run.selector is not None and run.rank == 0:
            run.selector.clean()
        return result

    def _exported_ppl(self, run: ElsaRun) -> float | None:
        """Validation perplexity of the model the export will hold: the final projection, or the selection's best
        snapshot written back into the shards when it was better (--select_every). Collective."""
        selector = run.selector
        stopped = selector is not None and selector.record["stopped_at"] is not None
        pruned_ppl = None if stopped else self.validation_ppl(run)
        if selector is not None and run.data.validation.count:
            pruned_ppl = selector.choose(run.zero, pruned_ppl, self.state.next_step)  # collective
            self.state.selection = selector.record
        return pruned_ppl

    def _record(self, run: ElsaRun, pruned_ppl: float | None) -> report.ReportRecord:
        """What the report says: this run's measurements and the layout's summary (rank 0)."""
        st = self.state
        return report.ReportRecord(
            cfg=self.cfg, method="elsa", deepspeed=self.opts.deepspeed, world=run.world, started=self.started,
            resumed_at=self.first_step if self.opts.resume else None,
            validation=run.data.validation.describe(), goals=run.goals,
            expected_zeros={sl.layer: sl.numel - sl.keep for sg in run.zero.layout for sl in sg.slices},
            final_ppl=pruned_ppl, dense_ppl=st.dense_ppl, baseline_ppl=st.baseline_ppl, losses=st.losses,
            step_times=st.step_times, history=st.history, selection=st.selection, defaults=self.plan.defaults,
            global_batch=self.ds.train_batch_size, offload=report.offload(self.ds), training_data=run.data.sampling,
            kernels=run.admm.kernel_report(), deepspeed_resolved=self.ds.raw,
            computed_in={**st.computed_in, "pruned": report.on_engine(self.ds)})  # the references' as measured (a resume)

    # ---- evaluate, cleanup ------------------------------------------------------------------------------------------
    def evaluate(self, result: dict[str, Any] | None) -> None:
        """Rank 0 (the one holding the report) evaluates the saved model alone, the engine gone (--eval_ppl, --eval_tasks)."""
        if result is None or not (self.cfg.eval_ppl or self.cfg.eval_tasks):
            return
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        report.evaluate_saved_model(self.opts.output_dir, self.cfg)

    def cleanup(self) -> None:
        """Collect what setup built; the process group lives until the process exits (``zero/dist.py``)."""
        gc.collect()


def _log_references(dense: float | None, name: str, baseline: float | None) -> None:
    """The reference perplexities measured (none without validation windows or a baseline), three decimals."""
    found = [f"{what} {ppl:.3f}" for what, ppl in (("dense", dense), (name, baseline)) if ppl is not None]
    if found:
        log.info("validation ppl: " + ", ".join(found))
