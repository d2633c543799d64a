"""λ schedules and the scaled-dual rescaling that goes with them.

ADMM's scaled dual is u = y / λ (y the unscaled multiplier). When the penalty moves from λ_old to
λ_new the multiplier y must stay the same, so

    u ← u · λ_old / λ_new.

λ is held constant between projections (it changes only at projection steps), so the x-updates of one
interval all solve the same augmented Lagrangian; the value used for interval j (steps
[j·interval, (j+1)·interval)) is the schedule at the interval's end, so a schedule that starts at 0
already penalizes during the first interval.

``adaptive`` is residual balancing (Boyd et al. 2011, §3.4.1; the authors' ``adaptive_boyd``): every layer has its own
λ, starting at the given one and moved at each projection by ``balanced_lambda`` from the layer's residuals; its u is
rescaled in the same update. The optimizer keeps those λ; the schedule's own λ stays the starting value.
"""
from __future__ import annotations

import math
from enum import Enum


class LambdaSchedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    adaptive = "adaptive"


def lambda_at(step: int, total_steps: int, peak: float, schedule: LambdaSchedule | str) -> float:
    """λ(t) for t = ``step`` of ``total_steps``: constant λ, or 0 → λ linearly or along a half cosine."""
    frac = min(max(step / max(total_steps, 1), 0.0), 1.0)
    schedule = LambdaSchedule(schedule)
    if schedule in (LambdaSchedule.constant, LambdaSchedule.adaptive):
        return peak
    if schedule is LambdaSchedule.linear:
        return peak * frac
    return peak * 0.5 * (1.0 - math.cos(math.pi * frac))


def interval_lambda(step: int, total_steps: int, interval: int, peak: float, schedule: LambdaSchedule | str) -> float:
    """λ in force at ``step``: the schedule at the end of the step's projection interval."""
    end = min((step // interval + 1) * interval, total_steps)
    return lambda_at(end, total_steps, peak, schedule)


BALANCE_SPAN = 1e12  # an adaptive λ stays within this factor of its start either way (not in the authors' code)


def balanced_lambda(lam: float, primal: float, dual: float, mu: float, tau: float, start: float | None = None) -> float:
    """A layer's next λ by residual balancing: × ``tau`` when its primal residual ‖x − z‖/‖x‖ exceeds ``mu`` times its
    dual residual ‖z − z_prev‖/‖z_prev‖ (x far from the sparse set: press harder), ÷ ``tau`` in the opposite case (z
    still moving: ease off), else unchanged; both residuals relative, as the authors' code has them.

    With ``start`` (the λ the layer began at) the result is kept within ``BALANCE_SPAN`` of it. Once both residuals are
    rounding noise one of them may stay the larger, and λ then doubles (or halves) at every projection without end
    (docs/history.md, 2026-11-29): λ is held in fp32, so a long run at a short interval would reach inf (a NaN step) or
    0 (the penalty gone for good). Within 10¹² of the start nothing is lost: Adam normalizes the
    step, and far before that factor the penalty's gradient has swamped (or vanished beside) the loss's."""
    if primal > mu * dual:
        lam = lam * tau
    elif dual > mu * primal:
        lam = lam / tau
    if start is not None and start > 0.0:
        lam = min(max(lam, start / BALANCE_SPAN), start * BALANCE_SPAN)
    return lam


def dual_rescale(lam_old: float, lam_new: float) -> float:
    """Factor for u when λ moves from ``lam_old`` to ``lam_new`` (1 when either is 0: y = λu is then 0)."""
    if lam_old <= 0.0 or lam_new <= 0.0:
        return 1.0
    return lam_old / lam_new


def learning_rate(step: int, total_steps: int, peak: float, warmup: int = 0, final_ratio: float = 0.0) -> float:
    """Linear warm-up over ``warmup`` steps, then linear decay from ``peak`` to ``final_ratio · peak``."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    span = max(total_steps - warmup, 1)
    frac = min(max((step - warmup) / span, 0.0), 1.0)
    return peak * (1.0 - (1.0 - final_ratio) * frac)
