"""The elsa-sparse layout of one pruned weight: encode, decode and check it, in plain torch (the readable reference).

A 2-D weight W [rows, cols] with at least ``min_sparsity`` zeros is stored as its entries in row-major order:

* ``<name>.values``       [n] in W's dtype: the nonzero values (delta8 adds explicit zero fillers, see below);
* positions, one of two codes, whichever takes fewer bytes (a tie picks bitmask):
  - ``bitmask``: ``<name>.bitmask`` uint8 [rows, ceil(cols / 8)]: bit ``c % 8`` (least significant first) of byte
    ``c // 8`` of row r is set when W[r, c] != 0; padding bits are 0; ``values`` holds exactly the set positions;
  - ``delta8``: ``<name>.deltas`` uint8 [n] and ``<name>.row_offsets`` int64 [rows + 1]: row r's entries are
    ``row_offsets[r] .. row_offsets[r+1]``; within a row, col(first) = delta[first], col(k) = col(k-1) + 1 + delta[k].
    A gap longer than 256 columns is bridged by filler entries of value 0 with delta 255, so n = nonzeros + fillers.

Zeros are what ``W == 0`` says: a ``-0.0`` is a zero and comes back as ``+0.0`` (every other bit is kept).

Not stored, built from delta8 on a GPU at load (:func:`delta8_to_cols16`): ``cols16``, the same rows with each entry's
column in full, ``<name>.cols`` int16 [n] (the column's 16 bits: columns up to 65535), ``values`` [n] without delta8's
fillers, ``row_offsets`` int32 [rows + 1]. One byte more an entry than delta8, and no running sum to decode: each entry
stands alone (elsa_ds/sparse/triton_spmv.py says why a GPU wants that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elsa_ds.sparse.integrity import SparseCheckpointError

FORMAT, VERSION = "elsa-sparse", 3  # 2: checksums recorded (elsa_ds/sparse/meta.py); 3: weight files transformers never reads
BITMASK, DELTA8 = "bitmask", "delta8"
MAX_GAP = 256  # a delta8 byte moves at most 256 columns
PARTS = {BITMASK: ("values", "bitmask"), DELTA8: ("values", "deltas", "row_offsets")}
COLS16 = "cols16"  # the GPU layout, built at load, never stored
POSITIONS = {DELTA8: "deltas", COLS16: "cols"}  # each layout's positions part, beside values and row_offsets
MAX_COLS16 = 1 << 16  # columns a cols16 entry can name


@dataclass(frozen=True)
class Encoded:
    """One weight in its chosen code: the tensors to store, by suffix."""

    encoding: str
    shape: tuple[int, int]
    nonzeros: int
    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


def zero_fraction(weight: torch.Tensor) -> float:
    return 1.0 - int(torch.count_nonzero(weight)) / max(weight.numel(), 1)


def compressible(weight: torch.Tensor, min_sparsity: float) -> bool:
    """A 2-D floating tensor with at least ``min_sparsity`` zeros."""
    return weight.dim() == 2 and weight.is_floating_point() and weight.numel() > 0 and zero_fraction(weight) >= min_sparsity


def _steps(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The column step of every entry (row-major) from the previous one in its row (from -1)."""
    prev = torch.full_like(cols, -1)
    if cols.numel() > 1:
        same_row = rows[1:] == rows[:-1]
        prev[1:] = torch.where(same_row, cols[:-1], prev[1:])
    return cols - prev


