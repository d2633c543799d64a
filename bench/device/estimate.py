"""What a budget-curve cell (bench/device/curve.py) will take on the GPU: its seconds and its peak GPU bytes.

Seconds: the per-run overhead (launch, load, one-shot or warm start, export, evaluation) plus steps x forwards a step x
seconds a forward, all measured on finished cells of the same GPU (on the H200 a 270M step's time was the host's, not its
tokens': one forward of 8 x 512 cost ~0.6 s with 3 cells at once, 2026-11-28), else the priors below. A forward's seconds
come from cells that stepped as the next ones will (:func:`regime`: gradient checkpointing, ``--leaf_layers``, torch's
F.linear: each changes the host's time a step), of the same method where measured, from the others only until one such
cell has ended (their slowest then: a cell cut at the deadline costs its whole time); of those, the forwards of the
cell's own tokens where measured, else the smaller ones plus their extra FLOPs at the GPU's typical rate, once for every
cell sharing the GPU, else the larger ones as measured (an upper bound). A cell that recorded the mean number of cells
on the GPU beside it (``sharing``, from 2026-12-04) is paced for the cells that will share the GPU with the next one:
the GPU time-slices their processes, so their steps' seconds add up (bench/device/curve.py's ``Shares``). The overhead
(launch, load, one-shot start, export, evaluation: whatever the step's regime) is the largest measured for the same
method, settings and start (an ELSA cell's SparseGPT start is in it or not: the rule's start depends on the steps,
:func:`starts_pruned`), else for the same method and start, else for any cell of its kind; a cell cut at a deadline
takes at least what it had taken (its line's wall_s). GPU bytes: a training cell's is elsa_ds's own estimate for its shape
(``elsa_ds.capacity.memory.estimate_job``, the ELSA job's, an upper bound for retraining's, which keeps no ADMM states)
times the largest measured / estimated ratio of finished cells (each line keeps both; an ELSA cell's from ELSA cells,
the prior among the others' until one is measured), else the prior ratio; the curve starts a cell only while the running
cells' and its own fit in ``GPU_SHARE`` of the GPU's memory.
"""
from __future__ import annotations

import os
from functools import lru_cache

Regime = tuple[bool, bool, bool, str, str]  # (gradient checkpointing, --leaf_layers, torch's F.linear, loop, loss): regime()
COMPILED = "+compiled"  # a loop's name with its model through torch.compile (bench/plain_cell.py --compile inductor)
FUSED, CHUNKED = "fused", "chunked"  # the training loss's paths (elsa_ds/loss.py): the Triton kernel, torch's chunks

PRIOR_FORWARD_S = 0.6  # one 8 x 512 forward + backward of Gemma-3 270M, 3 cells at once on the H200 (2026-11-28)
PRIOR_OVERHEAD_S = {"train": 150.0, "oneshot": 90.0, "eval": 60.0}
# a forward of one method priced from another's of the same regime: ELSA's step took 0.630 s where retraining's took
# 0.597-0.598 beside it (the H200, 2026-11-28: 5 %), twice that
OTHER_METHOD = 1.1
# measured peak / estimate: the H200's ELSA cell at 8 x 512 (2026-11-28) allocated 22.0 GiB where the estimate of that day
# said 17.4 (transformers' loss, then: its fp32 logits' copies were counted 10 bytes a logit); a prior until cells with
# the chunked loss (elsa_ds/loss.py) measure it
PRIOR_GPU_RATIO = 1.27
OTHER_GPU_BYTES = 12.0 * 2**30  # an evaluation or one-shot: the fp32 model, an 8 x 512 batch's fp32 logits a few times
GPU_SHARE = 0.9
# the settings under which an ELSA cell starts where the rule starts it (curve.py's SETTINGS: the others set the start)
RULE_START = ("rule", "held", "half_lmda", "retrain_lr", "seed1")


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


