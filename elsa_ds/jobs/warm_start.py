"""Warm start of ELSA's z (``--init_mask``): keep-masks from a one-shot method or an already pruned model."""
from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import torch

from elsa_ds.config import ElsaConfig
from elsa_ds.errors import ElsaError
from elsa_ds.mask_file import MaskReader, write_masks
from elsa_ds.methods import OneShot
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.pipeline import load_host_model, prune_oneshot
from elsa_ds.output import staging_dir


def warm_start_path(output_dir: Path) -> Path:
    """Where rank 0 leaves the one-shot masks of --init_mask for every rank (beside the output, so on the
    filesystem every node must share anyway)."""
    return staging_dir(output_dir).with_name(f".{output_dir.name}.init_mask.safetensors")


def warm_start_masks(cfg: ElsaConfig, source: ModelSource, output_dir: Path, tokenizer, rank: int, say) -> MaskReader:
    """Keep-masks for z₀: from a pruned model directory, or computed by a one-shot method on rank 0. Collective.

    The one-shot pass (SparseGPT on a 27B model takes hours) runs on rank 0 alone, before the ZeRO-3 model is
    built; the other ranks wait on a group with a long timeout and learn from rank 0 whether it succeeded.
    """
    if cfg.init_mask not in {m.value for m in OneShot}:
        return MaskReader(cfg.init_mask)
    method = OneShot(cfg.init_mask)
    path = warm_start_path(output_dir)
    waiting = torch.distributed.new_group(backend="gloo", timeout=timedelta(days=3))
    failure: BaseException | None = None
    if rank == 0:
        try:
            say(f"[elsa_ds] warm start: one-shot {method.value} masks (other ranks wait)")
            host = ModelSource(source.name, copy.deepcopy(source.module)) if source.module is not None else source
            done = prune_oneshot(cfg, method, tokenizer, load_host_model(host), say)
            write_masks(path, done.masks)
            del done
        except BaseException as err:  # the other ranks must hear of it, whatever it is
            failure = err
    ok = torch.tensor([1.0 if rank == 0 and failure is None else 0.0])
    torch.distributed.broadcast(ok, src=0, group=waiting)
    if failure is not None:
        raise failure
    if not ok.item():
        raise ElsaError(f"rank 0 could not compute the --init_mask {method.value} masks; its error says why")
    return MaskReader(path)
