"""MaskedOptimizer and the LoRA merge on plain tensors."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm.projection import Slice
from elsa_ds.errors import ElsaError
from elsa_ds.finetune.lora import merged_state_dict, merged_weight
from elsa_ds.finetune.optimizer import KEEP, MaskedOptimizer


def _setup(weight_decay=0.1):
    torch.manual_seed(0)
    flat = torch.nn.Parameter(torch.randn(50))
    keep = torch.rand(30) > 0.7  # the pruned layer: entries [10, 40) of the flat
    with torch.no_grad():
        flat[10:40] *= keep
    base = torch.optim.AdamW([flat], lr=0.1, weight_decay=weight_decay)
    opt = MaskedOptimizer(base, lambda sl: keep[sl.start:sl.start + sl.length])
    # the layer is cut in two slices, as ZeRO-3 cuts a weight between ranks' partitions
    opt.assign(flat, [Slice("w", 10, 12, 0, 30, int(keep.sum())), Slice("w", 22, 18, 12, 30, int(keep.sum()))])
    return flat, keep, opt


def test_pruned_entries_stay_exactly_zero_and_the_rest_trains():
    flat, keep, opt = _setup()
    start = flat.detach().clone()
    for _ in range(5):
        opt.zero_grad()
        (flat * torch.linspace(1, 2, 50)).square().sum().backward()
        opt.step()
    layer = flat.detach()[10:40]
    assert torch.equal(layer != 0, keep)                       # bitwise the mask
    assert (flat.detach()[keep.nonzero().squeeze() + 10] != start[keep.nonzero().squeeze() + 10]).all()
    assert (flat.detach()[:10] != start[:10]).all()            # entries outside the pruned layer train freely
    st = opt.state[flat]
    assert st[KEEP].dtype == torch.bool and torch.equal(st[KEEP][10:40], keep) and st[KEEP][:10].all()
    assert torch.count_nonzero(st["exp_avg"][10:40][~keep]) == 0


def test_state_dict_round_trip_restores_the_bool_mask():
    flat, keep, opt = _setup()
    opt.zero_grad()
    flat.square().sum().backward()
    opt.step()
    saved = opt.state_dict()
    flat2, _, opt2 = _setup()
    opt2.base.load_state_dict(saved)
    assert opt2.state[flat2][KEEP].dtype == torch.float32   # what torch alone does: states cast to the param's dtype
    flat2, _, opt2 = _setup()
    opt2.load_state_dict(saved)
    assert opt2.state[flat2][KEEP].dtype == torch.bool
    assert torch.equal(opt2.state[flat2][KEEP], opt.state[flat][KEEP])


def test_lora_merge_keeps_the_mask():
    torch.manual_seed(0)
    keep = torch.rand(6, 4) > 0.5
    w = (torch.randn(6, 4) * keep).to(torch.bfloat16)
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    out = merged_weight(w, a, b, 0.5, keep)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out != 0, keep)
    assert torch.equal(out, ((w.float() + 0.5 * b @ a) * keep).to(torch.bfloat16))
    dense = merged_weight(w, a, b, 0.5, None)
    assert int((dense == 0).sum()) < int((~keep).sum())         # without a mask the update fills the zeros


def _peft_state(b: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"base_model.model.layers.0.proj.base_layer.weight": torch.ones(6, 4, dtype=torch.bfloat16),
            "base_model.model.layers.0.proj.lora_A.default.weight": torch.randn(2, 4),
            "base_model.model.layers.0.proj.lora_B.default.weight": b, "base_model.model.embed.weight": torch.ones(3, 4)}


def test_merged_state_dict_drops_merged_adapters_and_renames_keys():
    state = _peft_state(torch.zeros(6, 2))
    plain = merged_state_dict(state)
    assert set(plain) == {"layers.0.proj.weight", "embed.weight"}
    assert plain["layers.0.proj.weight"] is state["base_model.model.layers.0.proj.base_layer.weight"]


def test_merged_state_dict_refuses_an_adapter_never_merged():
    b = torch.zeros(6, 2)
    b[3, 1] = 1e-3
    with pytest.raises(ElsaError, match="1 LoRA adapters .*layers.0.proj.* not merged"):
        merged_state_dict(_peft_state(b))
