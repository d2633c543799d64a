"""One-shot pruning of a model in host memory: calibration data, then the method layer by layer.

The model sits in host memory and, with CUDA, one decoder layer at a time is moved to the GPU, so a model
larger than the GPU is pruned on it. Used by the one-shot job and by ELSA's warm start (``--init_mask``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elsa_ds.data import is_gemma
from elsa_ds.data.sources import source_name
from elsa_ds.log import get_logger
from elsa_ds.methods import OneShot
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.calibration import calibration_sequences
from elsa_ds.oneshot.methods import prune_model
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.targets import LayerGoal, select_targets

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)


def accelerator() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def host_dtype() -> torch.dtype:
    """The dtype of the host copy a one-shot method prunes: bf16 when a GPU will do the work, fp32 on a CPU-only machine."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def saved_dtype(ds: dict) -> torch.dtype:
    """The dtype a one-shot job writes its model in: bf16 where the DeepSpeed config ``ds`` (as resolved for this machine)
    enables it, as an ELSA job with the same config writes it (the shipped configs: their outputs compare byte for byte);
    else the host copy's (a GPU's bf16 copy is never widened: a config with bf16 off gets bf16 there, where ELSA's
    engine would write fp32)."""
    return torch.bfloat16 if ds.get("bf16", {}).get("enabled") else host_dtype()


def load_host_model(source: ModelSource, random_init: bool = False) -> PreTrainedModel:
    """The whole model in host memory, in :func:`host_dtype` (``random_init``: built from its config, as --random_init
    builds the engine's; an audit, 2026-12-07: a one-shot job read the weights --random_init said not to)."""
    return source.load(host_dtype(), random_init).eval()


def round_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round the parameters' values to ``dtype`` in place (their own dtype kept): a model measured after this is the model
    that is saved in ``dtype``. Zeros stay zeros, so a mask is unchanged."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.copy_(p.to(dtype))


@dataclass
class OneShotResult:
    """A model pruned in place by a one-shot method, with what each layer was pruned to."""

    model: PreTrainedModel
    masks: dict[str, torch.Tensor]
    goals: dict[str, LayerGoal]
    calibration: dict[str, Any] | None
    seconds: float


def prune_oneshot(cfg: ElsaConfig, method: OneShot, tokenizer, model: PreTrainedModel, exact: bool = False) -> OneShotResult:
    """Prune ``model`` (in host memory) with ``method`` to ``cfg``'s sparsity, pattern or profile (``exact``: the export
    is this model, ``prune_model``'s)."""
    weights = dict(model.named_parameters())
    names = list(select_targets(model, cfg.targets).values())
    goals = cfg.layer_goals({name: tuple(weights[name].shape) for name in names})
    calibration, info = None, None
    if method.calibrated:
        calibration, how = calibration_sequences(cfg.dataset, tokenizer, cfg.nsamples, cfg.seqlen, cfg.seed, gemma=is_gemma(model.config),
                                                 holdout_part=cfg.val_dataset is None)
        info = {"dataset": source_name(cfg.dataset), "sequences": cfg.nsamples, "seqlen": cfg.seqlen, "sampling": how}
        if method is OneShot.sparsegpt:
            info.update(blocksize=cfg.blocksize, percdamp=cfg.percdamp)
        log.info(f"calibration: {how}")
    started = time.time()
    masks = prune_model(model, method, goals, calibration, accelerator(), cfg.blocksize, cfg.percdamp, exact)
    return OneShotResult(model, masks, goals, info, time.time() - started)


