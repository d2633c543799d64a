"""MaskedOptimizer, the LoRA merge on plain tensors, and the LoRA export's state dict from peft's own names."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm.projection import Slice
from elsa_ds.errors import ElsaError
from elsa_ds.finetune.lora import add_adapters, merged_weight, plain_state_dict
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


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.proj = torch.nn.Linear(4, 6, bias=False)
        self.head = torch.nn.Linear(6, 5, bias=False)


def _peft_state(seed: int = 0) -> tuple[_Tiny, dict[str, torch.Tensor]]:
    """A plain model and the state dict of its peft twin (adapters on proj, as the job adds them): peft's own names."""
    torch.manual_seed(seed)
    plain = _Tiny()
    twin = _Tiny()
    twin.load_state_dict(plain.state_dict())
    return plain, dict(add_adapters(twin, ["proj.weight"], rank=2, alpha=4.0).state_dict())


def test_plain_state_dict_drops_merged_adapters_and_loads_into_the_plain_model():
    plain, state = _peft_state()
    assert any(".lora_B." in k for k in state)  # peft's naming, which the regex reads
    out = plain_state_dict(state)  # B starts at zero, as the in-place merge leaves it
    assert set(out) == set(plain.state_dict())
    fresh = _Tiny()
    fresh.load_state_dict(out, strict=True)
    for name, w in plain.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], w), name


def test_plain_state_dict_refuses_an_adapter_never_merged():
    _, state = _peft_state()
    b = next(k for k in state if ".lora_B." in k)
    state[b] = state[b].clone()
    state[b][3, 1] = 1e-3
    with pytest.raises(ElsaError, match=r"not merged into their base weights before the export \(1, the first proj\)"):
        plain_state_dict(state)