def regime(line: dict) -> Regime:
    """How a finished cell stepped: (gradient checkpointing, --leaf_layers, torch's F.linear, its loop: deepspeed or
    plain, ``plain+compiled`` for a compiled model, its loss: fused, chunked or transformers'); lines before each key was
    recorded ran the other way (checkpointing on before 2026-11-29, and transformers' loss; hooks on every module and
    DeepSpeed's linear before 2026-12-01; the engine's loop before 2026-12-03; no compiled cell before 2026-12-04; the
    chunked loss before 2026-12-05)."""
    return (bool(line.get("gradient_checkpointing", True)), bool(line.get("leaf_layers", False)),
            line.get("memory_efficient_linear", True) is False, loop_of(line.get("engine", "deepspeed"), line.get("compiled")),
            line.get("loss") or "transformers")


def loss_of(cell) -> str:
    """The loss a training cell takes on a GPU (curve.py sets ``ELSA_DS_LOSS`` so): the Triton kernel (elsa_ds/loss.py)
    unless ``ELSA_DS_LOSS=chunked`` is set for the whole run (as the runner sets it once a cell has failed on the kernel:
    curve.py's ``loss_failed``). Eager cells before 2026-12-05 stepped with the chunks: the kernel's gradient is theirs to
    within one rounding of bf16 (grad_output 1, every cell's; the chunks round another to bf16 first), a smaller
    difference than two loops' (the engine's and the plain loop's retraining cells agreed within 0.04 % on the H200), so
    the eager cells' ratios stand across the change; the line's ``loss`` says which ran (a kernel that fails its checks
    on the GPU runs as chunks)."""
    from elsa_ds.loss import LOSS_ENV

    return CHUNKED if os.environ.get(LOSS_ENV, "").strip().lower() == CHUNKED else FUSED


def loop_of(engine: str, compiled: bool | None) -> str:
    """A cell's loop as the estimates tell them apart: its engine, with :data:`COMPILED` for a compiled model."""
    return engine + COMPILED if compiled else engine


def starts_pruned(method: str, settings: str, sparsity: float | None, steps: int) -> bool | None:
    """Whether an ELSA cell starts from SparseGPT's model (its overhead then holds the one-shot): the rule's choice for the
    settings that keep its start (:data:`RULE_START`: a short budget up to 90 %), never for the others; None for other
    methods (a retraining cell's one-shot is always in it)."""
    from elsa_ds.settings.defaults import rule_warm_start

    if method != "elsa":
        return None
    return settings in RULE_START and rule_warm_start(sparsity or 0.0, steps)


def line_start(line: dict) -> bool | None:
    """:func:`starts_pruned` of a finished cell: what its report says it started from, else what the rule gave it."""
    used = line.get("settings_used") or {}
    if line.get("method") == "elsa" and "init_mask" in used:
        return used["init_mask"] not in (None, "none")
    return starts_pruned(line.get("method", ""), line.get("settings", "rule"), line.get("sparsity"), line.get("steps", 0))


@lru_cache(maxsize=None)
def gpu_seconds_per_token(model: str, seqlen: int, checkpointing: bool) -> float | None:
    """A training token's seconds of GPU compute at the lent GPU's typical matmul rate (None without the model's config)."""
    from elsa_ds.capacity.shapes import model_shape, resolve_model_config
    from elsa_ds.capacity.step_time import TYPICAL, train_flops_per_token

    try:
        shape = model_shape(resolve_model_config(model))
    except Exception:  # noqa: BLE001 - no shape: a larger forward is priced as the measured one
        return None
    return train_flops_per_token(shape, seqlen, checkpointing) / TYPICAL["gpu-vm-16c"].matmul_flops


