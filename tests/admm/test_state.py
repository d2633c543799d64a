from __future__ import annotations

import pytest
import torch

from elsa_ds.admm import state
from elsa_ds.admm.state import StateDtype


@pytest.mark.parametrize("dtype, rel_tol", [(StateDtype.fp32, 0.0), (StateDtype.bf16, 2 ** -8), (StateDtype.fp8, 2 ** -3)])
def test_store_load_roundtrip_within_dtype_precision(dtype, rel_tol):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, generator=g) * 1e-3, torch.randn(50, generator=g) * 10
    data, scales = state.allocate(150, dtype, 2)
    state.store(data, scales, 0, 0, a)
    state.store(data, scales, 1, 100, b)
    for j, (off, v) in enumerate(((0, a), (100, b))):
        back = state.load(data, scales, j, off, v.numel())
        assert back.dtype == torch.float32
        # per-slice scale: small-valued slice keeps its relative precision next to a large one
        big = v.abs() > v.abs().max() * 2 ** -6
        assert torch.allclose(back[big], v[big], rtol=rel_tol, atol=0)
        assert torch.isfinite(back).all()
        assert float(back.abs().max()) == pytest.approx(float(v.abs().max()), rel=rel_tol)


def test_low_precision_storage_is_smaller():
    for dtype, size in ((StateDtype.fp32, 4), (StateDtype.bf16, 2), (StateDtype.fp8, 1)):
        data, _ = state.allocate(10, dtype, 1)
        assert data.element_size() == size


def test_zero_slice_does_not_divide_by_zero():
    data, scales = state.allocate(4, StateDtype.fp8, 1)
    state.store(data, scales, 0, 0, torch.zeros(4))
    assert torch.equal(state.load(data, scales, 0, 0, 4), torch.zeros(4))
