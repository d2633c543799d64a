"""The entry points' flags, generated from the settings models, so a flag exists exactly once.

Every flag is a field of a pydantic settings model: its name, type, choices, default, and help (the field's docstring;
one ending in ``[...]`` states its own default). A field with ``json_schema_extra={"positional": True}`` is a positional
argument, one with ``{"cli": False}`` no flag at all. ``elsa_ds/cli.py`` builds ``elsa-prune``'s, ``elsa-estimate``'s and
``elsa-evaluate``'s parsers from these; ``elsa-compress`` (``sparse/cli.py``) too.
"""
from __future__ import annotations

import argparse
import enum
import functools
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from elsa_ds.errors import ElsaError, SettingsError
from elsa_ds.quoting import format_validation_error, shell_word
from elsa_ds.log import setup_logging
from elsa_ds.settings.config import DEMO_PROFILE, ElsaConfig
from elsa_ds.settings.config_files import comma_paths, name_problem
from elsa_ds.settings.options import JobOptions

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
        raise SettingsError(format_validation_error(err, where, model)) from None


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
def cli_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {name: f for name, f in model.model_fields.items() if extra_of(f).get("cli", True)}


def extra_of(field: FieldInfo) -> dict[str, Any]:
    """A field's ``json_schema_extra`` (how it is spelt on the command line: group, metavar, positional ...)."""
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def _choices(kind: Any) -> list[str] | None:
    """The allowed values of an Enum or Literal field, else None."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [m.value for m in kind]
    return [str(v) for v in typing.get_args(kind)] if typing.get_origin(kind) is typing.Literal else None


PATH_METAVARS = ("CFG", "DIR", "FILE", "ID_OR_DIR", "METHOD_OR_DIR", "NAME_OR_FILE", "SOURCE", "LIST")  # LIST: of sources


def _may_name_a_path(kind: Any, extra: dict[str, Any]) -> bool:
    return kind is Path or str(extra.get("metavar", "")).split(".")[0] in PATH_METAVARS


@functools.cache  # one function per kind: the flags elsa-prune shares with elsa-estimate parse alike
def _named(convert: Callable[[str], Any], a_list: bool = False) -> Callable[[str], Any]:
    """argparse's type for a text flag, which may name a path: refused there when no path can be what it says (too long
    for the file system, an unknown ~user: ``name_problem``), for the checks that ask the file system raise on it (an
    audit: OSError and RuntimeError tracebacks from elsa-prune, elsa-evaluate, elsa-compress)."""
    def parse(text: str) -> Any:
        for part in comma_paths(text) if a_list else [text]:
            if problem := name_problem(part):
                raise argparse.ArgumentTypeError(f"{part[:80]!r}{'...' if len(part) > 80 else ''}: {problem}")
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "text")  # argparse names the type in its "invalid X value"
    return parse


def _argument(name: str, field: FieldInfo, flag_default: bool, model: type[BaseModel]) -> dict[str, Any]:
    """argparse's add_argument keywords for one field; not given = None, so lower-precedence sources keep their value."""
    kind = _unwrap(field.annotation)
    extra = extra_of(field)
    kwargs: dict[str, Any] = {"help": _help(name, field, model), "default": None}
    if kind is bool:
        kwargs.update(action="store_true", default=False) if flag_default else kwargs.update(action=argparse.BooleanOptionalAction)
    elif _choices(kind) is not None:
        kwargs["choices"] = _choices(kind)
    elif typing.get_origin(kind) is tuple:
        kwargs.update(nargs=len(typing.get_args(kind)), type=typing.get_args(kind)[0])
    elif typing.get_origin(kind) is list:  # a comma list, read by the model's validator (config_files: comma_list, comma_paths for paths)
        kwargs["type"] = _named(str, True) if _may_name_a_path(kind, extra) else str
    else:
        kwargs["type"] = _named(kind) if _may_name_a_path(kind, extra) else kind
    if "const" in extra:  # the flag alone means this value (e.g. --tasks = --tasks paper)
        kwargs.update(nargs="?", const=extra["const"])
    if field.is_required():
        kwargs["required"] = True
    if "metavar" in extra:
        kwargs["metavar"] = tuple(extra["metavar"].split()) if "nargs" in kwargs and "const" not in extra else extra["metavar"]
    return kwargs


def flag_text(model: type[BaseModel], name: str, value: Any) -> str:
    """``--name value`` as ``model``'s flags read it back, quoted for a shell: a bool --name / --no_name, a pair its two
    items, a list its items comma-joined; "" for None (the flag not given)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no_{name}"
    if typing.get_origin(_unwrap(model.model_fields[name].annotation)) is tuple:
        return f"--{name} " + " ".join(shell_word(str(v)) for v in value)
    text = ",".join(map(str, value)) if isinstance(value, list) else str(getattr(value, "value", value))
    return f"--{name} {shell_word(text)}"


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
    fields = cli_fields(model)
    groups: dict[str, Any] = {}
    for name in names or tuple(fields):
        field = fields[name]
        kwargs = _argument(name, field, flag_default, model)
        if name in optional:
            kwargs["required"] = False
        if extra_of(field).get("positional"):  # INPUT, not --input: optional ones may be left out
            if not kwargs.pop("required", False):
                kwargs["nargs"] = "?"
            parser.add_argument(name, **kwargs)
            continue
        target: Any = parser
        if grouped:
            group = str(extra_of(field).get("group", "job"))
            if group not in groups:
                groups[group] = parser.add_argument_group(GROUP_TITLES.get(group, group))
            target = groups[group]
        target.add_argument(f"--{name}", **kwargs)
        if kwargs.get("action") is argparse.BooleanOptionalAction:  # --no_X too: the spelling of every other flag
            target.add_argument(f"--no_{name}", dest=name, action="store_false", default=None, help=argparse.SUPPRESS)


def flag_table() -> str:
    """The README's flag table, from the same fields as the parser."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for model in (JobOptions, ElsaConfig):
        for name, field in cli_fields(model).items():
            text, default = _described(name, field, model)
            choices = _choices(_unwrap(field.annotation)) or []
            if choices and not all(c in text for c in choices):
                text += f" Choices: {', '.join(choices)}."
            lines.append(f"| `--{name}` | {default} | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
