"""The defaults rule: ELSA's lr, λ, λ schedule, warm-up, start and held end — and retraining's lr and warm-up — from
model size, sparsity and step budget.

Applied to every one of those settings the user leaves unset (``plan/defaults_applied.py``); the resolved config and
the report say which values came from here and why. Pure: numbers in, numbers out.

    lr_pre(N)      = 3e-3 · (N / 4e6)^-0.3                 a typical pre-training peak lr for N parameters
                                                            (3e-3 at 4 M, 2.1e-3 at 13 M, 3.2e-4 at 7 B: Llama-2's 3e-4;
                                                            above 7 B steeper, to the paper's Gemma-2-27B setting)
    lr_elsa        = lr_pre(N) · F · (4096 / T)^β · exp(k·(s − 0.9))       T = steps (at least 100), s = sparsity
                     (x starting pruned: F · min(1, (4096 / T)^β) in place of F · (4096 / T)^β, and at s ≥ 0.8
                     retraining's G · (4096 / T)^β where that is larger)
    start          = SparseGPT's pruned model (x₀ = z₀, --init_mask sparsegpt --init_weights) when s ≤ 0.9 and
                     T < 2048 and the lr is the rule's; else the dense model (the paper's)
    held end       = the last half of T inside the mask of an early x = Π(x) (--hold_steps T/2) when x starts pruned,
                     s ≥ 0.8 and retraining's G · (4096 / T)^β is above F (T below ~450); else none (the paper's)
                     (shortened where the steps before it would make no z, u update at the run's interval:
                     :func:`held_end`)
    λ              = Λ(N) · exp(κ·(s − 0.9))
    λ schedule     = cosine from 0 when s ≥ 0.7 and T ≥ 2048 (the paper's long runs); else linear from 0 when
                     s ≥ 0.8 (short budgets: our choice, measured); else constant
    lr_retrain     = lr_pre(N) · G · (4096 / T)^β                            (--finetune, and the dense control)
    warm-up        = 10 % of T when T < 2048 and the lr is the rule's (ELSA, retraining, dense control); else none

Anchors (``ANCHORS``; ``tests/test_defaults.py`` holds the rule to them), the ELSA paper's appendix at 4096 steps:
LLaMA-2-7B lr 5e-5 (50-60 %) .. 1e-4 (70-90 %), λ 1e-3 .. 2e-2 by sparsity, cosine λ from 0 at 70-90 %, constant at
50-60 %; Gemma-2-27B lr 2e-5, λ 2e-3, taken as printed. The paper's λ is per process of W = 2 (docs/design.md, "The λ
convention"), so at the anchors the rule's λ is twice the paper's effective penalty where the recipes divide by W: a
known difference, kept while the GPU budget curve runs under this rule (docs/results.md, section 6). Nothing else: β
and the short-budget branches below are ours, an extrapolation
chosen on small models at 400 steps (the measurements: ``docs/results.md``, section 6, "The defaults rule"). Far from 4096
steps, pass lr and lmda yourself or check the report's curve.

Why each short-budget branch (T < 2048 steps; the paper has no short runs):
- budget factor (4096 / T)^β: the pruned weights must travel to zero within T steps, so the lr grows as T shrinks
  (down to T = 100, the shortest budget measured; a shorter run keeps 100 steps' factor);
  the sparsity factor k: higher sparsity moves further from the dense weights and needs larger steps still.
- λ linear from 0 at s ≥ 0.8, constant below: with a constant λ the final x = Π(x) cuts a residual that no step is
  left to recover; below 80 % λ is small and the ramp does not pay.
- warm-up over 10 % of T, with the rule's lr only: Adam's first steps move every weight by about the lr whatever its
  gradient, which a pretrained model pays for at a short budget's larger lr.
- SparseGPT's pruned start up to 90 %, with the rule's lr only and without the budget factor: a short run from the
  dense weights never brings a trained model's x near the sparse set (‖x − z‖/‖x‖ at the last projection stays near
  the dense weights' own), so the final x = Π(x) is a one-shot cut of a fine-tuned dense model; from the one-shot's
  reconstruction x stays near the sparse set. The budget factor would only undo the reconstruction. Above 90 % the
  dense start, which is where it was measured to win (docs-llama at 95 %).
- from 80 %, a pruned start's lr is at least the retraining rule's G·(4096 / T)^β (1.6x ELSA's at 100 steps, 1.04x at
  400, none from ~450): retraining starts from the same one-shot model and trains T steps inside its mask at that lr without
  losing the reconstruction, and at 90 % ELSA from the pruned start gained with it (Gemma-3 270M, 100 steps).
- over the same budgets (retraining's lr above ELSA's), the last half of the steps trains inside the mask of an early x = Π(x)
  (--hold_steps): in ~100 steps λ stays too weak to close the residual (‖x − z‖/‖x‖ 0.14-0.18 at every projection: the
  pruned entries regrow towards their dense values), so the paper's final cut loses what the run gained, and a λ strong
  enough to close it anchors the kept weights as well; ending inside the mask lets the kept weights recover from the
  cut; at 90 % and 100 steps a half gained more than a quarter, on Gemma-3 270M and on the demo (docs/results.md).
A user's lr, --init_mask or --init_weights keeps the paper's dense start (or their own); a user's lr keeps the warm-up
the user sets (default none).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from elsa_ds.admm.schedule import LambdaSchedule

RULE_FIELDS = ("lr", "lmda", "lmda_schedule", "warmup_steps", "init_mask", "init_weights", "hold_steps")
USER_START = frozenset({"lr", "init_mask", "init_weights"})  # any of them set: the user's start (or the paper's dense one)

REF_STEPS = 4096          # the paper's budget
BETA = 0.3                # lr ∝ T^-β
MIN_RULE_STEPS = 100      # the shortest budget the rule was measured at: below it the budget factor stays at this one's
ELSA_F = 0.31             # lr / lr_pre at 90 %, 4096 steps (LLaMA-2-7B: 1e-4 / 3.2e-4)
ELSA_K = 1.6              # d ln(lr) / d sparsity (LLaMA-2-7B: 5e-5 at 50 % .. 1e-4 at 90 %)
RETRAIN_G = 0.16          # retraining lr / lr_pre at 4096 steps
LMDA_KAPPA = 7.5          # d ln(λ) / d sparsity (LLaMA-2-7B: 1e-3 at 50 % .. 2e-2 at 90 %)
COSINE_FROM = (0.7, 2048)  # cosine λ from 0 at sparsity >= 0.7 with >= 2048 steps
LINEAR_FROM = 0.8          # shorter budgets: linear λ from 0 at sparsity >= 0.8, constant below
WARMUP_FRACTION = 0.1      # shorter budgets (< COSINE_FROM[1] steps): lr warm-up over this fraction of the steps
WARM_START_UP_TO = 0.9     # shorter budgets: up to this sparsity x and z start from SparseGPT's pruned model
HOLD_FRACTION = 0.5        # a pruned start at >= LINEAR_FROM with retraining's lr: this fraction of the steps ends inside the mask
TOL = 1e-9                 # every sparsity threshold compares with this tolerance (a goal of 0.8 may arrive as 0.7999999999)


def at_least(sparsity: float, threshold: float) -> bool:
    """``sparsity`` ≥ ``threshold`` up to float noise: one tolerance for every threshold of the rule."""
    return sparsity >= threshold - TOL


@dataclass(frozen=True)
class Suggestion:
    """Settings the rule proposes, each with the reason shown in the resolved config and the report."""

    values: dict[str, object]
    why: dict[str, str] = field(default_factory=dict)


def pretraining_lr(n_params: int) -> float:
    """A typical pre-training peak lr for a model of ``n_params`` parameters (the scale every other lr is a fraction of):
    3e-3 · (N / 4e6)^-0.3 up to 7 B (3.2e-4 there: Llama-2-7B was pre-trained at 3e-4); above, log-linear to the value
    that puts ELSA's lr for Gemma-2-27B at the paper's 2e-5."""
    lr_7b = 3e-3 * (7e9 / 4e6) ** -0.3
    if n_params <= 7e9:
        return 3e-3 * (n_params / 4e6) ** -0.3
    slope = math.log(2e-5 / ELSA_F / lr_7b) / math.log(27.2e9 / 7e9)
    return lr_7b * (n_params / 7e9) ** slope


def lmda_at_90(n_params: int) -> float:
    """λ at 90 % sparsity: 2e-2 up to 7 B parameters (LLaMA-2-7B), falling log-linearly to 2e-3 at 27 B (Gemma-2-27B)."""
    if n_params <= 7e9:
        return 2e-2
    t = min(math.log(n_params / 7e9) / math.log(27e9 / 7e9), 1.0)
    return math.exp((1 - t) * math.log(2e-2) + t * math.log(2e-3))


def warmup(steps: int) -> tuple[int, str]:
    """Warm-up steps that come with the rule's lr for a run of ``steps`` steps, and why."""
    if steps >= COSINE_FROM[1]:
        return 0, f"none: {steps} steps is a long budget (the paper's setting)"
    n = max(1, round(WARMUP_FRACTION * steps))
    return n, (f"{WARMUP_FRACTION:.0%} of {steps} steps: a short budget's larger lr (< {COSINE_FROM[1]} steps; ours, "
               "measured on the demo and docs-llama)")


