"""The values of a DeepSpeed JSON that are read before DeepSpeed checks them: those elsa_ds reads itself (the memory and
step-time estimates, the engine config's own checks) by their JSON types and ranges, and those DeepSpeed reads only once
the model is built and warm-started; each wrong one is refused in one line naming its key when the file is loaded.

Audits found: a ratio of "half", a list of params or a buffer_count of "many" ending the check in a traceback, a device
of ["nvme"] or an nvme_path of 5 passing it for DeepSpeed to refuse after the model was built; a reduce_bucket_size of
"big", or a sub_group_size, ratio or buffer_size of 400 digits (no float holds it) ending the estimate in a ValueError or
OverflowError; a gradient_clipping of "one" (a TypeError at the first step; a NaN would silently never clip), a
checkpoint.tag_validation of "Nonsense" and a flops_profiler output_file naming a folder failing in DeepSpeed after
minutes of loading.
"""
from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from elsa_ds.errors import ElsaError, first_line
from elsa_ds.quoting import as_json, pydantic_problems, shown

AUTO = "auto"
COUNT_LIMIT = 2**53  # elements, buffers, batches: more than any machine holds, and the most a float holds exactly
# DeepSpeed's CHECKPOINT_TAG_VALIDATION_MODES (deepspeed/runtime/constants.py, ValidationMode), read upper-cased
# (runtime/config.py, get_checkpoint_tag_validation_mode)
TAG_VALIDATION_MODES = ("WARN", "IGNORE", "FAIL")


class Kind(NamedTuple):
    """What a value must be: ``what`` in words, its JSON ``types``, and for a number the range [``low``, ``high``] it
    keeps to, finite (``high`` None: no bound above but a float's)."""

    what: str
    types: tuple[type, ...]
    low: float | None = None
    high: float | None = None
    whole: bool = False  # a number DeepSpeed takes as an int: 5e8 is one, 1.5 is not


