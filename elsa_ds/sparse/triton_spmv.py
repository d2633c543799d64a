"""The delta8 decode matmul on CUDA as a Triton kernel: y[n, out] = x[n, in] · Wᵀ (+ b) for 1 to 16 rows of x.

One program per output row r walks r's entries ``row_offsets[r] .. row_offsets[r+1]`` in blocks of ``BLOCK``:

    col = carry + cumsum(1 + delta) - 1        (within the block; carry = the block's last column, starting at -1)
    acc[b, :] += value · x[b, col]             (fp32, for every row b of x; x is a few KiB and stays in cache)
    y[b, r] = Σ acc[b, :] (+ bias[r])          (stored in y's dtype, x's)

so a call streams each entry once (one delta byte and one value) and needs no metadata beyond the checkpoint's own
parts: nothing is precomputed, and ``SparseLinear.weight_bytes`` is what the kernel reads of the weight.

Triton is imported when this module is, and this module only when a CUDA tensor reaches SparseLinear (or a test
imports it): without triton or a GPU :func:`unavailable` names the reason and callers take the decompress path.
``TRITON_INTERPRET=1`` in the environment before triton is imported (triton decorates its own language functions
then) runs the same kernel on CPU tensors in Triton's interpreter; tests/sparse/test_triton_spmv.py does so.
"""
from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")  # as triton reads it on import
try:
    import triton
    import triton.language as tl
except Exception as err:  # noqa: BLE001 - a broken install is as unavailable as a missing one
    triton = tl = None
    _IMPORT_ERROR: str | None = f"triton is not importable ({type(err).__name__}: {err})"
else:
    _IMPORT_ERROR = None

MAX_ROWS = 16  # rows of x one call takes (decode: batch x 1 token)


def _delta8_rows(values, deltas, row_offsets, x, bias, y, n, in_features, out_features,
                 HAS_BIAS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """One program: output row r = program_id(0) for every row of x (x [n, in] and y [n, out] contiguous)."""
    r = tl.program_id(0)
    begin = tl.load(row_offsets + r)
    end = tl.load(row_offsets + r + 1)
    b = tl.arange(0, BLOCK_B)
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK_B, BLOCK), dtype=tl.float32)
    carry = tl.full((), -1, tl.int32)
    start = begin
    while start < end:  # not range(begin, end, BLOCK): the interpreter's range() needs numpy < 2.4 for tensor bounds
        k = start + lane
        inside = k < end
        step = tl.where(inside, tl.load(deltas + k, mask=inside, other=0).to(tl.int32) + 1, 0)
        col = carry + tl.cumsum(step, 0)
        carry = carry + tl.sum(step, 0)
        value = tl.load(values + k, mask=inside, other=0.0).to(tl.float32)
        take = (b[:, None] < n) & inside[None, :]
        xs = tl.load(x + b[:, None] * in_features + col[None, :], mask=take, other=0.0).to(tl.float32)
        acc += xs * value[None, :]
        start += BLOCK
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias + r).to(tl.float32)
    tl.store(y + b * out_features + r, out.to(y.dtype.element_ty), mask=b < n)


