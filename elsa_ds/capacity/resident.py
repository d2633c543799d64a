"""What one rank keeps from start to end under ZeRO-3, component by component: bytes and where they live (GPU, host
or NVMe), from the configs alone; ``memory.py`` adds the phases' transients and sums them per node.

The formulas are in ``memory.py``'s docstring. Host buffers DeepSpeed pins on a GPU host are counted as torch's CUDA
caching host allocator holds them (``pinned_reserved``): the next power of two of each tensor, and a freed block
kept for a later tensor of the same size class, never returned to the system.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from elsa_ds.capacity.shapes import ModelShape
from elsa_ds.errors import ElsaError
from elsa_ds.zero.ds_config import DEFAULT_PARAM_BUFFER, DsConfig, param_buffer_size

STATE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}
COMPONENTS = ("params", "grads", "optimizer", "admm", "workspace", "activations", "buffers", "runtime")


@dataclass(frozen=True)
class SubGroup:
    """One ZeRO-3 sub-group as a rank holds it: entries, entries of pruned layers, the largest pruned layer's share."""

    numel: float
    pruned: float
    largest_pruned: float
    full: float = 0.0        # the full (unpartitioned) numel of its parameters


def sub_groups(shape: ModelShape, world: int, sub_group_size: float) -> list[SubGroup]:
    """The sub-groups of one rank, cut as DeepSpeed cuts them (``_create_fp16_sub_groups``): walk the parameters'
    partitions (ceil(numel / W) entries each) in order and close a sub-group once it holds ≥ sub_group_size, so
    one can exceed sub_group_size by a parameter. Without the parameter list, sub-groups of min(sub_group_size, p)."""
    if not shape.params:
        n = min(sub_group_size, shape.trainable_params / world)
        return [SubGroup(n, min(n, shape.pruned_params / world), min(n, shape.largest_pruned_param / world), n * world)]
    groups, numel, pruned, largest, full = [], 0, 0, 0, 0
    for i, (count, is_pruned) in enumerate(shape.params):
        part = -(-count // world)
        numel, full = numel + part, full + count
        if is_pruned:
            pruned, largest = pruned + part, max(largest, part)
        if numel >= sub_group_size or i == len(shape.params) - 1:
            groups.append(SubGroup(float(numel), float(pruned), float(largest), float(full)))
            numel, pruned, largest, full = 0, 0, 0, 0
    return groups


def swappable(shape: ModelShape, world: int, element_bytes: int, min_aio: float, frozen: bool = False) -> float:
    """Bytes one rank swaps of per-parameter tensors (16-bit partitions of all parameters with ``frozen``, fp32 gradients
    of the trained ones): those of ≥ min_aio bytes."""
    if not shape.params:
        return element_bytes * (shape.num_params if frozen else shape.trainable_params) / world
    counts = [count for count, _ in shape.params] + (shape.frozen if frozen else [])
    parts = (element_bytes * -(-count // world) for count in counts)
    return float(sum(b for b in parts if b >= min_aio))


def moment_bytes(base: str) -> float:  # Adam's moments per entry: fp32, or 8-bit codes + an fp32 absmax per 256 (both formats)
    return 2 + 2 / 256 * 4 if base.startswith("adam8bit") else 8


def checkpoint_tag_bytes(shape: ModelShape, cfg, element: float) -> float:
    """One checkpoint of an ELSA run (``cfg``: its ElsaConfig): fp32 masters, Adam moments and z, u of the trained
    parameters, and the frozen ones' partitions in the engine's dtype (``element`` bytes: DeepSpeed's
    frozen_param_fragments). DeepSpeed's files hold these and ~25 kB more, the model-states file's metadata;
    tests/zero/test_checkpoint.py holds this to the files written."""
    states = moment_bytes(cfg.base_optimizer.value) + STATE_BYTES[cfg.z_dtype.value] + STATE_BYTES[cfg.u_dtype.value]
    return (4 + states) * shape.trainable_params + element * (shape.num_params - shape.trainable_params)


@dataclass(frozen=True)
class Job:
    """What the estimate depends on, read once from the configs."""

    world: int
    p: float                 # parameters per rank
    t: float                 # trained parameters per rank (the optimizer's share)
    half: int                # bytes of a 16-bit (or fp32) model element
    grad_accum: int          # bytes of an element of DeepSpeed's gradient accumulation buffer (data_types.grad_accum_dtype)
    param_dev: str
    opt_dev: str
    base: str                # adam | cpu_adam | adam8bit | adam8bit_minifloat (8-bit: the same state bytes)
    z_bytes: int
    u_bytes: int
    moment_bytes: float      # per entry: two moments (8-bit: codes + one fp32 absmax per block of 256)
    min_aio: float           # DeepSpeed swaps a tensor only when it has at least this many bytes
    fisher: bool
    pin_params: bool         # offload_param's CPU buffers are pinned by torch's caching host allocator (a GPU host)
    pin_grads: bool          # offload_optimizer's CPU gradient buffers are (a GPU host)
    fused: bool              # the projection runs on the fused CPU kernels (CPU flats, per-layer top-k): no score buffers
    fused_init: bool         # z₀ = Π(x) does too (no warm-start mask)
    remedy: str = ""         # adaptive | relaxed: the authors' remedy the run takes, whose parts run on the eager path
    param_buffer: float = DEFAULT_PARAM_BUFFER  # elements of each of the NVMe parameter swapper's buffers ("auto" resolved)


def element_bytes(ds: dict) -> int:
    """Bytes of a model element in the engine: 2 with bf16 or fp16 on, else 4 (fp32)."""
    return 2 if ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled") else 4


def job_optimizer(ds: dict, elsa: dict) -> tuple[str, str]:
    """(the base optimizer, ``auto`` resolved as the job resolves it; the authors' remedy the run takes, or "")."""
    base = elsa.get("base_optimizer", "auto")
    base = ("adam" if DsConfig(ds).optimizer_device == "none" else "cpu_adam") if base == "auto" else base
    return base, "adaptive" if elsa.get("lmda_schedule") == "adaptive" else "relaxed" if elsa.get("relaxation", 1.0) != 1.0 else ""


def read_job(shape: ModelShape, ds: dict, elsa: dict, world: int, device: str) -> Job:
    view = DsConfig(ds)
    opt_dev = view.optimizer_device
    if bad := sorted({view.param_device, opt_dev} - {"none", "cpu", "nvme"}):  # until DsConfig.check names it
        raise ElsaError(f"zero_optimization: offload_param / offload_optimizer device {bad[0]!r}: DeepSpeed takes none, cpu or nvme")
    base, remedy = job_optimizer(ds, elsa)
    half = element_bytes(ds)
    zero = view.zero
    pins = {k: device == "cuda" and bool(zero.get(k, {}).get("pin_memory")) for k in ("offload_param", "offload_optimizer")}
    fused = (opt_dev != "none" or device == "cpu") and elsa.get("pattern", "unstructured") == "unstructured"
    return Job(
        world=world, p=shape.num_params / world, t=shape.trainable_params / world, half=half,
        grad_accum=DTYPE_BYTES.get(str(ds.get("data_types", {}).get("grad_accum_dtype")), half),
        param_dev=view.param_device, opt_dev=opt_dev, base=base,
        z_bytes=STATE_BYTES[elsa.get("z_dtype", "fp32")], u_bytes=STATE_BYTES[elsa.get("u_dtype", "fp32")],
        moment_bytes=moment_bytes(base),
        min_aio=max(2.0**20, float(ds.get("aio", {}).get("block_size", 2**20))),
        fisher=elsa.get("projection", "fisher") == "fisher",
        pin_params=pins["offload_param"] and view.param_device != "none",
        pin_grads=pins["offload_optimizer"] and opt_dev != "none",
        # the adaptive λ and over-relaxation update z, u on the eager path (their first z = Π(x) stays fused)
        fused=fused and not remedy, fused_init=fused and not elsa.get("init_mask"), remedy=remedy,
        param_buffer=param_buffer_size(zero, shape.largest_param, world),
    )


# ---- pinned host memory on a GPU host -------------------------------------------------------------------------------
def pinned_block(nbytes: float) -> float:
    """The block torch's CUDA caching host allocator takes for a pinned tensor of ``nbytes``: the next power of two
    (``ATen/core/CachingHostAllocator.h``, ``allocate``: ``PowerOf2Ceil``, the default with no pinned_max_round_threshold_mb)."""
    n = math.ceil(nbytes)
    return float(1 << (n - 1).bit_length()) if n > 0 else 0.0


def pinned_reserved(events: list[tuple[str, float]]) -> float:
    """Bytes the caching host allocator takes from the system over ``events`` ("pin", bytes) / ("free", bytes): a
    pinned tensor reuses a freed block of its size class, else takes a new one; freed blocks stay cached."""
    cached: list[float] = []
    reserved = 0.0
    for kind, nbytes in events:
        block = pinned_block(nbytes)
        if kind == "free":
            cached.append(block)
        elif block in cached:
            cached.remove(block)
        else:
            reserved += block
    return reserved


def pinned_events(shape: ModelShape, job: Job, groups: list[SubGroup], max_in_cpu: float) -> dict[str, list[tuple[str, float]]]:
    """What DeepSpeed pins (and frees) on a GPU host, in its order, for the params and the grads rows: zero.Init pins each
    parameter's partition (``partition_parameters.py``: ``_partition_param``), a tied output head's too, freed when
    transformers ties it to the embedding; the engine pins one flat 16-bit buffer of the trained partitions
    (``_create_param_groups_fp16_flat_cpu_memory``, up to max_in_cpu under NVMe) and moves them there, freeing their
    blocks; then an fp32 gradient buffer per sub-group (``initialize_optimizer_states``, CPU offload) and the flat
    gradient accumulation buffer (``_setup_for_real_optimizer``)."""
    h, w = job.half, job.world
    parts = [h * -(-count // w) for count, _ in shape.params] if shape.params else [h * job.t]
    frozen = [h * -(-count // w) for count in shape.frozen] if shape.params else [h * (job.p - job.t)]
    tied = [h * -(-shape.tied // w)] if shape.tied else []
    params: list[tuple[str, float]] = []
    if job.pin_params and job.param_dev == "cpu":
        params += [("pin", b) for b in parts + frozen + tied] + [("free", b) for b in tied]
    if job.pin_params and (flat := sum(parts) if job.param_dev == "cpu" else min(sum(parts), h * max_in_cpu)) > 0:
        params.append(("pin", flat))
    if job.pin_params and job.param_dev == "cpu":
        params += [("free", b) for b in parts]
    grads = [("pin", 4 * g.numel) for g in groups] if job.pin_grads and job.opt_dev == "cpu" else []
    if job.pin_grads:
        grads.append(("pin", job.grad_accum * sum(parts) / h))
    return {"params": params, "grads": grads}


# ---- the resident state -----------------------------------------------------------------------------------------------
def states(per_rank: dict, shape: ModelShape, zero: dict, job: Job, groups: list[SubGroup]) -> float:
    """Parameters, gradients, masters + moments and z/u where the config puts them. Returns the bytes per entry of
    the states the first step creates outside NVMe's swap buffers."""
    where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}
    p, t, half = job.p, job.t, job.half
    opt_home, step_home = where[job.opt_dev], "gpu" if job.opt_dev == "none" else "cpu"
    max_in_cpu = float(zero.get("offload_param", {}).get("max_in_cpu", 1e9))
    if job.param_dev == "nvme":
        # a tied output head is built (and swapped out) as a parameter of its own under zero.Init before transformers
        # ties it: its file stays beside the embedding's
        per_rank["params"]["nvme"] += swappable(shape, job.world, half, job.min_aio, frozen=True) + half * -(-shape.tied // job.world)
        per_rank["params"]["cpu"] += half * min(t, max_in_cpu)
    else:
        per_rank["params"][where[job.param_dev]] += half * p
    # fp32 master weights and the moments; under NVMe a sub-group's states are swapped when its fp32 flat is
    swapped = sum(g.numel for g in groups if 4 * g.numel >= job.min_aio) if job.opt_dev == "nvme" else t
    per_rank["optimizer"][opt_home] += (4 + job.moment_bytes) * swapped
    per_rank["optimizer"]["cpu"] += (4 + job.moment_bytes) * (t - swapped)
    per_rank["grads"][step_home] += job.grad_accum * t                 # partitioned gradient accumulation buffer
    if job.opt_dev == "cpu":
        per_rank["grads"]["cpu"] += 4 * t
    elif job.opt_dev == "nvme":
        per_rank["grads"]["cpu"] += 4 * max(g.numel for g in groups)
        per_rank["grads"]["nvme"] += swappable(shape, job.world, 4, job.min_aio)
    _pinned(per_rank, pinned_events(shape, job, groups, max_in_cpu))
    return _admm_states(per_rank, job, swapped, opt_home)


def _pinned(per_rank: dict, events: dict[str, list[tuple[str, float]]]) -> None:
    """The host bytes of what DeepSpeed pins, as the caching host allocator holds them, in place of the tensors' own bytes:
    its blocks, those of freed tensors included (the trained partitions' zero.Init blocks stay cached)."""
    for row, seq in events.items():
        live = sum(b if kind == "pin" else -b for kind, b in seq)
        per_rank[row]["cpu"] += pinned_reserved(seq) - live


def _admm_states(per_rank: dict, job: Job, swapped: float, opt_home: str) -> float:
    zu = job.z_bytes + job.u_bytes
    if job.opt_dev == "nvme" and (job.z_bytes < 4 or job.u_bytes < 4 or job.base.startswith("adam8bit")):
        # low-precision states are kept out of the swapper (it would read them back as fp32): CPU
        per_rank["admm"]["cpu"] += zu * job.t
        if not job.base.startswith("adam8bit"):
            return job.moment_bytes
        moved = job.moment_bytes * swapped
        per_rank["optimizer"]["nvme"] -= moved
        per_rank["optimizer"]["cpu"] += moved
        return 0.0
    if job.opt_dev == "nvme":
        per_rank["admm"]["nvme"] += zu * swapped
        per_rank["admm"]["cpu"] += zu * (job.t - swapped)
        return job.moment_bytes + zu
    per_rank["admm"][opt_home] += zu * job.t
    return 0.0


def buffers(per_rank: dict, ds: dict, job: Job, groups: list[SubGroup]) -> float:
    """Buffers kept from start to end: the gradient (reduce) bucket, NVMe's page-locked swap buffers (DeepSpeed's aio
    allocator: exact sizes). Returns the bytes of the parameter swapper's buffers (zero.Init makes them)."""
    zero = ds.get("zero_optimization", {})
    per_rank["buffers"]["gpu"] += job.half * float(zero.get("reduce_bucket_size", 5e8))
    if job.opt_dev == "nvme":
        o = zero["offload_optimizer"]
        per_rank["buffers"]["cpu"] += int(o.get("buffer_count", 4)) * max(g.numel for g in groups) * 4
    if job.param_dev != "nvme":
        return 0.0
    o = zero["offload_param"]
    swapper = int(o.get("buffer_count", 5)) * job.param_buffer * job.half
    per_rank["buffers"]["cpu"] += swapper
    if job.t > float(o.get("max_in_cpu", 1e9)):
        # the buffer the step's updated 16-bit shares are swapped out through: DeepSpeed sizes it by the full
        # (unpartitioned) numel of the largest sub-group's parameters (reserve_partitioned_swap_space)
        per_rank["buffers"]["cpu"] += job.half * max(g.full for g in groups)
    return swapper
