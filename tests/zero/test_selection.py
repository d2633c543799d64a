"""Validation-driven selection (--select_every): the exported model is the best scored hard projection Π(x)."""
from __future__ import annotations

import json

import pytest

from elsa_ds.evaluation.run import EvalSettings, run
from tests.conftest import derived_config, run_entry

pytestmark = pytest.mark.integration


def test_export_is_the_best_scored_projection_on_two_ranks(tmp_path, tiny_model_dir, text_dir):
    ds = derived_config(tmp_path, bf16={"enabled": False})
    out = tmp_path / "out"
    # lr 0.03 makes the second projection (step 4) worse than the first on these windows: with patience 1 the run stops
    # there and exports the snapshot of step 2 (restored into the shards), the path a final Π(x) never takes
    run_entry("prune.py", ["--deepspeed", str(ds), "--model", str(tiny_model_dir), "--dataset", str(text_dir),
                           "--val_dataset", str(text_dir / "othello.txt"), "--seqlen", "64", "--steps", "16", "--interval", "2",
                           "--sparsity", "0.7", "--lr", "0.03", "--lmda", "0.05", "--micro_batch", "2", "--val_windows", "8",
                           "--select_every", "1", "--select_patience", "1", "--baseline", "none", "--init_mask", "none", "--output_dir", str(out)], ranks=2)
    report = json.loads((out / "elsa_report.json").read_text())
    selection = report["selection"]
    curve, chosen = selection["curve"], selection["chosen"]
    assert [p["step"] for p in curve if not p.get("final")] == list(range(2, 2 * len([p for p in curve if not p.get("final")]) + 1, 2))
    assert chosen["ppl"] == min(p["ppl"] for p in curve)
    assert selection["stopped_at"] == 4 and chosen == {"step": 2, "ppl": curve[0]["ppl"], "final": False}
    assert not any(p.get("final") for p in curve)  # stopped early: no final projection
    assert report["ppl"]["pruned"] == pytest.approx(chosen["ppl"])
    for name, layer in report["layers"].items():
        assert layer["zeros"] == round(0.7 * layer["numel"]), name
    # the exported files are the chosen projection: the evaluation code measures the same perplexity on the same windows
    measured = run(EvalSettings(model=str(out), ppl=[str(text_dir / "othello.txt")], seqlen=64, limit=8))
    assert measured["ppl"][str(text_dir / "othello.txt")]["ppl"] == pytest.approx(chosen["ppl"], rel=1e-4)
