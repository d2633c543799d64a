"""The training loss: mean next-token cross-entropy in fp32, a chunk of rows at a time (torch), or on CUDA one kernel.

transformers' own loss (``model(input_ids=ids, labels=ids).loss``) upcasts the whole [tokens, vocab] logits to fp32 and
keeps log_softmax's fp32 output for the backward; in the backward the fp32 gradient and its 16-bit cast are whole too. With
Gemma's 262,144-entry vocabulary that is most of a small model's GPU memory (Gemma-3 270M at 8 x 512 tokens on an H200:
the ELSA job's peak was 22.0 GiB, ~15 of them the logits' copies; bench/results/gpu_quality_gemma3-270m.jsonl). Here the
loss and its gradient are computed together in the forward, ``ROW_ELEMENTS`` logits at a time in fp32, the gradient kept
in the logits' own dtype: the fp32 copies never exist whole, and the backward only scales the kept gradient. The value
and the gradient are transformers' (the same fp32 arithmetic, summed in another order): tests/test_loss.py holds it to them.
The gradient is kept unscaled in the logits' dtype: right for bf16 and fp32; fp16 (whose loss scale would then come
after the rounding) is refused by the DeepSpeed config checks.

On CUDA the same loss runs as one Triton kernel (``elsa_ds.loss_kernel``: each row read twice, its gradient written
once, no fp32 copy), once this process has seen it agree with the chunks here on small problems on that device and
dtype (:func:`fused_disagrees`); its first loss there is held to the chunks at its own shape too
(:func:`_checked_at_scale`: where they differ, that loss and every later one are the chunks'). ``ELSA_DS_LOSS``:
``auto`` (unset) as said (``ELSA_DS_KERNELS=0``: the chunks), ``chunked`` the chunks everywhere, ``fused`` the kernel
or an error (:func:`loss_choice`; jobs check it before any work).
:func:`loss_path` names the path a tensor takes ("fused" / "chunked"): the job reports (``loss_path``) and the curve's
lines record it.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from elsa_ds.admm.kernels.build import enabled as kernels_enabled
from elsa_ds.errors import ElsaError
from elsa_ds.log import get_logger

ROW_ELEMENTS = 2**26  # fp32 logits per chunk: 256 MiB (256 rows of Gemma's vocabulary)
LOSS_ENV = "ELSA_DS_LOSS"  # "chunked": torch's chunks on every device; unset or "auto": the Triton kernel on CUDA
LOSS_CHOICES = ("auto", "chunked", "fused")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TAKEN: set[str] = set()  # the paths next_token_loss took in this process (taken())
log = get_logger(__name__)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor, row_elements: int = ROW_ELEMENTS) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [batch, seq, vocab] (any float dtype) predicting ``ids`` [batch, seq] one position
    ahead, as ``model(input_ids=ids, labels=ids).loss``: every position but each sequence's last predicts the next id."""
    if logits.dim() != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"next_token_loss: logits [batch, seq, vocab] and ids [batch, seq], got {tuple(logits.shape)} "
                         f"and {tuple(ids.shape)}")
    targets = shifted_targets(ids).reshape(-1)
    path = loss_path(logits)
    _TAKEN.add(path)
    if path == "fused":
        return _FusedNextToken.apply(logits, targets)
    return _ChunkedNextToken.apply(logits, targets, max(1, row_elements // logits.shape[-1]))


def taken() -> str | None:
    """The paths this process's training losses took, "+"-joined ("fused", "chunked", "chunked+fused"); None before the
    first: the job reports' ``loss_path``."""
    return "+".join(sorted(_TAKEN)) or None


def shifted_targets(ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] int64: each position's next id, -1 at each sequence's last position (it predicts nothing)."""
    targets = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)  # int32 ids too
    targets[:, :-1] = ids[:, 1:]
    return targets


def loss_choice() -> str:
    """``ELSA_DS_LOSS`` read and checked: "auto" (unset), "chunked" or "fused"; ElsaError for any other value."""
    choice = os.environ.get(LOSS_ENV, "auto").strip().lower() or "auto"
    if choice not in LOSS_CHOICES:
        raise ElsaError(f"{LOSS_ENV}={choice!r}: expected one of {', '.join(LOSS_CHOICES)} (unset: auto, the Triton kernel "
                        "on CUDA where it agrees with torch's chunks)")
    return choice


def loss_path(logits: torch.Tensor) -> str:
    """"fused" where the Triton kernel computes the loss of ``logits`` (CUDA, fp32/bf16/fp16, triton importable,
    ``ELSA_DS_LOSS`` not "chunked", and the kernel agreed with the chunks in this process), else "chunked";
    ``ELSA_DS_LOSS=fused`` where it cannot: ElsaError naming why."""
    choice = loss_choice()
    if choice == "chunked" or choice == "auto" and not kernels_enabled():
        return "chunked"  # ELSA_DS_KERNELS=0: every fast path off
    why = (f"logits on {logits.device}, not a CUDA device" if logits.device.type != "cuda" else
           f"{str(logits.dtype).split('.')[-1]} logits" if logits.dtype not in FUSED_DTYPES else
           fused_disagrees(str(logits.device), logits.dtype) or _AT_SCALE.get((str(logits.device), logits.dtype)))
    if why is not None and choice == "fused":
        raise _fused_refused(why)
    return "chunked" if why else "fused"


def check_loss_choice(device: str) -> None:
    """``ELSA_DS_LOSS`` checked before a job's work on ``device`` ("cuda" / "cpu"): a value that is not a choice, or
    "fused" where the Triton loss cannot run, is an ElsaError (triton is imported only then)."""
    if loss_choice() == "fused":
        from elsa_ds import loss_kernel

        if why := loss_kernel.unavailable(device):
            raise _fused_refused(why)


def _fused_refused(why: str) -> ElsaError:
    return ElsaError(f"{LOSS_ENV}=fused, but the Triton loss cannot run here: {why}; unset {LOSS_ENV} (the chunks then run "
                     "where the kernel cannot)")


@functools.cache
def fused_disagrees(device: str, dtype: torch.dtype) -> str | None:
    """Why the Triton loss is not used on ``device`` for ``dtype`` logits (None: it is): triton unavailable, or its value
    or gradient on small problems (a vocabulary of 3 blocks and a tail, one a multiple of 16 as Gemma's, whose launch
    Triton compiles with 16-byte loads, and one not; a position that predicts nothing, targets at both ends) not the
    chunks', each entry of the gradient in fp32 logits to within the summation order and a GPU's approximate exp, in
    ``dtype`` ones to within one rounding more, every row's gradient summing to ~0. Checked once per process, device and
    dtype (a CUDA error is raised, never taken for a disagreement); a refusal is logged once."""
    from elsa_ds import loss_kernel

    reason = loss_kernel.unavailable(device)
    try:
        for checked in dict.fromkeys((torch.float32, dtype)):
            for vocab in (loss_kernel.MAX_BLOCK * 3 + 16, loss_kernel.MAX_BLOCK * 3 + 5):
                reason = reason or _compare_paths(device, checked, vocab)
    except Exception as err:  # noqa: BLE001 - a kernel that does not build or launch here: the chunks instead
        if "CUDA" in str(err) and "triton" not in type(err).__module__:  # a sticky device error: the context is gone
            raise
        reason = f"the Triton loss failed on {device} ({type(err).__name__}: {err})"
    if reason is not None:
        log.warning("the next-token loss runs as torch chunks on %s (%s): correct, slower", device, reason)
    return reason


def _compare_paths(device: str, dtype: torch.dtype, vocab: int) -> str | None:
    with torch.inference_mode(False), torch.enable_grad():  # an evaluation's inference mode would refuse the backward
        gen = torch.Generator().manual_seed(vocab)
        logits = torch.randn(2, 5, vocab, generator=gen).to(dtype)
        ids = torch.randint(0, vocab, (2, 5), generator=gen)
        ids[0, 1], ids[1, 2] = 0, vocab - 1
        logits, ids = logits.to(device), ids.to(device)
        targets = shifted_targets(ids).reshape(-1)
        results = []
        for fn, extra in ((_ChunkedNextToken, (3,)), (_FusedNextToken, (False,))):  # False: not the at-scale check
            x = logits.clone().requires_grad_()
            value = fn.apply(x, targets, *extra)
            (grad,) = torch.autograd.grad(0.5 * value, x)
            results.append((float(value.detach()), grad.float()))
    (ref, ref_grad), (got, got_grad) = results
    worst, row_sum = _grad_off(got_grad, ref_grad, dtype)
    if abs(got - ref) > 1e-5 * abs(ref) or not worst <= 1e-7 or (dtype == torch.float32 and not row_sum <= 1e-4):
        return (f"its loss {got!r} against the chunks' {ref!r}, a gradient entry {worst:.3g} of the largest past its "
                f"tolerance, rows summing to {row_sum:.3g} of it, at {vocab} logits in {str(dtype).split('.')[-1]}")
    return None


def _grad_off(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """How far a gradient ``got`` (fp32 view) is from the chunks' ``ref``: the worst entry past its tolerance and the
    largest row sum, each over ref's largest entry. fp32: the summation order and a GPU's approximate exp (~1e-6);
    16-bit: one ulp (a rounding of nearly equal fp32), a subnormal's included."""
    info = torch.finfo(dtype)
    rtol, atol = (1e-5, 0.0) if dtype == torch.float32 else (info.eps, info.smallest_normal * info.eps)
    err = (got - ref).abs() - rtol * ref.abs() - atol
    scale = float(ref.abs().max()) or 1.0
    return float(err.max()) / scale, float(got.sum(-1).abs().max()) / scale  # softmax - one-hot sums to 0


_AT_SCALE: dict[tuple[str, torch.dtype], str | None] = {}  # the first fused loss a device and dtype took, checked: why not


def _checked_at_scale(flat: torch.Tensor, targets: torch.Tensor, count: torch.Tensor, value: torch.Tensor,
                      grad: torch.Tensor | None) -> str | None:
    """The first fused loss with a gradient of this process on a device and dtype held to the chunks at its own shape
    (the small problems of :func:`fused_disagrees` cannot show an offset that overflows or a grid that is cut at 16,384 x
    262,144): the value to 1e-4 (fp32 sums of other orders), the gradient of its first, middle, last predicting and last
    rows as that check holds it. Why it disagrees (then logged, and the chunks run from now on: :func:`loss_path`), or
    None. A call without a gradient, or whose chunks' loss is not finite (the logits' fault, not the kernel's), is checked
    but leaves the check to the next. Once: a logsumexp pass in fp32 chunks, and the gather."""
    key = (str(flat.device), flat.dtype)
    if key in _AT_SCALE or not len(flat) or int(targets.max()) >= flat.shape[-1]:  # a target past the vocabulary: NaN
        return None
    rows = max(1, ROW_ELEMENTS // flat.shape[-1])
    ref, got = float(_chunks(flat, targets, rows, count, None)), float(value)
    if not math.isfinite(ref):
        return None
    why = None if abs(got - ref) <= 1e-4 * abs(ref) else f"its loss {got!r} against the chunks' {ref!r}"
    if why is None and grad is not None:
        picked = torch.tensor(sorted({0, len(flat) // 2, _last_predicting(targets), len(flat) - 1}), device=flat.device)
        ref_grad = flat.new_empty((len(picked), flat.shape[-1]))
        _chunks(flat[picked], targets[picked], rows, count, ref_grad)
        worst, row_sum = _grad_off(grad[picked].float(), ref_grad.float(), flat.dtype)
        if not worst <= 1e-7 or flat.dtype == torch.float32 and not row_sum <= 1e-4:
            why = f"rows {picked.tolist()}' gradient {worst:.3g} of its largest entry past its tolerance"
    if why is None and grad is None:
        return None
    if why is not None:
        why += f" at {tuple(flat.shape)} in {str(flat.dtype).split('.')[-1]}, the first fused loss of this process"
        log.warning("the next-token loss runs as torch chunks on %s from now on (%s): correct, slower", key[0], why)
    _AT_SCALE[key] = why
    return why


def _last_predicting(targets: torch.Tensor) -> int:
    """The last row whose target is >= 0 (0 where none is): the highest address whose gradient is not all zero."""
    valid = (targets >= 0).nonzero()
    return int(valid.max()) if len(valid) else 0


def _chunks(flat: torch.Tensor, targets: torch.Tensor, rows: int, count: torch.Tensor, grad: torch.Tensor | None,
            ) -> torch.Tensor:
    """The reference: the summed fp32 NLL of ``flat``'s rows whose target is >= 0 over ``count``, ``rows`` rows a chunk;
    with ``grad`` (flat's shape and dtype) the gradient of that mean (softmax minus the target's one-hot, over the count)
    written into it chunk by chunk."""
    valid = targets >= 0
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        x = flat[start:start + rows].to(torch.float32, copy=True)  # its own: softmax and gradient in place
        ok, t = valid[start:start + rows], targets[start:start + rows].clamp(min=0)
        lse = torch.logsumexp(x, dim=-1)
        total += ((lse - x.gather(1, t[:, None]).squeeze(1)) * ok).sum()
        if grad is not None:
            x.sub_(lse[:, None]).exp_()  # softmax, in place
            x[torch.arange(len(t), device=x.device), t] -= ok.to(x.dtype)
            x.mul_((ok.to(x.dtype) / count)[:, None])
            grad[start:start + rows] = x
    return total / count


class _ChunkedNextToken(torch.autograd.Function):
    """Forward: the summed fp32 NLL of the rows whose target is >= 0, divided by their count; the gradient of that mean
    (softmax minus the target's one-hot, over the count) written per chunk into a tensor of the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1])
        count = (targets >= 0).sum().clamp(min=1).to(torch.float32)
        grad = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        value = _chunks(flat, targets, rows, count, grad)
        ctx.shape = shape
        ctx.save_for_backward(grad if grad is not None else flat.new_empty(0))
        return value

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = _spent(ctx)
        return grad.mul_(grad_output.to(grad.dtype)).view(ctx.shape), None, None


def _spent(ctx) -> torch.Tensor:
    """The saved gradient, which the backward scales in place and hands on: a second backward of one graph
    (``retain_graph=True``) would scale it, and the first one's result, again, so it is refused."""
    if getattr(ctx, "spent", False):
        raise ElsaError("a second backward through one next-token loss (retain_graph=True): its gradient was scaled in "
                        "place by the first; compute the loss again for each backward")
    ctx.spent = True
    (grad,) = ctx.saved_tensors
    return grad


class _FusedNextToken(torch.autograd.Function):
    """:class:`_ChunkedNextToken` as one Triton kernel launch (elsa_ds/loss_kernel.py): the same mean and gradient; the
    first of a process on a device and dtype held to the chunks at its shape (:func:`_checked_at_scale`), whose result
    stands where they disagree."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, at_scale: bool = True) -> torch.Tensor:
        from elsa_ds.loss_kernel import as_rows, cross_entropy_rows

        shape = logits.shape
        flat = as_rows(logits)
        count = (targets >= 0).sum().clamp(min=1).to(torch.float32)
        grad = torch.empty_like(flat, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        value = cross_entropy_rows(flat, targets, (1.0 / count).reshape(1), grad).sum() / count
        ctx.check_rows = None  # the backward's scale held to torch on these rows (the first real backward here)
        if at_scale and (why := _checked_at_scale(flat, targets, count, value, grad)) is not None:
            if loss_choice() == "fused":
                raise _fused_refused(why)
            _TAKEN.discard("fused")  # a process trains one dtype on one device: its losses were the chunks'
            _TAKEN.add("chunked")
            value = _chunks(flat, targets, max(1, ROW_ELEMENTS // shape[-1]), count, grad)
            ctx.chunks = True  # its backward the chunks' too
        elif at_scale and grad is not None and (str(flat.device), flat.dtype) not in _SCALE_CHECKED:
            ctx.check_rows = sorted({0, _last_predicting(targets)})  # the last: past 2^31 entries at 16,384 x 262,144
        ctx.shape = shape
        ctx.save_for_backward(grad if grad is not None else flat.new_empty(0))
        return value

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if getattr(ctx, "chunks", False):
            return _ChunkedNextToken.backward(ctx, grad_output)
        grad = _spent(ctx)  # times grad_output in fp32 (the chunks' mul_ rounds it to grad's dtype first)
        return _scaled(grad, grad_output, ctx.check_rows).view(ctx.shape), None, None


_SCALE_CHECKED: set[tuple[str, torch.dtype]] = set()


def _scaled(grad: torch.Tensor, grad_output: torch.Tensor, check_rows: list[int] | None) -> torch.Tensor:
    """``grad`` times ``grad_output`` in place by the Triton kernel; with ``check_rows`` (the first real backward of this
    process on a device and dtype: its first and last predicting rows) those rows held to torch's arithmetic on a copy,
    to one rounding (Triton's interpreter truncates to bf16 where a GPU rounds to nearest): a kernel that scaled them
    otherwise is an ElsaError (the gradient is gone by then; the chunks are a rerun away: ELSA_DS_LOSS=chunked)."""
    from elsa_ds.loss_kernel import scale_

    ends = grad[check_rows].clone() if check_rows else None
    scale_(grad, grad_output)
    if ends is not None:
        _SCALE_CHECKED.add((str(grad.device), grad.dtype))
        got, want = grad[check_rows].float(), (ends.float() * grad_output.float()).to(grad.dtype).float()
        info = torch.finfo(grad.dtype)
        if not bool(((got - want).abs() <= info.eps * want.abs() + info.smallest_normal * info.eps).all()):
            raise ElsaError(f"the Triton loss's gradient scale gave {got.abs().max().item():.6g} where torch gives "
                            f"{want.abs().max().item():.6g} on {grad.device} in {str(grad.dtype).split('.')[-1]} (rows "
                            f"{check_rows}): run with {LOSS_ENV}=chunked")
    return grad
