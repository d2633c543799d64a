"""The lock a torch extension build cut short leaves behind, which every later build of it would wait on forever.

torch's ``cpp_extension.load`` guards a build folder with a ``FileBaton``: the first process creates
``<folder>/lock`` (``O_CREAT | O_EXCL``, its descriptor held open until the build ends, then removed) and every other
process sleeps while the file exists, with no timeout and no word. A build killed outright (SIGKILL: the kernel's
out-of-memory killer, a scheduler's hard stop, kill -9; a build interrupted by an exception removes its lock) leaves
the file, and every later job on that machine waits at its first build forever, ours (``build.py``) and DeepSpeed's
ops alike (cpu_adam, async_io, the CPU backend's shm comm): found when a killed test run left one and the next jobs
hung at "one-shot magnitude masks", silent.

A lock no process holds open is such a leftover: its creator holds it from the moment it exists until just before
its removal. So it is checked in /proc (the processes of the file's owner), twice a second apart (a build ending
meanwhile removes its own), then removed, with a warning. Where that cannot be told, it is left, with a warning that
names it: a network filesystem (a build on another node holds it unseen from here), another user's processes
unreadable.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from elsa_ds.log import get_logger

NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p", "afs", "fuse")
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


def network_fs(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The filesystem type of ``path``'s mount when it is a network one (its holders may be on other machines)."""
    best, kind = "", ""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            point = fields[1].replace("\\040", " ")
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind if kind.split(".")[0] in NETWORK_FS else None


def held(path: Path, owner: int, proc: Path = Path("/proc")) -> bool | None:
    """Whether a process has ``path`` open (its descriptors in /proc); None when one of ``owner``'s processes (uid: the
    file's, the only ones that could have created it) cannot be read."""
    target = str(path.resolve())
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            try:
                if entry.stat().st_uid == owner:
                    return None
            except OSError:
                pass
            continue
        for fd in fds:
            try:
                if os.readlink(entry / "fd" / fd) == target:
                    return True
            except OSError:
                continue
    return False


def clear_stale_locks(root: Path | None = None, name: str = "*") -> list[Path]:
    """Remove the build locks under ``root`` (default: torch's extensions folder) that no process holds; warn of those
    that may be held unseen. Returns the removed ones."""
    try:
        root = root or extensions_root()
        locks = build_locks(root, name)
    except OSError:
        return []
    candidates = []
    for lock in locks:
        try:
            stat = lock.stat()
        except OSError:
            continue
        kind = network_fs(lock)
        holder = None if kind else held(lock, stat.st_uid)
        if holder is None:
            where = f"it is on a {kind} filesystem" if kind else "another user's processes cannot be read here"
            log.warning(f"a build lock {lock} exists and {where}: if no process anywhere is building {lock.parent.name}, "
                        "remove it (a build killed outright leaves it, and every build of it then waits forever)")
        elif not holder:
            candidates.append((lock, (stat.st_dev, stat.st_ino, stat.st_ctime_ns)))
    if not candidates:
        return []
    try:  # one remover at a time (the ranks of a job start together): none removes a lock another's build just made
        guard = os.open(root / ".elsa_ds_build_locks", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(guard, fcntl.LOCK_EX)
    except OSError:
        return []
    try:
        time.sleep(RECHECK_S)  # a lock being released (closed, not yet removed) is gone by now
        return [lock for lock, ident in candidates if _remove_if_stale(lock, ident)]
    finally:
        os.close(guard)


def _remove_if_stale(lock: Path, ident: tuple[int, int, int]) -> bool:
    """Remove ``lock`` if it is still the file first seen (``ident``: device, inode, change time) and still held by
    nobody."""
    try:
        stat = lock.stat()
        if (stat.st_dev, stat.st_ino, stat.st_ctime_ns) != ident or held(lock, stat.st_uid) is not False:
            return False
        lock.unlink()
    except OSError:
        return False
    log.warning(f"removed {lock}: a build of {lock.parent.name} killed before its end left it, no process holds it, "
                "and every build of it would have waited on it forever")
    return True
