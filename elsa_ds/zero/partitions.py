"""Reading and temporarily editing the engine's own partitions: distributed validation, the magnitude baseline, the
projected model ELSA's selection scores (``--select_every``), and snapshots of the 16-bit shards."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from elsa_ds.admm.adam8bit import second_moment
from elsa_ds.admm.optimizer import AdmmOptimizer
from elsa_ds.admm.settings import Projection
from elsa_ds.admm.projection import NM, projection_masks
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.perplexity import window_nll
from elsa_ds.zero import compat
from elsa_ds.zero.dist import agreed
from elsa_ds.zero.engine import ZeroEngine
from elsa_ds.zero.layout import local_partition


@torch.no_grad()
def distributed_nll(job: ZeroEngine, windows: torch.Tensor, micro_batch: int) -> tuple[float, int]:
    """Summed next-token NLL and token count of the engine's current weights over ``windows``, split over ranks. Collective."""
    engine = job.engine
    was_training = engine.module.training
    engine.module.eval()
    nll, count = window_nll(lambda ids: engine(input_ids=ids, use_cache=False).logits, windows, micro_batch,
                            rank=job.comm.rank, world_size=job.comm.world_size, device=engine.device)
    engine.module.train(was_training)
    total = job.comm.all_reduce_sum(torch.tensor([nll, count], dtype=torch.float64))
    return float(total[0]), int(total[1])


def pruned_params(job: ZeroEngine) -> list[tuple[str, torch.nn.Parameter]]:
    by_id = {id(p): p for p in job.engine.module.parameters()}
    return [(name, by_id[pid]) for pid, name in job.pruned.items()]


@contextlib.contextmanager
def magnitude_pruned(job: ZeroEngine, pattern: NM | None = None) -> Iterator[None]:
    """Temporarily zero the 16-bit model shards by one-shot magnitude pruning. Collective.

    The per-layer threshold comes from the same exact distributed selection ELSA uses, on each rank's own
    partition; on exit the shards are restored from the fp32 masters (which were never touched).
    """
    _check_resident(job, "the magnitude baseline", "use --baseline none")
    by_name = dict(pruned_params(job))
    rank, world = job.comm.rank, job.comm.world_size
    slices = [sl for sg in job.layout for sl in sg.slices]
    parts = [local_partition(by_name[sl.layer], rank, world) for sl in slices]
    with masked_shards(job, projection_masks(parts, None, slices, job.comm, pattern)):
        yield


@contextlib.contextmanager
def hard_projected(job: ZeroEngine, admm: AdmmOptimizer) -> Iterator[None]:
    """Temporarily set the pruned layers' 16-bit shards to Π(x), the hard projection ELSA ends with: x = the fp32
    masters, scores from ``admm``'s second moment (Fisher) or magnitude, as the run's projection. Collective."""
    _check_resident(job, "scoring the projected model", "drop --select_every")
    s3, settings, masks = job.zero_optimizer, admm.settings, []
    for sg in job.layout:  # sub-group by sub-group, in the same order on every rank (the selection is collective)
        flat = compat.flat_partition(s3, sg.index)
        xs = [flat.detach().view(-1).narrow(0, sl.offset, sl.length) for sl in sg.slices]
        fisher = None
        if settings.projection is Projection.fisher:
            f = second_moment(admm.state[flat])
            if f is None:  # as AdmmOptimizer._fisher says it
                raise RuntimeError("fisher projection needs the base optimizer's second moment (exp_avg_sq); none was found")
            f = f.view(-1)
            fisher = [f.narrow(0, sl.offset, sl.length) for sl in sg.slices]
        masks += projection_masks(xs, fisher, sg.slices, job.comm, settings.pattern)
    with masked_shards(job, masks):
        yield


def _check_resident(job: ZeroEngine, what: str, fix: str) -> None:
    if any(compat.flat_partition(job.zero_optimizer, sg.index).numel() == 0 for sg in job.layout):
        raise ElsaError(f"{what} needs resident fp32 masters; it is not available with NVMe optimizer offload ({fix})")


@contextlib.contextmanager
def masked_shards(job: ZeroEngine, masks: list[torch.Tensor]) -> Iterator[None]:
    """Multiply the pruned layers' 16-bit shards by ``masks`` (one per slice of ``job.layout``, in order) for the
    duration; on exit restore them from the fp32 masters (never touched). Collective."""
    s3, rank, world = job.zero_optimizer, job.comm.rank, job.comm.world_size
    by_name = dict(pruned_params(job))
    slices = [sl for sg in job.layout for sl in sg.slices]
    with compat.editing_shards(s3):
        for sl, m in zip(slices, masks):
            v = local_partition(by_name[sl.layer], rank, world)
            v.mul_(m.to(v.dtype))
    try:
        yield
    finally:
        with compat.editing_shards(s3):
            for sg in job.layout:
                flat = compat.flat_partition(s3, sg.index)
                for sl in sg.slices:
                    local_partition(by_name[sl.layer], rank, world).copy_(flat.narrow(0, sl.offset, sl.length))


def shard_snapshot(job: ZeroEngine) -> list[torch.Tensor]:
    """A copy of this rank's 16-bit shard of every parameter of the model (engine order)."""
    return [compat.shard(p).clone() for p in job.engine.module.parameters()]


def restore_shards(job: ZeroEngine, snapshot: list[torch.Tensor]) -> None:
    """Write a :func:`shard_snapshot` back into the 16-bit shards (the fp32 masters are not touched). Collective."""
    params = list(job.engine.module.parameters())
    if len(params) != len(snapshot):
        raise ElsaError(f"shard snapshot holds {len(snapshot)} tensors, the model {len(params)}: not this run's snapshot")
    with compat.editing_shards(job.zero_optimizer):
        for p, saved in zip(params, snapshot):
            compat.shard(p).copy_(saved)


def merge_adapters_in_place(job: ZeroEngine, scale: float, keep_mask: Callable[[str], torch.Tensor | None]) -> int:
    """Merge every LoRA adapter of the engine's peft model into its base weight's 16-bit partitions and zero its B:
    W ← (W + scale·B·A) ⊙ m (``finetune.lora.merged_weight``; ``keep_mask(plain weight name)``, called on rank 0), so the
    engine computes what the export holds (the export then drops the adapters: ``lora.plain_state_dict``). After the
    last step: the fp32 masters are not touched. Returns how many were merged. Collective: one layer gathered at a time."""
    import deepspeed

    from elsa_ds.finetune.lora import ADAPTER, merged_weight, plain_weight_name

    layers = [(name, m) for name, m in job.engine.module.named_modules()
              if hasattr(m, "base_layer") and ADAPTER in getattr(m, "lora_A", {})]
    failed: Exception | None = None  # rank 0's (a mask it cannot read): it gathers on with the others, then all stop
    with agreed("merging the LoRA adapters"), torch.no_grad(), compat.editing_shards(job.zero_optimizer):
        for name, module in layers:
            w, a, b = module.base_layer.weight, module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
            with deepspeed.zero.GatheredParameters([w, a, b], modifier_rank=0):  # rank 0's copies go to every rank
                if job.comm.rank == 0 and failed is None:
                    try:
                        w.data.copy_(merged_weight(w.data, a.data, b.data, scale, keep_mask(plain_weight_name(name))))
                        b.data.zero_()
                    except Exception as err:  # noqa: BLE001 - raised below, once every rank is past the gathers
                        failed = err
        if failed is not None:
            raise failed
    return len(layers)
