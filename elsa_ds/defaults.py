"""The defaults rule: ELSA's lr, λ and λ schedule — and retraining's lr — with their warm-up, from model size, sparsity and
step budget.

Applied to every one of those settings the user leaves unset (``jobs/defaults_applied.py``); the resolved config and
the report say which values came from here and why. Pure: numbers in, numbers out.

    lr_pre(N)      = 3e-3 · (N / 4e6)^-0.3                 a typical pre-training peak lr for N parameters
                                                            (3e-3 at 4 M, 2.1e-3 at 13 M, 3.2e-4 at 7 B: Llama-2's 3e-4;
                                                            above 7 B steeper, to the paper's Gemma-2-27B setting)
    lr_elsa        = lr_pre(N) · F · (4096 / T)^β · exp(k·(s − 0.9))       T = steps, s = sparsity
                     (x starting pruned: min(1, (4096 / T)^β) in place of the budget factor)
    start          = SparseGPT's pruned model (x₀ = z₀, --init_mask sparsegpt --init_weights) when s < 0.8 and
                     T < 2048 and the lr is the rule's; else the dense model (the paper's)
    λ              = Λ(N) · exp(κ·(s − 0.9))
    λ schedule     = cosine from 0 when s ≥ 0.7 and T ≥ 2048 (the paper's long runs); else linear from 0 when
                     s ≥ 0.8 (short budgets: our choice, measured); else constant
    lr_retrain     = lr_pre(N) · G · (4096 / T)^β                            (--finetune, and the dense control)
    warm-up        = 10 % of T when T < 2048 and the lr is the rule's (ELSA, retraining, dense control); else none

Anchors (see ``ANCHORS``; ``tests/test_defaults.py`` holds the rule to them): the paper's appendix, 4096 steps --
LLaMA-2-7B lr 5e-5 (50-60 %) .. 1e-4 (70-90 %), λ 1e-3 .. 2e-2 by sparsity, cosine λ from 0 at 70-90 %, constant at
50-60 %; Gemma-2-27B lr 2e-5, λ 2e-3. Nothing else: the budget exponent β and the short-budget behaviour are an
extrapolation. The 400-step sweeps of ``bench/quality.py`` (README "Quality at a fixed budget") do not confirm it
everywhere: on the under-trained demo and check-qwen2 the larger steps pay, but on docs-llama (a model that has
seen its corpus once, lr annealed) the same training with no pruning at all (dense + ft) ends 0.8 % worse than the
model it started from on text it never saw, and 7 % worse on its own training text (the first docs-llama). So at
budgets far from 4096 steps pass lr and lmda yourself, or check the report's curve.

The linear ramp at short budgets and high sparsity is ours, not the paper's (its short runs do not exist; its long runs
ramp by cosine): at 90 %, 400 steps it gave 83.37 against 87.31 for constant λ on the demo and 147.18 against 160.19
on the first docs-llama, while at 70 % there (λ is small) it lost, 130.04 against 128.51 -- so it starts at 80 %.
The check model does not confirm it: check-qwen2 at 90 % gave 113.82 with the ramp against 111.06 with constant λ.
A cosine ramp spends too long near λ = 0 for a short run (83.96 on the demo at 90 %). With this rule the demo at 95 %
gave 89.26 (constant λ: 99.29; Wanda + ft on the same tokens: 95.24); 80 % was not tried with constant λ on the same machine.

Short budgets need larger steps: the pruned weights must travel to zero within T steps, so the lr grows as T
shrinks (β); higher sparsity moves further from the dense weights and needs larger steps still (k).

Those larger steps come with a linear warm-up over the first 10 % of a short run (ours; the authors' code has none and
the paper's 4096-step runs keep none here). Adam's first steps move every weight by about the lr whatever its
gradient: 40 steps at the rule's lr without one raised held-out perplexity by 61 % on docs-llama and 23 % on the demo
with no pruning at all. Measured at 400 steps, one run each, `bench/explore.py` unless said: ELSA on docs-llama 159.31
(the bench) → 156.71 at 70 %, 163.91 (the bench) → 160.06 at 80 %; on the first docs-llama 128.51 → 125.53 at 70 %
(the bench); on the demo 83.48 → 83.25 at 90 %. Wanda + ft on docs-llama 157.19 (the bench) → 155.59 at 80 %, on
the demo 83.20 → 83.05 at 90 %. It is applied only with the rule's lr: an lr the user sets keeps the warm-up the user
sets (default none).

Below 80 % over a short budget the rule starts from SparseGPT's pruned model (ours; since 2026-11-26): there the one-shot
reconstruction keeps most of the model (SparseGPT within 2-3 % of dense at 70 % on docs-llama and check-qwen2), and a
short run from the dense weights does not get back what its large steps and final cut cost. From that start the
short-budget lr factor only undoes the reconstruction, so it is dropped. Measured at 70 %, 400 steps (`bench/explore.py`,
fp32, one run each, warm-up 40): docs-llama 156.71 (dense start, the rule's lr) → 154.76 (SparseGPT start, the same
lr) → 152.74 (SparseGPT start, no factor; SparseGPT alone: 154.48; through the bench, bf16: 152.68); the demo
78.35 → 77.90. On the check model (check-qwen2, not tuned on) it costs 7.6 %: 115.49 against the dense start's
107.35 (both through the bench; exploratory 115.45 and 107.35), still 15 % below SparseGPT's 135.61 -- a model that gains 18 % from dense fine-tuning on 0.8 M tokens wants the larger steps,
a trained one (the case of a real LLM pruned on C4: docs-llama's dense control gains nothing) wants the start. From
80 % on the dense start with the larger steps won on the demo (80 %: 79.00 against 79.12-79.37 from SparseGPT; 90 %:
83.47 against 83.26-83.70). A user's lr, --init_mask or --init_weights keeps the paper's dense start (or their own).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from elsa_ds.admm.schedule import LambdaSchedule

RULE_FIELDS = ("lr", "lmda", "lmda_schedule", "warmup_steps", "init_mask", "init_weights")

REF_STEPS = 4096          # the paper's budget
BETA = 0.3                # lr ∝ T^-β
ELSA_F = 0.31             # lr / lr_pre at 90 %, 4096 steps (LLaMA-2-7B: 1e-4 / 3.2e-4)
ELSA_K = 1.6              # d ln(lr) / d sparsity (LLaMA-2-7B: 5e-5 at 50 % .. 1e-4 at 90 %)
RETRAIN_G = 0.16          # retraining lr / lr_pre at 4096 steps
LMDA_KAPPA = 7.5          # d ln(λ) / d sparsity (LLaMA-2-7B: 1e-3 at 50 % .. 2e-2 at 90 %)
COSINE_FROM = (0.7, 2048)  # cosine λ from 0 at sparsity >= 0.7 with >= 2048 steps
LINEAR_FROM = 0.8          # shorter budgets: linear λ from 0 at sparsity >= 0.8, constant below
WARMUP_FRACTION = 0.1      # shorter budgets (< COSINE_FROM[1] steps): lr warm-up over this fraction of the steps
WARM_START_BELOW = 0.8     # shorter budgets: below this sparsity x and z start from SparseGPT's pruned model


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
    """Whether the rule starts ELSA from SparseGPT's pruned model (x₀ = z₀ = its reconstruction): a short budget below 80 %."""
    return steps < COSINE_FROM[1] and sparsity < WARM_START_BELOW


