"""Evaluation result files: read back, rendered as one markdown table (a row per model, the layout of the
pruning papers' tables), written atomically."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from elsa_ds import json_data
from elsa_ds.errors import ElsaError
from elsa_ds.targets import DEFAULT_TARGETS


def load_result(path: str | Path) -> dict[str, Any]:
    """One JSON written by ``elsa-evaluate --output``."""
    path = Path(path)
    try:
        result = json_data.read(path)
    except FileNotFoundError:
        raise ElsaError(f"--compare {path}: no such file") from None
    except json_data.DuplicateKey as err:
        raise ElsaError(f"--compare {path}: {err}") from None
    except (OSError, ValueError) as err:  # not UTF-8, not JSON, too large, nested too deeply
        raise ElsaError(f"--compare {path}: not a readable JSON file ({err})") from None
    if isinstance(result, dict) and "layers" in result and "method" in result:
        hint = f" (its eval.json is: --compare {path.with_name('eval.json')})" if path.with_name("eval.json").is_file() else ""
        raise ElsaError(f"--compare {path}: a pruning job's report, not an evaluation result{hint}; evaluate the model with "
                        f"launch/evaluate.py --model {path.parent} --ppl ... --output RESULT.json and compare that")
    if not isinstance(result, dict) or "model" not in result or not isinstance(result.get("ppl"), dict) \
            or not all(isinstance(v, dict) for v in result["ppl"].values()):
        raise ElsaError(f"--compare {path}: not an elsa-evaluate result (no 'model' and per-dataset 'ppl'); write one with --output")
    if (problem := _field_problem(result)) is not None:
        raise ElsaError(f"--compare {path}: {problem}, which elsa-evaluate never writes; evaluate the model again with --output")
    return result


def _number(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """None, or a number the table can format (an int beyond a float's range cannot be) in [low, high] (NaN: a run's
    NaN model, which elsa-evaluate writes as it is)."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isnan(value) or low <= float(value) <= high
    except OverflowError:
        return False


def _field_problem(result: dict[str, Any]) -> str | None:
    """The first field the table reads that holds what no elsa-evaluate result does (a string where a number goes)."""
    sparsity, tasks, protocol = result.get("sparsity") or {}, result.get("tasks") or {}, result.get("protocol") or {}
    if not isinstance(result["model"], str):
        return "its 'model' is not a string"
    if not isinstance(sparsity, dict) or not _number(sparsity.get("overall"), 0, 1) or not isinstance(sparsity.get("pattern", ""), str):
        return "its 'sparsity' is not an object with a fraction 'overall' (0 to 1) and a string 'pattern'"
    if not isinstance(protocol, dict) or not _count(protocol.get("limit")):
        return "its 'protocol' is not an object with a whole-number (or null) 'limit'"
    if bad := next((d for d, v in result["ppl"].items() if not _number(v.get("ppl"), 1)), None):  # exp(a mean NLL >= 0)
        return f"its perplexity of {str(bad)[:40]!r} is not a number of at least 1"
    if bad := next((d for d, v in result["ppl"].items() if not _count(v.get("windows"))), None):
        return f"its perplexity of {str(bad)[:40]!r} has a 'windows' that is not a whole number"
    if not _count(result.get("seqlen")):
        return "its 'seqlen' is not a whole number"
    if not isinstance(tasks, dict) or not all(isinstance(v, dict) and _number(v.get("acc"), 0, 1) for v in tasks.values()):
        return "its 'tasks' are not objects with a fraction 'acc' (0 to 1)"
    return None if _number(result.get("average_acc"), 0, 1) else "its 'average_acc' is not a fraction (0 to 1)"


