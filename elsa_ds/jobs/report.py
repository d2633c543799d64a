"""The report a job writes beside its model (``elsa_report.json``), its console summary, and the evaluation of the
saved model that ``--eval_ppl`` / ``--eval_tasks`` ask for at the end of a job.

A job fills one :class:`ReportRecord` with what it measured and decided; the report is built from that record and
from the exported files (per-layer sparsity is read back from them, never from memory), nothing else."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elsa_ds.data.sources import source_name
from elsa_ds.evaluation.sparsity import layers_summary, verified_layers
from elsa_ds.files.io import versions, write_json
from elsa_ds.files.output import REPORT_NAME, publish
from elsa_ds.log import get_logger
from elsa_ds.loss import taken as loss_taken
from elsa_ds.oneshot.pipeline import host_dtype
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.options import JobOptions
from elsa_ds.sparse.compress import DEFAULT_MIN_SPARSITY
from elsa_ds.sparse.export import compress_in_place
from elsa_ds.targets import LayerGoal
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import model_dtype

log = get_logger(__name__)
TAIL_STEPS = 32  # the retraining report's final_loss_mean_tail: the mean loss of the last this many steps
write = write_json


@dataclass
class ReportRecord:
    """What a job measured and decided: the one input of its report besides the exported files."""

    cfg: ElsaConfig                    # as the job ran it (the defaults rule applied)
    method: str                        # "elsa", or the one-shot method run or retrained ("dense": the control)
    deepspeed: str                     # --deepspeed as given
    world: int                         # ranks that trained (1: the one-shot job)
    started: float                     # time.time() at the job's start
    validation: dict[str, Any]         # the validation windows (PplWindows.describe())
    goals: dict[str, LayerGoal]        # each pruned layer's sparsity or N:M goal
    expected_zeros: dict[str, int]     # the layout summary: zeros each pruned layer must hold in the exported files
    final_ppl: float | None = None     # validation perplexity of the exported model (ELSA: pruned; --finetune: tuned)
    dense_ppl: float | None = None
    baseline_ppl: float | None = None  # ELSA: one-shot magnitude, or the warm start x₀; --finetune: before training
    losses: list[float] = field(default_factory=list)       # per step, global mean
    step_times: list[float] = field(default_factory=list)   # per step, seconds
    history: list[dict[str, Any]] = field(default_factory=list)  # ELSA's projections (AdmmOptimizer metrics)
    selection: dict[str, Any] | None = None   # --select_every's curve and choice
    defaults: dict[str, Any] | None = None    # what the defaults rule filled in, and why
    global_batch: int = 0                     # sequences per optimizer step
    offload: dict[str, str] | None = None     # where ZeRO-3 put parameters and optimizer states
    training_data: dict[str, Any] | None = None  # how the training sequences were drawn
    kernels: dict[str, Any] | None = None     # which ADMM kernels ran (fused / eager)
    calibration: dict[str, Any] | None = None  # the one-shot method's calibration data
    device: str | None = None                 # where the one-shot job ran
    prune_s: float | None = None              # the one-shot pass, seconds
    deepspeed_resolved: dict[str, Any] | None = None  # the plan's DeepSpeed config as the engine got it (None: no engine)
    computed_in: dict[str, str] = field(default_factory=dict)  # each perplexity of "ppl": the dtype and where it ran
    resumed_at: int | None = None             # --resume: the step this attempt continued at (its wall_s is this attempt's)


def on_engine(ds: DsConfig) -> str:
    """A perplexity computed by the engine ``ds`` configures: in the dtype it holds the model in (``model_dtype``)."""
    return f"{str(model_dtype(ds.raw)).removeprefix('torch.')} on the engine"


def on_host() -> str:
    """A perplexity computed on rank 0's host copy (a one-shot pass): in its dtype (fp32 on a CPU-only machine)."""
    return f"{str(host_dtype()).removeprefix('torch.')} in rank 0's one-shot pass"


