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


def test_the_backwards_scale_is_torchs_fp32_product_rounded_to_nearest_past_2_to_the_31():
    """loss_kernel.scale_ on the GPU: bit for bit torch's fp32 product rounded once (round to nearest, as the compile
    test reads in the PTX), over more entries than an int32 indexes (the 32 x 512 cells' gradient: 16,384 x 262,144)."""
    from elsa_ds.loss_kernel import scale_

    n = 2**31 + 4099  # 4 GiB of bf16 and a block's tail
    grad = torch.randn(n // 1024 + 1, 1024, device="cuda", dtype=torch.bfloat16).reshape(-1)[:n]
    scale = torch.tensor(1.0 / 3.0, device="cuda")
    ends = torch.cat([grad[:8192], grad[-8192:]]).float()
    scale_(grad, scale)
    assert torch.equal(torch.cat([grad[:8192], grad[-8192:]]), (ends * scale).to(torch.bfloat16))
