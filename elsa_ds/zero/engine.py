"""The engine: the model loaded into ZeRO-3 partitions, AdmmOptimizer installed as ZeRO-3's basic optimizer.

ZeRO-3 hands its basic optimizer one flat fp32 tensor per sub-group (this rank's share of many parameters);
``layout.py`` says which ranges of it belong to which pruned layer, and AdmmOptimizer keeps z and u in the
optimizer state beside the moments, where DeepSpeed partitions, offloads, swaps and checkpoints them.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from elsa_ds import torch_api
from elsa_ds.admm.optimizer import AdmmOptimizer
from elsa_ds.admm.projection import Slice, TorchDistComm
from elsa_ds.errors import ElsaError, require
from elsa_ds.files.mask_file import MaskReader
from elsa_ds.finetune.optimizer import MaskedOptimizer
from elsa_ds.log import get_logger
from elsa_ds.models import ModelSource
from elsa_ds.settings.config import BaseOptimizer, ElsaConfig
from elsa_ds.targets import LayerGoal, decoder_layer_list
from elsa_ds.zero import compat
from elsa_ds.zero.ds_config import DsConfig, linear_wrapped
from elsa_ds.zero.layout import SubGroupLayout, build_layout


def model_dtype(ds: dict) -> torch.dtype:
    return torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float32


@dataclass
class PartitionedModel:
    model: torch.nn.Module
    hf_ds_config: object  # must stay referenced: transformers reads ZeRO-3 settings through it


def load_partitioned(source: ModelSource, ds: DsConfig, gradient_checkpointing: bool = False,
                     random_init: bool = False, leaf_layers: bool = False) -> PartitionedModel:
    """Load a causal LM straight into ZeRO-3 partitions (no full copy of the model on any rank); a model given in
    memory is partitioned by deepspeed.initialize instead. ``leaf_layers``: its decoder layers ZeRO-3 leaf modules."""
    from transformers.integrations import HfDeepSpeedConfig

    torch_api.prepare_torch_for_zero_init()
    keep_alive = HfDeepSpeedConfig(ds.raw)
    nvme_params = ds.param_device == "nvme"
    with compat.zero3_init_one_module_at_a_time() if random_init and nvme_params else contextlib.nullcontext():
        model = source.load(model_dtype(ds.raw), random_init)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if leaf_layers:
        compat.mark_leaf_layers(decoder_layer_list(model))
    if not linear_wrapped(ds.zero):
        compat.torch_linear_back()
    return PartitionedModel(model, keep_alive)


class AdamSettings(TypedDict):
    """The settings every base optimizer takes, by keyword."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def base_optimizer(cfg: ElsaConfig, params, ds: DsConfig) -> torch.optim.Optimizer:
    """The optimizer ADMM wraps (and the one a plain fine-tuning run steps)."""
    kind = cfg.base_optimizer
    if kind is BaseOptimizer.auto:
        kind = BaseOptimizer.cpu_adam if ds.optimizer_offloaded else BaseOptimizer.adam
    common = AdamSettings(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if kind is BaseOptimizer.cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=cfg.weight_decay > 0, **common)
    if kind is BaseOptimizer.adam8bit:
        bnb = require("bitsandbytes", "8bit", "base_optimizer adam8bit (ELSA-L)")
        return bnb.optim.Adam8bit(params, **common)
    if kind is BaseOptimizer.adam8bit_minifloat:
        from elsa_ds.admm.adam8bit import Adam8bit
        from elsa_ds.admm.kernels.quant8 import MINIFLOAT

        return Adam8bit(params, format=MINIFLOAT, **common)
    return (torch.optim.AdamW if cfg.weight_decay > 0 else torch.optim.Adam)(params, **common)


_BUILT: weakref.WeakSet = weakref.WeakSet()  # the engines this process built and has not released (release_engines)


def built_engines() -> frozenset[int]:
    """The ids of the engines this process holds now: what :func:`release_engines` leaves alone."""
    return frozenset(id(engine) for engine in _BUILT)