def offload(ds: DsConfig) -> dict[str, str]:
    """The record's ``offload`` of an engine's config."""
    return {"offload_param": ds.param_device, "offload_optimizer": ds.optimizer_device}


def elsa_report(rec: ReportRecord, staging: Path) -> dict[str, Any]:
    """The ELSA job's report, with per-layer sparsity read back from the exported files (never from memory)."""
    cfg = rec.cfg
    layers = verified_layers(staging, rec.expected_zeros, rec.goals, cfg.targets)
    last = rec.history[-1] if rec.history else {}
    projections = [h for h in rec.history if not h["final"]]
    tail = rec.losses[-min(len(rec.losses), cfg.interval):]
    steady = rec.step_times[1:] or rec.step_times  # the first step builds lazy state (Adam, z, u)
    dense, baseline, pruned_ppl = rec.dense_ppl, rec.baseline_ppl, rec.final_ppl
    warm = cfg.init_weights  # then the baseline is the start x₀ (the one-shot ELSA began from), not magnitude pruning
    steps = (rec.selection or {}).get("stopped_at") or cfg.steps  # --select_patience's early stop: the steps that ran
    return {
        **_common(rec),
        "init_mask": cfg.init_mask,
        "init_weights": cfg.init_weights,
        "steps": steps,
        "planned_steps": cfg.steps,
        "tokens": steps * rec.global_batch * cfg.seqlen,
        "offload": rec.offload,
        "final_loss": rec.losses[-1],
        "step_time_s": sum(steady) / len(steady),
        "final_loss_mean_last_interval": sum(tail) / len(tail),
        "lambda": last.get("lambda"),
        "residual": projections[-1]["residual"] if projections else None,
        "projections": rec.history,
        "admm_state_bytes_per_param": last.get("admm_state_bytes_per_param"),
        "kernels": rec.kernels,
        "training_data": rec.training_data,
        "ppl": _perplexities(rec, dense=dense, magnitude_oneshot=None if warm else baseline,
                             warm_start=baseline if warm else None, pruned=pruned_ppl),
        "vs_magnitude": None if warm or baseline is None or pruned_ppl is None else {
            "ppl_ratio": baseline / pruned_ppl, "ppl_reduction": baseline - pruned_ppl},
        "layers": layers,
        "overall_sparsity": layers_summary(layers),
        "defaults": rec.defaults,
        "selection": rec.selection,
        "wall_s": time.time() - rec.started,
        "resumed_at_step": rec.resumed_at,  # not None: wall_s is the time since this attempt began, steps the whole run's
    }


def finetune_report(rec: ReportRecord, staging: Path) -> dict[str, Any]:
    """The retraining job's report: the one-shot (or dense) model before, the retrained one after, in the same layout."""
    cfg = rec.cfg
    if cfg.finetune is None:
        raise ValueError("finetune_report is the retraining job's report: its config names --finetune full or lora")
    finetune = cfg.finetune
    layers = verified_layers(staging, rec.expected_zeros, rec.goals, cfg.targets) if rec.expected_zeros else {}
    steady = rec.step_times[1:] or rec.step_times
    tail = rec.losses[-min(len(rec.losses), TAIL_STEPS):]
    lora = finetune.value == "lora"
    merged = ", LoRA adapters merged" + (" and the mask re-applied" if rec.expected_zeros else "")  # dense control: none
    measured_on = "the engine's weights" + (f"{merged} (the export's weights)" if lora else "")
    return {
        **_common(rec),
        "finetune": finetune.value, "lora": {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha} if lora else None,
        "steps": cfg.steps, "tokens": cfg.steps * rec.global_batch * cfg.seqlen, "calibration": rec.calibration,
        "final_loss": rec.losses[-1], "final_loss_mean_tail": sum(tail) / len(tail),
        "tail_steps": len(tail),  # TAIL_STEPS, or every step of a shorter run (an audit: "last_32" over 8 steps)
        "step_time_s": sum(steady) / len(steady),
        "lambda": None, "residual": None, "admm_state_bytes_per_param": None,
        "ppl": {**_perplexities(rec, dense=None, before_finetune=rec.baseline_ppl, pruned=rec.final_ppl),
                "measured_on": measured_on},
        "layers": layers, "overall_sparsity": layers_summary(layers) if layers else 0.0,
        "defaults": rec.defaults, "wall_s": time.time() - rec.started, "resumed_at_step": rec.resumed_at,
    }


