"""The DeepSpeed adapter: config, model loading into partitions, engine with ADMM, evaluation, export.

Everything that knows ZeRO-3 internals (sub-groups, flat fp32 partitions, ds_tensor) lives in
``elsa_ds/zero/``; the recipe in ``elsa_ds/prune.py`` only calls the functions here.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from elsa_ds.admm.optimizer import AdmmOptimizer
from elsa_ds.admm.projection import NM, Slice, TorchDistComm, projection_masks
from elsa_ds.config import BaseOptimizer, ElsaConfig
from elsa_ds.errors import ElsaError
from elsa_ds.mask_file import MaskReader
from elsa_ds.evaluation.perplexity import token_nll
from elsa_ds.zero.layout import SubGroupLayout, build_layout, local_partition

# DeepSpeed needs these to accept a wrapper around an arbitrary torch optimizer under offload
_CLIENT_OPTIMIZER_FLAGS = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def init_distributed() -> tuple[int, int]:
    """Initialize torch.distributed through DeepSpeed (gloo on CPU); a plain ``python`` run is rank 0 of 1."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    import torch.distributed as dist

    _unlink_shm_buffer(dist)
    return dist.get_rank(), dist.get_world_size()


def _unlink_shm_buffer(dist) -> None:
    """Remove this rank's /dev/shm all-reduce buffer of DeepSpeed's CPU backend once every rank has mapped it.

    DeepSpeed's shm_comm (CPU accelerator, all ranks on one node) creates a 66 MiB shared-memory file per rank
    and never unlinks it, so every run leaked that much of /dev/shm. Every rank maps every other rank's file
    inside init_distributed, so after a barrier the names are no longer needed: the mappings stay valid, and
    the memory is freed when the last rank exits, however it exits.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    dist.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def prepare_ds_config(raw: dict, cfg: ElsaConfig, world_size: int) -> dict:
    """The DeepSpeed config the engine gets: ZeRO-3 checked, batch sizes derived from the global batch."""
    ds = {k: v for k, v in raw.items() if k != "elsa"}
    zero = ds.get("zero_optimization", {})
    if zero.get("stage") != 3:
        raise ElsaError(f'zero_optimization.stage must be 3 (got {zero.get("stage")!r}); elsa_ds partitions the ADMM states with ZeRO-3')
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ElsaError(f'remove the "{key}" block from the DeepSpeed config: elsa_ds builds the optimizer and schedule from the "elsa" block (lr, betas, ...)')
    if ds.get("fp16", {}).get("enabled"):
        raise ElsaError('fp16 is not supported: its loss scaler skips optimizer steps, which would desynchronize the ADMM schedule; use "bf16": {"enabled": true}')
    if float(zero.get("offload_optimizer", {}).get("ratio", 1.0)) < 1.0:
        raise ElsaError("offload_optimizer.ratio < 1 (partial offload) is not supported: remove it or set it to 1.0")
    global_batch = ds.get("train_batch_size")
    if not isinstance(global_batch, int) or global_batch <= 0:
        raise ElsaError('the DeepSpeed config must set "train_batch_size" (the global batch in sequences) to a positive integer')
    micro = cfg.micro_batch or ds.get("train_micro_batch_size_per_gpu", 1)
    if global_batch % (micro * world_size):
        raise ElsaError(
            f"train_batch_size {global_batch} is not a multiple of micro batch {micro} x {world_size} ranks; "
            f"change train_batch_size, --micro_batch or the number of ranks"
        )
    _check_nvme(zero, cfg.nvme_path)
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = global_batch // (micro * world_size)
    zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds["zero_optimization"] = zero
    ds.update(_CLIENT_OPTIMIZER_FLAGS)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


# swapped per sub-group in one optimizer step: fp32 master, exp_avg, exp_avg_sq, z, u, and the gradient
NVME_OPTIMIZER_BUFFERS = 6


def _check_nvme(zero: dict, nvme_path: str | None) -> None:
    """Apply --nvme_path and check every NVMe path and the swap buffer count before any heavy work."""
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key, {})
        if section.get("device") != "nvme":
            continue
        if nvme_path is not None:
            section["nvme_path"] = nvme_path
        path = section.get("nvme_path")
        if not path:
            raise ElsaError(f"zero_optimization.{key}.device is nvme but no nvme_path is set; pass --nvme_path DIR")
        if not Path(path).is_dir():
            raise ElsaError(f"NVMe path {path} (zero_optimization.{key}.nvme_path) does not exist or is not a directory; create it or pass --nvme_path DIR")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ElsaError(f"NVMe path {path} (zero_optimization.{key}.nvme_path) is not writable; pass --nvme_path DIR on a writable local disk")
    opt = zero.get("offload_optimizer", {})
    if opt.get("device") == "nvme" and int(opt.get("buffer_count", 4)) < NVME_OPTIMIZER_BUFFERS:
        raise ElsaError(
            f"zero_optimization.offload_optimizer.buffer_count is {opt.get('buffer_count', 4)}; ELSA swaps "
            f"{NVME_OPTIMIZER_BUFFERS} tensors per sub-group (master, exp_avg, exp_avg_sq, z, u, gradient): set it to at least {NVME_OPTIMIZER_BUFFERS}"
        )


def model_dtype(ds: dict) -> torch.dtype:
    return torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float32


def uses_nvme(ds: dict) -> bool:
    zero = ds["zero_optimization"]
    return "nvme" in (zero.get("offload_param", {}).get("device"), zero.get("offload_optimizer", {}).get("device"))


def uses_cpu_offload(ds: dict) -> bool:
    return ds["zero_optimization"].get("offload_optimizer", {}).get("device") in ("cpu", "nvme")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_ds_config: object  # must stay referenced: transformers reads ZeRO-3 settings through it


def load_model(model_id: str, ds: dict, gradient_checkpointing: bool = False) -> LoadedModel:
    """Load a causal LM straight into ZeRO-3 partitions (no full copy per rank), eager attention."""
    import torch._dynamo.polyfills.tensor  # noqa: F401  (must precede zero.Init: it patches Tensor.__new__)
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=model_dtype(ds), attn_implementation="eager")
    except OSError as err:
        raise ElsaError(f"cannot load model {model_id!r}: {err}".splitlines()[0]) from None
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return LoadedModel(model, keep_alive)


def base_optimizer(cfg: ElsaConfig, params, ds: dict) -> torch.optim.Optimizer:
    kind = cfg.base_optimizer
    if kind is BaseOptimizer.auto:
        kind = BaseOptimizer.cpu_adam if uses_cpu_offload(ds) else BaseOptimizer.adam
    common = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if kind is BaseOptimizer.cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=cfg.weight_decay > 0, **common)
    if kind is BaseOptimizer.adam8bit:
        import bitsandbytes as bnb

        return bnb.optim.Adam8bit(params, **common)
    return (torch.optim.AdamW if cfg.weight_decay > 0 else torch.optim.Adam)(params, **common)


@dataclass
class ZeroJob:
    """The engine and what the recipe needs to drive ADMM through it."""

    engine: object
    admm: AdmmOptimizer
    layout: list[SubGroupLayout]
    pruned: dict[int, str]
    comm: TorchDistComm

    @property
    def zero_optimizer(self):
        return self.engine.optimizer


def _initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds: dict):
    """deepspeed.initialize with a client optimizer; returns the engine and a Comm over its ZeRO group."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    if not hasattr(engine.optimizer, "fp32_partitioned_groups_flat"):
        raise ElsaError("the engine is not running ZeRO stage 3; check zero_optimization in the DeepSpeed config")
    device = "cpu" if get_accelerator().device_name() == "cpu" else get_accelerator().current_device_name()
    return engine, TorchDistComm(group=engine.optimizer.dp_process_group, device=device)


