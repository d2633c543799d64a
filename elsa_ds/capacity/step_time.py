"""How long an ELSA job's step and whole run take: the bytes each step moves and its FLOPs, against a machine's rates.

Per optimizer step, per rank (W ranks, g of them on a node; P parameters, T trained ones; h bytes of a 16-bit or fp32
model element; a micro-steps of b sequences of L tokens; every host figure is the node's, shared by its g ranks):

    forward/backward, per micro-step, the larger of (DeepSpeed prefetches the next parameters while a layer computes):
      compute     (2P + 2P + 2T_mm [+ 2P recomputed with gradient checkpointing]) · b·L FLOPs, plus attention
                  4·L·H·layers per token and pass, at the device's matmul rate (a CPU's is its node's, over g ranks)
      PCIe        parameters fetched host→GPU twice (forward, backward; the recompute reuses the backward's gather):
                  2·h·P/W with offload_param; gradients GPU→host h·T/W with offload_optimizer (pinned rates)
      collectives the same parameters all-gathered twice and the gradients reduce-scattered: (2·h·P + h·T)·(W−1)/W
                  at the intra-node rate, or the inter-node rate when the job spans nodes
    + hooks       ZeRO-3's per-tensor fetch and release work, twice a micro-step, per parameter tensor (with
                  --leaf_layers per decoder layer, its tensors fetched together)
    optimizer     offloaded: T/W entries at DeepSpeedCPUAdam's measured rate times the fused ELSA kernel's cost
                  relative to it (bench/optimizer_step.py; the authors' remedies times their eager parts' measured
                  factors, REMEDY_FACTORS; with --measure, the job's own optimizer timed on the host beside
                  DeepSpeedCPUAdam: optimizer_probe), and DeepSpeed's host passes around it (stage3.py: the
                  gradient norm read, the gradient unscaled in place, the fp32 → 16-bit parameter copy: 16 + h bytes
                  an entry) at the host's copy rate; on the device: Adam's and ELSA's state traffic (28 + z + u bytes an entry read or
                  written, twice for torch's unfused passes) at the device's memory rate
    projection    every ``interval`` steps, z = Π(x + u): that many base steps (bench/optimizer_step.py), amortized
    NVMe          swapped optimizer states read and written once a step (master, moments, z, u), and with parameters on
                  NVMe their reads per fetch and one write, at the node's NVMe rate

A run: steps × step + the first step's projection z₀ = Π(x) + the validation passes (dense, start, end: forward only)
+ loading and exporting the weights at the disk's rate. The rates are typical values for a GPU host and for a CPU
host (``TYPICAL``, each with its source) or measured on this machine (:func:`measure`: a few seconds). A small CPU job's
micro-step can be timed outright (``probe.measure_job``): its forward/backward then stands for the modelled compute and
hooks, and the engine's step beyond the plain optimizer's modelled pass is a component of its own ("engine step").
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

from elsa_ds.capacity.optimizer_probe import OptimizerTimings, rate_key
from elsa_ds.capacity.probe import JobTimings
from elsa_ds.capacity.resident import COMPONENTS, Job, checkpoint_tag_bytes, element_bytes, read_job, states, sub_groups
from elsa_ds.capacity.shapes import ModelShape
from elsa_ds.methods import oneshot_names


@dataclass(frozen=True)
class Rates:
    """A machine's rates (bytes and FLOPs per second) and where they come from."""

    source: str
    matmul_flops: float        # achieved matmul FLOP/s in the compute dtype: per GPU, or a CPU node's all cores
    device_bw: float           # device memory bytes/s (HBM; the host's on a CPU)
    h2d: float                 # pinned host → GPU bytes/s, per GPU
    d2h: float                 # pinned GPU → host bytes/s, per GPU
    host_bw: float             # host copy bytes/s, the node's (multithreaded torch copy)
    adam: float                # DeepSpeedCPUAdam entries/s, the node's (all cores)
    intra: float               # collective bytes/s per rank inside a node
    inter: float               # collective bytes/s per rank across nodes
    nvme: float                # NVMe bytes/s, the node's
    disk: float                # reading the checkpoint, writing the export: bytes/s
    hook_s: float              # ZeRO-3 fetch/release work per parameter tensor and pass, seconds
    # the fused ELSA step's cost in DeepSpeedCPUAdam steps, by base optimizer; and one projection's
    kernel: dict[str, float] = field(default_factory=dict)
    projection: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# The projection of a flat on the GPU (the eager torch reference) in passes over ELSA's state bytes: 26.0 ms on a 32M-entry
