"""The budget curve's table and plot from the cells' JSON lines (bench/device/curve.py).

    python bench/device/curve_report.py                                     # bench/results/gpu_quality_gemma3-270m.jsonl
    python bench/device/curve_report.py --results FILE --out bench/results/gpu_quality_gemma3-270m

Writes OUT.md (per sparsity: held-out perplexity by method and budget, tokens and steps, on both test texts, and ELSA's
ratio to the best retraining baseline at each budget: the issue's target is <= 0.8 at the largest) and OUT.png
(perplexity against training tokens, log-log, one line per method and step size: 512 x 32 beside 2048 x 8; a panel per
sparsity and text; one-shot starts and the dense model as horizontal references). The last line printed is JSON: the
ratios.

The same curve from bench/quality.py's runs on another model (one JSON per budget, a single held-out text):

    python bench/device/curve_report.py --quality s125.json s500.json s2000.json --name "the demo" --test_label "held-out plays"
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.device.curve import Cell, read_lines  # noqa: E402
from bench.device.ship import CellsError, is_number  # noqa: E402
RESULTS = ROOT / "bench" / "results" / "gpu_quality_gemma3-270m.jsonl"
TEXTS = (("test_ppl", "techdocs test"), ("linuxdoc_ppl", "linux-doc test"))
RETRAINING = ("sparsegpt+ft", "wanda+ft")
TARGET = 0.8
LABELS = {"paper": " (paper's settings)", "dense": " (dense start)", "adaptive": " (residual balancing)",
          "held": " (held end)", "half_lmda": " (half λ)", "seed1": " (seed 1)", "elsa_lr": " (ELSA's lr)",
          "retrain_lr": " (retraining's lr)"}
SEEDS = (LABELS["seed1"],)  # the settings whose cells give the verdict's ratio again, on another seed
PLAIN = " (plain loop)"  # a label's end for the cells of bench/plain_cell.py (curve.py --engine plain)
COMPILED = " (compiled)"  # and for its compiled cells (keys ending |compiled: the model through inductor)
LOOPS = ("", PLAIN, COMPILED)
LINESTYLES = {"": "-", PLAIN: "-.", COMPILED: ":"}
COLORS = {"elsa": "C1", "elsa (paper's settings)": "C2", "elsa (dense start)": "C5", "elsa (residual balancing)": "C6",
          "elsa (held end)": "C7", "sparsegpt+ft": "C3", "wanda+ft": "C4", "dense+ft": "C0", "sparsegpt+ft (ELSA's lr)": "C8",
          "wanda+ft (ELSA's lr)": "C9", "elsa (retraining's lr)": "olive", "elsa (half λ)": "teal",
          # another seed: a paler shade of its method's colour
          "elsa (seed 1)": "navajowhite", "sparsegpt+ft (seed 1)": "lightcoral", "wanda+ft (seed 1)": "thistle"}


def from_quality(paths: list[Path]) -> list[dict]:
    """Cells as curve.py writes them from bench/quality.py's JSON payloads (one per budget): each row a cell, the held-out
    perplexity as ``test_ppl``; rows shared by the payloads (dense, the one-shot starts) count once."""
    cells: dict[str, dict] = {}
    for path in paths:
        payload = json.loads(path.read_text())
        for r in payload["results"]:
            sparsity = None if r["row"] in ("dense", "dense+ft") else r["sparsity"]
            cell = Cell(r["row"], sparsity, 0)
            if cell.kind == "train":  # the batch in sequences, from the tokens the run read
                steps = payload["steps"]
                cell = Cell(r["row"], sparsity, steps, batch=r["tokens"] // (steps * payload["seqlen"]))
            key = cell.key(payload["seqlen"])
            cells[key] = {"key": key, **asdict(cell), "kind": cell.kind, "tokens": r["tokens"] if cell.kind == "train" else 0,
                          "test_ppl": r["ppl"], "status": "ok", "device": "cpu", "model": payload["model"]}
    return list(cells.values())


def _reportable(cell: dict) -> bool:
    """Whether an ``ok`` cell has what the report reads, each of its kind (a third audit's review: a cell of only a key
    and a status was a KeyError)."""
    return (cell.get("kind") in ("train", "eval", "oneshot") and isinstance(cell.get("method"), str)
            and (cell.get("sparsity") is None or is_number(cell.get("sparsity"))) and isinstance(cell.get("device"), str)
            and all(type(cell.get(k)) is int for k in ("tokens", "steps")) and is_number(cell.get("test_ppl"))
            and ("linuxdoc_ppl" not in cell or is_number(cell["linuxdoc_ppl"])))


def load(path: Path) -> list[dict]:
    """The ``ok`` cells; a key measured twice keeps its latest line. CellsError for one the report cannot read."""
    latest: dict[str, dict] = {}
    for line in read_lines(path):
        if line.get("status") == "ok":
            if not _reportable(line):
                raise CellsError(f"{path}: cell {line['key'][:80]!r} lacks what the report reads (kind, method, sparsity, "
                                 "device, tokens, steps, test_ppl as curve.py writes them); remove or mend that line")
            latest[line["key"]] = line
    return list(latest.values())


Budget = tuple[int, int]  # (tokens, steps): the same tokens in fewer, larger steps is another budget (512 x 32, 2048 x 8)


def series(cells: list[dict], sparsity: float | None) -> dict[str, dict[Budget, dict]]:
    """{method label: {(tokens, steps): cell}} of the training cells at ``sparsity`` (the paper's settings and the dense
    start as their own labels)."""
    out: dict[str, dict[Budget, dict]] = defaultdict(dict)
    for c in cells:
        if c["kind"] == "train" and (c["sparsity"] == sparsity or c["method"] == "dense+ft"):
            label = c["method"] + LABELS.get(c.get("settings", "rule"), "") + loop_of(c)
            out[label][(c["tokens"], c["steps"])] = c
    return dict(out)


def loop_of(cell: dict) -> str:
    """The label's end for the loop a cell trained in: the engine's (""), the plain loop's, or the plain loop compiled."""
    return COMPILED if cell.get("compiled") else PLAIN if cell.get("engine") == "plain" else ""