def oneshot_report(rec: ReportRecord, staging: Path) -> dict[str, Any]:
    """The one-shot job's report, in the ELSA report's layout (ADMM fields None)."""
    cfg = rec.cfg
    layers = verified_layers(staging, rec.expected_zeros, rec.goals, cfg.targets)
    return {
        **_common(rec),
        "steps": 0,
        "tokens": rec.calibration["sequences"] * cfg.seqlen if rec.calibration else 0,
        "device": rec.device,
        "calibration": rec.calibration,
        "final_loss": None,
        "lambda": None,
        "residual": None,
        "admm_state_bytes_per_param": None,
        "prune_s": rec.prune_s,
        "ppl": _perplexities(rec, dense=rec.dense_ppl, pruned=rec.final_ppl),
        "layers": layers,
        "overall_sparsity": layers_summary(layers),
        "wall_s": time.time() - rec.started,
    }


def publish_report(result: dict[str, Any], staging: Path, opts: JobOptions, keep_checkpoints: bool,
                   mark: Callable[[str], None] | None = None) -> None:
    """Write the report into the staged output (first re-encoded as elsa-sparse with --export_format sparse), publish
    the output in place of --output_dir (``mark``: the job's phase log, which tells the watchdog), print the summary."""
    if opts.export_format == "sparse":
        result["export"] = sparse_export(staging, result["layers"])
        log.info(f"elsa-sparse checkpoint: the pruned layers take {result['export']['pruned_ratio']:.3f}x their dense "
                 f"bytes, the weight files {result['export']['files_ratio']:.3f}x")
    write(staging / REPORT_NAME, result)
    publish(staging, opts.output_dir, keep_checkpoints=keep_checkpoints, announce=mark)
    print_summary(result, opts.output_dir)


def sparse_export(staging: Path, layers: dict[str, dict]) -> dict[str, Any]:
    """Re-encode the verified dense export in ``staging`` as an elsa-sparse checkpoint; the report's ``export`` entry.

    Every pruned layer is stored sparse: the code's threshold is lowered to the least sparse pruned layer when that is
    below its default."""
    pruned = [layer["sparsity"] for layer in layers.values() if layer["sparsity"] > 0]
    stored = compress_in_place(staging, min([DEFAULT_MIN_SPARSITY, *pruned]))
    return {"format": "sparse", "pruned_dense_bytes": stored["pruned_dense_bytes"], "pruned_bytes": stored["pruned_bytes"],
            "pruned_ratio": stored["pruned_bytes"] / stored["pruned_dense_bytes"], "dense_files_bytes": stored["input_bytes"],
            "files_bytes": stored["output_bytes"], "files_ratio": stored["output_bytes"] / stored["input_bytes"]}


def _common(rec: ReportRecord) -> dict[str, Any]:
    cfg = rec.cfg
    return {"model": cfg.model, "method": rec.method, "dataset": source_name(cfg.dataset), "sparsity": cfg.sparsity, "pattern": cfg.pattern,
            "sparsity_profile": cfg.sparsity_profile, "world_size": rec.world, "deepspeed_config": rec.deepspeed,
            "deepspeed_resolved": rec.deepspeed_resolved,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
            "loss_path": loss_taken(),  # the training loss's: "fused" (the Triton kernel), "chunked" (torch)
            "config": {**cfg.model_dump(mode="json"), "dataset": source_name(cfg.dataset)}, "versions": versions()}


