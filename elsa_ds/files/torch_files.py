"""A ``torch.save`` file from elsewhere, looked at before torch reads it and after: no bigger in memory than on disk.

torch's weights-only loader keeps a pickle from running code, not from taking memory: a zip entry stored compressed
(deflate packs ~1000:1; ``torch.save`` never compresses) unpacks whole into memory when the file is scanned or loaded,
and a tensor saved as a view that repeats its storage (``expand``: stride 0) becomes its full size the moment anything
makes it contiguous (a checksum, a copy); and a zip's directory costs its reader ~0.6 KiB an entry, so one of more
entries than ``torch.save`` writes takes far more memory than its file. :func:`zip_problem` is read from the zip's
directory alone (nothing is unpacked), and for a file in torch's legacy format from its pickles' opcodes (nothing is
built); :func:`inflated_tensor` from the loaded object's tensors, whose storages are what the file held.
"""
from __future__ import annotations

import errno
import io
import os
import stat
import struct
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elsa_ds.files.pickle_walk import MAX_NESTING, Walk, walk
from elsa_ds.files.torch_legacy import storage_problem
from elsa_ds.regular_file import NotRegularFile, read_at_most

ZIP_MAGIC = b"PK\x03\x04"  # how torch tells its zip format from the legacy one: the file's first bytes
# torch.save writes an entry a storage and four more (a 27B model's state: a few thousand, ~70 bytes each in the
# directory); Python's zipfile holds ~0.6 KiB for each entry it reads (300,000 empty entries: a 34 MB file, 171 MB and
# ~25 s to read it), so a directory's size is read from the zip's end records before zipfile or torch reads it. miniz
# allocates by the count, zipfile reads the bytes the record declares whatever the count: 8 MiB holds at most ~182,000
# entries of the smallest kind (46 bytes: ~90 MiB in zipfile)
MAX_ZIP_ENTRIES, MAX_ZIP_DIRECTORY = 100_000, 8 * 2**20
# the pickle of a torch.save zip (``<archive>/data.pkl``) holds the containers and each tensor's ~200-byte record, never
# the tensors' data: kilobytes for a model's or an optimizer's state, 2.6 MB for 20,000 tensors. Unpickled, a crafted one
# takes ~170x its size (a walk: 20 MB of empty lists, 3.4 GB and 46 s of torch's weights-only load), so past this size
# it is refused before anything unpacks it
MAX_PICKLE_BYTES = 16 * 2**20
END_RECORD, ZIP64_LOCATOR, ZIP64_END_RECORD = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
# torch's legacy format (torch.save before 1.6, and with _use_new_zipfile_serialization=False) is five pickles in a row
# (magic number, protocol, system info, the object, its storages' keys), then the storages' bytes: torch.load unpickles
# them from the file's start, whatever they hold, so they get the zip's pickle cap (together: a whole file's are KBs)
LEGACY_PICKLES = 5


@dataclass(frozen=True)
class ZipProblem:
    """What is wrong with a torch zip: ``altered`` when no writer of a whole file makes it so (a compressed entry, data
    in front of the first entry, entries claiming more than the file), else the file may only be cut short."""

    text: str
    altered: bool


def real_folder(path: Path) -> Path:
    """Where the folder ``path`` really is (links above it resolved), refused when ``path`` itself is a link or no folder
    (NotRegularFile): opened once without following its last component, its name read back from Linux's
    ``/proc/self/fd``. A file later opened through ``path`` that does not lie under this answer went through a swap."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):  # Linux says ENOTDIR for a link with O_DIRECTORY
            link = err.errno == errno.ELOOP or path.is_symlink()
            raise NotRegularFile(path, "a link" if link else "not a folder", errno.ELOOP if link else errno.ENOTDIR) from None
        raise
    try:
        return Path(os.readlink(_fd_name(fd)))
    except OSError:  # no /proc: the name as resolved now
        return path.resolve()
    finally:
        os.close(fd)


def _fd_name(fd: int) -> str:
    """Linux's name for the open file ``fd``: a link to where it was opened, and a path that opens that file."""
    return f"/proc/self/fd/{fd}"


