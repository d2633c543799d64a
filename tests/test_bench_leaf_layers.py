"""bench/leaf_layers.py end to end on a 2-layer model: real jobs under the deepspeed launcher, alternating without and with
--leaf_layers (ABBA), their step times and losses, the ratio of the medians as the JSON's last line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


def test_the_bench_alternates_both_jobs_and_prints_their_ratio():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "leaf_layers.py"), "--layers", "2", "--steps", "3",
                           "--rounds", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["leaf_layers"] for r in summary["runs"]] == [False, True, True, False]  # ABBA
    assert all(r["step_time_s"] > 0 for r in summary["runs"])
    losses = {r["leaf_layers"]: r["final_loss"] for r in summary["runs"]}
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)  # the same job, to float rounding
    assert summary["speedup"] == pytest.approx(summary["plain_step_s"] / summary["leaf_step_s"])
    assert summary["model"]["layers"] == 2 and "with --leaf_layers" in proc.stdout
