"""Engines for retraining under ZeRO-3: MaskedOptimizer as the basic optimizer (full), or LoRA adapters (lora).

full: every parameter trains; the pruned layers' slices of ZeRO-3's flat fp32 partitions carry a fixed keep-mask,
read per rank from the bit-packed mask file (``mask_file.py``) and kept in the optimizer state, so it is partitioned,
offloaded and checkpointed with Adam's moments. lora: peft adapters on the pruned layers, the base weights frozen;
``deepspeed.initialize`` partitions the adapters it finds unpartitioned.
"""
from __future__ import annotations

import torch

from elsa_ds.admm.projection import Slice
from elsa_ds.files.mask_file import MaskReader
from elsa_ds.finetune.optimizer import MaskedOptimizer
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.targets import LayerGoal
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import ZeroEngine, base_optimizer, full_shapes, initialize, initialize_sliced


def build_masked_engine(model: torch.nn.Module, cfg: ElsaConfig, ds: DsConfig, pruned: dict[int, str], goals: dict[str, LayerGoal],
                        masks: MaskReader | None) -> tuple[ZeroEngine, torch.optim.Optimizer]:
    """deepspeed.initialize with MaskedOptimizer (or, without masks: the dense control, the plain base optimizer) as
    ZeRO-3's basic optimizer. Returns the engine and the optimizer whose ``param_groups`` carry the learning rate."""
    base = base_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], ds)
    if masks is None:
        engine, comm = initialize(model, base, ds)
        return ZeroEngine(engine, [], pruned, comm), base
    masks.check(full_shapes(model, pruned))

    def initial_mask(sl: Slice) -> torch.Tensor:
        return masks.read(sl.layer, sl.start, sl.length)

    masked = MaskedOptimizer(base, initial_mask)
    return initialize_sliced(model, masked, ds, pruned, goals), masked


def build_lora_engine(model: torch.nn.Module, cfg: ElsaConfig, ds: DsConfig, pruned: dict[int, str],
                      ) -> tuple[ZeroEngine, torch.optim.Optimizer]:
    """peft LoRA adapters (rank ``cfg.lora_rank``, scaling α/r) on every pruned Linear, then deepspeed.initialize with
    the base optimizer over the adapters alone."""
    from elsa_ds.finetune.lora import add_adapters

    peft_model = add_adapters(model, list(pruned.values()), cfg.lora_rank, cfg.lora_alpha)
    base = base_optimizer(cfg, [p for p in peft_model.parameters() if p.requires_grad], ds)
    engine, comm = initialize(peft_model, base, ds)
    return ZeroEngine(engine, [], pruned, comm), base
