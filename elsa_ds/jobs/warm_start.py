"""One-shot masks for a ZeRO-3 job, computed on rank 0 while the other ranks wait: ELSA's warm start of z
(``--init_mask``, with ``--init_weights`` x₀ too) and the mask (and pruned weights) that ``--finetune`` retrains."""
from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import saved_bytes, writing
from elsa_ds.files.mask_file import MaskReader, write_masks
from elsa_ds.files.output import side_path
from elsa_ds.log import get_logger
from elsa_ds.methods import OneShot
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.layerwise import layerwise_nll
from elsa_ds.oneshot.pipeline import accelerator, load_host_model, prune_oneshot, round_to
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.targets import goal_zeros, target_shapes

log = get_logger(__name__)


def warm_start_path(output_dir: Path) -> Path:
    """Where rank 0 leaves the one-shot masks of --init_mask for every rank (beside the output, so on the
    filesystem every node must share anyway)."""
    return side_path(output_dir, "init_mask.safetensors")


def warm_start_weights_dir(output_dir: Path) -> Path:
    """Where rank 0 leaves the one-shot's pruned model for --init_weights (removed once the engine holds it)."""
    return side_path(output_dir, "init_weights")


@dataclass
class WarmStart:
    """z₀'s keep-masks; with --init_weights the pruned model x₀ starts from, and the dense model's summed NLL and token
    count on the validation windows (rank 0 measures it before pruning: the engine never holds the dense weights)."""

    masks: MaskReader
    start: ModelSource | None = None
    dense_nll: tuple[float, int] | None = None
    at_goals: bool = False  # x₀ pruned by this job to exactly its goals' zeros (a one-shot --init_mask), not a folder's


def warm_start(cfg: ElsaConfig, source: ModelSource, output_dir: Path, tokenizer, rank: int, windows: torch.Tensor,
               engine_dtype: torch.dtype) -> WarmStart:
    """--init_mask (and --init_weights): from a pruned model directory, or computed by a one-shot method on rank 0 on the
    values the engine will hold (``engine_dtype``). Collective."""
    init_mask = cfg.init_mask
    if init_mask is None:
        raise ValueError("warm_start starts from --init_mask; the config has none (the job asks only when it is set)")
    if init_mask not in {m.value for m in OneShot}:
        # x₀ from a directory: no rank-0 pass to measure the dense model on, so the report leaves dense out
        if not cfg.init_weights and rank == 0:  # a short run from the dense weights can end far worse than the folder
            log.info(f"--init_mask {init_mask}: z starts from that folder's mask, x from the dense weights of {source.name}; "
                     "add --init_weights to start x from the folder's pruned weights")
        return WarmStart(MaskReader(init_mask), ModelSource(init_mask) if cfg.init_weights else None)
    model_dir = warm_start_weights_dir(output_dir) if cfg.init_weights else None
    masks, _, nll, exact = oneshot_on_rank0(cfg, OneShot(init_mask), source, tokenizer, rank, warm_start_path(output_dir),
                                            model_dir, windows if model_dir is not None else None, engine_dtype=engine_dtype)
    return WarmStart(masks, ModelSource(str(model_dir)) if model_dir is not None else None, nll, at_goals=exact)


def oneshot_on_rank0(cfg: ElsaConfig, method: OneShot, source: ModelSource, tokenizer, rank: int, mask_path: Path,
                     model_dir: Path | None = None, dense_windows: torch.Tensor | None = None, *, engine_dtype: torch.dtype,
                     ) -> tuple[MaskReader, dict[str, Any] | None, tuple[float, int] | None, bool]:
    """Prune a host copy of the model with ``method`` on rank 0; write its keep-masks to ``mask_path`` and, with
    ``model_dir``, the pruned model itself. Returns the masks (every rank), the calibration record (rank 0), with
    ``dense_windows`` the dense model's summed NLL and token count on them (every rank), and whether every pruned weight
    holds exactly its goal's zeros (every rank; a model already sparser than a goal keeps zeros among its kept weights, so
    its pruned copy is no export: a review). Collective.

    The copy is first rounded to ``engine_dtype``, the dtype the engine holds the parameters in: the one-shot decides on
    (and the dense model is measured at) the values the run trains, as a one-shot job prunes the values it saves (a CPU's
    fp32 copy under a bf16 engine pruned other values than the standalone one-shot's: 75.74 against 75.98 on the demo).

    The one-shot pass (SparseGPT on a 27B model takes hours) runs on rank 0 alone, before the ZeRO-3 model is
    built; the other ranks wait on a group with a long timeout and learn from rank 0 whether it succeeded.
    """
    waiting = torch.distributed.new_group(backend="gloo", timeout=timedelta(days=3))
    failure: BaseException | None = None
    calibration, dense, exact = None, (0.0, 0), False
    measured = dense_windows if dense_windows is not None and len(dense_windows) > 0 else None
    measure = measured is not None
    if rank == 0:
        try:
            log.info(f"one-shot {method.value} masks on rank 0 (other ranks wait)")
            if model_dir is not None and model_dir.exists():
                shutil.rmtree(model_dir)  # a crashed run's copy: gone before anything new is written
            host = ModelSource(source.name, copy.deepcopy(source.module)) if source.module is not None else source
            model = load_host_model(host, cfg.random_init)
            round_to(model, engine_dtype)
            if measured is not None:
                dense = layerwise_nll(model, measured, accelerator())
            done = prune_oneshot(cfg, method, tokenizer, model)
            exact = at_goals(done.model, cfg)
            write_masks(mask_path, done.masks)
            if model_dir is not None:
                with writing(model_dir, saved_bytes(done.model)):
                    done.model.save_pretrained(model_dir)
                    tokenizer.save_pretrained(model_dir)
            calibration = done.calibration
            del done
        except BaseException as err:  # the other ranks must hear of it, whatever it is
            failure = err
    ok = torch.tensor([1.0 if rank == 0 and failure is None else 0.0, *dense, float(exact)], dtype=torch.float64)
    torch.distributed.broadcast(ok, src=0, group=waiting)
    if failure is not None:
        raise failure
    if not ok[0].item():
        raise ElsaError(f"rank 0 could not compute the one-shot {method.value} masks; its error says why")
    return MaskReader(mask_path), calibration, (float(ok[1]), int(ok[2])) if measure else None, bool(ok[3])


def at_goals(model: torch.nn.Module, cfg: ElsaConfig) -> bool:
    """Whether every weight ``cfg`` prunes holds exactly its goal's zeros (an N:M mask's total: n in each group)."""
    weights = dict(model.named_parameters(remove_duplicate=False))
    goals = cfg.layer_goals(target_shapes(model, cfg.targets))
    return all(weights[n].numel() - int(torch.count_nonzero(weights[n])) == goal_zeros(weights[n].numel(), g) for n, g in goals.items())
