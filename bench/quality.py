"""Quality benchmark: every method at every sparsity on the same model and data, judged by the same evaluation.

    python bench/quality.py                                  # the shipped demo model, 50-90 %, all four methods
    python bench/quality.py --sparsities 0.7 0.9 --methods elsa sparsegpt --json out/quality.json
    python bench/quality.py --model google/gemma-2-2b --dataset c4 --eval_ppl wikitext2 --seqlen 2048 \\
        --deepspeed ds_configs/zero3_offload.json --num_gpus 8 -- --steps 4096

Each model is pruned by ``launch/prune.py`` (ELSA under the deepspeed launcher with --num_gpus ranks, the
one-shot methods in one process, all with the same calibration/training data), then its held-out perplexity
is measured by ``elsa_ds.evaluation`` (the code behind ``launch/evaluate.py``), the dense model's too.
Arguments after ``--`` go to the ELSA runs only (its budget: --steps, --lmda, ...).

Writes OUT/quality.md (table), OUT/quality.png (perplexity vs sparsity, log scale) and OUT/quality.json
``{"dense_ppl": x, "results": [{"method", "sparsity", "ppl", "wall_s", ...}]}`` (also to --json FILE), and
prints the issue's targets: ELSA lowest at >= 70 %, its ratio to the best one-shot method at 90 %, and the
one-shot order SparseGPT <= Wanda <= magnitude at 50-70 %.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHODS = ("magnitude", "wanda", "sparsegpt", "elsa")


def prune(method: str, sparsity: float, args, out: Path, extra: list[str]) -> dict:
    """One pruning run through the real entry point; returns its elsa_report.json."""
    cmd = [str(ROOT / "launch" / "prune.py"), "--deepspeed", args.deepspeed, "--method", method, "--sparsity", str(sparsity),
           "--output_dir", str(out), "--overwrite", "--val_windows", "0", "--baseline", "none"]
    cmd += [f for flag, value in (("--model", args.model), ("--dataset", args.dataset), ("--seqlen", args.seqlen))
            if value is not None for f in (flag, str(value))]
    if method == "elsa":
        launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
        cmd = [launcher, "--num_gpus", str(args.num_gpus), *cmd, *extra]
    else:
        cmd = [sys.executable, *cmd]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    started = time.time()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if rc != 0:
        raise SystemExit(f"{method} at {sparsity}: launch/prune.py failed with exit code {rc}; see {log}")
    report = json.loads((out / "elsa_report.json").read_text())
    report["bench_wall_s"] = time.time() - started
    return report


def heldout_ppl(model: str, source: str, seqlen: int, out: Path) -> float:
    """Perplexity of a saved or hub model on ``source``'s held-out split, by the evaluation entry point's code."""
    from elsa_ds.evaluation.run import EvalSettings, run

    result = run(EvalSettings(model=model, ppl=[source], seqlen=seqlen, batch_size=8, output=out))
    return result["ppl"][source]["ppl"]


def table(dense: float, rows: list[dict], sparsities: list[float], methods: list[str]) -> str:
    lines = [f"Held-out perplexity (dense: {dense:.2f}); lower is better, best per sparsity in bold.", "",
             "| method | " + " | ".join(f"{s:.0%}" for s in sparsities) + " |", "|---|" + "---:|" * len(sparsities)]
    best = {s: min(r["ppl"] for r in rows if r["sparsity"] == s) for s in sparsities}
    for m in methods:
        cells = []
        for s in sparsities:
            (r,) = [r for r in rows if r["method"] == m and r["sparsity"] == s]
            cells.append(f"**{r['ppl']:.2f}**" if r["ppl"] == best[s] else f"{r['ppl']:.2f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(dense: float, rows: list[dict], methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in methods:
        pts = sorted((r["sparsity"], r["ppl"]) for r in rows if r["method"] == m)
        ax.plot([100 * s for s, _ in pts], [p for _, p in pts], marker="o", label=m)
    ax.axhline(dense, color="grey", linestyle="--", label="dense")
    ax.set_yscale("log")
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)


def targets(dense: float, rows: list[dict], sparsities: list[float], methods: list[str]) -> list[str]:
    """The issue's targets, as lines of text (only those the chosen methods and sparsities can speak to)."""
    said = []
    at = {(r["method"], r["sparsity"]): r["ppl"] for r in rows}
    oneshot = [m for m in methods if m != "elsa"]
    if "elsa" in methods and oneshot:
        for s in (s for s in sparsities if s >= 0.7):
            best = min(oneshot, key=lambda m: at[(m, s)])
            ok = at[("elsa", s)] < at[(best, s)]
            said.append(f"{s:.0%}: ELSA {at[('elsa', s)]:.2f} vs best one-shot {best} {at[(best, s)]:.2f} "
                        f"-> {at[(best, s)] / at[('elsa', s)]:.2f}x lower {'(lowest: yes)' if ok else '(lowest: NO)'}"
                        + (" [target at 90%: >= 2x, goal 5x]" if abs(s - 0.9) < 1e-9 else ""))
    if {"magnitude", "wanda", "sparsegpt"} <= set(methods):
        for s in (s for s in sparsities if 0.5 <= s <= 0.7):
            order = at[("sparsegpt", s)] <= at[("wanda", s)] <= at[("magnitude", s)]
            said.append(f"{s:.0%}: sparsegpt {at[('sparsegpt', s)]:.2f} <= wanda {at[('wanda', s)]:.2f} <= magnitude "
                        f"{at[('magnitude', s)]:.2f}: {'yes' if order else 'NO'}")
    return said


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="hub id or directory [the embedded demo]")
    ap.add_argument("--dataset", default=None, help="calibration / training data [the demo's shakespeare; else c4]")
    ap.add_argument("--eval_ppl", default=None, help="held-out perplexity source [the dataset's validation split]")
    ap.add_argument("--seqlen", type=int, default=None, help="tokens per sequence for pruning and evaluation [demo 256; else 2048]")
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--deepspeed", default="ds_configs/zero3_offload.json")
    ap.add_argument("--num_gpus", type=int, default=2, help="ranks of the ELSA runs [2]")
    ap.add_argument("--out", type=Path, default=Path("out/quality"))
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("elsa_args", nargs=argparse.REMAINDER, help="-- then flags for the ELSA runs")
    args = ap.parse_args()
    extra = [a for a in args.elsa_args if a != "--"]

    from elsa_ds.cli import _quiet_libraries
    from elsa_ds.config import DEMO_MODEL_DIR, resolve_config
    from elsa_ds.zero.ds_config import DsConfig

    _quiet_libraries()
    model = args.model or str(DEMO_MODEL_DIR)
    cfg = resolve_config(DsConfig.load(args.deepspeed).raw, {"model": model, "dataset": args.dataset, "seqlen": args.seqlen})
    source = args.eval_ppl or cfg.dataset
    args.out.mkdir(parents=True, exist_ok=True)
    dense = heldout_ppl(model, source, cfg.seqlen, args.out / "dense_eval.json")
    print(f"[quality] dense {model}: {dense:.3f} on {source} (seqlen {cfg.seqlen})", flush=True)

    rows = []
    for s in args.sparsities:
        for m in args.methods:
            out = args.out / "runs" / f"{m}_{round(100 * s)}"
            report = prune(m, s, args, out, extra)
            ppl = heldout_ppl(str(out), source, cfg.seqlen, out.with_name(out.name + "_eval.json"))
            budget = (f"{report['steps']} steps x {report['tokens'] // max(report['steps'], 1):,} tokens = {report['tokens']:,} tokens"
                      if m == "elsa" else f"{report['tokens']:,} calibration tokens" if report["tokens"] else "no data")
            rows.append({"method": m, "sparsity": s, "ppl": ppl, "wall_s": report["bench_wall_s"], "budget": budget,
                         "steps": report["steps"], "tokens": report["tokens"], "overall_sparsity": report["overall_sparsity"]})
            print(f"[quality] {m:9s} {s:.0%}: ppl {ppl:10.3f}  ({report['bench_wall_s']:.0f} s; {budget})", flush=True)

    md = table(dense, rows, args.sparsities, args.methods)
    elsa_budget = sorted({r["budget"] for r in rows if r["method"] == "elsa"})
    if elsa_budget:
        md += f"\nELSA budget: {', '.join(elsa_budget)} ({' '.join(extra) or 'the config / demo defaults'}).\n"
    checks = targets(dense, rows, args.sparsities, args.methods)
    md += "".join(f"\n- {line}" for line in checks) + ("\n" if checks else "")
    (args.out / "quality.md").write_text(md)
    plot(dense, rows, args.methods, args.out / "quality.png")
    payload = {"model": model, "eval": source, "seqlen": cfg.seqlen, "dense_ppl": dense, "elsa_args": extra, "results": rows}
    for path in filter(None, (args.out / "quality.json", args.json)):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(path)
    print(md)
    print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
