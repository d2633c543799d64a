"""The projection's histogram search in C++ (``select_cum_search``) against its torch reference."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm.kernels import ops
from elsa_ds.admm.kernels.select import cum_search_reference


def _histograms(rows: int, bins: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 5, (rows, bins), generator=g, dtype=torch.int32)
    hist *= (torch.rand(rows, bins, generator=g) < 0.3).to(torch.int32)  # mostly empty bins, as a key histogram's
    hist[0] = 0  # an empty row: every search clamps to the last position
    hist[1, :] = 0
    hist[1, 0] = 1 << 30  # one bin that holds more than an int32 running sum's half
    hist[1, -1] = 1 << 30
    hist[2, :-1] = 0  # everything in the top bin
    return hist.contiguous()


@pytest.mark.parametrize("from_top", [False, True], ids=["ascending", "from_top"])
@pytest.mark.parametrize("right", [True, False], ids=["right", "left"])
@pytest.mark.parametrize("bins", [1, 7, 65536])
def test_cum_search_equals_searchsorted_on_the_cumsum(kernels, from_top, right, bins):
    hist = _histograms(6, bins, seed=bins)
    totals = hist.sum(1, dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    for target in (torch.full_like(totals, -1), torch.zeros_like(totals), totals // 2, totals - 1, totals, totals + 1,
                   (torch.rand(totals.shape, generator=g, dtype=torch.float64) * (totals + 1)).to(torch.int64)):
        index, cum = ops.select_cum_search(kernels, hist=hist, target=target.contiguous(), from_top=from_top, right=right)
        ref_index, ref_cum = cum_search_reference(hist, target, from_top, right)
        assert torch.equal(index, ref_index), (target.tolist(), index.tolist(), ref_index.tolist())
        assert torch.equal(cum, ref_cum), (target.tolist(), cum.tolist(), ref_cum.tolist())
    assert torch.equal(ops.select_row_totals(kernels, hist=hist), totals)


def test_cum_search_refuses_a_wrong_shape(kernels):
    with pytest.raises(RuntimeError, match="int32"):
        ops.select_cum_search(kernels, hist=torch.zeros(2, 4, dtype=torch.int64), target=torch.zeros(2, dtype=torch.int64),
                              from_top=False, right=True)
    with pytest.raises(RuntimeError, match="int32"):
        ops.select_row_totals(kernels, hist=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="target"):
        ops.select_cum_search(kernels, hist=torch.zeros(2, 4, dtype=torch.int32), target=torch.zeros(3, dtype=torch.int64),
                              from_top=False, right=True)
