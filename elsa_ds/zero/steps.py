"""One global batch through a DeepSpeed engine: the step every training job (ELSA, fine-tuning, benchmarks) shares."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import filesystem, unwritten
from elsa_ds.loss import next_token_loss
from elsa_ds.zero import compat


def train_step(engine, optimizer: torch.optim.Optimizer, comm, micro_batches: list[torch.Tensor], lr: float) -> float:
    """Set the learning rate, accumulate the micro batches, step. Returns the global mean loss. Collective.

    With AdmmOptimizer as the basic optimizer the ADMM work (penalty, projection) runs inside ``engine.step()``
    at the accumulation boundary; the caller sets the ADMM step (``begin_step``) before.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros(3, dtype=torch.float64)
    for ids in micro_batches:
        ids = ids.to(engine.device)
        loss = next_token_loss(engine(input_ids=ids, use_cache=False).logits, ids)  # the logits' fp32 copies never whole
        engine.backward(loss)
        engine.step()
        loss_sum += torch.tensor([float(loss.detach()), 1.0, 0.0], dtype=torch.float64)
    lost = unwritten(compat.swap_folders(engine))  # NVMe offload: the step's writes are done, the next step reads them
    loss_sum[2] = len(lost)
    comm.all_reduce_sum(loss_sum)  # collective: the global mean loss of this step, and the ranks' failed swap writes
    if loss_sum[2]:
        raise SwapWritesLost(lost)
    return float(loss_sum[0] / loss_sum[1])


class SwapWritesLost(ElsaError):
    """DeepSpeed's writes to its NVMe swap files failed (a full disk, most often): the state read back is lost. Raised on
    every rank; ``lost``: this rank's files (none: another rank's)."""

    def __init__(self, lost: list[Path]):
        if lost:
            where = lost[0].parent
            try:
                free = f"{filesystem(where)} has {shutil.disk_usage(where).free:,} bytes free"
            except OSError:
                free = f"{where} cannot be measured"
            what = f"{len(lost)} swap file{'s' * (len(lost) != 1)} not fully written ({lost[0]}; {free})"
        else:
            what = "another rank's swap files not fully written (its line names them)"
        super().__init__(f"NVMe offload: {what}. DeepSpeed does not report a failed write, so the optimizer state it "
                         "reads back is lost, and the run stopped; nothing unfinished was published. Free space there "
                         "(elsa-estimate gives the NVMe bytes the run needs) or pass --nvme_path on a larger disk")