class Estimator:
    """Seconds and GPU bytes of cells on one GPU; ``model`` None (no model to estimate from): training cells' GPU bytes
    are not predicted (0). ``leaf_layers`` and ``torch_linear``: how the next training cells step (the curve sets them
    again when a fallback drops them)."""

    def __init__(self, device: str, lines: list[dict], micro_batch: int = 32, checkpointing: bool = False,
                 model: str | None = None, deepspeed: str = "ds_configs/zero3.json", seqlen: int = 512,
                 leaf_layers: bool = False, torch_linear: bool = False, engine: str = "deepspeed"):
        self.micro_batch, self.checkpointing = micro_batch, checkpointing
        self.model, self.deepspeed, self.seqlen = model, deepspeed, seqlen
        self.leaf_layers, self.torch_linear, self.engine = leaf_layers, torch_linear, engine
        # (regime, (method, tokens a forward, seconds, the cells sharing the GPU on average: None where not recorded, the
        # host's seconds in operators a forward, profiled: a floor no sharing lowers, 0 where not profiled))
        self.forward_s: list[tuple[Regime, tuple[str, int, float, float | None, float]]] = []
        self.ratios: list[tuple[str, float]] = []  # (method, measured peak / estimate)
        self.cut_s: dict[str, float] = {}  # a cell cut at a deadline: what it had taken, less than it needs
        # seconds of a cell beyond its steps (launch, load, one-shot, export, evaluation: not the step's regime), by kind
        # and by (method, settings, start: :func:`line_start`)
        self.overhead: dict[str, list[float]] = {k: [] for k in PRIOR_OVERHEAD_S}
        self.overhead_of: dict[tuple[str, str, bool | None, str], list[float]] = {}
        for line in lines:
            if line.get("device") == device:
                self.add(line)

    def add(self, line: dict) -> None:
        if line.get("status") == "cut" and line.get("wall_s"):  # a lower bound for that cell (its steps in the same regime
            self.cut_s[line["key"]] = max(self.cut_s.get(line["key"], 0.0), line["wall_s"])  # or not: a bound either way)
        if line.get("status") != "ok":  # a failed or cut cell's seconds say nothing of what other cells take
            return
        n = line.get("forwards") or 1  # lines before 2026-11-29 had one forward a step
        if line.get("step_s"):
            tokens = -(-line.get("batch", 8) // n) * line.get("seqlen", self.seqlen)
            torch_profile = (line.get("profile") or {}).get("torch") or {}  # the host's own time: less its waits for room in
            # the GPU's queue ("Command Buffer Full": the GPU's pace, 0.55 of 0.83 s a step beside three 32 x 512 cells)
            host = (torch_profile.get("host_ops_s") or 0.0) - dict(torch_profile.get("host_top") or []).get("Command Buffer Full", 0.0)
            self.forward_s.append((regime(line), (line.get("method", ""), tokens, line["step_s"] / n, line.get("sharing"),
                                                  host / n)))
        if line.get("peak_gpu_bytes") and line.get("est_gpu_bytes"):
            self.ratios.append((line.get("method", ""), line["peak_gpu_bytes"] / line["est_gpu_bytes"]))
        if line.get("wall_s") is not None and line.get("kind") in self.overhead:  # a key and a status alone: no figure
            seconds = max(0.0, line["wall_s"] - (line.get("steps") or 0) * (line.get("step_s") or 0.0))
            self.overhead[line["kind"]].append(seconds)
            self.overhead_of.setdefault(_overhead_key(line), []).append(seconds)

    def per_forward(self, cell, concurrency: int) -> float:
        """Seconds a forward (and its backward) of ``cell`` takes with ``concurrency`` cells on the GPU: the slowest of its
        method's cells that stepped as it will; of other methods' such cells x ``OTHER_METHOD`` (an ELSA step is a little
        slower than retraining's); else of all earlier cells. A cell that recorded how many cells shared the GPU with it
        on average (``sharing``) is scaled to ``concurrency`` (the GPU time-slices its processes: 4 cells of 32 x 512 at
        once stepped at ~4x one's pace, 2026-12-04), never below its host's profiled seconds in operators (8 x 512 cells
        stepped at 0.27 s beside three others with 0.18 s of it on the host: no fewer cells make that faster); one that
        did not record ``sharing`` counts as measured."""
        engine = self.engine == "deepspeed"  # ZeRO-3's options do not reach a plain loop's cells
        now = (self.checkpointing, self.leaf_layers and engine, self.torch_linear and engine)

        def paced(s: float, shared: float | None, host: float) -> float:
            return max(s / shared * concurrency, host) if shared else s

        # none measured yet as the cell will step: priced as the loop it compiles (what compiling saves unknown), with
        # torch's chunked loss (what the kernel saves unknown), or transformers' (before 2026-11-29: slower still)
        loops = dict.fromkeys((loop_of(self.engine, getattr(cell, "compiled", False)), self.engine))
        ways = [(*now, loop, loss) for loop in loops for loss in dict.fromkeys((loss_of(cell), CHUNKED, "transformers"))]
        same = next(([(m, t, paced(s, k, h)) for r, (m, t, s, k, h) in self.forward_s if r == way] for way in ways
                     if any(r == way for r, _ in self.forward_s)), [])
        mine = [(t, s) for m, t, s in same if m == cell.method]
        samples = mine or [(t, s * OTHER_METHOD) for _, t, s in same] or [(t, paced(s, k, h)) for _, (_, t, s, k, h) in self.forward_s]
        if not samples:
            return PRIOR_FORWARD_S * concurrency / 3
        tokens = min(cell.batch, self.micro_batch) * self.seqlen
        if own := [s for t, s in samples if t == tokens]:
            return max(own)
        if smaller := [(t, s) for t, s in samples if t < tokens]:
            per_token = gpu_seconds_per_token(self.model, self.seqlen, self.checkpointing) if self.model else None
            return max(s + (tokens - t) * (per_token or 0.0) * concurrency for t, s in smaller)
        return max(s for _, s in samples)  # only larger forwards measured: an upper bound

    def overhead_s(self, cell) -> float:
        """A cell's seconds beyond its steps (launch, load, one-shot or warm start, export, evaluation)."""
        start = starts_pruned(cell.method, cell.settings, cell.sparsity, cell.steps)
        engine = loop_of(getattr(cell, "engine", "deepspeed"), getattr(cell, "compiled", False))  # a compile's time is its own
        alike = [x for (m, _, st, e), xs in self.overhead_of.items() if (m, st, e) == (cell.method, start, engine) for x in xs]
        measured = self.overhead_of.get((cell.method, cell.settings, start, engine)) or alike or self.overhead[cell.kind]
        return max(measured) if measured else PRIOR_OVERHEAD_S[cell.kind]

    def steps_s(self, cell, concurrency: int) -> float:
        """A cell's seconds of training steps with ``concurrency`` cells on the GPU (0 for an evaluation or a one-shot)."""
        if cell.kind != "train":
            return 0.0
        return cell.steps * forwards(cell.batch, self.micro_batch) * self.per_forward(cell, concurrency)

    def seconds(self, cell, concurrency: int) -> float:
        return max(self.overhead_s(cell) + self.steps_s(cell, concurrency), self.cut_s.get(cell.key(self.seqlen), 0.0))

    def estimate(self, cell) -> float | None:
        """elsa_ds's estimate for a training cell (None for the others, or without a model)."""
        if cell.kind != "train" or self.model is None:
            return None
        return estimated_gpu_bytes(self.model, self.deepspeed, self.seqlen, cell.batch, self.micro_batch, self.checkpointing)

    def gpu_bytes(self, cell) -> float:
        if cell.kind != "train":
            return OTHER_GPU_BYTES
        est = self.estimate(cell)
        # the estimate is the ELSA job's (z, u on the GPU): retraining's peaks fall below it, and price ELSA's only with the
        # prior beside them until an ELSA cell is measured
        own = [r for m, r in self.ratios if m == "elsa"] if cell.method == "elsa" else [r for _, r in self.ratios]
        ratios = own or [PRIOR_GPU_RATIO, *(r for _, r in self.ratios)]
        return 0.0 if est is None else est * max(ratios)


def _overhead_key(line: dict) -> tuple[str, str, bool | None, str]:
    return line.get("method", ""), line.get("settings", "rule"), line_start(line), loop_of(line.get("engine", "deepspeed"),
                                                                                            line.get("compiled"))
