"""The next-token loss on CUDA as one Triton kernel: each row's log-sum-exp, NLL and softmax gradient in two passes.

The readable reference is ``elsa_ds.loss._ChunkedNextToken`` (torch, a chunk of rows at a time); this is the same
arithmetic per row, fused. One program per row of logits [rows, vocab] (any float dtype, rows ``row_stride`` apart):

    pass 1:  m, s = running max and Σ exp(x - m) over the row in blocks of ``BLOCK``     (fp32; online log-sum-exp)
             lse = m + log(s);  loss[row] = lse - x[target]        (0 where target < 0: a position that predicts nothing)
    pass 2:  grad[row, j] = (exp(x[j] - lse) - [j == target]) · inv_count                (0 where target < 0)
             stored in grad's dtype (the logits' dtype: the reference's rounding)

so the row is read twice and its gradient written once, in the logits' own dtype: no fp32 copy, no broadcast temporaries.
Leading -inf logits (banned ids) shift by 0 until a finite one comes, as torch's logsumexp does; a target past the
vocabulary makes its row's loss NaN (the reference's gather raises).
The reference's chunks cost ~8 passes of fp32 over every logit, several of them through torch's broadcasting
(non-vectorized) kernels: with Gemma's 262,144-entry vocabulary they were ~40 % of a Gemma-3 270M step's GPU time on an
H200 at 32 x 512 tokens (bench/results/gpu_quality_gemma3-270m.jsonl, the cells' ``profile``). ``WRITE_GRAD`` off: the
losses alone (evaluation). ``inv_count`` is a one-element fp32 tensor (1 / the rows whose target is >= 0), read on the
device: no host sync. The backward's scale of that gradient by grad_output is :func:`scale_` (16-byte loads, the scale in
fp32; reference: torch's fp32 product rounded once).

Triton is imported when this module is; ``elsa_ds.loss`` imports it only for a CUDA tensor (or a test). With
``TRITON_INTERPRET=1`` set before triton is imported the same kernel runs on CPU tensors in Triton's interpreter:
tests/test_loss_kernel.py holds it to the reference that way, and compiles it for sm_90 with Triton's own ptxas.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from elsa_ds import triton_api
from elsa_ds.triton_api import INTERPRET, tl, triton  # noqa: F401 - tl: the kernels' annotations

MAX_BLOCK = 4096  # logits a program holds per trip: 16 fp32 registers a thread at 8 warps
NUM_WARPS = 8
SCALE_BLOCK = 4096  # entries a program scales: 8 warps x 32 threads x 16


def _cross_entropy_rows(logits, row_stride, targets, inv_count, losses, grad, grad_stride, vocab,
                        WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program: row = program_id(0) of logits; see the module's docstring."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    target = tl.load(targets + row).to(tl.int32)
    ok = target >= 0
    lane = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    start = 0
    while start < vocab:  # not range(0, vocab, BLOCK): the interpreter's range() needs numpy < 2.4 for tensor bounds
        cols = start + lane
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row's leading -inf logits (banned ids): no -inf - -inf
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
        start += BLOCK
    lse = m + tl.log(s)
    known = target < vocab  # a target past the vocabulary: NaN, where the reference's gather fails
    x_t = tl.load(base + tl.minimum(tl.maximum(target, 0), vocab - 1)).to(tl.float32)
    tl.store(losses + row, tl.where(ok, tl.where(known, lse - x_t, float("nan")), 0.0))
    if WRITE_GRAD:
        scale = tl.where(ok, tl.load(inv_count), 0.0)
        out = grad + row * grad_stride
        start = 0
        while start < vocab:
            cols = start + lane
            inside = cols < vocab
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(cols == target, g - 1.0, g) * scale
            tl.store(out + cols, g.to(grad.dtype.element_ty), mask=inside)
            start += BLOCK


def _scale_in_place(grad, scale, n, BLOCK: tl.constexpr):
    """One program: BLOCK entries of grad (flat, n of them) times the fp32 scalar at ``scale``, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(grad + offs, mask=inside).to(tl.float32)
    tl.store(grad + offs, (g * tl.load(scale)).to(grad.dtype.element_ty), mask=inside)


@functools.cache
def _kernel():
    """The jitted kernel (compiled, or interpreted under TRITON_INTERPRET=1)."""
    return triton.jit(_cross_entropy_rows)


@functools.cache
def _scale_kernel():
    return triton.jit(_scale_in_place)


