"""Keep-masks on disk, readable a flat range at a time: the hand-over from a one-shot method to ELSA.

A mask file is a safetensors file with one uint8 tensor per pruned weight: the weight's keep-mask,
flattened row-major and packed eight entries per byte (entry i is bit i % 8 of byte i // 8), so a 27B
model's masks take ~3 GB instead of 25 GB of bools. Under ZeRO-3 every rank reads only the bytes that
cover its own partition of each weight.

``MaskReader`` also reads masks from a saved model directory (a model pruned by any tool): the mask is
then ``weight != 0``, read row range by row range.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from elsa_ds import json_data
from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import writing

_BITS = torch.arange(8, dtype=torch.uint8)


def pack(mask: torch.Tensor) -> torch.Tensor:
    """Bool mask (any shape) -> uint8 [ceil(numel / 8)], entry i at bit i % 8 of byte i // 8."""
    flat = mask.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    return (flat.view(-1, 8) << _BITS).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, first: int, length: int) -> torch.Tensor:
    """Entries [first, first + length) of a mask from the packed bytes starting at byte first // 8."""
    bits = ((packed.view(-1, 1) >> _BITS) & 1).view(-1).bool()
    offset = first % 8
    return bits[offset:offset + length]


def write_masks(path: Path, masks: dict[str, torch.Tensor]) -> None:
    """Write keep-masks (name -> bool tensor of the weight's shape), atomically: a write that fails (a full disk:
    ``DiskFull``) or is interrupted leaves no file behind."""
    from safetensors.torch import save_file

    tensors = {name: pack(m) for name, m in masks.items()}
    meta = {"format": "elsa_ds packed keep-masks", "shapes": json.dumps({n: list(m.shape) for n, m in masks.items()})}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with writing(path, sum(t.numel() for t in tensors.values())):
            save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


class MaskReader:
    """Ranges of keep-masks from a mask file or from the zeros of a saved model's weights."""

    def __init__(self, source: str | Path):
        source = Path(source).expanduser()
        self.packed = source.is_file()
        files = [source] if self.packed else sorted(source.glob("*.safetensors"))
        if not files:
            raise ElsaError(f"{source}: no .safetensors files to read masks from (save the pruned model with safetensors)")
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        from safetensors import SafetensorError, safe_open

        for file in files:
            try:
                with safe_open(str(file), framework="pt") as fh:
                    meta = fh.metadata() or {}
                    shapes = _stored_shapes(file, meta) if self.packed else {}
                    for key in fh.keys():
                        self.where[key] = file
                        stored = fh.get_slice(key)
                        if self.packed:
                            _check_packed(file, key, shapes.get(key), stored.get_shape(), stored.get_dtype())
                        self.shapes[key] = tuple(shapes.get(key) or stored.get_shape())
            except SafetensorError as err:
                raise ElsaError(f"{file}: not a readable safetensors file ({' '.join(str(err).split())}); write or copy it "
                                "again") from None
        self.source = source

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every pruned weight must be present with its shape; say which are not."""
        missing = [n for n in shapes if n not in self.shapes]
        wrong = [f"{n} {self.shapes[n]} vs {tuple(s)}" for n, s in shapes.items() if n in self.shapes and self.shapes[n] != tuple(s)]
        if missing or wrong:
            raise ElsaError(f"--init_mask {self.source}: does not fit this model: "
                            + (f"missing {missing[:3]} " if missing else "") + (f"shape differs: {wrong[:3]}" if wrong else ""))

    def numel(self, name: str) -> int:
        """Entries of the weight ``name``."""
        return math.prod(self.shapes[name])

    def read(self, name: str, first: int, length: int) -> torch.Tensor:
        """Keep-mask entries [first, first + length) of the flattened weight ``name`` (bool [length])."""
        from safetensors import safe_open

        with safe_open(str(self.where[name]), framework="pt") as fh:
            view = fh.get_slice(name)
            if self.packed:
                return unpack(view[first // 8:-(-(first + length) // 8)], first, length)
            cols = self.shapes[name][-1]
            rows = view[first // cols:-(-(first + length) // cols)]
            return (rows.reshape(-1) != 0)[first % cols:first % cols + length]


def _stored_shapes(file: Path, meta: dict[str, str]) -> dict[str, list[int]]:
    """A packed mask file's ``shapes`` metadata: tensor name -> shape (a list of ints); ElsaError naming the file else."""
    try:
        shapes = json_data.loads(meta.get("shapes", "{}"))
    except json_data.DuplicateKey as err:
        raise ElsaError(f"{file}: its 'shapes' metadata: {err}; write the mask file again") from None
    except ValueError as err:
        raise ElsaError(f"{file}: its 'shapes' metadata is not JSON ({err}); write the mask file again") from None
    if not isinstance(shapes, dict) or not all(isinstance(v, list) and all(isinstance(d, int) for d in v) for v in shapes.values()):
        raise ElsaError(f"{file}: its 'shapes' metadata is not a map of tensor names to shapes; write the mask file again")
    return shapes


def _check_packed(file: Path, name: str, shape: list[int] | None, stored: list[int], dtype: str) -> None:
    """A packed mask file's tensor: uint8 bytes, one dimension, exactly the bytes its ``shapes`` entry packs into
    (:func:`pack`); ElsaError naming the file and tensor else (a short one would be read as a mask of another size)."""
    if shape is None:
        raise ElsaError(f"{file}: its 'shapes' metadata has no entry for {name}; write the mask file again")
    need = -(-math.prod(shape) // 8)
    if dtype != "U8" or list(stored) != [need]:
        raise ElsaError(f"{file}: {name} holds {dtype} {list(stored)}, where a packed mask of shape {shape} is U8 [{need}]; "
                        "write the mask file again")
