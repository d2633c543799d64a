"""The defaults rule: ELSA's lr, λ and λ schedule (and fine-tuning's lr) from model size, sparsity and step budget.

PLACEHOLDER — constants fitted in the sweep below are filled in once measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from elsa_ds.admm.schedule import LambdaSchedule

RULE_FIELDS = ("lr", "lmda", "lmda_schedule")


@dataclass(frozen=True)
class Suggestion:
    """Settings the rule proposes, each with the reason shown in the resolved config and the report."""

    values: dict[str, object]
    why: dict[str, str] = field(default_factory=dict)


def elsa_settings(n_params: int, sparsity: float, steps: int) -> Suggestion:
    """lr, λ and λ schedule for ELSA."""
    lr = 1e-3 * (4e6 / n_params) ** 0.3 * (512 / steps) ** 0.5 * math.exp(4 * (sparsity - 0.9))
    return Suggestion({"lr": lr, "lmda": 0.01, "lmda_schedule": LambdaSchedule.constant},
                      {"lr": "placeholder", "lmda": "placeholder", "lmda_schedule": "placeholder"})


def finetune_settings(n_params: int, sparsity: float, steps: int) -> Suggestion:
    """lr for retraining with a fixed mask (or the dense control)."""
    lr = 1e-3 * (4e6 / n_params) ** 0.3 * (512 / steps) ** 0.5
    return Suggestion({"lr": lr}, {"lr": "placeholder"})
