"""SparseGPT: prune column by column and let the remaining weights absorb the error (OBS).

Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot"
(IST-DASLab/sparsegpt, sparsegpt.py). With H = 2 X Xᵀ / n the layer-wise Hessian of ‖WX − ŴX‖²,
pruning weight q of a row w costs and updates

    L_q = w_q² / (2 [H⁻¹]_qq),     δ = −(w_q / [H⁻¹]_qq) · H⁻¹[:, q]

applied left to right with the upper Cholesky factor of H⁻¹ (each column's update only reaches the columns
to its right), the mask chosen per block of ``blocksize`` columns by w² / [chol(H⁻¹)]_ii².
"""
from __future__ import annotations

import math

import torch

from elsa_ds.admm.projection import NM
from elsa_ds.errors import ElsaError
from elsa_ds.oneshot.masks import Target, check_target, keep_largest, layer_keep_mask, prune_counts


class Hessian:
    """Running H = 2 / n · Σ X Xᵀ over n calibration sequences (the reference's ``add_batch``)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add_batch(self, inp: torch.Tensor) -> None:
        """Fold in a batch [batch, tokens, in] (or one sequence [tokens, in]).

        H ← H · n / (n + b);  n ← n + b;  H += (2 / n) · X Xᵀ    (X [in, tokens] of this batch, fp32)
        """
        if inp.dim() not in (2, 3) or inp.shape[-1] != self.H.shape[0]:
            raise ValueError(f"expected input [batch, tokens, {self.H.shape[0]}] or [tokens, {self.H.shape[0]}], got {tuple(inp.shape)}")
        batch = inp.shape[0] if inp.dim() == 3 else 1
        x = inp.reshape(-1, inp.shape[-1]).t().to(self.H.device, torch.float32)
        self.H *= self.nsamples / (self.nsamples + batch)
        self.nsamples += batch
        x = math.sqrt(2 / self.nsamples) * x
        self.H += x @ x.t()


def _inverse_cholesky(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹ = UᵀU, λ = percdamp · mean(diag H); dead columns get H_ii = 1."""
    H = H.float().clone()                    # never touch the caller's Hessian
    diag = torch.arange(H.shape[0], device=H.device)
    dead = H[diag, diag] == 0
    H[diag[dead], diag[dead]] = 1
    H[diag, diag] += percdamp * torch.mean(H[diag, diag])
    try:
        L = torch.linalg.cholesky(H)
    except torch.linalg.LinAlgError as err:
        raise ElsaError(f"SparseGPT: a layer's calibration Hessian ({H.shape[0]:,} inputs) is not positive definite after "
                        f"damping {percdamp} (--percdamp): fewer calibration tokens than inputs leave it singular; raise "
                        "--percdamp (0.01 is SparseGPT's) or --nsamples") from None
    del H                                    # at most two in x in copies alive beside the caller's: the down projection's
    inverse = torch.cholesky_inverse(L)      # (in = the MLP width) is the one-shot's host peak (bench/memory.py --oneshot)
    del L
    return torch.linalg.cholesky(inverse, upper=True)


