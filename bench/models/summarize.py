"""Collect the built models' metrics and their quality-bench results into one small JSON (no weights).

    python bench/models/summarize.py --json bench/results/models.json \\
        --quality docs-llama=bench/results/quality_docs-llama.json \\
        --quality docs-llama=bench/results/quality_docs-llama_90.json \\
        --quality check-qwen2=bench/results/quality_check-qwen2.json

Reads ``training_metrics.json`` of every recipe in ``build.RECIPES`` under ``--models`` (default
``~/.cache/elsa_ds/models``; a model not built there is listed with ``"built": false``), and for ``--quality NAME=FILE``
the ``quality.json`` that ``bench/quality.py`` wrote for that model (every row's held-out perplexity, budget and
settings). The JSON is written to a temporary file and renamed, so an existing one is never half-overwritten.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.models.build import MODELS_HOME, RECIPES  # noqa: E402
from elsa_ds.files.io import write_atomic  # noqa: E402

KEEP = ("arch", "n_params", "steps", "batch", "seqlen", "tokens_seen", "epochs", "final_train_loss", "val_ppl",
        "test_ppl", "heldout", "tokens", "warmup_steps", "tokenizer", "train_wall_s", "eval_wall_s", "wall_s",
        "versions", "recipe_key", "val_curve")


def quality_rows(path: Path) -> dict:
    """One bench/quality.py JSON, without the absolute paths and the per-run noise."""
    q = json.loads(path.read_text())
    if not isinstance(q.get("results"), list) or any("row" not in r for r in q["results"]):
        raise ValueError(f"{path}: not a bench/quality.py JSON (no results[].row)")
    return {"file": path.name, "eval": Path(q["eval"]).name, "seqlen": q["seqlen"], "steps": q["steps"],
            "elsa_args": q["elsa_args"], "ft_args": q["ft_args"],
            "results": [{"row": r["row"], "sparsity": r["sparsity"], "ppl": round(r["ppl"], 3),
                         "overall_sparsity": r["overall_sparsity"], "budget": r["budget"], "settings": r["settings"],
                         "wall_s": None if r["wall_s"] is None else round(r["wall_s"], 1)} for r in q["results"]]}


def summary(models: Path, quality: dict[str, list[Path]]) -> dict:
    out = {}
    for name, (corpus, settings, role, prune) in RECIPES.items():
        path = models.expanduser() / name / "training_metrics.json"
        if not path.is_file():  # not built: say so rather than drop it
            out[name] = {"role": role, "built": False, "corpus": {"name": corpus, "prune_fraction": prune}, "settings": asdict(settings),
                         "build": f"python bench/models/build.py --name {name}"}
            continue
        m = json.loads(path.read_text())
        entry = {"role": role, "built": True, "corpus": m["corpus"], "settings": m["settings"], **{k: m[k] for k in KEEP}}
        if name in quality:
            entry["quality"] = [quality_rows(path) for path in quality[name]]
        out[name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=MODELS_HOME)
    ap.add_argument("--quality", action="append", default=[], metavar="NAME=FILE", help="bench/quality.py JSON of a model (repeatable)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    quality = {}
    for item in args.quality:
        name, _, file = item.partition("=")
        if name not in RECIPES or not file:
            ap.error(f"--quality {item!r}: expected NAME=FILE with NAME in {', '.join(RECIPES)}")
        if not Path(file).is_file():
            ap.error(f"--quality {item!r}: {file} is not a file (run bench/quality.py for {name} first)")
        quality.setdefault(name, []).append(Path(file))
    try:
        data = summary(args.models, quality)
    except ValueError as e:
        ap.error(str(e))
    write_atomic(args.json, json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: {"val_ppl": v.get("val_ppl"), "test_ppl": v.get("test_ppl")} for k, v in data.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
