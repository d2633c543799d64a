"""A file in torch's legacy format (``torch.save`` before 1.6, or with ``_use_new_zipfile_serialization=False``): do its
storages' bytes follow its pickles, each where torch will read it?

The format is five pickles in a row (magic number, protocol, system info, the object, the keys of its storages), then
each listed storage as an 8-byte element count and its bytes. torch's loader allocates every storage the object's
pickle declares (``UntypedStorage(nbytes)``, uninitialised) and fills only those the fifth pickle lists, so a file that
lists none loads as tensors of whatever the allocator held (a fourth audit, 2026-12-05: an 883-byte ``.bin`` became a
268.6 MB sparse checkpoint whose small tensors held the process's heap). :func:`storage_problem` counts the storages
the object declares with an unpickler that builds nothing but placeholders (no class is imported, no function is
called) and holds the rest of the file to them byte for byte.
"""
from __future__ import annotations

import pickle
import struct
from typing import Any, BinaryIO

import torch

# the element size of each storage class a legacy file may name (``torch.<name>``: the typed classes torch writes)
ELEMENT_SIZE = {f"{name}Storage": dtype.itemsize for name, dtype in (
    ("Double", torch.float64), ("Float", torch.float32), ("Half", torch.float16), ("BFloat16", torch.bfloat16),
    ("Long", torch.int64), ("Int", torch.int32), ("Short", torch.int16), ("Char", torch.int8), ("Byte", torch.uint8),
    ("Bool", torch.bool), ("ComplexFloat", torch.complex64), ("ComplexDouble", torch.complex128),
    ("QUInt8", torch.quint8), ("QInt8", torch.qint8), ("QInt32", torch.qint32), ("QUInt4x2", torch.quint4x2),
    ("QUInt2x4", torch.quint2x4))}
MAX_GLOBALS = 256  # distinct classes and functions a legacy pickle may name (a model's state names a handful)


class _Placeholder:
    """What every class or function a legacy pickle names becomes here: called, built, filled, it keeps nothing."""

    origin = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Placeholder:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Counter(pickle.Unpickler):
    """Reads a pickle to its end, recording each storage it declares (key -> (class name, element count)); every global
    is a placeholder class named after it (nothing imported), every persistent id a placeholder."""

    def __init__(self, file: BinaryIO, declared: dict[Any, tuple[str, Any]]):
        super().__init__(file, encoding="utf-8")  # as torch.load reads a Python 2 str: two keys torch tells apart stay two
        self.declared = declared
        self.named: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> type:
        origin = f"{module}.{name}"
        if origin not in self.named and len(self.named) >= MAX_GLOBALS:
            raise pickle.UnpicklingError(f"more than {MAX_GLOBALS} classes and functions named")
        return self.named.setdefault(origin, type("Placeholder", (_Placeholder,), {"origin": origin}))

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0] if isinstance(pid, tuple) and pid else None
        if kind in ("storage", b"storage") and len(pid) == 6:  # (kind, class, root key, location, count, view)
            storage_type, key = pid[1], pid[2]  # nothing of the pickle's is ever repr'd: a shared list's repr is 2^depth
            named = isinstance(storage_type, type) and issubclass(storage_type, _Placeholder)
            self.declared.setdefault(key, (storage_type.origin if named else f"a {type(storage_type).__name__}", pid[4]))
        return _Placeholder()


def storage_problem(head: BinaryIO, fh: BinaryIO, size: int) -> str | None:
    """Why the legacy file ``fh`` (``size`` bytes; ``head``: its first bytes, at least its five pickles) does not hold
    exactly the storages its object declares, or None. Every declared storage is listed once, each list entry is
    declared, of a class torch writes, and the file is the pickles, then each listed storage's count (equal to the
    declared one) and bytes, and nothing after."""
    declared: dict[Any, tuple[str, Any]] = {}
    head.seek(0)
    try:
        for _ in range(3):  # magic number, protocol, system info
            _Counter(head, {}).load()
        _Counter(head, declared).load()
        keys = _Counter(head, {}).load()
    except Exception as err:  # noqa: BLE001 - whatever the bytes make the unpickler raise: the file cannot be accounted for
        return f"its pickles (torch's legacy format) cannot be read to count their storages ({type(err).__name__})"
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in (*keys, *declared))):
        return "its pickles (torch's legacy format) name their storages by other things than strings, as torch.save never does"
    if missing := set(declared) - set(keys):
        return (f"its pickles (torch's legacy format) declare {_storages(len(declared))} and list {_storages(len(keys))} "
                f"to read, {len(missing):,} of the declared not among them: torch would hand those out uninitialised "
                "(whatever memory held)")
    if len(keys) != len(set(keys)) or len(keys) != len(declared):
        return "its pickles (torch's legacy format) list a storage to read twice, or one they never declare"
    offset = head.tell()
    for key in keys:
        origin, count = declared[key]
        element = ELEMENT_SIZE.get(origin.removeprefix("torch.")) if origin.startswith("torch.") else None
        if element is None:
            return f"its storage {key[:40]!r} is of {origin[:60]}, not a storage class torch.save writes"
        if type(count) is not int:
            return f"its storage {key[:40]!r} declares a count of entries that is a {type(count).__name__}"
        if not 0 <= count <= size:  # never format an int of unbounded digits
            return f"its storage {key[:40]!r} declares a negative count or more entries than the file holds bytes"
        fh.seek(offset)
        stored = fh.read(8)
        if len(stored) < 8 or struct.unpack("<q", stored)[0] != count or offset + 8 + count * element > size:
            return (f"its storage {key[:40]!r} of {count:,} entries is not where torch reads it (at byte {offset:,} of "
                    f"{size:,}): the file is cut short or altered")
        offset += 8 + count * element
    if offset != size:
        return f"it holds {size - offset:,} bytes after its last storage, which no torch.save writes"
    return None


def _storages(n: int) -> str:
    return f"{n:,} storage{'' if n == 1 else 's'}"
