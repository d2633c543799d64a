"""The ADMM knobs AdmmOptimizer runs with (validated upstream by ElsaConfig), apart from the optimizer so that the
settings layer can name them without the optimizer's machinery."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from elsa_ds.admm.projection import NM
from elsa_ds.admm.schedule import LambdaSchedule
from elsa_ds.admm.state import StateDtype


class Projection(str, Enum):
    fisher = "fisher"
    magnitude = "magnitude"


@dataclass(frozen=True)
class AdmmSettings:
    """The ADMM knobs the optimizer needs (validated upstream by ElsaConfig)."""

    total_steps: int
    interval: int = 32
    lmda: float = 0.01
    lmda_schedule: LambdaSchedule = LambdaSchedule.constant
    projection: Projection = Projection.fisher
    z_dtype: StateDtype = StateDtype.fp32
    u_dtype: StateDtype = StateDtype.fp32
    pattern: NM | None = None  # N:M instead of a per-layer top-k
    hold_steps: int = 0  # the last steps train inside the mask of an early x ← Π(x) (0: the paper's method)
    balance_mu: float = 1.5  # adaptive λ: the residuals' ratio that moves a layer's λ (the authors' --admm_mu)
    balance_tau: float = 2.0  # adaptive λ: the factor it moves by (their --admm_tau_incr and --admm_tau_decr)
    relaxation: float = 1.0  # α of the dual update u ← u + α (x − z) (their --admm_alpha; 1: plain ADMM)
    kernels: bool = True  # fused CPU kernels where they apply (ELSA_DS_KERNELS=0 also turns them off)