def _perplexities(rec: ReportRecord, **ppl: float | None) -> dict[str, Any]:
    """A report's ``ppl``: the perplexities, the validation windows they were scored on, and ``computed_in``: the dtype
    and place of each figure that was measured."""
    return {**ppl, **_validation(rec.validation),
            "computed_in": {k: v for k, v in rec.computed_in.items() if ppl.get(k) is not None}}


def _validation(d: dict[str, Any]) -> dict[str, Any]:
    """The windows' count, length and protocol, and which text they come from (never the training part)."""
    return {"windows": d["windows"], "seqlen": d["seqlen"], "protocol": d["protocol"],
            "validation": {k: d[k] for k in ("source", "part", "documents", "text_tokens")}}


def print_summary(result: dict[str, Any], output_dir: Path) -> None:
    p = result["ppl"]
    log.info(f"wrote {output_dir} ({len(result['layers'])} layers, each exactly at its target; overall sparsity "
             f"{result['overall_sparsity']:.4f})")
    if p.get("before_finetune") is not None:
        lora = f" (LoRA adapters merged{', the mask re-applied' if result['layers'] else ''})" if result.get("lora") else ""
        log.info(f"validation perplexity over {p['windows']} windows of {p['seqlen']}: before fine-tuning "
                 f"{p['before_finetune']:.3f} | after {p['pruned']:.3f}{lora}")
        if p["pruned"] is not None and p["pruned"] > p["before_finetune"]:  # as ELSA's below (a user's walk: only ELSA's)
            log.warning(worse_than_start(result, "fine-tuning"))
        return
    if p["pruned"] is None:  # no validation windows
        return
    dense = "" if p["dense"] is None else f"dense {p['dense']:.3f} | "  # a pruned model as --model: no dense model
    if result["method"] != "elsa":
        log.info(f"validation perplexity ({_where(p)}): {dense}{result['method']} {p['pruned']:.3f}")
        return
    baseline, what = (p["warm_start"], f"warm start ({result['init_mask']})") if result["init_weights"] else \
        (p["magnitude_oneshot"], "one-shot magnitude")
    shown = "" if baseline is None else f"{what} {baseline:.3f} | "  # --baseline none, or skipped: said where it was
    log.info(f"validation perplexity ({_where(p)}): {dense}{shown}ELSA {p['pruned']:.3f}{_arithmetic(p)}")
    _say_selection(result)
    if result["vs_magnitude"]:
        log.info(f"ELSA perplexity is {_compared(result['vs_magnitude']['ppl_ratio'], 'one-shot magnitude pruning')}")
    elif result["init_weights"] and baseline is not None:
        start = f"its warm start ({result['init_mask']})"
        log.info(f"ELSA perplexity is {_compared(baseline / p['pruned'], start)}")
        if p["pruned"] > baseline:
            log.warning(worse_than_start(result))


def _say_selection(result: dict[str, Any]) -> None:
    """--select_every: where the run stopped and which model the export holds, when that is not the last step's
    projection (an audit, 2026-12-07: an early stop and a warm start never beaten were both reported as the full run)."""
    selection = result.get("selection") or {}
    if selection.get("stopped_at"):
        log.info(f"stopped early at step {selection['stopped_at']} of {result['planned_steps']} (--select_patience)")
    chosen = selection.get("chosen")
    if not chosen or chosen["final"]:
        return
    if chosen["step"] == 0:
        log.warning(f"no scored projection beat the warm start ({result['init_mask']}): the export holds the warm start "
                    "unchanged, and the ELSA figure above is its perplexity; train longer or with another --lr")
    else:
        log.info(f"the export holds the best scored projection, of step {chosen['step']} (--select_every)")


