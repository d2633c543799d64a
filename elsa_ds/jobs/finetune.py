"""Retraining jobs: a one-shot mask retrained with the mask held fixed, or the dense model trained the same way.

    plan -> setup (process group, data; rank 0: one-shot masks and pruned weights, others wait; load into ZeRO-3)
         -> load_checkpoint -> train (ELSA's loop, data, batch and lr schedule; checkpoints) -> finish (export, report)
         -> evaluate (the saved model) -> cleanup

--finetune full trains every weight through MaskedOptimizer (pruned entries exactly zero); --finetune lora trains
peft adapters on the pruned layers and merges them into the engine's weights before the validation, the mask
re-applied, so the validation and the export see the same model. --method dense is the
control: the same training without pruning. The data, loop, checkpoints and validation are the components ELSA's job
uses too (``training.py``).
"""
from __future__ import annotations

import gc
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from elsa_ds import launch_env
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.files.mask_file import MaskReader
from elsa_ds.files.output import fresh_staging, side_path, staging_dir
from elsa_ds.files.weight_files import check_weight_files
from elsa_ds.finetune.lora import plain_state_dict
from elsa_ds.jobs import report
from elsa_ds.jobs.phases import PhaseLog
from elsa_ds.jobs.training import (Checkpoints, Opened, RunState, TrainingData, load_for_training, open_training, train_loop,
                                   windows_ppl)
from elsa_ds.jobs.warm_start import oneshot_on_rank0
from elsa_ds.log import get_logger
from elsa_ds.methods import Finetune
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.pipeline import saved_dtype
from elsa_ds.monitor import Monitor
from elsa_ds.plan import Plan
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.options import JobOptions
from elsa_ds.targets import LayerGoal, goal_text, goal_zeros
from elsa_ds.zero import steps
from elsa_ds.zero.dist import agreed
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import PartitionedModel, ZeroEngine
from elsa_ds.zero.export import export_consolidated, export_model
from elsa_ds.zero.finetune_engine import build_lora_engine, build_masked_engine
from elsa_ds.zero.partitions import merge_adapters_in_place

log = get_logger(__name__)


def oneshot_paths(output_dir: Path) -> tuple[Path, Path]:
    """(mask file, pruned model directory) of the one-shot pass, beside the output until the job publishes (a resumed
    run reuses them: LoRA's frozen base weights are not in ZeRO-3's checkpoints)."""
    base = side_path(output_dir, "oneshot")
    return base.with_suffix(".mask.safetensors"), base


@dataclass(frozen=True)
class Retraining:
    """What :meth:`FinetuneJob.setup` builds, from the process group on; the later stages take it."""

    rank: int
    world: int
    data: TrainingData
    masks: MaskReader | None              # the one-shot keep-masks; None for the dense control
    calibration: dict[str, Any] | None    # the one-shot pass's calibration data (rank 0 of a fresh run; else None)
    partitioned: PartitionedModel         # the model in ZeRO-3 partitions
    goals: dict[str, LayerGoal]           # each pruned layer's sparsity or N:M goal
    zero: ZeroEngine                      # the DeepSpeed engine, the slice layout, the comm
    optimizer: torch.optim.Optimizer      # ZeRO-3's basic optimizer (the lr lives here)
    monitor: Monitor


