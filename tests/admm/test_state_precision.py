"""ELSA-L's storage at its edges (issue 10): bf16 without a scale, fp8 with a per-layer scale, and the 8-bit second
moment read back exactly as bitsandbytes reads it."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm import state as admm_state
from elsa_ds.admm.kernels.quant8 import dequantize_blockwise
from elsa_ds.admm.optimizer import second_moment
from elsa_ds.admm.state import StateDtype


def _roundtrip(values: torch.Tensor, dtype: StateDtype) -> torch.Tensor:
    data, scales = admm_state.allocate(values.numel(), dtype, 1)
    peak = values.abs().max().view(1)
    admm_state.store(data, scales, 0, 0, values, admm_state.layer_scales(peak, dtype)[0])
    return admm_state.load(data, scales, 0, 0, values.numel())


@pytest.mark.parametrize("dtype", [StateDtype.bf16, StateDtype.fp8])
def test_tiny_peak_and_exact_zeros_survive_storage(dtype):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=g) * 1e-8 / 4
    values[::7] = 0.0
    values[5] = 1e-8
    back = _roundtrip(values, dtype)
    assert torch.equal(back[::7], torch.zeros_like(back[::7]))         # zeros stay exactly zero
    nonzero = values != 0
    rel = ((back - values).abs() / values.abs())[nonzero]
    # a peak of 1e-8 is neither flushed to zero nor saturated: relative rounding of the format only
    bound = 2.0 ** -8 if dtype is StateDtype.bf16 else 2.0 ** -3
    big = values.abs() > 1e-8 / 64 if dtype is StateDtype.fp8 else nonzero  # fp8's subnormal range is coarser
    assert float(rel[big[nonzero]].max()) <= bound
    assert float(back[5]) == pytest.approx(1e-8, rel=bound)


def test_bf16_is_stored_plainly_and_an_all_zero_layer_stays_zero():
    values = torch.tensor([0.0, -3.0e-30, 1.5, 2.0 ** 100])
    back = _roundtrip(values, StateDtype.bf16)
    assert torch.equal(back, values.to(torch.bfloat16).float())
    zeros = _roundtrip(torch.zeros(300), StateDtype.fp8)
    assert torch.equal(zeros, torch.zeros(300)) and bool(torch.isfinite(zeros).all())


@pytest.mark.parametrize("n", [4097, 5000, 65025])
def test_eight_bit_second_moment_equals_bitsandbytes_dequantization(n):
    import bitsandbytes.functional as F  # the dev extra installs it

    g = torch.Generator().manual_seed(n)
    v = torch.rand(n, generator=g) ** 4 * 1e-3                          # a second moment: non-negative, skewed
    qmap = F.create_dynamic_map(signed=False)
    codes, qstate = F.quantize_blockwise(v, code=qmap, blocksize=256)
    theirs = F.dequantize_blockwise(codes, qstate)
    ours = dequantize_blockwise(codes, qstate.code, qstate.absmax)
    assert torch.equal(ours, theirs)
    st = {"state2": codes, "qmap2": qstate.code, "absmax2": qstate.absmax}
    assert torch.equal(second_moment(st), theirs)
