"""A full disk as one line: the error a write that runs out of room becomes, wherever in a job it happens.

The exporter, the mask writer and the warm start's model copy name the file and the bytes the whole write needs
(:func:`writing`); any other ``OSError`` of that kind (ENOSPC, EDQUOT, EFBIG), or safetensors' error wrapping one, is
recognised on the way out of the job (:func:`disk_full`). The room a job needs is checked before work by
``preflight.py`` (the export and checkpoints against the free space of the output's file system).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from elsa_ds.errors import ElsaError, causes

REASONS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
           errno.EFBIG: "file size limit reached"}  # EFBIG: ulimit -f, or the file system's own largest file
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust side names the OS error it wraps
_MOUNT_ESCAPE = re.compile(r"\\([0-7]{3})")  # /proc/self/mounts writes a space in a path as \040


OUTPUT_DIR_FIX = "choose another --output_dir"  # what a full disk's message tells the user to do, unless told otherwise


class DiskFull(ElsaError):
    """A write ran out of room: the file, the bytes its whole write needs (None: not known) and the free space now."""

    def __init__(self, path: Path, needed: int | None, code: int = errno.ENOSPC, fix: str = OUTPUT_DIR_FIX):
        self.path, self.needed, self.code, self.fix = Path(path), needed, code, fix
        where = existing_ancestor(self.path)
        try:
            device, free, vfs = filesystem(where), f"{shutil.disk_usage(where).free:,}", os.statvfs(where)
        except OSError:  # the message must not fail in its turn
            device, free, vfs = str(where), "an unknown number of bytes", None
        if code == errno.ENOSPC and vfs is not None and _inodes_out(vfs):
            super().__init__(f"no free inode left on {device} writing {self.path}: the file system can hold no more files "
                             f"({vfs.f_files:,} in all), though {free} bytes are free; delete files there or {fix}")
            return
        need = f"{needed:,} bytes needed, " if needed is not None else ""
        super().__init__(f"{REASONS.get(code, REASONS[errno.ENOSPC])} on {device} writing {self.path}: {need}{free} free; "
                         f"free space or {fix}")

    def measured_again(self, fix: str | None = None) -> DiskFull:
        """The same error with the free space measured now (once the job's partial files are gone); ``fix``: what the
        message tells the user to choose instead, when another entry point than prune's reports it."""
        return DiskFull(self.path, self.needed, self.code, self.fix if fix is None else fix)


def disk_full_errno(err: BaseException) -> int | None:
    """The errno that says ``err`` (or an exception it was raised from) ran out of room, else None."""
    found = _full_disk_cause(err)
    return None if found is None else found[1]


def _full_disk_cause(err: BaseException | None) -> tuple[BaseException, int] | None:
    """(the exception in ``err``'s chain that ran out of room, its errno), or None."""
    for cause in causes(err):
        if isinstance(cause, OSError) and cause.errno in REASONS:
            return cause, cause.errno
        if type(cause).__module__.startswith("safetensors") and (m := _OS_ERROR.search(str(cause))) and int(m[1]) in REASONS:
            return cause, int(m[1])
    return None


def disk_full(err: BaseException, fallback: Path) -> DiskFull | None:
    """``err`` as a :class:`DiskFull` measured now, or None when it is no full disk. ``fallback``: the path it names
    when the error itself names none."""
    if isinstance(err, DiskFull):
        return err.measured_again()
    found = _full_disk_cause(err)
    if found is None:
        return None
    name = getattr(found[0], "filename", None)
    return DiskFull(Path(name) if isinstance(name, (str, os.PathLike)) else fallback, None, found[1])


def writer_ran_out(err: BaseException, path: Path, room: int = 16 * 2**20) -> DiskFull | None:
    """``err`` as a :class:`DiskFull` naming ``path`` when it is a full disk: by its errno, or, for torch's zip writer (whose
    failed write is a RuntimeError without one: "[enforce fail at inline_container.cc:...] . unexpected pos ..." or
    "PytorchStreamWriter failed writing file"), when the file system it wrote to has less than ``room`` bytes left."""
    found = disk_full(err, path)
    torch_writer = any(mark in str(err) for mark in ("inline_container.cc", "PytorchStreamWriter"))
    if found is not None or not isinstance(err, RuntimeError) or not torch_writer:
        return found
    try:
        free = shutil.disk_usage(existing_ancestor(path)).free
    except OSError:
        return None
    return DiskFull(path, None) if free < room else None


@contextlib.contextmanager
def writing(path: Path, needed: int | None) -> Iterator[None]:
    """A full disk inside the block becomes :class:`DiskFull` naming ``path`` and the ``needed`` bytes of the whole write."""
    try:
        yield
    except DiskFull:
        raise
    except BaseException as err:
        code = disk_full_errno(err)
        if code is None:
            raise
        raise DiskFull(path, needed, code) from None


def saved_bytes(module) -> int:
    """The bytes of ``module``'s state dict (a tied weight once): what ``save_pretrained`` writes, less headers."""
    unique = {(t.data_ptr(), t.dtype, t.numel()): t for t in module.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest parent that exists (where the free space of a file not written yet is measured)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


DIRECT_IO_REFUSED = errno.EINVAL  # open(O_DIRECT) on a file system without direct I/O


def direct_io_problem(folder: Path) -> str | None:
    """Why DeepSpeed's asynchronous I/O could not make its swap files in ``folder``, or None: a file opened there as it
    opens them (``O_DIRECT``), then removed. An audit (file systems, 2026-12-07): tmpfs before Linux 6.6, ramfs and
    many FUSE and network file systems refuse ``O_DIRECT`` (EINVAL), and a file system with no free inode refuses any
    new file; both were an AssertionError from DeepSpeed's swapper, after the model had loaded."""
    probe = Path(folder) / f".elsa_ds_direct_io.{os.getpid()}.{secrets.token_hex(4)}"  # a reused pid's leftover aside
    try:
        handle = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as err:
        if err.errno != errno.EEXIST:  # ramfs makes the file, then refuses O_DIRECT
            with contextlib.suppress(OSError):
                os.unlink(probe)
        if err.errno == DIRECT_IO_REFUSED:
            return (f"its file system ({filesystem(folder)}) takes no direct I/O (O_DIRECT), which DeepSpeed writes its swap "
                    "files with (tmpfs before Linux 6.6, ramfs, many FUSE and network file systems)")
        if err.errno == errno.ENOSPC:
            return f"its file system ({filesystem(folder)}) can make no new file (no free inode, or no space)"
        return f"no file can be made there ({err.strerror or err})"
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def filesystem(path: Path) -> str:
    """The file system holding ``path``, as ``df`` names it: its source (device) and mount point."""
    return _named(*_mount_of(path)[:2])


def _named(source: str | None, mount: Path) -> str:
    return f"{source} at {mount}" if source else str(mount)


def _mount_of(path: Path) -> tuple[str | None, Path, str | None]:
    """(source, mount point, type) of the file system holding ``path``; source and type None where /proc says nothing."""
    mount = Path(path).resolve()
    dev = os.stat(mount).st_dev
    while mount != mount.parent and os.stat(mount.parent).st_dev == dev:
        mount = mount.parent
    source = kind = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and _MOUNT_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[1]) == str(mount):
                source, kind = fields[0], fields[2]  # the last mount on a path is the one seen
    return source, mount, kind


EXACT_BLOCKS = ("ext2", "ext3", "ext4", "xfs")  # a file's blocks are what was written: a hole is a write that failed
LOW_ROOM = 256 * 2**20  # elsewhere (compression, network, FUSE) a file short of blocks counts only beside this little room
FULL_ROOM = 2**20  # less free than one of DeepSpeed's aio writes (its block_size, 1 MiB in the shipped configs): full


def no_inode_left(folder: Path) -> str | None:
    """That the file system holding ``folder`` can make no more files (no free inode, bytes to spare or not), or None."""
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return None
    if _inodes_out(vfs):
        return f"{filesystem(folder)} has no free inode: no more files can be made there"
    return None


def _inodes_out(vfs: os.statvfs_result) -> bool:
    """Whether a file system that counts inodes (``f_files``) has none left for this process (root may take them all)."""
    return vfs.f_files > 0 and (vfs.f_ffree if os.geteuid() == 0 else vfs.f_favail) == 0


def swap_problems(folders: list[Path]) -> list[str]:
    """Why the swap files in ``folders`` may not hold what DeepSpeed wrote, one phrase each (empty: none seen).
    DeepSpeed's asynchronous writes never check a write's result: a full disk leaves a file with a hole or short of its
    end, and the run reads zeros back. Seen here: a folder gone, a file system with less than FULL_ROOM free (root may
    fill the blocks kept for it: its figure), a state file with fewer bytes allocated than its size (on EXACT_BLOCKS file
    systems, or anywhere beside less than LOW_ROOM free) or with no byte. Gradient files are left out (rewritten every step, maybe
    still in flight after a skipped step): a full disk shows in the free space. Never raises (a rank's error here would
    leave the others in the collective that follows)."""
    found = []
    for folder in folders:
        try:
            vfs = os.statvfs(folder)
            free = (vfs.f_bfree if os.geteuid() == 0 else vfs.f_bavail) * vfs.f_frsize
            source, mount, kind = _mount_of(folder)
            entries = [e for e in os.scandir(folder) if e.is_file(follow_symlinks=False) and "_gradient_" not in e.name]
        except FileNotFoundError:
            found.append(f"{folder} is gone")  # removed under the run: what DeepSpeed reads back from it is zeros
            continue
        except OSError:
            continue
        if free < FULL_ROOM:
            found.append(f"{_named(source, mount)} has {free:,} bytes free")
        holes_count = kind in EXACT_BLOCKS or free < LOW_ROOM
        for entry in entries:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if st.st_size == 0 or (holes_count and st.st_blocks * 512 < st.st_size):
                    found.append(f"{entry.path} is not fully written ({st.st_blocks * 512:,} of {st.st_size:,} bytes on disk)")
    return list(dict.fromkeys(found))  # one file system's free space once