def _delta8_groups(values, deltas, row_offsets, x, bias, y, n, in_features, out_features,
                   HAS_BIAS: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ROWS consecutive output rows, each its own chain, stepped together as a [ROWS, BLOCK] tile (more
    bytes in flight per program, ROWS times fewer programs; a short row's lanes are masked while a long one goes on)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < out_features
    begin = tl.load(row_offsets + r, mask=live, other=0)
    end = tl.load(row_offsets + r + 1, mask=live, other=0)
    b = tl.arange(0, BLOCK_B)
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros((ROWS, BLOCK_B, BLOCK), dtype=tl.float32)
    carry = tl.full((ROWS,), -1, tl.int32)
    longest = tl.max(end - begin, 0)
    start = longest * 0
    while start < longest:
        k = begin[:, None] + start + lane[None, :]
        inside = k < end[:, None]
        step = tl.where(inside, tl.load(deltas + k, mask=inside, other=0).to(tl.int32) + 1, 0)
        col = carry[:, None] + tl.cumsum(step, 1)
        carry = carry + tl.sum(step, 1)
        value = tl.load(values + k, mask=inside, other=0.0).to(tl.float32)
        take = (b[None, :, None] < n) & inside[:, None, :]
        xs = tl.load(x + b[None, :, None] * in_features + col[:, None, :], mask=take, other=0.0).to(tl.float32)
        acc += xs * value[:, None, :]
        start += BLOCK
    out = tl.sum(acc, 2)
    if HAS_BIAS:
        out += tl.load(bias + r, mask=live, other=0.0).to(tl.float32)[:, None]
    tl.store(y + b[None, :] * out_features + r[:, None], out.to(y.dtype.element_ty), mask=live[:, None] & (b[None, :] < n))


@functools.cache
def _kernel():
    """The jitted kernel (compiled, or interpreted under TRITON_INTERPRET=1)."""
    return triton.jit(_delta8_rows)


@functools.cache
def _group_kernel():
    """The row-group kernel, jitted as :func:`_kernel`."""
    return triton.jit(_delta8_groups)


def unavailable(device: torch.device | str = "cuda") -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can): no triton, or no GPU and no interpreter."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if INTERPRET:
        return None if torch.device(device).type == "cpu" else "TRITON_INTERPRET=1 runs Triton kernels on CPU tensors only"
    if torch.device(device).type != "cuda":
        return f"the Triton kernel runs on CUDA tensors, not {torch.device(device)} ones"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def block_sizes(n: int, entries_per_row: float) -> tuple[int, int]:
    """(BLOCK_B, BLOCK): the batch padded to a power of two, and entries per step keeping the tile near 2048 values."""
    block_b = max(1 << (n - 1).bit_length(), 1)
    block = max(32, min(512, 2048 // block_b, triton.next_power_of_2(max(int(entries_per_row), 1))))
    return block_b, block


def group_block(block_b: int, rows: int, entries_per_row: float) -> int:
    """Entries per row and step of the row-group kernel: the [rows, batch, block] tile kept near 4096 values."""
    return max(16, min(256, 4096 // (block_b * rows), triton.next_power_of_2(max(int(entries_per_row), 1))))


def delta8_linear(parts: dict[str, torch.Tensor], x: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None, rows_per_program: int = 1) -> torch.Tensor:
    """y = x Wᵀ (+ bias) in x's dtype, fp32 accumulation; x [n, in] with 1 <= n <= 16, on the parts' device.
    ``rows_per_program`` (a power of two): 1, one output row a program; more, the row-group kernel."""
    reason = unavailable(x.device)
    if reason is not None:
        raise RuntimeError(f"the Triton delta8 kernel is unavailable: {reason}")
    n = x.shape[0]
    if not 1 <= n <= MAX_ROWS:
        raise ValueError(f"the Triton delta8 kernel takes 1 to {MAX_ROWS} rows, got {n}")
    x = x.contiguous()
    y = torch.empty(n, out_features, dtype=x.dtype, device=x.device)
    if out_features == 0:
        return y
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    block_b, block = block_sizes(n, parts["values"].numel() / out_features)
    if rows_per_program > 1:
        block = group_block(block_b, rows_per_program, parts["values"].numel() / out_features)
        _group_kernel()[(triton.cdiv(out_features, rows_per_program),)](
            parts["values"], parts["deltas"], parts["row_offsets"], x, y if bias is None else bias, y,
            n, x.shape[1], out_features, HAS_BIAS=bias is not None, BLOCK_B=block_b, ROWS=rows_per_program, BLOCK=block,
            num_warps=4)
        return y
    _kernel()[(out_features,)](
        parts["values"], parts["deltas"], parts["row_offsets"], x, y if bias is None else bias, y,
        n, x.shape[1], out_features, HAS_BIAS=bias is not None, BLOCK_B=block_b, BLOCK=block,
        num_warps=4 if block_b * block >= 2048 else 2)
    return y
