"""The entry points' argument parsing: generated from the settings models, so a flag exists exactly once.

``elsa-prune`` flags come from :class:`~elsa_ds.config.JobOptions` and :class:`~elsa_ds.config.ElsaConfig`
(name, type, choices, default, help = the field's docstring); ``python -m elsa_ds.cli --flag-table`` prints the
README's flag table from the same fields. Errors become one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import enum
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from elsa_ds.config import DEMO_PROFILE, ElsaConfig, JobOptions
from elsa_ds.errors import ElsaError
from elsa_ds.version import __version__

GROUP_TITLES = {
    "run": "the job (not ELSA settings: never in a recipe or the JSON's \"elsa\" block)",
    "job": "what is pruned",
    "sparsity": "sparsity, pattern, one-shot methods",
    "data": "data and validation",
    "admm": "ADMM",
    "finetune": "retraining a one-shot mask, and the dense control (--method dense)",
    "optimizer": "the optimizer ADMM wraps",
    "engine": "engine, checkpoints, logging",
    "evaluation": "evaluation of the saved model at the end (the launch/evaluate.py protocol, rank 0 alone)",
}


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("DeepSpeed", "deepspeed", "transformers", "datasets", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)


def guarded(fn: Callable[[], int | None]) -> int:
    """Run ``fn``; an ElsaError becomes one line on stderr and exit code 2, with no traceback."""
    try:
        return fn() or 0
    except ElsaError as err:
        rank = os.environ.get("RANK", "0")
        print(f"elsa_ds: error: {err}" if rank == "0" else f"elsa_ds: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        return 2


# ---- flags from fields ---------------------------------------------------------------------------------------------
def _cli_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {name: f for name, f in model.model_fields.items() if (f.json_schema_extra or {}).get("cli", True)}


def _argument(name: str, field: FieldInfo, flag_default: bool) -> tuple[list[str], dict[str, Any]]:
    """argparse's add_argument for one field; not given = None, so lower-precedence sources keep their value."""
    kind = _unwrap(field.annotation)
    extra = field.json_schema_extra or {}
    kwargs: dict[str, Any] = {"help": _help(name, field), "default": None}
    if kind is bool:
        kwargs.update(action="store_true", default=False) if flag_default else kwargs.update(action=argparse.BooleanOptionalAction)
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["choices"] = [m.value for m in kind]
    elif typing.get_origin(kind) is tuple:
        kwargs.update(nargs=len(typing.get_args(kind)), type=typing.get_args(kind)[0])
    elif typing.get_origin(kind) is list:
        kwargs["type"] = str
    else:
        kwargs["type"] = kind
    if field.is_required():
        kwargs["required"] = True
    if "metavar" in extra:
        kwargs["metavar"] = tuple(extra["metavar"].split()) if "nargs" in kwargs else extra["metavar"]
    return [f"--{name}"], kwargs


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return args[0] if is_union and len(args) == 1 else annotation


def _described(name: str, field: FieldInfo) -> tuple[str, str]:
    """(meaning, default as shown): a docstring ending in ``[...]`` states its own default (e.g. the demo's)."""
    text = (field.description or "").strip()
    stated = re.search(r"\s*\[([^\]]*)\]\.?$", text)
    if stated:
        return text[:stated.start()] + ".", stated.group(1)
    return text, "required" if field.is_required() else _default_text(name, field)


def _help(name: str, field: FieldInfo) -> str:
    text, default = _described(name, field)
    text = text if field.is_required() else f"{text.removesuffix('.')} [{default}]"
    return text.replace("%", "%%")  # argparse %-formats help strings ("10%" would be a format spec)