def sparsify_weight(
    weight: torch.Tensor, H: torch.Tensor, target: Target, blocksize: int = 128, percdamp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """SparseGPT on one weight [out, in] with Hessian H [in, in]: (new weight in weight's dtype, keep-mask, loss).

    ``loss`` is Σ_rows Σ_pruned w_q² / (2 [U]_qq²), the reference's OBS loss estimate. Deviations from the
    reference, kept on purpose:

    1. Sparsity s: block b prunes exactly ``prune_counts([out · width_b for each block], s)[b]`` entries,
       the lowest w² / [U]_ii² of the block (ties: the higher flat index is pruned), so the layer prunes
       exactly round(s · numel). The reference prunes every score ``<= thresh``, one extra per block and
       more on ties.
    2. N:M: the N lowest scores of each group of M in a row, ties pruning the higher column (the
       reference's unstable topk).
    3. Dead columns (diag(H) = 0, an input never seen in calibration) get H_ii = 1 as in the reference but
       their weights are not zeroed: an unseen input is not known to be useless, and zeroing would break
       the exact count. Such a column is decoupled in H, so it neither gives nor receives updates.
    """
    _check_inputs(weight, H, target, blocksize)
    rows, cols = weight.shape
    W = weight.float().clone()
    Hinv = _inverse_cholesky(H.to(W.device), percdamp)
    starts = list(range(0, cols, blocksize))
    block_pruned = None if isinstance(target, NM) else prune_counts([rows * (min(i1 + blocksize, cols) - i1) for i1 in starts], target)
    pruned = torch.zeros_like(W, dtype=torch.bool)
    loss = torch.zeros(rows, device=W.device)
    for b, i1 in enumerate(starts):
        i2 = min(i1 + blocksize, cols)
        count = None if block_pruned is None else block_pruned[b]
        Q1, Err1, pruned1, block_loss = _sparsify_block(W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2], target, count)
        W[:, i1:i2] = Q1
        pruned[:, i1:i2] = pruned1
        loss += block_loss
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    # pruned entries are exact zeros whatever the rounding; a kept entry that an update drove to 0 stays kept
    W.masked_fill_(pruned, 0.0)
    return W.to(weight.dtype), ~pruned, float(loss.sum())


def _check_inputs(weight: torch.Tensor, H: torch.Tensor, target: Target, blocksize: int) -> None:
    check_target(target)
    if weight.dim() != 2 or H.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"weight {tuple(weight.shape)} needs a Hessian [{weight.shape[-1]}, {weight.shape[-1]}], got {tuple(H.shape)}")
    if isinstance(target, NM):
        if weight.shape[1] % target.m:
            raise ValueError(f"N:M {target} needs an input dim that is a multiple of {target.m}, got weight shape {tuple(weight.shape)}")
        if blocksize % target.m:
            raise ValueError(f"N:M {target} needs a blocksize that is a multiple of {target.m}, got {blocksize}")


def _sparsify_block(W1: torch.Tensor, Hinv1: torch.Tensor, target: Target, prune_count: int | None):
    """One block of columns, left to right: (pruned weights Q1, scaled errors, pruned mask, per-row OBS loss).

    ``prune_count`` entries of the block are pruned by the lowest w² / [U]_ii² (unstructured); with N:M each
    group of M columns is scored on the weights as already updated by the columns to its left, as in the reference.
    A column costs seven operations and, for a sparsity, never waits on a GPU (the reference's boolean index
    ``q[mask] = 0`` waits once a column; an N:M group's mask is still chosen on the host); the loss, (w − q)² / d² per
    entry in the reference's loop, is the scaled errors squared, summed after it.
    """
    Q1, Err1 = torch.zeros_like(W1), torch.zeros_like(W1)
    d1 = torch.diag(Hinv1)
    if isinstance(target, NM):
        pruned1 = torch.zeros_like(W1, dtype=torch.bool)
    else:
        assert prune_count is not None, "an unstructured target gives each block its count (sparsify)"
        score = W1 ** 2 / d1.unsqueeze(0) ** 2
        pruned1 = ~keep_largest(score, score.numel() - prune_count)
    for i in range(W1.shape[1]):
        w, d = W1[:, i], Hinv1[i, i]
        if isinstance(target, NM) and i % target.m == 0:
            group = W1[:, i:i + target.m] ** 2 / d1[i:i + target.m].unsqueeze(0) ** 2
            pruned1[:, i:i + target.m] = ~layer_keep_mask(group, target)
        q = w.masked_fill(pruned1[:, i], 0)
        Q1[:, i] = q
        err1 = (w - q) / d
        W1[:, i:] -= err1.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
        Err1[:, i] = err1
    return Q1, Err1, pruned1, torch.sum(Err1 ** 2, 1) / 2
