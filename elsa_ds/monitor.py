"""Progress to DeepSpeed's configured monitor (the JSON's ``tensorboard``, ``wandb``, ``csv_monitor``, ``comet`` blocks).

Per step: loss, λ, learning rate and step time; per projection: the residual ‖x − z‖/‖x‖, the fraction of
mask flips and λ. Events are named ``elsa/<metric>`` and indexed by the optimizer step (1-based), so a
multi-day run can be followed in TensorBoard or W&B like any DeepSpeed job. Only rank 0 writes (DeepSpeed's
MonitorMaster also checks).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elsa_ds.files.disk_room import disk_full
from elsa_ds.files.marks import MONITOR_DIR
from elsa_ds.log import get_logger

MONITOR_BLOCKS = ("tensorboard", "wandb", "csv_monitor", "comet")
# DeepSpeed's file monitors: each writes under os.path.join(output_path, job_name), job_name DeepSpeed's default unless set
FILE_MONITORS = ("tensorboard", "csv_monitor")
DEFAULT_JOB_NAME = "DeepSpeedJobName"


def default_output_paths(ds: dict, output_dir: Path) -> bool:
    """Point enabled file-based monitors without an ``output_path`` at ``OUTPUT_DIR/monitor`` (DeepSpeed's default
    is the working directory); True when any does. The output's publication carries that folder over."""
    used = False
    for key in FILE_MONITORS:
        block = ds.get(key)
        if isinstance(block, dict) and block.get("enabled") and not block.get("output_path"):
            block["output_path"] = str(output_dir / MONITOR_DIR)
            used = True
    return used


def entries_inside(ds: dict, output_dir: Path) -> list[str]:
    """The names directly in ``output_dir`` under which the enabled file monitors write (``output_path/job_name``, as
    DeepSpeed joins them), once :func:`default_output_paths` has set theirs: the run's own logs, which its publication
    neither stops on nor leaves behind (``files/marks.run_writes``)."""
    return sorted({folder.parts[0] for folder in folders_inside(ds, output_dir)})


def folders_inside(ds: dict, output_dir: Path) -> list[Path]:
    """The folders in ``output_dir`` (relative to it) that the enabled file monitors with an ``output_path`` write in."""
    out, folders = Path(os.path.realpath(output_dir)), set()
    for key in FILE_MONITORS:
        block = ds.get(key)
        if isinstance(block, dict) and block.get("enabled") and isinstance(block.get("output_path"), str):
            where = Path(os.path.realpath(os.path.join(block["output_path"], str(block.get("job_name", DEFAULT_JOB_NAME)))))
            if out in where.parents:
                folders.add(where.relative_to(out))
    return sorted(folders)


class Monitor:
    """Writes ``elsa/*`` events through an engine's ``monitor`` (a no-op when no monitor is enabled).

    Rank 0 alone writes, between the step's collectives: a write that fails (a full disk under the CSV or TensorBoard
    files) stopped rank 0 and left the other ranks waiting in the next step. The logs stop instead, with a warning, and
    the run goes on: its next checkpoint or export says whether the disk is still full, in a line from every rank."""

    def __init__(self, engine, rank: int):
        master = getattr(engine, "monitor", None)
        self._master = master if rank == 0 and getattr(master, "enabled", False) else None
        if self._master is not None:  # DeepSpeed's own events (learning rate, timers) go through the same call
            self._master.write_events = self._guarded(self._master.write_events)
            _quiet_writer_threads()

    @property
    def enabled(self) -> bool:
        return self._master is not None

    def write(self, step: int, values: dict[str, Any]) -> None:
        if self._master is not None:
            self._master.write_events([(f"elsa/{k}", float(v), step) for k, v in values.items() if v is not None])

    def _guarded(self, write: Callable[[list], None]) -> Callable[[list], None]:
        def guarded(events: list) -> None:
            master = self._master
            if master is None:
                return
            try:
                write(events)
            except OSError as err:
                master.enabled, self._master = False, None  # DeepSpeed's engine checks `enabled` before its events
                get_logger(__name__).warning(
                    f"the monitor's logs stop here: {disk_full(err, _written_at(master)) or err}; the run goes on (rank 0 "
                    "alone writes them), and its next checkpoint stops it if the disk is still full")
        return guarded


def _quiet_writer_threads() -> None:
    """TensorBoard writes its events from a thread of its own: a full disk there printed "Exception in thread" and a
    traceback beside the guard's warning (an audit, 2026-12-03). That thread keeps the error and raises it again in the
    next write or flush of the main thread, where ``Monitor._guarded`` turns it into the one warning: its own print of an
    OSError is dropped (every other thread's exception is printed as before; installed once per process)."""
    previous = threading.excepthook
    if getattr(previous, "elsa_quiet_writers", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook.elsa_quiet_writers = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _written_at(master) -> Path:
    """Where DeepSpeed's file-based monitors write (the first configured ``output_path``): the folder a full disk's
    message names when the error itself names no file."""
    paths = (getattr(getattr(master, key, None), "output_path", None) for key in ("csv_monitor", "tb_monitor"))
    return Path(next((p for p in paths if p), MONITOR_DIR))
