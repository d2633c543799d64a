"""The ADMM x-step for flats the C++ kernels do not take (GPU flats): penalty and Adam in one compiled pass.

    g' = g + λ ((x − z·s_z) + u·s_u)      on the pruned slices (z, u stored in fp32, bf16 or fp8 with scales s)
    Adam(x, g')                           torch.optim.Adam / AdamW's arithmetic (fp32 m, v; L2 or decoupled decay)

``torch.compile`` turns ``segment`` into one kernel per dtype combination (Triton on CUDA, C++ on CPU) that
reads p, g, m, v, z, u once and writes p, m, v: no slice-sized temporary, where the eager path of
``optimizer.py`` writes (x − z) + u into one and adds it to the gradient before ``base.step()``. That eager
path stays the reference this step is tested against; this step leaves ``grad`` untouched.

A flat qualifies when it is not on the CPU (CPU flats have the C++ kernels), fp32 and contiguous, and the
base is a plain ``torch.optim.Adam`` or ``AdamW`` (no amsgrad, maximize, capturable or differentiable) whose
state already exists. It is opt-in, ``ELSA_DS_COMPILED=1`` (``ELSA_DS_KERNELS=0`` turns every fast path off): on the one
GPU measured (an H100, ``bench/optimizer_step.py --device cuda``, 32M entries in 8 layers) it took 1.61 ms a step where
the eager path took 0.77 ms (the penalty into the gradient, then torch's fused Adam), most likely the per-call cost of
Dynamo's guards over one call per slice and gap (docs/results.md, section 3, "On the GPU"). A compilation that fails says
why once and this flat's step then runs the same function uncompiled.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch

from elsa_ds.admm.kernels import build

log = logging.getLogger(__name__)

ADAM, ADAMW = "adam", "adamw"
# hyper-parameters travel as one fp32 tensor on the flat's device, so a new lr, λ or step never recompiles; each is
# computed in double on the host as torch's Adam computes its scalars, then rounded once to fp32
_LAM, _W1, _BETA2, _W2, _EPS, _WD, _DECAY, _STEP_SIZE, _BC2_SQRT = range(9)


def enabled() -> bool:
    """True when ``ELSA_DS_COMPILED=1`` (opt-in) and not ``ELSA_DS_KERNELS=0`` (every fast path off)."""
    return (os.environ.get("ELSA_DS_COMPILED") or "0").strip().lower() not in build.OFF and build.enabled()


def base_kind(base: torch.optim.Optimizer) -> str | None:
    """``adam`` or ``adamw`` when ``base`` is torch's own Adam(W) with settings this step reproduces, else None."""
    kind = {torch.optim.Adam: ADAM, torch.optim.AdamW: ADAMW}.get(type(base))
    if kind is None:
        return None
    if any(g.get(k) for g in base.param_groups for k in ("amsgrad", "maximize", "capturable", "differentiable")):
        return None
    if kind == ADAM and any(g.get("decoupled_weight_decay") for g in base.param_groups):
        return ADAMW
    return kind


def hyper(group: dict, step: float, lam: float, adamw: bool, device: torch.device) -> torch.Tensor:
    """The step's scalars (see ``_LAM`` ...) as torch's Adam derives them from the group and the step count t."""
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    values = [lam, 1 - beta1, beta2, 1 - beta2, eps, 0.0 if adamw else wd, 1 - lr * wd if adamw else 1.0, lr / bc1,
              math.sqrt(bc2)]
    return torch.tensor(values, dtype=torch.float32, device=device)


