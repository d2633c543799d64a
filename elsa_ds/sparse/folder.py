"""Reading a model folder's tensors one at a time: safetensors or pytorch_model.bin, one file or sharded with an index.

Every read problem (a truncated or corrupt file, a shard the index names but the folder lacks) becomes an ElsaError
that names the file.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from elsa_ds.errors import ElsaError

SAFETENSORS_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
WEIGHT_NAMES = ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin", BIN_INDEX)


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files in index order; ElsaError when it has none or its index names missing shards."""
    for index_name, single in ((SAFETENSORS_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin")):
        if (folder / index_name).is_file():
            try:
                weight_map = json.loads((folder / index_name).read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ElsaError(f"{folder / index_name}: not a valid shard index ({err})") from None
            files = [folder / name for name in dict.fromkeys(weight_map.values())]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise ElsaError(f"{folder}: the shard index names {', '.join(absent)}, which the folder lacks")
            return files
        if (folder / single).is_file():
            return [folder / single]
    raise ElsaError(f"{folder} holds no model weights ({' or '.join(WEIGHT_NAMES)})")


def is_weight_file(path: Path) -> bool:
    return path.name in WEIGHT_NAMES or (path.name.startswith(("model-", "pytorch_model-")) and path.suffix in (".safetensors", ".bin"))


class TensorReader:
    """The tensors of a folder by name, read lazily (safetensors: memory-mapped per tensor; .bin: torch.load mmap)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files = weight_files(self.folder)
        self._where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        for path in self.files:
            for name in self._handle(path).keys():
                self._where[name] = path

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        path = self._where[name]
        handle = self._handle(path)
        try:
            return handle.get_tensor(name) if path.suffix == ".safetensors" else handle[name]
        except Exception as err:
            raise ElsaError(f"cannot read {name} from {path}: {_first_line(err)}; the file is truncated or corrupt") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.get(name)

    def _handle(self, path: Path):
        if path not in self._open:
            try:
                if path.suffix == ".safetensors":
                    from safetensors import safe_open

                    self._open[path] = safe_open(str(path), framework="pt")
                else:
                    self._open[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as err:
                raise ElsaError(f"cannot read {path}: {_first_line(err)}; the file is truncated or corrupt") from None
        return self._open[path]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
