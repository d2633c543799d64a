"""Where a training step's time goes, measured inside a real job: a few steps under ``torch.profiler`` (operators'
host time, the GPU's kernel time), then as many under ``cProfile`` (the Python functions that spend the host's time:
DeepSpeed's hooks, the model's code, ours). For machines lent briefly: ``bench/device/curve.py`` asks it of every
training cell on the GPU, so that a loan that runs the budget curve also says whether its steps wait on the host or on
the GPU, at a few seconds a cell. On CUDA, autograd runs the backward (and DeepSpeed's hooks in it) on its own device
thread, which cProfile does not see: there the backward's Python shows as ``run_backward``; torch.profiler's spans and
operators cover every thread.

Off unless ``ELSA_DS_PROFILE_STEPS`` is ``FIRST:COUNT`` (``16:3``: steps 16-18 under torch.profiler, 19-21 under
cProfile); rank 0 then logs a summary once the window ends and, if ``ELSA_DS_PROFILE_OUT`` names a file, writes it there
as JSON (temp file, then rename). Every figure is per step. The steps are the job's own: the loss is not changed, only
slowed while profiled (the job's step times include those steps). A malformed value is a warning, not an error: the
profile is a diagnostic, never a reason to stop a run.
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import time
from pathlib import Path
from typing import Any

import torch

from elsa_ds.log import get_logger

log = get_logger(__name__)

PROFILE_STEPS_ENV = "ELSA_DS_PROFILE_STEPS"
PROFILE_OUT_ENV = "ELSA_DS_PROFILE_OUT"
TOP = 10  # operators / functions kept in each list
# the spans zero/steps.py names (torch.profiler.record_function): a step's host time by part
SPANS = ("elsa_ds.forward", "elsa_ds.loss", "elsa_ds.backward", "elsa_ds.step")


def parse_window(text: str | None) -> tuple[int, int] | None:
    """``"FIRST:COUNT"`` -> (first, count) with first >= 0, count >= 1; None when unset; ValueError when malformed."""
    if not text:
        return None
    first, sep, count = text.partition(":")
    if not sep or not first.strip().isdigit() or not count.strip().isdigit() or int(count) < 1:
        raise ValueError(f"{PROFILE_STEPS_ENV}={text!r} is not FIRST:COUNT (e.g. 16:3)")
    return int(first), int(count)


class StepProfiler:
    """Call :meth:`before` and :meth:`after` around each step and :meth:`close` once the loop ends (a no-op unless
    this is rank 0 with a window set: see the module's text)."""

    def __init__(self, window: tuple[int, int] | None, rank: int, out: Path | None = None):
        self.window = window if rank == 0 else None
        self.out = out
        self.torch_prof: Any = None
        self.python_prof: cProfile.Profile | None = None
        self.started = 0.0
        self.measured = 0  # steps ended under the profiler now open
        self.result: dict[str, Any] = {}

    @classmethod
    def from_env(cls, rank: int) -> StepProfiler:
        try:
            window = parse_window(os.environ.get(PROFILE_STEPS_ENV))
        except ValueError as err:
            if rank == 0:
                log.warning(f"{err}; no steps are profiled")
            window = None
        out = os.environ.get(PROFILE_OUT_ENV)
        return cls(window, rank, Path(out) if out else None)

    def before(self, step: int) -> None:
        self._guarded(self._before, step)

    def after(self, step: int) -> None:
        self._guarded(self._after, step)

    def close(self) -> None:
        """End whatever is still open (the loop stopped inside the window: what was measured is kept), then report."""
        self._guarded(self._close)

    def _guarded(self, method, *args) -> None:
        """A profiler that fails (CUPTI missing, a full disk) stops profiling with one warning, never the run."""
        if self.window is None:
            return
        try:
            method(*args)
        except Exception as err:  # noqa: BLE001 - a diagnostic: whatever went wrong, the job goes on unprofiled
            log.warning(f"the step profile stopped ({type(err).__name__}: {err}); the run goes on without it")
            self.window = None
            torch_prof, python_prof, self.torch_prof, self.python_prof = self.torch_prof, self.python_prof, None, None
            try:
                if torch_prof is not None:
                    torch_prof.__exit__(None, None, None)
                if python_prof is not None:
                    python_prof.disable()
            except Exception:  # noqa: BLE001,S110 - reported once above
                pass

    def _before(self, step: int) -> None:
        assert self.window is not None
        first, count = self.window
        if step == first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_prof = torch.profiler.profile(activities=activities)
            self.torch_prof.__enter__()
            self.started, self.measured = time.perf_counter(), 0
        elif step == first + count:
            self.python_prof = cProfile.Profile()
            self.started, self.measured = time.perf_counter(), 0
            self.python_prof.enable()

    def _after(self, step: int) -> None:
        assert self.window is not None
        first, count = self.window
        if self.torch_prof is not None or self.python_prof is not None:
            self.measured += 1
        if step == first + count - 1 and self.torch_prof is not None:
            self._end_torch(complete=True)
        elif step == first + 2 * count - 1 and self.python_prof is not None:
            self._end_python(complete=True)
            self._close()

    def _close(self) -> None:
        if self.torch_prof is not None:
            self._end_torch(complete=False)
        if self.python_prof is not None:
            self._end_python(complete=False)
        if self.result:
            self._report()
        self.window = None

    def _end_torch(self, complete: bool) -> None:
        sync()
        wall = time.perf_counter() - self.started
        prof, self.torch_prof = self.torch_prof, None
        prof.__exit__(None, None, None)
        if self.measured:  # a step that raised is no step to average over
            self.result["torch"] = operator_summary(prof.key_averages(), wall, self.measured) | {"complete": complete}

    def _end_python(self, complete: bool) -> None:
        sync()
        prof, self.python_prof = self.python_prof, None
        assert prof is not None
        prof.disable()
        if self.measured:
            stats = pstats.Stats(prof)
            self.result["python"] = function_summary(stats, time.perf_counter() - self.started, self.measured) | {"complete": complete}

    def _report(self) -> None:
        t = self.result.get("torch")
        if t:
            spans = ", ".join(f"{k.split('.')[-1]} {v * 1e3:.0f}" for k, v in t["spans_s"].items())
            log.info(f"profile of {t['steps']} steps: {t['wall_s'] * 1e3:.0f} ms a step; operators on the host "
                     f"{t['host_ops_s'] * 1e3:.0f} ms, {t['kernels']:.0f} kernels taking {t['device_s'] * 1e3:.0f} ms on the "
                     f"GPU; spans (ms): {spans}")
            log.info("  host operators (ms a step): " + "; ".join(f"{n} {s * 1e3:.1f}" for n, s in t["host_top"]))
            if t["device_top"]:
                log.info("  GPU kernels (ms a step): " + "; ".join(f"{n} {s * 1e3:.1f}" for n, s in t["device_top"]))
        p = self.result.get("python")
        if p:
            log.info(f"profile (cProfile) of {p['steps']} steps: {p['wall_s'] * 1e3:.0f} ms a step; functions by own time "
                     "(ms a step): " + "; ".join(f"{n} {s * 1e3:.1f}" for n, s in p["self_top"]))
        if self.out is not None:
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(json.dumps(self.result, indent=1), encoding="utf-8")
            os.replace(tmp, self.out)


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def operator_summary(averages, wall: float, n: int) -> dict[str, Any]:
    """Per step of ``n``: the wall time, the host time inside operators (self time, summed), the GPU's kernels (their
    count and time, summed), the named spans' host time (inclusive) and the operators / kernels that took the most."""
    host = [(e.key, e.self_cpu_time_total / 1e6 / n) for e in averages]
    device = [(e.key, device_self_us(e) / 1e6 / n) for e in averages]
    spans = {e.key: e.cpu_time_total / 1e6 / n for e in averages if e.key in SPANS}
    top = sorted(((k, s) for k, s in host if k not in SPANS), key=lambda x: -x[1])[:TOP]
    kernels = sum(e.count for e in averages if device_self_us(e) > 0) / n
    return {"steps": n, "wall_s": wall / n, "host_ops_s": sum(s for k, s in host if k not in SPANS),
            "device_s": sum(s for _, s in device), "kernels": kernels, "spans_s": spans,
            "host_top": [[k, round(s, 6)] for k, s in top],
            "device_top": [[k, round(s, 6)] for k, s in sorted(device, key=lambda x: -x[1])[:TOP] if s > 0]}


def device_self_us(event) -> float:
    """An averaged event's own time on the accelerator (µs); torch names it device time now, CUDA time before."""
    value = getattr(event, "self_device_time_total", None)
    return float(value if value is not None else getattr(event, "self_cuda_time_total", 0.0))


def function_summary(stats: pstats.Stats, wall: float, n: int) -> dict[str, Any]:
    """Per step of ``n``: the wall time and the Python functions with the most own time, named ``file:line(function)``
    with the file's last two path parts (DeepSpeed's, transformers', torch's and ours tell apart by their folder)."""
    rows = []
    for (path, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        short = "/".join(Path(path).parts[-2:]) if path not in ("~", "") else "builtin"
        rows.append((f"{short}:{line}({name})", tottime / n))
    rows.sort(key=lambda x: -x[1])
    return {"steps": n, "wall_s": wall / n, "self_top": [[k, round(s, 6)] for k, s in rows[:TOP]]}
