"""Perplexity scoring: the summed next-token NLL of windows [n, seqlen], each token after a window's first predicted once.

What the windows hold (the published protocols: ``stream`` for SparseGPT/Wanda, ``window`` for the ELSA authors'
Gemma runs, ``prepend`` for their older Gemma code) and how the sum becomes a perplexity (and the mean per predicted
token beside it) is ``elsa_ds.data.windows``; this module only scores.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from elsa_ds.loss import ROW_ELEMENTS, loss_path, shifted_targets


def token_nll(logits: torch.Tensor, ids: torch.Tensor, row_elements: int = ROW_ELEMENTS) -> tuple[float, int]:
    """Summed NLL of ids[:, 1:] under logits[:, :-1] and the number of predicted tokens: fp32 arithmetic, as
    ``cross_entropy(logits.float(), reduction="sum")``, ``row_elements`` logits upcast at a time (Gemma's 262,144-entry
    vocabulary made the whole fp32 copy and log_softmax's output 8 GiB at 8 x 512 tokens), the chunks' sums added in fp64.
    Where the training loss runs fused (``elsa_ds.loss.loss_path``: CUDA) the rows' NLLs come from its kernel, summed in
    fp64 the same way."""
    if loss_path(logits) == "fused":
        from elsa_ds.loss_kernel import as_rows, cross_entropy_rows

        nll = cross_entropy_rows(as_rows(logits), shifted_targets(ids).reshape(-1))
        return float(nll.sum(dtype=torch.float64)), ids[:, 1:].numel()
    tokens, vocab = logits.shape[1] - 1, logits.shape[-1]
    rows = max(1, row_elements // vocab)
    total = torch.zeros((), dtype=torch.float64, device=logits.device)  # read once at the end: one device sync
    for b in range(logits.shape[0]):
        for start in range(0, tokens, rows):
            x = logits[b, start:min(start + rows, tokens)].float()
            t = ids[b, start + 1:start + 1 + x.shape[0]].long()
            total += (torch.logsumexp(x, dim=-1) - x.gather(1, t[:, None]).squeeze(1)).sum(dtype=torch.float64)
    return float(total), ids[:, 1:].numel()


@torch.no_grad()
def window_nll(forward: Callable[[torch.Tensor], torch.Tensor], windows: torch.Tensor, batch_size: int = 1, *,
               rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu", progress: bool = False) -> tuple[float, int]:
    """Summed next-token NLL (fp32 logits) and number of predicted tokens over ``windows`` [n, seqlen].

    ``forward(ids) -> logits``. With ``world_size`` > 1 rank r scores windows r, r + W, ... and every rank runs
    the same number of forwards (ZeRO-3 gathers parameters inside each forward; a rank without a window of its
    own scores the first one and discards it): the caller sums the ranks' results.
    """
    mine = windows[rank::world_size]
    rounds = -(-windows.shape[0] // (world_size * batch_size))
    total, count = 0.0, 0
    steps = range(rounds)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="perplexity", unit="batch")
    for i in steps:
        batch = mine[i * batch_size:(i + 1) * batch_size]
        ids = (batch if batch.shape[0] else windows[:1]).to(device)
        nll, n = token_nll(forward(ids), ids)
        if batch.shape[0]:
            total, count = total + nll, count + n
    return total, count


def ppl(nll_sum: float, tokens: int) -> float:
    """exp(Σ NLL / predicted tokens): the stream protocol's perplexity (``PplWindows.perplexity`` picks per protocol)."""
    return math.exp(nll_sum / tokens) if tokens else float("nan")
