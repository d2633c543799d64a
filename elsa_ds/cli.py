"""The entry points' argument parsing: generated from the settings models, so a flag exists exactly once.

Every flag is a field of a pydantic settings model (name, type, choices, default, help = the field's docstring):
``elsa-prune``'s are :class:`~elsa_ds.config.JobOptions` and :class:`~elsa_ds.config.ElsaConfig`;
``elsa-estimate`` takes the job settings it shares with them from the same fields, plus :class:`EstimateOptions`;
``elsa-evaluate``'s are :class:`~elsa_ds.evaluation.run.EvalSettings`. ``python -m elsa_ds.cli --flag-table`` prints
the README's flag table from the fields of ``elsa-prune``. Errors become one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import enum
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from elsa_ds.config import DEMO_PROFILE, ElsaConfig
from elsa_ds.options import JobOptions
from elsa_ds.errors import ElsaError, OneLineParser, format_validation_error, guarded  # noqa: F401 (guarded: the entry points')
from elsa_ds.log import get_logger, setup_logging
from elsa_ds.version import __version__

log = get_logger(__name__)

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


def validated(model: type[BaseModel], values: dict[str, Any], where: str = "the command line") -> Any:
    """``model(**values)``, or one ElsaError naming every bad value."""
    try:
        return model(**values)
    except ValidationError as err:
        raise ElsaError(format_validation_error(err, where, model)) from None


def positive_int(text: str) -> int:
    """argparse's type for a count of at least 1 that no settings model holds (launch/ablate_offload.py's --num_gpus)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def start_logging(args: argparse.Namespace) -> None:
    """The console of this process at ``--log_level`` (rank 0; other ranks log warnings only)."""
    setup_logging(args.log_level or JobOptions.model_fields["log_level"].default)


# ---- flags from fields ---------------------------------------------------------------------------------------------
def _cli_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {name: f for name, f in model.model_fields.items() if (f.json_schema_extra or {}).get("cli", True)}


def _choices(kind: Any) -> list[str] | None:
    """The allowed values of an Enum or Literal field, else None."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [m.value for m in kind]
    return [str(v) for v in typing.get_args(kind)] if typing.get_origin(kind) is typing.Literal else None


def _argument(name: str, field: FieldInfo, flag_default: bool, model: type[BaseModel]) -> dict[str, Any]:
    """argparse's add_argument keywords for one field; not given = None, so lower-precedence sources keep their value."""
    kind = _unwrap(field.annotation)
    extra = field.json_schema_extra or {}
    kwargs: dict[str, Any] = {"help": _help(name, field, model), "default": None}
    if kind is bool:
        kwargs.update(action="store_true", default=False) if flag_default else kwargs.update(action=argparse.BooleanOptionalAction)
    elif _choices(kind) is not None:
        kwargs["choices"] = _choices(kind)
    elif typing.get_origin(kind) is tuple:
        kwargs.update(nargs=len(typing.get_args(kind)), type=typing.get_args(kind)[0])
    elif typing.get_origin(kind) is list:
        kwargs["type"] = str  # a comma list, read by the model's validator (config.comma_list)
    else:
        kwargs["type"] = kind
    if "const" in extra:  # the flag alone means this value (e.g. --tasks = --tasks paper)
        kwargs.update(nargs="?", const=extra["const"])
    if field.is_required():
        kwargs["required"] = True
    if "metavar" in extra:
        kwargs["metavar"] = tuple(extra["metavar"].split()) if "nargs" in kwargs and "const" not in extra else extra["metavar"]
    return kwargs


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> X; ``Annotated[X, ...]`` -> X."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return args[0] if is_union and len(args) == 1 else annotation


def _described(name: str, field: FieldInfo, model: type[BaseModel]) -> tuple[str, str]:
    """(meaning, default as shown): a docstring ending in ``[...]`` states its own default (e.g. the demo's)."""
    text = " ".join((field.description or "").split())  # a docstring wrapped over lines is one paragraph
    stated = re.search(r"\s*\[([^\]]*)\]\.?$", text)
    if stated:
        return text[:stated.start()] + ".", stated.group(1)
    return text, "required" if field.is_required() else _default_text(name, field, model)


def _help(name: str, field: FieldInfo, model: type[BaseModel]) -> str:
    text, default = _described(name, field, model)
    text = text if field.is_required() else f"{text.removesuffix('.')} [{default}]"
    return text.replace("%", "%%")  # argparse %-formats help strings ("10%" would be a format spec)


