"""Collect the built models' metrics and their one-shot sanity runs into one small JSON (no weights).

    python bench/models/summarize.py --json bench/results/models.json \\
        --sanity docs-llama=out/models/docs-llama/quality.json --sanity check-qwen2=out/models/check-qwen2/quality.json

Reads ``training_metrics.json`` of every recipe in ``build.RECIPES`` under ``--models`` (default
``~/.cache/elsa_ds/models``; a model not built there is listed with ``"built": false``), and for ``--sanity NAME=FILE`` the ``quality.json`` that ``bench/quality.py``
wrote for that model (dense and pruned perplexity on the test split).
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

KEEP = ("arch", "n_params", "steps", "batch", "seqlen", "tokens_seen", "epochs", "final_train_loss", "val_ppl",
        "test_ppl", "heldout", "tokens", "warmup_steps", "tokenizer", "train_wall_s", "eval_wall_s", "wall_s",
        "versions", "recipe_key", "val_curve")


def summary(models: Path, sanity: dict[str, Path]) -> dict:
    out = {}
    for name, (corpus, settings, role) in RECIPES.items():
        path = models.expanduser() / name / "training_metrics.json"
        if not path.is_file():  # not built: say so rather than drop it
            out[name] = {"role": role, "built": False, "corpus": {"name": corpus}, "settings": asdict(settings),
                         "build": f"python bench/models/build.py --name {name}"}
            continue
        m = json.loads(path.read_text())
        entry = {"role": role, "built": True, "corpus": m["corpus"], "settings": m["settings"], **{k: m[k] for k in KEEP}}
        if name in sanity:
            q = json.loads(sanity[name].read_text())
            entry["oneshot_sanity"] = {
                "eval": Path(q["eval"]).name, "seqlen": q["seqlen"], "dense_ppl": round(q["dense_ppl"], 3),
                "results": [{"method": r["method"], "sparsity": r["sparsity"], "ppl": round(r["ppl"], 3),
                             "overall_sparsity": r["overall_sparsity"], "calibration": r["budget"], "wall_s": round(r["wall_s"], 1)}
                            for r in q["results"]],
            }
        out[name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=MODELS_HOME)
    ap.add_argument("--sanity", action="append", default=[], metavar="NAME=FILE", help="bench/quality.py JSON of a model")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    sanity = {}
    for item in args.sanity:
        name, _, file = item.partition("=")
        if name not in RECIPES or not file:
            ap.error(f"--sanity {item!r}: expected NAME=FILE with NAME in {', '.join(RECIPES)}")
        sanity[name] = Path(file)
    data = summary(args.models, sanity)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: {"val_ppl": v.get("val_ppl"), "test_ppl": v.get("test_ppl")} for k, v in data.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
