"""Reading a model folder's tensors one at a time: safetensors or pytorch_model.bin, one file or sharded with an index.

Every read problem (a truncated or corrupt file, a shard the index names but the folder lacks, an index that
disagrees with its shards, a shard name that leads outside the folder) becomes a SparseCheckpointError that names
the file. A file from elsewhere is data: its names never reach outside the folder (the Hugging Face hub cache's own
layout, snapshot files linked into the repository's ``blobs/``, excepted).
"""
from __future__ import annotations

import os
import re
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast

import torch

from elsa_ds import regular_file
from elsa_ds.errors import first_line
from elsa_ds.files import torch_files
from elsa_ds.files.weight_files import BIN_INDEX, SAFETENSORS_INDEX, SPARSE_INDEX, SPARSE_STEM, checked_target, inside_folder, within
from elsa_ds.files.weight_files import read_index as read_weight_map
from elsa_ds.sparse.integrity import SparseCheckpointError

SPARSE_SINGLE = f"{SPARSE_STEM}.safetensors"
SPARSE_SHARD = re.compile(rf"{SPARSE_STEM}-\d{{5}}-of-\d{{5}}\.safetensors")
WEIGHT_NAMES = ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin", BIN_INDEX, SPARSE_SINGLE, SPARSE_INDEX)


