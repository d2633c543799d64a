"""The fused ADMM x-step on CPU flats: penalty and Adam in one pass (csrc/xstep.cpp, csrc/xstep8bit.cpp).

    g' = g + λ ((x − z) + u)     on the pruned slices, z and u dequantized in registers
    Adam(x, g')                  DeepSpeedCPUAdam's arithmetic (fp32 m, v), or blockwise 8-bit Adam (uint8 codes
                                 of m, v with per-256-entry absmax, in either format of ``quant8.py``)

reads p, g, m, v, z, u once and writes p, m, v: 36 bytes per entry for fp32 states instead of the
eager path's 28 (Adam) + 24 ((x − z) + u into a temporary, added to g). The eager path in
``optimizer.py`` (penalty into ``grad``, then ``base.step()``) stays the reference the kernels are
tested against; the kernel leaves ``grad`` untouched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from elsa_ds.admm.kernels import ops
from elsa_ds.admm.kernels.ops import PenaltyState, SliceTable
from elsa_ds.admm.kernels.quant8 import MINIFLOAT, f32, state_format


def chained_power(base: float, step: int) -> float:
    """β^t as a run that stepped 1, 2, ..., t holds it in DeepSpeed's float32 members: β multiplied in once a step."""
    value = 1.0
    for _ in range(step):
        value = f32(value * base)
    return value


@dataclass
class DeepSpeedBiasCorrection:
    """DeepSpeed's ``Adam_Optimizer::IncrementStep`` and ``update_state``, in its float32 arithmetic.

    DeepSpeed keeps β1^t, β2^t per optimizer (shared by all its parameters): multiplied by β once per new
    step. One instance per optimizer reproduces that history, so fused flats get DeepSpeed's bias corrections
    bit for bit. Where the step jumps (a resumed run's first step) or β changes, DeepSpeed takes ``pow``, which
    differs from the product in float32's last bit: a resumed run's masters then moved 1 ulp from the
    uninterrupted run's, which in bf16 changes the forward and, over a few projections, the mask (a user's
    walk, 2026-12-01). Here a jump takes the product a run stepping from 1 holds (``chained_power``), so a
    resumed run steps as the uninterrupted one; ``compat.replay_cpu_adam`` does the same for DeepSpeed's own.
    """

    step: int = 0
    beta1: float = float("nan")
    beta2: float = float("nan")
    beta1_t: float = 1.0
    beta2_t: float = 1.0

    def advance(self, step: int, beta1: float, beta2: float) -> tuple[float, float]:
        """(1 − β1^t, 1/√(1 − β2^t)) for ``step`` t, as DeepSpeed's float members hold them."""
        b1, b2 = f32(beta1), f32(beta2)
        if b1 != self.beta1 or b2 != self.beta2 or step not in (self.step, self.step + 1):
            self.step, self.beta1, self.beta2 = step, b1, b2
            self.beta1_t, self.beta2_t = chained_power(b1, step), chained_power(b2, step)
        elif step == self.step + 1:
            self.step += 1
            self.beta1_t, self.beta2_t = f32(self.beta1_t * b1), f32(self.beta2_t * b2)
        return f32(1.0 - self.beta1_t), f32(1.0 / f32(math.sqrt(f32(1.0 - self.beta2_t))))


def adam_step(kernels: ModuleType, flat: torch.Tensor, state: dict, group: dict, table: SliceTable, zu: PenaltyState,
              lam: float, adamw: bool, bias: DeepSpeedBiasCorrection) -> None:
    """One DeepSpeedCPUAdam step of ``flat`` with the ADMM penalty fused in; ``state['step']`` += 1.

    ``zu`` as stored; ``PenaltyState.none()`` and no slices give plain DeepSpeed Adam.
    """
    grad = flat.grad
    assert grad is not None, "the optimizer steps only flats with a gradient"
    state["step"] += 1
    beta1, beta2 = group["betas"]
    bc1, bc2 = bias.advance(state["step"], beta1, beta2) if group.get("bias_correction", True) else (1.0, 1.0)
    ops.adam_step(kernels, p=flat.data, grad=grad.data, exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"], zu=zu,
                  table=table, lam=lam, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"], adamw=adamw, bias_correction1=bc1, bias_correction2=bc2)


def adam8bit_step(kernels: ModuleType, flat: torch.Tensor, state: dict, group: dict, table: SliceTable, zu: PenaltyState,
                  lam: float) -> str:
    """One 8-bit Adam step of ``flat`` (bitsandbytes or minifloat codes, as its maps say) with the ADMM penalty fused
    in; ``state['step']`` += 1. Returns the code format it stepped."""
    grad = flat.grad
    assert grad is not None, "the optimizer steps only flats with a gradient"
    name = state_format(state)
    state["step"] += 1
    beta1, beta2 = group["betas"][:2]
    ops.adam8bit_step(kernels, p=flat.data, grad=grad.data, state1=state["state1"], state2=state["state2"],
                      qmap1=state["qmap1"], qmap2=state["qmap2"], absmax1=state["absmax1"], absmax2=state["absmax2"], zu=zu,
                      table=table, lam=lam, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], step=state["step"], minifloat=name == MINIFLOAT)
    return name