def full_shapes(model: torch.nn.Module, pruned: dict[int, str]) -> dict[str, tuple[int, ...]]:
    """Full (unpartitioned) shape of every pruned weight of a model built under ZeRO-3."""
    return {pruned[id(p)]: tuple(p.ds_shape) for p in model.parameters() if id(p) in pruned}


def build_engine(loaded: LoadedModel, cfg: ElsaConfig, ds: dict, pruned: dict[int, str], targets: dict[str, float | NM],
                 init_masks: MaskReader | None = None) -> ZeroJob:
    """deepspeed.initialize with AdmmOptimizer as ZeRO-3's basic optimizer, and the slice layout wired in.

    ``targets`` gives each pruned weight's sparsity or N:M pattern; ``init_masks`` warm-starts z from
    keep-masks on disk, each rank reading only its own slices.
    """
    model = loaded.model
    admm = AdmmOptimizer(base_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], ds), cfg.admm_settings())
    if init_masks is not None:
        init_masks.check(full_shapes(model, pruned))

        def initial_mask(sl: Slice) -> torch.Tensor:
            return init_masks.read(sl.layer, sl.start, sl.length)

        admm.initial_mask = initial_mask
    engine, comm = _initialize(model, admm, ds)
    admm.comm = comm
    if ds["zero_optimization"].get("offload_optimizer", {}).get("device") == "nvme":
        admm.on_state_created = keep_low_precision_states_in_memory
    s3 = engine.optimizer
    layout = build_layout(s3, pruned, targets, comm.rank, comm.world_size)
    for sg in layout:
        admm.assign(s3.fp32_partitioned_groups_flat[sg.index], sg.slices)
    return ZeroJob(engine, admm, layout, pruned, comm)


def build_plain_engine(loaded: LoadedModel, cfg: ElsaConfig, ds: dict):
    """The same engine for ordinary fine-tuning (no ADMM): the baseline of the overhead benchmark."""
    base = base_optimizer(cfg, [p for p in loaded.model.parameters() if p.requires_grad], ds)
    engine, comm = _initialize(loaded.model, base, ds)
    return engine, base, comm


def keep_low_precision_states_in_memory(state: dict) -> None:
    """Mark non-fp32 optimizer states (8-bit Adam's codes, fp8 z, bf16 u) as not swappable.

    DeepSpeed's NVMe swapper reads every swapped state back as fp32 (its buffers are fp32), which turns
    8-bit codes into wrong values; states it may not swap stay in CPU memory, and are small.
    """
    for value in state.values():
        if torch.is_tensor(value) and value.dtype != torch.float32:
            value.swappable = False


