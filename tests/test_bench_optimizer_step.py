"""bench/optimizer_step.py runs end to end on a small flat and its --json line holds what the README quotes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_optimizer_step_bench_json_names_the_shipped_elsal_format():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "optimizer_step.py"), "--numel", "3e5", "--slices", "3",
                           "--interval", "4", "--rounds", "1", "--remedies", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    shipped = json.loads((ROOT / "ds_configs" / "zero3_offload_elsal.json").read_text())["elsa"]["base_optimizer"]
    assert out["elsal_base_optimizer"] == shipped
    assert out["ratio_elsal"] == out["ratio_elsal_minifloat" if shipped == "adam8bit_minifloat" else "ratio_elsal_bnb"]
    for key in ("ratio_fp32", "ratio_elsal", "ratio_elsal_minifloat", "ratio_elsal_bnb", "projection_steps_equiv"):
        assert out[key] > 0, (key, out)
    assert out["numel"] == 300000 and out["slices"] == 3 and out["interval"] == 4
    assert sum(out["projection_paths"].values()) >= 1  # the fp32 run projected (the exact passes on a flat this small)
    # the remedies' rows, each against the fused ELSA beside the same DeepSpeedCPUAdam: what step_time.py scales by
    assert set(out["remedies"]) == {f"{r}_{k}" for r in ("adaptive", "relaxed") for k in ("fp32", "l_minifloat", "l_bnb")}
    assert all(f["step_vs_fused"] > 0 and f["projection_vs_fused"] > 0 for f in out["remedies"].values()), out["remedies"]
