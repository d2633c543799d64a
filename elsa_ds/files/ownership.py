"""One owner per output: an exclusive lock beside every output a job writes, and outputs kept apart from inputs.

The lock is ``.NAME.lock`` in the output's parent directory, held with ``flock`` for the job's lifetime and naming its
holder (pid, host, start time). The kernel drops a ``flock`` when its process dies, so the lock file a killed job
leaves behind is taken over by the next job; a lock file that names a live process on this host, or a process on
another host (which ``flock`` may not reach across a network filesystem), is refused with its holder named. A job
writes only into a lock file it created (``O_EXCL``), never through a symbolic link: the lock path sits in a folder
others may write to, and a link planted there must not turn the lock into an overwrite of its target.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from elsa_ds import json_data
from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import DiskFull, disk_full_errno
from elsa_ds.files.mounts import mount_problem
from elsa_ds.files.procfs import ancestors, stat_fields
from elsa_ds.log import get_logger

NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # filesystems without flock: the file decides
GONE_ELSEWHERE = "; if that job is gone, delete the lock file"  # a holder on another host: its end cannot be seen here
HELD_DEPTH = 3  # how deep below a folder to be replaced a live job's lock is looked for (an output's own tree is shallow)
NAME_WAIT_S = 5.0  # how long a refused job waits for a lock's new holder to write its name (a loaded host can be slow)


NAME_MAX, PATH_MAX = 255, 4096  # bytes, as Linux's file systems take them
SIDE_ROOM = 48  # bytes a name the job keeps beside an output takes beyond the output's own: the longest, the sparse export
# built beside the staging folder (``.NAME.partial.PID.sparse.partial.PID``), takes 41 with PIDs of 7 digits, Linux's most
INSIDE_ROOM = 512  # bytes under an output for the paths a job writes there (DeepSpeed's checkpoint shards take ~110)


def check_output_names(output: Path | str, flag: str, utf8: bool = False, beside: int = SIDE_ROOM, inside: int = INSIDE_ROOM) -> None:
    """ElsaError, before any work, for an output path the job could only fail to publish after it (a seventh audit):
    a name or path so long that a side name the job keeps beside it (its staging folder, the temporary file it renames,
    its lock), or a file it writes inside, passes what a name or a path may be (a traceback at the publication, the
    result lost), a ``..`` after a folder that does not exist (``nosuch/../o``: the checks resolve it on paper, the
    final rename cannot), and with ``utf8`` a name that is not UTF-8 (the tokenizer's files cannot be written under it).
    For the outputs a user names (elsa-prune's folder, elsa-evaluate's files, elsa-compress's folder), not for the side
    folders a job then locks inside its own room (the sparse export beside the staging folder); elsa-prune's own rules
    for its folder (no link, not a folder a replaced output would take along) are ``files/output.check_output_path``.
    ``beside`` and ``inside``: the bytes the job's side names add to the name and its files to the path (a file
    written whole takes ``files/io.ATOMIC_ROOM`` and nothing inside)."""
    text = os.fspath(output)
    name, full = os.fsencode(Path(text).name), os.fsencode(os.path.abspath(text))
    if len(name) + beside > NAME_MAX:
        raise ElsaError(f"{flag} {text}: its name is {len(name):,} bytes, and the job keeps files beside it named after it "
                        f"with up to {beside} more, past a name's {NAME_MAX}: choose a name of at most "
                        f"{NAME_MAX - beside} bytes")
    if len(full) + beside + inside >= PATH_MAX:  # PATH_MAX counts the NUL that ends a path
        raise ElsaError(f"{flag} {text}: its path is {len(full):,} bytes, which leaves too little of a path's {PATH_MAX:,} for "
                        f"the files the job writes beside{' and inside' if inside else ''} it (up to {beside + inside} "
                        "more): choose a shorter path")
    parts = Path(text).parts
    for i, part in enumerate(parts):
        if part == ".." and not os.path.isdir(before := Path(*parts[:i])):
            raise ElsaError(f"{flag} {text}: {before} is not an existing folder, so the path cannot go up from it (..): the output "
                            "could not be published there; give the path without it")
    if why := mount_problem(Path(text), flag, replaced=False):  # a file too (elsa-evaluate's): replaced by a rename
        raise ElsaError(why)
    if utf8:  # the path its files are written under: absolute, links resolved (the staging folder's)
        try:
            os.path.realpath(text).encode("utf-8")
        except UnicodeEncodeError:
            raise ElsaError(f"{flag} {text}: its path is not valid UTF-8, and the tokenizer's files cannot be written under "
                            "such a path: choose a UTF-8 name") from None


def lock_path(output: Path) -> Path:
    """The lock file of ``output``: beside it, like its staging directory."""
    output = Path(output)
    return output.resolve().parent / f".{output.name}.lock"


def check_apart(output: Path, flag: str, inputs: Mapping[str, str | Path | None]) -> None:
    """Refuse an output that is, contains or sits inside one of the local ``inputs`` ({flag: path}); hub names and
    paths that do not exist are skipped. Writing there would replace or mix with what the job reads, so --overwrite
    does not change the answer."""
    out = Path(output).expanduser().resolve()
    for label, value in inputs.items():
        if value is None or not str(value) or not _is_there(value):
            continue
        given = Path(value).expanduser().resolve()
        the_input = f"the input {label + ' ' if label else ''}{value}"
        if out == given:
            why = f"is inside {the_input}, the very same folder: writing there would replace it"
        elif given in out.parents:
            why = f"is inside {the_input}: the job would write into what it reads"
        elif out in given.parents:
            why = f"contains {the_input}: replacing it would delete the input"
        else:
            continue
        raise ElsaError(f"{flag} {output} {why} (--overwrite does not change this); choose a path apart from it")


def _is_there(value: str | Path) -> bool:
    """Whether a local path ``value`` exists; a name no path can be (too long, a NUL byte, an unknown ~user: a hub id
    or a dataset name) is not."""
    try:
        return Path(value).expanduser().exists()
    except (OSError, ValueError, RuntimeError):
        return False


@contextlib.contextmanager
def owned(output: Path | None, flag: str, take: bool = True, lock: Path | None = None) -> Iterator[None]:
    """Hold the lock of ``output`` while the block runs (nothing with ``output`` None or ``take`` False: e.g. on a rank
    that does not write); released on the way out, an exception included. ``lock``: its file, where that is not
    :func:`lock_path`'s (one of several locks of a path, each named so: an NVMe path's, one per rank)."""
    if output is None or not take:
        yield
        return
    if lock is None:  # an output's own lock (not one of an NVMe path's, which each rank of a job takes)
        _check_not_inside_held(Path(output), flag)
    fd = acquire(Path(output), flag, lock)
    try:
        yield
    finally:
        release(Path(output), fd, lock)


def acquire(output: Path, flag: str, path: Path | None = None) -> int:
    """Take the lock of ``output`` (its file descriptor, for :func:`release`), or ElsaError naming the holder.

    A job writes its name only into a lock file it has just created itself (``O_CREAT | O_EXCL | O_NOFOLLOW``): a file
    or symbolic link someone put at the lock path is never truncated or written through. A stale lock (its holder gone)
    is unlinked, once checked to be the regular file that was examined, and created anew. ``path``: the lock file, where
    it is not :func:`lock_path`'s."""
    path = path or lock_path(output)
    for _ in range(5):
        fd, created = _open_lock(output, flag, path)
        if fd is None:  # removed between looking and opening: look again
            continue
        try:
            locked = _flock(fd)
            if locked is False and _same_file(fd, path):
                raise ElsaError(_busy(output, flag, path, _named_holder(fd, NAME_WAIT_S)))
            if locked is False or not _same_file(fd, path):  # released (unlinked) or replaced since our open
                os.close(fd)
                continue
            if not created:
                _check_previous(output, flag, path, read_holder(fd), flock_works=locked)  # refuses a live holder
                if _same_file(fd, path):
                    path.unlink()  # the stale file examined above: the next round creates a new one
                os.close(fd)
                continue
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "pid_start": _pid_start(os.getpid())}
            try:
                os.pwrite(fd, json.dumps(info).encode(), 0)
                os.fsync(fd)
            except OSError as err:  # a full disk most often: the empty file made here is not left behind
                if _same_file(fd, path):
                    path.unlink()
                if (code := disk_full_errno(err)) is not None:
                    raise DiskFull(path, None, code, fix=f"choose another {flag}") from None
                raise ElsaError(f"{flag} {output}: cannot write its lock file {path} ({err.strerror}); choose another path") from None
            if _same_file(fd, path):  # without flock, another job may have taken the empty file over meanwhile
                return fd
            os.close(fd)
        except BaseException:
            os.close(fd)
            raise
    raise ElsaError(f"{flag} {output}: its lock {path} keeps changing hands; try again")


