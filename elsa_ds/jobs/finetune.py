"""Retraining jobs: a one-shot mask retrained with the mask held fixed, or the dense model trained the same way.

    setup -> (rank 0: one-shot masks and pruned weights, others wait) -> load into ZeRO-3 -> load_checkpoint
          -> train (ELSA's loop, data, batch and lr schedule; checkpoints) -> finish (export, report) -> cleanup

--finetune full trains every weight through MaskedOptimizer (pruned entries exactly zero); --finetune lora trains
peft adapters on the pruned layers and merges them at the export, the mask re-applied. --method dense is the
control: the same training without pruning. The data, loop, checkpoints and validation are the components ELSA's job
uses too (``training.py``).
"""
from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from elsa_ds.admm.projection import keep_count
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.config import ElsaConfig
from elsa_ds.options import JobOptions
from elsa_ds.jobs import checks, report
from elsa_ds.jobs.defaults_applied import apply_defaults
from elsa_ds.jobs.interface import Printer
from elsa_ds.jobs.phases import PhaseLog
from elsa_ds.jobs.training import (Checkpoints, RunState, TrainingData, launched_world_size, load_data, start_process_group,
                                   train_loop, windows_ppl)
from elsa_ds.jobs.warm_start import oneshot_on_rank0
from elsa_ds.mask_file import MaskReader
from elsa_ds.methods import Finetune
from elsa_ds.models import ModelSource
from elsa_ds.monitor import Monitor
from elsa_ds.output import fresh_staging, staging_dir
from elsa_ds.targets import LayerGoal, goal_ratio, select_targets
from elsa_ds.zero import checkpoint, steps
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import PartitionedModel, ZeroEngine, full_shapes, load_partitioned
from elsa_ds.zero.export import export_consolidated, export_model
from elsa_ds.zero.finetune_engine import build_lora_engine, build_masked_engine


def oneshot_paths(output_dir: Path) -> tuple[Path, Path]:
    """(mask file, pruned model directory) of the one-shot pass, beside the output until the job publishes (a resumed
    run reuses them: LoRA's frozen base weights are not in ZeRO-3's checkpoints)."""
    base = staging_dir(output_dir).with_name(f".{output_dir.name}.oneshot")
    return base.with_suffix(".mask.safetensors"), base