# flat whose 36 bytes an entry take 0.34 ms at the H100's 3.35 TB/s (bench/optimizer_step.py --device cuda, 2026-11-26,
# bench/results/device_check_2026-11-26.json; docs/results.md section 3); the host kernels' ratio (~2.7) priced it 28x low
GPU_PROJECTION = 26.0 / 0.34

# bench/optimizer_step.py on the lent H200 host (16 threads; bench/results/device_check_2026-11-27_h200.json,
# bench_threads) and on the 2-core AMD EPYC box (bench/results/optimizer_step.md, run 8): the fused ELSA step in
# DeepSpeedCPUAdam steps (fp32 z, u; ELSA-L minifloat codes; bitsandbytes' codes) and one projection in the same unit.
# The GPU host's projection is its 4-thread figure: its 16-thread run (5.42, 5.22, 4.96) predates the fix of the
# histogram's scratch that kept the projection from scaling past 4 threads (79fb59d: 27.9 -> 4.0 ms at 16 threads); the
# 16-thread figure took 41.7 ms a projection there, no faster than 4 threads' 39.9. The H200 jobs that ran after the fix
# (issue 43: ELSA 2.14 s a step, its dense control 2.22) show no such cost. To be measured again there (bench_threads).
# ELSA on torch's Adam on the host (--base_optimizer adam under offload: no fused kernel, the step on the eager path):
# 8.30 and 8.80 DeepSpeedCPUAdam steps in two runs on the 2-core AMD EPYC box (bench/optimizer_step.py --torch_adam,
# 2026-12-01, bench/results/optimizer_step_torch_adam_2026-12-01_epyc.txt); not measured on the GPU host: its figure too
TORCH_ADAM_ON_HOST = 8.55
_KERNEL_GPU_HOST = {"cpu_adam": 1.505, "adam8bit_minifloat": 1.064, "adam8bit": 1.724, "adam": TORCH_ADAM_ON_HOST}
_PROJECTION_GPU_HOST = {"cpu_adam": 2.666, "adam8bit_minifloat": 2.900, "adam8bit": 3.052}
_KERNEL_CPU_HOST = {"cpu_adam": 1.42, "adam8bit_minifloat": 1.15, "adam8bit": 3.36, "adam": TORCH_ADAM_ON_HOST}
_PROJECTION_CPU_HOST = {"cpu_adam": 2.26, "adam8bit_minifloat": 3.75, "adam8bit": 6.07}
# The authors' remedies under optimizer offload (bench/optimizer_step.py --remedies on the 2-core AMD EPYC box,
# 2026-11-28, bench/results/optimizer_step_remedies_32m_2026-11-28_epyc.txt; one run, not measured on the GPU host):
# (step, projection) against the fused ELSA's beside the same DeepSpeedCPUAdam, applied to every host's fused figures.
# adaptive: the penalty added in torch per layer, then the base's own step; both remedies update z, u on the eager path.
# relaxed: its x-step is the fused one (1 by construction; measured 0.98-1.20, the run's noise).
REMEDY_FACTORS = {"adaptive": {"cpu_adam": (1.81, 15.9), "adam8bit_minifloat": (6.30, 34.1), "adam8bit": (16.9, 54.3)},
                  "relaxed": {"cpu_adam": (1.0, 11.4), "adam8bit_minifloat": (1.0, 28.2), "adam8bit": (1.0, 25.0)}}

