"""A file handed over, opened once for reading without waiting: what is checked through the handle is what is read.

A FIFO, socket or device where a file is expected would hang its reader for good (an audit: a recipe's
``sparsity_profile`` naming a FIFO beside it waited for a writer with the job's lock held), and a path checked, then
opened, may be swapped between the two. So the file is opened once, non-blocking, and examined through its descriptor:
the readers of files from elsewhere (JSON through :mod:`elsa_ds.json_data`, torch files, safetensors headers, model
cards) open them here; a corpus's text files and a resumed run's ``latest`` are checked as regular files before they
are read (``data/sources.py``, ``files/handed.py``).
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO


class NotRegularFile(OSError):
    """A path that :func:`open_regular` refused: ``what`` it is (a link, not a regular file); an OSError with the path
    as its filename, so a reader's ``except OSError`` that quotes ``strerror`` says what it was."""

    def __init__(self, path: str | Path, what: str, code: int = errno.EINVAL):
        super().__init__(code, what, str(path))
        self.what = what


def open_regular(path: str | Path, follow: bool = False) -> BinaryIO:
    """``path`` opened once for reading (binary, close-on-exec), not through a link at its last component (``follow``:
    through one too, as a hub snapshot's links into its blobs are read); a folder is IsADirectoryError naming the path,
    a link or anything but a regular file (a FIFO, socket, device) NotRegularFile, neither waited on."""
    nofollow = 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | nofollow | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP and not follow:
            raise NotRegularFile(path, "a link", errno.ELOOP) from None
        raise
    try:
        if stat.S_ISDIR(mode := os.fstat(fd).st_mode):  # as open() says it, naming the path (fdopen named the number)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, "not a regular file (a FIFO, socket or device)")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_at_most(fh: BinaryIO, n: int, piece: int = 1 << 20) -> bytes:
    """At most ``n`` bytes of ``fh``, read a piece at a time: ``fh.read(n)`` reserves all ``n`` bytes before it reads
    one (an audit: a 260 KB tokenizer.json read under a 256 MiB cap failed with MemoryError under ``ulimit -v``)."""
    parts: list[bytes] = []
    while n > 0 and (part := fh.read(min(n, piece))):
        parts.append(part)
        n -= len(part)
    return b"".join(parts)
