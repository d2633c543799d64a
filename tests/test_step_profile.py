"""Profiling a few training steps (elsa_ds/step_profile.py): the window, what is measured and how the GPU's entries
are counted, a loop stopped inside the window, a failing profiler or run, the profiled steps out of the mean step time.
The real job's path (launch/prune.py under the deepspeed launcher, the curve's line) is tests/test_device_ship.py's
quality.sh dry run; bench/step_time.py's, tests/test_device_kit.py's scale.sh dry run."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

from elsa_ds import step_profile
from elsa_ds.step_profile import SPANS, StepProfiler, operator_summary, parse_window
from tests.conftest import ROOT


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
            profiler.after(step, 0.01)
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
    assert 0 < t["host_ops_s"] and t["wall_s"] == p["wall_s"] == 0.01  # a step's wall: the loop's own measure
    assert "aten::addmm" in [name for name, _ in t["host_top"]] and t["device_s"] == 0.0 and t["device_events"] == 0  # no GPU
    assert t["spans_gpu_s"] == {} and t["runtime_s"] == t["sync_s"] == 0.0 and not t["cuda"]
    assert p["steps"] == 2 and p["complete"] and len(p["self_top"]) == step_profile.TOP
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
    assert any("step profile stopped (ElsaError: cannot write" in r.message and "No such file" in r.message
               for r in caplog.records)


def event(key, device, self_cpu=0, cpu=0, self_dev=0, dev=0, count=1, annotation=False):
    return types.SimpleNamespace(key=key, device_type=device, is_user_annotation=annotation, self_cpu_time_total=self_cpu,
                                 cpu_time_total=cpu, self_device_time_total=self_dev, device_time_total=dev, count=count)


def test_on_a_gpu_each_kernel_counts_once_and_a_span_keeps_its_host_time():
    """key_averages() groups by key and device: a CUDA op's CPU entry carries its kernels' time, the kernel has its own
    entry, and a span has a CPU entry and a GPU annotation under the same name (torch's own table counts the same way)."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    averages = [event("aten::mm", cpu, self_cpu=300, cpu=300, self_dev=500, dev=500, count=2),  # launched the kernel below
                event("sm90_gemm_bf16", gpu, self_dev=500, dev=500, count=2),
                event("Memcpy HtoD (Pageable -> Device)", gpu, self_dev=100, dev=100),
                event("cudaLaunchKernel", cpu, self_cpu=40, cpu=40, count=2),
                event("cudaStreamSynchronize", cpu, self_cpu=900, cpu=900),
                event("elsa_ds.forward", cpu, self_cpu=60, cpu=2000),
                event("elsa_ds.forward", gpu, self_dev=700, dev=700, annotation=True)]
    t = operator_summary(averages, 2)
    assert t["device_s"] == pytest.approx(300e-6) and t["device_events"] == 1.5  # the kernel and the copy, once each
    assert t["host_ops_s"] == pytest.approx(150e-6) and t["runtime_s"] == pytest.approx(470e-6)
    assert t["sync_s"] == pytest.approx(450e-6)
    assert t["spans_s"] == {"elsa_ds.forward": pytest.approx(1e-3)} and t["spans_gpu_s"] == {"elsa_ds.forward": pytest.approx(350e-6)}
    assert [k for k, _ in t["device_top"]] == ["sm90_gemm_bf16", "Memcpy HtoD (Pageable -> Device)"]
    assert [k for k, _ in t["host_top"]] == ["cudaStreamSynchronize", "aten::mm", "cudaLaunchKernel"]  # no span there


def test_a_failing_run_drops_the_profile_and_the_mean_step_time_leaves_profiled_steps_out(tmp_path, monkeypatch, caplog):
    from elsa_ds.jobs.training import RunState, train_loop

    cfg = types.SimpleNamespace(steps=8, method=types.SimpleNamespace(value="elsa"), save_interval=0)
    monkeypatch.setenv(step_profile.PROFILE_STEPS_ENV, "2:2")
    monkeypatch.setenv(step_profile.PROFILE_OUT_ENV, str(tmp_path / "profile.json"))
    state = RunState()
    train_loop(cfg, state, 0, lambda step: 1.0, lambda bar, step, loss: False, lambda: None)
    assert len(state.losses) == 8 and len(state.step_times) == 4  # steps 2-5 ran under a profiler
    assert json.loads((tmp_path / "profile.json").read_text())["python"]["steps"] == 2
    monkeypatch.setenv(step_profile.PROFILE_STEPS_ENV, "1:1")
    short = types.SimpleNamespace(steps=3, method=cfg.method, save_interval=0)
    train_loop(short, state := RunState(), 0, lambda step: 1.0, lambda bar, step, loss: False, lambda: None)
    assert len(state.step_times) == 3  # fewer than two steps would be left for the mean: the profiled ones stay

    def fails(step):
        if step == 3:
            raise RuntimeError("a rank is gone")
        return 1.0

    (tmp_path / "profile.json").unlink()
    monkeypatch.setenv(step_profile.PROFILE_STEPS_ENV, "2:2")
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="a rank is gone"):
        train_loop(cfg, RunState(), 0, fails, lambda bar, step, loss: False, lambda: None)
    assert not (tmp_path / "profile.json").exists() and not [r for r in caplog.records if "profile" in r.message]


def test_a_bench_reads_a_summary_or_says_why_it_could_not(tmp_path):
    assert step_profile.read_profile(tmp_path / "none.json") == {}
    (tmp_path / "cut.json").write_text('{"torch": {"steps"')  # a file cut short
    assert "JSONDecodeError" in step_profile.read_profile(tmp_path / "cut.json")["profile"]["unreadable"]
    (tmp_path / "ok.json").write_text('{"torch": {"steps": 3}}')
    assert step_profile.read_profile(tmp_path / "ok.json") == {"profile": {"torch": {"steps": 3}}}


def test_a_full_disk_at_the_summary_is_the_one_warning_and_leaves_no_temp_file(tmp_path):
    """A third audit: the summary's fixed temp name was left half-written beside it on a full disk (ulimit -f here)."""
    code = textwrap.dedent("""
        import resource, signal, sys
        from pathlib import Path
        from elsa_ds.step_profile import StepProfiler
        from tests.test_step_profile import steps
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk's does
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        steps(StepProfiler((0, 2), rank=0, out=Path(sys.argv[1]) / "profile.json"), 4)
    """)
    (tmp_path / "profile.json").write_text("the last summary")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "the step profile stopped" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]
    assert (tmp_path / "profile.json").read_text() == "the last summary"
