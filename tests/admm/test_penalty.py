"""elsa_ds/admm/penalty.py: the eager x-step's penalty for many slices at once is the slice-by-slice code's to the bit."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm import penalty


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
