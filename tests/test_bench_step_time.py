"""bench/step_time.py --plan end to end: the 27B budget's memory and time from elsa-estimate itself, issue 43's H200 jobs
beside what they measured, and what fits the lent machine, as printed tables and one JSON line. The measured mode runs
real jobs through ``elsa_ds.capacity.ablation`` (``tests/zero/test_ablation.py`` covers that path)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import step_time as bench  # noqa: E402  (bench/step_time.py)


@pytest.fixture(scope="module")
def plan() -> tuple[str, list[dict]]:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_time.py"), "--plan", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])["rows"]


def test_the_27b_budget_rows_hold_the_runs_tokens_and_its_time(plan):
    printed, rows = plan
    budget = [r for r in rows if r.get("gpus_per_node") == 8]
    assert {(r["model"], r["config"], r["nodes"]) for r in budget} == {
        (m, c, n) for m in bench.PLAN_MODELS for c in bench.PLAN_CONFIGS for n in (1, 2)}
    for r in budget:
        assert r["tokens"] == 4096 * 8 * 8 * r["nodes"] * 2048
        assert r["run_h"] * 3600 >= 4096 * r["step_s"] > 0  # the run is its steps plus load, projections, export
        assert (r["nvme_gib"] > 0) == (r["config"] == "zero3_nvme")
        assert f"| {r['model']} | {r['config']} | {r['nodes']} x 8 | {r['per_gpu_gib']:.1f} |" in printed
    by = {(r["model"], r["config"], r["nodes"]): r for r in budget}
    for model in bench.PLAN_MODELS:
        for nodes in (1, 2):  # ELSA-L's fp8 z, bf16 u and 8-bit moments: less host memory than fp32 states
            assert by[model, "zero3_offload_elsal", nodes]["cpu_per_node_gib"] < by[model, "zero3_offload", nodes]["cpu_per_node_gib"]
        for config, (json_name, _) in bench.PLAN_CONFIGS.items():  # twice the ranks: each keeps about half the partitions
            kept = "per_gpu_gib" if json_name == "zero3" else "cpu_per_node_gib"  # zero3: all on the GPUs, the host's a runtime
            assert by[model, config, 2][kept] < by[model, config, 1][kept]
        resident = by[model, "zero3 + ELSA-L's states", 1]  # the optimizer on 80 GB GPUs: a fraction of offload's host
        assert resident["per_gpu_gib"] < 80 and resident["cpu_per_node_gib"] < 0.1 * by[model, "zero3_offload_elsal", 1]["cpu_per_node_gib"]


def test_the_h200_jobs_stand_beside_what_they_measured(plan):
    _, rows = plan
    h200 = {r["config"]: r for r in rows if r.get("measured_step_s") is not None}
    assert set(h200) == set(bench.H200_RUNS)
    for config, r in h200.items():
        assert r["measured_step_s"] == bench.H200_RUNS[config]
        assert r["ratio"] == pytest.approx(r["step_s"] / r["measured_step_s"])


def test_what_fits_the_lent_machine_is_the_largest_cut_inside_it(plan):
    _, rows = plan
    fits = {(f["config"], f["freeze_embeddings"]): f for f in (r["fits_lent_machine"] for r in rows if "fits_lent_machine" in r)}
    assert set(fits) == {(c, frozen) for c in bench.FIT_CONFIGS for frozen in (True, False)}
    for (config, frozen), f in fits.items():
        assert f["layers"] >= 1, f"{config}: not even one 27B layer fits the lent machine"
        assert f["cpu_gib"] <= bench.LENT_HOST_GIB and f["gpu_gib"] <= bench.LENT_GPU_GIB and f["nvme_gib"] <= bench.LENT_DISK_GIB
        assert fits[config, True]["layers"] >= fits[config, False]["layers"]  # frozen embeddings: no moments for them
    assert fits["zero3_offload_elsal", True]["layers"] >= fits["zero3_offload", True]["layers"]


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_a_measured_run_puts_time_and_memory_beside_the_estimate(tmp_path):
    """The measured mode on the demo, one rank, one config, 3 steps: the real job through the ablation's harness."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_time.py"), "--configs", "ds_configs/zero3_offload.json",
                           "--ranks", "1", "--steps", "3", "--interval", "2", "--out", str(tmp_path), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert row["config"] == "zero3_offload" and row["measured_s"] > 0 and row["estimated_s"] > 0
    assert row["ratio"] == pytest.approx(row["estimated_s"] / row["measured_s"])
    assert row["host_peak_bytes"] > 0 and row["host_ratio"] == pytest.approx(row["host_est_bytes"] / row["host_peak_bytes"])
    assert row["gpu_peak_bytes"] is None  # no GPU here: the report has no allocator peak
    assert row["timed_optimizer_step"] > 0 and row["timed_projection"] > 0  # the job's optimizer timed beside DeepSpeedCPUAdam
    assert f"| zero3_offload | 1 | 3 | {row['measured_s']:.3f} |" in proc.stdout
