"""Memory estimator: bytes per GPU, CPU bytes per node and NVMe bytes of an ELSA job, from configs alone.

Per rank (W = GPUs per node x nodes, P = parameters, p = P / W its ZeRO-3 share; n entries of a sub-group,
cut as DeepSpeed cuts them (≥ sub_group_size, or the rest), N ≤ n of them in pruned layers, S the largest
pruned layer's share in it; h = 2 for bf16, 4 for fp32; "device" is the GPU, or host memory when DeepSpeed
runs on its CPU accelerator):

    params      h·p                  where offload_param puts them; NVMe: files of h·p, and DeepSpeed keeps the
                                     first max_in_cpu elements in a CPU buffer as well
    master      4p fp32              where offload_optimizer puts them
    grads       h·p                  partitioned accumulation buffer (data_types.grad_accum_dtype, else the
                                     model's), on the device without optimizer offload, else on the CPU
                + 4p fp32            CPU offload: one buffer per sub-group; NVMe: a 4n CPU buffer and 4p of files;
                                     without offload built per sub-group during the step (see workspace)
    optimizer   8p Adam moments, 2p 8-bit Adam (+ block absmax)
    admm        (bytes(z) + bytes(u)) p       beside the optimizer states
    workspace   the temporaries of one sub-group's optimizer step, its largest phase, the largest sub-group
                (on the optimizer's device):
                  base step   torch Adam 8n (sqrt and quotient); DeepSpeedCPUAdam 0 (fused);
                              8-bit Adam on the CPU 20n (fp32 copies of both moments and the gradient, the
                              denominator; bitsandbytes' CPU backend), 0 on CUDA (fused kernel)
                  projection  the fused CPU kernels (CPU flats, per-layer top-k: keys recomputed, no score
                              buffer): 0; the eager reference (GPU flats, N:M): fp32 z, u: 10N + 8S (x+u, the old
                              keep-mask, scores, keep-masks; one layer's scoring temporaries); with fisher scores
                              from 8-bit moments + 12n while they are dequantized (4n kept); low-precision z, u:
                              + 8S (one layer's dequantized z, u)
                  first step  z = Π(x): fused n (measured ≤ 1.1 bytes per entry); eager (and with a warm-start
                              mask) 5N + 8S, + 12n to dequantize 8-bit moments; with NVMe the swapped states it
                              creates (moments, fp32 z, u) live outside the swap buffers until swapped out: + their bytes·n
                + 4n         the fp32 gradient of the sub-group when the optimizer is not offloaded
                and, on rank 0's host only, the consolidated 16-bit state dict of the export (h·P);
                counted beyond the forward/backward working set, which is released before the step
    buffers     device: the gradient (reduce) bucket; CPU: NVMe swap buffers (page-locked, resident in full)
    activations device, forward/backward working set: the gathered parameters in flight (two decoder layers,
                capped by stage3_max_live_parameters, plus the prefetch bucket; with memory_efficient_linear
                off every layer's and the head's beside them), a reduce buffer, and the
                activations: with gradient checkpointing each layer's input (2·B·L·H bytes) plus one
                layer's full activations B·L·H·(34 + 5·a·L/H) bytes (Korthikanti et al.), plus fp32 logits
                and their gradient (B·L·V·10 bytes); without, every layer's full activations
    runtime     per process: the framework itself (torch, DeepSpeed, transformers, the job's code and data;
                the CUDA context and libraries on a GPU) and the tokenizer every rank loads (per vocabulary entry);
                per node: the launcher's two processes

On a GPU host the CPU buffers of an offload section with pin_memory are pinned by torch's CUDA caching host allocator,
which takes the next power of two of each and keeps freed blocks (``resident.pinned_reserved``): zero.Init's
per-parameter partitions (the trained ones' blocks stay cached once the engine moves them into its flat 16-bit
buffer), that flat buffer, each sub-group's fp32 gradient and the flat gradient accumulation buffer. A job with a
one-shot --init_mask first prunes the whole model on rank 0 (``oneshot_host_bytes``): the "warm start" phase.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from elsa_ds.capacity.resident import (COMPONENTS, STATE_BYTES, Job, SubGroup, buffers, moment_bytes, read_job, states,  # noqa: F401
                                       sub_groups)
from elsa_ds.capacity.shapes import ModelShape, model_shape, resolve_model_config
from elsa_ds.errors import ElsaError
from elsa_ds.files.safetensors_writer import DEFAULT_MAX_SHARD_SIZE, TensorSpec, plan_shards
from elsa_ds.loss import ROW_ELEMENTS
from elsa_ds.methods import oneshot_names
from elsa_ds.zero.ds_config import DsConfig, linear_wrapped

# Host RSS of one rank that holds no model: the peak RSS of a rank process running the whole job (launch/prune.py,
# 3 steps, --val_windows 0) on a 0.3M-parameter Gemma-2 under each shipped config, 1 and 2 ranks, DeepSpeed's CPU
# accelerator, less the estimate of its (tiny) model state and NVMe buffers: 507-519 MiB (torch 2.13 CPU, DeepSpeed
# 0.19.8, transformers 5.23; `python bench/memory.py --runtime`).
RUNTIME_HOST_BYTES = 520 * 2**20
# A one-shot job's process beside its model: the validation phase's peak RSS less the fp32 model (464 MiB) on the
# 121.6 M-parameter one-layer Gemma-2 with the demo's 4,096-entry tokenizer (bench/memory.py --oneshot, 2026-11-29:
# 1,181-1,183 MiB), i.e. the imports (477 MiB before the job's first phase) and what loading and the texts leave on the
# heap. A fast tokenizer adds ~1.26 KiB per vocabulary entry (Gemma's 262,144: +322 MiB measured in one process).
ONESHOT_RUNTIME_HOST_BYTES = 718 * 2**20
TOKENIZER_BYTES_PER_ENTRY = 322 * 2**20 / 262144
# The deepspeed launcher's two processes on a node (runner and launch.py; each imports torch): 244 MiB RSS each,
# measured the same way.
LAUNCHER_HOST_BYTES = 2 * 244 * 2**20
# A CUDA rank's extra host RSS (CUDA runtime, cuBLAS/cuDNN mapped in, pinned staging): the 32-step demo job on one H100
# against the same job with CUDA hidden, peak RSS 2.501e9 vs 1.433e9 bytes (torch 2.11+cu130; docs/history.md,
# "GPU device kit: the first run on a GPU"). The CUDA context on the GPU (not in torch.cuda.max_memory_allocated) is a
# typical value, not measured.
CUDA_HOST_BYTES = 1.07e9
RUNTIME_GPU_BYTES = 0.6e9


@dataclass
class Estimate:
    num_params: int
    pruned_params: int
    world_size: int
    per_gpu_bytes: float
    per_node_cpu_bytes: float
    nvme_bytes: float  # the whole job's; the breakdown's "nvme" too (per node: per_node_nvme_bytes)
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    # host bytes per node (rank 0's node) and bytes per GPU in each phase of the job; the totals are their maxima
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    per_node_nvme_bytes: float = 0.0  # each node's own disk holds its ranks' share

    def to_json(self) -> str:
        """Every field; each breakdown row also with ``per_node_nvme``, the table's column (its ``nvme`` is the job's)."""
        out = asdict(self)
        for row in out["breakdown"].values():  # as format_estimate divides the job's NVMe by the nodes
            row["per_node_nvme"] = row["nvme"] / max(1, self.num_nodes)
        return json.dumps(out)


PHASES = ("load", "first step", "step", "projection", "export", "verify")


def estimate(shape: ModelShape, ds: dict, num_gpus: int, num_nodes: int = 1, micro_batch: int | None = None,
             seqlen: int = 2048, elsa: dict | None = None, gradient_checkpointing: bool = True,
             device: str = "cuda") -> Estimate:
    """Bytes per GPU, CPU per node and NVMe in total for an ELSA job; ``elsa`` holds the JSON's elsa settings.

    ``device="cpu"``: DeepSpeed runs on its CPU accelerator (no GPU), so what would sit on the GPU is host
    memory: it is reported as CPU, per GPU is 0, and there is no CUDA context.
    """
    if device not in ("cuda", "cpu"):
        raise ElsaError(f"device must be cuda or cpu, not {device!r}")
    job = read_job(shape, ds, {**ds.get("elsa", {}), **(elsa or {})}, num_gpus * num_nodes, device)
    zero = ds.get("zero_optimization", {})
    per_rank: dict[str, dict[str, float]] = {k: {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0} for k in COMPONENTS}
    groups = sub_groups(shape, job.world, float(zero.get("sub_group_size", 1e9)))
    swapped_fresh = states(per_rank, shape, zero, job, groups)
    swapper = buffers(per_rank, ds, job, groups)
    forward = _forward_backward(shape, ds, job, micro_batch, seqlen, gradient_checkpointing, device)
    per_rank["runtime"]["cpu"] += rank_runtime_bytes(shape)
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


def gathered_params(shape: ModelShape, zero: dict, gradient_checkpointing: bool, device: str) -> float:
    """Per rank, the parameter entries held gathered on the device at the forward/backward's peak: two decoder layers
    in flight (capped by stage3_max_live_parameters, never less than the largest parameter, which must be whole to be
    used: the embedding), or, from the second step on, what ZeRO-3 keeps from the forward to the backward for reuse within
    stage3_max_reuse_distance entries (:func:`reused_params`), whichever is more. With
    ``memory_efficient_linear`` off torch's F.linear saves a view of each gathered weight for its backward, which a
    release cannot free, and the backward gathers the weight again beside it: every layer's weights and the head's are
    kept on top of those in flight (the head's alone when gradient checkpointing recomputes the layers)."""
    live = max(min(float(zero.get("stage3_max_live_parameters", 1e9)), 2.0 * shape.largest_layer_params), float(shape.largest_param))
    if device == "cpu":  # host pages are resident only once touched
        live = min(live, shape.num_params)
    kept = 0.0 if linear_wrapped(zero) else \
        float(shape.largest_param) + (0.0 if gradient_checkpointing else shape.layers * float(shape.largest_layer_params))
    return max(live + kept, reused_params(shape, float(zero.get("stage3_max_reuse_distance", 1e9))))


def reused_params(shape: ModelShape, distance: float) -> float:
    """The entries ZeRO-3 keeps gathered from the forward to the backward, from the second step on: a parameter stays when
    its trace says it is used again within ``distance`` entries (``__params_to_release``), and what its prefetcher looked
    ahead at stays too. Measured on real engines (``bench/gathered.py``: Gemma shapes from 270M to 27B and the shipped
    knobs, all scaled alike; a 2 M-entry model whole in tests/test_memory_engine.py): the model up to ``distance``
    entries, and the output head at least (used again at once by its backward), 0.99-1.04x of what stayed. The shipped
    1e9 keeps Gemma-3 270M and 1B whole, 1e9 entries of a 2B-9B, and the head alone of a 27B."""
    head = float(shape.largest_param if shape.tied else shape.vocab * shape.hidden)
    return min(float(shape.num_params), max(head, distance))


def _forward_backward(shape: ModelShape, ds: dict, job: Job, micro_batch: int | None, seqlen: int,
                      gradient_checkpointing: bool, device: str) -> float:
    """Per rank on the device: the gathered parameters (:func:`gathered_params`), the prefetch bucket (what is not
    gathered already), a reduce buffer, and the activations."""
    zero = ds.get("zero_optimization", {})
    prefetch = float(zero.get("stage3_prefetch_bucket_size", 5e7))
    bucket = float(zero.get("reduce_bucket_size", 5e8))
    if device == "cpu":  # host pages are resident only once touched: a bucket never holds more than the model
        prefetch, bucket = (min(v, shape.num_params) for v in (prefetch, bucket))
    b = micro_batch or ds.get("train_micro_batch_size_per_gpu", 1)
    h, a, n_layers, vocab = shape.hidden, shape.heads, shape.layers, shape.vocab
    full_layer = b * seqlen * h * (34 + 5 * a * seqlen / h)
    acts = (n_layers * 2 * b * seqlen * h + full_layer) if gradient_checkpointing else n_layers * full_layer
    # the loss (elsa_ds/loss.py): the logits and their gradient in the model's dtype, fp32 a chunk of rows at a time (the
    # chunk, its softmax in place, logsumexp's temporary); an upper bound where its Triton kernel runs (none of those)
    acts += b * seqlen * vocab * 2 * job.half + 3 * 4 * min(b * seqlen * vocab, ROW_ELEMENTS)
    gathered = gathered_params(shape, zero, gradient_checkpointing, device)
    prefetch = min(prefetch, max(0.0, shape.num_params - gathered))  # a model kept whole has nothing left to prefetch
    return job.half * (gathered + prefetch) + job.half * bucket + acts


def _transients(shape: ModelShape, job: Job, groups: list[SubGroup], swapped_fresh: float, forward: float,
                device: str) -> dict[str, dict[str, float]]:
    """Per rank, what each phase needs beyond the resident state (gpu: the device, cpu: the host); "rank0" rows are
    needed once per node, by rank 0 alone."""
    step_home = "gpu" if job.opt_dev == "none" else "cpu"   # where the optimizer steps, and DeepSpeed's self.device
    base_on_gpu, fp32_grad = job.opt_dev == "none" and device == "cuda", job.opt_dev == "none"
    work = {kind: max(_step_workspace(g, job, base_on_gpu, swapped_fresh, fp32_grad, kind) for g in groups)
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


def _totals(per_rank: dict, lazy: dict, transients: dict, shape: ModelShape, job: Job, num_gpus: int) -> Estimate:
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
    nvme = sum(v["nvme"] for v in breakdown.values())
    return Estimate(
        num_params=shape.num_params, pruned_params=shape.pruned_params, world_size=job.world,
        per_gpu_bytes=sum(v["per_gpu"] for v in breakdown.values()),
        per_node_cpu_bytes=sum(v["per_node_cpu"] for v in breakdown.values()),
        nvme_bytes=nvme, breakdown=breakdown, phases=phases, num_gpus=num_gpus, num_nodes=job.world // num_gpus,
        per_node_nvme_bytes=nvme * num_gpus / job.world,
    )


def _step_workspace(group: SubGroup, job: Job, base_on_gpu: bool, swapped_fresh: float, fp32_grad_in_step: bool,
                    kind: str = "projection") -> float:
    """Peak temporaries of one sub-group's optimizer step, per rank: a plain step (the base step), a projection step
    or the first step (z = Π(x), and the states it creates outside NVMe's swap buffers).

    Counted from the code that runs: torch's single-tensor Adam, bitsandbytes' CPU 8-bit update, and the projection:
    on CPU flats with a per-layer top-k the fused kernels (``admm/kernels/select.py``: each entry's key recomputed from
    x, u and F, 8-bit codes read as stored, no score buffer), else the eager reference (``AdmmOptimizer._init_state`` /
    ``_update_z_u`` / ``_finalize``, ``projection.scores`` / ``select_masks``). Measured for the fused path (1 rank,
    CPU, a 28.3M-entry flat, fp32 and ELSA-L states): a projection step's peak within 1 MB of a plain step's, the first
    step's transients (beyond the states it creates) 15 and 30 MB, ≤ 1.1 bytes per entry.
    """
    n, pruned, slice_ = group.numel, group.pruned, group.largest_pruned   # n, N, S
    # minifloat: the fused kernel on CPU; on a GPU its torch reference (m, v, denom, dequantize/encode temporaries: ~32 B)
    base_step = {"adam": 8 * n, "cpu_adam": 0.0, "adam8bit": 0.0 if base_on_gpu else 20 * n,
                 "adam8bit_minifloat": 32 * n if base_on_gpu else 0.0}[job.base]
    dequant_peak, dequant_kept = (12 * n, 4 * n) if job.fisher and job.base.startswith("adam8bit") else (0.0, 0.0)
    dequant_admm = 8 * slice_ if job.z_bytes < 4 or job.u_bytes < 4 else 0.0
    fp32_grad = 4 * n if fp32_grad_in_step else 0.0
    if kind == "step" or (kind == "projection" and job.fused):
        return fp32_grad + base_step
    if kind == "first step":
        init = 1.0 * n if job.fused_init else 5 * pruned + 8 * slice_ + dequant_peak
        return fp32_grad + max(base_step, init + swapped_fresh * n)
    return fp32_grad + max(base_step, 5 * pruned + dequant_admm + dequant_peak, 10 * pruned + dequant_kept + 8 * slice_)


def job_estimate(shape: ModelShape, ds: dict, cfg, num_gpus: int, num_nodes: int = 1, device: str = "cuda") -> Estimate:
    """An ELSA job's estimate as it runs (``ds``: the engine's DeepSpeed config, ``cfg``: its ElsaConfig after the defaults
    rule): the engine's phases and, with a one-shot --init_mask, the "warm start" before them, rank 0 pruning the whole
    model in host memory while the node's other ranks wait (what the largest phase needs beyond the rows above it is
    the "warm start" row)."""
    est = estimate(shape, ds, num_gpus, num_nodes, ds["train_micro_batch_size_per_gpu"], cfg.seqlen, elsa=cfg.model_dump(mode="json"),
                   gradient_checkpointing=cfg.gradient_checkpointing, device=device)
    if cfg.init_mask in oneshot_names():
        host = oneshot_host_bytes(shape, cfg.init_mask, cfg, device == "cuda") + (num_gpus - 1) * rank_runtime_bytes(shape)
        est.phases["warm start"] = {"per_gpu": 0.0, "per_node_cpu": host}
        est.breakdown["warm start"] = {"per_gpu": 0.0, "per_node_cpu": max(0.0, host - est.per_node_cpu_bytes), "nvme": 0.0}
        est.per_node_cpu_bytes = max(est.per_node_cpu_bytes, host)
    return est


def estimate_config(cfg, ds_config: DsConfig, num_gpus: int, num_nodes: int = 1, device: str = "cuda") -> Estimate:
    """The estimate for ``cfg`` (an ElsaConfig resolved as the job resolves it) under ``ds_config`` on num_gpus × num_nodes
    ranks, both checked as the job checks them (NVMe paths aside: they belong to the machine that runs the job)."""
    shape, ds = resolved_job(cfg, ds_config, num_gpus * num_nodes)
    return job_estimate(shape, ds, cfg, num_gpus, num_nodes, device)


def resolved_job(cfg, ds_config: DsConfig, world: int) -> tuple[ModelShape, dict]:
    """The model's shape and the engine's DeepSpeed config of ``cfg`` on ``world`` ranks, as the job resolves them."""
    from elsa_ds.models import check_seqlen, hidden_size

    config = model_config(cfg.model)
    check_seqlen(config, cfg.seqlen, cfg.model)
    shape = model_shape(config, cfg.targets, freeze_embeddings=cfg.freeze_embeddings)
    return shape, ds_config.resolve(cfg, world, hidden_size(config), check_paths=False, largest_param=shape.largest_param).raw


def model_config(model: str):
    """A model's transformers config as the estimator reads it (shipped configs offline); a damaged file is named."""
    from elsa_ds.models import guarded_config

    return guarded_config(model, lambda: resolve_model_config(model))


def estimate_job(model: str, deepspeed: str, num_gpus: int, num_nodes: int = 1, settings: dict | None = None,
                 device: str = "cuda") -> Estimate:
    """:func:`estimate_config` for ``settings`` (ElsaConfig fields) merged over the ``elsa`` block of the DeepSpeed config
    (by path or shipped name); the defaults rule is not applied (``elsa-estimate`` applies it, as the job does)."""
    from elsa_ds.settings.config import resolve_config

    ds_config = DsConfig.load(deepspeed)
    model_dir = str(Path(model).expanduser().parent) if Path(model).expanduser().is_file() else model
    cfg = resolve_config(ds_config.raw, {**(settings or {}), "model": model_dir}, source=deepspeed)
    return estimate_config(cfg, ds_config, num_gpus, num_nodes, device)


def rank_runtime_bytes(shape: ModelShape) -> float:
    """A training rank's host runtime: the framework's and the tokenizer it loads (every rank loads one)."""
    return RUNTIME_HOST_BYTES + TOKENIZER_BYTES_PER_ENTRY * shape.vocab


def oneshot_host_bytes(shape: ModelShape, method: str, cfg, cuda: bool) -> float:
    """Host memory of a one-shot job (one process): the whole model (fp32 on a CPU, bf16 with a GPU), the process's
    runtime with its tokenizer, and on a CPU the larger of the layer-by-layer working set (calibration or validation
    activations in and out of a layer, and the method's statistics of one decoder layer's Linears: SparseGPT an in²
    Hessian per Linear, the largest one inverted; Wanda, magnitude scores and a sort of the largest weight) and the
    validation's logits (one window's, fp32, and the NLL's fp32 chunk). Checked against measured peaks by
    ``bench/memory.py --oneshot`` (docs/results.md section 2)."""
    h = 2 if cuda else 4
    rows = max(cfg.nsamples if method != "magnitude" else 0, cfg.val_windows)
    acts = 2 * rows * cfg.seqlen * shape.hidden * h
    largest = shape.largest_pruned_param
    if method == "sparsegpt":
        inputs = [shape.hidden] * 6 + [largest // shape.hidden]          # q, k, v, o (≈ hidden), gate, up; down
        work = 4 * sum(i * i for i in inputs) + 8 * max(inputs) ** 2 + 12 * largest
    else:
        work = 16 * largest
    logits = cfg.seqlen * shape.vocab * 4 if cfg.val_windows else 0
    logits += min(ROW_ELEMENTS, logits // 4) * 4
    runtime = ONESHOT_RUNTIME_HOST_BYTES + TOKENIZER_BYTES_PER_ENTRY * shape.vocab
    return h * shape.num_params + runtime + (0 if cuda else max(acts + work, logits))


def format_estimate(est: Estimate, model: str, deepspeed: str, num_gpus: int, num_nodes: int, device: str = "cuda") -> str:
    """The estimate as the table ``elsa-estimate`` prints."""
    gib = 2 ** 30
    scale, unit = (1e9, "B") if est.num_params >= 1e9 else (1e6, "M")
    lines = [f"{model}: {est.num_params / scale:.2f} {unit} parameters ({est.pruned_params / scale:.2f} {unit} pruned), "
             f"{num_nodes} node(s) x {num_gpus} {'GPU(s)' if device == 'cuda' else 'CPU rank(s)'}, {deepspeed}",
             f"{'':12s} {'per GPU':>12s} {'CPU per node':>14s} {'NVMe per node':>14s}"]
    rows = [(name, row["per_gpu"], row["per_node_cpu"], row["nvme"]) for name, row in est.breakdown.items()]
    for name, gpu, cpu, nvme in rows + [("total", est.per_gpu_bytes, est.per_node_cpu_bytes, est.nvme_bytes)]:
        # NVMe: the job's whole (est.nvme_bytes, --json), each node's own disk holding its ranks' share
        gpu, cpu, nvme = (0.0 if abs(b) < gib / 200 else b / gib for b in (gpu, cpu, nvme / num_nodes))  # no "-0.00"
        lines.append(f"{name:12s} {gpu:10.2f} GiB {cpu:12.2f} GiB {nvme:12.2f} GiB")
    return "\n".join(lines)


# the memory CUDA reports (torch.cuda.mem_get_info's total) on the GPUs the device kit ran on (bench/results/device_check_*)
MEASURED_GPUS = (("an 80 GB H100", 79.2 * 2 ** 30), ("a 141 GB H200", 139.8 * 2 ** 30))


def gpu_room_note(est: Estimate, this_gpu: tuple[str, float] | None = None) -> str | None:
    """A note when the per-GPU total is more than a GPU holds: this machine's (``(name, total bytes)``) where it has one,
    else the GPUs measured (an H100's 80 GB, an H200's 141 GB); None when it fits. The job's own check compares with the
    GPU it gets."""
    gib = 2 ** 30
    gpus = [this_gpu] if this_gpu else list(MEASURED_GPUS)
    over = [(name, total) for name, total in gpus if est.per_gpu_bytes > total]
    if not over:
        return None
    fits = [name for name, total in gpus if est.per_gpu_bytes <= total]
    rows = sorted(((row["per_gpu"], name) for name, row in est.breakdown.items()), reverse=True)[:3]
    return (f"note: {est.per_gpu_bytes / gib:.1f} GiB per GPU is more than {over[-1][0]} holds ({over[-1][1] / gib:.1f} GiB to "
            f"CUDA){f'; {fits[0]} holds it' if fits else ''}. Largest: {', '.join(f'{n} {b / gib:.1f} GiB' for b, n in rows)}: "
            "ZeRO-3 divides parameters, gradients and optimizer states by the ranks (more GPUs, --num_nodes) or moves them "
            "to the host (an offload config); ELSA-L's states shrink them (--base_optimizer adam8bit --z_dtype fp8 --u_dtype "
            "bf16 on the GPU); activations shrink with a smaller --micro_batch (--gradient_checkpointing, the default, on)")
