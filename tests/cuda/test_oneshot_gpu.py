"""SparseGPT on a CUDA device: its column loop never waits on the GPU (a boolean index did, once a column: the one-shot
start of three curve cells sharing an H200 took 54-56 s, Wanda's calibration alone 15.5 s), and it prunes as on the
host. Marked ``cuda`` (conftest.py)."""
from __future__ import annotations

import warnings

import torch

from elsa_ds.oneshot.sparsegpt import sparsify_weight


def _syncs(fn) -> int:
    """How many times ``fn`` waited on the GPU (torch's sync debug mode, one warning each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def _layer(cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weight, x = torch.randn(96, cols, generator=gen), torch.randn(2048, cols, generator=gen)
    return weight, 2 * x.t() @ x / x.shape[0]


def test_the_column_loop_does_not_wait_on_the_gpu_and_prunes_as_the_host_does():
    gen = torch.Generator().manual_seed(0)
    small, large = (tuple(t.cuda() for t in _layer(cols, gen)) for cols in (512, 1024))
    # four blocks each (a block's mask selection waits ~17 times, the Cholesky a few): a wait a column would add 512
    extra = _syncs(lambda: sparsify_weight(*large, 0.9, blocksize=256)) - _syncs(lambda: sparsify_weight(*small, 0.9))
    assert extra < 32, f"{extra} more waits on the GPU for 512 more columns in as many blocks: one a column is back"
    weight, hessian = (t.cpu() for t in small)
    host_w, host_keep, host_loss = sparsify_weight(weight, hessian, 0.9)
    gpu_w, gpu_keep, gpu_loss = sparsify_weight(*small, 0.9)
    assert int(gpu_keep.sum()) == int(host_keep.sum()) == round(0.1 * weight.numel())
    assert float((gpu_keep.cpu() == host_keep).float().mean()) > 0.99  # the same mask but for near ties
    both = host_keep & gpu_keep.cpu()
    assert float((gpu_w.cpu()[both] - host_w[both]).norm() / host_w[both].norm()) < 1e-3
    assert abs(gpu_loss - host_loss) <= 1e-3 * abs(host_loss)