def column(budget: Budget) -> str:
    tokens, steps = budget
    return f"{tokens:,} tokens ({steps} steps)"


def references(cells: list[dict], sparsity: float) -> dict[str, dict]:
    """The untrained rows: dense and the one-shot starts at ``sparsity``."""
    return {c["method"]: c for c in cells if c["kind"] == "eval" or (c["kind"] == "oneshot" and c["sparsity"] == sparsity)}


def ratios(curves: dict[str, dict[Budget, dict]], metric: str, loop: str = "", variant: str = "") -> dict[Budget, float]:
    """ELSA (rule) / the best retraining baseline at every budget both were measured on, in one loop (``loop``: "" the
    engine's cells, :data:`PLAIN` bench/plain_cell.py's, :data:`COMPILED` its compiled ones): never one loop's ELSA
    against another's retraining. ``variant``: a label's settings part that all three share (:data:`SEEDS`: the same
    ratio on another seed), "" the rule's."""
    out = {}
    for tokens, cell in curves.get("elsa" + variant + loop, {}).items():
        base = [curves[m + variant + loop][tokens][metric] for m in RETRAINING if tokens in curves.get(m + variant + loop, {})]
        if base:
            out[tokens] = cell[metric] / min(base)
    return out


def table(cells: list[dict], sparsity: float, texts: tuple) -> tuple[str, dict]:
    curves, refs = series(cells, sparsity), references(cells, sparsity)
    budgets = sorted({t for s in curves.values() for t in s})
    lines = [f"### {sparsity:.0%} sparsity", "", "| method | " + " | ".join(column(t) for t in budgets) + " |",
             "|---|" + "---:|" * len(budgets)]
    figures = {}
    for metric, text in texts:
        for label in sorted(curves):
            row = [f"{curves[label][t][metric]:.2f}" if t in curves[label] else "" for t in budgets]
            lines.append(f"| {label}, {text} | " + " | ".join(row) + " |")
        for variant in ("", *SEEDS):
            for loop in LOOPS:
                if r := ratios(curves, metric, loop, variant):
                    lines.append(f"| **ELSA / best retraining{variant}{loop}**, {text} | "
                                 + " | ".join(f"{r[t]:.2f}" if t in r else "" for t in budgets) + " |")
                    figures[text + variant + loop] = {column(t): round(v, 4) for t, v in r.items()}
    lines += ["", "Untrained: " + ", ".join(f"{m} " + " / ".join(f"{c[metric]:.2f}" for metric, _ in texts)
                                            for m, c in sorted(refs.items())) + f" ({' / '.join(t for _, t in texts)}).", ""]
    return "\n".join(lines), figures


