"""Exact-count keep-masks for one-shot pruning: per layer, per output row, or N:M.

Every mask is a keep-mask (bool, True = the weight stays) of the weight's shape [out, in]. A target is a
float sparsity s ∈ [0, 1), which prunes exactly round(s · numel) entries of each weight matrix, or an
:class:`~elsa_ds.admm.projection.NM` pattern, which prunes exactly N of every M consecutive weights of a
row. Scores are non-negative; the largest are kept, and among equal scores the lower index is kept.
"""
from __future__ import annotations

import math
from fractions import Fraction

import torch

from elsa_ds.admm.projection import NM, LocalComm, Slice, keep_count, nm_masks, select_masks

Target = float | NM


def check_target(target: Target) -> None:
    """ValueError unless ``target`` is an NM pattern or a sparsity in [0, 1)."""
    if isinstance(target, NM):
        return
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 <= target < 1.0:
        raise ValueError(f"sparsity must be a float in [0, 1) or an NM pattern, got {target!r}")


def prune_counts(sizes: list[int], sparsity: float) -> list[int]:
    """Entries to prune in each part so the parts sum to exactly round(s · Σ sizes) (as ``keep_count``).

    Cumulative rounding: part i prunes R(s · c_{i+1}) − R(s · c_i), c_i = n_0 + … + n_{i−1}, with one
    rounding R(x) = ⌊x + δ⌋ for every prefix, so each part gets ⌊s · n_i⌋ or ⌈s · n_i⌉. δ = ½ (round half
    up) unless Python's round(s · total) goes the other way (half to even, or the float product rounded
    across a half); then δ is moved so that R(s · total) = round(s · total).
    """
    check_target(sparsity)
    total = sum(sizes)
    want = total - keep_count(total, sparsity)
    exact = Fraction(float(sparsity))          # the float's exact value: the prefixes round without float error
    offset = Fraction(1, 2)
    if math.floor(exact * total + offset) != want:
        # ⌊s·total + δ⌋ = want for any δ ∈ [want − s·total, want − s·total + 1); take its middle
        offset = (1 + want - exact * total) / 2
    counts, done, seen = [], 0, 0
    for n in sizes:
        seen += n
        upto = math.floor(exact * seen + offset)
        counts.append(upto - done)
        done = upto
    return counts


def _clean(score: torch.Tensor) -> torch.Tensor:
    """fp32, NaN-free, contiguous; abs() only turns −0.0 into +0.0 (select_masks orders by float bits)."""
    s = torch.nan_to_num(score.float(), nan=0.0, posinf=torch.finfo(torch.float32).max)
    return s.abs().contiguous()


def _check_nm(shape: torch.Size, pattern: NM) -> None:
    if len(shape) != 2 or shape[1] % pattern.m:
        raise ValueError(f"N:M {pattern} needs a 2-D weight whose input dim is a multiple of {pattern.m}, got shape {tuple(shape)}")


def keep_largest(score: torch.Tensor, keep: int) -> torch.Tensor:
    """Keep-mask of the ``keep`` largest scores of the whole tensor; ties go to the lower flat index."""
    flat = _clean(score).view(-1)
    whole = Slice("layer", 0, flat.numel(), 0, flat.numel(), keep)
    return select_masks([flat], [whole], LocalComm())[0].view(score.shape)


def layer_keep_mask(score: torch.Tensor, target: Target) -> torch.Tensor:
    """Keep-mask over the whole matrix: exact top-k for a sparsity, the top M − N of each group for N:M."""
    check_target(target)
    if isinstance(target, NM):
        _check_nm(score.shape, target)
        flat = _clean(score).view(-1)
        # row-major flattening: since in % M == 0, groups of M flat entries are groups along the input dim
        whole = Slice("layer", 0, flat.numel(), 0, flat.numel(), 0)
        # nm_masks builds its masks on the CPU; the caller multiplies them into a weight on score's device
        return nm_masks([flat], [whole], target, LocalComm())[0].view(score.shape).to(score.device)
    return keep_largest(score, keep_count(score.numel(), target))


def row_keep_mask(score: torch.Tensor, target: Target) -> torch.Tensor:
    """Keep-mask compared per output row: row r prunes ``prune_counts([in] * out, s)[r]`` lowest scores.

    Rows differ by at most one pruned entry, and the matrix prunes exactly round(s · numel). N:M is
    already per row, so it is :func:`layer_keep_mask`'s.
    """
    check_target(target)
    if isinstance(target, NM):
        return layer_keep_mask(score, target)
    if score.dim() != 2:
        raise ValueError(f"per-row pruning needs a 2-D score [out, in], got shape {tuple(score.shape)}")
    rows, cols = score.shape
    pruned = torch.tensor(prune_counts([cols] * rows, target), device=score.device)
    # a stable descending sort puts equal scores in index order, so the lower column is kept
    order = torch.sort(_clean(score), dim=1, descending=True, stable=True).indices
    rank_kept = torch.arange(cols, device=score.device).unsqueeze(0) < (cols - pruned).unsqueeze(1)
    return torch.zeros_like(rank_kept).scatter_(1, order, rank_kept)


def magnitude_mask(weight: torch.Tensor, target: Target) -> torch.Tensor:
    """Magnitude pruning, per layer: keep the largest w² (ties to the lower flat index)."""
    return layer_keep_mask(weight.float() ** 2, target)
