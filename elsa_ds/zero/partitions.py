"""Reading and temporarily editing the engine's own partitions: distributed validation and the magnitude baseline."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from elsa_ds.admm.projection import NM, projection_masks
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.perplexity import window_nll
from elsa_ds.zero import compat
from elsa_ds.zero.engine import ZeroJob
from elsa_ds.zero.layout import local_partition


@torch.no_grad()
def distributed_nll(job: ZeroJob, windows: torch.Tensor, micro_batch: int) -> tuple[float, int]:
    """Summed next-token NLL and token count of the engine's current weights over ``windows``, split over ranks. Collective."""
    engine = job.engine
    was_training = engine.module.training
    engine.module.eval()
    nll, count = window_nll(lambda ids: engine(input_ids=ids).logits, windows, micro_batch,
                            rank=job.comm.rank, world_size=job.comm.world_size, device=engine.device)
    engine.module.train(was_training)
    total = job.comm.all_reduce_sum(torch.tensor([nll, count], dtype=torch.float64))
    return float(total[0]), int(total[1])


def pruned_params(job: ZeroJob) -> list[tuple[str, torch.nn.Parameter]]:
    by_id = {id(p): p for p in job.engine.module.parameters()}
    return [(name, by_id[pid]) for pid, name in job.pruned.items()]


@contextlib.contextmanager
def magnitude_pruned(job: ZeroJob, pattern: NM | None = None) -> Iterator[None]:
    """Temporarily zero the 16-bit model shards by one-shot magnitude pruning. Collective.

    The per-layer threshold comes from the same exact distributed selection ELSA uses, on each rank's own
    partition; on exit the shards are restored from the fp32 masters (which were never touched).
    """
    s3, rank, world = job.zero_optimizer, job.comm.rank, job.comm.world_size
    if any(compat.flat_partition(s3, sg.index).numel() == 0 for sg in job.layout):
        raise ElsaError("the magnitude baseline needs resident fp32 masters; it is not available with NVMe optimizer offload (use --baseline none)")
    by_name = dict(pruned_params(job))
    slices = [sl for sg in job.layout for sl in sg.slices]
    parts = [local_partition(by_name[sl.layer], rank, world) for sl in slices]
    masks = projection_masks(parts, None, slices, job.comm, pattern)
    with compat.editing_shards(s3):
        for v, m in zip(parts, masks):
            v.mul_(m.to(v.dtype))
    try:
        yield
    finally:
        with compat.editing_shards(s3):
            for sg in job.layout:
                flat = compat.flat_partition(s3, sg.index)
                for sl in sg.slices:
                    local_partition(by_name[sl.layer], rank, world).copy_(flat.narrow(0, sl.offset, sl.length))