class FinetuneJob:
    """``cfg.method``'s mask (or none: dense) retrained with ``cfg.finetune`` for ``finetune_steps`` steps."""

    def __init__(self, plan: Plan):
        if plan.cfg.finetune is None:
            raise ValueError("FinetuneJob retrains with --finetune full or lora; the plan names neither (make_job picks the job)")
        self.plan: Plan = plan
        self.finetune: Finetune = plan.cfg.finetune
        self.cfg: ElsaConfig = plan.cfg  # cfg.steps: the retraining's own count (the plan's)
        self.opts: JobOptions = plan.opts
        self.ds: DsConfig = plan.ds  # the engine's DeepSpeed config
        self.source: ModelSource = plan.source
        self.started: float = time.time()
        self.first_step: int = 0  # the step this attempt began at (--resume: the checkpoint's)
        self.phases: PhaseLog = PhaseLog(launch_env.rank())
        self.checkpoints: Checkpoints = Checkpoints(plan.opts, plan.cfg.keep_checkpoints)
        self.state: RunState = RunState()  # set by the checkpoint loader: fresh, or the checkpoint's

    # ---- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> Retraining:
        """The process group and the data as ELSA's job has them; then the one-shot pass (rank 0) and the engine that
        retrains its result. Collective."""
        self.phases.mark("load")
        opened = open_training(self.plan)
        torch.manual_seed(self.cfg.seed)
        start, masks, calibration = self._oneshot_start(opened)
        partitioned, goals, zero, optimizer = self._build_engine(start, masks)
        return Retraining(opened.rank, opened.world, opened.data, masks, calibration, partitioned, goals, zero, optimizer,
                          Monitor(zero.engine, opened.rank))

    def _oneshot_start(self, opened: Opened) -> tuple[ModelSource | None, MaskReader | None, dict[str, Any] | None]:
        """The pruned model to retrain, its masks and calibration record (rank 0); all None for the dense control. A
        resumed run reuses the one-shot pass it left beside the output. Collective."""
        cfg = self.cfg
        if cfg.oneshot is None:
            return None, None, None
        mask_path, model_dir = oneshot_paths(self.opts.output_dir)
        calibration = None
        if self.opts.resume and mask_path.is_file() and (model_dir / "config.json").is_file():
            check_weight_files(model_dir, f"the one-shot model {model_dir} a --resume reads again")  # shards inside it
            masks = MaskReader(mask_path)
        else:
            masks, calibration, _, _ = oneshot_on_rank0(cfg, cfg.oneshot, self.source, opened.data.tokenizer, opened.rank,
                                                     mask_path, model_dir, engine_dtype=saved_dtype(self.ds.raw))
        return ModelSource(str(model_dir)), masks, calibration

    def _build_engine(self, start: ModelSource | None, masks: MaskReader | None,
                      ) -> tuple[PartitionedModel, dict[str, LayerGoal], ZeroEngine, torch.optim.Optimizer]:
        cfg = self.cfg
        partitioned, pruned, goals = load_for_training(cfg, self.ds, self.source, start)
        model = partitioned.model
        if cfg.finetune is Finetune.lora:
            zero, optimizer = build_lora_engine(model, cfg, self.ds, pruned)
        else:
            zero, optimizer = build_masked_engine(model, cfg, self.ds, pruned, goals, masks)
        what = (f"one-shot {cfg.method.value} mask ({len(pruned)} layers to "
                f"{goal_text(cfg.sparsity, cfg.pattern if cfg.nm else None, cfg.sparsity_profile)})"
                if masks is not None else "dense model (no pruning)")
        lora = f", rank {cfg.lora_rank}, α {cfg.lora_alpha:g}" if cfg.finetune is Finetune.lora else ""
        log.info(f"fine-tuning ({self.finetune.value}{lora}) the {what}: {cfg.steps} steps, lr {cfg.lr:.3g}")
        return partitioned, goals, zero, optimizer

    # ---- load_checkpoint ----------------------------------------------------------------------------------------
    def load_checkpoint(self, run: Retraining) -> None:
        """Continue from the latest loadable checkpoint (--resume), or measure the model before training. Collective."""
        fingerprint = self.cfg.resume_fingerprint(run.world)
        self.state = self.checkpoints.load(run.zero.engine, run.zero.comm, fingerprint)
        self.first_step = self.state.next_step
        if self.opts.resume:
            log.info(f"continuing at step {self.state.next_step} of {self.cfg.steps}")
            return
        self.state.baseline_ppl = self.validation_ppl(run)
        self.state.computed_in = {"before_finetune": report.on_engine(self.ds)}
        if self.state.baseline_ppl is not None:
            log.info(f"validation ppl before fine-tuning: {self.state.baseline_ppl:.3f}")

    def validation_ppl(self, run: Retraining) -> float | None:
        """Perplexity of the engine's current weights on the validation windows (None without windows). Collective."""
        return windows_ppl(run.zero, run.data.validation, self.ds.micro_batch_size)

    # ---- train ----------------------------------------------------------------------------------------------------
    def train(self, run: Retraining) -> None:
        """The loop from ``state.next_step`` (nothing of it lives outside the engine and ``state``)."""
        train_loop(self.cfg, self.state, run.rank, partial(self.train_step, run), partial(self._after_step, run),
                   partial(self.save_checkpoint, run))

    def train_step(self, run: Retraining, step: int) -> float:
        """One global batch at this step's learning rate. Returns the global mean loss."""
        cfg = self.cfg
        self.phases.mark("first step" if step == 0 else "step", step)  # ELSA's names (no projection here)
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        return steps.train_step(run.zero.engine, run.optimizer, run.zero.comm, run.data.batches.micro_batches(step), lr)

    def _after_step(self, run: Retraining, bar, step: int, loss: float) -> bool:
        lr = run.optimizer.param_groups[0]["lr"]
        if step % self.cfg.log_interval == 0:
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        run.monitor.write(step + 1, {"loss": loss, "lr": lr, "step_time_s": self.state.step_times[-1]})
        return False

    def save_checkpoint(self, run: Retraining) -> None:
        """A DeepSpeed checkpoint (weights, optimizer and mask state, the loop's state), published as ``latest``. Collective."""
        self.checkpoints.save(run.zero.engine, self.state, run.rank)

    # ---- finish -----------------------------------------------------------------------------------------------------
    def finish(self, run: Retraining) -> dict[str, Any] | None:
        """Validation, the export (LoRA merged, mask re-applied), the report verified from the files. Collective."""
        cfg, opts = self.cfg, self.opts
        self.phases.mark("validation")
        if cfg.finetune is Finetune.lora:  # the validation measures what the export holds: adapters merged, mask kept
            merge_adapters_in_place(run.zero, cfg.lora_alpha / cfg.lora_rank, partial(_keep_mask, run.masks))
        tuned_ppl = self.validation_ppl(run)
        staging = staging_dir(opts.output_dir)
        with agreed(f"the output {opts.output_dir}"):
            if run.rank == 0:
                fresh_staging(opts.output_dir, opts.overwrite)
        self.phases.mark("export")
        result = None
        with agreed(f"the output {opts.output_dir}"):  # the last collective: the other ranks may leave, rank 0 evaluates
            if cfg.finetune is Finetune.lora:  # a gather, then rank 0's writes
                export_consolidated(run.zero, run.data.tokenizer, staging, transform=plain_state_dict)
            else:
                export_model(run.zero.engine.module, run.data.tokenizer, staging, run.rank)  # its ranks agree at its end
            if run.rank == 0:
                self.phases.mark("verify")
                result = report.finetune_report(self._record(run, tuned_ppl), staging)
                report.publish_report(result, staging, opts, bool(opts.resume or cfg.save_interval), self.phases.mark)
                self.phases.mark("done")
        if run.rank == 0:
            mask_path, model_dir = oneshot_paths(opts.output_dir)
            mask_path.unlink(missing_ok=True)
            shutil.rmtree(model_dir, ignore_errors=True)
        return result

    def _record(self, run: Retraining, tuned_ppl: float | None) -> report.ReportRecord:
        """What the report says: the run's measurements and the zeros each masked layer must hold (rank 0)."""
        masks, st = run.masks, self.state
        expected = {name: goal_zeros(masks.numel(name), goal) for name, goal in run.goals.items()} if masks is not None else {}
        return report.ReportRecord(
            cfg=self.cfg, method=self.cfg.method.value, deepspeed=self.opts.deepspeed, world=run.world, started=self.started,
            resumed_at=self.first_step if self.opts.resume else None,
            validation=run.data.validation.describe(), goals=run.goals, expected_zeros=expected, final_ppl=tuned_ppl,
            baseline_ppl=st.baseline_ppl, losses=st.losses, step_times=st.step_times, defaults=self.plan.defaults,
            global_batch=self.ds.train_batch_size, calibration=run.calibration, deepspeed_resolved=self.ds.raw,
            computed_in={**st.computed_in, "pruned": report.on_engine(self.ds)})  # before: as measured (a resume)

    # ---- evaluate, cleanup ------------------------------------------------------------------------------------------
    def evaluate(self, result: dict[str, Any] | None) -> None:
        """Rank 0 (the one holding the report) evaluates the saved model alone, the engine gone (--eval_ppl, --eval_tasks)."""
        if result is not None and (self.cfg.eval_ppl or self.cfg.eval_tasks):
            gc.collect()
            report.evaluate_saved_model(self.opts.output_dir, self.cfg)

    def cleanup(self) -> None:
        """Collect what setup built; the process group lives until the process exits (``zero/dist.py``)."""
        gc.collect()


def _keep_mask(masks: MaskReader | None, name: str) -> torch.Tensor | None:
    """The one-shot keep-mask of the plain weight ``name`` (None: the dense control)."""
    return None if masks is None else masks.read(name, 0, masks.numel(name))
