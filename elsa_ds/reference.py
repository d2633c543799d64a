"""The single-process reference: the same AdmmOptimizer on an ordinary model, no DeepSpeed.

Every pruned weight is one flat tensor with one slice, the batches are the same global batches, the
gradient is the mean over the global batch, clipped by global norm like ZeRO-3 clips it. ZeRO-3 runs on
any number of ranks, with or without offload, must reproduce its masks (up to float reduction order).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from elsa_ds.admm.optimizer import AdmmOptimizer
from elsa_ds.admm.projection import Slice, keep_count
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.data import GlobalBatches
from elsa_ds.files.mask_file import MaskReader
from elsa_ds.loss import next_token_loss
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.targets import goal_ratio


def train_reference(model: torch.nn.Module, cfg: ElsaConfig, batches: GlobalBatches, pruned: dict[int, str],
                    gradient_clipping: float | None = None, init_masks: MaskReader | None = None) -> dict[str, torch.Tensor]:
    """Run ELSA on ``model`` in place; returns name -> keep-mask of every pruned weight."""
    params = [p for p in model.parameters() if p.requires_grad]
    base = torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0)
    admm = AdmmOptimizer(base, cfg.admm_settings())
    if init_masks is not None:
        admm.initial_mask = lambda sl: init_masks.read(sl.layer, sl.start, sl.length)
    weights = {pid: p for p in params if (pid := id(p)) in pruned}
    goals = cfg.layer_goals({pruned[pid]: tuple(w.shape) for pid, w in weights.items()})
    for pid, w in weights.items():
        ratio = goal_ratio(goals[pruned[pid]])
        admm.assign(w, [Slice(pruned[pid], 0, w.numel(), 0, w.numel(), keep_count(w.numel(), ratio))])
    train_loop(model, admm, cfg, batches, gradient_clipping, admm.begin_step)
    return {pruned[pid]: (w.detach() != 0) for pid, w in weights.items()}


def train_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: ElsaConfig, batches: GlobalBatches,
               gradient_clipping: float | None = None, begin_step: Callable[[int], None] | None = None) -> None:
    """``cfg.steps`` steps of ``opt`` (its params: the trainable ones): the lr schedule, the mean loss over each global
    batch, global-norm clipping. ``begin_step(step)`` runs first in every step (ADMM: λ and the projection flags)."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for step in range(cfg.steps):
        if begin_step is not None:
            begin_step(step)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        opt.zero_grad()
        micro = batches.micro_batches(step)
        for ids in micro:
            (next_token_loss(model(input_ids=ids, use_cache=False).logits, ids) / len(micro)).backward()
        if gradient_clipping:
            torch.nn.utils.clip_grad_norm_(params, gradient_clipping)
        opt.step()
