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
from elsa_ds.targets import select_targets

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
STATE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
# Host RSS of one rank that holds no model: the peak RSS of a rank process running the whole job (launch/prune.py,
# 3 steps, --val_windows 0) on a 0.3M-parameter Gemma-2 under each shipped config, 1 and 2 ranks, DeepSpeed's CPU
# accelerator, less the estimate of its (tiny) model state and NVMe buffers: 507-519 MiB (torch 2.13 CPU, DeepSpeed
# 0.19.8, transformers 5.23; `python bench/memory.py --runtime`).
RUNTIME_HOST_BYTES = 520 * 2**20
# The deepspeed launcher's two processes on a node (runner and launch.py; each imports torch): 244 MiB RSS each,
# measured the same way.
LAUNCHER_HOST_BYTES = 2 * 244 * 2**20
# Not measured here (no GPU was lent): the extra host RSS of a CUDA rank (CUDA runtime, cuBLAS and cuDNN mapped in)
# and the CUDA context on the GPU, which torch.cuda.max_memory_allocated does not count.
CUDA_HOST_BYTES = 0.7e9
RUNTIME_GPU_BYTES = 0.6e9


@dataclass
class ModelShape:
    """What the estimator needs to know of a model (exact counts from a meta-device instance)."""

    num_params: int
    pruned_params: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    largest_layer_params: int
    largest_param: int
    largest_pruned_param: int = 0
    # (numel, pruned) of every parameter in the optimizer's order (model.parameters()): ZeRO-3's sub-groups
    params: list[tuple[int, bool]] = field(default_factory=list)


def resolve_model_config(model: str):
    """A transformers config from a directory, a config.json, a shipped config, or the hub (in that order)."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.is_file():
        path = path.parent
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ElsaError(f"{model}: directory has no config.json")
        return AutoConfig.from_pretrained(path)
    shipped = CONFIG_DIR / model
    if (shipped / "config.json").exists():
        return AutoConfig.from_pretrained(shipped)
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise ElsaError(f"cannot resolve model {model!r}: not a directory, not shipped in {CONFIG_DIR}, and not loadable ({str(err).splitlines()[0]})") from None


def model_shape(config, targets: str | None = None) -> ModelShape:
    """Exact parameter counts from a meta-device instance of the architecture (no weights, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    pruned_ids = select_targets(model, targets)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in _decoder_layers(model)]
    text = getattr(config, "text_config", config)
    return ModelShape(
        num_params=sum(p.numel() for p in model.parameters()),
        pruned_params=sum(p.numel() for p in model.parameters() if id(p) in pruned_ids),
        hidden=text.hidden_size, layers=text.num_hidden_layers, heads=text.num_attention_heads,
        vocab=text.vocab_size, largest_layer_params=max(per_layer) if per_layer else 0,
        largest_param=max(p.numel() for p in model.parameters()),
        largest_pruned_param=max((p.numel() for p in model.parameters() if id(p) in pruned_ids), default=0),
        params=[(p.numel(), id(p) in pruned_ids) for p in model.parameters()],
    )


def check_nvme_param_buffers(model: str, ds: dict) -> None:
    """DeepSpeed's NVMe parameter swapper needs buffer_size >= the largest parameter; say so before loading."""
    section = ds.get("zero_optimization", {}).get("offload_param", {})
    if section.get("device") != "nvme":
        return
    largest = model_shape(resolve_model_config(model)).largest_param
    size = float(section.get("buffer_size", 1e8))
    if size < largest:
        raise ElsaError(
            f"zero_optimization.offload_param.buffer_size is {size:.3g} elements but the model's largest parameter has "
            f"{largest:,} (usually the embedding); set buffer_size to at least {largest}"
        )


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and sum(1 for _ in module[0].parameters()) > 1:
            return list(module)
    return []


@dataclass(frozen=True)
class SubGroup:
    """One ZeRO-3 sub-group as a rank holds it: entries, entries of pruned layers, the largest pruned layer's share."""

    numel: float
    pruned: float
    largest_pruned: float