def rule_warm_start(sparsity: float, steps: int) -> bool:
    """Whether the rule starts ELSA from SparseGPT's pruned model (x₀ = z₀ = its reconstruction): a short budget up to 90 %."""
    return steps < COSINE_FROM[1] and sparsity <= WARM_START_UP_TO + TOL


def schedule_why(sparsity: float, cosine: bool, linear: bool) -> str:
    """Why the λ schedule is what it is, in the thresholds' own values (COSINE_FROM, LINEAR_FROM)."""
    low, long_budget = COSINE_FROM
    short = f"a short budget (< {long_budget} steps"
    if cosine:
        return f"cosine from 0: sparsity >= {low:.0%} over a long budget (>= {long_budget} steps; the paper's setting)"
    if linear:
        return f"linear from 0: sparsity >= {LINEAR_FROM:.0%} over {short}; ours, measured at 90 %)"
    if at_least(sparsity, low):
        return f"constant: sparsity below {LINEAR_FROM:.0%} over {short})"
    return f"constant: sparsity below {low:.0%} (the paper's setting)"


def elsa_settings(n_params: int, sparsity: float, steps: int, start_pruned: bool | None = None,
                  interval: int | None = None) -> Suggestion:
    """lr, λ, λ schedule, warm-up, start and held end for ELSA on a model of ``n_params`` parameters pruned to
    ``sparsity`` in ``steps`` steps. ``start_pruned``: whether x starts from a one-shot's pruned weights as the user set
    it (their ``--init_mask`` with ``--init_weights``); None: the rule decides, and says so in ``init_mask`` /
    ``init_weights``. ``interval``: the run's steps between z, u updates, which the held end leaves room for one of
    (:func:`held_end`); None: not known, the held end as the rule states it."""
    rule_start = start_pruned is None and rule_warm_start(sparsity, steps)
    pruned = bool(start_pruned) or rule_start
    factor, budget_why = budget_factor(steps)
    retrain_like = pruned and at_least(sparsity, LINEAR_FROM) and RETRAIN_G * factor > ELSA_F  # a budget too short for ADMM alone
    if not pruned or factor <= 1.0:
        scale, scale_why = ELSA_F * factor, f"{ELSA_F:g} x {budget_why}"
    elif retrain_like:
        scale, scale_why = RETRAIN_G * factor, (f"{RETRAIN_G:g} x {budget_why} (x starts pruned at >= {LINEAR_FROM:.0%}: the "
                                                "retraining rule's lr, which starts from the same one-shot model, as it is "
                                                f"above ELSA's {ELSA_F:g})")
    else:
        scale, scale_why = ELSA_F, (f"{ELSA_F:g} x budget factor 1 (x starts pruned: the short budget's {budget_why} would "
                                    "undo the one-shot's reconstruction)")
    lr = pretraining_lr(n_params) * scale * math.exp(ELSA_K * (sparsity - 0.9))
    lmda = lmda_at_90(n_params) * math.exp(LMDA_KAPPA * (sparsity - 0.9))
    cosine = at_least(sparsity, COSINE_FROM[0]) and steps >= COSINE_FROM[1]
    linear = not cosine and at_least(sparsity, LINEAR_FROM)
    schedule = LambdaSchedule.cosine if cosine else LambdaSchedule.linear if linear else LambdaSchedule.constant
    size = f"{n_params / 1e6:.1f} M parameters"
    warm, warm_why = warmup(steps)
    values = {"lr": float(f"{lr:.3g}"), "lmda": float(f"{lmda:.3g}"), "lmda_schedule": schedule, "warmup_steps": warm}
    why = {"lr": f"{size} (pre-training-scale lr {pretraining_lr(n_params):.2g}) x {scale_why} x sparsity "
                 f"factor exp({ELSA_K:g}·({sparsity:g}−0.9))",
           "lmda": f"λ at 90 % {lmda_at_90(n_params):.2g} for {size} x exp({LMDA_KAPPA:g}·({sparsity:g}−0.9))",
           "lmda_schedule": schedule_why(sparsity, cosine, linear),
           "warmup_steps": warm_why}
    if rule_start:
        values.update(init_mask="sparsegpt", init_weights=True)
        start_why = (f"start from SparseGPT's pruned model: sparsity up to {WARM_START_UP_TO:.0%} over a short budget "
                     f"(< {COSINE_FROM[1]} steps; ours, measured at 70 and 90 %)")
        why.update(init_mask=start_why, init_weights=start_why)
    half = round(HOLD_FRACTION * steps) if retrain_like else 0
    if half:  # else unset: the paper's end (x = Π(x) at the last step)
        values["hold_steps"] = hold = held_end(half, steps, interval)
        why["hold_steps"] = (f"{HOLD_FRACTION:.0%} of {steps} steps inside the mask of an early x = Π(x): x starts pruned at "
                             f">= {LINEAR_FROM:.0%} where retraining's lr is above ELSA's (below ~450 steps; ours, measured "
                             "at 80 and 90 %)" + (f"; {hold}, not {half}: the {steps - half} steps before {half} end before "
                                                  f"the first z, u update at interval {interval}" if hold != half else ""))
    return Suggestion(values, why)


