"""The compiled ADMM x-step (kernels/compiled.py) equals the eager reference (penalty into grad, then torch's Adam) on CPU."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.admm import state as admm_state
from elsa_ds.admm.kernels import compiled
from elsa_ds.admm.projection import Slice
from elsa_ds.admm.state import StateDtype

# odd offsets and lengths, an empty slice, gaps before, between and after the slices (entries no layer owns)
SLICES = [Slice("a", 3, 101, 0, 101, 40), Slice("empty", 104, 0, 0, 0, 0), Slice("b", 111, 57, 0, 57, 20),
          Slice("c", 168, 1, 0, 1, 1)]
NUMEL = 181


@pytest.fixture(autouse=True)
def _opted_in(monkeypatch):
    """The compiled step is opt-in (ELSA_DS_COMPILED=1); every test here opts in unless it says otherwise."""
    monkeypatch.setenv("ELSA_DS_COMPILED", "1")


def _compiled_or_skip(step: compiled.CompiledStep) -> None:
    if not step.compiled:
        pytest.skip("torch.compile could not build the step here (no C++ compiler for Inductor?)")


def _state(dtype: StateDtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """z (sparse, like Π(x + u)) and u stored in ``dtype`` with per-layer scales, as the optimizer keeps them."""
    z, zs = admm_state.allocate(NUMEL, dtype, len(SLICES))
    u, us = admm_state.allocate(NUMEL, dtype, len(SLICES))
    for j, sl in enumerate(SLICES):
        zv = torch.randn(sl.length, generator=gen) * (torch.rand(sl.length, generator=gen) < 0.5)
        admm_state.store(z, zs, j, sl.offset, zv)
        admm_state.store(u, us, j, sl.offset, torch.randn(sl.length, generator=gen) * 0.1)
    return z, u, zs, us


def _eager(opt: torch.optim.Optimizer, p: torch.nn.Parameter, zu: tuple, lam: float) -> None:
    """The reference: AdmmOptimizer's eager penalty ∇ ← ∇ + λ((x − z) + u) per slice, then the base's step."""
    z, u, zs, us = zu
    if lam > 0.0:
        for j, sl in enumerate(SLICES):
            x = p.detach().narrow(0, sl.offset, sl.length)
            zj = admm_state.load(z, zs, j, sl.offset, sl.length)
            uj = admm_state.load(u, us, j, sl.offset, sl.length)
            p.grad.narrow(0, sl.offset, sl.length).add_(x.float() - zj + uj, alpha=lam)
    opt.step()


def _pair(make, gen: torch.Generator):
    start = torch.randn(NUMEL, generator=gen)
    ps = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    opts = [make([p]) for p in ps]
    first = torch.randn(NUMEL, generator=gen)
    for p, opt in zip(ps, opts):  # the base's first step creates its state, as under AdmmOptimizer
        p.grad = first.clone()
        opt.step()
    return ps, opts


@pytest.mark.parametrize("make, dtypes", [
    (lambda ps: torch.optim.Adam(ps, lr=1e-2), (StateDtype.fp32, StateDtype.fp32)),
    (lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95)), (StateDtype.fp32, StateDtype.fp32)),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-6), (StateDtype.fp32, StateDtype.fp32)),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), (StateDtype.fp8, StateDtype.bf16)),
], ids=["adam", "adam_l2", "adamw", "adamw_elsal"])
def test_compiled_step_equals_eager_reference(make, dtypes):
    gen = torch.Generator().manual_seed(1)
    (p_ref, p_new), (opt_ref, opt_new) = _pair(make, gen)
    z, zs = _state(dtypes[0], gen)[0::2]
    u, us = _state(dtypes[1], gen)[1::2]
    zu = (z, u, zs, us)
    step = compiled.CompiledStep(opt_new)
    assert step.kind == ("adamw" if isinstance(opt_new, torch.optim.AdamW) else "adam")
    for lam in (0.05, 0.0, 0.3):  # λ = 0: a held step (no penalty) takes the same path
        grad = torch.randn(NUMEL, generator=gen)
        p_ref.grad, p_new.grad = grad.clone(), grad.clone()
        _eager(opt_ref, p_ref, zu, lam)
        step.step(p_new, SLICES, opt_new.state[p_new], opt_new.param_groups[0], lam, zu)
        _compiled_or_skip(step)
        torch.testing.assert_close(p_new.grad, grad, rtol=0, atol=0)  # the gradient is left untouched
        st_ref, st_new = opt_ref.state[p_ref], opt_new.state[p_new]
        assert float(st_new["step"]) == float(st_ref["step"])
        for a, b in ((p_new.detach(), p_ref.detach()), (st_new["exp_avg"], st_ref["exp_avg"]),
                     (st_new["exp_avg_sq"], st_ref["exp_avg_sq"])):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)   # fp32 rounding, not an algorithmic difference
    assert step.x_steps == 3


def test_the_penalty_reaches_exactly_the_slices():
    """Against plain Adam: entries outside every slice move identically, entries inside move differently."""
    gen = torch.Generator().manual_seed(2)
    (p_plain, p_admm), (opt_plain, opt_admm) = _pair(lambda ps: torch.optim.Adam(ps, lr=1e-2), gen)
    z, _, zs, _ = _state(StateDtype.fp32, gen)
    u, us = torch.zeros(NUMEL), torch.ones(len(SLICES))
    grad = torch.randn(NUMEL, generator=gen)
    p_plain.grad, p_admm.grad = grad.clone(), grad.clone()
    opt_plain.step()
    step = compiled.CompiledStep(opt_admm)
    step.step(p_admm, SLICES, opt_admm.state[p_admm], opt_admm.param_groups[0], 1.0, (z, u, zs, us))
    _compiled_or_skip(step)
    inside = torch.zeros(NUMEL, dtype=torch.bool)
    for sl in SLICES:
        inside[sl.offset:sl.offset + sl.length] = True
    torch.testing.assert_close(p_admm.detach()[~inside], p_plain.detach()[~inside], rtol=2e-6, atol=1e-7)
    moved = (p_admm.detach() - p_plain.detach()).abs() > 1e-6
    assert moved[inside].float().mean() > 0.9


def test_which_bases_and_flats_qualify(monkeypatch):
    p = torch.nn.Parameter(torch.zeros(4))
    assert compiled.CompiledStep(torch.optim.Adam([p])).kind == "adam"
    assert compiled.CompiledStep(torch.optim.Adam([p], amsgrad=True)).kind is None
    assert compiled.CompiledStep(torch.optim.SGD([p], lr=0.1)).kind is None
    assert compiled.CompiledStep(torch.optim.Adam([p]), on=False).kind is None
    monkeypatch.setenv("ELSA_DS_COMPILED", "0")
    assert compiled.CompiledStep(torch.optim.Adam([p])).kind is None
    monkeypatch.delenv("ELSA_DS_COMPILED")  # opt-in: off when unset
    assert compiled.CompiledStep(torch.optim.Adam([p])).kind is None
    monkeypatch.setenv("ELSA_DS_COMPILED", "1")
    monkeypatch.setenv("ELSA_DS_KERNELS", "0")
    assert compiled.CompiledStep(torch.optim.Adam([p])).kind is None
    monkeypatch.delenv("ELSA_DS_KERNELS")
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(4)
    opt.step()
    assert not compiled.CompiledStep(opt).steps(p, opt.state[p])  # CPU flats have the C++ kernels


def test_admm_optimizer_takes_the_compiled_step_and_matches_its_eager_path():
    """Through AdmmOptimizer (projections included): the compiled x-step gives the eager path's x, z, u and masks."""
    from elsa_ds.admm.optimizer import AdmmOptimizer, AdmmSettings

    gen = torch.Generator().manual_seed(3)
    start, grads = torch.randn(NUMEL, generator=gen), [torch.randn(NUMEL, generator=gen) for _ in range(7)]
    runs = []
    for kernels in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = AdmmOptimizer(torch.optim.AdamW([p], lr=1e-2, weight_decay=0.01), AdmmSettings(total_steps=8, interval=3, lmda=0.1,
                                                                                            kernels=kernels))
        opt.assign(p, [sl for sl in SLICES if sl.length])
        opt._compiled.cpu = kernels  # CPU flats normally have the C++ kernels; here the compiled step stands in
        for t, g in enumerate(grads):
            opt.begin_step(t)
            p.grad = g.clone()
            opt.step()
        runs.append((p, opt))
    (p_ref, opt_ref), (p_new, opt_new) = runs
    if not opt_new._compiled.compiled:
        pytest.skip("torch.compile could not build the step here")
    assert opt_new._compiled.x_steps == 6 and opt_ref._compiled.x_steps == 0  # every step after the first
    torch.testing.assert_close(p_new.detach(), p_ref.detach(), rtol=1e-5, atol=1e-6)
    for key in ("admm_z", "admm_u"):
        torch.testing.assert_close(opt_new.state[p_new][key], opt_ref.state[p_ref][key], rtol=1e-5, atol=1e-6)
    assert torch.equal(opt_new.state[p_new]["admm_z"] != 0, opt_ref.state[p_ref]["admm_z"] != 0)