def sub_groups(shape: ModelShape, world: int, sub_group_size: float) -> list[SubGroup]:
    """The sub-groups of one rank, cut as DeepSpeed cuts them (``_create_fp16_sub_groups``): walk the parameters'
    partitions (ceil(numel / W) entries each) in order and close a sub-group once it holds ≥ sub_group_size, so
    one can exceed sub_group_size by a parameter. Without the parameter list, sub-groups of min(sub_group_size, p)."""
    if not shape.params:
        n = min(sub_group_size, shape.num_params / world)
        return [SubGroup(n, min(n, shape.pruned_params / world), min(n, shape.largest_pruned_param / world))]
    groups, numel, pruned, largest = [], 0, 0, 0
    for i, (count, is_pruned) in enumerate(shape.params):
        part = -(-count // world)
        numel += part
        if is_pruned:
            pruned, largest = pruned + part, max(largest, part)
        if numel >= sub_group_size or i == len(shape.params) - 1:
            groups.append(SubGroup(float(numel), float(pruned), float(largest)))
            numel, pruned, largest = 0, 0, 0
    return groups


def _swappable(shape: ModelShape, world: int, element_bytes: int, min_aio: float) -> float:
    """Bytes one rank swaps of per-parameter tensors (16-bit partitions, fp32 gradients): those of ≥ min_aio bytes."""
    if not shape.params:
        return element_bytes * shape.num_params / world
    parts = (element_bytes * -(-count // world) for count, _ in shape.params)
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

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def estimate(shape: ModelShape, ds: dict, num_gpus: int, num_nodes: int = 1, micro_batch: int | None = None,
             seqlen: int = 2048, elsa: dict | None = None, gradient_checkpointing: bool = True,
             device: str = "cuda") -> Estimate:
    """Bytes per GPU, CPU per node and NVMe in total for an ELSA job; ``elsa`` holds the JSON's elsa settings.

    ``device="cpu"``: DeepSpeed runs on its CPU accelerator (no GPU), so what would sit on the GPU is host
    memory: it is reported as CPU, per GPU is 0, and there is no CUDA context.
    """
    if device not in ("cuda", "cpu"):
        raise ElsaError(f"device must be cuda or cpu, not {device!r}")
    elsa = {**ds.get("elsa", {}), **(elsa or {})}
    world = num_gpus * num_nodes
    zero = ds.get("zero_optimization", {})
    p = shape.num_params / world
    param_dev = zero.get("offload_param", {}).get("device", "none")
    opt_dev = zero.get("offload_optimizer", {}).get("device", "none")
    half = 2 if ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled") else 4
    base = elsa.get("base_optimizer", "auto")
    if base == "auto":
        base = "adam" if opt_dev == "none" else "cpu_adam"
    eight_bit = base == "adam8bit"
    z_b, u_b = STATE_BYTES[elsa.get("z_dtype", "fp32")], STATE_BYTES[elsa.get("u_dtype", "fp32")]
    moment_bytes = 2 + 2 / 256 * 4 if eight_bit else 8  # per entry: two moments (8-bit: codes + one fp32 absmax per block of 256)

    where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}
    opt_home = where[opt_dev]
    step_home = "gpu" if opt_dev == "none" else "cpu"   # where the optimizer steps, and DeepSpeed's self.device
    per_rank: dict[str, dict[str, float]] = {k: {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0} for k in
                                             ("params", "grads", "optimizer", "admm", "workspace", "activations", "buffers", "runtime")}
    # DeepSpeed swaps a tensor only when it has at least max(1 MiB, aio.block_size) bytes; smaller ones stay in RAM
    min_aio = max(2.0**20, float(ds.get("aio", {}).get("block_size", 2**20)))
    if param_dev == "nvme":
        per_rank["params"]["nvme"] += _swappable(shape, world, half, min_aio)
        per_rank["params"]["cpu"] += half * min(p, float(zero["offload_param"].get("max_in_cpu", 1e9)))
    else:
        per_rank["params"][where[param_dev]] += half * p
    groups = sub_groups(shape, world, float(zero.get("sub_group_size", 1e9)))
    sub = max(g.numel for g in groups)                                 # the largest sub-group's entries, n
    # fp32 master weights and the moments; under NVMe a sub-group's states are swapped when its fp32 flat is
    swapped = sum(g.numel for g in groups if 4 * g.numel >= min_aio) if opt_dev == "nvme" else p
    per_rank["optimizer"][opt_home] += (4 + moment_bytes) * swapped
    per_rank["optimizer"]["cpu"] += (4 + moment_bytes) * (p - swapped)
    per_rank["grads"][step_home] += half * p                           # partitioned gradient accumulation buffer
    if opt_dev == "cpu":
        per_rank["grads"]["cpu"] += 4 * p
    elif opt_dev == "nvme":
        per_rank["grads"]["cpu"] += 4 * sub
        per_rank["grads"]["nvme"] += _swappable(shape, world, 4, min_aio)
    admm_bytes = (z_b + u_b) * p
    swapped_fresh = 0.0  # bytes per entry of states the first step creates outside NVMe's swap buffers
    if opt_dev == "nvme" and (z_b < 4 or u_b < 4 or eight_bit):
        # low-precision states are kept out of the swapper (it would read them back as fp32): CPU
        per_rank["admm"]["cpu"] += admm_bytes
        if eight_bit:
            moved = moment_bytes * swapped
            per_rank["optimizer"]["nvme"] -= moved
            per_rank["optimizer"]["cpu"] += moved
        else:
            swapped_fresh = moment_bytes
    elif opt_dev == "nvme":
        per_rank["admm"]["nvme"] += (z_b + u_b) * swapped
        per_rank["admm"]["cpu"] += (z_b + u_b) * (p - swapped)
        swapped_fresh = moment_bytes + z_b + u_b
    else:
        per_rank["admm"][opt_home] += admm_bytes
    base_on_gpu = opt_dev == "none" and device == "cuda"
    per_rank["workspace"][step_home] += max(
        _step_workspace(g, base, base_on_gpu, elsa.get("projection", "fisher") == "fisher", z_b < 4 or u_b < 4,
                        swapped_fresh, fp32_grad_in_step=opt_dev == "none") for g in groups)

    live = min(float(zero.get("stage3_max_live_parameters", 1e9)), 2.0 * shape.largest_layer_params)
    prefetch = float(zero.get("stage3_prefetch_bucket_size", 5e7))
    bucket = float(zero.get("reduce_bucket_size", 5e8))
    if device == "cpu":  # host pages are resident only once touched: a bucket never holds more than the model
        live, prefetch, bucket = (min(v, shape.num_params) for v in (live, prefetch, bucket))
    per_rank["buffers"]["gpu"] += half * bucket                        # the gradient bucket, kept from start to end
    if opt_dev == "nvme":
        o = zero["offload_optimizer"]
        per_rank["buffers"]["cpu"] += int(o.get("buffer_count", 4)) * sub * 4
    if param_dev == "nvme":
        o = zero["offload_param"]
        per_rank["buffers"]["cpu"] += int(o.get("buffer_count", 5)) * float(o.get("buffer_size", 1e8)) * half

    b = micro_batch or ds.get("train_micro_batch_size_per_gpu", 1)
    h, a, n_layers, vocab = shape.hidden, shape.heads, shape.layers, shape.vocab
    full_layer = b * seqlen * h * (34 + 5 * a * seqlen / h)
    acts = (n_layers * 2 * b * seqlen * h + full_layer) if gradient_checkpointing else n_layers * full_layer
    acts += b * seqlen * vocab * 10
    # forward/backward working set: gathered parameters of the layers in flight, a reduce buffer, activations
    per_rank["activations"]["gpu"] += half * (live + prefetch) + half * bucket + acts
    per_rank["runtime"]["cpu"] += RUNTIME_HOST_BYTES
    if device == "cuda":
        per_rank["runtime"]["cpu"] += CUDA_HOST_BYTES
        per_rank["runtime"]["gpu"] += RUNTIME_GPU_BYTES
    else:
        for row in per_rank.values():
            row["cpu"], row["gpu"] = row["cpu"] + row["gpu"], 0.0

    breakdown = {
        k: {"per_gpu": v["gpu"], "per_node_cpu": v["cpu"] * num_gpus, "nvme": v["nvme"] * world}
        for k, v in per_rank.items()
    }
    breakdown["runtime"]["per_node_cpu"] += LAUNCHER_HOST_BYTES
    # Transients that are never live at once: forward/backward (gathered parameters are released before the step),
    # the optimizer step, and rank 0's export (the consolidated 16-bit state dict on its host, after the last step).
    # "workspace" is what the step or the export needs beyond the forward/backward working set.
    ws, fb = breakdown["workspace"], breakdown["activations"]
    ws["per_gpu"] = max(0.0, ws["per_gpu"] - fb["per_gpu"])
    ws["per_node_cpu"] = max(0.0, ws["per_node_cpu"] - fb["per_node_cpu"], half * shape.num_params - fb["per_node_cpu"])
    return Estimate(
        num_params=shape.num_params, pruned_params=shape.pruned_params, world_size=world,
        per_gpu_bytes=sum(v["per_gpu"] for v in breakdown.values()),
        per_node_cpu_bytes=sum(v["per_node_cpu"] for v in breakdown.values()),
        nvme_bytes=sum(v["nvme"] for v in breakdown.values()),
        breakdown=breakdown,
    )


def _step_workspace(group: SubGroup, base: str, base_on_gpu: bool, fisher: bool, low_precision_admm: bool,
                    swapped_fresh: float, fp32_grad_in_step: bool) -> float:
    """Peak temporaries of one sub-group's optimizer step (base step, ADMM projection, first step), per rank.

    Counted from the code that runs: torch's single-tensor Adam, bitsandbytes' CPU 8-bit update,
    ``AdmmOptimizer._init_state`` / ``_update_z_u`` / ``_finalize`` and ``projection.scores`` / ``select_masks``.
    """
    n, pruned, slice_ = group.numel, group.pruned, group.largest_pruned   # n, N, S
    base_step = {"adam": 8 * n, "cpu_adam": 0.0, "adam8bit": 0.0 if base_on_gpu else 20 * n}[base]
    dequant_peak, dequant_kept = (12 * n, 4 * n) if fisher and base == "adam8bit" else (0.0, 0.0)
    dequant_admm = 8 * slice_ if low_precision_admm else 0.0
    projection = max(5 * pruned + dequant_admm + dequant_peak, 10 * pruned + dequant_kept + 8 * slice_)
    first = 5 * pruned + 8 * slice_ + dequant_peak + swapped_fresh * n
    fp32_grad = 4 * n if fp32_grad_in_step else 0.0
    return fp32_grad + max(base_step, projection, first)
