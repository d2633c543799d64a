from __future__ import annotations

import copy

import torch

from elsa_ds.admm.optimizer import AdmmOptimizer, AdmmSettings, Projection, second_moment, summarize_metrics
from elsa_ds.admm.projection import Slice, keep_count
from elsa_ds.admm.state import StateDtype


def _least_squares(seed: int = 0, n: int = 40, m: int = 200):
    """f(x) = ½‖A x − b‖²/m with b from a 75%-sparse ground truth: a smooth problem whose answer is known."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(n, generator=g)
    truth[torch.randperm(n, generator=g)[: 3 * n // 4]] = 0
    a = torch.randn(m, n, generator=g)
    return a, a @ truth, truth


def _run(projection: Projection, z_dtype=StateDtype.fp32, u_dtype=StateDtype.fp32, steps=600, sparsity=0.75):
    a, b, truth = _least_squares()
    x = torch.nn.Parameter(torch.linalg.lstsq(a, b).solution.clone() + 0.3)  # dense start, off the optimum
    settings = AdmmSettings(total_steps=steps, interval=10, lmda=0.5, projection=projection, z_dtype=z_dtype, u_dtype=u_dtype)
    opt = AdmmOptimizer(torch.optim.Adam([x], lr=0.02), settings)
    opt.assign(x, [Slice("x", 0, x.numel(), 0, x.numel(), keep_count(x.numel(), sparsity))])
    residuals = []
    for t in range(steps):
        opt.begin_step(t)
        opt.zero_grad()
        loss = 0.5 * (a @ x - b).square().mean()
        loss.backward()
        opt.step()
        if opt.projected_this_step and t < steps - 1:
            residuals.append(summarize_metrics(opt.local_metrics(), opt.lam)["residual"])
    return x.detach(), truth, residuals, opt


def test_admm_reaches_feasible_point_with_small_residual():
    x, truth, residuals, _ = _run(Projection.fisher)
    assert int((x != 0).sum()) == keep_count(x.numel(), 0.75)          # exactly feasible
    assert residuals[-1] < 0.01 < residuals[0]                        # the x - z gap closes
    assert torch.equal(x != 0, truth != 0)                             # the true support is found
    assert torch.allclose(x, truth, atol=0.05)


def test_magnitude_and_low_precision_states_also_converge():
    for proj, zd, ud in ((Projection.magnitude, StateDtype.fp32, StateDtype.fp32), (Projection.fisher, StateDtype.fp8, StateDtype.bf16)):
        x, truth, residuals, opt = _run(proj, zd, ud)
        assert int((x != 0).sum()) == keep_count(x.numel(), 0.75)
        assert residuals[-1] < 0.02
        assert torch.equal(x != 0, truth != 0)
        st = opt.state[next(iter(opt.state))]
        assert st["admm_z"].dtype == zd.torch_dtype and st["admm_u"].dtype == ud.torch_dtype


def test_penalty_is_added_to_gradient_before_base_step():
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 4.0]))
    base = torch.optim.SGD([x], lr=1.0)
    opt = AdmmOptimizer(base, AdmmSettings(total_steps=100, interval=50, lmda=0.1))
    opt.settings = AdmmSettings(total_steps=100, interval=50, lmda=0.1, projection=Projection.magnitude)
    opt.assign(x, [Slice("x", 0, 4, 0, 4, keep=2)])
    for t in range(2):
        opt.begin_step(t)
        x.grad = torch.zeros(4)
        opt.step()
        if t == 0:  # first step: plain base step, then z = Π(x) = [0, -2, 0, 4], u = 0
            assert torch.equal(x.detach(), torch.tensor([1.0, -2.0, 0.5, 4.0]))
    # second step: x ← x − lr·λ(x − z + u)
    assert torch.allclose(x.detach(), torch.tensor([0.9, -2.0, 0.45, 4.0]))


def test_second_moment_reads_adam_state():
    x = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([x])
    x.grad = torch.tensor([1.0, 2.0, 3.0])
    opt.step()
    assert torch.allclose(second_moment(opt.state[x]), 0.001 * torch.tensor([1.0, 4.0, 9.0]))


def test_hold_steps_train_inside_the_early_projections_mask():
    """hold_steps h: x ← Π(x) at step T − h − 1, then h steps of the base optimizer with the pruned entries held at
    exactly 0 (gradient and value) while the kept ones keep training; λ ramps over the first T − h steps only."""
    from elsa_ds.admm.schedule import LambdaSchedule

    a, b, _ = _least_squares()
    steps, hold, keep = 60, 20, keep_count(40, 0.75)
    x = torch.nn.Parameter(torch.linalg.lstsq(a, b).solution.clone() + 0.3)
    settings = AdmmSettings(total_steps=steps, interval=10, lmda=0.5, lmda_schedule=LambdaSchedule.linear, hold_steps=hold)
    opt = AdmmOptimizer(torch.optim.Adam([x], lr=0.02), settings)
    opt.assign(x, [Slice("x", 0, x.numel(), 0, x.numel(), keep)])
    lams, kept_at, snapshots = [], None, []
    ref = ref_opt = None  # from the early hard projection on: plain Adam on the masked gradient, pruned entries re-zeroed
    for t in range(steps):
        if ref is not None:
            ref_opt.zero_grad()
            (0.5 * (a @ ref - b).square().mean()).backward()
            ref.grad.masked_fill_(~kept_at, 0.0)
            ref_opt.step()
            with torch.no_grad():
                ref.masked_fill_(~kept_at, 0.0)
        opt.begin_step(t)
        lams.append(opt.lam)
        assert opt.holding is (t >= steps - hold)
        assert opt.projected_this_step is ((t + 1) % 10 == 0 and t < steps - hold or t in (steps - hold - 1, steps - 1))
        opt.zero_grad()
        (0.5 * (a @ x - b).square().mean()).backward()
        opt.step()
        if t == steps - hold - 1:  # the early hard projection
            kept_at = x.detach() != 0
            assert int(kept_at.sum()) == keep
            ref = torch.nn.Parameter(x.detach().clone())
            ref_opt = torch.optim.Adam([ref], lr=0.02)
            ref_opt.load_state_dict(copy.deepcopy(opt.base.state_dict()))  # its moments and step count, not shared
        if t >= steps - hold:
            assert torch.equal(x.detach() != 0, kept_at)  # the mask is held, exactly
            snapshots.append(x.detach().clone())
    assert lams[steps - hold - 1] == 0.5 and lams[0] < lams[20] < 0.5  # the ramp ends where the hold starts
    assert not torch.equal(snapshots[0], snapshots[-1])  # the kept entries train on
    assert torch.equal(x.detach(), ref.detach())  # no penalty in the held steps: exactly masked Adam
    assert int((x != 0).sum()) == keep


def test_hold_steps_is_refused_where_it_means_nothing():
    import pytest

    from elsa_ds.errors import ElsaError
    from elsa_ds.settings.config import resolve_config

    for given, words in (({"hold_steps": 100, "steps": 100}, "must be below steps"),
                         ({"hold_steps": 10, "method": "wanda", "finetune": "full"}, "mean nothing"),
                         ({"hold_steps": 10, "select_every": 2}, "select_every .* must be 0")):
        with pytest.raises((ElsaError, ValueError), match=words):
            resolve_config({}, {"model": "m", **given})