def pruned_params(job: ZeroJob) -> list[tuple[str, torch.nn.Parameter]]:
    by_id = {id(p): p for p in job.engine.module.parameters()}
    return [(name, by_id[pid]) for pid, name in job.pruned.items()]


@torch.no_grad()
def window_nll(job: ZeroJob, windows: torch.Tensor, micro_batch: int) -> tuple[float, int]:
    """Summed next-token NLL and token count over ``windows`` [n, seqlen], split across ranks. Collective.

    ZeRO-3 gathers parameters inside every forward, so every rank runs the same number of forwards;
    ranks without a window of their own run the first one and discard it.
    """
    engine, rank, world = job.engine, job.comm.rank, job.comm.world_size
    mine = windows[rank::world]
    rounds = -(-windows.shape[0] // (world * micro_batch))
    device = engine.device
    total = torch.zeros(2, dtype=torch.float64)
    was_training = engine.module.training
    engine.module.eval()
    for i in range(rounds):
        batch = mine[i * micro_batch:(i + 1) * micro_batch]
        real = batch.shape[0] > 0
        ids = (batch if real else windows[:1]).to(device)
        nll, count = token_nll(engine(input_ids=ids).logits, ids)
        if real:
            total += torch.tensor([nll, count], dtype=torch.float64)
    engine.module.train(was_training)
    job.comm.all_reduce_sum(total)
    return float(total[0]), int(total[1])


@contextlib.contextmanager
def magnitude_pruned_partitions(job: ZeroJob, pattern: NM | None = None):
    """Temporarily zero the 16-bit model partitions by one-shot magnitude pruning. Collective.

    The per-layer threshold comes from the same exact distributed selection ELSA uses, on each rank's
    own partition; on exit the partitions are restored from the fp32 masters (which were never touched).
    """
    s3, rank, world = job.zero_optimizer, job.comm.rank, job.comm.world_size
    if any(s3.fp32_partitioned_groups_flat[sg.index].numel() == 0 for sg in job.layout):
        raise ElsaError("the magnitude baseline needs resident fp32 masters; it is not available with NVMe optimizer offload (use --baseline none)")
    params = pruned_params(job)
    slices = [sl for sg in job.layout for sl in sg.slices]
    by_name = {name: p for name, p in params}
    parts = [local_partition(by_name[sl.layer], rank, world) for sl in slices]
    masks = projection_masks(parts, None, slices, job.comm, pattern)
    with _editing_partitions(s3):
        for v, m in zip(parts, masks):
            v.mul_(m.to(v.dtype))
    try:
        yield
    finally:
        with _editing_partitions(s3):
            for sg in job.layout:
                flat = s3.fp32_partitioned_groups_flat[sg.index]
                for sl in sg.slices:
                    local_partition(by_name[sl.layer], rank, world).copy_(flat.narrow(0, sl.offset, sl.length))


@contextlib.contextmanager
def _editing_partitions(zero_optimizer):
    """Release gathered parameters before editing ds_tensor partitions, re-gather persistent ones after.

    Parameters below stage3_param_persistence_threshold stay gathered between steps; without the
    re-gather the forward would keep using their old full copies. Collective.
    """
    zero_optimizer.checkpoint_event_prologue()
    yield
    zero_optimizer.checkpoint_event_epilogue()


def consolidated_state_dict(job: ZeroJob) -> dict[str, torch.Tensor] | None:
    """The full 16-bit state dict on rank 0 (None elsewhere), gathered one layer at a time. Collective."""
    return job.engine._zero3_consolidated_16bit_state_dict()


def export_model(job: ZeroJob, tokenizer, out_dir: Path) -> None:
    """Write a Hugging Face model (sharded safetensors, config, tokenizer) to ``out_dir``. Collective."""
    from huggingface_hub import save_torch_state_dict

    state_dict = consolidated_state_dict(job)
    if job.comm.rank != 0:
        return
    model = job.engine.module
    tied = [k for k in ("lm_head.weight",) if getattr(model.config, "tie_word_embeddings", False) and k in state_dict]
    for k in tied:  # the tie is restored by from_pretrained from the config
        del state_dict[k]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state_dict, out_dir, max_shard_size="5GB")
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def masters_sparsity(job: ZeroJob) -> dict[str, int]:
    """Zeros per pruned layer counted on the fp32 masters, summed over ranks. Collective."""
    names = sorted({sl.layer for sg in job.layout for sl in sg.slices})
    counts = torch.zeros(len(names), dtype=torch.float64)
    index = {n: i for i, n in enumerate(names)}
    s3 = job.zero_optimizer
    for sg in job.layout:
        flat = s3.fp32_partitioned_groups_flat[sg.index]
        for sl in sg.slices:
            counts[index[sl.layer]] += float((flat.narrow(0, sl.offset, sl.length) == 0).sum())
    job.comm.all_reduce_sum(counts)
    return {n: int(c) for n, c in zip(names, counts.tolist())}