def held_end(hold: int, steps: int, interval: int | None) -> int:
    """The held end, shortened so that the ADMM steps before it make at least one z, u update at ``interval`` (after
    step interval − 1: ``config_checks.schedule_oddities``); as it is where no hold leaves one either (a run no longer
    than its interval: the schedule's warning says so) or the interval is not known. A walk: at 64 steps the rule's half
    left 32 ADMM steps, no update at the default interval 32, and the job warned of settings the user had not set."""
    if interval is None or (steps - hold - 1) // interval >= 1 or (steps - 1) // interval < 1:
        return hold
    return steps - interval - 1


def budget_factor(steps: int) -> tuple[float, str]:
    """(4096 / T)^β and why, T at least MIN_RULE_STEPS: the rule has no evidence below it, and a factor grown on (8x at
    4 steps) made a short smoke run worse than the one-shot model it started from (docs/history.md)."""
    factor = (REF_STEPS / max(steps, MIN_RULE_STEPS)) ** BETA
    if steps >= MIN_RULE_STEPS:
        return factor, f"budget factor (4096/{steps})^{BETA:g} = {factor:.2f}"
    return factor, (f"budget factor (4096/{MIN_RULE_STEPS})^{BETA:g} = {factor:.2f} ({steps} steps: below "
                    f"{MIN_RULE_STEPS}, the shortest budget the rule was measured at, it grows no further)")