def opened_path(handle: BinaryIO) -> Path | None:
    """Where the file ``handle`` holds was when it was opened, every link resolved (Linux's ``/proc/self/fd``); None
    where that cannot be read."""
    try:
        return Path(os.readlink(_fd_name(handle.fileno())))
    except OSError:
        return None


def same_file_name(handle: BinaryIO) -> str | None:
    """A name that opens the very file ``handle`` holds, whatever is at its path now (Linux's ``/proc/self/fd``), for
    readers that take only a name (torch's mmap, safetensors); None where there is none."""
    name = _fd_name(handle.fileno())
    try:
        same = os.path.samestat(os.stat(name), os.fstat(handle.fileno()))
    except OSError:
        return None
    return name if same else None


def zip_problem(file: Path | BinaryIO) -> ZipProblem | None:
    """Why torch must not read ``file`` as a zip, from its directory alone; None for a ``torch.save`` zip, and for a
    file in torch's legacy format whose pickles fit the cap (:func:`_legacy_problem`). A zip that Python's zipfile cannot read is
    not read by torch either (miniz, torch's reader, accepts zips that zipfile refuses, and the two can disagree on
    which directory a file holds: data in front of the first entry, an extra field zipfile rejects, end records
    that point each reader elsewhere: :func:`_directory_problem`). ``file``: a path, or a file opened for reading, which
    is then the one checked and is left at its start (so that what torch reads next is what was checked)."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as opened:
            return zip_problem(opened)
    try:
        return _zip_problem(file)
    finally:
        file.seek(0)


def _zip_problem(fh: BinaryIO) -> ZipProblem | None:
    if not stat.S_ISREG((st := os.fstat(fh.fileno())).st_mode):
        return ZipProblem("it is not a regular file", altered=True)
    fh.seek(0)
    size = st.st_size
    if fh.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
        return _legacy_problem(fh, size)
    if (problem := _directory_problem(fh, size)) is not None:
        return problem
    try:
        with zipfile.ZipFile(fh) as zf:  # the handle checked above (ZipFile leaves a file it was given open)
            entries = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, NotImplementedError) as err:
        return ZipProblem(f"its zip directory is unreadable ({' '.join(str(err).split())[:120]})", altered=False)
    if entries and min(e.header_offset for e in entries) != 0:
        return ZipProblem("it holds data in front of its first zip entry", altered=True)
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            return ZipProblem(f"its entry {entry.filename[:80]!r} is stored compressed, which torch.save never writes",
                              altered=True)
        if entry.file_size != entry.compress_size or entry.file_size > size:
            return ZipProblem(f"its entry {entry.filename[:80]!r} claims {entry.file_size:,} bytes stored in "
                              f"{entry.compress_size:,}, in a file of {size:,}", altered=True)
        if _is_pickle(entry) and entry.file_size > MAX_PICKLE_BYTES:
            return ZipProblem(f"its pickle {entry.filename[:80]!r} holds {entry.file_size:,} bytes, more than torch.save "
                              f"writes for a model's or an optimizer's state ({MAX_PICKLE_BYTES:,}): unpickled it could "
                              "take ~170x that", altered=True)
    if sum(e.file_size for e in entries) > size:
        return ZipProblem(f"its entries claim more bytes than the file's {size:,}", altered=True)
    return _pickle_problem(fh, entries)


def _is_pickle(entry: zipfile.ZipInfo) -> bool:
    """Whether torch may read ``entry`` as the archive's pickle: miniz, its reader, finds ``data.pkl`` whatever its case
    (a review: ``archive/DATA.PKL`` passed both the cap and the walk, and torch's load then crashed on it)."""
    return entry.filename.lower().endswith("/data.pkl") or entry.filename.lower() == "data.pkl"


def _pickle_problem(fh: BinaryIO, entries: list[zipfile.ZipInfo]) -> ZipProblem | None:
    """The zip's pickles (``<archive>/data.pkl``, under the cap checked above) walked before torch unpickles them
    (:func:`~elsa_ds.files.pickle_walk.walk`): one nesting containers deeper than ``torch.save`` does crashes the loader.
    Their bytes are read from their local headers as miniz reads them: no CRC is checked (torch checks none, and
    ``torch.serialization.set_crc32_options(False)`` writes 0), no flag honoured (an encrypted one made zipfile raise)."""
    for entry in entries:
        if not _is_pickle(entry):
            continue
        fh.seek(entry.header_offset)
        header = fh.read(30)
        if len(header) < 30 or header[:4] != ZIP_MAGIC:
            return ZipProblem(f"its pickle {entry.filename[:80]!r} has no local header where its directory says", altered=True)
        name_len, extra_len = struct.unpack_from("<HH", header, 26)
        fh.seek(entry.header_offset + 30 + name_len + extra_len)
        try:
            found = walk(io.BytesIO(fh.read(entry.file_size)))
        except ValueError:  # no pickle, or cut short: torch refuses it having read no more than the entry
            continue
        if (problem := _walk_problem(found, f"its pickle {entry.filename[:80]!r}")) is not None:
            return problem
    return None


def _walk_problem(found: Walk, what: str) -> ZipProblem | None:
    """What a pickle's walk shows that no pickler writes: containers nested past ``MAX_NESTING``, or a memo entry numbered
    ahead of those made before it (Python's C unpickler sizes its memo by the number: 5 bytes ask for ~1 GB)."""
    if found.depth > MAX_NESTING:
        return ZipProblem(f"{what}: containers nested more than {MAX_NESTING:,} deep, where torch.save nests a model's or "
                          "an optimizer's state ~10 deep (unpickled, such a pickle crashes the process)", altered=True)
    if found.memo_ahead:
        return ZipProblem(f"{what}: a memo entry numbered ahead of those made before it, as no pickler writes", altered=True)
    return None


def _legacy_problem(fh: BinaryIO, size: int) -> ZipProblem | None:
    """What torch.load would unpickle of a file that is no zip, held to the zip's pickle cap: a tar (torch 0.3's format,
    whose pickle members nothing could check) is refused; else the pickles torch reads from the file's start, walked
    opcode by opcode (pickletools builds nothing), must end within ``MAX_PICKLE_BYTES`` (a walk of 2026-12-04: a legacy
    file's pickle of empty lists passed every check that a zip's would not), and the storages they declare must follow
    them, each whole (:func:`~elsa_ds.files.torch_legacy.storage_problem`). A stream that is no pickle, or ends early, is
    left to torch, which refuses it having read no more than the file, under the cap."""
    fh.seek(0)
    try:  # what torch.load tries first on such a file
        with tarfile.open(fileobj=fh, mode="r:", format=tarfile.PAX_FORMAT):
            return ZipProblem("it is in torch 0.3's tar format, whose pickles cannot be checked before they are unpickled",
                              altered=True)
    except Exception:  # noqa: BLE001 - not a tar (torch then reads pickles), or one torch's own probe fails on too
        pass
    fh.seek(0)
    head = io.BytesIO(read_at_most(fh, MAX_PICKLE_BYTES + 1))
    try:
        for _ in range(LEGACY_PICKLES):
            if (found := _walk_problem(walk(head), "its pickles (torch's legacy format)")) is not None:
                return found
    except ValueError:  # the bytes ran out before a STOP, or are no pickle
        if size > MAX_PICKLE_BYTES and head.tell() >= MAX_PICKLE_BYTES:
            return ZipProblem(f"its pickles (torch's legacy format) run past {MAX_PICKLE_BYTES:,} bytes, more than torch.save "
                              "writes for a model's or an optimizer's state: unpickled they could take ~170x that",
                              altered=True)
        return None
    problem = storage_problem(head, fh, size)
    return None if problem is None else ZipProblem(problem, altered=True)


def _directory_problem(fh: Any, size: int) -> ZipProblem | None:
    """The zip's end as ``torch.save`` writes it, and its directory's size: the end record ends the file (no comment), a
    zip64 locator before it points at the zip64 record just before it, and the directory ends where those records start.
    Then zipfile and miniz (torch's reader) take the same record and read the same directory bytes, which zipfile's
    checks below then cover: elsewhere they look in different places (zipfile the bytes before the record and the zip64
    record before the locator, miniz the offsets the records give), and reviews hid a second directory from each."""
    tail = b""
    if size >= 22:
        fh.seek(size - min(size, 98))
        tail = fh.read(98)
    if tail[-22:-18] != END_RECORD or tail[-2:] != b"\0\0":
        return ZipProblem("its zip directory is unreadable (the file does not end with a zip end record)", altered=False)
    entries, nbytes, offset = struct.unpack_from("<HII", tail, len(tail) - 12)
    start = size - 22
    if tail[-42:-38] == ZIP64_LOCATOR:
        if len(tail) < 98 or struct.unpack_from("<Q", tail, 64)[0] != size - 98 or tail[:4] != ZIP64_END_RECORD:
            return ZipProblem("its zip64 locator does not point at the zip64 record before it", altered=True)
        entries, nbytes, offset = struct.unpack_from("<QQQ", tail, 32)
        start = size - 98
    if offset + nbytes != start:
        return ZipProblem(f"its zip directory of {nbytes:,} bytes at {offset:,} does not end where its end records "
                          f"start ({start:,})", altered=True)
    if entries > MAX_ZIP_ENTRIES or nbytes > MAX_ZIP_DIRECTORY:
        return ZipProblem(f"its zip directory declares {entries:,} entries in {nbytes:,} bytes, more than any torch.save "
                          f"file holds ({MAX_ZIP_ENTRIES:,} entries, {MAX_ZIP_DIRECTORY:,} bytes)", altered=True)
    return None


def inflated_tensor(obj: Any) -> str | None:
    """The first tensor in ``obj`` (inside dicts, lists, tuples and sets, however deep) that claims more bytes than its
    storage holds (a view repeating its storage), or that is not a plain strided tensor with data (sparse, meta): none
    is what ``torch.save`` of a model's or an optimizer's state writes. Named by its path of keys; None when there is none.
    Each container and tensor is visited once: a pickle may share one many times (``x = [x, x]`` 64 deep is 2^64 paths in
    a 31 KB file, a walk's find) or hold one inside itself."""
    todo: list[tuple[Any, Any]] = [((), obj)]  # (where, item): where = (its parent's where, its key), built on refusal only
    seen: set[int] = set()  # ids of the containers and tensors visited (all alive: ``obj`` holds them)
    while todo:  # a loop, not recursion: a pickle can nest containers deeper than Python's stack
        where, item = todo.pop()
        if isinstance(item, (dict, list, tuple, set, frozenset)) or torch.is_tensor(item):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if torch.is_tensor(item):
            if item.layout != torch.strided or item.is_meta:
                return f"{_name(where)} is a {'meta' if item.is_meta else item.layout} tensor"
            claims, held = item.numel() * item.element_size(), item.untyped_storage().nbytes()
            if claims > held:
                return f"{_name(where)} claims {claims:,} bytes over a storage of {held:,}"
        elif isinstance(item, dict):
            todo += [((where, key), value) for key, value in item.items()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo += [((where, key), value) for key, value in enumerate(item)]
    return None


def _name(where: tuple) -> str:
    keys = []
    while where:
        where, key = where
        keys.append(key)
    keys.reverse()
    return (str(keys[0]) + "".join(f"[{k!r}]" for k in keys[1:])) if keys else "a tensor"