def worse_than_start(result: dict[str, Any], who: str = "ELSA") -> str:
    """What to change when ELSA (or a retraining run) ended above the perplexity of the pruned model it started from:
    its lr, first."""
    lr, steps = result["config"]["lr"], result.get("planned_steps", result["steps"])  # the schedule's, an early stop's too
    applied = (result.get("defaults") or {}).get("applied", {})
    whose = "the defaults rule's" if "lr" in applied else "your"
    more = "--finetune_steps" if result.get("finetune") else "--steps"  # the retraining's own count (an audit)
    # a user's walk: a user's lr keeps the paper's dense start, which the rule's pruned start beats at short budgets
    start = (f" with --init_mask {result['init_mask']} --init_weights (without them your lr starts from the dense model)"
             if "init_mask" in applied and result.get("init_weights") else "")
    return (f"{who} ended worse than the pruned model it started from: {whose} lr {lr:g} is likely too large for "
            f"{steps} steps; pass a smaller --lr (e.g. {lr / 4:.2g}){start} or more {more}")


def _compared(ratio: float, other: str) -> str:
    """'1.250x lower than other' for a baseline / ELSA perplexity ratio of 1.25; '1.250x HIGHER than other' for 0.8 (never
    '0.80x lower'); 'the same as other' where the ratio is 1 to the digits shown (an audit, 2026-12-07: an export that
    was its warm start unchanged read "1.000x lower than its warm start")."""
    if f"{ratio:.3f}" == "1.000" or f"{1 / ratio:.3f}" == "1.000":
        return f"the same as {other} (to 0.1 %)"
    return f"{ratio:.3f}x lower than {other}" if ratio > 1 else f"{1 / ratio:.3f}x HIGHER than {other}"


def _arithmetic(p: dict[str, Any]) -> str:
    """Where the perplexities of one line were computed in other dtypes (an audit, 2026-12-07: on a CPU-only machine
    the dense model scored on rank 0's fp32 host copy, the warm start and ELSA on the bf16 engine: one SparseGPT model
    73.853 in its one-shot job and 73.866 as ELSA's start), each figure's; else nothing."""
    shown = {k: v for k, v in (p.get("computed_in") or {}).items() if p.get(k) is not None}
    if len({v.split(" ")[0] for v in shown.values()}) < 2:
        return ""
    names = {"pruned": "ELSA", "magnitude_oneshot": "one-shot magnitude", "warm_start": "warm start"}  # as the line says
    each = [f"{names.get(k, k)} in {v}" for k, v in shown.items()]
    return f" ({', '.join(each)}: the fourth digit may differ)"


def _where(p: dict[str, Any]) -> str:
    return f"{p['validation']['source']}, {p['windows']} windows of {p['seqlen']}, {p['protocol']['name']} protocol"


def evaluate_saved_model(output_dir: Path, cfg: ElsaConfig) -> dict[str, Any]:
    """Evaluate a job's saved model in the job's own process (rank 0, after its last collective) with the code
    behind ``launch/evaluate.py``; the full result goes to ``eval.json``/``eval.md``, a summary into the report."""
    from elsa_ds.evaluation.zeroshot import expand_tasks
    from elsa_ds.jobs.evaluate import EvalSettings, run

    log.info(f"evaluating {output_dir} (ppl: {cfg.eval_ppl or 'none'}; tasks: {cfg.eval_tasks or 'none'})")
    result = run(EvalSettings(
        model=str(output_dir), ppl=list(cfg.eval_ppl), tasks=expand_tasks(cfg.eval_tasks) if cfg.eval_tasks else [],
        include_path=cfg.eval_include_path, seqlen=cfg.seqlen, ppl_protocol=cfg.ppl_protocol.value,
        device_map="auto" if torch.cuda.is_available() else None,
        output=output_dir / "eval.json", markdown=output_dir / "eval.md", overwrite=True,  # the job owns output_dir
    ))
    report_path = output_dir / REPORT_NAME
    saved = json.loads(report_path.read_text())
    saved["evaluation"] = {"file": "eval.json", "ppl": {k: v["ppl"] for k, v in result["ppl"].items()},
                           "tasks": {k: v.get("acc") for k, v in result["tasks"].items()}, "average_acc": result["average_acc"]}
    write_json(report_path, saved)
    return result
