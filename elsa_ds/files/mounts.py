"""Mount points, read from the mount table this process sees (``/proc/self/mountinfo``): where an output's final rename
cannot go.

An output is built beside its path and renamed into place, and an ``--overwrite`` first renames the previous output
aside. A rename fails on a mount point (EBUSY) and, on overlayfs without ``redirect_dir`` (most kernels' default), on a
folder of a lower layer, a container image's (EXDEV). An audit (file systems, 2026-12-07) met both only at the
publication, the run done: a bind mount of the same file system is invisible to ``st_dev``, which the earlier check
compared, and overlayfs gives its lower folders the same ``st_dev`` as its own. Nothing is renamed to find out: the
other ranks, and a job that holds the output's lock, may be reading the folder.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path


MOUNTINFO = Path("/proc/self/mountinfo")
_ESCAPE = re.compile(rb"\\([0-7]{3})")  # the table writes a space in a path as \040


def mount_table() -> dict[str, tuple[str, str]]:
    """{mount point: (its file system's type, its super options)}, the last mount on a path winning (the one seen
    there); empty where the table cannot be read (not Linux)."""
    table: dict[str, tuple[str, str]] = {}
    with contextlib.suppress(OSError):
        for line in MOUNTINFO.read_bytes().splitlines():
            left, _, right = line.partition(b" - ")
            fields, after = left.split(b" "), right.split(b" ")
            if len(fields) >= 5 and len(after) >= 3:
                table[_unescaped(fields[4])] = (os.fsdecode(after[0]), _unescaped(after[2]))
    return table


def _unescaped(field: bytes) -> str:
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), field))


def mount_problem(path: Path, what: str, replaced: bool) -> str | None:
    """Why ``path`` (an output) could not be renamed into place or aside, or None: it is a mount point; and where the job
    replaces what is there (``replaced``: --overwrite, or an empty folder the finished output takes the place of) a mount
    point below it (its files would be removed with the previous output), or a folder of an overlay's lower layer, which
    overlayfs cannot rename without ``redirect_dir`` (found where this process can see the lower layer's folders)."""
    if not (path.exists() or path.is_symlink()):
        return None
    real, table = os.path.realpath(path), mount_table()
    if real in table:  # not os.path.ismount: a btrfs subvolume (its own st_dev) renames as any folder
        return (f"{what} {path} is a mount point: the result is built beside it and renamed into place, which cannot "
                "replace a mount; use a path inside it")
    if not replaced or not path.is_dir():
        return None
    if below := sorted(point for point in table if point.startswith(real.rstrip("/") + "/")):
        return (f"{what} {path} holds a mount point ({below[0]}): the previous output is moved aside and removed once the "
                "new one is in place, which would delete the mounted files; unmount it, or choose another path")
    here = max((point for point in table if real == point or real.startswith(point.rstrip("/") + "/")), key=len, default="")
    kind, options = table.get(here, ("", ""))
    if kind == "overlay" and (lower := _in_lower_layer(Path(real).relative_to(here), options)) is not None:
        return (f"{what} {path} is a folder of its overlay file system's lower layer ({lower}: a container image's), which "
                "overlayfs cannot rename (EXDEV) where redirect_dir is off; remove it (rm -r) or choose another path")
    return None


def _in_lower_layer(inside: Path, options: str) -> Path | None:
    """The lower layer's copy of the overlay's folder ``inside``, where a lower layer holds it and the overlay cannot
    rename it (no ``redirect_dir=on``); None otherwise, or where the layers are not visible from here (a container)."""
    if re.search(r"(?:^|,)redirect_dir=on(?:,|$)", options) or not (lower := re.search(r"(?:^|,)lowerdir=([^,]*)", options)):
        return None
    for layer in lower[1].split(":"):
        if layer and (copy := Path(layer) / inside).is_dir():
            return copy
    return None
