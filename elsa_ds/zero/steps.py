"""One global batch through a DeepSpeed engine: the step every training job (ELSA, fine-tuning, benchmarks) shares."""
from __future__ import annotations

import torch

from elsa_ds.loss import next_token_loss


def train_step(engine, optimizer: torch.optim.Optimizer, comm, micro_batches: list[torch.Tensor], lr: float) -> float:
    """Set the learning rate, accumulate the micro batches, step. Returns the global mean loss. Collective.

    With AdmmOptimizer as the basic optimizer the ADMM work (penalty, projection) runs inside ``engine.step()``
    at the accumulation boundary; the caller sets the ADMM step (``begin_step``) before.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros(2, dtype=torch.float64)
    for ids in micro_batches:
        ids = ids.to(engine.device)
        loss = next_token_loss(engine(input_ids=ids, use_cache=False).logits, ids)  # the logits' fp32 copies never whole
        engine.backward(loss)
        engine.step()
        loss_sum += torch.tensor([float(loss.detach()), 1.0], dtype=torch.float64)
    comm.all_reduce_sum(loss_sum)  # collective: the global mean loss of this step
    return float(loss_sum[0] / loss_sum[1])
