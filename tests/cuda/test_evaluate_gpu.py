"""The evaluation on a GPU host: an elsa-sparse checkpoint under --device_map auto (what a pruning job's own end-of-run
evaluation sets) is decompressed and spread by accelerate as the dense export is, and scores what the dense export
scores. Marked ``cuda`` (conftest.py); the CPU and disk tiers of the same spread are tested in
tests/sparse/test_where_dense_is_expected.py."""
from __future__ import annotations

import json

import pytest

from elsa_ds.cli import main_evaluate

EVAL = ["--ppl", "shakespeare", "--seqlen", "64", "--limit", "4", "--batch_size", "4", "--device_map", "auto"]


def test_a_sparse_checkpoint_is_spread_and_scored_as_its_dense_export(tmp_path, capsys):
    from elsa_ds.sparse import compress
    from tests.sparse.conftest import pruned_demo

    dense = pruned_demo(tmp_path / "pruned")
    compress(dense, tmp_path / "sparse")
    results = {}
    for name in ("pruned", "sparse"):
        out = tmp_path / f"{name}.json"
        assert main_evaluate(["--model", str(tmp_path / name), *EVAL, "--output", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert "spreading the decompressed model over cuda:0" in capsys.readouterr().out
    assert results["sparse"]["device"].startswith("cuda"), results["sparse"]["device"]
    assert results["sparse"]["ppl"]["shakespeare"]["ppl"] == pytest.approx(results["pruned"]["ppl"]["shakespeare"]["ppl"], rel=1e-5)
