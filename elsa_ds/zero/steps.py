"""One global batch through a DeepSpeed engine: the step every training job (ELSA, fine-tuning, benchmarks) shares."""
from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.profiler import record_function

from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import no_inode_left, swap_problems
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
    try:
        _accumulate(engine, micro_batches, loss_sum)
    except AssertionError as err:  # an audit: DeepSpeed's swapper asserts on a swap file it could not open (no inode)
        folders = compat.swap_folders(engine) if _raised_in_swapper(err) else []
        if not (problems := [*(why for f in folders if (why := no_inode_left(f))), *swap_problems(folders)]):
            raise  # another assertion of DeepSpeed's: its own words
        raise SwapWritesLost(problems) from None
    problems = swap_problems(compat.swap_folders(engine))  # NVMe offload: the step's writes done, the next step reads them
    loss_sum[2] = len(problems)
    comm.all_reduce_sum(loss_sum)  # collective: the global mean loss of this step, and the ranks' failed swap writes
    if loss_sum[2]:
        raise SwapWritesLost(problems)
    return float(loss_sum[0] / loss_sum[1])


def _raised_in_swapper(err: BaseException) -> bool:
    """Whether ``err`` was raised inside DeepSpeed's swap code (``deepspeed/runtime/swap_tensor``)."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and "swap_tensor" in Path(frames[-1].filename).parts


def _accumulate(engine, micro_batches: list[torch.Tensor], loss_sum: torch.Tensor) -> None:
    """Forward, backward and the engine's step for each micro batch; the loss and the count added to ``loss_sum``."""
    for ids in micro_batches:
        ids = ids.to(engine.device)
        with record_function("elsa_ds.forward"):  # spans elsa_ds/step_profile.py names; ~10 µs each otherwise
            logits = engine(input_ids=ids, use_cache=False).logits
        with record_function("elsa_ds.loss"):
            loss = next_token_loss(logits, ids)  # the logits' fp32 copies never whole
        del logits  # the loss keeps their gradient, not them: the backward must not hold the [tokens, vocab] logits too
        with record_function("elsa_ds.backward"):
            engine.backward(loss)
        with record_function("elsa_ds.step"):
            engine.step()
        loss_sum += torch.tensor([float(loss.detach()), 1.0, 0.0], dtype=torch.float64)


class SwapWritesLost(ElsaError):
    """DeepSpeed's writes to its NVMe swap files may have failed (a full disk, most often): the state read back is lost.
    Raised on every rank after a step; ``problems``: what this rank saw (none: another rank saw them). Raised by one rank
    alone where DeepSpeed's swapper asserted on a file it could not make (the others then end as their peer is gone)."""

    def __init__(self, problems: list[str]):
        what = "; ".join(problems[:2]) + (f" (and {len(problems) - 2} more)" if len(problems) > 2 else "") if problems \
            else "another rank's swap files (its line names them)"
        super().__init__(f"NVMe offload: {what}. DeepSpeed does not report a failed write, so what it reads back from its "
                         "swap files is lost, and the run stopped; nothing unfinished was published. Free space (or files) "
                         "there (elsa-estimate gives the NVMe bytes the run needs) or pass --nvme_path on a larger disk")
