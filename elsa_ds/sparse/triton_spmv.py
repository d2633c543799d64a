"""The delta8 decode matmul on CUDA as a Triton kernel: y[n, out] = x[n, in] · Wᵀ (+ b) for 1 to 16 rows of x.

One program per output row r walks r's entries ``row_offsets[r] .. row_offsets[r+1]`` in blocks of ``BLOCK``:

    col = carry + cumsum(1 + delta) - 1        (within the block; carry = the block's last column, starting at -1)
    acc[b, :] += value · x[b, col]             (fp32, for every row b of x; x is a few KiB and stays in cache)
    y[b, r] = Σ acc[b, :] (+ bias[r])          (stored in y's dtype, x's)

so a call streams each entry once (one delta byte and one value) and needs no metadata beyond the checkpoint's own
parts: nothing is precomputed, and ``SparseLinear.weight_bytes`` is what the kernel reads of the weight.

With ``rows_per_program`` > 1 (``ELSA_DS_TRITON_ROWS`` when the caller gives none) the row-group kernel runs instead:
one program per row of x and group of that many output rows, their chains stepped together as one [BLOCK, rows] tile
(fewer, larger programs: the H200's 1-row kernel spent ~5 µs a call on fixed costs and streamed at ~1 TB/s;
``_row_group_tiles`` says why the tile is transposed). On the cols16 layout (each column whole, built from delta8 on a
GPU at load: elsa_ds/sparse/format.py) the row-group kernel runs without the running sum, and for x of more than one
row every row of x in one program (``batch_in_program``: each entry loaded once for all of them).
Which is faster per shape is bench/sparse_decode_gpu.py's to say.

Triton is imported when this module is, and this module only when a CUDA tensor reaches SparseLinear (or a test
imports it): without triton or a GPU :func:`unavailable` names the reason and callers take the decompress path.
``TRITON_INTERPRET=1`` in the environment before triton is imported (triton decorates its own language functions
then) runs the same kernel on CPU tensors in Triton's interpreter; tests/sparse/test_triton_spmv.py does so.
"""
from __future__ import annotations

import functools
import os

import torch

from elsa_ds import triton_api
from elsa_ds.triton_api import INTERPRET, tl, triton  # noqa: F401 - tl: the kernels' annotations

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


