"""The Triton next-token loss compiled for the GPU (elsa_ds/loss_kernel.py) equals the chunks (elsa_ds/loss.py) at
Gemma's vocabulary, and CUDA logits take it. Marked ``cuda`` (conftest.py); the same kernel under Triton's CPU
interpreter is tests/test_loss_kernel.py."""
from __future__ import annotations

import pytest
import torch

from elsa_ds import loss as L
from elsa_ds.evaluation.perplexity import token_nll

VOCAB = 262_144  # Gemma's


def _value_and_grad(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    x = logits.clone().requires_grad_()
    value = L.next_token_loss(x, ids)
    (0.5 * value).backward()
    return float(value), x.grad.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_logits_take_the_kernel_and_it_is_the_chunks_loss(dtype, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(2, 96, VOCAB, generator=gen, device="cuda")).to(dtype)
    ids = torch.randint(0, VOCAB, (2, 96), generator=gen, device="cuda")
    assert L.fused_disagrees(str(logits.device), dtype) is None
    assert L.loss_path(logits) == "fused"
    fused = _value_and_grad(logits, ids)
    nll_fused = token_nll(logits, ids)
    monkeypatch.setenv(L.LOSS_ENV, "chunked")
    assert L.loss_path(logits) == "chunked"
    chunked = _value_and_grad(logits, ids)
    nll_chunked = token_nll(logits, ids)
    assert fused[0] == pytest.approx(chunked[0], rel=1e-5)
    tol = (1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps) * float(chunked[1].abs().max())
    assert float((fused[1] - chunked[1]).abs().max()) <= tol
    assert float(fused[1][:, -1].abs().max()) == 0.0
    assert nll_fused[1] == nll_chunked[1] and nll_fused[0] == pytest.approx(nll_chunked[0], rel=1e-5)
