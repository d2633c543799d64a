"""Π: the per-layer sparse projection, exact and distributed.

Π keeps, in every pruned layer, the ``keep`` entries with the largest score

    s_i = F_ii · v_i²        (objective-aware; F = the optimizer's second moment, Adam's exp_avg_sq)
    s_i = v_i²               (magnitude; F ≡ 1)

and zeroes the rest. Ties are broken by the lower global index within the layer, so exactly ``keep``
entries survive and every world size picks the same entries.

With an N:M pattern Π keeps, in every group of M consecutive entries of a row (the input dimension of
W [out, in], groups starting at multiples of M of the flattened index), the M − N largest scores; ties
again go to the lower index.

A layer may be cut into slices held by different ranks (ZeRO-3 partitions). The k-th largest score of
each layer is found by an exact radix select on the scores' float bits: non-negative IEEE floats order
like their bit patterns, so four passes of 8-bit histograms (all-reduced, batched over all layers of the
call) pin down the exact threshold, and one all-gather of per-rank tie counts settles the ties. No rank
sees another rank's scores; the number of collectives per call is five, whatever the number of layers.
For N:M only a group cut by a partition boundary needs other ranks: each rank shares the scores of its
entries in such groups (at most 2·(M − 1) per layer slice) in one all-gather, whatever the number of layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

_RADIX_BITS = 8
_PASSES = 32 // _RADIX_BITS
_BINS = 1 << _RADIX_BITS


class Comm(Protocol):
    """The collectives the projection needs, over the ranks that share the layers' slices."""

    rank: int
    world_size: int

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks (in place) and return it."""

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``tensor`` over ranks (in place) and return it."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack every rank's ``tensor`` along a new dim 0, in rank order: [world_size, *shape]."""


class LocalComm:
    """The single-process Comm: no other rank holds any slice."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)


class TorchDistComm:
    """Comm over a torch.distributed process group (gloo or nccl); tensors travel on ``device``."""

    def __init__(self, group=None, device: torch.device | str = "cpu"):
        import torch.distributed as dist

        self._dist, self.group, self.device = dist, group, torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, self._dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, self._dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        moved = tensor.to(self.device)
        self._dist.all_reduce(moved, op=op, group=self.group)
        tensor.copy_(moved)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self.device)
        out = [torch.empty_like(moved) for _ in range(self.world_size)]
        self._dist.all_gather(out, moved, group=self.group)
        return torch.stack(out).to(tensor.device)


@dataclass(frozen=True)
class Slice:
    """This rank's share of one pruned layer: ``length`` entries at ``offset`` in a flat tensor.

    ``start`` is the global index of the first entry in the layer's flattened weight; slices of one
    layer on increasing ranks have increasing ``start`` (ZeRO-3 partitions a flattened weight in rank
    order), which is what makes "lower global index wins" a per-rank prefix rule.
    """

    layer: str
    offset: int
    length: int
    start: int
    numel: int
    keep: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This slice's entries of ``flat`` (or of any tensor laid out like it: its gradient, a moment), as a view."""
        return flat.view(-1).narrow(0, self.offset, self.length)