def elsa_settings(n_params: int, sparsity: float, steps: int, start_pruned: bool | None = None) -> Suggestion:
    """lr, λ, λ schedule, warm-up and start for ELSA on a model of ``n_params`` parameters pruned to ``sparsity`` in
    ``steps`` steps. ``start_pruned``: whether x starts from a one-shot's pruned weights as the user set it (their
    ``--init_mask`` with ``--init_weights``); None: the rule decides, and says so in ``init_mask`` / ``init_weights``."""
    rule_start = start_pruned is None and rule_warm_start(sparsity, steps)
    pruned = bool(start_pruned) or rule_start
    factor = (REF_STEPS / steps) ** BETA
    budget = min(factor, 1.0) if pruned else factor
    lr = pretraining_lr(n_params) * ELSA_F * budget * math.exp(ELSA_K * (sparsity - 0.9))
    lmda = lmda_at_90(n_params) * math.exp(LMDA_KAPPA * (sparsity - 0.9))
    cosine = sparsity >= COSINE_FROM[0] and steps >= COSINE_FROM[1]
    linear = not cosine and sparsity >= LINEAR_FROM
    schedule = LambdaSchedule.cosine if cosine else LambdaSchedule.linear if linear else LambdaSchedule.constant
    size = f"{n_params / 1e6:.1f} M parameters"
    warm, warm_why = warmup(steps)
    budget_why = (f"budget factor (4096/{steps})^{BETA:g} = {factor:.2f}" if not pruned or factor <= 1.0 else
                  f"budget factor 1 (x starts pruned: the short-budget factor (4096/{steps})^{BETA:g} = {factor:.2f} "
                  "would undo the one-shot's reconstruction)")
    values = {"lr": float(f"{lr:.3g}"), "lmda": float(f"{lmda:.3g}"), "lmda_schedule": schedule, "warmup_steps": warm}
    why = {"lr": f"{size} (pre-training-scale lr {pretraining_lr(n_params):.2g}) x {ELSA_F:g} x {budget_why} x sparsity "
                 f"factor exp({ELSA_K:g}·({sparsity:g}−0.9))",
           "lmda": f"λ at 90 % {lmda_at_90(n_params):.2g} for {size} x exp({LMDA_KAPPA:g}·({sparsity:g}−0.9))",
           "lmda_schedule": ("cosine from 0: sparsity >= 70 % over a long budget (the paper's setting)" if cosine else
                             "linear from 0: sparsity >= 80 % over a short budget (< 2048 steps; ours, measured at 90 %)" if linear else
                             "constant: " + ("sparsity below 80 % over a short budget (< 2048 steps)" if sparsity >= COSINE_FROM[0]
                                             else "sparsity below 70 % (the paper's setting)")),
           "warmup_steps": warm_why}
    if rule_start:
        values.update(init_mask="sparsegpt", init_weights=True)
        start_why = (f"start from SparseGPT's pruned model: sparsity below {WARM_START_BELOW:.0%} over a short budget "
                     f"(< {COSINE_FROM[1]} steps; ours, measured at 70 %)")
        why.update(init_mask=start_why, init_weights=start_why)
    return Suggestion(values, why)


