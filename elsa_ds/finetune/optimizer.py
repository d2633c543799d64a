"""MaskedOptimizer: any torch optimizer with a fixed keep-mask on the pruned entries of the flat tensors it steps.

Fine-tuning a one-shot mask m (1 = kept) must leave every pruned entry exactly zero:

    ∇ ← ∇ ⊙ m        (before the base step: Adam's moments of pruned entries stay 0)
    x ← x ⊙ m        (after it: weight decay, eps or a stale moment can never bring one back)

Like AdmmOptimizer it knows ``Slice``s of flat tensors (under ZeRO-3 one rank's fp32 partition of a sub-group, on
an ordinary model a whole weight), and keeps its state in ``state[flat]`` beside the base optimizer's moments, so
whatever partitions, offloads or checkpoints those moments does the same for the mask. The mask of a flat is one
bool per entry (True outside the pruned slices), built in the first step from ``initial_mask(slice)`` (each rank
reads only its own ranges of the mask file) — created in the base optimizer's first step, so ZeRO's NVMe swapper
registers it with the moments.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from elsa_ds.admm.projection import Slice
from elsa_ds.admm.wrapper import OptimizerWrapper

KEEP = "keep_mask"


class MaskedOptimizer(OptimizerWrapper):
    """Wraps ``base``; shares its ``param_groups`` and ``state`` (ZeRO-3 edits them through the wrapper)."""

    def __init__(self, base: torch.optim.Optimizer, initial_mask: Callable[[Slice], torch.Tensor]):
        super().__init__(base)
        self.initial_mask = initial_mask
        # called with a flat's state dict right after the mask was stored (the base state exists by then)
        self.on_state_created: Callable[[dict], None] | None = None

    def keep_mask(self, flat: torch.Tensor, slices: list[Slice]) -> torch.Tensor:
        """The flat's keep-mask [numel] (True outside the pruned slices), from ``initial_mask`` per slice."""
        keep = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
        for sl in slices:
            if sl.length:
                keep.narrow(0, sl.offset, sl.length).copy_(self.initial_mask(sl).to(keep.device))
        return keep

    @torch.no_grad()
    def step(self, closure=None):
        flats = [(p, sl) for g in self.param_groups for p in g["params"] if (sl := self.slices_of(p)) is not None]
        fresh = {}
        for flat, slices in flats:
            keep = self.state[flat].get(KEEP) if flat in self.state else None
            if keep is None:
                keep = fresh[id(flat)] = self.keep_mask(flat, slices)
            if flat.grad is not None:
                flat.grad.view(-1).masked_fill_(~keep, 0.0)
        loss = self.base.step(closure) if closure is not None else self.base.step()
        for flat, _ in flats:
            st = self.state[flat]
            if id(flat) in fresh:
                st[KEEP] = fresh[id(flat)]
                if self.on_state_created is not None:
                    self.on_state_created(st)
            flat.detach().view(-1).masked_fill_(~st[KEEP], 0.0)
        return loss