def retrain_settings(n_params: int, steps: int) -> Suggestion:
    """lr and warm-up for retraining with a fixed mask (one-shot + fine-tuning or LoRA) and for the dense control."""
    budget, budget_why = budget_factor(steps)
    lr = pretraining_lr(n_params) * RETRAIN_G * budget
    warm, warm_why = warmup(steps)
    return Suggestion({"lr": float(f"{lr:.3g}"), "warmup_steps": warm},
                      {"lr": f"{n_params / 1e6:.1f} M parameters (pre-training-scale lr {pretraining_lr(n_params):.2g}) x "
                             f"{RETRAIN_G:g} x {budget_why}",
                       "warmup_steps": warm_why})


# Settings the rule must reproduce (or stay within), with where each comes from; tests/test_defaults.py checks them.
ANCHORS = (
    {"source": "ELSA paper appendix, LLaMA-2-7B, 4096 steps", "n_params": 6.74e9, "steps": 4096,
     "lr": {0.5: (4e-5, 7e-5), 0.9: (8e-5, 1.3e-4)}, "lmda": {0.5: (5e-4, 2e-3), 0.9: (1e-2, 3e-2)}},
    {"source": "ELSA paper appendix, Gemma-2-27B, 4096 steps", "n_params": 27.2e9, "steps": 4096,
     "lr": {0.9: (1.5e-5, 2.5e-5)}, "lmda": {0.9: (1.5e-3, 2.5e-3)}},
)
