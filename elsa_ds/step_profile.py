"""Where a training step's time goes, measured inside a real job: a few steps under ``torch.profiler`` (the host's time
in operators and in CUDA runtime calls, the GPU's kernels, the forward / loss / backward / step spans on both), then as
many under ``cProfile`` (the Python functions that spend the host's time: DeepSpeed's hooks, the model's code, ours). For
machines lent briefly: ``bench/device/curve.py`` asks it of every training cell on the GPU, so that a loan that runs the
budget curve also says whether its steps wait on the host or on the GPU, at a few seconds a cell.

Off unless ``ELSA_DS_PROFILE_STEPS`` is ``FIRST:COUNT`` (``16:3``: steps 16-18 under torch.profiler, 19-21 under
cProfile); rank 0 then logs a summary once the window ends and, if ``ELSA_DS_PROFILE_OUT`` names a file, writes it there
as JSON (temp file, then rename). Every figure is per step; a step's wall time is the loop's own measure of it. The loss
is not changed, only slowed while profiled, so the loop leaves those steps out of the report's mean step time. A
malformed value is a warning, a profiler that fails stops profiling with one warning, and a run that fails inside the
window drops the profile without a sync or a line: the profile is a diagnostic, never a reason to stop or hold a run.

Reading it: ``host_ops_s`` is the host's time inside operators, ``runtime_s`` inside CUDA runtime calls (launches,
copies; ``sync_s`` the synchronizations among them, where the host waits for the GPU), ``device_s`` the GPU's kernels and
copies (summed over streams; with other processes on the same GPU a kernel's time can hold theirs). cProfile sees the
main thread only on Python 3.11; from 3.12 (``sys.monitoring``) every thread, autograd's device thread and the backward's
hooks included.
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from elsa_ds.files.io import write_atomic
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


def read_profile(path: Path) -> dict[str, Any]:
    """``{"profile": ...}`` from a summary this module wrote, ``{}`` without one; never an error (for a bench's result
    line: the run's own figures stand without its profile)."""
    try:
        return {"profile": json.loads(path.read_text(encoding="utf-8"))} if path.is_file() else {}
    except (OSError, ValueError) as err:
        return {"profile": {"unreadable": f"{type(err).__name__}: {err}"}}


class StepProfiler:
    """Call :meth:`before` and :meth:`after` around each step, then :meth:`close` when the loop ends, or :meth:`abandon`
    when it fails (a no-op unless this is rank 0 with a window set: see the module's text)."""

    def __init__(self, window: tuple[int, int] | None, rank: int, out: Path | None = None):
        self.window = window if rank == 0 else None
        self.out = out
        self.torch_prof: Any = None
        self.python_prof: cProfile.Profile | None = None
        self.seconds: list[float] = []  # the loop's measure of each step under the profiler now open
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

    def after(self, step: int, seconds: float) -> bool:
        """After step ``step``, which took ``seconds``: True when it ran under a profiler (slowed by it)."""
        profiled = self.torch_prof is not None or self.python_prof is not None
        self._guarded(self._after, step, seconds)
        return profiled

    def close(self) -> None:
        """End whatever is still open (the loop stopped early inside the window: what was measured is kept), then report."""
        self._guarded(self._close)

    def abandon(self) -> None:
        """The run failed: drop the profile, no sync (a rank may be stuck in a collective), no summary, no line."""
        if self.python_prof is not None:
            self.python_prof.disable()
        self.torch_prof = self.python_prof = self.window = None

    def _guarded(self, method, *args) -> None:
        """A profiler that fails (CUPTI, the summary's file) stops profiling with one warning, never the run."""
        if self.window is None:
            return
        try:
            method(*args)
        except Exception as err:  # noqa: BLE001 - a diagnostic: whatever went wrong, the job goes on unprofiled
            log.warning(f"the step profile stopped ({type(err).__name__}: {err}); the run goes on without it")
            torch_prof, python_prof, self.torch_prof, self.python_prof = self.torch_prof, self.python_prof, None, None
            self.window = None
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
            sync()  # the steps before do not spill into the window
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_prof = torch.profiler.profile(activities=activities)
            self.torch_prof.__enter__()
            self.seconds = []
        elif step == first + count:
            self.python_prof = cProfile.Profile()
            self.seconds = []
            self.python_prof.enable()

    def _after(self, step: int, seconds: float) -> None:
        assert self.window is not None
        first, count = self.window
        if self.torch_prof is not None or self.python_prof is not None:
            self.seconds.append(seconds)
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
        prof, self.torch_prof = self.torch_prof, None
        prof.__exit__(None, None, None)  # synchronizes the device
        if self.seconds:  # a window the loop left before its first step ended has nothing to average
            summary = operator_summary(prof.key_averages(), len(self.seconds))
            self.result["torch"] = {**summary, "wall_s": sum(self.seconds) / len(self.seconds), "complete": complete,
                                    "cuda": torch.cuda.is_available()}

    def _end_python(self, complete: bool) -> None:
        prof, self.python_prof = self.python_prof, None
        assert prof is not None
        prof.disable()
        if self.seconds:
            self.result["python"] = {**function_summary(pstats.Stats(prof), len(self.seconds)),
                                     "wall_s": sum(self.seconds) / len(self.seconds), "complete": complete}

    def _report(self) -> None:
        if t := self.result.get("torch"):
            spans = ", ".join(f"{k.split('.')[-1]} {v * 1e3:.0f}" for k, v in t["spans_s"].items())
            log.info(f"profile of {t['steps']} steps: {t['wall_s'] * 1e3:.0f} ms a step; on the host {t['host_ops_s'] * 1e3:.0f}"
                     f" ms in operators, {t['runtime_s'] * 1e3:.0f} in CUDA calls ({t['sync_s'] * 1e3:.0f} waiting); "
                     f"{t['device_events']:.0f} GPU kernels and copies, {t['device_s'] * 1e3:.0f} ms; spans (ms): {spans}")
            log.info("  host (ms a step): " + "; ".join(f"{n} {s * 1e3:.1f}" for n, s in t["host_top"]))
            if t["device_top"]:
                log.info("  GPU (ms a step): " + "; ".join(f"{n} {s * 1e3:.1f}" for n, s in t["device_top"]))
            elif t["cuda"]:
                log.warning("the step profile recorded no GPU kernel (CUPTI unavailable?): its GPU figures are missing")
        if p := self.result.get("python"):
            log.info(f"profile (cProfile) of {p['steps']} steps: {p['wall_s'] * 1e3:.0f} ms a step; functions by own time "
                     "(ms a step): " + "; ".join(f"{n} {s * 1e3:.1f}" for n, s in p["self_top"]))
        if self.out is not None:  # a full disk: the one warning, no temp file left (a third audit)
            write_atomic(self.out, json.dumps(self.result, indent=1))


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def operator_summary(averages, n: int) -> dict[str, Any]:
    """Per step of ``n``, from ``key_averages()``, whose entries are grouped by key *and* device: the host's operators
    (CPU entries; their self time), its CUDA runtime calls (CPU entries named ``cuda*``) and synchronizations among them,
    the GPU's kernels and copies (device entries that are not a span's annotation: their count and self time), each span's
    host time (its CPU entry, inclusive) and GPU time (its device annotation's range), and the entries that took most."""
    host = [e for e in averages if e.device_type == DeviceType.CPU]
    device = [e for e in averages if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    annotations = [e for e in averages if e.device_type != DeviceType.CPU and getattr(e, "is_user_annotation", False)]
    runtime = [e for e in host if e.key.startswith("cuda")]
    ops = [e for e in host if e.key not in SPANS and not e.key.startswith("cuda")]
    per = lambda us: us / 1e6 / n  # noqa: E731 - µs summed over the window -> seconds a step
    top = lambda events, t: [[e.key, round(per(t(e)), 6)] for e in sorted(events, key=t, reverse=True)[:TOP] if t(e) > 0]  # noqa: E731
    return {"steps": n, "host_ops_s": per(sum(e.self_cpu_time_total for e in ops)),
            "runtime_s": per(sum(e.self_cpu_time_total for e in runtime)),
            "sync_s": per(sum(e.self_cpu_time_total for e in runtime if "Synchronize" in e.key)),
            "device_s": per(sum(e.self_device_time_total for e in device)), "device_events": sum(e.count for e in device) / n,
            "spans_s": {e.key: per(e.cpu_time_total) for e in host if e.key in SPANS},
            "spans_gpu_s": {e.key: per(e.device_time_total) for e in annotations if e.key in SPANS},
            "host_top": top([e for e in host if e.key not in SPANS], lambda e: e.self_cpu_time_total),
            "device_top": top(device, lambda e: e.self_device_time_total)}


def function_summary(stats: pstats.Stats, n: int) -> dict[str, Any]:
    """Per step of ``n``: the Python functions with the most own time, named ``file:line(function)`` with the file's last
    two path parts (DeepSpeed's, transformers', torch's and ours tell apart by their folder)."""
    rows = []
    for (path, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        short = "/".join(Path(path).parts[-2:]) if path not in ("~", "") else "builtin"
        rows.append((f"{short}:{line}({name})", tottime / n))
    rows.sort(key=lambda x: -x[1])
    return {"steps": n, "self_top": [[k, round(s, 6)] for k, s in rows[:TOP]]}