def _row_group_tiles(values, positions, row_offsets, x, bias, y, in_features, out_features,
                     HAS_BIAS: tl.constexpr, COLS16: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: row b = program_id(0) of x against ROWS consecutive output rows (program_id(1)), each row its own
    chain, stepped together as a [BLOCK, ROWS] tile: entries along dim 0, rows along dim 1. ``positions``: delta8's
    deltas (a running sum per row, carried between steps), or with COLS16 the cols16 layout's columns (each read whole:
    no running sum, no carry, no fillers; elsa_ds/sparse/format.py). Compiled for sm_90, COLS16 issues ~16 instructions
    an entry where delta8 issues 55-80 (the scan's shuffles, its cross-warp barriers, 64-bit offsets): at 90 % on
    LLaMA-2-7B's MLP delta8's instructions alone outlast the bytes it reads (bench/kernel_code.py).

    The tile is transposed on purpose. Triton lays out a load whose addresses it cannot analyse (the gather of x at the
    decoded columns) with dim 0 fastest across a warp's lanes; with entries along dim 0 that is the layout of the
    values and positions loads too, so a warp's 32 lanes read 32 consecutive entries of one row (coalesced) and gather
    x at 32 nearby columns (a few cache lines), and nothing is shuffled between layouts inside the loop. As [ROWS, BLOCK]
    the gather took rows fastest (32 lanes, 16 rows' scattered columns) behind two layout conversions a step through
    shared memory (tests/sparse/test_triton_spmv.py reads the compiled IR for it). Each program takes one row of x:
    the programs of one row group run together (b varies fastest), so the weight comes once from memory and the
    other rows of x find it in L2."""
    b = tl.program_id(0)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    live = r < out_features
    begin = tl.load(row_offsets + r, mask=live, other=0)
    end = tl.load(row_offsets + r + 1, mask=live, other=0)
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, ROWS), dtype=tl.float32)
    carry = tl.full((ROWS,), -1, tl.int32)
    longest = tl.max(end - begin, 0)
    start = longest * 0
    xb = x + b * in_features
    while start < longest:  # a short row's lanes are masked while a long one goes on
        k = begin[None, :] + start + lane[:, None]
        inside = k < end[None, :]
        if COLS16:
            col = tl.load(positions + k, mask=inside, other=0).to(tl.int32) & 0xFFFF
        else:
            step = tl.where(inside, tl.load(positions + k, mask=inside, other=0).to(tl.int32) + 1, 0)
            col = carry[None, :] + tl.cumsum(step, 0)
            carry = carry + tl.sum(step, 0)
        value = tl.load(values + k, mask=inside, other=0.0).to(tl.float32)
        xs = tl.load(xb + col, mask=inside, other=0.0).to(tl.float32)
        acc += xs * value
        start += BLOCK
    out = tl.sum(acc, 0)
    if HAS_BIAS:
        out += tl.load(bias + r, mask=live, other=0.0).to(tl.float32)
    tl.store(y + b * out_features + r, out.to(y.dtype.element_ty), mask=live)


def _row_group_batch(values, positions, row_offsets, x, bias, y, n, in_features, out_features,
                     HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    """The cols16 row-group kernel with every row of x in one program (batch > 1): a [BLOCK, ROWS, BLOCK_B] tile, entries
    along dim 0 as in :func:`_row_group_tiles`, so each entry's column and value are loaded and converted once for all n
    rows of x, where one program per row of x pays them n times (sm_90's code, bench/kernel_code.py: ~54 instructions an
    entry for 8 rows of x against 8 x 16, 22 for 2 against 2 x 16). The batch padded to a power of two reads its last row
    again (no batch mask in the loop; those rows are not stored). ``positions``: the cols16 layout's columns."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < out_features
    begin = tl.load(row_offsets + r, mask=live, other=0)
    end = tl.load(row_offsets + r + 1, mask=live, other=0)
    lane = tl.arange(0, BLOCK)
    rows_x = tl.arange(0, BLOCK_B)
    read_x = tl.minimum(rows_x, n - 1)  # the padding rows read the last row again: no mask on the batch in the loop
    acc = tl.zeros((BLOCK, ROWS, BLOCK_B), dtype=tl.float32)
    longest = tl.max(end - begin, 0)
    start = longest * 0
    while start < longest:  # a short row's lanes are masked while a long one goes on
        k = begin[None, :] + start + lane[:, None]
        inside = k < end[None, :]
        col = tl.load(positions + k, mask=inside, other=0).to(tl.int32) & 0xFFFF
        value = tl.load(values + k, mask=inside, other=0.0).to(tl.float32)
        xs = tl.load(x + read_x[None, None, :] * in_features + col[:, :, None], mask=inside[:, :, None], other=0.0)
        xs = xs.to(tl.float32)
        acc += xs * value[:, :, None]
        start += BLOCK
    out = tl.sum(acc, 0)  # [ROWS, BLOCK_B]
    if HAS_BIAS:
        out += tl.load(bias + r, mask=live, other=0.0).to(tl.float32)[:, None]
    stored = live[:, None] & (rows_x < n)[None, :]
    tl.store(y + rows_x[None, :] * out_features + r[:, None], out.to(y.dtype.element_ty), mask=stored)


@functools.cache
def _kernel():
    """The jitted kernel (compiled, or interpreted under TRITON_INTERPRET=1)."""
    return triton.jit(_delta8_rows)


@functools.cache
def _tile_kernel():
    """The row-group kernel (either layout), jitted as :func:`_kernel`."""
    return triton.jit(_row_group_tiles)


@functools.cache
def _batch_kernel():
    """The cols16 row-group kernel with the batch in its program, jitted as :func:`_kernel`."""
    return triton.jit(_row_group_batch)


def compile_ahead(layout: str, rows: int, dtype: str, block: int, *, has_bias: bool = False, block_b: int = 1,
                  num_warps: int = 4, capability: int = 90):
    """One variant compiled by Triton for a CUDA GPU of compute ``capability`` with no GPU present (its bundled ptxas):
    the kernel :func:`delta8_linear` would launch for ``layout`` ('delta8' / 'cols16') at ``rows`` per program (cols16
    with ``block_b`` > 1: the batch held in the program, ``block_b`` rows of x), its arguments typed as the launches pass
    them (``dtype`` 'bf16', 'fp16' or 'fp32'). Returns Triton's compiled kernel (``.asm``: ttgir, ptx, cubin) for reading
    its code: bench/kernel_code.py and tests/sparse/test_triton_spmv.py."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = {"values": f"*{dtype}", "positions": "*u8", "row_offsets": "*i64", "x": f"*{dtype}", "bias": f"*{dtype}",
                "y": f"*{dtype}"}
    if layout == "delta8" and rows == 1:
        fn, consts = _kernel(), {"HAS_BIAS": has_bias, "BLOCK_B": block_b, "BLOCK": block}
        pointers["deltas"] = pointers.pop("positions")
        signature = {**pointers, "n": "i32", "in_features": "i32", "out_features": "i32"}
    elif layout == "cols16" and block_b > 1:
        fn, consts = _batch_kernel(), {"HAS_BIAS": has_bias, "ROWS": rows, "BLOCK": block, "BLOCK_B": block_b}
        pointers.update(positions="*i16", row_offsets="*i32")
        signature = {**pointers, "n": "i32", "in_features": "i32", "out_features": "i32"}
    else:
        fn, consts = _tile_kernel(), {"HAS_BIAS": has_bias, "COLS16": layout == "cols16", "ROWS": rows, "BLOCK": block}
        if layout == "cols16":
            pointers.update(positions="*i16", row_offsets="*i32")
        signature = {**pointers, "in_features": "i32", "out_features": "i32"}
    signature = {name: signature[name] for name in fn.arg_names if name in signature} | {c: "constexpr" for c in consts}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps})


def unavailable(device: torch.device | str = "cuda") -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can): no triton, or no GPU and no interpreter."""
    return triton_api.unavailable(device, "the Triton kernel")


def padded_batch(n: int) -> int:
    """BLOCK_B: ``n`` rows of x padded to a power of two (Triton's tile sizes)."""
    return max(1 << (n - 1).bit_length(), 1)


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 in plain Python: Triton's is a constexpr function whose call costs ~3 µs of Python, paid
    on every eager launch (the block sizes are worked out per call)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_sizes(n: int, entries_per_row: float) -> tuple[int, int]:
    """(BLOCK_B, BLOCK): the batch padded to a power of two, and entries per step keeping the tile near 2048 values."""
    block_b = padded_batch(n)
    block = max(32, min(512, 2048 // block_b, _next_power_of_2(max(int(entries_per_row), 1))))
    return block_b, block


def tile_block(rows: int, entries_per_row: float) -> int:
    """Entries per row and step of the row-group kernel: the [block, rows] tile kept near 4096 values."""
    return max(16, min(512, 4096 // rows, _next_power_of_2(max(int(entries_per_row), 1))))


ROWS_ENV = "ELSA_DS_TRITON_ROWS"
BATCH_TILE_ROWS = 256  # output rows x rows of x in the batch kernel's tile, at most: its 16 entries a trip then fill 4096


DEFAULT_ROWS = {"delta8": 1, "cols16": 4}  # delta8: the kernel timed on a GPU; cols16: from its compiled code, untimed


def default_rows(layout: str = "delta8") -> int:
    """rows_per_program when the caller gives none: ``ELSA_DS_TRITON_ROWS`` (read each call, so a benchmark can set it
    for a whole model), else the layout's default (cols16: 4 rows of up to 512 entries a trip, 72 registers and no
    spill at sm_90, bench/kernel_code.py: more programs resident per SM than 8 rows' 128 registers allow)."""
    return _rows(os.environ.get(ROWS_ENV, str(DEFAULT_ROWS[layout])))


@functools.lru_cache(maxsize=16)
def _rows(text: str) -> int:
    """The rows a ``ELSA_DS_TRITON_ROWS`` text names, checked (parsed once per text: this runs at every launch)."""
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if not 1 <= rows <= 64 or rows & (rows - 1):
        from elsa_ds.sparse.integrity import SparseArgumentError  # an ElsaError: one line from the command-line tools

        raise SparseArgumentError(f"{ROWS_ENV}={text!r}: expected a power of two from 1 to 64 (output rows per Triton program)")
    return rows


def delta8_linear(parts: dict[str, torch.Tensor], x: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None, rows_per_program: int | None = None,
                  num_warps: int | None = None, batch_in_program: bool | None = None) -> torch.Tensor:
    """y = x Wᵀ (+ bias) in x's dtype, fp32 accumulation; x [n, in] with 1 <= n <= 16, on the parts' device; ``parts``
    delta8 or the cols16 layout (``cols``: the row-group kernel at any rows_per_program). ``rows_per_program`` (a power of
    two; None: :func:`default_rows`): 1, one output row a program for every row of x; more, the row-group kernel, one
    row of x a program. ``batch_in_program`` (cols16 only; None: when x has more than one row and the tile stays within
    BATCH_TILE_ROWS): every row of x in one program (:func:`_row_group_batch`). ``num_warps``: Triton's, None for the default."""
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
    rows_per_program = default_rows("cols16" if "cols" in parts else "delta8") if rows_per_program is None else rows_per_program
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    entries_per_row, cols16 = parts["values"].numel() / out_features, "cols" in parts
    block_b = padded_batch(n)
    if batch_in_program is None:  # past BATCH_TILE_ROWS the tile outgrows its registers (spills at sm_90)
        batch_in_program = cols16 and n > 1 and rows_per_program * block_b <= BATCH_TILE_ROWS
    if batch_in_program and not cols16:
        raise ValueError("batch_in_program: the kernel holding the batch in its program reads the cols16 layout, not delta8")
    if batch_in_program:
        block = tile_block(rows_per_program * block_b, entries_per_row)
        _batch_kernel()[(_cdiv(out_features, rows_per_program),)](
            parts["values"], parts["cols"], parts["row_offsets"], x, y if bias is None else bias, y, n, x.shape[1],
            out_features, HAS_BIAS=bias is not None, ROWS=rows_per_program, BLOCK=block, BLOCK_B=block_b,
            num_warps=num_warps or (4 if block * rows_per_program * block_b >= 2048 else 2))
        return y
    if cols16 or rows_per_program > 1:  # the GPU layout has only the row-group kernels
        block = tile_block(rows_per_program, entries_per_row)
        _tile_kernel()[(n, _cdiv(out_features, rows_per_program))](
            parts["values"], parts["cols" if cols16 else "deltas"], parts["row_offsets"], x, y if bias is None else bias, y,
            x.shape[1], out_features, HAS_BIAS=bias is not None, COLS16=cols16, ROWS=rows_per_program, BLOCK=block,
            num_warps=num_warps or (4 if block * rows_per_program >= 2048 else 2))
        return y
    block_b, block = block_sizes(n, entries_per_row)
    _kernel()[(out_features,)](
        parts["values"], parts["deltas"], parts["row_offsets"], x, y if bias is None else bias, y,
        n, x.shape[1], out_features, HAS_BIAS=bias is not None, BLOCK_B=block_b, BLOCK=block,
        num_warps=num_warps or (4 if block_b * block >= 2048 else 2))
    return y
