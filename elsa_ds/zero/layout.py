"""Where each pruned weight lives inside ZeRO-3's flat fp32 partitions on this rank.

ZeRO-3 groups parameters into sub-groups; for sub-group i every rank holds one flat fp32 tensor, the
concatenation of its ``partition_numel()``-sized share of each parameter in ``fp16_groups[i]``, in that
order. Rank r's share of a parameter with n entries covers the global range [r·pn, r·pn + real) of the
flattened weight, pn = ceil(n / W), real = clamp(n − r·pn, 0, pn); the rest is padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from elsa_ds.admm.projection import NM, Slice, keep_count


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


def build_layout(zero_optimizer, pruned: dict[int, str], targets: dict[str, float | NM], rank: int, world_size: int) -> list[SubGroupLayout]:
    """Slices of every pruned parameter (``pruned``: id(param) -> name) in every sub-group that has one.

    ``targets`` gives each name's sparsity or N:M pattern. Every rank returns the same layers in the same order.
    """
    layouts = []
    for i, group in enumerate(zero_optimizer.fp16_groups):
        offset, slices = 0, []
        for p in group:
            pn, start, real = partition_range(p.ds_numel, rank, world_size)
            assert pn == p.partition_numel(), "ZeRO-3 partition size differs from ceil(numel / world)"
            assert zero_optimizer.grad_position[zero_optimizer.get_param_id(p)][:2] == [i, offset]
            name = pruned.get(id(p))
            if name is not None:
                target = targets[name]
                ratio = target.ratio if isinstance(target, NM) else target
                slices.append(Slice(name, offset, real, start, p.ds_numel, keep_count(p.ds_numel, ratio)))
            offset += pn
        if slices:
            layouts.append(SubGroupLayout(i, slices))
    return layouts


def local_partition(param: torch.nn.Parameter, rank: int, world_size: int) -> torch.Tensor:
    """This rank's real (unpadded) entries of a ZeRO-3 parameter's 16-bit partition, as a view."""
    _, _, real = partition_range(param.ds_numel, rank, world_size)
    return param.ds_tensor.data.view(-1).narrow(0, 0, real)