TYPICAL = {
    # The lent GPU machine: one H100 or H200 and a 16-core Xeon VM. Measured there: DeepSpeedCPUAdam 32M entries in
    # 7.70 ms at 16 threads (4.16e9 entries/s). Typical, not measured there: PCIe Gen5 x16 pinned copies as
    # DeepSpeed's per-tensor transfers reach them (~25 GB/s of the link's 64), dense bf16 matmul at batch 1 x 2048
    # tokens (~400 TFLOP/s of 989), HBM3 (~3 TB/s), one NVMe drive (~3 GB/s), the host's copy rate (~100 GB/s: its
    # DeepSpeedCPUAdam moved ~117 GB/s), ZeRO-3's hooks (~60 µs a tensor and pass).
    "gpu-vm-16c": Rates("typical 1-GPU host with 16 cores (the lent H100/H200 machine)", matmul_flops=4.0e14,
                        device_bw=3.0e12, h2d=25e9, d2h=25e9, host_bw=100e9, adam=4.16e9, intra=150e9, inter=40e9,
                        nvme=3e9, disk=2e9, hook_s=60e-6, kernel=_KERNEL_GPU_HOST, projection=_PROJECTION_GPU_HOST),
    # An 8-GPU server (DGX/HGX H100 class: two 56-core Xeon sockets, 16 DDR5 channels, 8 NVMe drives, 400 Gb/s
    # InfiniBand per GPU). Typical values: the host copy ~300 GB/s of the sockets' ~600; DeepSpeedCPUAdam memory-bound
    # at ~28 bytes an entry (~1.1e10 entries/s); the GPU figures as above, NVLink collectives ~150 GB/s per rank.
    "gpu-server": Rates("typical 8-GPU server (HGX H100 class, 2 sockets)", matmul_flops=4.0e14, device_bw=3.0e12,
                        h2d=25e9, d2h=25e9, host_bw=300e9, adam=1.1e10, intra=150e9, inter=40e9, nvme=20e9, disk=5e9,
                        hook_s=60e-6, kernel=_KERNEL_GPU_HOST, projection=_PROJECTION_GPU_HOST),
    # DeepSpeed's CPU accelerator on the 2-core AMD EPYC (Zen 4) box: DeepSpeedCPUAdam 2.04e9 entries/s; fp32 matmul
    # (at the demo job's shape) and copy as --measure timed them there (2026-12-02; guesses before, 1.31x the README
    # job's step); gloo typical. ZeRO-3's per-tensor work fitted to the demo job there: its step less the modelled
    # compute and optimizer over 2 ranks x 46 tensors x 2 passes (0.9 ms; 0.98 from a 0.575 s step; bench/step_time.py).
    "cpu-2c": Rates("typical 2-core CPU host (DeepSpeed's CPU accelerator)", matmul_flops=1.5e11, device_bw=3.4e10,
                    h2d=math.inf, d2h=math.inf, host_bw=3.4e10, adam=2.04e9, intra=2e9, inter=1e9, nvme=1e9, disk=1e9,
                    hook_s=0.9e-3, kernel=_KERNEL_CPU_HOST, projection=_PROJECTION_CPU_HOST),
}
DEFAULT_MACHINE = {"cuda": "gpu-server", "cpu": "cpu-2c"}
LENT_HOST_CPUS = 16  # the cores behind gpu-vm-16c's measured DeepSpeedCPUAdam and copy rates


def allotted(rates: Rates, cpus: float) -> Rates:
    """``rates`` for a job that may use ``cpus`` CPUs of the host (a SLURM allocation's, a container's): its CPU-bound
    rates, DeepSpeedCPUAdam's (which ELSA's kernels are priced against) and the host's copies, at most the profile's
    own and at most the lent 16-core host's per CPU; the rest (GPU, PCIe, NVMe, network) is the machine's."""
    lent = TYPICAL["gpu-vm-16c"]
    adam, host_bw = (min(mine, cpus * theirs / LENT_HOST_CPUS) for mine, theirs in ((rates.adam, lent.adam), (rates.host_bw, lent.host_bw)))
    if (adam, host_bw) == (rates.adam, rates.host_bw):
        return rates
    return replace(rates, adam=adam, host_bw=host_bw, source=f"{rates.source}; its CPU rates for the {cpus:g} CPUs allowed")


