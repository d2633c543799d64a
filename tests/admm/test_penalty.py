"""elsa_ds/admm/penalty.py: the eager x-step's penalty for many slices at once is the slice-by-slice code's to the bit."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm import penalty
from elsa_ds.admm import state as admm_state
from elsa_ds.admm.projection import Slice
from elsa_ds.admm.state import StateDtype


@pytest.mark.parametrize("chunk", [penalty.CHUNK, 100, 1])
def test_many_slices_at_once_are_the_slice_by_slice_penalty_to_the_bit(chunk):
    """Slices of two λs (the adaptive schedule's per-layer λ), of sizes from 1 to past the chunk, views into one flat
    gradient as the optimizer's are; chunks of 100 entries and of 1 (each slice alone) change nothing."""
    g = torch.Generator().manual_seed(3)
    sizes, lams = [1, 7, 64, 250, 33], [0.05, 0.3, 0.05, 1e-3, 0.3]
    grad = torch.randn(sum(sizes), generator=g)
    xs, zs, us = ([torch.randn(n, generator=g) for n in sizes] for _ in range(3))
    expected = grad.clone()
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for lam, off, n, x, z, u in zip(lams, offsets, sizes, xs, zs, us):
        expected[off:off + n].add_(x - z + u, alpha=lam)
    terms = [(lam, grad[off:off + n], x, z, u) for lam, off, n, x, z, u in zip(lams, offsets, sizes, xs, zs, us)]
    penalty.add_penalties(terms, chunk)
    assert torch.equal(grad, expected)


def test_chunks_keep_the_order_and_never_exceed_the_bound_but_for_one_large_slice():
    terms = [(0.1, torch.empty(n), torch.empty(n), torch.empty(n), torch.empty(n)) for n in (3, 4, 10, 2, 2)]
    parts = [[t[2].numel() for t in part] for part in penalty._chunks(terms, 6)]
    assert parts == [[3], [4], [10], [2, 2]]
    assert [n for part in parts for n in part] == [3, 4, 10, 2, 2]
    penalty.add_penalties([])  # nothing to add: nothing happens


@pytest.mark.parametrize("u_dtype", [StateDtype.fp32, StateDtype.bf16])
def test_only_views_wait_in_the_queue_dequantized_states_are_added_at_once(u_dtype):
    """A review (2026-12-04): queuing ELSA-L's dequantized z and u kept a whole sub-group's fp32 copies alive at the step
    (a layer's before). fp32 x, z, u are views and wait in the queue; a bf16 u is added slice by slice at once; either
    way the gradient is the slice-by-slice penalty's to the bit."""
    g = torch.Generator().manual_seed(5)
    slices = [Slice("a", 0, 40, 0, 40, 10), Slice("b", 40, 24, 0, 24, 6)]  # (layer, offset in the flat, length, ...)
    flat = torch.randn(64, generator=g).requires_grad_()
    flat.grad = torch.randn(64, generator=g)
    z, z_scales = admm_state.allocate(64, StateDtype.fp32, 2)
    u, u_scales = admm_state.allocate(64, u_dtype, 2)
    for j, sl in enumerate(slices):
        admm_state.store(z, z_scales, j, sl.offset, torch.randn(sl.length, generator=g))
        admm_state.store(u, u_scales, j, sl.offset, torch.randn(sl.length, generator=g))
    expected = flat.grad.clone()
    for j, (sl, lam) in enumerate(zip(slices, (0.1, 0.2))):
        zj, uj = admm_state.load(z, z_scales, j, sl.offset, sl.length), admm_state.load(u, u_scales, j, sl.offset, sl.length)
        expected[sl.offset:sl.offset + sl.length].add_(flat.detach()[sl.offset:sl.offset + sl.length] - zj + uj, alpha=lam)
    queue: list = []
    penalty.queue_penalty(queue, flat, slices, (z, u, z_scales, u_scales), [0.1, 0.2])
    assert len(queue) == (2 if u_dtype is StateDtype.fp32 else 0)
    penalty.add_penalties(queue)
    assert torch.equal(flat.grad, expected)