def counts(weight: torch.Tensor) -> tuple[int, int]:
    """Nonzeros of ``weight`` and the entries (nonzeros + fillers) delta8 needs for it."""
    step = _steps(*torch.nonzero(weight, as_tuple=True))
    return int(step.numel()), int(step.numel() + ((step - 1) // MAX_GAP).sum())


def code_bytes(shape: tuple[int, int], element_size: int, nonzeros: int, entries: int) -> dict[str, int]:
    """Bytes of each code for a weight of ``shape`` with these counts."""
    rows, cols = shape
    return {BITMASK: nonzeros * element_size + rows * math.ceil(cols / 8), DELTA8: entries * (element_size + 1) + (rows + 1) * 8}


def encoded_bytes(weight: torch.Tensor) -> dict[str, int]:
    """Bytes of each code for ``weight`` (without building them)."""
    rows, cols = weight.shape
    return code_bytes((rows, cols), weight.element_size(), *counts(weight))


def pick(sizes: dict[str, int]) -> str:
    """The code with fewer bytes (a tie: bitmask)."""
    return BITMASK if sizes[BITMASK] <= sizes[DELTA8] else DELTA8


def encode(weight: torch.Tensor, encoding: str | None = None) -> Encoded:
    """``weight`` in ``encoding`` (None: the smaller of the two)."""
    if encoding is None:
        encoding = pick(encoded_bytes(weight))
    weight = weight.detach().cpu()
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    nonzeros = int(torch.count_nonzero(weight))
    parts = encode_bitmask(weight) if encoding == BITMASK else encode_delta8(weight)
    return Encoded(encoding, shape, nonzeros, parts)


def encode_bitmask(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, cols = weight.shape
    mask = weight != 0
    padded = torch.zeros(rows, math.ceil(cols / 8) * 8, dtype=torch.uint8)
    padded[:, :cols] = mask
    weights = (2 ** torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    bits = (padded.view(rows, -1, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)
    return {"values": weight[mask].contiguous(), "bitmask": bits}


def encode_delta8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight``'s delta8 parts, on its device."""
    rows, cols = torch.nonzero(weight, as_tuple=True)
    return _delta8_from_positions(rows, cols, weight[rows, cols], weight.shape[0])


def _delta8_from_positions(row: torch.Tensor, col: torch.Tensor, nonzero: torch.Tensor, n_rows: int) -> dict[str, torch.Tensor]:
    """delta8 parts of the entries at (row, col) in row-major order, their values ``nonzero``."""
    step = _steps(row, col)
    fill = (step - 1) // MAX_GAP  # fillers before each nonzero
    slot = torch.cumsum(fill + 1, 0) - 1  # where each nonzero lands among the entries
    entries = int(slot[-1]) + 1 if slot.numel() else 0
    device = nonzero.device  # encoded where the weight is: on a GPU, a 7B model's weights in seconds
    values = torch.zeros(entries, dtype=nonzero.dtype, device=device)
    deltas = torch.full((entries,), MAX_GAP - 1, dtype=torch.uint8, device=device)
    values[slot] = nonzero
    deltas[slot] = (step - 1 - MAX_GAP * fill).to(torch.uint8)
    per_row = torch.zeros(n_rows, dtype=torch.int64, device=device).index_add_(0, row, fill + 1)
    offsets = torch.zeros(n_rows + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(per_row, 0)
    return {"values": values, "deltas": deltas, "row_offsets": offsets}


def delta8_positions(deltas: torch.Tensor, row_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every delta8 entry: col = (running sum of 1 + delta within the row) - 1."""
    counts = row_offsets[1:] - row_offsets[:-1]
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=deltas.device), counts)
    run = torch.cumsum(deltas.to(torch.int64) + 1, 0)
    before = torch.cat([run.new_zeros(1), run])[row_offsets[:-1]]  # running sum where each row starts
    return row, run - before[row] - 1


def cols16_positions(cols: torch.Tensor, row_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every cols16 entry (the int16's 16 bits, read unsigned)."""
    counts = row_offsets[1:] - row_offsets[:-1]
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=cols.device), counts)
    return row, cols.to(torch.int64) & (MAX_COLS16 - 1)


def positions(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every entry of delta8 or cols16 parts."""
    if "cols" in parts:
        return cols16_positions(parts["cols"], parts["row_offsets"])
    return delta8_positions(parts["deltas"], parts["row_offsets"])


def delta8_to_cols16(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The cols16 layout of checked delta8 parts, on their device: fillers dropped (the only stored zeros: entries are
    nonzeros and fillers), each column in full. ValueError past 65536 columns or 2^31 entries."""
    if shape[1] > MAX_COLS16 or parts["values"].numel() >= 1 << 31:
        raise ValueError(f"a {shape[0]}x{shape[1]} weight with {parts['values'].numel()} entries does not fit cols16 (at most "
                         f"{MAX_COLS16} columns and 2^31 entries): keep it in delta8")
    row, col = delta8_positions(parts["deltas"], parts["row_offsets"])
    keep = parts["values"] != 0
    row, col = row[keep], col[keep]
    per_row = torch.zeros(shape[0], dtype=torch.int64, device=row.device).index_add_(0, row, torch.ones_like(row))
    offsets = torch.zeros(shape[0] + 1, dtype=torch.int64, device=row.device)
    offsets[1:] = torch.cumsum(per_row, 0)
    signed = torch.where(col >= MAX_COLS16 // 2, col - MAX_COLS16, col)  # the 16 bits as an int16
    return {"values": parts["values"][keep].contiguous(), "cols": signed.to(torch.int16), "row_offsets": offsets.to(torch.int32)}


def cols16_to_delta8(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The delta8 parts of cols16 ones, on their device (fillers put back where a gap passes 256 columns)."""
    row, col = cols16_positions(parts["cols"], parts["row_offsets"])
    return _delta8_from_positions(row, col, parts["values"], shape[0])


def bitmask_mask(bitmask: torch.Tensor, cols: int) -> torch.Tensor:
    """The bool mask [rows, cols] a bitmask code stands for (padding bits dropped)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :cols].bool()


def decode(encoding: str, shape: tuple[int, int], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense weight back (bit for bit, zeros as +0.0); ``parts`` must have passed :func:`check`."""
    values = parts["values"]
    dense = torch.zeros(shape, dtype=values.dtype, device=values.device)
    if encoding == BITMASK:
        dense[bitmask_mask(parts["bitmask"], shape[1])] = values
    else:  # delta8, or the cols16 layout
        row, col = positions(parts)
        dense[row, col] = values
    return dense


def to_delta8(encoding: str, shape: tuple[int, int], parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The delta8 parts of a checked weight (what the decode kernel runs), whatever code it was stored in."""
    return dict(parts) if encoding == DELTA8 else encode_delta8(decode(encoding, shape, parts))


def check(name: str, encoding: str, shape: tuple[int, int], parts: dict[str, torch.Tensor]) -> None:
    """SparseCheckpointError unless ``parts`` are a consistent ``encoding`` of a ``shape`` weight (counts, ranges, dtypes)."""
    if encoding not in PARTS:
        raise SparseCheckpointError(f"{name}: unknown position code {encoding!r} (this version reads {', '.join(PARTS)})")
    missing = [p for p in PARTS[encoding] if p not in parts]
    if missing:
        raise SparseCheckpointError(f"{name}: the checkpoint lacks {', '.join(f'{name}.{p}' for p in missing)}: it is incomplete")
    values, (rows, cols) = parts["values"], shape
    if values.dim() != 1 or not values.is_floating_point():
        raise SparseCheckpointError(f"{name}.values: expected a 1-D floating tensor, found {tuple(values.shape)} {values.dtype}")
    if encoding == BITMASK:
        _check_bitmask(name, parts["bitmask"], values.numel(), rows, cols)
    else:
        _check_delta8(name, parts["deltas"], parts["row_offsets"], values.numel(), rows, cols)


def _corrupt(name: str, what: str) -> SparseCheckpointError:
    return SparseCheckpointError(f"{name}: {what}; the sparse checkpoint is corrupt (compress the model again)")


def _check_bitmask(name: str, bitmask: torch.Tensor, count: int, rows: int, cols: int) -> None:
    if bitmask.dtype != torch.uint8 or tuple(bitmask.shape) != (rows, math.ceil(cols / 8)):
        raise _corrupt(name, f"bitmask is {tuple(bitmask.shape)} {bitmask.dtype}, expected ({rows}, {math.ceil(cols / 8)}) uint8")
    if cols % 8 and bool((bitmask[:, -1] >> (cols % 8)).any()):
        raise _corrupt(name, "bitmask sets padding bits past the last column")
    popcount = torch.tensor([bin(byte).count("1") for byte in range(256)])
    set_bits = int((torch.bincount(bitmask.reshape(-1), minlength=256) * popcount).sum())  # a pass over the bytes, no bool mask
    if set_bits != count:
        raise _corrupt(name, f"bitmask marks {set_bits} positions but there are {count} values")


def _check_offsets(name: str, offsets: torch.Tensor, count: int, rows: int, dtype: torch.dtype = torch.int64) -> None:
    if offsets.dtype != dtype or tuple(offsets.shape) != (rows + 1,):
        raise _corrupt(name, f"row_offsets is {tuple(offsets.shape)} {offsets.dtype}, expected ({rows + 1},) "
                       f"{str(dtype).removeprefix('torch.')}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != count or bool((offsets[1:] < offsets[:-1]).any()):
        raise _corrupt(name, f"row_offsets do not rise from 0 to the {count} values")


def check_layout(name: str, layout: str, shape: tuple[int, int], parts: dict[str, torch.Tensor]) -> None:
    """SparseCheckpointError unless ``parts`` are a consistent ``layout`` (delta8 or cols16) of a ``shape`` weight: what
    SparseLinear's kernels read without checking (a row's entries within the values, each column within the input)."""
    if len({t.device for t in parts.values()}) > 1 or not all(t.is_contiguous() for t in parts.values()):
        raise _corrupt(name, "its parts are not contiguous tensors on one device")  # the kernels take raw pointers
    if layout != COLS16:
        return check(name, layout, shape, parts)
    values, cols, offsets = parts["values"], parts["cols"], parts["row_offsets"]
    if values.dim() != 1 or not values.is_floating_point() or cols.dtype != torch.int16 or cols.shape != values.shape:
        raise _corrupt(name, f"{cols.numel()} cols ({cols.dtype}) for {values.numel()} values ({values.dtype})")
    _check_offsets(name, offsets, values.numel(), shape[0], torch.int32)  # cols16's offsets: int32 (< 2^31 entries)
    if values.numel() and int((cols.to(torch.int32) & 0xFFFF).max()) >= shape[1]:
        raise _corrupt(name, f"a column past the last of a {shape[1]}-column weight")
    return None


def _check_delta8(name: str, deltas: torch.Tensor, offsets: torch.Tensor, count: int, rows: int, cols: int) -> None:
    if deltas.dtype != torch.uint8 or deltas.dim() != 1 or deltas.numel() != count:
        raise _corrupt(name, f"{deltas.numel()} deltas ({deltas.dtype}) for {count} values")
    _check_offsets(name, offsets, count, rows)
    if count:  # deltas are >= 0, so a row's last entry has its largest column: (sum of 1 + delta over the row) - 1
        run = torch.cat([offsets.new_zeros(1), torch.cumsum(deltas.to(torch.int64) + 1, 0)])
        last = int((run[offsets[1:]] - run[offsets[:-1]]).max()) - 1
        if last >= cols:
            raise _corrupt(name, f"a delta reaches column {last} of a {cols}-column weight")