@dataclass(frozen=True)
class NM:
    """N:M sparsity: at least ``n`` zeros in every group of ``m`` consecutive weights along the input dimension."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not 0 < self.n < self.m:
            raise ValueError(f"N:M needs 0 < N < M, got {self.n}:{self.m}")

    @classmethod
    def parse(cls, text: str) -> NM:
        """``"2:4"`` -> NM(2, 4); ValueError with the reason otherwise."""
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{text!r} is not of the form N:M (e.g. 2:4)")
        return cls(int(parts[0]), int(parts[1]))

    @property
    def ratio(self) -> float:
        return self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


def keep_count(numel: int, sparsity: float) -> int:
    """Entries kept so that exactly round(sparsity · numel) are zero."""
    return numel - round(sparsity * numel)


def scores(values: torch.Tensor, fisher: torch.Tensor | None) -> torch.Tensor:
    """s = F · v² (or v² when F is None) in fp32; NaN-free and non-negative by construction."""
    v = values.float()
    s = v * v
    if fisher is not None:
        s = s * fisher.float().clamp_min(0)
    # abs() turns -0.0 into +0.0: the bit-pattern order below holds for non-negative floats only
    return torch.nan_to_num(s, nan=0.0, posinf=torch.finfo(torch.float32).max).abs()


def _bits(score: torch.Tensor) -> torch.Tensor:
    """Order-preserving integer keys of non-negative fp32 scores (their bit patterns)."""
    return score.contiguous().view(torch.int32)


def select_masks(score_slices: list[torch.Tensor], slices: list[Slice], comm: Comm) -> list[torch.Tensor]:
    """Boolean keep-masks, one per slice, keeping exactly ``keep`` entries of each layer. Collective.

    ``score_slices[j]`` holds the scores of ``slices[j]`` (its ``length`` entries). Every rank must call
    with the same layers in the same order (lengths may differ, and may be zero).
    """
    n = len(slices)
    keys = [_bits(s) for s in score_slices]
    candidates = list(keys)                         # keys still sharing the threshold's leading bits
    prefix = torch.zeros(n, dtype=torch.int64)     # threshold bits found so far
    above = torch.zeros(n, dtype=torch.int64)      # global count of scores strictly above the prefix range
    need = torch.tensor([s.keep for s in slices], dtype=torch.int64)
    for p in range(_PASSES):
        shift = 32 - _RADIX_BITS * (p + 1)
        hist = torch.zeros(n, _BINS, dtype=torch.int64)
        for j, c in enumerate(candidates):
            if c.numel():
                hist[j] = torch.bincount((c >> shift) & (_BINS - 1), minlength=_BINS)
        comm.all_reduce_sum(hist)
        # count of entries in bins >= b, from the top; choose the bin holding the need-th largest
        from_top = hist.flip(1).cumsum(1).flip(1)
        for j in range(n):
            if need[j] <= 0:
                continue
            target = need[j] - above[j]
            b = int((from_top[j] >= target).nonzero().max())
            above[j] += from_top[j, b + 1] if b + 1 < _BINS else 0
            prefix[j] |= b << shift
            if p + 1 < _PASSES and candidates[j].numel():
                c = candidates[j]
                candidates[j] = c[((c >> shift) & (_BINS - 1)) == b]
    # prefix[j] is now the exact key of the keep-th largest score; resolve ties by global index
    ties_local = torch.zeros(n, dtype=torch.int64)
    for j, k in enumerate(keys):
        if need[j] > 0:
            ties_local[j] = (k == prefix[j]).sum()
    ties_all = comm.all_gather(ties_local)                       # [world, n]
    ties_before = ties_all[:comm.rank].sum(0)
    masks = []
    for j, k in enumerate(keys):
        if need[j] <= 0:
            masks.append(torch.zeros_like(k, dtype=torch.bool))
            continue
        take = int((need[j] - above[j] - ties_before[j]).clamp(0, int(ties_local[j])))
        mask = k > prefix[j]
        if take:
            tied = (k == prefix[j]).nonzero().squeeze(1)[:take]
            mask[tied] = True
        masks.append(mask)
    return masks


def _top_in_groups(score: torch.Tensor, keep: int, chunk: int = 1 << 20) -> torch.Tensor:
    """Keep-mask [groups, m] of the ``keep`` largest scores per row; ties go to the lower column.

    Sorted ``chunk`` groups at a time, so a layer slice of 10⁸ entries needs no 10⁸ int64 sort indices.
    """
    mask = torch.zeros_like(score, dtype=torch.bool)
    for first in range(0, score.shape[0], chunk):
        part = score[first:first + chunk]
        order = torch.sort(part, dim=1, descending=True, stable=True).indices[:, :keep]
        mask[first:first + chunk].scatter_(1, order, True)
    return mask


def nm_masks(score_slices: list[torch.Tensor], slices: list[Slice], pattern: NM, comm: Comm) -> list[torch.Tensor]:
    """Boolean keep-masks, one per slice, keeping the M − N largest scores of every group of M. Collective.

    Group g of a layer holds its global indices [g·M, (g+1)·M). Groups wholly inside a slice are decided
    locally; a group cut by a slice boundary is decided by every rank that holds part of it, from the
    same all-gathered (index, score) pairs, so all of them take the same decision. Every rank must call
    with the same layers in the same order.
    """
    m, keep = pattern.m, pattern.m - pattern.n
    width = 2 * (m - 1)                                   # entries of cut groups a slice can hold, at most
    shared = torch.full((len(slices), width, 2), -1.0, dtype=torch.float64)  # (global index, score); -1 = none
    masks, cut_groups = [], []
    for j, (sc, sl) in enumerate(zip(score_slices, slices)):
        mask = torch.zeros(sl.length, dtype=torch.bool)
        begin, end = sl.start, sl.start + sl.length
        whole_from, whole_to = -(-begin // m) * m, (end // m) * m   # the span of groups wholly inside
        if whole_to > whole_from:
            local = slice(whole_from - begin, whole_to - begin)
            mask[local] = _top_in_groups(sc[local].view(-1, m), keep).view(-1)
        else:
            whole_from = whole_to = end  # no whole group: every entry belongs to a cut group
        edge = [i for i in range(begin, min(whole_from, end))] + [i for i in range(max(whole_to, begin), end)]
        if edge:
            shared[j, :len(edge), 0] = torch.tensor(edge, dtype=torch.float64)
            shared[j, :len(edge), 1] = sc[torch.tensor(edge) - begin].double()
        cut_groups.append(sorted({i // m for i in edge}))
        masks.append(mask)
    if any(cut_groups) or comm.world_size > 1:
        everyone = comm.all_gather(shared)                  # [world, slices, width, 2]
        for j, (sl, groups) in enumerate(zip(slices, cut_groups)):
            pairs = everyone[:, j].reshape(-1, 2)
            for g in groups:
                members = pairs[(pairs[:, 0] >= g * m) & (pairs[:, 0] < (g + 1) * m)]
                if members.shape[0] != m:
                    raise RuntimeError(f"{sl.layer}: group {g} has {members.shape[0]} of {m} entries across ranks")
                ordered = members[members[:, 0].argsort()]   # by global index, so ties go to the lower one
                kept = _top_in_groups(ordered[:, 1].float().view(1, m), keep).view(-1)
                for (index, _), k in zip(ordered.tolist(), kept.tolist()):
                    if sl.start <= index < sl.start + sl.length:
                        masks[j][int(index) - sl.start] = k
    return masks


def projection_masks(
    values: list[torch.Tensor], fisher: list[torch.Tensor] | None, slices: list[Slice], comm: Comm,
    pattern: NM | None = None,
) -> list[torch.Tensor]:
    """The keep-masks of Π(v) for every slice: scores F·v² (v² when ``fisher`` is None), exact top-k per
    layer, or the top M − N of every group of M with an N:M ``pattern``. Collective."""
    fishers = fisher if fisher is not None else [None] * len(values)
    score_slices = [scores(v, f) for v, f in zip(values, fishers)]
    if pattern is not None:
        return nm_masks(score_slices, slices, pattern, comm)
    return select_masks(score_slices, slices, comm)
