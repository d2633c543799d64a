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


# the second pair runs the same bench code on other arms (their jobs: tests/zero/test_leaf_layers.py): --slow only
@pytest.mark.parametrize("arms", ["plain,leaf", pytest.param("leaf,leaf_torch_linear", marks=pytest.mark.slow)])
def test_the_bench_alternates_both_jobs_and_prints_their_ratio(arms):
    """Without and with --leaf_layers; within it, DeepSpeed's linear wrapper or torch's (memory_efficient_linear off)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "leaf_layers.py"), "--layers", "2", "--steps", "3",
                           "--rounds", "1", "--arms", arms, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    a, b = arms.split(",")
    assert [r["arm"] for r in summary["runs"]] == [a, b, b, a]  # ABBA
    assert [r["leaf_layers"] for r in summary["runs"]] == [a != "plain", True, True, a != "plain"]
    assert all(r["step_time_s"] > 0 for r in summary["runs"])
    losses = {r["arm"]: r["final_loss"] for r in summary["runs"]}
    assert losses[a] == pytest.approx(losses[b], rel=1e-4)  # the same job, to float rounding
    assert summary["speedup"] == pytest.approx(summary["median_step_s"][a] / summary["median_step_s"][b])
    assert summary["model"]["layers"] == 2 and f"s {a}, " in proc.stdout


def test_unknown_or_repeated_arms_are_refused():
    for arms in ("plain,nope", "leaf,leaf", "plain"):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "leaf_layers.py"), "--arms", arms], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "--arms" in proc.stderr
