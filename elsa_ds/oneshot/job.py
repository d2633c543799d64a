"""The one-shot pruning job (``--method magnitude|wanda|sparsegpt``): the command line, output directory and
``elsa_report.json`` of an ELSA run, so the methods can be compared on the same data by the same evaluation.

One process does the work (rank 0 under a launcher; other ranks have nothing to do and exit): the model
sits in host memory and, with CUDA, one decoder layer at a time is moved to the GPU, so a model larger
than the GPU is pruned on it. Perplexity before and after is measured the same layer-by-layer way.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elsa_ds.admm.projection import NM, keep_count
from elsa_ds.config import ElsaConfig
from elsa_ds.data import load_blocks, load_tokenizer
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.perplexity import PROTOCOL, ppl
from elsa_ds.oneshot.calibration import calibration_sequences
from elsa_ds.oneshot.layerwise import layerwise_nll
from elsa_ds.oneshot.methods import CALIBRATED, prune_model
from elsa_ds.output import (REPORT_NAME, check_output_dir, fresh_staging, layers_summary, publish, verified_layers,
                            versions, write_json)
from elsa_ds.targets import select_targets


def accelerator() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_host_model(model_id: str) -> torch.nn.Module:
    """The whole model in host memory: bf16 when a GPU will do the work, fp32 on a CPU-only machine; eager
    attention (Gemma-2's logit soft-capping is dropped by sdpa)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError) as err:
        raise ElsaError(f"cannot load model {model_id!r}: {str(err).splitlines()[0]}") from None
    model.config.use_cache = False
    return model.eval()


@dataclass
class OneShot:
    """A model pruned in place by a one-shot method, with what it was pruned to."""

    model: torch.nn.Module
    masks: dict[str, torch.Tensor]
    targets: dict[str, float | NM]
    calibration: dict[str, Any] | None
    seconds: float


def prune_oneshot(cfg: ElsaConfig, method: str, tokenizer, model: torch.nn.Module, say=print) -> OneShot:
    """Prune ``model`` (in host memory) with ``method`` to ``cfg``'s sparsity, pattern or profile."""
    weights = dict(model.named_parameters())
    names = list(select_targets(model, cfg.targets).values())
    targets = cfg.targets_for({name: tuple(weights[name].shape) for name in names})
    calibration, info = None, None
    if method in CALIBRATED:
        calibration, how = calibration_sequences(cfg.dataset, tokenizer, cfg.nsamples, cfg.seqlen, cfg.seed)
        info = {"dataset": cfg.dataset, "sequences": cfg.nsamples, "seqlen": cfg.seqlen, "sampling": how}
        if method == "sparsegpt":
            info.update(blocksize=cfg.blocksize, percdamp=cfg.percdamp)
        say(f"[elsa_ds] calibration: {how}")
    started = time.time()
    masks = prune_model(model, method, targets, calibration, accelerator(), cfg.blocksize, cfg.percdamp, say)
    return OneShot(model, masks, targets, info, time.time() - started)


def run_oneshot(cfg: ElsaConfig, output_dir: Path, overwrite: bool, ds_config_path: str | None = None) -> dict | None:
    """Prune ``cfg.model`` with ``cfg.method`` and write the model and its report; rank 0 only."""
    check_output_dir(output_dir, overwrite)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        print(f"[elsa_ds] rank {rank}: {cfg.method.value} runs in one process (rank 0); nothing to do here", flush=True)
        return None
    started = time.time()
    method = cfg.method.value
    say = _say
    say(f"[elsa_ds] one-shot {method} of {cfg.model} to {cfg.pattern if cfg.nm else f'{cfg.sparsity:.0%}'}"
        f"{' with profile ' + cfg.sparsity_profile if cfg.sparsity_profile else ''} on {accelerator()}")
    tokenizer = load_tokenizer(cfg.model)
    val = (load_blocks(cfg.dataset, "validation", tokenizer, cfg.seqlen, max_blocks=cfg.val_windows)
           if cfg.val_windows else torch.empty(0, cfg.seqlen, dtype=torch.long))
    model = load_host_model(cfg.model)
    dense_ppl = ppl(*layerwise_nll(model, val, accelerator())) if val.shape[0] else None
    done = prune_oneshot(cfg, method, tokenizer, model, say)
    pruned_ppl = ppl(*layerwise_nll(model, val, accelerator())) if val.shape[0] else None

    staging = fresh_staging(output_dir)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    expected = {name: keep.numel() - keep_count(keep.numel(), _ratio(done.targets[name])) for name, keep in done.masks.items()}
    layers = verified_layers(staging, expected, done.targets, cfg.targets)
    report = {
        "model": cfg.model,
        "method": method,
        "dataset": cfg.dataset,
        "sparsity": cfg.sparsity,
        "pattern": cfg.pattern,
        "sparsity_profile": cfg.sparsity_profile,
        "steps": 0,
        "tokens": done.calibration["sequences"] * cfg.seqlen if done.calibration else 0,
        "world_size": 1,
        "deepspeed_config": ds_config_path,
        "device": str(accelerator()),
        "config": cfg.model_dump(mode="json"),
        "calibration": done.calibration,
        "final_loss": None,
        "lambda": None,
        "residual": None,
        "admm_state_bytes_per_param": None,
        "prune_s": done.seconds,
        "ppl": {"dense": dense_ppl, "pruned": pruned_ppl, "windows": int(val.shape[0]), "seqlen": cfg.seqlen,
                "split": "validation", "protocol": PROTOCOL},
        "layers": layers,
        "overall_sparsity": layers_summary(layers),
        "wall_s": time.time() - started,
        "versions": versions(),
    }
    write_json(staging / REPORT_NAME, report)
    publish(staging, output_dir, keep_checkpoints=False)
    say(f"[elsa_ds] wrote {output_dir} ({len(layers)} layers, overall sparsity {report['overall_sparsity']:.4f})")
    if dense_ppl is not None:
        say(f"[elsa_ds] validation perplexity over {val.shape[0]} windows of {cfg.seqlen}: dense {dense_ppl:.3f} | {method} {pruned_ppl:.3f}")
    if cfg.eval_ppl or cfg.eval_tasks:
        from elsa_ds.evaluation.run import evaluate_output

        del model, done
        evaluate_output(output_dir, cfg.eval_ppl, cfg.eval_tasks, cfg.eval_include_path, cfg.seqlen)
    return report


def _ratio(target: float | NM) -> float:
    return target.ratio if isinstance(target, NM) else target


def _say(msg: str) -> None:
    print(msg, flush=True)
