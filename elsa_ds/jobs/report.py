"""The report a job writes beside its model (``elsa_report.json``), its console summary, and the evaluation of the
saved model that ``--eval_ppl`` / ``--eval_tasks`` ask for at the end of a job."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from elsa_ds.config import ElsaConfig
from elsa_ds.data import PplWindows
from elsa_ds.io import versions, write_json
from elsa_ds.output import REPORT_NAME, layers_summary, verified_layers
from elsa_ds.zero.ds_config import DsConfig

write = write_json


def elsa_report(job, staging: Path, pruned_ppl: float | None) -> dict[str, Any]:
    """The ELSA job's report, with per-layer sparsity read back from the exported files (never from memory)."""
    cfg, ds, state = job.cfg, job.ds, job.state
    expected = {sl.layer: sl.numel - sl.keep for sg in job.job.layout for sl in sg.slices}
    layers = verified_layers(staging, expected, job.goals, cfg.targets)
    last = state.history[-1] if state.history else {}
    projections = [h for h in state.history if not h["final"]]
    tail = state.losses[-min(len(state.losses), cfg.interval):]
    steady = state.step_times[1:] or state.step_times  # the first step builds lazy state (Adam, z, u)
    dense, baseline = state.dense_ppl, state.baseline_ppl
    warm = cfg.init_weights  # then the baseline is the start x₀ (the one-shot ELSA began from), not magnitude pruning
    return {
        **_common(cfg, "elsa", job.opts.deepspeed, job.world, job.started),
        "init_mask": cfg.init_mask,
        "init_weights": cfg.init_weights,
        "steps": cfg.steps,
        "tokens": cfg.steps * ds["train_batch_size"] * cfg.seqlen,
        "offload": _offload(DsConfig(ds)),
        "final_loss": state.losses[-1],
        "step_time_s": sum(steady) / len(steady),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "final_loss_mean_last_interval": sum(tail) / len(tail),
        "lambda": last.get("lambda"),
        "residual": projections[-1]["residual"] if projections else None,
        "projections": state.history,
        "admm_state_bytes_per_param": last.get("admm_state_bytes_per_param"),
        "kernels": job.job.admm.kernel_report(),
        "training_data": job.train_data,
        "ppl": {"dense": dense, "magnitude_oneshot": None if warm else baseline, "warm_start": baseline if warm else None,
                "pruned": pruned_ppl, **_validation(job.validation)},
        "vs_magnitude": None if warm or baseline is None or pruned_ppl is None else {
            "ppl_ratio": baseline / pruned_ppl, "ppl_reduction": baseline - pruned_ppl},
        "layers": layers,
        "overall_sparsity": layers_summary(layers),
        "defaults": job.defaults,
        "selection": state.selection,
        "wall_s": time.time() - job.started,
    }


def finetune_report(job, staging: Path, expected: dict[str, int], tuned_ppl: float | None) -> dict[str, Any]:
    """The retraining job's report: the one-shot (or dense) model before, the retrained one after, in the same layout."""
    cfg, ds, state = job.cfg, job.ds, job.state
    layers = verified_layers(staging, expected, job.goals, cfg.targets) if expected else {}
    steady = state.step_times[1:] or state.step_times
    tail = state.losses[-min(len(state.losses), 32):]
    return {
        **_common(cfg, cfg.method.value, job.opts.deepspeed, job.world, job.started),
        "finetune": cfg.finetune.value, "lora": {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha} if cfg.finetune.value == "lora" else None,
        "steps": cfg.steps, "tokens": cfg.steps * ds["train_batch_size"] * cfg.seqlen, "calibration": job.calibration,
        "final_loss": state.losses[-1], "final_loss_mean_last_32": sum(tail) / len(tail), "step_time_s": sum(steady) / len(steady),
        "lambda": None, "residual": None, "admm_state_bytes_per_param": None,
        "ppl": {"dense": None, "before_finetune": state.baseline_ppl, "pruned": tuned_ppl, **_validation(job.validation),
                "measured_on": "the engine's weights" + (": LoRA adapters not yet merged, the mask not yet re-applied "
                                                         "(evaluate the export for the merged model)" if cfg.finetune.value == "lora" else "")},
        "layers": layers, "overall_sparsity": layers_summary(layers) if layers else 0.0,
        "defaults": job.defaults, "wall_s": time.time() - job.started,
    }


def oneshot_report(job, staging: Path, expected: dict[str, int], dense_ppl: float | None, pruned_ppl: float | None) -> dict[str, Any]:
    """The one-shot job's report, in the ELSA report's layout (ADMM fields None)."""
    cfg, done = job.cfg, job.done
    layers = verified_layers(staging, expected, done.goals, cfg.targets)
    return {
        **_common(cfg, cfg.method.value, job.opts.deepspeed, 1, job.started),
        "steps": 0,
        "tokens": done.calibration["sequences"] * cfg.seqlen if done.calibration else 0,
        "device": str(job.device),
        "calibration": done.calibration,
        "final_loss": None,
        "lambda": None,
        "residual": None,
        "admm_state_bytes_per_param": None,
        "prune_s": done.seconds,
        "ppl": {"dense": dense_ppl, "pruned": pruned_ppl, **_validation(job.validation)},
        "layers": layers,
        "overall_sparsity": layers_summary(layers),
        "wall_s": time.time() - job.started,
    }


