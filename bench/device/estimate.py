"""What a budget-curve cell (bench/device/curve.py) will take on the GPU: its seconds and its peak GPU bytes.

Seconds: the per-run overhead (launch, load, one-shot or warm start, export, evaluation) plus steps x forwards a step x
seconds a forward, all measured on finished cells of the same GPU (on the H200 a 270M step's time was the host's, not its
tokens': one forward of 8 x 512 cost ~0.6 s with 3 cells at once, 2026-11-28), else the priors below. GPU bytes: a training
cell's is elsa_ds's own estimate for its shape (``elsa_ds.capacity.memory.estimate_job``, the ELSA job's, an upper bound
for retraining's, which keeps no ADMM states) times the largest measured / estimated ratio of finished cells (each line
keeps both), else the prior ratio; the curve starts a cell only while the running cells' and its own fit in ``GPU_SHARE``
of the GPU's memory.
"""
from __future__ import annotations

from functools import lru_cache

PRIOR_FORWARD_S = 0.6  # one 8 x 512 forward + backward of Gemma-3 270M, 3 cells at once on the H200 (2026-11-28)
PRIOR_OVERHEAD_S = {"train": 150.0, "oneshot": 90.0, "eval": 60.0}
# measured peak / estimate: the H200's ELSA cell at 8 x 512 (2026-11-28) allocated 22.0 GiB where the estimate of that day
# said 17.4 (transformers' loss, then: its fp32 logits' copies were counted 10 bytes a logit); a prior until cells with
# the chunked loss (elsa_ds/loss.py) measure it
PRIOR_GPU_RATIO = 1.27
OTHER_GPU_BYTES = 12.0 * 2**30  # an evaluation or one-shot: the fp32 model, an 8 x 512 batch's fp32 logits a few times
GPU_SHARE = 0.9


def forwards(batch: int, micro_batch: int) -> int:
    """Forwards (micro-batches) a training step of ``batch`` sequences takes."""
    return -(-batch // min(batch, micro_batch))


@lru_cache(maxsize=None)
def estimated_gpu_bytes(model: str, deepspeed: str, seqlen: int, batch: int, micro_batch: int, checkpointing: bool) -> float | None:
    """elsa_ds's estimate of an ELSA job's peak GPU bytes on one GPU for this batch shape (90 %: the pruned share does not
    move the GPU's peak under ``zero3.json``, which keeps every state there); None, said once, when it cannot be made
    (then no cell waits for memory: an estimate is never worth a cell)."""
    from elsa_ds.capacity.memory import estimate_job

    settings = {"seqlen": seqlen, "batch_size": batch, "micro_batch": min(batch, micro_batch),
                "gradient_checkpointing": checkpointing, "sparsity": 0.9, "steps": 1}
    try:
        return estimate_job(model, deepspeed, 1, settings=settings).per_gpu_bytes
    except Exception as err:  # noqa: BLE001 - whatever it is, the cells run without the memory gate
        print(f"[curve] no GPU-memory estimate for {batch} x {seqlen} ({type(err).__name__}: {err}); cells start by time alone",
              flush=True)
        return None


class Estimator:
    """Seconds and GPU bytes of cells on one GPU; ``model`` None (no model to estimate from): training cells' GPU bytes
    are not predicted (0)."""

    def __init__(self, device: str, lines: list[dict], micro_batch: int = 32, checkpointing: bool = False,
                 model: str | None = None, deepspeed: str = "ds_configs/zero3.json", seqlen: int = 512):
        self.micro_batch, self.checkpointing = micro_batch, checkpointing
        self.model, self.deepspeed, self.seqlen = model, deepspeed, seqlen
        self.forward_s: dict[bool, list[float]] = {True: [], False: []}
        self.ratios: list[float] = []
        self.overhead: dict[str, list[float]] = {k: [] for k in PRIOR_OVERHEAD_S}
        for line in lines:
            if line.get("device") == device:
                self.add(line)

    def add(self, line: dict) -> None:
        if line.get("status") != "ok":  # a failed or cut cell's seconds say nothing of what a cell takes
            return
        n = line.get("forwards") or 1  # lines before 2026-11-29 had one forward a step
        if line.get("step_s"):  # by gradient checkpointing (on before 2026-11-29): it recomputes the forward
            self.forward_s[line.get("gradient_checkpointing", True)].append(line["step_s"] / n)
        if line.get("peak_gpu_bytes") and line.get("est_gpu_bytes"):
            self.ratios.append(line["peak_gpu_bytes"] / line["est_gpu_bytes"])
        if line.get("wall_s") is not None:
            self.overhead[line["kind"]].append(max(0.0, line["wall_s"] - line["steps"] * (line.get("step_s") or 0.0)))

    def seconds(self, cell, concurrency: int) -> float:
        measured = self.forward_s[self.checkpointing] or self.forward_s[not self.checkpointing]
        per_forward = max(measured) if measured else PRIOR_FORWARD_S * concurrency / 3
        overhead = max(self.overhead[cell.kind]) if self.overhead[cell.kind] else PRIOR_OVERHEAD_S[cell.kind]
        steps = cell.steps * forwards(cell.batch, self.micro_batch)
        return overhead + (steps * per_forward if cell.kind == "train" else 0.0)

    def estimate(self, cell) -> float | None:
        """elsa_ds's estimate for a training cell (None for the others, or without a model)."""
        if cell.kind != "train" or self.model is None:
            return None
        return estimated_gpu_bytes(self.model, self.deepspeed, self.seqlen, cell.batch, self.micro_batch, self.checkpointing)

    def gpu_bytes(self, cell) -> float:
        if cell.kind != "train":
            return OTHER_GPU_BYTES
        est = self.estimate(cell)
        return 0.0 if est is None else est * max(self.ratios or [PRIOR_GPU_RATIO])