class FinetuneJob:
    """``cfg.method``'s mask (or none: dense) retrained with ``cfg.finetune`` for ``finetune_steps`` steps."""

    def __init__(self, cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig):
        # the loop runs cfg.steps: the fine-tuning's own count (setup applies the defaults rule to the rest)
        self.cfg: ElsaConfig = cfg.model_copy(update={"steps": cfg.finetune_steps or cfg.steps})
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
        self.masks: MaskReader | None = None  # set by setup: the one-shot keep-masks (None: the dense control)
        self.calibration: dict[str, Any] | None = None  # set by setup: the one-shot pass's calibration data (rank 0)
        self.partitioned: PartitionedModel | None = None  # set by setup: the model in ZeRO-3 partitions
        self.goals: dict[str, LayerGoal] = {}  # set by setup: each pruned layer's sparsity or N:M goal
        self.zero: ZeroEngine | None = None  # set by setup: the DeepSpeed engine, the slice layout, the comm
        self.optimizer: torch.optim.Optimizer | None = None  # set by setup: ZeRO-3's basic optimizer (lr lives here)
        self.monitor: Monitor | None = None  # set by setup

    # ---- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """The checks, the process group and the data as ELSA's job has them; then the one-shot pass (rank 0) and the
        engine that retrains its result."""
        resumed = checkpoint.resumed_fingerprint(self.opts.output_dir, self.opts.resume)
        self.cfg, self.defaults = apply_defaults(self.cfg, self.source.config(), resumed)
        cfg = self.cfg
        self.phases.mark("load")
        self.ds = checks.before_work(cfg, self.opts, self.ds_config, launched_world_size(), self.source)
        self.rank, self.world, self.say = start_process_group(cfg, self.opts, self.ds, self.defaults)
        self.data = load_data(cfg, self.source, self.ds, self.rank, self.world, self.say)
        torch.manual_seed(cfg.seed)
        start, self.masks, self.calibration = self._oneshot_start()
        self.partitioned, self.goals, self.zero, self.optimizer = self._build_engine(start)
        self.monitor = Monitor(self.zero.engine, self.rank)

    def _oneshot_start(self) -> tuple[ModelSource | None, MaskReader | None, dict[str, Any] | None]:
        """The pruned model to retrain, its masks and calibration record (rank 0); all None for the dense control. A
        resumed run reuses the one-shot pass it left beside the output. Collective."""
        cfg = self.cfg
        if cfg.oneshot is None:
            return None, None, None
        mask_path, model_dir = oneshot_paths(self.opts.output_dir)
        calibration = None
        if self.opts.resume and mask_path.is_file() and (model_dir / "config.json").is_file():
            masks = MaskReader(mask_path)
        else:
            masks, calibration, _ = oneshot_on_rank0(cfg, cfg.oneshot, self.source, self.data.tokenizer, self.rank, self.say,
                                                     mask_path, model_dir)
        return ModelSource(str(model_dir)), masks, calibration

    def _build_engine(self, start: ModelSource | None,
                      ) -> tuple[PartitionedModel, dict[str, LayerGoal], ZeroEngine, torch.optim.Optimizer]:
        cfg = self.cfg
        random_init = cfg.random_init and start is None
        partitioned = load_partitioned(start or self.source, self.ds, cfg.gradient_checkpointing, random_init)
        model = partitioned.model
        pruned = select_targets(model, cfg.targets)
        goals = cfg.layer_goals(full_shapes(model, pruned))
        if cfg.finetune is Finetune.lora:
            zero, optimizer = build_lora_engine(model, cfg, self.ds, pruned)
        else:
            zero, optimizer = build_masked_engine(model, cfg, self.ds, pruned, goals, self.masks)
        what = (f"one-shot {cfg.method.value} mask ({len(pruned)} layers to {cfg.pattern if cfg.nm else f'{cfg.sparsity:.0%}'})"
                if self.masks is not None else "dense model (no pruning)")
        lora = f", rank {cfg.lora_rank}, α {cfg.lora_alpha:g}" if cfg.finetune is Finetune.lora else ""
        self.say(f"[elsa_ds] fine-tuning ({cfg.finetune.value}{lora}) the {what}: {cfg.steps} steps, lr {cfg.lr:.3g}")
        return partitioned, goals, zero, optimizer

    # ---- load_checkpoint ----------------------------------------------------------------------------------------
    def load_checkpoint(self) -> None:
        """Continue from the latest loadable checkpoint (--resume), or measure the model before training. Collective."""
        fingerprint = self.cfg.resume_fingerprint(self.world)
        self.state = self.checkpoints.load(self.zero.engine, self.zero.comm, fingerprint, self.rank, self.say)
        if self.opts.resume:
            self.say(f"[elsa_ds] continuing at step {self.state.next_step} of {self.cfg.steps}")
            return
        self.state.baseline_ppl = self.validation_ppl()
        self.say(f"[elsa_ds] validation ppl before fine-tuning: {self.state.baseline_ppl}")

    def validation_ppl(self) -> float | None:
        """Perplexity of the engine's current weights on the validation windows (None without windows). Collective."""
        return windows_ppl(self.zero, self.data.validation, self.ds.micro_batch_size)

    # ---- train ----------------------------------------------------------------------------------------------------
    def train(self) -> None:
        """The loop from ``state.next_step`` (nothing of it lives outside the engine and ``state``)."""
        train_loop(self.cfg, self.state, self.rank, self.train_step, self._after_step, self.save_checkpoint)

    def train_step(self, step: int) -> float:
        """One global batch at this step's learning rate. Returns the global mean loss."""
        cfg = self.cfg
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        return steps.train_step(self.zero.engine, self.optimizer, self.zero.comm, self.data.batches.micro_batches(step), lr)

    def _after_step(self, bar, step: int, loss: float) -> bool:
        lr = self.optimizer.param_groups[0]["lr"]
        if step % self.cfg.log_interval == 0:
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        self.monitor.write(step + 1, {"loss": loss, "lr": lr, "step_time_s": self.state.step_times[-1]})
        return False

    def save_checkpoint(self) -> None:
        """A DeepSpeed checkpoint (weights, optimizer and mask state, the loop's state), published as ``latest``. Collective."""
        self.checkpoints.save(self.zero.engine, self.state, self.rank, self.say)

    # ---- finish -----------------------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any] | None:
        """Validation, the export (LoRA merged, mask re-applied), the report verified from the files."""
        cfg, opts = self.cfg, self.opts
        tuned_ppl = self.validation_ppl()
        staging = staging_dir(opts.output_dir)
        if self.rank == 0:
            fresh_staging(opts.output_dir)
        if cfg.finetune is Finetune.lora:
            export_consolidated(self.zero, self.data.tokenizer, staging, transform=self._merge)  # collective
        else:
            export_model(self.zero.engine.module, self.data.tokenizer, staging, self.rank)  # collective
        result = None
        if self.rank == 0:
            result = report.finetune_report(self._record(tuned_ppl), staging)
            report.publish_report(result, staging, opts, bool(opts.resume or cfg.save_interval), self.say)
        torch.distributed.barrier()  # the last collective: the other ranks may leave now, rank 0 evaluates alone
        if self.rank == 0:
            mask_path, model_dir = oneshot_paths(opts.output_dir)
            mask_path.unlink(missing_ok=True)
            shutil.rmtree(model_dir, ignore_errors=True)
            if cfg.eval_ppl or cfg.eval_tasks:
                self._drop_engine()
                report.evaluate_saved_model(opts.output_dir, cfg)
        return result

    def _record(self, tuned_ppl: float | None) -> report.ReportRecord:
        """What the report says: the run's measurements and the zeros each masked layer must hold (rank 0)."""
        masks, st = self.masks, self.state
        expected = ({name: numel - keep_count(numel, goal_ratio(self.goals[name]))
                     for name, numel in ((n, masks.numel(n)) for n in self.goals)} if masks is not None else {})
        return report.ReportRecord(
            cfg=self.cfg, method=self.cfg.method.value, deepspeed=self.opts.deepspeed, world=self.world, started=self.started,
            validation=self.data.validation.describe(), goals=self.goals, expected_zeros=expected, final_ppl=tuned_ppl,
            baseline_ppl=st.baseline_ppl, losses=st.losses, step_times=st.step_times, defaults=self.defaults,
            global_batch=self.ds.train_batch_size, calibration=self.calibration)

    def _merge(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's consolidated peft state dict -> the plain model's, adapters merged, the one-shot mask re-applied."""
        from elsa_ds.finetune.lora import merge_adapters

        masks = self.masks

        def keep(name: str) -> torch.Tensor | None:
            return None if masks is None else masks.read(name, 0, masks.numel(name))

        return merge_adapters(state_dict, self.cfg.lora_alpha / self.cfg.lora_rank, keep)

    def _drop_engine(self) -> None:
        self.zero = self.optimizer = self.partitioned = None

    def cleanup(self) -> None:
        """Drop the engine and the model; the process group lives until the process exits (``zero/dist.py``)."""
        self._drop_engine()
        gc.collect()