def _default_text(name: str, field: FieldInfo, model: type[BaseModel]) -> str:
    default = field.get_default(call_default_factory=True)
    shown = default.value if isinstance(default, enum.Enum) else "none" if default in (None, []) else default
    if isinstance(default, bool):
        shown = "on" if default else "off"
    if isinstance(default, tuple):
        shown = " ".join(str(x) for x in default)
    demo = model is ElsaConfig and name in DEMO_PROFILE  # the demo's profile applies to the job's settings only
    return f"{shown}; demo: {DEMO_PROFILE[name]}" if demo else str(shown)


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], names: tuple[str, ...] | None = None,
              flag_default: bool = False, grouped: bool = False, optional: tuple[str, ...] = ()) -> None:
    """One flag per field of ``model`` (or the fields ``names``), in argument groups by the field's group if ``grouped``.

    ``flag_default``: a bool field is a plain switch (off unless given) instead of --X / --no-X; ``optional``: fields
    that are required by the model but may be left out on this command line (checked after parsing).
    """
    fields = _cli_fields(model)
    groups: dict[str, Any] = {}
    for name in names or tuple(fields):
        field = fields[name]
        kwargs = _argument(name, field, flag_default, model)
        if name in optional:
            kwargs["required"] = False
        target: Any = parser
        if grouped:
            group = (field.json_schema_extra or {}).get("group", "job")
            if group not in groups:
                groups[group] = parser.add_argument_group(GROUP_TITLES.get(group, group))
            target = groups[group]
        target.add_argument(f"--{name}", **kwargs)
        if kwargs.get("action") is argparse.BooleanOptionalAction:  # --no_X too: the spelling of every other flag
            target.add_argument(f"--no_{name}", dest=name, action="store_false", default=None, help=argparse.SUPPRESS)


def prune_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="elsa-prune", description="Prune a causal LM with ELSA (ADMM, objective-aware projection) "
                                "under DeepSpeed ZeRO-3, or with a one-shot baseline.")
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    add_flags(p, JobOptions, flag_default=True, grouped=True)
    add_flags(p, ElsaConfig, grouped=True)
    return p


def flag_table() -> str:
    """The README's flag table, from the same fields as the parser."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for model in (JobOptions, ElsaConfig):
        for name, field in _cli_fields(model).items():
            text, default = _described(name, field, model)
            choices = _choices(_unwrap(field.annotation)) or []
            if choices and not all(c in text for c in choices):
                text += f" Choices: {', '.join(choices)}."
            lines.append(f"| `--{name}` | {default} | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def settings_from_args(args: argparse.Namespace):
    """(JobOptions, ElsaConfig, DsConfig) from parsed flags: the JSON read, a recipe merged, everything validated."""
    from elsa_ds.options import job_options
    from elsa_ds.zero.ds_config import DsConfig

    opts = job_options({k: v for k in _cli_fields(JobOptions) if (v := getattr(args, k)) is not None})
    ds_config = DsConfig.load(opts.deepspeed)
    cfg = resolved_settings(ds_config, opts.deepspeed, opts.recipe, {k: getattr(args, k) for k in _cli_fields(ElsaConfig)})
    return opts, cfg, ds_config


def resolved_settings(ds_config, deepspeed: str, recipe: str | None, given: dict[str, Any]) -> ElsaConfig:
    """ElsaConfig from the flags ``given`` (None: not given) over the JSON's ``elsa`` block and a recipe, validated; ELSA's
    own flags refused for another method."""
    from elsa_ds.config import load_recipe, refuse_unread_elsa_settings, resolve_config

    settings = load_recipe(recipe) if recipe else None
    cfg = resolve_config(ds_config.raw, given, source=deepspeed, recipe=settings, recipe_source=f"recipe {recipe}")
    refuse_unread_elsa_settings(cfg, given, "--")
    return cfg


def main_prune(argv: list[str] | None = None) -> int:
    args = prune_parser().parse_args(argv)
    start_logging(args)

    def go() -> None:
        from elsa_ds.jobs.owner import run_owned

        opts, cfg, ds_config = settings_from_args(args)
        run_owned(cfg, opts, ds_config)

    return guarded(go)


# ---- elsa-estimate ----------------------------------------------------------------------------------------------------
class EstimateOptions(BaseModel):
    """elsa-estimate's own settings; the job's settings it shares with elsa-prune are ESTIMATE_SHARED."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str = Field(..., json_schema_extra={"metavar": "ID_OR_DIR"})
    """Hub id (shipped configs resolve offline), model directory or config.json."""
    num_gpus: int = Field(1, gt=0)
    """GPUs (ranks) per node."""
    num_nodes: int = Field(1, gt=0)
    """Nodes."""


# The job settings the estimate depends on, read as elsa-prune reads them (not given: a recipe's, the JSON "elsa" block's,
# the demo profile's, the defaults rule's or the field's default): the batch and its activations, what is pruned and
# trained, the optimizer's and ADMM's state types, and what decides a one-shot warm start (--init_mask, or the defaults
# rule's SparseGPT start from steps, sparsity and a user's lr) and its working set. --random_init is not among them: both
# load paths build into partitions module by module under zero.Init.
ESTIMATE_SHARED: dict[type[BaseModel], tuple[str, ...]] = {
    JobOptions: ("deepspeed", "recipe", "log_level"),
    ElsaConfig: ("seqlen", "batch_size", "micro_batch", "targets", "gradient_checkpointing", "freeze_embeddings", "base_optimizer",
                 "z_dtype", "u_dtype", "projection", "steps", "sparsity", "pattern", "sparsity_profile", "lr", "init_mask",
                 "init_weights", "nsamples", "val_windows"),
}


