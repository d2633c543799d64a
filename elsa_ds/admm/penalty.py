"""The x-step's penalty gradient, ∇ ← ∇ + λ (x − z + u), for many slices at once.

The eager path (GPU flats, the adaptive λ, bases the fused CPU kernels do not reproduce) added it slice by slice: three
launches a pruned layer, ~380 a step for Gemma-3 270M, each the host's time on a GPU whose step is the host's. Here the
slices of one λ go through torch's multi-tensor ops (a few launches for all of them on a GPU; on a CPU the same per-tensor
ops, so the arithmetic is the slice-by-slice code's to the bit), with at most :data:`CHUNK` entries of x − z + u alive at
once (a slice larger than that alone, as before).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from elsa_ds.admm import state as admm_state
from elsa_ds.admm.projection import Slice
from elsa_ds.torch_api import foreach_add_, foreach_sub

CHUNK = 1 << 26  # entries of x − z + u held at once (256 MB in fp32)

# (λ, the gradient's slice, x, z, u): x, z, u in fp32 (z, u dequantized), the gradient's slice a view written in place
Term = tuple[float, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def queue_penalty(queue: list[Term], flat: torch.Tensor, slices: list[Slice], zu: tuple[torch.Tensor, ...],
                  lams: list[float]) -> None:
    """``flat``'s terms (``zu``: its state's z, u and their scales; ``lams``: each slice's λ) appended to ``queue`` where x,
    z and u are fp32 (views: nothing copied while the queue waits), else added at once slice by slice (ELSA-L's z and u
    dequantized: one fp32 copy alive at a time, as before the queue)."""
    z_data, u_data, z_scales, u_scales = zu
    views = flat.dtype == z_data.dtype == u_data.dtype == torch.float32
    assert flat.grad is not None
    for j, sl in enumerate(slices):
        if sl.length == 0:
            continue
        z = admm_state.load(z_data, z_scales, j, sl.offset, sl.length)
        u = admm_state.load(u_data, u_scales, j, sl.offset, sl.length)
        term = (lams[j], sl.view(flat.grad), sl.view(flat.detach()).float(), z, u)
        if views:
            queue.append(term)
        else:
            add_penalties([term])


def add_penalties(terms: list[Term], chunk: int = CHUNK) -> None:
    """∇ ← ∇ + λ (x − z + u) for every term, computed as ``grad.add_(x - z + u, alpha=λ)`` is."""
    by_lam: dict[float, list[Term]] = {}
    for term in terms:
        by_lam.setdefault(term[0], []).append(term)
    for lam, group in by_lam.items():
        for part in _chunks(group, chunk):
            v = foreach_sub([t[2] for t in part], [t[3] for t in part])  # x − z
            foreach_add_(v, [t[4] for t in part])  # + u
            foreach_add_([t[1] for t in part], v, alpha=lam)  # ∇ += λ (x − z + u)


def _chunks(terms: list[Term], chunk: int) -> Iterator[list[Term]]:
    """Consecutive runs of ``terms`` of at most ``chunk`` entries each (a larger term alone)."""
    part: list[Term] = []
    size = 0
    for term in terms:
        n = term[2].numel()
        if part and size + n > chunk:
            yield part
            part, size = [], 0
        part.append(term)
        size += n
    if part:
        yield part
