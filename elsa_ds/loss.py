"""The training loss: mean next-token cross-entropy in fp32, a chunk of rows at a time (pure torch).

transformers' own loss (``model(input_ids=ids, labels=ids).loss``) upcasts the whole [tokens, vocab] logits to fp32 and
keeps log_softmax's fp32 output for the backward; in the backward the fp32 gradient and its 16-bit cast are whole too. With
Gemma's 262,144-entry vocabulary that is most of a small model's GPU memory (Gemma-3 270M at 8 x 512 tokens on an H200:
the ELSA job's peak was 22.0 GiB, ~15 of them the logits' copies; bench/results/gpu_quality_gemma3-270m.jsonl). Here the
loss and its gradient are computed together in the forward, ``ROW_ELEMENTS`` logits at a time in fp32, the gradient kept
in the logits' own dtype: the fp32 copies never exist whole, and the backward only scales the kept gradient. The value
and the gradient are transformers' (the same fp32 arithmetic, summed in another order): tests/test_loss.py holds it to them.
The gradient is kept unscaled in the logits' dtype: right for bf16 and fp32; fp16 (whose loss scale would then come
after the rounding) is refused by the DeepSpeed config checks.
"""
from __future__ import annotations

import torch

ROW_ELEMENTS = 2**26  # fp32 logits per chunk: 256 MiB (256 rows of Gemma's vocabulary)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor, row_elements: int = ROW_ELEMENTS) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [batch, seq, vocab] (any float dtype) predicting ``ids`` [batch, seq] one position
    ahead, as ``model(input_ids=ids, labels=ids).loss``: every position but each sequence's last predicts the next id."""
    if logits.dim() != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"next_token_loss: logits [batch, seq, vocab] and ids [batch, seq], got {tuple(logits.shape)} "
                         f"and {tuple(ids.shape)}")
    targets = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)  # int32 ids too
    targets[:, :-1] = ids[:, 1:]
    rows = max(1, row_elements // logits.shape[-1])
    return _ChunkedNextToken.apply(logits, targets.reshape(-1), rows)


class _ChunkedNextToken(torch.autograd.Function):
    """Forward: the summed fp32 NLL of the rows whose target is >= 0, divided by their count; the gradient of that mean
    (softmax minus the target's one-hot, over the count) written per chunk into a tensor of the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1])
        valid = targets >= 0
        count = valid.sum().clamp(min=1).to(torch.float32)
        grad = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
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
        ctx.shape = shape
        ctx.save_for_backward(grad if grad is not None else flat.new_empty(0))
        return total / count

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output.to(grad.dtype)).view(ctx.shape), None, None
