from __future__ import annotations

import math

import pytest
import torch

from elsa_ds.admm.schedule import balanced_lambda, dual_rescale, interval_lambda, lambda_at


def test_constant_linear_cosine_endpoints_and_midpoint():
    assert lambda_at(0, 100, 2.0, "constant") == 2.0
    assert lambda_at(0, 100, 2.0, "linear") == 0.0
    assert lambda_at(50, 100, 2.0, "linear") == pytest.approx(1.0)
    assert lambda_at(100, 100, 2.0, "linear") == pytest.approx(2.0)
    assert lambda_at(0, 100, 2.0, "cosine") == pytest.approx(0.0)
    assert lambda_at(50, 100, 2.0, "cosine") == pytest.approx(1.0)
    assert lambda_at(25, 100, 2.0, "cosine") == pytest.approx(1.0 - math.cos(math.pi / 4))


def test_schedules_monotone_and_bounded():
    for kind in ("linear", "cosine"):
        vals = [lambda_at(t, 64, 0.5, kind) for t in range(65)]
        assert all(b >= a for a, b in zip(vals, vals[1:]))
        assert max(vals) == pytest.approx(0.5)


def test_interval_lambda_is_piecewise_constant_at_interval_end():
    vals = [interval_lambda(t, 64, 16, 1.0, "linear") for t in range(64)]
    assert vals[0] == vals[15] == pytest.approx(16 / 64)
    assert vals[16] == pytest.approx(32 / 64)
    assert vals[63] == pytest.approx(1.0)
    assert len(set(vals)) == 4


def test_dual_rescale_keeps_unscaled_multiplier():
    u, lam_old, lam_new = 3.0, 0.2, 0.5
    assert lam_new * u * dual_rescale(lam_old, lam_new) == pytest.approx(lam_old * u)
    assert dual_rescale(0.0, 1.0) == 1.0


def test_unknown_schedule_is_rejected():
    with pytest.raises(ValueError):
        lambda_at(1, 10, 1.0, "exponential")


def test_balanced_lambda_presses_where_x_lags_and_eases_where_z_moves():
    assert balanced_lambda(0.1, primal=0.4, dual=0.2, mu=1.5, tau=2.0) == pytest.approx(0.2)   # 0.4 > 1.5 · 0.2
    assert balanced_lambda(0.1, primal=0.1, dual=0.2, mu=1.5, tau=2.0) == pytest.approx(0.05)  # 0.2 > 1.5 · 0.1
    assert balanced_lambda(0.1, primal=0.25, dual=0.2, mu=1.5, tau=2.0) == 0.1                 # within μ of each other
    assert balanced_lambda(0.1, primal=0.0, dual=0.0, mu=1.5, tau=2.0) == 0.1
    assert lambda_at(0, 100, 2.0, "adaptive") == interval_lambda(99, 100, 10, 2.0, "adaptive") == 2.0  # the start, held


def test_balanced_lambda_stays_within_its_span_of_the_start_and_finite_in_fp32():
    """A residual that stays the larger forever (rounding noise at convergence) would double λ at every projection:
    2¹²⁸ x 0.01 is fp32's inf. With its start given, λ stops at BALANCE_SPAN either way and stays there."""
    from elsa_ds.admm.schedule import BALANCE_SPAN

    up, down, free = 0.01, 0.01, 0.01
    for _ in range(300):
        up = balanced_lambda(up, primal=1e-7, dual=1e-9, mu=1.5, tau=2.0, start=0.01)
        down = balanced_lambda(down, primal=1e-9, dual=1e-7, mu=1.5, tau=2.0, start=0.01)
        free = balanced_lambda(free, primal=1e-7, dual=1e-9, mu=1.5, tau=2.0)  # no start: the authors' rule, unbounded
    assert up == pytest.approx(0.01 * BALANCE_SPAN) and down == pytest.approx(0.01 / BALANCE_SPAN)
    assert torch.isfinite(torch.tensor([up], dtype=torch.float32)).all() and torch.tensor([down], dtype=torch.float32) > 0
    assert not torch.isfinite(torch.tensor([free], dtype=torch.float32)).all()
    assert balanced_lambda(0.2, primal=0.4, dual=0.2, mu=1.5, tau=2.0, start=0.1) == pytest.approx(0.4)  # inside: as before