@dataclass
class StepTime:
    """Seconds per optimizer step by component (their sum is ``step_s``), and the whole run's."""

    components: dict[str, float]
    step_s: float
    steps: int
    interval: int
    run_s: float
    run_parts: dict[str, float]
    rates: dict
    uncounted: tuple[str, ...] = ()  # what the run also does that run_s leaves out
    timed: dict | None = None        # the job's micro-step as timed on this machine (probe.JobTimings), if it was
    optimizer_timed: dict | None = None  # the job's optimizer as timed on this machine (optimizer_probe), if it was

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def hours(self) -> str:  # the run's hours as printed: 28,100 h, not 2.81e+04
        return f"{self.run_s / 3600:.3g}" if self.run_s < 360_000 else f"{self.run_s / 3600:,.0f}"

    def report_mean(self) -> float:
        """The step time as a job's report averages it (``step_time_s``: steps 1 .. steps-1, the first left out), where
        step s projects when (s + 1) % interval == 0 and the last one finalizes x = Π(x) (one projection's work) in
        place of the amortized share."""
        timed, projection = range(1, self.steps), self.components["projection"]
        projections = sum(1 for s in timed if (s + 1) % self.interval == 0 or s == self.steps - 1)
        return self.step_s - projection + projection * self.interval * projections / len(timed) if timed else self.step_s


def _matmul_params(shape: ModelShape) -> tuple[float, float]:
    """(parameters a token multiplies through, trained ones among them): the input embedding is a lookup, unless it is
    tied to the output projection, which multiplies every token."""
    lookup = 0 if shape.tied else shape.vocab * shape.hidden
    frozen = sum(shape.frozen)
    frozen_mm = max(0, frozen - lookup)
    p_mm = shape.num_params - lookup
    return float(p_mm), float(max(0, p_mm - frozen_mm))


def train_flops_per_token(shape: ModelShape, seqlen: int, checkpointing: bool) -> float:
    """A training token's FLOPs (forward, backward, the recomputed forward with ``checkpointing``): the matmuls of the
    parameters it multiplies through (the frozen ones need no weight gradient) and attention's at ``seqlen``."""
    p_mm, t_mm = _matmul_params(shape)
    passes = 4 if checkpointing else 3               # forward, backward (x2), the recomputed forward
    return 4 * p_mm + 2 * t_mm + (2 * p_mm if checkpointing else 0) + 4 * seqlen * shape.hidden * shape.layers * passes


