"""JSON from elsewhere, read as data: a size cap before the file is read, and nesting too deep as a ValueError.

``json.loads`` raises RecursionError, a RuntimeError that no reader's ``except ValueError`` catches, on 50 kB of ``[``,
and ``Path.read_text`` reads a 50 GB "config.json" whole into memory before the JSON is even looked at. Every reader of
a file handed over (configs, shard indexes, recipes, fingerprints, evaluation results, the text corpora's lines) goes
through :func:`read` (a file) or :func:`loads` (JSON held in another file), so both become the reader's own one line.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

# configs, shard indexes, recipes, results: kilobytes; a 27B model's sparse config.json with its checksums ~0.3 MB. Parsed,
# JSON takes up to ~20x its bytes in Python objects: 16 MiB of it stays under ~0.4 GB
MAX_BYTES = 16 * 2**20
MODEL_FILE_BYTES = 256 * 2**20  # the most any JSON file of a model folder holds (transformers reads them whole)


def loads(text: str | bytes) -> Any:
    """``json.loads``; ValueError (json.JSONDecodeError, or nesting too deep for Python's stack) when not JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def read_text(path: str | Path, limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``: ValueError when it is larger than ``limit`` bytes (refused before reading it) or not
    UTF-8 (UnicodeDecodeError); OSError as ``open`` raises it, and one saying so for anything but a regular file (an
    audit: a recipe's sparsity_profile naming a FIFO beside it waited for a writer for good): opened without waiting."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:  # checked before fdopen, which names a folder by its descriptor's number and keeps the descriptor
        if stat.S_ISDIR((st := os.fstat(fd)).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket or device)", str(path))
        if st.st_size > limit:
            raise ValueError(f"{st.st_size:,} bytes, more than the {limit:,} any such file holds")
        data = fh.read(limit + 1)  # a file that grows while it is read stops at the limit too
    if len(data) > limit:
        raise ValueError(f"more than the {limit:,} bytes any such file holds")
    return data.decode("utf-8")


def read(path: str | Path, limit: int = MAX_BYTES) -> Any:
    """The JSON document in the UTF-8 file ``path``: ValueError when it is too large or not UTF-8 (:func:`read_text`),
    or not JSON; OSError as ``open`` raises it."""
    return loads(read_text(path, limit))
