"""The 8-bit x-step's hand-written AVX-512 loop (csrc/span8_avx512.h) against the portable loop it reproduces.

Bit for bit: p, both code arrays and both absmax arrays, for both code formats, every z/u storage pair, with and without
weight decay, on slices at odd offsets with a short last block; z holds fp8 subnormals and both zeros, the gradient
exact zeros of both signs, and a stretch of tiny gradients makes blocks whose absmax is too small for the fp16 route's
folded scale (the loop then decodes with integers). Runs where the kernels were built with AVX-512 (BW, VL).
"""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm.kernels import ops
from elsa_ds.admm.kernels.ops import PenaltyState, SliceTable
from elsa_ds.admm.kernels.quant8 import dynamic_map, minifloat_map

N = 9001
OFFSETS, LENGTHS = [5, 1030, 6701, 8999], [1017, 3001, 2289, 2]  # odd starts and ends, a two-entry slice, gaps
STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def simd(kernels):
    if not kernels.has_span8_avx512():
        pytest.skip("the kernels were built without AVX-512 (BW, VL): only the portable loop exists here")
    yield kernels
    kernels.use_portable_loops(False)


def _inputs(seed: int, z_type: str, u_type: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(N, generator=g) * 1e-2
    grad[::97] = 0.0
    grad[1::97] = -0.0
    grad[6000:6600] *= 1e-17  # between slices: v ~ 1e-41 (fp32 subnormal) from zero moments, absmax2 < 2^-125 in block 24
    if z_type == "fp8":
        codes = torch.randint(0, 256, (N,), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x08  # no NaN codes; 0x00-0x07 and 0x80-0x87 are zeros and subnormals
        z = codes.view(torch.float8_e4m3fn)
    else:
        z = (torch.randn(N, generator=g) * 2).to(STORAGE[z_type])
    u = (torch.randn(N, generator=g) * 0.5).to(STORAGE[u_type])
    blocks = -(-N // 256)
    absmax1, absmax2 = torch.rand(blocks, generator=g) * 1e-2, torch.rand(blocks, generator=g) * 1e-4
    absmax1[23:26] = absmax2[23:26] = 0.0
    return dict(p=torch.randn(N, generator=g), grad=grad, state1=torch.randint(0, 256, (N,), generator=g, dtype=torch.uint8),
                state2=torch.randint(0, 256, (N,), generator=g, dtype=torch.uint8), absmax1=absmax1, absmax2=absmax2, z=z, u=u,
                z_scale=torch.tensor([0.01, 3.0, 1e-30, 0.5]), u_scale=torch.tensor([1.0, 0.25, 2.0, 1e-3]))


def _step(kernels, t: dict, fmt: int, weight_decay: float, step: int) -> None:
    signed, unsigned = (minifloat_map(True), minifloat_map(False)) if fmt else (dynamic_map(True), dynamic_map(False))
    ops.adam8bit_step(kernels, p=t["p"], grad=t["grad"], state1=t["state1"], state2=t["state2"], qmap1=signed, qmap2=unsigned,
                      absmax1=t["absmax1"], absmax2=t["absmax2"], zu=PenaltyState(t["z"], t["u"], t["z_scale"], t["u_scale"]),
                      table=SliceTable(torch.tensor(OFFSETS), torch.tensor(LENGTHS)), lam=0.3, lr=1e-2, beta1=0.9, beta2=0.999,
                      eps=1e-8, weight_decay=weight_decay, step=step, minifloat=bool(fmt))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x


@pytest.mark.parametrize("fmt", [1, 0], ids=["minifloat", "bitsandbytes"])
@pytest.mark.parametrize("z_type,u_type", [("fp8", "bf16"), ("fp32", "fp32"), ("bf16", "fp8"), ("fp8", "fp8")])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_avx512_loop_equals_the_portable_loop_bit_for_bit(simd, fmt, z_type, u_type, weight_decay):
    runs = {}
    for portable in (True, False):
        simd.use_portable_loops(portable)
        t = _inputs(7, z_type, u_type)
        for step in (1, 2, 3):  # the later steps start from codes and absmax the kernel wrote itself
            t["grad"].mul_(-1.0)
            _step(simd, t, fmt, weight_decay, step)
        runs[portable] = t
    simd.use_portable_loops(False)
    assert 0.0 < runs[False]["absmax2"][24].item() < 2.0**-125  # the integer decode ran in block 24
    for key in ("p", "state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(_bits(runs[True][key]), _bits(runs[False][key])), key