def scale_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad`` (contiguous, any float dtype) times the one-element tensor ``scale`` in place, in fp32, rounded once to
    grad's dtype: ``(grad.float() * scale.float()).to(grad.dtype)`` without the fp32 copy. The loss's backward: torch's
    ``grad.mul_(scale)`` broadcasts a 0-dim CUDA tensor through its non-vectorized kernel (~24 ms a 32 x 512 step of
    Gemma-3 270M on an H200, the profiles' bf16 ``elementwise_kernel<128, 4>``) and rounds the scale to grad's dtype
    first; here 16-byte loads, and a scale of 1 / 3 stays 1 / 3."""
    if not grad.is_contiguous() or scale.numel() != 1:
        raise ValueError(f"scale_: a contiguous tensor and a one-element scale, got strides {grad.stride()} and "
                         f"{tuple(scale.shape)}")
    if grad.numel():
        with torch.cuda.device(grad.device) if grad.is_cuda else contextlib.nullcontext():
            _scale_kernel()[(triton.cdiv(grad.numel(), SCALE_BLOCK),)](
                grad, scale.to(device=grad.device, dtype=torch.float32).reshape(1), grad.numel(), BLOCK=SCALE_BLOCK,
                num_warps=NUM_WARPS)
    return grad


def unavailable(device: torch.device | str = "cuda") -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can): no triton, or no GPU and no interpreter."""
    return triton_api.unavailable(device, "the Triton loss")


def block_size(vocab: int) -> int:
    """BLOCK: the vocabulary padded to a power of two, at most :data:`MAX_BLOCK`."""
    return min(MAX_BLOCK, 1 << (vocab - 1).bit_length() if vocab > 1 else 1)


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., vocab] as the [rows, vocab] the kernel reads (a view where its rows are contiguous already)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, inv_count: torch.Tensor | None = None,
                       grad: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """Per-row NLL (fp32 [rows]) of ``logits`` [rows, vocab] (last dim contiguous) against ``targets`` [rows] (int64,
    -1: no loss); with ``grad`` (shaped as logits, last dim contiguous) and ``inv_count`` also each row's gradient of
    Σ loss · inv_count written into ``grad``."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_rows: logits [rows, vocab] with contiguous rows and targets [rows], got "
                         f"{tuple(logits.shape)} (strides {logits.stride()}) and {tuple(targets.shape)}")
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if grad is not None and (grad.shape != logits.shape or grad.stride(-1) != 1 or inv_count is None):
        raise ValueError("cross_entropy_rows: grad shaped as logits (contiguous rows) and inv_count are needed together")
    if rows:  # without a gradient its pointers are the losses' (never read: WRITE_GRAD is compiled out)
        with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():  # Triton: the current device's
            _kernel()[(rows,)](logits, logits.stride(0), targets.to(torch.int64).contiguous(),
                               losses if inv_count is None else inv_count, losses, losses if grad is None else grad,
                               0 if grad is None else grad.stride(0), vocab,
                               WRITE_GRAD=grad is not None, BLOCK=block or block_size(vocab), num_warps=NUM_WARPS)
    return losses


def compile_scale_ahead(dtype: str = "bf16", capability: int = 90, aligned: bool = True):
    """:func:`scale_`'s kernel compiled for sm_``capability`` as :func:`compile_ahead` compiles the loss's (``n`` an i64:
    16,384 x 262,144 logits are more than 2^31)."""
    return _compiled(_scale_kernel(), {"grad": f"*{dtype}", "scale": "*fp32", "n": "i64"}, {"BLOCK": SCALE_BLOCK},
                     capability, aligned)


def compile_ahead(dtype: str = "bf16", write_grad: bool = True, block: int = MAX_BLOCK, capability: int = 90,
                  aligned: bool = True):
    """The kernel compiled by Triton for a CUDA GPU of compute ``capability`` with no GPU present (its bundled ptxas), its
    arguments typed as :func:`cross_entropy_rows` passes them (``dtype``: the logits' and gradient's, 'bf16', 'fp16',
    'fp32'); ``aligned``: as a launch with Gemma's vocabulary specializes it (pointers, strides and the vocabulary
    multiples of 16, which Triton's launcher detects). Returns Triton's compiled kernel (``.asm``: ttgir, ptx, cubin):
    tests/test_loss_kernel.py."""
    types = {"logits": f"*{dtype}", "row_stride": "i32", "targets": "*i64", "inv_count": "*fp32", "losses": "*fp32",
             "grad": f"*{dtype}", "grad_stride": "i32", "vocab": "i32"}
    return _compiled(_kernel(), types, {"WRITE_GRAD": write_grad, "BLOCK": block}, capability, aligned)


def _compiled(fn, types: dict[str, str], consts: dict, capability: int, aligned: bool):
    """``fn`` (a jitted kernel) compiled by Triton's own ptxas for sm_``capability``, its arguments typed by ``types``
    and ``consts``; ``aligned``: every typed argument a multiple of 16, as Triton's launcher detects it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types[name] for name in fn.arg_names if name in types} | {c: "constexpr" for c in consts}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in types} if aligned else None
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", capability, 32), options={"num_warps": NUM_WARPS})