def _count(value: Any) -> bool:
    """A whole number of at least 0, or absent (a second audit: a list there made the table's set of window shapes
    unhashable; an eighth: -64 printed as the tokens a window held)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _ordered_union(rows: list[dict]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    return keys


def _cell(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def results_table(results: list[dict[str, Any]], labels: list[str] | None = None) -> str:
    """Markdown: model | sparsity | pattern | ppl per dataset | acc (%) per task | mean acc (%).

    Columns are the union over ``results``; a model without a value shows "–".
    """
    labels = labels or [r["model"] for r in results]
    datasets = _ordered_union([r.get("ppl") or {} for r in results])
    tasks = _ordered_union([r.get("tasks") or {} for r in results])
    header = ["model", "sparsity", "pattern", *(f"{d} ppl" for d in datasets), *(f"{t} acc" for t in tasks)]
    header += ["mean acc"] if tasks else []
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---:", "---"] + ["---:"] * (len(header) - 3)) + "|"]
    for label, r in zip(labels, results):
        sparsity = r.get("sparsity") or {}
        overall = sparsity.get("overall")
        cells = [label, "–" if overall is None else f"{100 * overall:.2f}%", sparsity.get("pattern", "–")]
        cells += [_cell((r["ppl"].get(d) or {}).get("ppl"), ".3f") for d in datasets]
        cells += [_cell(_percent((r.get("tasks") or {}).get(t, {}).get("acc")), ".2f") for t in tasks]
        cells += [_cell(_percent(r.get("average_acc")), ".2f")] if tasks else []
        lines.append("| " + " | ".join(cells) + " |")
    protocols = sorted({_ppl_protocol(r) for r in results if r.get("ppl")})
    if protocols:
        lines += ["", f"Perplexity protocol: {protocols[0]}" if len(protocols) == 1 else
                  f"Perplexity protocols differ ({', '.join(protocols)}): these perplexities are not comparable"]
    for d in datasets:  # a walk: 64-token windows beside 128-token ones, side by side without a word
        shapes = sorted({(r.get("seqlen"), (r["ppl"].get(d) or {}).get("windows")) for r in results if (r.get("ppl") or {}).get(d)},
                        key=str)
        if len(shapes) > 1:
            lines += ["", f"{d} was scored over different windows ({'; '.join(f'{w} of {n} tokens' for n, w in shapes)}): these "
                          "perplexities are not comparable"]
    counted = sorted({_counted((r.get("sparsity") or {}).get("targets")) for r in results if r.get("sparsity")})
    if len(counted) > 1:  # an audit (2026-12-07): 35 % of every decoder weight beside 70 % of the MLP's, unlabelled
        lines += ["", f"Sparsity counted over different weights ({'; '.join(counted)}): these sparsities are not comparable"]
    elif counted and counted[0] != _counted(DEFAULT_TARGETS):
        lines += ["", f"Sparsity: zeros over {counted[0]} (the weights the pruning job chose)"]
    limited = [label for label, r in zip(labels, results) if (r.get("protocol") or {}).get("limit")]
    if limited:
        lines += ["", f"Run with --limit (a quick check, not comparable with published tables): {', '.join(limited)}"]
    return "\n".join(lines) + "\n"


def _ppl_protocol(result: dict[str, Any]) -> str:
    """stream, window or prepend (``elsa_ds.data.windows``); results written before the protocols existed packed BOS-first
    blocks."""
    name = (result.get("protocol") or {}).get("ppl")
    return name if name in ("stream", "window", "prepend") else "packed BOS-first blocks (elsa_ds before --ppl_protocol)"


def _counted(targets: str | None) -> str:
    """Which weights a result's sparsity counts: every decoder-layer weight (results written before the field existed
    counted those), or the weights ``targets`` matches."""
    return "every decoder-layer weight" if targets in (None, DEFAULT_TARGETS) else f"the weights matching `{targets}`"


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def compare(paths: list[str]) -> str:
    """The table of several result files; a model evaluated twice is told apart by its file name."""
    results = [load_result(p) for p in paths]
    models = [r["model"] for r in results]
    labels = [f"{m} ({Path(p).name})" if models.count(m) > 1 else m for m, p in zip(models, paths)]
    return results_table(results, labels)
