"""The math core on a CUDA device: the compiled x-step equals the eager reference there, and the projection's histograms and
counts travel on the device the process group needs (NCCL takes CUDA tensors only). Marked ``cuda`` (conftest.py)."""
from __future__ import annotations


import pytest
import torch

from elsa_ds.admm import state as admm_state
from elsa_ds.admm.kernels import compiled
from elsa_ds.admm.projection import LocalComm, TorchDistComm, projection_masks
from elsa_ds.admm.state import StateDtype
from elsa_ds.zero.dist import free_port  # the rendezvous port
from tests.admm.test_compiled_step import NUMEL, SLICES, _eager


@pytest.mark.parametrize("dtypes", [(StateDtype.fp32, StateDtype.fp32), (StateDtype.fp8, StateDtype.bf16)], ids=["fp32", "elsal"])
def test_compiled_step_equals_eager_on_cuda(dtypes, monkeypatch):
    monkeypatch.setenv("ELSA_DS_COMPILED", "1")  # opt-in
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(NUMEL, generator=gen)
    ps = [torch.nn.Parameter(start.clone().cuda()) for _ in range(2)]
    opts = [torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in ps]
    for p, opt in zip(ps, opts):
        p.grad = torch.ones(NUMEL, device="cuda")
        opt.step()
    z, zs = admm_state.allocate(NUMEL, dtypes[0], len(SLICES), "cuda")
    u, us = admm_state.allocate(NUMEL, dtypes[1], len(SLICES), "cuda")
    for j, sl in enumerate(SLICES):
        admm_state.store(z, zs, j, sl.offset, torch.randn(sl.length, generator=gen).cuda())
        admm_state.store(u, us, j, sl.offset, 0.1 * torch.randn(sl.length, generator=gen).cuda())
    step = compiled.CompiledStep(opts[1])
    assert step.steps(ps[1], opts[1].state[ps[1]])  # a CUDA flat under torch's AdamW qualifies
    for lam in (0.05, 0.0, 0.3):
        grad = torch.randn(NUMEL, generator=gen).cuda()
        ps[0].grad, ps[1].grad = grad.clone(), grad.clone()
        _eager(opts[0], ps[0], (z, u, zs, us), lam)
        step.step(ps[1], SLICES, opts[1].state[ps[1]], opts[1].param_groups[0], lam, (z, u, zs, us))
        assert step.compiled, "torch.compile (Triton) failed on this GPU"
        torch.testing.assert_close(ps[1].detach(), ps[0].detach(), rtol=2e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opts[1].state[ps[1]][key], opts[0].state[ps[0]][key], rtol=2e-6, atol=1e-7)


@pytest.fixture
def nccl_group():
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield None
    finally:
        dist.destroy_process_group()


def test_projection_over_nccl_equals_the_local_one(nccl_group):
    """CUDA scores with CPU histograms and counts, all-reduced and gathered over NCCL: the masks LocalComm gives."""
    gen = torch.Generator().manual_seed(6)
    values = [torch.randn(sl.length, generator=gen) for sl in SLICES]
    fisher = [torch.rand(sl.length, generator=gen) for sl in SLICES]
    local = projection_masks(values, fisher, SLICES, LocalComm())
    comm = TorchDistComm(device="cuda")
    on_gpu = projection_masks([v.cuda() for v in values], [f.cuda() for f in fisher], SLICES, comm)
    for a, b, sl in zip(local, on_gpu, SLICES):
        assert b.device.type == "cuda"
        assert torch.equal(a, b.cpu()), sl.layer
        assert int(b.sum()) == min(sl.keep, sl.length)
    peaks = torch.tensor([1.0, 3.0])  # the fp8 scales' max all-reduce takes CPU tensors too
    comm.all_reduce_max(peaks)
    assert peaks.tolist() == [1.0, 3.0]
