"""The projection's histogram pass on any number of OpenMP threads equals the keys' histogram counted in torch.

Each thread histograms a contiguous range of pieces into one block per slice it meets, and each output bin sums the
blocks of its slice (csrc/select.cpp, histogram). Here: slices listed out of offset order (the plan walks them by
offset, so a thread's slices are not consecutive indices), a slice cut between threads, an empty one, one that keeps
nothing (prefix -1), more threads than pieces; 1, 2, 3 and 8 threads give the same counts and peaks, bit for bit,
and those equal torch's bincount of the keys.
"""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm.kernels import ops
from elsa_ds.admm.kernels.ops import ScoreSource, SliceTable
from elsa_ds.admm.projection import Slice

CHUNK = 1 << 15  # csrc/plan.h's kChunk: a piece holds at most this many entries
EMPTY, EMPTY_I64 = torch.empty(0), torch.empty(0, dtype=torch.int64)
# index order differs from offset order; "b" spans three pieces, "e" is empty, "c" is smaller than one piece
SLICES = [Slice("a", 2 * CHUNK + 9000, CHUNK + 77, 0, CHUNK + 77, 100), Slice("b", 11, 2 * CHUNK + 5000, 0, 2 * CHUNK + 5000, 50),
          Slice("e", 2 * CHUNK + 5020, 0, 0, 0, 0), Slice("c", 3 * CHUNK + 9100, 4001, 0, 4001, 7)]
N = 3 * CHUNK + 9100 + 4001 + 5


def _keys(x: torch.Tensor) -> torch.Tensor:
    """The magnitude score key of each entry: the fp32 bits of v², as select.cpp computes it (v = x)."""
    return (x * x).view(torch.int32).to(torch.int64)


def _run(kernels, x: torch.Tensor, prefix: torch.Tensor, stride: int, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = ScoreSource(x, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY)
        return ops.select_histogram(kernels, source=source, table=SliceTable.of(SLICES), prefix=prefix, stride=stride)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def flat() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(3))


def test_high_digit_histogram_and_peaks_equal_torch_on_any_thread_count(kernels, flat):
    keys = _keys(flat)
    for threads in (1, 2, 3, 8):
        hist, peaks = _run(kernels, flat, EMPTY_I64, 1, threads)
        assert hist.shape == (len(SLICES), 1 << 16)
        for j, sl in enumerate(SLICES):
            part = keys.narrow(0, sl.offset, sl.length)
            assert torch.equal(hist[j].to(torch.int64), torch.bincount(part >> 16, minlength=1 << 16)), (threads, sl.name)
            want = float(flat.narrow(0, sl.offset, sl.length).abs().max()) if sl.length else 0.0
            assert float(peaks[j]) == want, (threads, sl.name)


def test_low_digit_histogram_under_a_prefix_equals_torch_on_any_thread_count(kernels, flat):
    keys = _keys(flat)
    prefix = torch.tensor([int(keys[sl.offset + sl.length // 2] >> 16) if sl.length else -1 for sl in SLICES])
    prefix[3] = -1  # a layer that keeps nothing: no second digit
    for threads in (1, 3, 8):
        hist, _ = _run(kernels, flat, prefix, 1, threads)
        for j, sl in enumerate(SLICES):
            part = keys.narrow(0, sl.offset, sl.length)
            want = torch.zeros(1 << 16, dtype=torch.int64)
            if prefix[j] >= 0:
                want = torch.bincount(part[(part >> 16) == prefix[j]] & 0xFFFF, minlength=1 << 16)
            assert torch.equal(hist[j].to(torch.int64), want), (threads, sl.name)


def test_the_sample_is_the_same_on_any_thread_count(kernels, flat):
    one, _ = _run(kernels, flat, EMPTY_I64, 16, 1)
    assert 0 < int(one.sum()) < N  # a sample: some blocks, not all
    for threads in (2, 3, 8):
        assert torch.equal(_run(kernels, flat, EMPTY_I64, 16, threads)[0], one), threads
