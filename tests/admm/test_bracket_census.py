"""Small layers whose rows differ in scale: the fused projection counts them whole (select.CENSUS_NUMEL) and hits.

The demo's k_proj is 128 rows of 256 entries: its 1/16 sample is ten 256-entry blocks, i.e. ten whole rows, and the
rows' scores differ by orders of magnitude, so the sampled bracket missed in every projection of a 2-rank run and
sent the whole flat through the exact passes. Here 40 such layers beside one large one (sampled, so the flat takes the
bracket path; a flat of small layers alone now takes the exact passes directly) on the real kernels: with the census
the bracket holds every layer's threshold (the masks keep exactly k); the projection equals the eager reference bit
for bit.
"""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm import state as admm_state
from elsa_ds.admm.kernels import select
from elsa_ds.admm.optimizer import U, U_SCALE, Z, Z_SCALE, AdmmOptimizer, AdmmSettings, Projection
from elsa_ds.admm.projection import Slice
from elsa_ds.admm.state import StateDtype

ROWS, WIDTH, LAYERS = 128, 256, 40


def _flat(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[Slice]]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(LAYERS * ROWS, 1, generator=g) * 2.0).expand(-1, WIDTH).flatten()  # rows differ ~e^±4
    x = torch.randn(LAYERS * ROWS * WIDTH, generator=g) * scale
    second = torch.rand(x.numel(), generator=g) * 1e-3
    n = ROWS * WIDTH
    slices = [Slice(f"layers.{j}.k_proj", j * n, n, 0, n, round(0.3 * n)) for j in range(LAYERS)]
    big = select.CENSUS_NUMEL  # and one layer large enough to be sampled: the flat takes the bracket path
    x = torch.cat([x, torch.randn(big, generator=g)])
    second = torch.cat([second, torch.rand(big, generator=g) * 1e-3])
    slices.append(Slice("layers.0.mlp.up_proj", LAYERS * n, big, 0, big, round(0.3 * big)))
    return x, second, slices


def _project(x, second, slices, kernels_on: bool) -> tuple[dict, dict]:
    p = torch.nn.Parameter(x.clone())
    settings = AdmmSettings(total_steps=10_000, interval=1000, lmda=0.3, projection=Projection.fisher, z_dtype=StateDtype.fp32,
                            u_dtype=StateDtype.fp32, kernels=kernels_on)
    opt = AdmmOptimizer(torch.optim.SGD([p], lr=0.0), settings)
    opt.assign(p, slices)
    st = opt.state[p]
    st["exp_avg_sq"] = second.clone()
    st[Z], st[Z_SCALE] = admm_state.allocate(x.numel(), StateDtype.fp32, len(slices))
    st[U], st[U_SCALE] = admm_state.allocate(x.numel(), StateDtype.fp32, len(slices))
    opt._update_z_u(p, slices, st)
    return st, dict(opt._fused.projection_paths) if opt._fused is not None else {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_clustered_small_layers_are_counted_whole_and_the_bracket_holds(kernels, seed):
    x, second, slices = _flat(seed)
    assert all(s.numel < select.CENSUS_NUMEL for s in slices[:-1]) and slices[-1].numel >= select.BRACKET_MIN_NUMEL
    fused, paths = _project(x, second, slices, True)
    eager, _ = _project(x, second, slices, False)
    assert paths == {"bracket": 1}, paths
    for key in (Z, U):
        assert torch.equal(fused[key].view(torch.int32), eager[key].view(torch.int32)), key
    for s in slices:
        assert int((fused[Z].narrow(0, s.offset, s.length) != 0).sum()) == s.keep


def test_without_the_census_such_layers_miss(kernels, monkeypatch):
    """What the census is for: the same flats sampled (CENSUS_NUMEL = 0) miss at least once in three, and still
    end with the exact result through the exact passes."""
    flats = [_flat(seed) for seed in (0, 1, 2)]
    monkeypatch.setattr(select, "CENSUS_NUMEL", 0)
    seen = {}
    for x, second, slices in flats:
        fused, paths = _project(x, second, slices, True)
        for k, v in paths.items():
            seen[k] = seen.get(k, 0) + v
        for s in slices:
            assert int((fused[Z].narrow(0, s.offset, s.length) != 0).sum()) == s.keep
    assert seen.get("missed", 0) >= 1, seen