def segment(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, z: torch.Tensor | None,
            u: torch.Tensor | None, zs: torch.Tensor | None, us: torch.Tensor | None, h: torch.Tensor, adamw: bool) -> None:
    """One Adam step of a contiguous range, with the ADMM penalty where z and u are given (in place; g untouched).

    torch's foreach Adam's order of operations: L2 decay into g (Adam) or p ← p·(1 − lr·wd) (AdamW);
    m ← lerp(m, g, 1 − β1); v ← v·β2 + (1 − β2)·g²; p ← p − lr/bc1 · m / (√v / √bc2 + ε).
    """
    grad = g
    if z is not None:
        assert u is not None and zs is not None and us is not None, "z, u and their scales come together (step's zu)"
        grad = grad + h[_LAM] * ((p - z.float() * zs) + u.float() * us)
    if adamw:
        p.mul_(h[_DECAY])
    else:
        grad = grad + h[_WD] * p
    m.lerp_(grad, h[_W1])
    v.mul_(h[_BETA2]).addcmul_(grad, grad * h[_W2])
    p.sub_(h[_STEP_SIZE] * (m / (v.sqrt() / h[_BC2_SQRT] + h[_EPS])))


class CompiledStep:
    """The compiled x-step of one AdmmOptimizer for its non-CPU flats; ``kind`` is None when it never applies."""

    def __init__(self, base: torch.optim.Optimizer, on: bool = True):
        self.kind = base_kind(base) if on and enabled() else None
        self._fn: Callable[..., None] | None = None  # segment compiled, on first use
        self.compiled = True  # False once a compilation failed: the same function then runs uncompiled
        self.cpu = False  # also step CPU flats (tests and bench/optimizer_step.py; CPU flats have the C++ kernels)
        self.x_steps = 0

    def steps(self, flat: torch.Tensor, st: dict) -> bool:
        """True when this step runs ``flat`` (not on the CPU, fp32, contiguous; Adam's state already there)."""
        if self.kind is None or flat.grad is None or (flat.device.type == "cpu" and not self.cpu):
            return False
        tensors = (flat, flat.grad, st.get("exp_avg"), st.get("exp_avg_sq"))
        return "step" in st and all(torch.is_tensor(t) and t.dtype == torch.float32 and t.is_contiguous()
                                    and t.device == flat.device and t.numel() == flat.numel() for t in tensors)

    def step(self, flat: torch.Tensor, slices: list, st: dict, group: dict, lam: float, zu: tuple) -> None:
        """x ← Adam(x, ∇f + λ((x − z) + u) on the slices); ``zu`` = (z, u, z_scale, u_scale); ``st['step']`` += 1."""
        st["step"] += 1
        h = hyper(group, float(st["step"]), lam, self.kind == ADAMW, flat.device)
        grad = flat.grad
        assert grad is not None, "steps() ran this flat only with its gradient"
        p, g, m, v = (t.view(-1) for t in (flat.detach(), grad, st["exp_avg"], st["exp_avg_sq"]))
        z, u, zs, us = zu
        done = 0
        for j, sl in sorted(enumerate(slices), key=lambda js: js[1].offset):
            if sl.length == 0 or lam == 0.0:
                continue
            self._run(p, g, m, v, done, sl.offset - done, None, h)
            zu_j = (z.narrow(0, sl.offset, sl.length), u.narrow(0, sl.offset, sl.length), zs.narrow(0, j, 1), us.narrow(0, j, 1))
            self._run(p, g, m, v, sl.offset, sl.length, zu_j, h)
            done = sl.offset + sl.length
        self._run(p, g, m, v, done, p.numel() - done, None, h)
        self.x_steps += 1

    def _run(self, p, g, m, v, offset: int, length: int, zu: tuple | None, h: torch.Tensor) -> None:
        if length <= 0:
            return
        args = [t.narrow(0, offset, length) for t in (p, g, m, v)] + list(zu or (None,) * 4) + [h, self.kind == ADAMW]
        if self.compiled:
            try:
                return self._compiled()(*args)
            except Exception as err:  # no Triton, no compiler, an Inductor bug: say why once, run it uncompiled
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                log.warning("the compiled ADMM step is unavailable (%s); running it uncompiled", first)
                self.compiled = False
        segment(*args)

    def _compiled(self):
        if self._fn is None:
            # not fullgraph: past Dynamo's recompile limit (dtype and λ = 0 variants) a variant runs eagerly instead of failing
            self._fn = torch.compile(segment, dynamic=True)
        return self._fn