def _open_lock(output: Path, flag: str, path: Path) -> tuple[int | None, bool]:
    """(descriptor, created here): a new lock file, else the regular file already at ``path`` opened as it is (no
    truncation: it is only read; read-write because flock over NFS is an fcntl lock, which needs a writable descriptor);
    (None, False) when it vanished meanwhile. A symbolic link there is refused, never followed (it could point at any
    file of the user's, which the lock would overwrite)."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass  # a lock file (or something else) is there already: examined below
    except OSError as err:
        raise ElsaError(f"{flag} {output}: cannot create its lock file {path} ({err.strerror}); choose another path") from None
    try:
        kind = os.lstat(path).st_mode
        if stat.S_ISREG(kind):
            fd = os.open(path, flags | os.O_NONBLOCK)
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd, False
            os.close(fd)
    except FileNotFoundError:
        return None, False
    except OSError as err:
        if err.errno != errno.ELOOP:  # ELOOP: a symbolic link swapped in after lstat, refused below
            raise ElsaError(f"{flag} {output}: cannot open its lock file {path} ({err.strerror}); choose another path") from None
        kind = stat.S_IFLNK
    what = "a symbolic link" if stat.S_ISLNK(kind) else "not a regular file"
    raise ElsaError(f"{flag} {output}: its lock file {path} is {what}, which elsa_ds never follows or replaces; "
                    "remove it if it is yours, or choose another path")


def release(output: Path, fd: int, path: Path | None = None) -> None:
    """Give the lock up: the file is removed while still held (a job waiting on it then retries on a new one)."""
    path = path or lock_path(output)
    try:
        if _same_file(fd, path):
            path.unlink()
    except OSError:
        pass  # the lock is released with the descriptor anyway
    finally:
        os.close(fd)


def held_inside(folder: Path, depth: int = HELD_DEPTH) -> str | None:
    """'PATH is being written by another job (pid ...; lock ...)' when an output's lock in ``folder`` or a folder below
    it (``depth`` levels, links not followed) names a job that runs (on this host, or on another, which this one cannot
    tell), else None. Read only, never locked: a job taking that lock meanwhile must not find it held (an audit: a
    folder holding a live job's lock was called no elsa_ds command's, "empty it yourself first", and a job publishing
    over it removed the other's output)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return None
    for entry in entries:
        name = entry.name
        if name.startswith(".") and name.endswith(".lock") and name != ".lock" and entry.is_file(follow_symlinks=False):
            if (info := _live_holder(folder / name)) is not None:
                return f"{folder / name[1:-5]} is being written by another job ({holder_text(info)}; lock {folder / name})"
    for entry in entries:
        if depth > 0 and entry.is_dir(follow_symlinks=False) and (busy := held_inside(folder / entry.name, depth - 1)):
            return busy
    return None


def _check_not_inside_held(output: Path, flag: str) -> None:
    """ElsaError when ``output`` lies inside an output another job writes now (the lock beside a folder above it names
    a live job other than one that started this process, as an ablation starts its runs; this process's own included:
    two API jobs in two threads): its publication would stop on what this one writes there, or this one's result go
    with the other's --overwrite."""
    lineage = ancestors()
    for folder in Path(os.path.abspath(output)).parents:
        if folder.parent == folder:
            break
        path = lock_path(folder)
        if (info := _live_holder(path)) is not None and info["pid"] not in lineage:
            gone = GONE_ELSEWHERE if info.get("host") != socket.gethostname() else ""
            raise ElsaError(f"{flag} {output} is inside {folder}, which is being written by another job ({holder_text(info)}; "
                            f"lock {path}){gone}; wait for it to end or choose a path outside it")


def _live_holder(path: Path) -> dict | None:
    """What the lock file at ``path`` names, when it names a job that runs (see :func:`held_inside`); read only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = read_holder(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else {}
    finally:
        os.close(fd)
    return info if _names_live_job(info) else None


def _names_live_job(info: dict) -> bool:
    """Whether the holder a lock file names (``info``) may still run: a job on another host, which this one cannot
    tell, or a process here that runs (its pid, with the start time written beside it: not a reused pid). The one rule
    both the lock's own check and the look above and below an output apply."""
    if not info.get("pid"):
        return False
    return info.get("host") != socket.gethostname() or _alive(int(info["pid"]), info.get("pid_start"))


def holder_text(info: dict) -> str:
    """'pid 123 on host since 2026-01-01 12:00:00' from a lock file's contents."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if "started" in info else "an unknown time"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {since}"


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in NO_FLOCK:
            return None
        raise


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` itself (not what a symbolic link there points at) is the file open as ``fd``."""
    try:
        st, now = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def read_holder(fd: int) -> dict:
    """The holder a lock file names, read through the descriptor examined (not the path: it may have been swapped)."""
    try:
        info = json_data.loads(os.pread(fd, 1 << 16, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return _well_typed(info) if isinstance(info, dict) else {}


def _well_typed(info: dict) -> dict:
    """A lock file's fields of the types and ranges ``acquire`` writes; any other is dropped (a second audit: the lock
    sits in the output's parent, a folder others may write to, and a pid of "abc" or 10**30, a start time of 1e300 or
    "yesterday" ended the refusal in a traceback). A pid is a positive int below 2**22 (Linux's pid_max limit); a start
    time a finite number any platform's time_t holds."""
    pid, started = info.get("pid"), info.get("started")
    kept = {key: info[key] for key in ("host", "pid_start") if isinstance(info.get(key), str)}
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**22:
        kept["pid"] = pid
    if isinstance(started, (int, float)) and not isinstance(started, bool) and 0 <= started < 2**33:
        kept["started"] = float(started)
    return kept


def _named_holder(fd: int, wait_s: float) -> dict:
    """The holder of a lock held by another job. Its holder creates the file, locks it, then writes its name: a job
    refused in between waits up to ``wait_s`` for the name, so that the refusal can say whom it waits for."""
    deadline = time.monotonic() + wait_s
    info = read_holder(fd)
    while not info.get("pid") and time.monotonic() < deadline:
        time.sleep(0.02)
        info = read_holder(fd)
    return info


def _busy(output: Path, flag: str, path: Path, info: dict, gone: str = "") -> str:
    who = holder_text(info) if info else "a job that has not written its name yet"
    return f"{flag} {output} is being written by another job ({who}; lock {path}){gone}; wait for it to end or choose another path"


def _check_previous(output: Path, flag: str, path: Path, info: dict, flock_works: bool | None) -> None:
    """A lock file left by an earlier holder (``info``: what it names): stale when its process is gone from this host;
    otherwise refused."""
    if not info.get("pid"):
        return
    elsewhere = info.get("host") != socket.gethostname()
    if _names_live_job(info) and (elsewhere or flock_works is None or int(info["pid"]) != os.getpid()):
        raise ElsaError(_busy(output, flag, path, info, GONE_ELSEWHERE if elsewhere else ""))
    get_logger(__name__).warning(f"{flag} {output}: taking over the lock of {holder_text(info)}, a process that is gone")


def _pid_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from /proc): tells a reused pid from the lock holder's."""
    fields = stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    now = _pid_start(pid)
    return started is None or now is None or now == started
