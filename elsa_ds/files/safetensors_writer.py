"""A safetensors writer that takes one tensor at a time, sharded as ``save_pretrained`` shards.

Every tensor's name, shape and dtype is known before any data exists (under ZeRO-3: from the partitioned
parameters' full shapes), so the shards and each file's header are fixed up front: 8 bytes of header length,
the JSON header (``data_offsets`` of every tensor), then the tensors' bytes in header order. Data is written as
each tensor arrives and dropped at once: the writer never holds more than the tensor it is given.

Shards follow huggingface_hub's split (``split_state_dict_into_shards_factory``): a tensor that would push a shard
past ``max_shard_size`` starts the next one, a tensor larger than ``max_shard_size`` gets a shard of its own;
``model.safetensors`` when there is one shard, else ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json`` (an elsa-sparse checkpoint: ``elsa-sparse`` in place of ``model``, another index name).

A full disk becomes ``disk_room.DiskFull`` naming the shard and the bytes of every shard together.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import writing
from elsa_ds.files.weight_files import SAFETENSORS_INDEX

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
          torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
INDEX_NAME = SAFETENSORS_INDEX
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DEFAULT_MAX_SHARD_SIZE = "5GB"


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"`` (powers of 10, as transformers reads it) or ``"4GiB"``."""
    wrong = ElsaError(f"max_shard_size {size!r}: expected a positive number of bytes or e.g. '5GB', '500MB', '4GiB'")
    if isinstance(size, bool):
        raise wrong
    if isinstance(size, int):
        if size < 1:
            raise wrong
        return size
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]I?B)\s*", str(size).upper())  # "1..5GB": refused
    if not match or (count := int(float(match.group(1)) * SIZE_UNITS[match.group(2)])) < 1:
        raise wrong
    return count


@dataclass(frozen=True)
class TensorSpec:
    """What the header says of one tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


def plan_shards(specs: list[TensorSpec], max_shard_size: int | str) -> list[list[TensorSpec]]:
    """The tensors of every shard, in order."""
    limit = parse_size(max_shard_size)
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.nbytes > limit:
            shards.append([spec])
            continue
        if current and size + spec.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int, stem: str = "model") -> list[str]:
    return [f"{stem}.safetensors"] if count == 1 else [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """A safetensors header: little-endian u64 length, then JSON padded with spaces to a multiple of 8 bytes."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPES:
            raise ElsaError(f"{spec.name}: dtype {spec.dtype} has no safetensors name")
        entries[spec.name] = {"dtype": DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class ShardedWriter:
    """Writes ``specs`` into ``out_dir`` in the given order, one tensor per :meth:`write` call (rank 0 only).

    Use as a context manager; leaving it without an exception checks that every tensor was written and writes the
    index. The largest tensor handed over is kept in ``largest_tensor_bytes``, for the estimator's export term.
    """

    def __init__(self, out_dir: Path, specs: list[TensorSpec], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                 metadata: dict[str, str] | None = None, stem: str = "model", index: str = INDEX_NAME):
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(specs, max_shard_size)
        self.names = shard_names(len(self.shards), stem)
        self.index_name = index
        self.metadata = metadata or {"format": "pt"}
        self._queue = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._file: BinaryIO | None = None  # the shard being written (``_open_index``)
        self._open_index = -1
        self.largest_tensor_bytes = 0
        self.total_bytes = sum(len(header_bytes(shard, self.metadata)) + sum(s.nbytes for s in shard) for shard in self.shards)

    def __enter__(self) -> ShardedWriter:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        file, self._file = self._file, None
        try:
            if file is not None:
                with self._room(self._open_index):
                    file.close()
        except Exception:
            if exc_type is None:
                raise  # else the error on the way out stays the one reported
        if exc_type is None:
            with self._room(self._open_index):
                self._finish()

    def _room(self, shard: int):
        """A full disk while writing: DiskFull naming the shard and the bytes of the whole export."""
        return writing(self.out_dir / self.names[max(shard, 0)], self.total_bytes)

    @property
    def pending(self) -> TensorSpec | None:
        """The tensor the next :meth:`write` must bring."""
        return self._queue[self._next][1] if self._next < len(self._queue) else None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor's bytes; ``tensor`` may live on any device (a GPU tensor is copied to the host)."""
        spec = self.pending
        if spec is None or spec.name != name:
            raise ElsaError(f"export wrote {name!r} out of order (expected {spec.name if spec else 'nothing more'})")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ElsaError(f"export: {name} is {tuple(tensor.shape)} {tensor.dtype}, its header says {spec.shape} {spec.dtype}")
        shard = self._queue[self._next][0]
        data = tensor.detach().reshape(-1).contiguous().cpu()
        with self._room(shard):
            file = self._open(shard) if shard != self._open_index else self._file
            assert file is not None, "the shard of a written tensor is open (_open_index is -1 until one is)"
            if data.numel():
                file.write(data.view(torch.uint8).numpy().data)
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, spec.nbytes)
        self._next += 1

    def _open(self, shard: int) -> BinaryIO:
        if self._file is not None:
            self._file.close()
        self._file = file = (self.out_dir / self.names[shard]).open("wb")
        file.write(header_bytes(self.shards[shard], self.metadata))
        self._open_index = shard
        return file

    def _finish(self) -> None:
        if self._next != len(self._queue):
            raise ElsaError(f"export stopped after {self._next} of {len(self._queue)} tensors; next was {self._queue[self._next][1].name}")
        for shard in range(len(self.shards)):
            if shard > self._open_index:  # shards left empty (a model without tensors) still get a valid file
                self._open(shard).close()
                self._file = None
        if len(self.shards) > 1:
            weight_map = {spec.name: self.names[i] for i, shard in enumerate(self.shards) for spec in shard}
            index = {"metadata": {"total_size": sum(s.nbytes for shard in self.shards for s in shard)}, "weight_map": weight_map}
            (self.out_dir / self.index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
