"""JSON from elsewhere, read as data: a size cap before the file is read, and nesting too deep as a ValueError.

``json.loads`` raises RecursionError, a RuntimeError that no reader's ``except ValueError`` catches, on 50 kB of ``[``,
and ``Path.read_text`` reads a 50 GB "config.json" whole into memory before the JSON is even looked at. Every reader of
a file handed over (configs, shard indexes, recipes, fingerprints, evaluation results, the text corpora's lines) goes
through :func:`read` (a file) or :func:`loads` (JSON held in another file), so both become the reader's own one line.
A key named twice in one object is refused where elsa_ds is the file's judge (configs, recipes, profiles, indexes,
checkpoints' own files): readers differ on which value counts, so a check could pass on the value another reader drops.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from elsa_ds.regular_file import open_regular, read_at_most

# configs, shard indexes, recipes, results: kilobytes; a 27B model's sparse config.json with its checksums ~0.3 MB. Parsed,
# JSON takes up to ~20x its bytes in Python objects: 16 MiB of it stays under ~0.4 GB
MAX_BYTES = 16 * 2**20
MODEL_FILE_BYTES = 256 * 2**20  # the most any JSON file of a model folder holds (transformers reads them whole)


class DuplicateKey(ValueError):
    """An object of the document names one key twice: JSON leaves which one counts to the reader (Python's and
    transformers' keep the last, DeepSpeed's own config reader refuses the file), so a check may read the other value."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(f"the key {json.dumps(key)[:80]} appears twice in one object (JSON readers differ on which "
                                      "value counts); keep one")
            seen.add(key)
    return found


def loads(text: str | bytes, unique: bool = True) -> Any:
    """``json.loads``; ValueError when not JSON (json.JSONDecodeError, or nesting too deep for Python's stack), and
    DuplicateKey for an object naming a key twice (``unique=False``: the last counts, as transformers reads a model's
    files and ``datasets`` a corpus's lines)."""
    try:
        return json.loads(text, object_pairs_hook=_unique if unique else None)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def read_text(path: str | Path, limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``: ValueError when it is larger than ``limit`` bytes (refused before reading it) or not
    UTF-8 (UnicodeDecodeError); OSError as ``open`` raises it, NotRegularFile (an OSError) for anything but a regular
    file, never waited on (:func:`elsa_ds.regular_file.open_regular`, through links as ``open`` goes)."""
    with open_regular(path, follow=True) as fh:
        if (size := os.fstat(fh.fileno()).st_size) > limit:
            raise ValueError(f"{size:,} bytes, more than the {limit:,} any such file holds")
        data = read_at_most(fh, limit + 1)  # a file that grows while it is read stops at the limit too
    if len(data) > limit:
        raise ValueError(f"more than the {limit:,} bytes any such file holds")
    return data.decode("utf-8")


def read(path: str | Path, limit: int = MAX_BYTES, unique: bool = True) -> Any:
    """The JSON document in the UTF-8 file ``path``: ValueError when it is too large or not UTF-8 (:func:`read_text`),
    or not JSON, or names a key twice in one object (:func:`loads`); OSError as ``open`` raises it."""
    return loads(read_text(path, limit), unique)


def same(a: Any, b: Any) -> bool:
    """Whether two values read from JSON (or about to be written as JSON) are the same document: ``==``, except that a
    boolean equals only a boolean (Python's ``1 == True`` had a file's ``"steps": true`` pass as this job's 1 step, and
    its ``1`` as ``True``), through lists and objects of any depth (no recursion: a value nested past Python's stack
    is compared too). Numbers compare by value, as JSON has one number type (``1`` is ``1.0``)."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y))
        elif isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return False
            pending.extend((x[k], y[k]) for k in x)
        elif isinstance(x, bool) != isinstance(y, bool) or isinstance(x, (list, tuple, dict)) or isinstance(y, (list, tuple, dict)):
            return False
        elif x != y:
            return False
    return True
