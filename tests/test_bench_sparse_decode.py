"""bench/sparse_decode.py --kernels_only runs end to end and its --json file and last line hold every path's timing."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_kernels_only_bench_times_every_path_and_writes_its_json(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sparse_decode.py"), "--kernels_only", "--sparsities", "0.9",
                           "--batches", "1,2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == last
    assert isinstance(last["portable_at_batch_1"], bool) and last["cpu"]
    rows = last["kernels"]
    assert [(r["sparsity"], r["batch"]) for r in rows] == [(0.9, 1), (0.9, 2)]
    for r in rows:
        for path in ("dense", "kernel", "csr"):
            assert math.isfinite(r[f"{path}_ms"]) and r[f"{path}_ms"] > 0, (path, r)
        assert ("avx512_ms" in r) == ("portable_ms" in r)  # both batch-1 loops, or neither (no AVX-512 build)
