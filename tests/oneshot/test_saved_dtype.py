"""What a one-shot job writes its model in: the DeepSpeed config's bf16 (as an ELSA job with that config exports), else
the host copy's dtype; the pruned perplexity is taken on the weights rounded as they are saved (zeros kept)."""
from __future__ import annotations

import torch

from elsa_ds.oneshot.pipeline import host_dtype, round_to, saved_dtype


def test_the_config_s_bf16_is_what_a_one_shot_job_saves_and_a_host_copy_is_never_widened():
    assert saved_dtype({"bf16": {"enabled": True}}) is torch.bfloat16
    assert saved_dtype({"bf16": {"enabled": False}}) is host_dtype()
    assert saved_dtype({}) is host_dtype()


def test_rounding_keeps_the_dtype_and_the_zeros_and_saving_then_changes_no_value():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        model[0].weight[:, ::3] = 0
    zeros = model[0].weight == 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    round_to(model, torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype is torch.float32 and torch.equal(p, before[name].to(torch.bfloat16).float()), name
    assert torch.equal(model[0].weight == 0, zeros) and not all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    rounded = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(torch.bfloat16)
    assert all(torch.equal(p.float(), rounded[n]) for n, p in model.named_parameters())  # the saved values are the measured
