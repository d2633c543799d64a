"""Two threads standing in for two ranks: layers cut between them as ZeRO-3 cuts a flattened weight, and the
collectives the projection and the adaptive λ need."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from elsa_ds.admm.projection import Slice


class ThreadComm:
    """Collectives between threads standing in for ranks (the kernels hold the GIL: they simply take turns)."""

    def __init__(self, rank: int, world: list, barrier: threading.Barrier):
        self.rank, self.world_size, self._world, self._barrier = rank, len(world), world, barrier

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._world[self.rank] = tensor.clone()
        self._barrier.wait()
        out = torch.stack(self._world)
        self._barrier.wait()
        return out

    def all_reduce_sum(self, tensor):
        return tensor.copy_(self._gather(tensor).sum(0))

    def all_reduce_max(self, tensor):
        return tensor.copy_(self._gather(tensor).amax(0))

    def all_gather(self, tensor):
        return self._gather(tensor)


def cut(whole: list[Slice], cuts: dict[str, int]) -> dict[int, list[Slice]]:
    """Each rank's slices of the single-rank layout ``whole``: layer l's entries below ``cuts[l]`` on rank 0, the rest on
    rank 1 (a cut at 0 leaves rank 0 none of it), packed in layer order into each rank's flat."""
    parts: dict[int, list[Slice]] = {0: [], 1: []}
    for rank in (0, 1):
        offset = 0
        for sl in whole:
            lo, hi = (0, cuts[sl.layer]) if rank == 0 else (cuts[sl.layer], sl.numel)
            parts[rank].append(Slice(sl.layer, offset, hi - lo, lo, sl.numel, sl.keep))
            offset += hi - lo
    return parts


def share(values: torch.Tensor, whole: list[Slice], mine: list[Slice]) -> torch.Tensor:
    """A rank's flat (its slices ``mine``) taken from a single-rank flat laid out as ``whole``."""
    return torch.cat([values.narrow(0, w.offset + s.start, s.length) for w, s in zip(whole, mine)])


def on_two_ranks(body: Callable[[int, ThreadComm], Any]) -> dict[int, Any]:
    """``body(rank, comm)`` on two threads at once; {rank: what it returned}. An error on one releases the other."""
    world: list = [None, None]
    barrier, out, errors = threading.Barrier(2), {}, []

    def main(rank: int) -> None:
        try:
            out[rank] = body(rank, ThreadComm(rank, world, barrier))
        except Exception as err:  # surfaced below; a stuck peer is released by the barrier's abort
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out