def _default_text(name: str, field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    shown = default.value if isinstance(default, enum.Enum) else "none" if default in (None, []) else default
    if isinstance(default, bool):
        shown = "on" if default else "off"
    if isinstance(default, tuple):
        shown = " ".join(str(x) for x in default)
    return f"{shown}; demo: {DEMO_PROFILE[name]}" if name in DEMO_PROFILE else str(shown)


def prune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elsa-prune", description="Prune a causal LM with ELSA (ADMM, objective-aware projection) "
                                "under DeepSpeed ZeRO-3, or with a one-shot baseline.")
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    groups: dict[str, argparse._ArgumentGroup] = {}
    for model, flag_default in ((JobOptions, True), (ElsaConfig, False)):
        for name, field in _cli_fields(model).items():
            group = (field.json_schema_extra or {}).get("group", "job")
            if group not in groups:
                groups[group] = p.add_argument_group(GROUP_TITLES.get(group, group))
            flags, kwargs = _argument(name, field, flag_default)
            groups[group].add_argument(*flags, **kwargs)
    return p


def flag_table() -> str:
    """The README's flag table, from the same fields as the parser."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for model in (JobOptions, ElsaConfig):
        for name, field in _cli_fields(model).items():
            text, default = _described(name, field)
            kind = _unwrap(field.annotation)
            if isinstance(kind, type) and issubclass(kind, enum.Enum) and not all(m.value in text for m in kind):
                text += f" Choices: {', '.join(m.value for m in kind)}."
            lines.append(f"| `--{name}` | {default} | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def settings_from_args(args: argparse.Namespace):
    """(JobOptions, ElsaConfig, DsConfig) from parsed flags: the JSON read, a recipe merged, everything validated."""
    from elsa_ds.config import job_options, load_recipe, resolve_config
    from elsa_ds.zero.ds_config import DsConfig

    opts = job_options({k: getattr(args, k) for k in _cli_fields(JobOptions)})
    ds_config = DsConfig.load(opts.deepspeed)
    recipe = load_recipe(opts.recipe) if opts.recipe else None
    cfg = resolve_config(ds_config.raw, {k: getattr(args, k) for k in _cli_fields(ElsaConfig)}, source=opts.deepspeed, recipe=recipe)
    return opts, cfg, ds_config


def main_prune(argv: list[str] | None = None) -> int:
    args = prune_parser().parse_args(argv)
    _quiet_libraries()

    def go() -> None:
        from elsa_ds.jobs import make_job, run_job

        opts, cfg, ds_config = settings_from_args(args)
        run_job(make_job(cfg, opts, ds_config))

    return guarded(go)


# ---- elsa-estimate ----------------------------------------------------------------------------------------------------
def estimate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elsa-estimate", description="Estimate GPU, CPU and NVMe memory of an ELSA job from configs alone.")
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    p.add_argument("--model", required=True, help="hub id (shipped configs resolve offline), model directory or config.json")
    p.add_argument("--deepspeed", required=True, metavar="CFG", help="DeepSpeed JSON by path or shipped name (its \"elsa\" block sets "
                   "state dtypes and optimizer)")
    p.add_argument("--num_gpus", type=int, default=1, help="GPUs (ranks) per node [1]")
    p.add_argument("--num_nodes", type=int, default=1, help="nodes [1]")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per GPU per forward [the JSON's]")
    p.add_argument("--batch_size", type=int, default=None, help="global batch in sequences [the JSON's train_batch_size]")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per sequence [2048]")
    p.add_argument("--targets", default=None, help="regex of pruned modules [decoder-layer Linears]")
    p.add_argument("--no_gradient_checkpointing", action="store_true", help="estimate activations without checkpointing")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def main_estimate(argv: list[str] | None = None) -> int:
    args = estimate_parser().parse_args(argv)
    _quiet_libraries()

    def go() -> None:
        from elsa_ds.memory import estimate_job, format_estimate

        if args.num_gpus <= 0 or args.num_nodes <= 0:
            raise ElsaError("--num_gpus and --num_nodes must be positive")
        est = estimate_job(args.model, args.deepspeed, args.num_gpus, args.num_nodes,
                           {"micro_batch": args.micro_batch, "batch_size": args.batch_size, "seqlen": args.seqlen,
                            "targets": args.targets, "gradient_checkpointing": not args.no_gradient_checkpointing})
        print(format_estimate(est, args.model, args.deepspeed, args.num_gpus, args.num_nodes), flush=True)
        if args.json:
            print(est.to_json())

    return guarded(go)


# ---- elsa-evaluate ----------------------------------------------------------------------------------------------------
def evaluate_parser() -> argparse.ArgumentParser:
    from elsa_ds.data import PplProtocol
    from elsa_ds.evaluation.run import DTYPES

    p = argparse.ArgumentParser(
        prog="elsa-evaluate",
        description="Evaluate a (pruned) causal LM with the pruning papers' protocol: sparsity, perplexity, zero-shot accuracy.",
    )
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    p.add_argument("--model", metavar="ID_OR_DIR", help="hub id or saved model directory (required unless --compare)")
    p.add_argument("--ppl", default="", metavar="LIST",
                   help="comma list of wikitext2 | c4 | local .txt/.jsonl/.parquet path or directory [none]")
    p.add_argument("--tasks", nargs="?", const="paper", default=None, metavar="LIST",
                   help="comma list of lm-eval tasks, 0-shot; 'paper' or no value: boolq,rte,hellaswag,winogrande,"
                        "arc_easy,arc_challenge,openbookqa [none]")
    p.add_argument("--include_path", metavar="DIR", help="directory of local lm-eval task YAMLs")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per perplexity window [2048]")
    p.add_argument("--ppl_protocol", choices=[m.value for m in PplProtocol], default="auto",
                   help="stream: SparseGPT/Wanda (the text tokenized once, consecutive windows, BOS only where the tokenizer puts "
                        "it); window: the ELSA authors' Gemma protocol (the same windows, BOS overwrites each window's first "
                        "token, ppl = exp(sum NLL / (windows x seqlen))); auto: window for Gemma, stream otherwise [auto]")
    p.add_argument("--batch_size", type=int, default=1, help="windows / lm-eval requests per forward [1]")
    p.add_argument("--limit", type=int, default=None, help="examples per task and most windows per dataset; quick checks only [all]")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="weights' dtype [bf16 on CUDA, fp32 on CPU]")
    p.add_argument("--device_map", choices=["auto"], default=None,
                   help="spread a model too large for one GPU over GPUs, CPU and disk (CUDA only) [one device]")
    p.add_argument("--offload_folder", metavar="DIR",
                   help="parent of the temporary disk-offload directory for --device_map auto [system temp]")
    p.add_argument("--output", type=Path, metavar="FILE.json", help="write the result JSON here")
    p.add_argument("--markdown", type=Path, metavar="FILE.md", help="write the markdown table here")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="render result JSONs of several models as one markdown table, evaluate nothing")
    return p


def main_evaluate(argv: list[str] | None = None) -> int:
    parser = evaluate_parser()
    args = parser.parse_args(argv)
    if args.compare and (args.model or args.ppl or args.tasks):
        parser.error("--compare renders existing results; drop --model/--ppl/--tasks")
    if not args.compare and not args.model:
        parser.error("--model is required (or --compare A.json B.json ...)")
    _quiet_libraries()

    def go() -> None:
        from elsa_ds.evaluation.run import EvalSettings, run
        from elsa_ds.evaluation.tables import compare
        from elsa_ds.evaluation.zeroshot import expand_tasks
        from elsa_ds.io import write_atomic

        if args.compare:
            table = compare(args.compare)
            print(table, end="", flush=True)
            if args.markdown is not None:
                write_atomic(args.markdown, table)
            return
        run(EvalSettings(
            model=args.model, ppl=[s for s in (x.strip() for x in args.ppl.split(",")) if s],
            tasks=expand_tasks(args.tasks) if args.tasks is not None else [], include_path=args.include_path,
            seqlen=args.seqlen, ppl_protocol=args.ppl_protocol, batch_size=args.batch_size, limit=args.limit, dtype=args.dtype, device_map=args.device_map,
            offload_folder=args.offload_folder, output=args.output, markdown=args.markdown,
        ))

    return guarded(go)


if __name__ == "__main__":
    if sys.argv[1:] == ["--flag-table"]:
        print(flag_table(), end="")
    else:
        sys.exit(main_prune())
