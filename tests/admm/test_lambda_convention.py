"""λ convention: a paper λ (the ELSA authors' trainer on W processes) is λ_paper / W in elsa_ds.

Their ``_proximal_update`` (``lib/optimizers.py``) runs inside ``optimizer.step()``, after FSDP has averaged the gradient
over the W ranks (and HF Trainer/accelerate divided each micro-batch loss by the accumulation steps) and after the
gradient clipping, and adds ``λ (x − z + u) / W``. elsa_ds adds ``λ (x − z + u)`` once to the rank- and
accumulation-averaged gradient. One step of each on a tiny Llama, from the same x, z, u and Adam state, must agree.
"""
from __future__ import annotations

import copy

import torch

from elsa_ds.admm.optimizer import Z, Z_SCALE, U, U_SCALE, AdmmOptimizer, AdmmSettings
from elsa_ds.admm.projection import Slice, keep_count
from elsa_ds.admm.state import store

W, LAMBDA_PAPER, BETAS, LR, CLIP = 2, 2e-3, (0.9, 0.95), 1e-3, 1.0


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).float()


def _pruned(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.endswith("proj.weight")}


def _mean_loss_grad(model, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def _z_u(weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, w in weights.items():
        keep = torch.rand(w.shape, generator=g) > 0.7
        out[name] = ((w.detach() * keep).flatten().clone(), 0.01 * torch.randn(w.numel(), generator=g))
    return out


def _authors_step(model, opt, rank_batches, z_u) -> None:
    """Per rank: the mean loss's gradient; FSDP: their average; Trainer: clipping; their step: + λ/W (x − z + u); Adam."""
    grads = []
    for ids in rank_batches:
        _mean_loss_grad(model, ids)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n, p in model.named_parameters():
        p.grad = sum(g[n] for g in grads) / W
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    with torch.no_grad():
        for name, w in _pruned(model).items():
            z, u = z_u[name]
            w.grad.add_((LAMBDA_PAPER * (w.detach().flatten() - z + u)).view_as(w) / W)
    opt.step()


def _ours(model, lam: float) -> AdmmOptimizer:
    admm = AdmmOptimizer(torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS), AdmmSettings(total_steps=100, interval=50, lmda=lam))
    for name, w in _pruned(model).items():
        admm.assign(w, [Slice(name, 0, w.numel(), 0, w.numel(), keep_count(w.numel(), 0.7))])
    return admm


def _our_step(model, admm, step, ids, z_u=None) -> None:
    """elsa_ds: the gradient of the global batch's mean loss (what ZeRO-3 averages to), clipped, then the ADMM step."""
    admm.begin_step(step)
    _mean_loss_grad(model, ids)
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    admm.step()
    if z_u is not None:  # replace z and u (created by the first step) with the ones both sides share
        for name, w in _pruned(model).items():
            st = admm.state[w]
            store(st[Z], st[Z_SCALE], 0, 0, z_u[name][0])
            store(st[U], st[U_SCALE], 0, 0, z_u[name][1])


def test_paper_lambda_is_ours_times_world_size():
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2 * W, 16), generator=g) for _ in range(2)]  # global batch 2 per rank, 2 steps
    start = _tiny_llama()
    z_u = _z_u(_pruned(start))

    theirs = copy.deepcopy(start)
    their_opt = torch.optim.Adam(theirs.parameters(), lr=LR, betas=BETAS)
    _mean_loss_grad(theirs, batches[0])  # step 0: a plain Adam step on both sides (z and u do not exist yet in elsa_ds)
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), CLIP)
    their_opt.step()
    _authors_step(theirs, their_opt, batches[1].chunk(W), z_u)

    results = {}
    for lam in (LAMBDA_PAPER / W, LAMBDA_PAPER):
        ours = copy.deepcopy(start)
        admm = _ours(ours, lam)
        _our_step(ours, admm, 0, batches[0], z_u)
        _our_step(ours, admm, 1, batches[1])
        results[lam] = ours

    for name, w in _pruned(theirs).items():
        torch.testing.assert_close(_pruned(results[LAMBDA_PAPER / W])[name], w, rtol=0, atol=1e-6)
    moved = [(w - _pruned(start)[n]).abs().max() for n, w in _pruned(theirs).items()]
    differs = [(_pruned(results[LAMBDA_PAPER])[n] - w).abs().max() for n, w in _pruned(theirs).items()]
    assert max(differs) > 1e-4 and max(moved) > 1e-4  # λ_ours = λ_paper would be a different (W times stronger) penalty