def estimated_job(args: argparse.Namespace, opts: EstimateOptions, ds_config) -> ElsaConfig:
    """The ElsaConfig of the job elsa-estimate sizes, resolved as elsa-prune resolves it: flags over the JSON's ``elsa``
    block and a recipe, then the defaults rule (which may start from a SparseGPT-pruned model: a one-shot warm start)."""
    from elsa_ds.jobs.defaults_applied import apply_defaults
    from elsa_ds.memory import model_config
    from elsa_ds.methods import ELSA

    model = Path(opts.model).expanduser()
    given = {**{k: getattr(args, k) for k in ESTIMATE_SHARED[ElsaConfig]}, "model": str(model.parent) if model.is_file() else opts.model}
    cfg = resolved_settings(ds_config, args.deepspeed, args.recipe, given)
    if cfg.method.value != ELSA:
        raise ElsaError(f"elsa-estimate sizes ELSA jobs, but the recipe or the JSON's elsa block sets method {cfg.method.value}")
    cfg, defaults = apply_defaults(cfg, model_config(cfg.model))
    if defaults["applied"]:
        log.info("[elsa_ds] from the defaults rule: " + "; ".join(f"{k} {v}" for k, v in defaults["applied"].items()))
    return cfg


def estimate_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="elsa-estimate", description="Estimate GPU, CPU and NVMe memory of an ELSA job from configs alone.")
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    add_flags(p, EstimateOptions)
    for model, names in ESTIMATE_SHARED.items():
        add_flags(p, model, names)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")  # output format, no setting
    return p


def main_estimate(argv: list[str] | None = None) -> int:
    args = estimate_parser().parse_args(argv)
    start_logging(args)

    def go() -> None:
        from elsa_ds.memory import estimate_config, format_estimate
        from elsa_ds.zero.ds_config import DsConfig

        opts = validated(EstimateOptions, {k: getattr(args, k) for k in _cli_fields(EstimateOptions) if getattr(args, k) is not None})
        ds_config = DsConfig.load(args.deepspeed)
        est = estimate_config(estimated_job(args, opts, ds_config), ds_config, opts.num_gpus, opts.num_nodes)
        # the table and the JSON line are the command's product: stdout, whatever the log level
        print(format_estimate(est, opts.model, args.deepspeed, opts.num_gpus, opts.num_nodes), flush=True)
        if args.json:
            print(est.to_json())

    return guarded(go)


# ---- elsa-evaluate ----------------------------------------------------------------------------------------------------
def evaluate_parser() -> argparse.ArgumentParser:
    from elsa_ds.evaluation.run import EvalSettings

    p = OneLineParser(
        prog="elsa-evaluate",
        description="Evaluate a (pruned) causal LM with the pruning papers' protocol: sparsity, perplexity, zero-shot accuracy.",
    )
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    add_flags(p, EvalSettings, optional=("model",))
    add_flags(p, JobOptions, ("log_level",))
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="render result JSONs of several models as one markdown table, evaluate nothing")
    return p


def main_evaluate(argv: list[str] | None = None) -> int:
    from elsa_ds.evaluation.run import EvalSettings

    parser = evaluate_parser()
    args = parser.parse_args(argv)
    if args.compare and (args.model or args.ppl or args.tasks):
        parser.error("--compare renders existing results; drop --model/--ppl/--tasks")
    if not args.compare and not args.model:
        parser.error("--model is required (or --compare A.json B.json ...)")
    start_logging(args)

    def go() -> None:
        from elsa_ds.evaluation.run import run
        from elsa_ds.evaluation.tables import compare
        from elsa_ds.io import write_atomic

        if args.compare:
            table = compare(args.compare)
            print(table, end="", flush=True)  # the table is the command's product: stdout
            if args.markdown is not None:
                write_atomic(args.markdown, table)
            return
        from elsa_ds.evaluation.run import check_settings
        from elsa_ds.ownership import owned

        settings = validated(EvalSettings, {k: v for k in _cli_fields(EvalSettings) if (v := getattr(args, k)) is not None})
        check_settings(settings)  # again under the lock, by run: a refusal for the path itself comes first
        with owned(settings.output, "--output"):
            run(settings)

    return guarded(go)


if __name__ == "__main__":
    if sys.argv[1:] == ["--flag-table"]:
        print(flag_table(), end="")  # the table is the product
    else:
        sys.exit(main_prune())
