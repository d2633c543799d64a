"""The quality benchmark's table, plot and target checks (``bench/quality.py``)."""
from __future__ import annotations

from pathlib import Path

LABELS = {"dense": "dense", "dense+ft": "dense + fine-tuning", "elsa": "**ELSA**"}


def label(row: str) -> str:
    if row in LABELS:
        return LABELS[row]
    method, _, how = row.partition("+")
    return method + {"": " (one-shot)", "ft": " + fine-tuning", "lora": " + LoRA"}[how]


def _at(results: list[dict], row: str, sparsity: float | None) -> float | None:
    def matches(r: dict) -> bool:
        return sparsity is None or r["sparsity"] is None or abs(r["sparsity"] - sparsity) < 1e-9

    found = [r["ppl"] for r in results if r["row"] == row and matches(r)]
    return found[0] if found else None


def table(results: list[dict], rows: list[str], sparsities: list[float], source: str, limit: int | None) -> str:
    """Rows x sparsities of held-out perplexity (dense rows repeated), best pruned model per sparsity in bold; every
    row's budget and settings below."""
    head = (f"Held-out perplexity on {source}" + (f" (first {limit} windows)" if limit else "") +
            "; lower is better; best pruned model per sparsity in bold.\n\n")
    lines = ["| model | " + " | ".join(f"{s:.0%}" for s in sparsities) + " |", "|---|" + "---:|" * len(sparsities)]
    pruned = [r for r in rows if r not in ("dense", "dense+ft")]
    best = {s: min((_at(results, r, s) for r in pruned if _at(results, r, s) is not None), default=None) for s in sparsities}
    for row in rows:
        cells = []
        for s in sparsities:
            v = _at(results, row, s)
            cells.append("" if v is None else f"**{v:.2f}**" if row in pruned and v == best[s] else f"{v:.2f}")
        lines.append(f"| {label(row)} | " + " | ".join(cells) + " |")
    budgets = {}
    for r in results:
        budgets.setdefault(r["row"], set()).add((r["budget"], r["settings"]))
    notes = [f"- {label(row)}: " + "; ".join(sorted(f"{b}" + (f" ({s})" if s else "") for b, s in budgets[row]))
             for row in rows if row in budgets and row != "dense"]
    return head + "\n".join(lines) + "\n\nBudgets (steps x global batch x seqlen tokens) and settings:\n\n" + "\n".join(notes) + "\n"


def checks(results: list[dict]) -> str:
    """The issue's targets, each with its margin (only those the rows and sparsities can speak to)."""
    said = []
    dense, dense_ft = _at(results, "dense", None), _at(results, "dense+ft", None)
    for s in (0.7, 0.9):
        e, g = _at(results, "elsa", s), _at(results, "sparsegpt", s)
        if e is not None and g is not None:
            said.append(f"{s:.0%}: ELSA {e:.2f} vs one-shot SparseGPT {g:.2f}: {'beats' if e < g else 'LOSES'} "
                        f"({(g - e) / g:+.1%} of SparseGPT's)")
    e90 = _at(results, "elsa", 0.9)
    if e90 is not None and dense is not None:
        said.append(f"90%: ELSA / dense = {e90 / dense:.3f} ({'<=' if e90 / dense <= 1.5 else '>'} 1.5)")
    for s in (0.8, 0.9, 0.95):
        e, w = _at(results, "elsa", s), _at(results, "wanda+ft", s)
        if e is not None and w is not None:
            said.append(f"{s:.0%}: ELSA {e:.2f} vs Wanda + fine-tuning {w:.2f} (same tokens): {'beats' if e < w else 'LOSES'} "
                        f"(ratio {e / w:.3f})")
    if e90 is not None and dense_ft is not None:
        said.append(f"90%: ELSA / dense fine-tuned = {e90 / dense_ft:.3f} ({'<=' if e90 / dense_ft <= 1.3 else '>'} 1.3)")
    return "".join(f"\n- {line}" for line in said) + ("\n" if said else "")


def plot(results: list[dict], rows: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    for row in rows:
        pts = sorted((r["sparsity"], r["ppl"]) for r in results if r["row"] == row and r["sparsity"] is not None)
        if pts:
            ax.plot([100 * s for s, _ in pts], [p for _, p in pts], marker="o", label=label(row).replace("*", ""),
                    linewidth=2.2 if row == "elsa" else 1.2)
    for row, style in (("dense", "--"), ("dense+ft", ":")):
        v = _at(results, row, None)
        if v is not None:
            ax.axhline(v, color="grey", linestyle=style, label=label(row))
    ax.set_yscale("log")
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
