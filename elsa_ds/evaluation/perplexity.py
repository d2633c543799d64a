"""Perplexity with the pruning papers' protocol: non-overlapping seqlen windows, exp(mean token NLL).

Windows come from ``elsa_ds.data.load_blocks`` (BOS at the start of every window when the tokenizer
has one); every token after the first of a window is predicted once.
"""
from __future__ import annotations

import math

import torch

PROTOCOL = (
    "non-overlapping windows of seqlen tokens (stride = seqlen, remainder dropped), BOS first in every window "
    "when the tokenizer has one, documents joined by EOS; ppl = exp(sum NLL / predicted tokens)"
)


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL of ids[:, 1:] under logits[:, :-1] (computed in fp32) and the number of predicted tokens."""
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    return float(nll), ids[:, 1:].numel()


@torch.no_grad()
def window_nll(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = False) -> tuple[float, int]:
    """Summed next-token NLL (fp32 logits) and number of predicted tokens over ``windows`` [n, seqlen]."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    batches = windows.split(batch_size)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="perplexity", unit="batch")
    model.eval()
    for batch in batches:
        ids = batch.to(device)
        nll, n = token_nll(model(input_ids=ids).logits, ids)
        total += nll
        count += n
    return total, count


def ppl(nll_sum: float, tokens: int) -> float:
    return math.exp(nll_sum / tokens) if tokens else float("nan")
