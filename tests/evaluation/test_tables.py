"""--compare renders several result JSONs as one markdown table."""
from __future__ import annotations

import json
import math

from elsa_ds.jobs.evaluate import EvalSettings, run
from tests.conftest import run_entry


def test_compare_two_models(tmp_path, tiny_model_dir, sixty_model_dir, text_dir, offline):
    text = str(text_dir / "macbeth.txt")
    paths = []
    for name, model in (("dense", tiny_model_dir), ("sixty", sixty_model_dir)):
        paths.append(tmp_path / f"{name}.json")
        run(EvalSettings(model=str(model), ppl=[text], seqlen=64, limit=4, output=paths[-1]))
    dense, sixty = (json.loads(p.read_text()) for p in paths)
    assert dense["ppl"][text]["windows"] == 4  # --limit caps the windows
    got = dense["ppl"][text]  # what the sum of NLL is divided by, beside it (an audit: `tokens` is not it)
    assert got["denominator"] == 4 * 64 != got["tokens"] and abs(math.exp(got["nll_sum"] / got["denominator"]) / got["ppl"] - 1) < 1e-12

    md = tmp_path / "table.md"
    proc = run_entry("evaluate.py", ["--compare", *map(str, paths), "--markdown", str(md)], timeout=120)
    table = md.read_text()
    assert proc.stdout.strip() == table.strip()
    rows = [line for line in table.splitlines() if line.startswith(f"| {tiny_model_dir}") or line.startswith(f"| {sixty_model_dir}")]
    assert len(rows) == 2
    assert "0.00%" in rows[0] and "dense" in rows[0] and f"{dense['ppl'][text]['ppl']:.3f}" in rows[0]
    assert f"{100 * sixty['sparsity']['overall']:.2f}%" in rows[1] and "unstructured" in rows[1]
    assert f"{sixty['ppl'][text]['ppl']:.3f}" in rows[1]
    assert f"{text} ppl" in table.splitlines()[0]
    assert "--limit" in table  # results from a limited run are flagged


def test_perplexities_over_other_windows_are_flagged():
    """The same text scored over 64-token and 128-token windows (or another count of them) is not one column's worth of
    comparable numbers: the table says so (a walk); the same windows say nothing."""
    from elsa_ds.evaluation.tables import results_table

    def result(seqlen: int, windows: int) -> dict:
        return {"model": f"m{seqlen}-{windows}", "seqlen": seqlen, "protocol": {"ppl": "window"},
                "ppl": {"shakespeare": {"ppl": 70.0, "windows": windows}}}
    assert "not comparable" not in results_table([result(64, 8), result(64, 8)])
    for other in (result(128, 8), result(64, 4)):
        table = results_table([result(64, 8), other])
        assert "shakespeare was scored over different windows" in table and "not comparable" in table
