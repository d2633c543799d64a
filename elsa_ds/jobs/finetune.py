"""Retraining jobs: a one-shot mask retrained with the mask held fixed, or the dense model trained the same way.

    setup -> (rank 0: one-shot masks and pruned weights, others wait) -> load into ZeRO-3 -> load_checkpoint
          -> train (ELSA's loop, data, batch and lr schedule; checkpoints) -> finish (export, report) -> cleanup

--finetune full trains every weight through MaskedOptimizer (pruned entries exactly zero); --finetune lora trains
peft adapters on the pruned layers and merges them at the export, the mask re-applied. --method dense is the
control: the same training without pruning. The loop, checkpoints and validation are ELSA's (``elsa.py``).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from elsa_ds.admm.projection import keep_count
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.config import ElsaConfig, JobOptions
from elsa_ds.jobs import report
from elsa_ds.jobs.elsa import ElsaJob
from elsa_ds.jobs.warm_start import oneshot_on_rank0
from elsa_ds.mask_file import MaskReader
from elsa_ds.methods import Finetune
from elsa_ds.models import ModelSource
from elsa_ds.output import REPORT_NAME, fresh_staging, publish, staging_dir
from elsa_ds.targets import goal_ratio, select_targets
from elsa_ds.zero import steps
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import full_shapes, load_partitioned
from elsa_ds.zero.export import export_consolidated, export_model
from elsa_ds.zero.finetune_engine import build_lora_engine, build_masked_engine


def oneshot_paths(output_dir: Path) -> tuple[Path, Path]:
    """(mask file, pruned model directory) of the one-shot pass, beside the output until the job publishes (a resumed
    run reuses them: LoRA's frozen base weights are not in ZeRO-3's checkpoints)."""
    base = staging_dir(output_dir).with_name(f".{output_dir.name}.oneshot")
    return base.with_suffix(".mask.safetensors"), base


class FinetuneJob(ElsaJob):
    """``cfg.method``'s mask (or none: dense) retrained with ``cfg.finetune`` for ``finetune_steps`` steps."""

    def __init__(self, cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig):
        super().__init__(cfg.model_copy(update={"steps": cfg.finetune_steps or cfg.steps}), opts, ds_config)
        self.masks: MaskReader | None = None
        self.calibration: dict[str, Any] | None = None

    def _setup_engine(self) -> None:
        cfg, opts = self.cfg, self.opts
        source, random_init = self.source, cfg.random_init
        if cfg.oneshot is not None:
            mask_path, model_dir = oneshot_paths(opts.output_dir)
            if opts.resume and mask_path.is_file() and (model_dir / "config.json").is_file():
                self.masks = MaskReader(mask_path)
            else:
                self.masks, self.calibration, _ = oneshot_on_rank0(cfg, cfg.oneshot, source, self.tokenizer, self.rank, self.say,
                                                                mask_path, model_dir)
            source, random_init = ModelSource(str(model_dir)), False
        self._partitioned = load_partitioned(source, self.ds, cfg.gradient_checkpointing, random_init)
        model = self._partitioned.model
        pruned = select_targets(model, cfg.targets)
        self.goals = cfg.layer_goals(full_shapes(model, pruned))
        if cfg.finetune is Finetune.lora:
            self.job, self.optimizer = build_lora_engine(model, cfg, self.ds, pruned)
        else:
            self.job, self.optimizer = build_masked_engine(model, cfg, self.ds, pruned, self.goals, self.masks)
        what = f"one-shot {cfg.method.value} mask ({len(pruned)} layers to {cfg.pattern if cfg.nm else f'{cfg.sparsity:.0%}'})" \
            if self.masks is not None else "dense model (no pruning)"
        lora = f", rank {cfg.lora_rank}, α {cfg.lora_alpha:g}" if cfg.finetune is Finetune.lora else ""
        self.say(f"[elsa_ds] fine-tuning ({cfg.finetune.value}{lora}) the {what}: {cfg.steps} steps, lr {cfg.lr:.3g}")

    def _measure_references(self) -> None:
        """Validation perplexity before the training (the one-shot or the dense model). Collective."""
        self.state.baseline_ppl = self.validation_ppl()
        self.say(f"[elsa_ds] validation ppl before fine-tuning: {self.state.baseline_ppl}")

    def _resume_loop(self) -> None:
        """Nothing of the loop lives outside the engine and ``state``."""

    def train_step(self, step: int) -> float:
        cfg = self.cfg
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        return steps.train_step(self.job.engine, self.optimizer, self.job.comm, self.batches.micro_batches(step), lr)

    def _after_step(self, bar, step: int, loss: float) -> bool:
        lr = self.optimizer.param_groups[0]["lr"]
        if step % self.cfg.log_interval == 0:
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        self.monitor.write(step + 1, {"loss": loss, "lr": lr, "step_time_s": self.state.step_times[-1]})
        return False

    def finish(self) -> dict[str, Any] | None:
        """Validation, the export (LoRA merged, mask re-applied), the report verified from the files."""
        cfg, opts = self.cfg, self.opts
        tuned_ppl = self.validation_ppl()
        staging = staging_dir(opts.output_dir)
        if self.rank == 0:
            fresh_staging(opts.output_dir)
        if cfg.finetune is Finetune.lora:
            export_consolidated(self.job, self.tokenizer, staging, transform=self._merge)  # collective
        else:
            export_model(self.job.engine.module, self.tokenizer, staging, self.rank)  # collective
        result = None
        if self.rank == 0:
            expected = ({name: numel - keep_count(numel, goal_ratio(self.goals[name]))
                         for name, numel in ((n, self.masks.numel(n)) for n in self.goals)} if self.masks is not None else {})
            result = report.finetune_report(self, staging, expected, tuned_ppl)
            report.write(staging / REPORT_NAME, result)
            publish(staging, opts.output_dir, keep_checkpoints=bool(opts.resume or cfg.save_interval))
            report.print_summary(self.say, result, opts.output_dir)
        torch.distributed.barrier()  # the last collective: the other ranks may leave now, rank 0 evaluates alone
        if self.rank == 0:
            mask_path, model_dir = oneshot_paths(opts.output_dir)
            mask_path.unlink(missing_ok=True)
            shutil.rmtree(model_dir, ignore_errors=True)
            if cfg.eval_ppl or cfg.eval_tasks:
                self.job = self._partitioned = None
                report.evaluate_saved_model(opts.output_dir, cfg)
        return result

    def _merge(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's consolidated peft state dict -> the plain model's, adapters merged, the one-shot mask re-applied."""
        from elsa_ds.finetune.lora import merge_adapters

        masks = self.masks

        def keep(name: str) -> torch.Tensor | None:
            return None if masks is None else masks.read(name, 0, masks.numel(name))

        return merge_adapters(state_dict, self.cfg.lora_alpha / self.cfg.lora_rank, keep)
