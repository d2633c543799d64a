"""The one-shot job (``--method magnitude|wanda|sparsegpt``): the command line, output directory and report of an
ELSA run, so the methods are compared on the same data by the same evaluation.

One process does the work (rank 0 under a launcher; the other ranks have nothing to do and exit at once): the
model sits in host memory and, with CUDA, one decoder layer at a time moves to the GPU. Perplexity before and
after is measured the same layer-by-layer way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from elsa_ds import launch_env
from elsa_ds.data import PplWindows, validation_windows
from elsa_ds.files.disk_room import saved_bytes, writing
from elsa_ds.files.output import fresh_staging
from elsa_ds.jobs import report
from elsa_ds.jobs.phases import PhaseLog
from elsa_ds.log import EVERY_RANK, get_logger
from elsa_ds.methods import OneShot
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.layerwise import layerwise_nll
from elsa_ds.oneshot.pipeline import OneShotResult, accelerator, load_host_model, prune_oneshot, round_to, saved_dtype
from elsa_ds.plan import Plan
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.options import JobOptions
from elsa_ds.targets import goal_text, goal_zeros

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)


@dataclass(frozen=True)
class HostModel:
    """What :meth:`OneShotJob.setup` builds on rank 0: the whole model in host memory, its tokenizer, the validation windows."""

    tokenizer: Any
    validation: PplWindows
    model: PreTrainedModel


@dataclass
class PassState:
    """What the one pass measured and made, set by train on rank 0 (as a training job's RunState is by its loop)."""

    dense_ppl: float | None = None          # None without validation windows
    pruned_ppl: float | None = None
    result: OneShotResult | None = None     # the pruned model (in place), its masks and goals


class OneShotJob:
    """Prune ``plan.cfg.model`` with ``cfg.method`` in one process and write the model and its report."""

    def __init__(self, plan: Plan):
        if plan.cfg.oneshot is None:
            raise ValueError(f"OneShotJob runs a one-shot method; --method {plan.cfg.method.value} is not one (make_job picks the job)")
        self.cfg: ElsaConfig = plan.cfg
        self.method: OneShot = plan.cfg.oneshot
        self.opts: JobOptions = plan.opts
        self.source: ModelSource = plan.source
        self.started: float = time.time()
        self.rank: int = launch_env.rank()
        self.device: torch.device = accelerator()
        self.saved: torch.dtype = saved_dtype(plan.ds.raw)  # what the model is written (and its pruned perplexity taken) in
        self.state: PassState = PassState()  # set by train (rank 0)
        self.phases: PhaseLog = PhaseLog(self.rank)  # load, validation, prune, validation, export, verify, done

    def setup(self) -> HostModel | None:
        """Rank 0 loads the model into host memory; the other ranks have nothing to build."""
        cfg = self.cfg
        if self.rank != 0:
            return None
        self.phases.mark("load")
        goal = goal_text(cfg.sparsity, cfg.pattern if cfg.nm else None, cfg.sparsity_profile)
        log.info(f"one-shot {cfg.method.value} of {cfg.model} to {goal} on {self.device}")
        tokenizer = self.source.load_tokenizer()
        validation = validation_windows(cfg.dataset, cfg.val_dataset, tokenizer, cfg.seqlen, cfg.ppl_protocol,
                                        self.source.config(), cfg.val_windows)
        return HostModel(tokenizer, validation, load_host_model(self.source, cfg.random_init))

    def load_checkpoint(self, host: HostModel | None) -> None:
        """Nothing to restore: a one-shot method is one pass."""

    def train(self, host: HostModel | None) -> None:
        if host is None:
            log.info(f"{self.cfg.method.value} runs in one process (rank 0); nothing to do here", extra=EVERY_RANK)
            return
        round_to(host.model, self.saved)  # pruned and measured (dense and pruned) as the output holds them: a CPU's fp32
        # copy then prunes the bf16 values a GPU's copy holds; computing stays fp32 there
        self.phases.mark("validation")
        self.state.dense_ppl = self._ppl(host)
        self.phases.mark("prune")
        self.state.result = prune_oneshot(self.cfg, self.method, host.tokenizer, host.model, exact=True)
        round_to(host.model, self.saved)  # the perplexity of the weights the output holds
        self.phases.mark("validation")
        self.state.pruned_ppl = self._ppl(host)

    def _ppl(self, host: HostModel) -> float | None:
        v = host.validation
        return v.perplexity(*layerwise_nll(host.model, v.ids, self.device)) if v.count else None

    def save_checkpoint(self, host: HostModel | None) -> None:
        """Nothing to checkpoint: a one-shot method is one pass."""

    def finish(self, host: HostModel | None) -> dict[str, Any] | None:
        done = self.state.result
        if host is None or done is None:  # another rank: nothing was pruned here
            return None
        opts = self.opts
        staging = fresh_staging(opts.output_dir, opts.overwrite)
        self.phases.mark("export")
        cast(torch.nn.Module, host.model).to(self.saved)  # in place, a tensor at a time; rounded already (train)
        with writing(staging, saved_bytes(host.model)):
            host.model.save_pretrained(staging, save_original_format=False)  # module names, as the ZeRO-3 export writes them
            host.tokenizer.save_pretrained(staging)
        self.phases.mark("verify")
        result = {**report.oneshot_report(self._record(host, done), staging), "saved_dtype": str(self.saved).removeprefix("torch.")}
        report.publish_report(result, staging, opts, False, self.phases.mark)
        self.phases.mark("done")
        return result

    def _record(self, host: HostModel, done: OneShotResult) -> report.ReportRecord:
        """What the report says: the perplexities before and after, the zeros each pruned layer must hold."""
        expected = {name: goal_zeros(keep.numel(), done.goals[name]) for name, keep in done.masks.items()}
        return report.ReportRecord(
            cfg=self.cfg, method=self.cfg.method.value, deepspeed=self.opts.deepspeed, world=1, started=self.started,
            validation=host.validation.describe(), goals=done.goals, expected_zeros=expected, final_ppl=self.state.pruned_ppl,
            dense_ppl=self.state.dense_ppl, calibration=done.calibration, device=str(self.device), prune_s=done.seconds,
            computed_in=dict.fromkeys(("dense", "pruned"), report.on_host()))

    def evaluate(self, result: dict[str, Any] | None) -> None:
        """Rank 0 evaluates the saved model, the host copy gone (--eval_ppl, --eval_tasks)."""
        self.state.result = None  # the pruned host copy goes before the saved model loads
        if result is not None and (self.cfg.eval_ppl or self.cfg.eval_tasks):
            report.evaluate_saved_model(self.opts.output_dir, self.cfg)

    def cleanup(self) -> None:
        """No process group to tear down: the one-shot job runs in one process; the pruned host copy goes."""
        self.state.result = None
