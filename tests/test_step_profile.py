"""Profiling a few training steps (elsa_ds/jobs/step_profile.py): the window, what is measured, and that a loop stopped
inside the window keeps what was measured. The real job's path (launch/prune.py under the deepspeed launcher, the
curve's line) is tests/test_device_ship.py's quality.sh dry run."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.profiler import record_function

from elsa_ds.jobs import step_profile
from elsa_ds.jobs.step_profile import SPANS, StepProfiler, parse_window


def test_the_window_is_first_and_count():
    assert parse_window(None) is None and parse_window("") is None
    assert parse_window("16:3") == (16, 3) and parse_window("0:1") == (0, 1)
    for bad in ("16", "a:3", "3:0", "-1:2", "1:-2", ":3", "2:"):
        with pytest.raises(ValueError, match="FIRST:COUNT"):
            parse_window(bad)


def steps(profiler: StepProfiler, n: int, stop_after: int | None = None) -> None:
    """A plain training loop with the spans zero/steps.py names, as jobs/training.train_loop drives the profiler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        for step in range(n):
            profiler.before(step)
            x = torch.randn(32, 64)
            with record_function("elsa_ds.forward"):
                y = model(x)
            with record_function("elsa_ds.loss"):
                loss = (y - x).pow(2).mean()
            with record_function("elsa_ds.backward"):
                loss.backward()
            with record_function("elsa_ds.step"):
                opt.step()
                opt.zero_grad()
            profiler.after(step)
            if stop_after is not None and step == stop_after:
                break
    finally:
        profiler.close()


def test_a_window_measures_its_steps_and_writes_the_summary(tmp_path, caplog):
    out = tmp_path / "profile.json"
    with caplog.at_level(logging.INFO):
        steps(StepProfiler((1, 2), rank=0, out=out), 8)
    result = json.loads(out.read_text())
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed
    t, p = result["torch"], result["python"]
    assert t["steps"] == 2 and t["complete"] and set(t["spans_s"]) == set(SPANS)
    assert 0 < t["host_ops_s"] and 0 < sum(t["spans_s"].values()) <= t["wall_s"] * 1.05  # spans inside the step's wall
    assert "aten::addmm" in [name for name, _ in t["host_top"]] and t["device_s"] == 0.0 and t["kernels"] == 0  # no GPU
    assert p["steps"] == 2 and p["complete"] and p["wall_s"] > 0 and len(p["self_top"]) == step_profile.TOP
    assert any("ms a step" in r.message and "spans (ms)" in r.message for r in caplog.records)


def test_a_loop_stopped_inside_the_window_keeps_what_it_measured(tmp_path):
    out = tmp_path / "profile.json"
    steps(StepProfiler((1, 4), rank=0, out=out), 8, stop_after=2)  # two of the four torch.profiler steps ran
    result = json.loads(out.read_text())
    assert set(result) == {"torch"} and not result["torch"]["complete"] and result["torch"]["steps"] == 2


def test_only_rank_0_profiles_and_a_malformed_window_is_a_warning(tmp_path, monkeypatch, caplog):
    out = tmp_path / "profile.json"
    steps(StepProfiler((0, 1), rank=1, out=out), 3)
    assert not out.exists()
    monkeypatch.setenv(step_profile.PROFILE_STEPS_ENV, "sixteen")
    monkeypatch.setenv(step_profile.PROFILE_OUT_ENV, str(out))
    with caplog.at_level(logging.WARNING):
        profiler = StepProfiler.from_env(0)
    assert profiler.window is None and any("no steps are profiled" in r.message for r in caplog.records)
    monkeypatch.setenv(step_profile.PROFILE_STEPS_ENV, "0:1")
    steps(StepProfiler.from_env(0), 3)
    assert json.loads(out.read_text())["python"]["complete"]


def test_a_profiler_that_fails_stops_profiling_with_a_warning_never_the_run(tmp_path, monkeypatch, caplog):
    def no_cupti(*args, **kwargs):
        raise RuntimeError("CUPTI could not be loaded")

    monkeypatch.setattr(step_profile.torch.profiler, "profile", no_cupti)
    profiler = StepProfiler((1, 1), rank=0, out=tmp_path / "profile.json")
    with caplog.at_level(logging.WARNING):
        steps(profiler, 4)  # every step ran
    assert profiler.window is None and not (tmp_path / "profile.json").exists()
    assert [r.message for r in caplog.records if "step profile stopped" in r.message] == [
        "the step profile stopped (RuntimeError: CUPTI could not be loaded); the run goes on without it"]
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the summary cannot be written: the measured steps are still logged
        steps(StepProfiler((0, 1), rank=0, out=tmp_path / "missing" / "profile.json"), 3)
    assert any("step profile stopped (FileNotFoundError" in r.message for r in caplog.records)