def plot(cells: list[dict], sparsities: list[float], out: Path, texts: tuple, name: str) -> list[str]:
    """OUT.png: a panel per text (rows) and sparsity (columns); returns the panels' titles."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(texts), len(sparsities), figsize=(5.5 * len(sparsities), 4 * len(texts)), squeeze=False)
    for col, sparsity in enumerate(sparsities):
        curves, refs = series(cells, sparsity), references(cells, sparsity)
        batches = Counter(c.get("batch") for points in curves.values() for c in points.values())
        main = batches.most_common(1)[0][0] if batches else None
        for row, (metric, text) in enumerate(texts):
            ax, trained = axes[row][col], []
            for label, points in sorted(curves.items()):  # one line a method across the budgets; a square: another batch
                xs = sorted(points)  # the line joins each token count's fewest steps; more steps there: a point beside it
                ys = [points[t][metric] for t in xs]
                trained += ys
                joined = [t for t in xs if t == min(u for u in xs if u[0] == t[0])]
                loop = loop_of(next(iter(points.values())))
                line, = ax.plot([t for t, _ in joined], [points[t][metric] for t in joined], label=label,
                                color=COLORS.get(label.removesuffix(loop)), linestyle=LINESTYLES[loop])
                for t, y in zip(xs, ys):
                    ax.plot(t[0], y, marker="o" if points[t].get("batch") == main else "s", color=line.get_color(),
                            fillstyle="full" if t in joined else "none")
            shown = trained + ([refs["dense"][metric]] if "dense" in refs else [])  # the dense model always on the scale
            low, high = (min(shown) / 1.1, max(shown) * 1.1) if trained else (1, 10)
            off = []  # untrained rows far off the trained cells' scale are named, not drawn
            for ref, cell in sorted(refs.items()):
                if low <= cell[metric] <= high or not trained:
                    ax.axhline(cell[metric], linestyle=":" if ref == "dense" else "--", linewidth=1, color="grey")
                    ax.annotate(f"{ref} (untrained)", (0.01, cell[metric]), xycoords=("axes fraction", "data"), fontsize=7)
                else:
                    off.append(f"{ref} {cell[metric]:.4g}")
            if trained:
                ax.set_ylim(low, high)
            squares = f"squares: batch {'/'.join(str(b) for b in sorted(set(batches) - {main}, key=str))}, " if len(batches) > 1 else ""
            ax.set(xscale="log", yscale="log", xlabel=f"training tokens ({squares}circles: batch {main})",
                   ylabel=f"perplexity, {text}", title=f"{name}, {sparsity:.0%}")
            if off:
                ax.text(0.01, 0.99, "untrained, off the scale: " + ", ".join(off), transform=ax.transAxes, fontsize=7, va="top")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return [ax.get_title() for row in axes for ax in row]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--quality", type=Path, nargs="+", default=None,
                    help="bench/quality.py JSON payloads (one per budget) instead of --results")
    ap.add_argument("--out", type=Path, default=None, help="OUT.md and OUT.png [next to --results]")
    ap.add_argument("--name", default="Gemma-3 270M", help="the model, in titles [Gemma-3 270M]")
    ap.add_argument("--test_label", default=TEXTS[0][1], help=f"what test_ppl measures [{TEXTS[0][1]}]")
    args = ap.parse_args(argv)
    missing = [p for p in args.quality or [args.results] if not p.is_file()]
    if missing:
        print(f"error: {missing[0]} does not exist: no cell has run yet (bench/device/README.md)", file=sys.stderr)
        return 2
    try:
        cells = from_quality(args.quality) if args.quality else load(args.results)
    except CellsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        print(f"error: --quality: not bench/quality.py's JSON payloads ({type(err).__name__}: {str(err)[:120]})", file=sys.stderr)
        return 2
    out = args.out or (args.quality[-1] if args.quality else args.results).with_suffix("")
    texts = tuple((metric, args.test_label if metric == "test_ppl" else text) for metric, text in TEXTS
                  if cells and all(metric in c for c in cells))  # a text some cells were not judged on has no row
    sparsities = sorted({c["sparsity"] for c in cells if c["kind"] == "train" and c["sparsity"] is not None}, reverse=True)
    parts, figures = [], {}
    for s in sparsities:
        text, figures[f"{s:g}"] = table(cells, s, texts)
        parts.append(text)
    devices = sorted({c["device"] for c in cells})
    head = [f"# The budget curve on {args.name} ({', '.join(devices)})", "",
            f"Perplexity, fp32, window protocol; target: ELSA / best retraining <= {TARGET} at the largest budget.", ""]
    out.with_suffix(".md").write_text("\n".join(head + parts))
    if sparsities:
        plot(cells, sparsities, out.with_suffix(".png"), texts, args.name)
    print("\n".join(head + parts))
    print(json.dumps({"ratios": figures, "cells": len(cells)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
