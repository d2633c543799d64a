"""The files settings come from besides the command line: recipes, sparsity profiles, JSON objects."""
from __future__ import annotations

import json
import os
import re
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any

import regex as rx
from pydantic import BeforeValidator, ValidationInfo

from elsa_ds import json_data
from elsa_ds.admm.projection import NM
from elsa_ds.data.sources import DEMO_DATASET, in_memory_name, looks_local
from elsa_ds.errors import ElsaError
from elsa_ds.files.aside import REPORT_NAME
from elsa_ds.files.ownership import NAME_MAX, PATH_MAX
from elsa_ds.log import get_logger
from elsa_ds.quoting import shown
from elsa_ds.targets import NamePattern

log = get_logger(__name__)


def comma_list(value: Any) -> Any:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: how every comma-list flag is read; anything but a string passes as it is."""
    return [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value


def comma_paths(value: Any, base: Path | None = None) -> Any:
    """A comma list of paths and source names as a flag (or a recipe's string) gives it, where a file's own name may hold
    a comma: from each piece on, the longest run of pieces that names a file here (``base``: relative names are read
    against it, a recipe's folder) is one entry, else the piece alone; a list (a recipe's, the API's) passes as it is."""
    if not isinstance(value, str):
        return value
    pieces, out, i = value.split(","), [], 0
    while i < len(pieces):
        end = next((j for j in _runs(pieces, i) if _exists(",".join(pieces[i:j]).strip(), base)), i + 1)
        if entry := ",".join(pieces[i:end]).strip():
            out.append(entry)
        i = end
    return out


MAX_JOINED_PIECES = 256  # a list of more comma pieces than this is one entry a piece (no text, flag or recipe needs more)


def _runs(pieces: list[str], i: int) -> range:
    """The ends j > i + 1 of the runs ``pieces[i:j]`` that could name one path, the longest first: those shorter than a
    path may be, none in a list of more than MAX_JOINED_PIECES pieces (an audit: every run was tried, so a recipe's 30,000
    commas took ~an hour of stat calls before its first line)."""
    if len(pieces) > MAX_JOINED_PIECES:
        return range(0)
    end, length = i + 1, len(pieces[i])
    while end < len(pieces) and (length := length + 1 + len(pieces[end])) < PATH_MAX:
        end += 1
    return range(end, i + 1, -1)


CommaList = Annotated[list[str], BeforeValidator(comma_list)]  # a list setting that a flag gives as "a,b,c"
PathList = Annotated[list[str], BeforeValidator(comma_paths)]  # one whose entries may be paths ("a,b.txt": one file's name)


def _exists(text: str, base: Path | None = None) -> bool:
    try:
        return bool(text) and not name_problem(text) and (base or Path()).joinpath(Path(text).expanduser()).exists()
    except OSError:
        return False


def name_problem(value: str) -> str | None:
    """Why ``value`` cannot be a path on this machine, or None (a hub id or a dataset name passes too): a path's checks
    (``exists``, ``resolve``, ``expanduser``) raise on these rather than answer (an audit: OSError, ValueError and
    RuntimeError tracebacks for a recipe's dataset of 300 characters, a NUL byte, ``~nosuchuser/x``)."""
    try:
        encoded = os.fsencode(value)
    except UnicodeEncodeError:
        return "it holds characters no file name can"
    if b"\0" in encoded:
        return "it holds a NUL byte"
    if len(encoded) >= PATH_MAX:
        return f"{len(encoded):,} bytes, longer than a path may be ({PATH_MAX:,})"
    if (longest := max(len(part) for part in encoded.split(b"/"))) > NAME_MAX:
        return f"a name in it is {longest:,} bytes, longer than a file's name may be ({NAME_MAX})"
    try:
        Path(value).expanduser()
    except RuntimeError:
        user = value.split("/")[0]
        return "this machine's home folder is unknown (no HOME)" if user == "~" else f"this machine has no user {user[:80]!r}"
    return None


PATH_SETTINGS = ("model", "dataset", "val_dataset", "sparsity_profile", "init_mask", "nvme_path", "eval_include_path",
                 "eval_ppl")  # ElsaConfig's settings a path may be given for (eval_ppl: a list, or "a,b" from a flag)


def usable_path(cls: Any, value: Any, info: ValidationInfo) -> Any:
    """A settings model's first check of a field that may name a path (or, for a list field, each of them): ValueError
    when no path can be what it says (``name_problem``), before the field's own checks ask the file system about it. A
    single path's leading ``~`` is expanded here, once for every reader (``--output_dir=~/x``, which no shell expands,
    was written to ``./~/x``; ``--model '~/m'`` reached transformers as a hub id); no hub id or dataset name starts so."""
    listed = typing.get_origin(cls.model_fields[info.field_name].annotation) is list  # "a,b" is one path elsewhere
    for text in comma_paths(value) if listed and isinstance(value, (str, list)) else [value]:  # other types: the field's
        if isinstance(text, (str, Path)) and (problem := name_problem(str(text))):
            raise ValueError(problem)
    if not listed and isinstance(value, (str, Path)) and str(value).startswith("~"):
        return value.expanduser() if isinstance(value, Path) else os.path.expanduser(value)
    return value


def read_json_object(path: str | Path, what: str, hint: str, unique: bool = True) -> dict:
    """A JSON object from a file, or ElsaError naming the file, the problem and ``hint``; a key named twice in one of
    its objects is refused (``unique=False``: the last counts, :func:`elsa_ds.json_data.loads`)."""
    path = Path(path)
    try:
        data = json_data.read(path, unique=unique)
    except (OSError, UnicodeDecodeError) as err:
        raise ElsaError(f"cannot read {what} {path}: {getattr(err, 'strerror', None) or err}; {hint}") from None
    except json.JSONDecodeError as err:
        raise ElsaError(f"{what} {path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except json_data.DuplicateKey as err:
        raise ElsaError(f"{what} {path}: {err}") from None
    except ValueError as err:  # too large, nested too deeply
        raise ElsaError(f"{what} {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ElsaError(f"{what} {path} must hold a JSON object")
    return data


# Settings that name code, taken from the command line (or the API's keywords) only, never from a file a user may have
# downloaded (a recipe, the DeepSpeed JSON's "elsa" block): a file is data. lm-eval imports the Python module a task YAML
# names with `!function module.fn` from that YAML's own folder, so an include path in such a file would run its code.
# eval_tasks stays allowed in files: a name is only looked up among the task YAMLs lm-eval installs (with no include
# path, evaluation.zeroshot.task_manager refuses any other name, a path included, before lm-eval loads anything), and
# the only code those YAMLs import is the installed lm_eval package's own.
COMMAND_LINE_ONLY = ("eval_include_path",)


def refuse_command_line_only(settings: dict[str, Any], where: str) -> None:
    """ElsaError when a file's ``settings`` (``where``: which file) carry a setting of COMMAND_LINE_ONLY."""
    found = [k for k in COMMAND_LINE_ONLY if k in settings]
    if found:
        flags = ", ".join(f"--{k}" for k in found)
        raise ElsaError(f"{where} sets {', '.join(found)}: a folder whose Python lm-eval would import, so it is read from the command "
                        f"line only ({flags} DIR), never from a file; remove it there and pass {flags} yourself if you trust that folder")


def recipe_dir() -> Path:
    """The paper's settings that ship with elsa_ds (``recipes/`` in the repository)."""
    return Path(__file__).resolve().parents[1] / "recipes"


def load_recipe(name_or_path: str, known: set[str]) -> dict[str, Any]:
    """A recipe's settings: a JSON object ``{"source": ..., "settings": {ElsaConfig field: value}}``, by path or by the
    name of a shipped recipe. Unknown settings are an error (they would otherwise be silently ignored)."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        shipped = {p.stem: p for p in sorted(recipe_dir().glob("*.json"))}
        if name_or_path.removesuffix(".json") not in shipped:
            raise ElsaError(f"--recipe {name_or_path}: no such file, and not a shipped recipe ({', '.join(shipped) or 'none'})")
        path = shipped[name_or_path.removesuffix(".json")]
    recipe = read_json_object(path, "recipe", "pass an existing recipe file or a shipped name with --recipe")
    settings = recipe.get("settings")
    if not isinstance(settings, dict) or not isinstance(recipe.get("source"), str):
        raise ElsaError(f"recipe {path} must hold {{\"source\": \"<where the values come from>\", \"settings\": {{...}}}}")
    unknown = sorted(set(settings) - set(known))
    if unknown:  # the known a recipe may set (a walk: the list named nvme_path and eval_include_path, which it refuses)
        settable = sorted(set(known) - {*COMMAND_LINE_ONLY, *MACHINE_ONLY})
        raise ElsaError(f"recipe {path}: unknown settings {unknown} (a recipe may set: {', '.join(settable)})")
    refuse_command_line_only(settings, f"recipe {path}")
    return recipe_paths(settings, path)


# A recipe is a file from elsewhere: data. Its paths are read against its own folder and never reach outside it (a walk:
# a recipe's "dataset": "/etc" trained on the machine's files, and its relative paths were the working directory's).
ALWAYS_PATHS = ("sparsity_profile",)                                     # a file, whatever its name
NAME_OR_PATH = ("model", "dataset", "val_dataset", "init_mask", "eval_ppl")  # a path when it looks like one
MACHINE_ONLY = ("nvme_path",)  # where this machine writes its swap files: its user's choice, never a downloaded file's


def recipe_paths(settings: dict[str, Any], recipe: Path) -> dict[str, Any]:
    """``settings`` with each local path made absolute against ``recipe``'s folder; ElsaError for one that is absolute,
    starts with ~ or leads outside that folder (links resolved), and for a setting of MACHINE_ONLY."""
    if found := [k for k in MACHINE_ONLY if k in settings]:
        raise ElsaError(f"recipe {recipe} sets {', '.join(found)}: where this machine writes is yours to choose, never a "
                        f"recipe's; remove it there and pass --{found[0]} yourself")
    folder = recipe.resolve().parent

    def a_path(key: str, value: str) -> bool:
        """A name that is there in the recipe's folder is a path, as on the command line (``models/x`` beside the recipe:
        not a hub id), and so is one with a ``..`` in it; else as it looks."""
        return key not in NAME_OR_PATH or looks_local(value) or ".." in value.split("/") or (folder / value).exists() or (
            "/" in value and (folder / value.split("/")[0]).is_dir())  # "..": no hub id or dataset name holds one (an audit)

    def inside(key: str, value: Any) -> Any:
        if isinstance(value, str) and (problem := name_problem(value)):
            raise ElsaError(f"recipe {recipe}: {key} {value[:80]!r}{'...' if len(value) > 80 else ''}: {problem}")
        if not isinstance(value, str) or not a_path(key, value):
            return value  # a hub id, a dataset or method name (or a wrong type, refused with the settings' own checks)
        target = (folder / value).resolve()
        if value.startswith(("/", "~")) or not target.is_relative_to(folder):
            raise ElsaError(f"recipe {recipe}: {key} {value!r} is outside the recipe's folder {folder}; a recipe is data, so "
                            f"its paths stay within its folder: remove it there (or move the file into that folder) "
                            f"and pass --{key} yourself")  # --{key} beside it alone: refused (an audit)
        if link := _link_out(target, folder):  # a folder read whole (a dataset's texts, a model's files) holds no way out
            raise ElsaError(f"recipe {recipe}: {key} {value!r} holds {link.relative_to(target)}, a link to outside the "
                            f"recipe's folder {folder}; a recipe is data, so what it reads stays within its folder: remove "
                            f"it there and pass --{key} yourself")
        return str(target)
    out = dict(settings)
    for key in (*ALWAYS_PATHS, *NAME_OR_PATH):
        if key not in out:
            continue
        value = comma_paths(out[key], folder) if key == "eval_ppl" else out[key]  # a comma list, as on the command line
        out[key] = [inside(key, v) for v in value] if isinstance(value, list) else inside(key, value)
    return out


def _link_out(target: Path, folder: Path) -> Path | None:
    """The first link under the folder ``target`` that resolves outside ``folder`` (the data reader and transformers
    follow a file link; a second audit: a recipe's dataset folder with ``t.txt -> /etc/passwd`` trained on it)."""
    if not target.is_dir():
        return None
    for entry in target.rglob("*"):  # rglob lists a linked folder but does not walk into it
        if entry.is_symlink() and not entry.resolve().is_relative_to(folder):
            return entry
    return None


DEMO_PLACE = "the embedded demo model"  # how a resume's fingerprint names it, wherever elsa_ds is installed
RESUME_PLACES = ("model", "init_mask", "dataset", "val_dataset")


def resume_place(key: str, value: Any) -> Any:
    """A setting as a resume compares it: a local path by its real place (``m``, ``./m`` and ``/abs/m`` agree; the same
    relative path from another folder does not), the embedded demo model by name (a moved or reinstalled elsa_ds resumes
    its own checkpoints; a walk), a hub id, a dataset or method name as given. The same rule reads an older checkpoint's
    fingerprint, whose paths are as they were typed."""
    if key not in RESUME_PLACES or not isinstance(value, str):
        return value
    if in_memory := in_memory_name(value):  # the Python API's documents: by their content, not the file's passing place
        return in_memory
    try:  # a fingerprint file's value is data: "~nobody/m" or a name too long for the system is compared as written
        path = Path(value).expanduser()
        if value == DEMO_PLACE or path.parts[-3:] == ("elsa_ds", "demo", "model"):
            return DEMO_PLACE
        if value != DEMO_DATASET and (looks_local(value) or path.exists()):  # a path, as the job reads it
            return str(path.resolve())
    except (RuntimeError, OSError, ValueError):
        pass
    return value


def check_each_source(model: Any, sources: list[tuple[str, dict[str, Any]]]) -> None:
    """ElsaError naming the source of every setting that is wrong on its own (type, range, unknown name), even where a
    later source overrides it: a recipe's ``"steps": "four"`` is the recipe's error, also when --steps replaces it.
    Rules across settings are left to the merged config (a source alone may be incomplete). The sources are files, so a
    setting that names code is refused there (``refuse_command_line_only``)."""
    from pydantic import ValidationError

    from elsa_ds.errors import SettingsError
    from elsa_ds.quoting import as_json, format_validation_error

    for where, values in sources:
        if not values:
            continue
        refuse_command_line_only(values, where)
        try:
            model(**values)
        except ValidationError as err:
            if own := [e for e in err.errors() if e["loc"] and e["loc"][0] in values]:
                raise SettingsError(format_validation_error(err, where, model, own, as_json)) from None


MAX_REGEX_CHARS = 1000


def compile_regex(pattern: str) -> re.Pattern:
    """``pattern`` compiled, or ValueError for one that is not a regular expression or whose matching can take
    exponential time (an unbounded repeat holding an alternation or another unbounded repeat: ``(a|aa)*``, ``(a+)+``;
    a walk: a recipe's ``"targets": "(.|.|.)*!"`` held the job at 100 % CPU before its first step). Module names are
    short, so other patterns end at once. Settings from files are data: a regex among them must not stop a job."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise ValueError(f"a regular expression of {len(pattern):,} characters; at most {MAX_REGEX_CHARS:,}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # re's "possible nested set": [[:alpha:]] means another thing
            compiled = re.compile(pattern)                   # to the regex engine that searches module names (a review)
        parsed = _regex_parser().parse(pattern)
        NamePattern(pattern)  # that engine, with its time limit, reads it too
    except (re.error, rx.error, FutureWarning) as err:
        raise ValueError(f"not a valid regular expression: {err}") from None
    if _nested_repeat(list(parsed), inside=False):
        raise ValueError(f"{pattern!r} repeats a group that holds an alternation or another repeat, which can take "
                         "exponential time to match; write it without the nested repeat (e.g. (q|k)_proj, layers\\.\\d+\\.)")
    return compiled


def _regex_parser():
    """The standard library's regular expression parser (``re._parser`` from Python 3.11, ``sre_parse`` before)."""
    import importlib

    try:
        return importlib.import_module("re._parser")
    except ImportError:  # Python 3.10
        return importlib.import_module("sre_parse")


def _nested_repeat(items: list, inside: bool) -> bool:
    """Whether parsed regex ``items`` hold an unbounded repeat of a branch or of another unbounded repeat (``inside``:
    already within an unbounded repeat)."""
    parser = _regex_parser()
    for op, arg in items:
        if op in (parser.MAX_REPEAT, parser.MIN_REPEAT, getattr(parser, "POSSESSIVE_REPEAT", None)):
            _low, high, body = arg
            unbounded = high == parser.MAXREPEAT
            if (unbounded and inside) or _nested_repeat(list(body), inside or unbounded):
                return True
        elif op == parser.BRANCH:
            if inside or any(_nested_repeat(list(alt), inside) for alt in arg[1]):
                return True
        elif op in (parser.SUBPATTERN, parser.ASSERT, parser.ASSERT_NOT) and _nested_repeat(list(arg[-1]), inside):
            return True  # a group's or a lookaround's body is its last part
    return False


def load_profile(path: str | Path) -> dict[str, float]:
    """A per-layer sparsity profile: a JSON object {module-name regex: sparsity in [0, 1)}, in file order.

    OWL-style (one ratio per decoder block, e.g. ``"layers\\.3\\."``) and EvoPress-style (one per module,
    e.g. ``"layers\\.3\\.mlp\\.down_proj"``) profiles are both written this way.
    """
    try:
        profile = json_data.read(Path(path).expanduser())
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None
    except json_data.DuplicateKey as err:
        raise ValueError(f"{path}: {err}") from None
    except ValueError as err:  # not JSON, not UTF-8, too large, nested too deeply
        raise ValueError(f"{path} is not valid JSON: {getattr(err, 'msg', err)}") from None
    if not isinstance(profile, dict) or not profile:
        raise ValueError(f"{path} must hold a non-empty JSON object {{regex: sparsity}}")
    for regex, ratio in profile.items():
        try:
            compile_regex(regex)
        except ValueError as err:
            raise ValueError(f"{path}: {regex!r}: {err}") from None
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
            raise ValueError(f"{path}: sparsity of {regex!r} is {ratio!r}; it must be a number in [0, 1)")
    return {k: float(v) for k, v in profile.items()}


def _job_config(model_dir: Path) -> dict[str, Any] | None:
    """``config`` of the elsa_report.json in ``model_dir`` (data: read size-capped), None where there is no such plain file
    (a link is never followed out of the folder: no job writes one) or it holds no such object; OSError, ValueError for
    a file that cannot be read as JSON."""
    report = model_dir / REPORT_NAME
    if report.is_symlink() or not report.is_file():
        return None
    found = json_data.read(report)
    config = found.get("config") if isinstance(found, dict) else None
    return config if isinstance(config, dict) else None


def job_targets(model_dir: Path) -> str | None:
    """The weights the elsa_ds job that wrote ``model_dir`` pruned: ``config.targets`` of its elsa_report.json, so that
    elsa-evaluate's sparsity is over the weights the job's report counts (an audit, 2026-12-07: --targets
    'mlp\\.(gate|up)_proj' at 70 % was 70 % in the report and 35 % in elsa-evaluate's). None (every decoder-layer
    weight) where there is no such file, or it names none, or what it names is no usable pattern (data from elsewhere:
    said once, and the evaluation goes on)."""
    report = model_dir / REPORT_NAME
    try:
        config = _job_config(model_dir)
        targets = config.get("targets") if config else None
        if not isinstance(targets, str) or not targets:
            return None
        compile_regex(targets)
    except (ValueError, OSError) as err:
        log.warning(f"{report} unread ({shown(str(err), render=str)}): sparsity over every decoder-layer weight")
        return None
    log.info(f"sparsity over the weights its job pruned: targets {targets} ({report})")
    return targets


def job_pattern(model_dir: Path) -> tuple[tuple[int, int], ...]:
    """The N:M pattern the job that wrote ``model_dir`` pruned to (``config.pattern`` of its report), so that
    elsa-evaluate names a 3:4 export as the job's report does (a thirteenth audit: only 2:4 and 4:8 were tried, and a
    3:4 export read "2:4"); none where there is no such report or it names none (``job_targets`` says what it could
    not read)."""
    try:
        config = _job_config(model_dir)
        pattern = config.get("pattern") if config else None
        nm = NM.parse(pattern) if isinstance(pattern, str) and pattern != "unstructured" else None
    except (ValueError, OSError):  # not a pattern, or no file to read
        return ()
    return ((nm.n, nm.m),) if nm else ()
