"""The lock a torch extension build cut short leaves behind, which every later build of it would wait on forever.

torch's ``cpp_extension.load`` guards a build folder with a ``FileBaton``: the first process creates
``<folder>/lock`` (``O_CREAT | O_EXCL``, its descriptor held open until the build ends, then removed) and every other
process sleeps while the file exists, with no timeout and no word. A build killed outright (SIGKILL: the kernel's
out-of-memory killer, a scheduler's hard stop, kill -9; a build interrupted by an exception removes its lock) leaves
the file, and every later job on that machine waits at its first build forever, ours (``build.py``) and DeepSpeed's
ops alike (cpu_adam, async_io, the CPU backend's shm comm): found when a killed test run left one and the next jobs
hung at "one-shot magnitude masks", silent.

A lock some process here holds open (its file's device and inode among the descriptors in /proc) is a live build's:
torch waits on it as it should. One that no process here holds may still be a live build's on another node (a shared
home) or in another container sharing the folder (another PID namespace, invisible here; a review reproduced both), so
it is removed only once older than any build takes (``STALE_S``); until then the caller waits for it to go, saying
why once. One remover at a time (an flock beside the locks), each removal rechecked a moment later. From torch 2.14
builds are guarded by an flock on the lock file (``filelock``), which a killed build releases: nothing to clear then.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Any

from elsa_ds.log import get_logger

STALE_S = 600.0  # no build of ours or DeepSpeed's takes 10 minutes (cpu_adam ~1-2 min on 2 cores)
POLL_S = 2.0
RECHECK_S = 1.0
log = get_logger(__name__)


def extensions_root() -> Path:
    """Where torch builds extensions (``TORCH_EXTENSIONS_DIR``, else its default), as cpp_extension.load decides."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def build_locks(root: Path, name: str = "*") -> list[Path]:
    """The build locks under ``root`` (torch's two layouts: ``root/NAME/lock``, ``root/pyXY_cpu/NAME/lock``)."""
    if not root.is_dir():
        return []
    return sorted({*root.glob(f"{name}/lock"), *root.glob(f"*/{name}/lock")})


def batons(cpp_extension: Any = None) -> bool:
    """Whether torch guards its builds with a ``FileBaton`` (up to torch 2.13: a lock file that exists is taken), not with
    an flock on the file (``filelock``, from torch 2.14: the file stays after each build and means nothing unheld; an
    audit of the dependency ranges, 2026-12-07: every job after the first waited 10 minutes on them)."""
    if cpp_extension is None:
        from torch.utils import cpp_extension
    found = vars(cpp_extension).values()
    return hasattr(cpp_extension, "FileBaton") and not any(
        str(getattr(v, "__module__", None) or getattr(v, "__name__", "")).startswith("filelock") for v in found)


def held(path: Path, proc: Path = Path("/proc")) -> bool:
    """Whether a process this machine's /proc shows has ``path`` open: a descriptor on the same file (device and inode:
    a bind mount, a link or another mount namespace's path to it included)."""
    try:
        target = os.stat(path)
    except OSError:
        return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except OSError:  # exited meanwhile, or another user's (hidden: its lock is left to the age rule)
            continue
        for fd in fds:
            try:
                found = os.stat(entry / "fd" / fd)
            except OSError:
                continue
            if (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino):
                return True
    return False


def clear_stale_locks(root: Path | None = None, name: str = "*") -> list[Path]:
    """Remove the build locks under ``root`` (default: torch's extensions folder) that no process here holds and that
    are older than any build takes, waiting (up to STALE_S) for a younger one to go or to age. Returns the removed."""
    try:
        root = root or extensions_root()
        locks = [lock for lock in build_locks(root, name) if lock.exists()]
        live = [lock for lock in locks if held(lock)]
    except OSError:
        return []
    for lock in live:  # an audit: a job waited 6 minutes on another's builds, torch saying nothing
        log.info(f"another process here (this job's other rank, or another job) is building {lock.parent.name} ({lock}); a "
                 "job that needs it waits for that build to end, without a word from torch (minutes)")
    if not (unheld := [lock for lock in locks if lock not in live]) or not batons():
        return []  # torch 2.14's flock: its lock files stay after every build, and a killed build's lock goes with it
    try:  # one remover at a time (the ranks of a job start together): none removes a lock another's build just made
        guard = os.open(root / ".elsa_ds_build_locks", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(guard, fcntl.LOCK_EX)
    except OSError as err:
        log.warning(f"build locks under {root} not checked ({err.strerror or err}): if a build waits forever, remove the "
                    f"lock of {', '.join(lock.parent.name for lock in unheld)} (a build killed outright leaves it)")
        return []
    try:
        return [lock for lock in unheld if _wait_or_remove(lock)]
    finally:
        os.close(guard)


def _wait_or_remove(lock: Path) -> bool:
    """Wait while ``lock`` is held by no process here and younger than STALE_S (a build elsewhere ends and removes it);
    remove it once older. False when it went, or a build here holds it now (torch waits on that one itself)."""
    said = False
    while True:
        try:
            stat = lock.stat()
        except FileNotFoundError:
            return False
        if held(lock):
            return False
        age = time.time() - stat.st_mtime
        if age >= STALE_S:
            return _remove_if_stale(lock, (stat.st_dev, stat.st_ino, stat.st_ctime_ns), age)
        if not said:
            log.warning(f"waiting for {lock} ({age:.0f} s old, held by no process on this machine: a build of "
                        f"{lock.parent.name} on another node or container, or one killed outright); it is removed once "
                        f"{STALE_S / 60:.0f} min old (remove it now if no build of {lock.parent.name} runs anywhere)")
            said = True
        time.sleep(POLL_S)


def _remove_if_stale(lock: Path, ident: tuple[int, int, int], age: float) -> bool:
    """Remove ``lock`` if, a moment later, it is still the file first seen (``ident``: device, inode, change time) and
    still held by no process here."""
    time.sleep(RECHECK_S)  # a build's own release (closed, not yet removed) is over by now
    try:
        stat = lock.stat()
        if (stat.st_dev, stat.st_ino, stat.st_ctime_ns) != ident or held(lock):
            return False
        lock.unlink()
    except OSError:
        return False
    log.warning(f"removed {lock} ({age / 60:.0f} min old, held by no process): a build of {lock.parent.name} killed "
                "before its end left it, and every build of it would have waited on it forever")
    return True