def retrain_settings(n_params: int, steps: int) -> Suggestion:
    """lr and warm-up for retraining with a fixed mask (one-shot + fine-tuning or LoRA) and for the dense control."""
    budget = (REF_STEPS / steps) ** BETA
    lr = pretraining_lr(n_params) * RETRAIN_G * budget
    warm, warm_why = warmup(steps)
    return Suggestion({"lr": float(f"{lr:.3g}"), "warmup_steps": warm},
                      {"lr": f"{n_params / 1e6:.1f} M parameters (pre-training-scale lr {pretraining_lr(n_params):.2g}) x "
                             f"{RETRAIN_G:g} x budget factor (4096/{steps})^{BETA:g} = {budget:.2f}",
                       "warmup_steps": warm_why})


# Settings the rule must reproduce (or stay within), with where each comes from; tests/test_defaults.py checks them.
ANCHORS = (
    {"source": "ELSA paper appendix, LLaMA-2-7B, 4096 steps", "n_params": 6.74e9, "steps": 4096,
     "lr": {0.5: (4e-5, 7e-5), 0.9: (8e-5, 1.3e-4)}, "lmda": {0.5: (5e-4, 2e-3), 0.9: (1e-2, 3e-2)}},
    {"source": "ELSA paper appendix, Gemma-2-27B, 4096 steps", "n_params": 27.2e9, "steps": 4096,
     "lr": {0.9: (1.5e-5, 2.5e-5)}, "lmda": {0.9: (1.5e-3, 2.5e-3)}},
)