_NUMBERS = (int, float)
_TEXT, _OBJECT, _BOOL = Kind("a string", (str,)), Kind("an object", (dict,)), Kind("true or false", (bool,))
_COUNT = Kind("a whole number (5e8 is one)", _NUMBERS, 0, COUNT_LIMIT, whole=True)
_WHOLE = Kind("a whole number", (int,), 0, COUNT_LIMIT)
_ZERO = "zero_optimization"
# DeepSpeed's own bounds where it has them (runtime/zero/config.py, offload_config.py: reduce_bucket_size > 0, a ratio in
# [0, 1], the counts >= 0); a batch is at least one sequence; gradient_clipping a finite norm (0: no clipping)
TYPED: dict[tuple[str, ...], Kind] = {
    **{(_ZERO, sec, key): kind for sec in ("offload_param", "offload_optimizer")
       for key, kind in (("device", _TEXT), ("nvme_path", _TEXT), ("buffer_count", _WHOLE), ("ratio", Kind("a number", _NUMBERS, 0, 1)))},
    (_ZERO, "offload_param", "buffer_size"): _COUNT, (_ZERO, "offload_param", "max_in_cpu"): _COUNT,
    (_ZERO, "reduce_bucket_size"): Kind("a whole number (5e8 is one)", _NUMBERS, 1, COUNT_LIMIT, whole=True),
    **{(_ZERO, key): _COUNT for key in ("sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                        "stage3_max_live_parameters", "stage3_max_reuse_distance")},
    **{(key,): Kind("a whole number", (int,), 1, COUNT_LIMIT)
       for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")},
    ("gradient_clipping",): Kind("a number", _NUMBERS, 0), ("aio", "block_size"): _COUNT,
    ("optimizer", "type"): _TEXT, ("optimizer", "params"): _OBJECT, ("scheduler", "params"): _OBJECT,
    ("bf16", "enabled"): _BOOL, ("fp16", "enabled"): _BOOL}
FIX = "fix the file or pass a shipped config with --deepspeed"
SHOWN = 60  # characters of a refused value a line quotes


def _shown(value: Any) -> str:
    return shown(value, SHOWN, as_json)


def _range(kind: Kind) -> str:
    return f"{kind.what} of at least {kind.low:g}, finite" if kind.high is None else f"{kind.what} in [{kind.low:g}, {kind.high:,}]"


def _in_range(value: Any, kind: Kind) -> bool:
    """Whether a number lies in ``kind``'s range, finite (an int is compared exactly: no float holds 400 digits)."""
    high = math.inf if kind.high is None else kind.high
    finite = isinstance(value, int) or math.isfinite(value)
    return kind.low is not None and kind.low <= value <= high and finite and (not kind.whole or float(value).is_integer())


def check_values(raw: dict[str, Any], path: Path) -> None:
    """ElsaError naming the first value of :data:`TYPED` of another type or out of its range ("auto" and null pass:
    resolved, or left to DeepSpeed's default), then :func:`check_deepspeed_reads`."""
    for keys, kind in TYPED.items():
        value: Any = raw
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None or value == AUTO:
            continue
        where = f"DeepSpeed config {path}: \"{'.'.join(keys)}\""
        if not isinstance(value, kind.types) or (isinstance(value, bool) and bool not in kind.types):
            raise ElsaError(f"{where} must be {kind.what}, not {_shown(value)}; {FIX}")
        if kind.low is not None and not _in_range(value, kind):
            raise ElsaError(f"{where} must be {_range(kind)}, not {_shown(value)}; {FIX}")
    check_deepspeed_reads(raw, path)


def check_deepspeed_reads(raw: dict[str, Any], path: Path) -> None:
    """ElsaError for a value elsa_ds never reads that DeepSpeed would refuse (or fail on) only after the model is built:
    a checkpoint.tag_validation not among DeepSpeed's modes, an enabled flops profiler's output_file that is no file's
    path. Its sections are JSON objects (``ds_config._check_sections``)."""
    checkpoint = raw.get("checkpoint", {})
    mode = checkpoint.get("tag_validation")
    if "tag_validation" in checkpoint and (not isinstance(mode, str) or mode.upper() not in TAG_VALIDATION_MODES):  # null: .upper()
        raise ElsaError(f'DeepSpeed config {path}: "checkpoint.tag_validation" must be one of {", ".join(TAG_VALIDATION_MODES)} '
                        f"(any case), not {_shown(mode)}; {FIX}")
    profiler = raw.get("flops_profiler", {})
    out = profiler.get("output_file")
    if profiler.get("enabled") and out not in (None, ""):  # none: DeepSpeed prints the profile
        if not isinstance(out, str) or os.path.isdir(out):
            what = f"{out!r} is a folder" if isinstance(out, str) else f"is {_shown(out)}"
            raise ElsaError(f'DeepSpeed config {path}: "flops_profiler.output_file" {what}; it must be the path of a file '
                            "for DeepSpeed to write the profile to (or leave it out: the profile is printed)")


def deepspeed_refusal(engine_config: dict[str, Any]) -> str | None:
    """What DeepSpeed's own config reader refuses in ``engine_config`` (a resolved config, as the engine gets it), in one
    line naming each key; None when it reads it. ``deepspeed.initialize`` builds that reader once the model is loaded and
    warm-started: an audit's key DeepSpeed does not know ("zero_optimization": {"foo_bar": 1}) ended a job after its
    warm start with "cannot load model ...: 1 validation error for DeepSpeedZeroConfig". The global batch is left for the
    reader to derive (micro batch x accumulation x its own world, one rank here): elsa_ds checks it for the job's ranks."""
    import logging

    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    probe = copy.deepcopy(engine_config)
    probe.pop("train_batch_size", None)
    level = logger.level
    logger.setLevel(logging.ERROR)  # its info and warnings are said again, once, when the engine reads the config
    try:
        DeepSpeedConfig(probe)
    except pydantic.ValidationError as err:
        return "; ".join(pydantic_problems(err.errors(), lambda loc: _key_path(loc, engine_config, err.title),
                                           lambda name: f"{name}: DeepSpeed knows no such setting", as_json, SHOWN))
    except Exception as err:  # noqa: BLE001 - DeepSpeedConfigError (a removed key: "nebula"), asserts, ValueErrors
        return first_line(err)
    finally:
        logger.setLevel(level)
    return None


def _key_path(loc: tuple[str, ...], config: dict[str, Any], model: str) -> str:
    """A key DeepSpeed's pydantic reader refuses, by its path in ``config`` (pydantic names it inside its section's
    model only: ``foo_bar`` of DeepSpeedZeroConfig), or by the model where the key is missing or ambiguous."""
    found = [path for path in _key_paths(config) if loc and path[-len(loc):] == loc]
    return '"' + ".".join(found[0] if len(found) == 1 else (model, *loc)) + '"'


def _key_paths(node: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key's path in a JSON document's objects."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, str(key))
            yield from _key_paths(value, (*prefix, str(key)))
