"""bench/gpu_decode.py (issue 45's end-to-end figures on a GPU) rehearsed on the CPU: a tiny Llama built, pruned,
sparsified and timed through generate() with the decode step compiled (as generate() does by itself on CUDA), the
dense weights restored between cells, the issue's keys written; a budget too small for a cell starts none. The GPU
run of the same script is tests/cuda/test_triton_gpu.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, str(ROOT / "bench" / "gpu_decode.py"), "--device", "cpu", "--tiny", "--batches", "1", "--steps", "4",
         "--rounds", "1"]


def _run(*args: str, out: Path) -> dict:
    proc = subprocess.run([*BENCH, *args, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == last
    return last


@pytest.mark.integration
def test_the_cells_run_compiled_with_the_weights_restored_between_them(tmp_path):
    r = _run("--compile", "--sparsities", "0.9,0.7", out=tmp_path / "gpu_decode.json")
    assert r["compiled"] and r["matrix"] == {"skipped": "not a CUDA device"} and r["matrix_speedup"] == {} and r["cut"] == []
    assert [(row["sparsity"], row["batch"]) for row in r["generate"]] == [(0.9, 1), (0.7, 1)]
    high, low = (row["pruned_weight_bytes"] for row in r["generate"])
    assert high["dense"] == low["dense"] and high["sparse"] < 0.2 * high["dense"] < low["sparse"]  # 70 % after 90 %: restored
    for row in r["generate"]:
        assert row["same_tokens"] is True and row["equal_token_fraction"] == 1.0
        assert row["dense"]["tokens_per_s"] > 0 and row["sparse"]["first_call_s"] > 0
    assert set(r["generate_speedup"]) == {"0.9", "0.7"} and r["generate_same_tokens"] == {"0.9@1": True, "0.7@1": True}


def test_a_budget_with_no_room_starts_no_cell(tmp_path):
    r = _run("--no_matrix", "--budget_s", "0", "--sparsities", "0.9,0.7", out=tmp_path / "cut.json")
    assert r["generate"] == [] and [(c["sparsity"], c["batch"]) for c in r["cut"]] == [(0.9, 1), (0.7, 1)]
    assert r["generate_speedup"] == {}


def test_the_generate_cells_take_the_fastest_row_groups_at_90_percent(monkeypatch):
    """The per-matrix part's rows (as bench/sparse_decode_gpu.py writes them): the fastest default-warps variant at 90 %
    summed over both weights sets ELSA_DS_TRITON_ROWS; an explicit --triton_rows wins; no rows (no CUDA): the default."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_decode

    from elsa_ds.sparse.triton_spmv import ROWS_ENV

    def row(sparsity, **us):
        return {"sparsity": sparsity, "batch": 1, **{f"triton_{k}": {"graph_us": v} for k, v in us.items()}}

    matrix = {"rows": [row(0.9, r1=9.0, r4=5.0, r16=4.0, r16w8=1.0), row(0.9, r1=18.0, r4=9.0, r16=10.5, r16w8=1.0),
                       row(0.7, r1=1.0, r4=50.0, r16=50.0, r16w8=50.0)]}
    monkeypatch.delenv(ROWS_ENV, raising=False)
    assert gpu_decode.generate_rows(matrix, None) == 4 and os.environ[ROWS_ENV] == "4"  # 14 us against r16's 14.5 (r16w8 has other warps)
    assert gpu_decode.generate_rows(matrix, 32) == 32 and os.environ[ROWS_ENV] == "32"
    monkeypatch.delenv(ROWS_ENV)
    assert gpu_decode.generate_rows({"skipped": "no CUDA"}, None) is None and ROWS_ENV not in os.environ
