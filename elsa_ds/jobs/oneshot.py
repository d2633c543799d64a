"""The one-shot job (``--method magnitude|wanda|sparsegpt``): the command line, output directory and report of an
ELSA run, so the methods are compared on the same data by the same evaluation.

One process does the work (rank 0 under a launcher; the other ranks have nothing to do and exit at once): the
model sits in host memory and, with CUDA, one decoder layer at a time moves to the GPU. Perplexity before and
after is measured the same layer-by-layer way.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from elsa_ds.admm.projection import keep_count
from elsa_ds.config import ElsaConfig
from elsa_ds.options import JobOptions
from elsa_ds.data import PplWindows, validation_windows
from elsa_ds.disk_room import saved_bytes, writing
from elsa_ds.errors import ElsaError
from elsa_ds.jobs import checks, report
from elsa_ds.jobs.interface import Printer
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.layerwise import layerwise_nll
from elsa_ds.oneshot.pipeline import OneShotResult, accelerator, load_host_model, prune_oneshot
from elsa_ds.output import fresh_staging
from elsa_ds.targets import goal_ratio
from elsa_ds.zero.ds_config import DsConfig


class OneShotJob:
    """Prune ``cfg.model`` with ``cfg.method`` in one process and write the model and its report."""

    def __init__(self, cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig):
        if opts.resume:
            raise ElsaError(f"--resume continues an ELSA run; {cfg.method.value} has no checkpoints (it is one pass)")
        self.cfg: ElsaConfig = cfg
        self.opts: JobOptions = opts
        self.ds_config: DsConfig = ds_config  # checked like an ELSA run's, though no engine runs
        self.started: float = time.time()
        self.rank: int = int(os.environ.get("RANK", "0"))
        self.say: Printer = Printer(0)
        self.device: torch.device = accelerator()
        self.source: ModelSource = checks.model_source(cfg, opts)
        self.tokenizer: Any = None  # set by setup (rank 0)
        self.validation: PplWindows | None = None  # set by setup (rank 0)
        self.model: torch.nn.Module | None = None  # set by setup (rank 0): the whole model in host memory
        self.dense_ppl: float | None = None  # set by train (rank 0)
        self.done: OneShotResult | None = None  # set by train (rank 0): the pruned model and its masks
        self.pruned_ppl: float | None = None  # set by train (rank 0)

    def setup(self) -> None:
        cfg = self.cfg
        checks.before_work(cfg, self.opts, self.ds_config, 1, self.source)
        if self.rank != 0:
            return
        goal = cfg.pattern if cfg.nm else f"{cfg.sparsity:.0%}"
        self.say(f"[elsa_ds] one-shot {cfg.method.value} of {cfg.model} to {goal}"
                 f"{' with profile ' + cfg.sparsity_profile if cfg.sparsity_profile else ''} on {self.device}")
        self.tokenizer = self.source.load_tokenizer()
        self.validation = validation_windows(cfg.dataset, cfg.val_dataset, self.tokenizer, cfg.seqlen, cfg.ppl_protocol,
                                             self.source.config(), cfg.val_windows)
        self.model = load_host_model(self.source)

    def load_checkpoint(self) -> None:
        """Nothing to restore: a one-shot method is one pass."""

    def train(self) -> None:
        if self.rank != 0:
            self.say.every_rank(f"{self.cfg.method.value} runs in one process (rank 0); nothing to do here")
            return
        self.dense_ppl = self._ppl()
        self.done = prune_oneshot(self.cfg, self.cfg.oneshot, self.tokenizer, self.model, self.say)
        self.pruned_ppl = self._ppl()

    def _ppl(self) -> float | None:
        v = self.validation
        return v.perplexity(*layerwise_nll(self.model, v.ids, self.device)) if v.count else None

    def save_checkpoint(self) -> None:
        """Nothing to checkpoint: a one-shot method is one pass."""

    def finish(self) -> dict[str, Any] | None:
        if self.rank != 0:
            return None
        cfg, opts = self.cfg, self.opts
        staging = fresh_staging(opts.output_dir)
        with writing(staging, saved_bytes(self.model)):
            self.model.save_pretrained(staging, save_original_format=False)  # module names, as the ZeRO-3 export writes them
            self.tokenizer.save_pretrained(staging)
        result = report.oneshot_report(self._record(), staging)
        report.publish_report(result, staging, opts, False, self.say)
        if cfg.eval_ppl or cfg.eval_tasks:
            self.model = self.done = None
            report.evaluate_saved_model(opts.output_dir, cfg)
        return result

    def _record(self) -> report.ReportRecord:
        """What the report says: the perplexities before and after, the zeros each pruned layer must hold."""
        done = self.done
        expected = {name: keep.numel() - keep_count(keep.numel(), goal_ratio(done.goals[name])) for name, keep in done.masks.items()}
        return report.ReportRecord(
            cfg=self.cfg, method=self.cfg.method.value, deepspeed=self.opts.deepspeed, world=1, started=self.started,
            validation=self.validation.describe(), goals=done.goals, expected_zeros=expected, final_ppl=self.pruned_ppl,
            dense_ppl=self.dense_ppl, calibration=done.calibration, device=str(self.device), prune_s=done.seconds)

    def cleanup(self) -> None:
        """No process group to tear down: the one-shot job runs in one process."""
