"""Memory estimator: bytes per GPU, CPU bytes per node and NVMe bytes of an ELSA job, from configs alone.

Per rank (W = GPUs per node x nodes, P = parameters, p = P / W its ZeRO-3 share; n entries of a sub-group,
cut as DeepSpeed cuts them (≥ sub_group_size, or the rest), N ≤ n of them in pruned layers, S the largest
pruned layer's share in it; h = 2 for bf16, 4 for fp32; "device" is the GPU, or host memory when DeepSpeed
runs on its CPU accelerator):

    params      h·p                  where offload_param puts them; NVMe: files of h·p, and DeepSpeed keeps the
                                     first max_in_cpu elements in a CPU buffer as well
    master      4p fp32              where offload_optimizer puts them
    grads       h·p                  partitioned accumulation buffer (grad_accum_dtype = the model's), on the
                                     device without optimizer offload, else on the CPU
                + 4p fp32            CPU offload: one buffer per sub-group; NVMe: a 4n CPU buffer and 4p of files;
                                     without offload built per sub-group during the step (see workspace)
    optimizer   8p Adam moments, 2p 8-bit Adam (+ block absmax)
    admm        (bytes(z) + bytes(u)) p       beside the optimizer states
    workspace   the temporaries of one sub-group's optimizer step, its largest phase, the largest sub-group
                (on the optimizer's device):
                  base step   torch Adam 8n (sqrt and quotient); DeepSpeedCPUAdam 0 (fused);
                              8-bit Adam on the CPU 20n (fp32 copies of both moments and the gradient, the
                              denominator; bitsandbytes' CPU backend), 0 on CUDA (fused kernel)
                  projection  fp32 z, u: 10N + 8S (x+u, the old keep-mask, scores, keep-masks; one layer's
                              scoring temporaries); with fisher scores from 8-bit moments + 12n while they
                              are dequantized (4n kept); low-precision z, u: + 8S (one layer's dequantized z, u)
                  first step  z = Π(x): 5N + 8S; with NVMe the swapped states it creates (moments, fp32 z, u)
                              live outside the swap buffers until swapped out: + their bytes·n
                + 4n         the fp32 gradient of the sub-group when the optimizer is not offloaded
                and, on rank 0's host only, the consolidated 16-bit state dict of the export (h·P);
                counted beyond the forward/backward working set, which is released before the step
    buffers     device: the gradient (reduce) bucket; CPU: NVMe swap buffers (page-locked, resident in full)
    activations device, forward/backward working set: the gathered parameters in flight (two decoder layers,
                capped by stage3_max_live_parameters, plus the prefetch bucket), a reduce buffer, and the
                activations: with gradient checkpointing each layer's input (2·B·L·H bytes) plus one
                layer's full activations B·L·H·(34 + 5·a·L/H) bytes (Korthikanti et al.), plus fp32 logits
                and their gradient (B·L·V·10 bytes); without, every layer's full activations
    runtime     per process: the framework itself (torch, DeepSpeed, transformers, the job's code and data;
                the CUDA context and libraries on a GPU); per node: the launcher's two processes
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from elsa_ds.errors import ElsaError
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.safetensors_writer import DEFAULT_MAX_SHARD_SIZE, TensorSpec, plan_shards
from elsa_ds.shapes import ModelShape, model_shape, resolve_model_config

STATE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
# Host RSS of one rank that holds no model: the peak RSS of a rank process running the whole job (launch/prune.py,
# 3 steps, --val_windows 0) on a 0.3M-parameter Gemma-2 under each shipped config, 1 and 2 ranks, DeepSpeed's CPU
# accelerator, less the estimate of its (tiny) model state and NVMe buffers: 507-519 MiB (torch 2.13 CPU, DeepSpeed
# 0.19.8, transformers 5.23; `python bench/memory.py --runtime`).
RUNTIME_HOST_BYTES = 520 * 2**20
# The deepspeed launcher's two processes on a node (runner and launch.py; each imports torch): 244 MiB RSS each,
# measured the same way.
LAUNCHER_HOST_BYTES = 2 * 244 * 2**20
# A CUDA rank's extra host RSS (CUDA runtime, cuBLAS/cuDNN mapped in, pinned staging): the 32-step demo job on one H100
# against the same job with CUDA hidden, peak RSS 2.501e9 vs 1.433e9 bytes (torch 2.11+cu130; docs/history.md,
# "GPU device kit: the first run on a GPU"). The CUDA context on the GPU (not in torch.cuda.max_memory_allocated) is a
# typical value, not measured.
CUDA_HOST_BYTES = 1.07e9
RUNTIME_GPU_BYTES = 0.6e9


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


def _swappable(shape: ModelShape, world: int, element_bytes: int, min_aio: float, frozen: bool = False) -> float:
    """Bytes one rank swaps of per-parameter tensors (16-bit partitions of all parameters with ``frozen``, fp32 gradients
    of the trained ones): those of ≥ min_aio bytes."""
    if not shape.params:
        return element_bytes * (shape.num_params if frozen else shape.trainable_params) / world
    counts = [count for count, _ in shape.params] + (shape.frozen if frozen else [])
    parts = (element_bytes * -(-count // world) for count in counts)
    return float(sum(b for b in parts if b >= min_aio))


@dataclass
class Estimate:
    num_params: int
    pruned_params: int
    world_size: int
    per_gpu_bytes: float
    per_node_cpu_bytes: float
    nvme_bytes: float
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    # host bytes per node (rank 0's node) and bytes per GPU in each phase of the job; the totals are their maxima
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


PHASES = ("load", "first step", "step", "projection", "export", "verify")


@dataclass(frozen=True)
class _Job:
    """What the estimate depends on, read once from the configs."""

    world: int
    p: float                 # parameters per rank
    t: float                 # trained parameters per rank (the optimizer's share)
    half: int                # bytes of a 16-bit (or fp32) model element
    param_dev: str
    opt_dev: str
    base: str                # adam | cpu_adam | adam8bit | adam8bit_minifloat (8-bit: the same state bytes)
    z_bytes: int
    u_bytes: int
    moment_bytes: float      # per entry: two moments (8-bit: codes + one fp32 absmax per block of 256)
    min_aio: float           # DeepSpeed swaps a tensor only when it has at least this many bytes
    fisher: bool


def moment_bytes(base: str) -> float:  # Adam's moments per entry: fp32, or 8-bit codes + an fp32 absmax per 256 (both formats)
    return 2 + 2 / 256 * 4 if base.startswith("adam8bit") else 8


def _read_job(shape: ModelShape, ds: dict, elsa: dict, world: int) -> _Job:
    view = DsConfig(ds)
    opt_dev, base = view.optimizer_device, elsa.get("base_optimizer", "auto")
    if bad := sorted({view.param_device, opt_dev} - {"none", "cpu", "nvme"}):  # until DsConfig.check names it
        raise ElsaError(f"zero_optimization: offload_param / offload_optimizer device {bad[0]!r}: DeepSpeed takes none, cpu or nvme")
    base = ("adam" if opt_dev == "none" else "cpu_adam") if base == "auto" else base
    return _Job(
        world=world, p=shape.num_params / world, t=shape.trainable_params / world,
        half=2 if ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled") else 4,
        param_dev=view.param_device, opt_dev=opt_dev, base=base,
        z_bytes=STATE_BYTES[elsa.get("z_dtype", "fp32")], u_bytes=STATE_BYTES[elsa.get("u_dtype", "fp32")],
        moment_bytes=moment_bytes(base),
        min_aio=max(2.0**20, float(ds.get("aio", {}).get("block_size", 2**20))),
        fisher=elsa.get("projection", "fisher") == "fisher",
    )


def estimate(shape: ModelShape, ds: dict, num_gpus: int, num_nodes: int = 1, micro_batch: int | None = None,
             seqlen: int = 2048, elsa: dict | None = None, gradient_checkpointing: bool = True,
             device: str = "cuda") -> Estimate:
    """Bytes per GPU, CPU per node and NVMe in total for an ELSA job; ``elsa`` holds the JSON's elsa settings.

    ``device="cpu"``: DeepSpeed runs on its CPU accelerator (no GPU), so what would sit on the GPU is host
    memory: it is reported as CPU, per GPU is 0, and there is no CUDA context.
    """
    if device not in ("cuda", "cpu"):
        raise ElsaError(f"device must be cuda or cpu, not {device!r}")
    job = _read_job(shape, ds, {**ds.get("elsa", {}), **(elsa or {})}, num_gpus * num_nodes)
    zero = ds.get("zero_optimization", {})
    per_rank: dict[str, dict[str, float]] = {k: {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0} for k in
                                             ("params", "grads", "optimizer", "admm", "workspace", "activations", "buffers", "runtime")}
    groups = sub_groups(shape, job.world, float(zero.get("sub_group_size", 1e9)))
    swapped_fresh = _states(per_rank, shape, zero, job, groups)
    swapper = _buffers(per_rank, ds, job, groups)
    forward = _forward_backward(shape, ds, job, micro_batch, seqlen, gradient_checkpointing, device)
    per_rank["runtime"]["cpu"] += RUNTIME_HOST_BYTES
    if device == "cuda":
        per_rank["runtime"]["cpu"] += CUDA_HOST_BYTES
        per_rank["runtime"]["gpu"] += RUNTIME_GPU_BYTES
    per_rank["activations"]["gpu"] += forward
    transients = _transients(shape, job, groups, swapped_fresh, forward, device)
    # building the model (zero.Init), before the engine: the runtime, the parameters' home, the parameter swapper
    transients["build"]["cpu"] += per_rank["runtime"]["cpu"] + per_rank["params"]["cpu"] + swapper
    transients["build"]["gpu"] += per_rank["runtime"]["gpu"] + per_rank["params"]["gpu"]
    # states the first step creates (Adam's moments and z, u where they are not swapped) are absent while loading
    lazy = {d: per_rank["admm"][d] + per_rank["optimizer"][d] * job.moment_bytes / (4 + job.moment_bytes) for d in ("gpu", "cpu")}
    if device == "cpu":  # the device is the host: resident bytes add up, a phase's transients come one after another
        for row in (*per_rank.values(), lazy):
            row["cpu"], row["gpu"] = row["cpu"] + row["gpu"], 0.0
        for name, row in transients.items():
            row["cpu"], row["gpu"] = row["cpu"] + row["gpu"] if name == "build" else max(row["cpu"], row["gpu"]), 0.0
    return _totals(per_rank, lazy, transients, shape, job, num_gpus)


def _states(per_rank: dict, shape: ModelShape, zero: dict, job: _Job, groups: list[SubGroup]) -> float:
    """Parameters, gradients, masters + moments and z/u where the config puts them. Returns the bytes per entry of
    the states the first step creates outside NVMe's swap buffers."""
    where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}
    p, t, half = job.p, job.t, job.half
    opt_home, step_home = where[job.opt_dev], "gpu" if job.opt_dev == "none" else "cpu"
    if job.param_dev == "nvme":
        # a tied output head is built (and swapped out) as a parameter of its own under zero.Init before transformers
        # ties it: its file stays beside the embedding's
        per_rank["params"]["nvme"] += _swappable(shape, job.world, half, job.min_aio, frozen=True) + half * -(-shape.tied // job.world)
        per_rank["params"]["cpu"] += half * min(t, float(zero["offload_param"].get("max_in_cpu", 1e9)))
    else:
        per_rank["params"][where[job.param_dev]] += half * p
    # fp32 master weights and the moments; under NVMe a sub-group's states are swapped when its fp32 flat is
    swapped = sum(g.numel for g in groups if 4 * g.numel >= job.min_aio) if job.opt_dev == "nvme" else t
    per_rank["optimizer"][opt_home] += (4 + job.moment_bytes) * swapped
    per_rank["optimizer"]["cpu"] += (4 + job.moment_bytes) * (t - swapped)
    per_rank["grads"][step_home] += half * t                           # partitioned gradient accumulation buffer
    if job.opt_dev == "cpu":
        per_rank["grads"]["cpu"] += 4 * t
    elif job.opt_dev == "nvme":
        per_rank["grads"]["cpu"] += 4 * max(g.numel for g in groups)
        per_rank["grads"]["nvme"] += _swappable(shape, job.world, 4, job.min_aio)
    return _admm_states(per_rank, job, swapped, opt_home)


def _admm_states(per_rank: dict, job: _Job, swapped: float, opt_home: str) -> float:
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


def _buffers(per_rank: dict, ds: dict, job: _Job, groups: list[SubGroup]) -> float:
    """Buffers kept from start to end: the gradient (reduce) bucket, NVMe's page-locked swap buffers. Returns the bytes
    of the parameter swapper's buffers (they exist before the engine: zero.Init makes them)."""
    zero = ds.get("zero_optimization", {})
    per_rank["buffers"]["gpu"] += job.half * float(zero.get("reduce_bucket_size", 5e8))
    if job.opt_dev == "nvme":
        o = zero["offload_optimizer"]
        per_rank["buffers"]["cpu"] += int(o.get("buffer_count", 4)) * max(g.numel for g in groups) * 4
    if job.param_dev != "nvme":
        return 0.0
    o = zero["offload_param"]
    swapper = int(o.get("buffer_count", 5)) * float(o.get("buffer_size", 1e8)) * job.half
    per_rank["buffers"]["cpu"] += swapper
    if job.t > float(o.get("max_in_cpu", 1e9)):
        # the buffer the step's updated 16-bit shares are swapped out through: DeepSpeed sizes it by the full
        # (unpartitioned) numel of the largest sub-group's parameters (reserve_partitioned_swap_space)
        per_rank["buffers"]["cpu"] += job.half * max(g.full for g in groups)
    return swapper


def _forward_backward(shape: ModelShape, ds: dict, job: _Job, micro_batch: int | None, seqlen: int,
                      gradient_checkpointing: bool, device: str) -> float:
    """Per rank on the device: the gathered parameters in flight (two decoder layers, capped by
    stage3_max_live_parameters, and never less than the largest parameter, which must be whole to be used: the
    embedding), the prefetch bucket, a reduce buffer, and the activations."""
    zero = ds.get("zero_optimization", {})
    live = max(min(float(zero.get("stage3_max_live_parameters", 1e9)), 2.0 * shape.largest_layer_params), float(shape.largest_param))
    prefetch = float(zero.get("stage3_prefetch_bucket_size", 5e7))
    bucket = float(zero.get("reduce_bucket_size", 5e8))
    if device == "cpu":  # host pages are resident only once touched: a bucket never holds more than the model
        live, prefetch, bucket = (min(v, shape.num_params) for v in (live, prefetch, bucket))
    b = micro_batch or ds.get("train_micro_batch_size_per_gpu", 1)
    h, a, n_layers, vocab = shape.hidden, shape.heads, shape.layers, shape.vocab
    full_layer = b * seqlen * h * (34 + 5 * a * seqlen / h)
    acts = (n_layers * 2 * b * seqlen * h + full_layer) if gradient_checkpointing else n_layers * full_layer
    acts += b * seqlen * vocab * 10
    return job.half * (live + prefetch) + job.half * bucket + acts


def _transients(shape: ModelShape, job: _Job, groups: list[SubGroup], swapped_fresh: float, forward: float,
                device: str) -> dict[str, dict[str, float]]:
    """Per rank, what each phase needs beyond the resident state (gpu: the device, cpu: the host); "rank0" rows are
    needed once per node, by rank 0 alone."""
    step_home = "gpu" if job.opt_dev == "none" else "cpu"   # where the optimizer steps, and DeepSpeed's self.device
    base_on_gpu, fp32_grad = job.opt_dev == "none" and device == "cuda", job.opt_dev == "none"
    low = job.z_bytes < 4 or job.u_bytes < 4
    work = {kind: max(_step_workspace(g, job.base, base_on_gpu, job.fisher, low, swapped_fresh, fp32_grad, kind) for g in groups)
            for kind in ("step", "first step", "projection")}
    largest, n_max = float(shape.largest_param), max(g.numel for g in groups)
    out = {phase: {"gpu": 0.0, "cpu": 0.0} for phase in (*PHASES, "build")}
    for kind, need in work.items():
        out[kind]["gpu"] = forward
        out[kind][step_home] = max(out[kind][step_home], need)
    # load, building the model: a parameter is made whole on every rank, then initialized gathered (measured: 2 copies
    # of the embedding at once); building the engine: the fp32 masters are cut from the 16-bit shares a sub-group at a time
    out["build"]["gpu"] = 2 * job.half * largest
    out["load"]["cpu"] += 4 * n_max if job.opt_dev != "none" else 0.0
    # export: every rank gathers one parameter at a time (on the CPU accelerator gloo's all-gather holds a second copy:
    # measured 2x); with a GPU rank 0 copies it to the host to write it
    out["export"]["gpu"] = (2 if device == "cpu" else 1) * job.half * largest
    out["rank0"] = {"gpu": 0.0, "cpu": job.half * largest if device == "cuda" else 0.0}
    # verify: rank 0 reads the export back one tensor at a time (the tensor, its zero mask, N:M group sums); the pages of
    # the pruned tensors read from one shard stay mapped (resident, though reclaimable) until the shard is closed
    pages = max((sum(job.half * n for n, pruned in shard if pruned) for shard in _shards(shape, job.half)), default=0.0)
    out["rank0 verify"] = {"gpu": 0.0, "cpu": pages + (job.half + 4) * shape.largest_pruned_param}
    return out


def _shards(shape: ModelShape, half: int) -> list[list[tuple[int, bool]]]:
    """The export's shards, as (numel, pruned) lists (``safetensors_writer.plan_shards`` on the state-dict order)."""
    specs = [TensorSpec(str(i), (n,), torch.bfloat16 if half == 2 else torch.float32) for i, (n, _) in enumerate(shape.order)]
    return [[shape.order[int(spec.name)] for spec in shard] for shard in plan_shards(specs, DEFAULT_MAX_SHARD_SIZE)]


def _totals(per_rank: dict, lazy: dict, transients: dict, shape: ModelShape, job: _Job, num_gpus: int) -> Estimate:
    """Each phase: the resident state plus that phase's transients; the estimate is the largest phase. In the breakdown
    the forward/backward working set is "activations", and what the largest phase needs beyond it "workspace"."""
    resident = {d: sum(v[d] for k, v in per_rank.items() if k not in ("activations", "workspace")) for d in ("gpu", "cpu")}
    phases = {}
    for phase in PHASES:
        rank = {d: resident[d] + transients[phase][d] - (lazy[d] if phase == "load" else 0.0) for d in ("gpu", "cpu")}
        if phase == "load":  # the larger of building the model and building the engine
            rank = {d: max(rank[d], transients["build"][d]) for d in ("gpu", "cpu")}
        extra = {"export": transients["rank0"]["cpu"], "verify": transients["rank0 verify"]["cpu"]}.get(phase, 0.0)
        phases[phase] = {"per_gpu": rank["gpu"], "per_node_cpu": rank["cpu"] * num_gpus + LAUNCHER_HOST_BYTES + extra}
    breakdown = {k: {"per_gpu": v["gpu"], "per_node_cpu": v["cpu"] * num_gpus, "nvme": v["nvme"] * job.world} for k, v in per_rank.items()}
    breakdown["runtime"]["per_node_cpu"] += LAUNCHER_HOST_BYTES
    peak_gpu = max(v["per_gpu"] for v in phases.values())
    peak_cpu = max(v["per_node_cpu"] for v in phases.values())
    ws = breakdown["workspace"]
    ws["per_gpu"] = max(0.0, peak_gpu - sum(v["per_gpu"] for v in breakdown.values()))
    ws["per_node_cpu"] = max(0.0, peak_cpu - sum(v["per_node_cpu"] for v in breakdown.values()))
    return Estimate(
        num_params=shape.num_params, pruned_params=shape.pruned_params, world_size=job.world,
        per_gpu_bytes=sum(v["per_gpu"] for v in breakdown.values()),
        per_node_cpu_bytes=sum(v["per_node_cpu"] for v in breakdown.values()),
        nvme_bytes=sum(v["nvme"] for v in breakdown.values()), breakdown=breakdown, phases=phases,
    )


def _step_workspace(group: SubGroup, base: str, base_on_gpu: bool, fisher: bool, low_precision_admm: bool,
                    swapped_fresh: float, fp32_grad_in_step: bool, kind: str = "projection") -> float:
    """Peak temporaries of one sub-group's optimizer step, per rank: a plain step (the base step), a projection step
    or the first step (z = Π(x), and the states it creates outside NVMe's swap buffers).

    Counted from the code that runs: torch's single-tensor Adam, bitsandbytes' CPU 8-bit update,
    ``AdmmOptimizer._init_state`` / ``_update_z_u`` / ``_finalize`` and ``projection.scores`` / ``select_masks``.
    """
    n, pruned, slice_ = group.numel, group.pruned, group.largest_pruned   # n, N, S
    # minifloat: the fused kernel on CPU; on a GPU its torch reference (m, v, denom, dequantize/encode temporaries: ~32 B)
    base_step = {"adam": 8 * n, "cpu_adam": 0.0, "adam8bit": 0.0 if base_on_gpu else 20 * n,
                 "adam8bit_minifloat": 32 * n if base_on_gpu else 0.0}[base]
    dequant_peak, dequant_kept = (12 * n, 4 * n) if fisher and base.startswith("adam8bit") else (0.0, 0.0)
    dequant_admm = 8 * slice_ if low_precision_admm else 0.0
    fp32_grad = 4 * n if fp32_grad_in_step else 0.0
    if kind == "step":
        return fp32_grad + base_step
    if kind == "first step":
        return fp32_grad + max(base_step, 5 * pruned + 8 * slice_ + dequant_peak + swapped_fresh * n)
    return fp32_grad + max(base_step, 5 * pruned + dequant_admm + dequant_peak, 10 * pruned + dequant_kept + 8 * slice_)


def estimate_job(model: str, deepspeed: str, num_gpus: int, num_nodes: int = 1, settings: dict | None = None,
                 device: str = "cuda") -> Estimate:
    """The estimate for a job as ``launch/prune.py`` would run it: the DeepSpeed config by path or shipped name, checked
    as the job checks it (ZeRO stage 3, the batch split over num_gpus × num_nodes ranks; NVMe paths are not checked:
    they belong to the machine that runs the job), and ``settings`` (ElsaConfig fields) merged over its ``elsa`` block."""
    from elsa_ds.config import resolve_config
    from elsa_ds.models import check_seqlen, guarded_config, hidden_size

    ds_config = DsConfig.load(deepspeed)
    config = guarded_config(model, lambda: resolve_model_config(model))
    model_dir = str(Path(model).expanduser().parent) if Path(model).expanduser().is_file() else model
    cfg = resolve_config(ds_config.raw, {**(settings or {}), "model": model_dir}, source=deepspeed)
    check_seqlen(config, cfg.seqlen, model)
    world = num_gpus * num_nodes
    ds_config.check(cfg, world, hidden_size(config), check_paths=False)
    shape = model_shape(config, cfg.targets, freeze_embeddings=cfg.freeze_embeddings)
    ds = {**ds_config.raw, "train_batch_size": ds_config.global_batch(cfg)}
    return estimate(shape, ds, num_gpus, num_nodes, ds_config.micro_batch(cfg), cfg.seqlen, elsa=cfg.model_dump(mode="json"),
                    gradient_checkpointing=cfg.gradient_checkpointing, device=device)


def format_estimate(est: Estimate, model: str, deepspeed: str, num_gpus: int, num_nodes: int) -> str:
    """The estimate as the table ``elsa-estimate`` prints."""
    gib = 2 ** 30
    lines = [f"{model}: {est.num_params / 1e9:.2f} B parameters ({est.pruned_params / 1e9:.2f} B pruned), "
             f"{num_nodes} node(s) x {num_gpus} GPU(s), {deepspeed}",
             f"{'':12s} {'per GPU':>12s} {'CPU per node':>14s} {'NVMe':>12s}"]
    rows = [(name, row["per_gpu"], row["per_node_cpu"], row["nvme"]) for name, row in est.breakdown.items()]
    for name, gpu, cpu, nvme in rows + [("total", est.per_gpu_bytes, est.per_node_cpu_bytes, est.nvme_bytes)]:
        lines.append(f"{name:12s} {gpu / gib:10.2f} GiB {cpu / gib:12.2f} GiB {nvme / gib:10.2f} GiB")
    return "\n".join(lines)
