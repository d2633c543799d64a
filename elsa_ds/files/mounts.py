"""Mount points, read from the mount table this process sees (``/proc/self/mountinfo``): where an output's final rename
cannot go.

An output is built beside its path and renamed into place, and an ``--overwrite`` first renames the previous output's
folders aside. A rename fails on a mount point (EBUSY) and, on overlayfs without ``redirect_dir`` (most kernels'
default), on a folder of a lower layer, a container image's (EXDEV). An audit (file systems, 2026-12-07) met both only
at the publication, the run done: a bind mount of the same file system is invisible to ``st_dev``, which the earlier
check compared, and overlayfs gives its lower folders the same ``st_dev`` as its own.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from elsa_ds import launch_env
from elsa_ds.errors import signals_held
from elsa_ds.files.aside import beside

MOUNTINFO = Path("/proc/self/mountinfo")
_ESCAPE = re.compile(rb"\\([0-7]{3})")  # the table writes a space in a path as \040


def mount_table() -> dict[str, str]:
    """{mount point: its file system's type}, the last mount on a path winning (the one seen there); empty where the
    table cannot be read (not Linux)."""
    table: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in MOUNTINFO.read_bytes().splitlines():
            left, _, right = line.partition(b" - ")
            fields = left.split(b" ")
            if len(fields) >= 5 and right:
                point = os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), fields[4]))
                table[point] = os.fsdecode(right.split(b" ")[0])
    return table


def mount_problem(path: Path, what: str, replaced: bool) -> str | None:
    """Why ``path`` (an output) could not be renamed into place or aside, or None: it is a mount point; and where the job
    replaces what is there (``replaced``: --overwrite, or an empty folder the finished output takes the place of) a mount
    point below it, or a folder overlayfs cannot rename (a rename tried and undone at once, signals held, by the rank
    that writes: the others may be reading it)."""
    if not (path.exists() or path.is_symlink()):
        return None
    real, table = os.path.realpath(path), mount_table()
    if real in table or os.path.ismount(real):
        return (f"{what} {path} is a mount point: the result is built beside it and renamed into place, which cannot "
                "replace a mount; use a path inside it")
    if not replaced or not path.is_dir():
        return None
    if below := sorted(point for point in table if point.startswith(real.rstrip("/") + "/")):
        return (f"{what} {path} holds a mount point ({below[0]}): the previous output is moved aside whole, which cannot move "
                "a mount; unmount it, or choose another path")
    here = max((point for point in table if real == point or real.startswith(point.rstrip("/") + "/")), key=len, default="")
    if table.get(here) == "overlay" and launch_env.writes() and (err := _rename_fails(Path(real))) is not None:
        return (f"{what} {path} cannot be renamed on its overlay file system ({err.strerror or err}: a folder of a lower "
                "layer, a container image's), and the previous output is moved aside whole; remove it (rm -r) or choose "
                "another path")
    return None


def _rename_fails(folder: Path) -> OSError | None:
    """The error renaming ``folder`` beside itself meets, or None once it was renamed and back (signals held between)."""
    probe = beside(folder, "probe")
    with signals_held():
        try:
            folder.rename(probe)
        except OSError as err:
            return err
        probe.rename(folder)
    return None