def _common(cfg: ElsaConfig, method: str, ds_config: str, world: int, started: float) -> dict[str, Any]:
    return {"model": cfg.model, "method": method, "dataset": cfg.dataset, "sparsity": cfg.sparsity, "pattern": cfg.pattern,
            "sparsity_profile": cfg.sparsity_profile, "world_size": world, "deepspeed_config": ds_config,
            "config": cfg.model_dump(mode="json"), "versions": versions()}


def _validation(windows: PplWindows) -> dict[str, Any]:
    """The windows' count, length and protocol, and which text they come from (never the training part)."""
    d = windows.describe()
    return {"windows": d["windows"], "seqlen": d["seqlen"], "protocol": d["protocol"],
            "validation": {k: d[k] for k in ("source", "part", "documents", "text_tokens")}}


def print_summary(say, result: dict[str, Any], output_dir: Path) -> None:
    p = result["ppl"]
    say(f"[elsa_ds] wrote {output_dir} ({len(result['layers'])} layers, each exactly at its target; overall sparsity "
        f"{result['overall_sparsity']:.4f})")
    if p.get("before_finetune") is not None:
        say(f"[elsa_ds] validation perplexity over {p['windows']} windows of {p['seqlen']}: before fine-tuning "
            f"{p['before_finetune']:.3f} | after {p['pruned']:.3f}")
        return
    if p["dense"] is None:
        return
    if result["method"] != "elsa":
        say(f"[elsa_ds] validation perplexity ({_where(p)}): dense {p['dense']:.3f} | {result['method']} {p['pruned']:.3f}")
        return
    baseline, what = (p["warm_start"], f"warm start ({result['init_mask']})") if result["init_weights"] else \
        (p["magnitude_oneshot"], "one-shot magnitude")
    say(f"[elsa_ds] validation perplexity ({_where(p)}): dense {p['dense']:.3f} | "
        f"{what} {baseline if baseline is None else format(baseline, '.3f')} | ELSA {p['pruned']:.3f}")
    if result["vs_magnitude"]:
        say(f"[elsa_ds] ELSA perplexity is {result['vs_magnitude']['ppl_ratio']:.2f}x lower than one-shot magnitude pruning")
    elif result["init_weights"] and baseline is not None and p["pruned"] is not None:
        ratio = baseline / p["pruned"]
        say(f"[elsa_ds] ELSA perplexity is {ratio if ratio >= 1 else 1 / ratio:.3f}x {'lower' if ratio >= 1 else 'HIGHER'} "
            f"than its warm start ({result['init_mask']})")


def _where(p: dict[str, Any]) -> str:
    return f"{p['validation']['source']}, {p['windows']} windows of {p['seqlen']}, {p['protocol']['name']} protocol"


def evaluate_saved_model(output_dir: Path, cfg: ElsaConfig) -> dict[str, Any]:
    """Evaluate a job's saved model in the job's own process (rank 0, after its last collective) with the code
    behind ``launch/evaluate.py``; the full result goes to ``eval.json``/``eval.md``, a summary into the report."""
    from elsa_ds.evaluation.run import EvalSettings, run
    from elsa_ds.evaluation.zeroshot import expand_tasks
    from elsa_ds.log import get_logger

    get_logger(__name__).info(f"evaluating {output_dir} (ppl: {cfg.eval_ppl or 'none'}; tasks: {cfg.eval_tasks or 'none'})")
    result = run(EvalSettings(
        model=str(output_dir), ppl=list(cfg.eval_ppl), tasks=expand_tasks(",".join(cfg.eval_tasks)) if cfg.eval_tasks else [],
        include_path=cfg.eval_include_path, seqlen=cfg.seqlen, ppl_protocol=cfg.ppl_protocol.value,
        device_map="auto" if torch.cuda.is_available() else None,
        output=output_dir / "eval.json", markdown=output_dir / "eval.md",
    ))
    report_path = output_dir / REPORT_NAME
    saved = json.loads(report_path.read_text())
    saved["evaluation"] = {"file": "eval.json", "ppl": {k: v["ppl"] for k, v in result["ppl"].items()},
                           "tasks": {k: v.get("acc") for k, v in result["tasks"].items()}, "average_acc": result["average_acc"]}
    write_json(report_path, saved)
    return result


def _offload(view: DsConfig) -> dict[str, str]:
    return {"offload_param": view.param_device, "offload_optimizer": view.optimizer_device}