def _micro_steps(ds: dict, world: int) -> tuple[int, int]:
    micro = int(ds["train_micro_batch_size_per_gpu"])
    return micro, max(1, int(ds["train_batch_size"]) // (micro * world))


def job_matmul(shape: ModelShape, ds: dict, cfg) -> tuple[int, tuple[int, int, int]]:
    """(bits of the compute dtype, the job's typical matmul: a micro-step's tokens x hidden @ hidden x hidden), what
    :func:`measure` and :func:`matmul_rate` time for this job."""
    return 8 * element_bytes(ds), (int(ds["train_micro_batch_size_per_gpu"]) * cfg.seqlen, shape.hidden, shape.hidden)


def step_time(shape: ModelShape, ds: dict, cfg, num_gpus: int, num_nodes: int, device: str, rates: Rates,
              timed: JobTimings | None = None, optimizer: OptimizerTimings | None = None) -> StepTime:
    """Seconds per step and for the run of an ELSA job (``ds``: the engine's DeepSpeed config, ``cfg``: the ElsaConfig
    after the defaults rule) on num_gpus x num_nodes ranks; ``timed``: its micro-step timed on this machine
    (``probe.measure_job``), which then stands for the modelled one; ``optimizer``: its optimizer's step and projection
    timed here (``optimizer_probe``), which then stand for the profile's ratios."""
    rates = with_optimizer(rates, optimizer)
    job = read_job(shape, ds, {**ds.get("elsa", {}), **cfg.model_dump(mode="json")}, num_gpus * num_nodes, device)
    micro, accumulation = _micro_steps(ds, job.world)
    # a CPU node's ranks share its cores: each gets 1/g of the node's matmul rate (the host's rates are always shared)
    flop_rate = rates.matmul_flops / num_gpus if device == "cpu" else rates.matmul_flops
    micro_s = timed.micro_step_s if timed else _micro_step(shape, job, cfg, micro, num_gpus, num_nodes, device, rates, flop_rate)
    opt_step, projection, first_projection, host = _optimizer(shape, job, cfg, num_gpus, rates)
    components = {"forward/backward": accumulation * micro_s, "optimizer": opt_step, "host passes": host,
                  "projection": projection, "nvme": _nvme(shape, job, ds.get("zero_optimization", {}), accumulation, num_gpus, rates)}
    if timed:  # the engine's own work around the optimizer, which the model leaves out: its timed step less the plain
        plain = _plain_step(shape, job, num_gpus, rates)   # base optimizer's modelled pass and the host passes
        components["engine step"] = max(0.0, timed.step_s - plain - host)
    step_s = sum(components.values())
    p_mm, _ = _matmul_params(shape)
    windows = -(-cfg.val_windows // job.world)                    # each rank's share of the validation windows
    forward = timed.forward_s if timed else max(
        (2 * p_mm + 4 * cfg.seqlen * shape.hidden * shape.layers) * micro * cfg.seqlen / flop_rate,
        _fetch_bytes(shape, job) / 2 / rates.h2d if device == "cuda" else 0.0)
    scored = ((cfg.steps - 1) // cfg.interval) // cfg.select_every if cfg.select_every else 0  # --select_every's, at most
    parts = {"steps": cfg.steps * step_s, "first projection": first_projection,  # z₀ = Π(x)
             "validation": 3 * -(-windows // micro) * forward,    # the dense model, the start, the end
             "selection": scored * -(-windows // micro) * forward,  # an audit (2026-12-07): it doubled a run unsaid
             "load and export": 2 * job.half * shape.num_params / rates.disk,
             # --save_interval: every rank writes its partition of each checkpoint, a node its ranks' share
             "checkpoints": _saves(cfg) * checkpoint_tag_bytes(shape, cfg, job.half) / num_nodes / rates.disk}
    uncounted = (*([f"the {cfg.init_mask} warm start"] if cfg.init_mask in oneshot_names() else []), "start-up (processes, engine)",
                 *(["the end-of-run evaluation (--eval_ppl, --eval_tasks)"] if cfg.eval_ppl or cfg.eval_tasks else []))
    return StepTime(components=components, step_s=step_s, steps=cfg.steps, interval=cfg.interval,
                    run_s=sum(parts.values()), run_parts=parts, rates=rates.to_dict(), uncounted=uncounted,
                    timed=timed.to_dict() if timed else None, optimizer_timed=optimizer.to_dict() if optimizer else None)


def _saves(cfg) -> int:
    """Checkpoints a run writes: after every save_interval-th step but the last (``jobs/training.py``)."""
    return (cfg.steps - 1) // cfg.save_interval if cfg.save_interval else 0


def _fetch_bytes(shape: ModelShape, job: Job) -> float:
    """Bytes a rank copies host → GPU in a micro-step: its parameters' partition, forward and backward (offload_param)."""
    return 2 * job.half * shape.num_params / job.world if job.param_dev != "none" else 0.0


def _micro_step(shape: ModelShape, job: Job, cfg, micro: int, num_gpus: int, num_nodes: int, device: str, rates: Rates,
                flop_rate: float) -> float:
    """One micro-step's forward and backward: the compute, or the copies and collectives that feed it, whichever is
    longer (DeepSpeed prefetches while a layer computes), and ZeRO-3's per-tensor hooks."""
    compute = train_flops_per_token(shape, cfg.seqlen, cfg.gradient_checkpointing) * micro * cfg.seqlen / flop_rate
    trained, w = float(shape.trainable_params), job.world
    copies = 0.0
    if device == "cuda":
        grads = job.grad_accum * trained / w if job.opt_dev != "none" else 0.0
        copies = _fetch_bytes(shape, job) / rates.h2d + grads / rates.d2h
    link = rates.inter if num_nodes > 1 else rates.intra
    collectives = (2 * job.half * shape.num_params + job.grad_accum * trained) * (w - 1) / w / link
    tensors = len(shape.params) + len(shape.frozen)
    if cfg.leaf_layers:  # one fetch and release a layer, whatever it holds (at most: each tensor is still waited on)
        tensors += shape.layers - shape.layer_tensors
    hooks = 2 * tensors * rates.hook_s * (num_gpus if device == "cpu" else 1)
    return max(compute, copies, collectives) + hooks


def _optimizer(shape: ModelShape, job: Job, cfg, num_gpus: int, rates: Rates) -> tuple[float, float, float, float]:
    """(the step, one projection amortized over the interval, the first projection z₀ = Π(x) (fused with any remedy),
    DeepSpeed's host passes) of a rank's T/W entries."""
    entries = shape.trainable_params / job.world
    if job.opt_dev == "none":                                     # on the device: bytes at its memory rate
        base = (28 + job.z_bytes + job.u_bytes) * entries / rates.device_bw
        step = base * (2 if job.base == "adam" else 1)            # torch's Adam: unfused passes
        return step, base * GPU_PROJECTION / cfg.interval, base * GPU_PROJECTION, 0.0
    adam = entries * num_gpus / rates.adam                        # the node's g ranks step at once
    host = (16 + job.half) * entries * num_gpus / rates.host_bw
    first = adam * rates.projection.get(job.base, rates.projection["cpu_adam"])
    if job.remedy and (timed := rate_key(job.base, job.remedy)) in rates.kernel:  # timed here with its remedy
        step, projection = adam * rates.kernel[timed], adam * rates.projection[timed]
    else:
        factors = REMEDY_FACTORS.get(job.remedy, {})
        step_factor, projection_factor = factors.get(job.base, factors.get("cpu_adam", (1.0, 1.0)))  # 1, 1 without a remedy
        step, projection = adam * rates.kernel.get(job.base, rates.kernel["cpu_adam"]) * step_factor, first * projection_factor
    return step, projection / cfg.interval, first, host


def _plain_step(shape: ModelShape, job: Job, num_gpus: int, rates: Rates) -> float:
    """The modelled step of the optimizer ``probe.measure_job`` steps its engine with: DeepSpeedCPUAdam on the host,
    else torch's Adam on the device (its unfused passes over 28 bytes an entry)."""
    entries = shape.trainable_params / job.world
    return entries * num_gpus / rates.adam if job.opt_dev != "none" else 2 * 28 * entries / rates.device_bw


def _nvme(shape: ModelShape, job: Job, zero: dict, accumulation: int, num_gpus: int, rates: Rates) -> float:
    """What the memory estimate puts on NVMe, moved each step: the swapped optimizer states (masters, the moments and z, u
    where they are swapped: low-precision ones stay in host memory) read and written once, the fp32 gradients written
    when reduced and read by the step; parameters on NVMe read per fetch and written once."""
    swapped = 0.0
    if job.opt_dev == "nvme":
        per_rank = {k: {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0} for k in COMPONENTS}
        states(per_rank, shape, zero, job, sub_groups(shape, job.world, float(zero.get("sub_group_size", 1e9))))
        swapped += 2 * sum(per_rank[row]["nvme"] for row in ("optimizer", "admm", "grads"))
    if job.param_dev == "nvme":
        swapped += (2 * accumulation + 1) * job.half * shape.num_params / job.world
    return swapped * num_gpus / rates.nvme


def format_time(t: StepTime) -> str:
    """The lines ``elsa-estimate`` prints under the memory table."""
    parts = ", ".join(f"{k} {v:.3g}" for k, v in t.components.items() if v > 0)
    timed = f"; its forward/backward timed here ({t.timed['micro_step_s']:.3g} s a micro-step)" if t.timed else ""
    if o := t.optimizer_timed:
        timed += (f"; its optimizer timed here ({o['key']}: a step {o['kernel']:.3g}, a projection {o['projection']:.3g} "
                  "DeepSpeedCPUAdam steps)")
    return "\n".join([f"time per step {t.step_s:.3g} s ({parts}); {t.rates['source']}{timed}",
                      f"the run: {t.steps} steps, {t.hours} h ({t.run_s:,.0f} s; "
                      + ", ".join(f"{k} {v:,.0f} s" for k, v in t.run_parts.items() if v > 0) + ")"
                      + (f"; not counted: {', '.join(t.uncounted)}" if t.uncounted else "")])


# ---- measuring this machine ----------------------------------------------------------------------------------------

def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(device: str, base: Rates, dtype_bits: int = 16, gemm: tuple[int, int, int] = (2048, 2048, 2048)) -> Rates:
    """This machine's rates, in a few seconds: a multithreaded host copy, the job's matmul (``gemm``: tokens x hidden @
    hidden x hidden, in the compute dtype: a small model's matmuls run well below a large one's rate), DeepSpeedCPUAdam
    on an 8M-entry flat and, with a GPU, pinned copies both ways and a device copy. What it cannot time (collectives,
    NVMe, disk, ZeRO-3's hooks) stays ``base``'s; ELSA's step and projection relative to DeepSpeedCPUAdam are the job's
    own, timed by ``optimizer_probe`` (:func:`with_optimizer`)."""
    import torch

    n = 64 * 2**20                                                 # 256 MiB of fp32
    src, dst = torch.ones(n), torch.empty(n)
    host_bw = 2 * 4 * n / _best(lambda: dst.copy_(src))
    del src, dst
    dev = "cuda" if device == "cuda" else "cpu"
    flops = matmul_rate(device, dtype_bits, gemm)
    rates = replace(base, source=f"measured on this machine ({time.strftime('%Y-%m-%d')}; the rest: {base.source})",
                    matmul_flops=flops, host_bw=host_bw, adam=_adam_rate() or base.adam)
    if dev != "cuda":
        return replace(rates, device_bw=host_bw)
    pinned, gpu = torch.empty(n, pin_memory=True), torch.empty(n, device="cuda")

    def copy(to, frm):
        to.copy_(frm, non_blocking=True)
        torch.cuda.synchronize()

    h2d = 4 * n / _best(lambda: copy(gpu, pinned))
    d2h = 4 * n / _best(lambda: copy(pinned, gpu))
    other = torch.empty(n, device="cuda")
    device_bw = 2 * 4 * n / _best(lambda: copy(other, gpu))
    return replace(rates, h2d=h2d, d2h=d2h, device_bw=device_bw)


def with_optimizer(rates: Rates, timed: OptimizerTimings | None) -> Rates:
    """``rates`` with the job's optimizer step and projection as timed here (``optimizer_probe``) in place of the
    profile's ratios to DeepSpeedCPUAdam, and DeepSpeedCPUAdam's rate the one timed beside them (on the probe's
    larger flat: past the caches, as a real partition is); ``rates`` itself when nothing was timed."""
    if timed is None:
        return rates
    return replace(rates, kernel={**rates.kernel, timed.key: timed.kernel}, projection={**rates.projection, timed.key: timed.projection},
                   adam=timed.entries / (timed.adam_ms / 1e3))


def matmul_rate(device: str, dtype_bits: int, gemm: tuple[int, int, int]) -> float:
    """FLOP/s of ``gemm`` (m x k @ k x n) on this machine's device in the compute dtype (bf16 on a GPU, fp32 on a CPU)."""
    import torch

    dev = "cuda" if device == "cuda" else "cpu"
    dtype = torch.bfloat16 if dtype_bits == 16 and dev == "cuda" else torch.float32
    m, k, cols = gemm
    a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, cols, device=dev, dtype=dtype)
    repeats = max(1, int(2e9 / (2 * m * k * cols)))                # ~2 GFLOP a timing

    def matmul():
        for _ in range(repeats):
            a @ b
        if dev == "cuda":
            torch.cuda.synchronize()

    return repeats * 2 * m * k * cols / _best(matmul)


def _adam_rate() -> float | None:
    """DeepSpeedCPUAdam's entries/s on an 8M-entry flat with this process's threads; None where its op cannot build."""
    import torch

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        flat = torch.nn.Parameter(torch.zeros(8 * 2**20))
        flat.grad = torch.full_like(flat, 1e-3)
        opt = DeepSpeedCPUAdam([flat], lr=1e-3)
    except Exception:  # noqa: BLE001 - no compiler or no cpu_adam op: the typical value stands
        return None
    return flat.numel() / _best(opt.step)
