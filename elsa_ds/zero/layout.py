"""Where each pruned weight lives inside ZeRO-3's flat fp32 partitions on this rank.

ZeRO-3 groups parameters into sub-groups; for sub-group i every rank holds one flat fp32 tensor, the
concatenation of its ``partition_numel()``-sized share of each parameter in ``fp16_groups[i]``, in that
order. Rank r's share of a parameter with n entries covers the global range [r·pn, r·pn + real) of the
flattened weight, pn = ceil(n / W), real = clamp(n − r·pn, 0, pn); the rest is padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from elsa_ds.admm.projection import Slice, keep_count
from elsa_ds.targets import LayerGoal, goal_ratio
from elsa_ds.zero import compat


@dataclass(frozen=True)
class SubGroupLayout:
    """The pruned slices of one sub-group's flat partition on this rank."""

    index: int
    slices: list[Slice]


def partition_range(numel: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(partition_numel, global start, real length) of rank ``rank``'s share of a flattened weight."""
    pn = -(-numel // world_size)
    start = rank * pn
    return pn, start, max(0, min(pn, numel - start))


def build_layout(zero_optimizer, pruned: dict[int, str], goals: dict[str, LayerGoal], rank: int, world_size: int) -> list[SubGroupLayout]:
    """Slices of every pruned parameter (``pruned``: id(param) -> name) in every sub-group that has one.

    ``goals`` gives each name's sparsity or N:M pattern. Every rank returns the same layers in the same order.
    """
    layouts = []
    for i, group in enumerate(compat.sub_group_params(zero_optimizer)):
        offset, slices = 0, []
        for p in group:
            numel = compat.full_numel(p)
            pn, start, real = partition_range(numel, rank, world_size)
            assert pn == compat.partition_numel(p), "ZeRO-3 partition size differs from ceil(numel / world)"
            assert compat.flat_position(zero_optimizer, p) == (i, offset), "ZeRO-3 flat layout differs from fp16_groups order"
            name = pruned.get(id(p))
            if name is not None:
                slices.append(Slice(name, offset, real, start, numel, keep_count(numel, goal_ratio(goals[name]))))
            offset += pn
        if slices:
            layouts.append(SubGroupLayout(i, slices))
    return layouts


def local_partition(param: torch.nn.Parameter, rank: int, world_size: int) -> torch.Tensor:
    """This rank's real (unpadded) entries of a ZeRO-3 parameter's 16-bit partition, as a view."""
    _, _, real = partition_range(compat.full_numel(param), rank, world_size)
    return compat.shard(param).narrow(0, 0, real)