def locate(folder: Path, sparse: bool = False) -> tuple[list[Path], dict[str, Path] | None, Path | None]:
    """The folder's weight files in index order, the index's tensor -> shard map (None: a single file) and the index.

    transformers' files (``model.safetensors``, ``pytorch_model.bin``, sharded or not), or (``sparse``) an elsa-sparse
    checkpoint's of format version 3 (:func:`check_sparse_layout`). SparseCheckpointError when the folder has none,
    its index is malformed or names shards it lacks or outside it."""
    if sparse:
        check_sparse_layout(folder)
    layouts = ((SPARSE_INDEX, SPARSE_SINGLE),) if sparse else ((SAFETENSORS_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin"))
    for name, single in layouts:
        index = folder / name
        if index.is_file():
            weight_map = read_index(index)
            shards = {name: inside(folder, name, index) for name in dict.fromkeys(weight_map.values())}
            if sparse and (odd := next((n for n in shards if not SPARSE_SHARD.fullmatch(n)), None)) is not None:
                raise SparseCheckpointError(f"{index}: names {odd!r}, which is no elsa-sparse shard's name "
                                            f"({SPARSE_STEM}-0000i-of-0000n.safetensors): the index was edited")
            absent = [name for name, f in shards.items() if not f.is_file()]
            if absent:
                raise SparseCheckpointError(f"{index}: names {', '.join(absent)}, which the folder lacks")
            return list(shards.values()), {tensor: shards[name] for tensor, name in weight_map.items()}, index
        if (folder / single).is_file():
            return [inside(folder, single, folder)], None, None
    names = " or ".join(n for layout in layouts for n in layout[::-1])
    raise SparseCheckpointError(f"{folder} holds no {SPARSE_STEM if sparse else 'model'} weights ({names})")


def check_sparse_layout(folder: Path) -> None:
    """A version 3 checkpoint's weight files are its own: a transformers weight file beside them (a v2 checkpoint's
    left under a v3 copied over it, or a version edited) would have transformers load the folder with random weights
    again, and both a single file and an index would leave one of them unread. SparseCheckpointError naming it."""
    for entry in sorted(folder.iterdir()):
        if is_weight_file(entry) and not entry.name.startswith(SPARSE_STEM):
            raise SparseCheckpointError(f"{entry}: a transformers weight file, which an elsa-sparse checkpoint of format "
                                        "version 3 never holds (left from an older checkpoint, or config.json's version was "
                                        "edited); remove it, or write the checkpoint again into an empty folder")
    if (folder / SPARSE_INDEX).exists() and (folder / SPARSE_SINGLE).exists():
        raise SparseCheckpointError(f"{folder}: holds both {SPARSE_INDEX} and {SPARSE_SINGLE}, of two different writes; "
                                    "write the checkpoint again into an empty folder")


def weight_files(folder: Path, sparse: bool = False) -> list[Path]:
    """The folder's weight files in index order (see :func:`locate`)."""
    return locate(folder, sparse)[0]


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index: tensor name -> shard file name, both strings (a name given twice refused)."""
    return read_weight_map(index, SparseCheckpointError, unique=True)


def inside(folder: Path, name: str, listed_in: Path) -> Path:
    """``folder / name`` where ``name`` is relative, has no ``..`` and, links resolved, stays inside ``folder``."""
    return inside_folder(folder, name, listed_in, SparseCheckpointError)


def is_weight_file(path: Path) -> bool:
    """A weight file or shard index of transformers' names, or of an elsa-sparse checkpoint's."""
    return path.name in WEIGHT_NAMES or (path.name.startswith(("model-", "pytorch_model-", f"{SPARSE_STEM}-"))
                                         and path.suffix in (".safetensors", ".bin"))


class TensorReader:
    """The tensors of a folder by name, read lazily (safetensors: memory-mapped per tensor; .bin: torch.load mmap)."""

    def __init__(self, folder: Path, sparse: bool = False):
        self.folder = Path(folder)
        self.files, index, self._index_file = locate(self.folder, sparse)
        self._where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        self._kept: list[BinaryIO] = []  # files a handle reads by their /proc name: open while the reader lives
        weakref.finalize(self, _close, self._kept)
        for path in self.files:
            for name in self._handle(path).keys():
                if name in self._where:
                    raise SparseCheckpointError(f"{path}: holds {name}, which {self._where[name].name} holds too")
                self._where[name] = path
        if index is not None:
            self._agree(index)

    def _agree(self, index: dict[str, Path]) -> None:
        """The index and the shards' headers name the same tensors in the same files."""
        listed = cast(Path, self._index_file)
        for name, path in index.items():
            if self._where.get(name) != path:
                found = f"{self._where[name].name} holds it" if name in self._where else "no shard it names holds it"
                raise SparseCheckpointError(f"{listed}: puts {name} in {path.name}, but {found}")
        unlisted = [n for n in self._where if n not in index]
        if unlisted:
            raise SparseCheckpointError(f"{self._where[unlisted[0]]}: holds {unlisted[0]}, which {listed.name} does not list")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def where(self, name: str) -> Path:
        return self._where[name]

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        path = self._where[name]
        handle = self._handle(path)
        try:
            return handle.get_tensor(name) if path.suffix == ".safetensors" else handle[name]
        except Exception as err:
            raise SparseCheckpointError(f"cannot read {name} from {path}: {first_line(err)}; the file is truncated or corrupt") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.get(name)

    def _handle(self, path: Path):
        if path not in self._open:
            self._open[path], kept = _opened(path, self.folder)
            if kept is not None:
                self._kept.append(kept)
        return self._open[path]


def _opened(path: Path, folder: Path) -> tuple[object, BinaryIO | None]:
    """A safetensors file's handle, or a .bin file's state dict (checked: tensors by name, none bigger than its
    storage), with the file the safetensors handle reads by name (None for a .bin: loaded); SparseCheckpointError
    naming the file else. The file is opened once, where its name leads when it is opened (checked again: inside the
    folder), and its check and its read go through that handle: a file or link put there since is never the one read."""
    target = checked_target(folder, path.relative_to(folder).as_posix(), path, SparseCheckpointError, what="file")
    try:
        with regular_file.open_regular(target) as fh:
            if (opened := torch_files.opened_path(fh)) is not None and not within(folder.resolve(), opened):
                raise SparseCheckpointError(f"{path}: opened at {opened}, outside {folder} (a folder on its way was replaced "
                                            "by a link after the folder was checked); copy the checkpoint again")
            name = torch_files.same_file_name(fh)
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                if name is None:
                    return safe_open(str(target), framework="pt"), None
                kept = os.fdopen(os.dup(fh.fileno()), "rb")  # the name stays this file's while the reader lives
                try:
                    return safe_open(torch_files.same_file_name(kept) or str(target), framework="pt"), kept
                except BaseException:
                    kept.close()
                    raise
            if (problem := torch_files.zip_problem(fh)) is not None:  # before torch unpacks anything
                raise SparseCheckpointError(f"{path}: {problem.text}; copy the checkpoint again")
            zipped = fh.read(len(torch_files.ZIP_MAGIC)) == torch_files.ZIP_MAGIC  # torch maps only its zip format
            fh.seek(0)
            handle = (torch.load(name, map_location="cpu", mmap=True, weights_only=True) if name is not None and zipped
                      else torch.load(fh, map_location="cpu", weights_only=True))  # no name, or legacy: read whole
    except SparseCheckpointError:
        raise
    except regular_file.NotRegularFile as err:
        raise SparseCheckpointError(f"{path}: {err.what} put there after the folder was checked; copy the checkpoint "
                                    "again") from None
    except Exception as err:
        raise SparseCheckpointError(f"cannot read {path}: {first_line(err)}; the file is truncated or corrupt") from None
    if not (isinstance(handle, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in handle.items())):
        raise SparseCheckpointError(f"{path}: not a state dict (tensors by name)")
    if (inflated := torch_files.inflated_tensor(handle)) is not None:
        raise SparseCheckpointError(f"{path}: {inflated}, which no saved state dict holds; the file was altered: copy the "
                                    "checkpoint again")
    return handle, None


def _close(files: list[BinaryIO]) -> None:
    for f in files:
        f.close()