def release_engines(kept: frozenset[int] = frozenset(), destroy: bool = True) -> None:
    """Give up the engines this process built but those in ``kept`` (a caller's own, built before the job): a job run
    from Python ends with it, so that the next call does not find the last one's states still held (the command line's
    process just exits). ``destroy`` False (the job stopped by Ctrl-C or an exit: a rank may be inside a collective
    its peers never join, and ``destroy`` synchronizes the device): the references and ZeRO-3's records of the engine
    alone. Never raises (a review: an error here would hide the job's own); a failure is a warning."""
    try:
        for engine in [e for e in list(_BUILT) if id(e) not in kept]:
            _BUILT.discard(engine)
            try:
                compat.release_engine(engine, destroy)
            except Exception as err:  # noqa: BLE001 - the job's own outcome matters more than the cleanup's
                get_logger(__name__).warning(f"the finished job's DeepSpeed engine could not be given up ({err}); its "
                                             "memory may stay held until the process ends")
    finally:
        gc.collect()


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds: DsConfig):
    """deepspeed.initialize with a client optimizer; returns the engine and a Comm over its data-parallel group."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds.raw)
    _BUILT.add(engine)
    if not compat.is_stage3(engine.optimizer):
        raise ElsaError("the engine is not running ZeRO stage 3; check zero_optimization in the DeepSpeed config")
    device = "cpu" if get_accelerator().device_name() == "cpu" else get_accelerator().current_device_name()
    return engine, TorchDistComm(group=compat.data_parallel_group(engine.optimizer), device=device)


@dataclass
class ZeroEngine:
    """The DeepSpeed engine and what a job needs beside it: which ranges of the flat partitions are which pruned layer
    (``layout``: empty when nothing is masked), the pruned weights by ``id`` and the data-parallel ``comm``. The basic
    optimizer a builder installs (AdmmOptimizer, MaskedOptimizer or the plain one) is returned next to it."""

    engine: Any  # deepspeed.DeepSpeedEngine, which DeepSpeed leaves untyped
    layout: list[SubGroupLayout]
    pruned: dict[int, str]
    comm: TorchDistComm

    @property
    def zero_optimizer(self):
        return self.engine.optimizer


def full_shapes(model: torch.nn.Module, pruned: dict[int, str]) -> dict[str, tuple[int, ...]]:
    """Full (unpartitioned) shape of every pruned weight of a model built under ZeRO-3."""
    return {pruned[id(p)]: compat.full_shape(p) for p in model.parameters() if id(p) in pruned}


def build_admm_engine(model: torch.nn.Module, cfg: ElsaConfig, ds: DsConfig, pruned: dict[int, str],
                      goals: dict[str, LayerGoal], init_masks: MaskReader | None = None) -> tuple[ZeroEngine, AdmmOptimizer]:
    """deepspeed.initialize with AdmmOptimizer as ZeRO-3's basic optimizer, and the slice layout wired in.

    ``goals`` gives each pruned weight's sparsity or N:M pattern; ``init_masks`` warm-starts z from keep-masks on
    disk, each rank reading only its own slices.
    """
    admm = AdmmOptimizer(base_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], ds), cfg.admm_settings())
    if init_masks is not None:
        init_masks.check(full_shapes(model, pruned))

        def initial_mask(sl: Slice) -> torch.Tensor:
            return init_masks.read(sl.layer, sl.start, sl.length)

        admm.initial_mask = initial_mask
    zero = initialize_sliced(model, admm, ds, pruned, goals)
    admm.comm = zero.comm
    return zero, admm


def initialize_sliced(model: torch.nn.Module, wrapper: AdmmOptimizer | MaskedOptimizer, ds: DsConfig, pruned: dict[int, str],
                      goals: dict[str, LayerGoal]) -> ZeroEngine:
    """deepspeed.initialize with a wrapper that knows the pruned slices (AdmmOptimizer, MaskedOptimizer) as ZeRO-3's
    basic optimizer; each sub-group's flat partition is handed its slices (``layout.py``)."""
    engine, comm = initialize(model, wrapper, ds)
    if ds.optimizer_on_nvme:
        wrapper.on_state_created = keep_low_precision_states_in_memory
    layout = build_layout(engine.optimizer, pruned, goals, comm.rank, comm.world_size)
    for sg in layout:
        wrapper.assign(compat.flat_partition(engine.optimizer, sg.index), sg.slices)
    return ZeroEngine(engine, layout, pruned, comm)


def keep_low_precision_states_in_memory(state: dict) -> None:
    """Keep non-fp32 optimizer states (8-bit Adam's codes, fp8 z, bf16 u) out of the NVMe swapper.

    DeepSpeed's NVMe swapper reads every swapped state back as fp32 (its buffers are fp32), which turns 8-bit
    codes into wrong values; states it may not swap stay in CPU memory, and are small.
    """
    for value in state.values():
        if torch.is_tensor(value) and value.dtype != torch.float32:
            compat.keep_out_of_swapper(value)
