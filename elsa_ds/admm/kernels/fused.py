"""The AdmmOptimizer's fast path: which flats the fused kernels step and project, and the calls that do it.

A flat qualifies for the fused x-step when it is a contiguous fp32 CPU tensor with an fp32 gradient and
the base optimizer is one whose update the kernels reproduce: DeepSpeedCPUAdam (fp32 moments, its
bias-correction history), or 8-bit Adam in bitsandbytes' blockwise format or our minifloat codes
(``elsa_ds.admm.adam8bit.Adam8bit``, or bitsandbytes' own ``Adam8bit`` with its default settings). It qualifies for the fused projection
when it is a CPU flat and the projection is a per-layer top-k (N:M keeps the eager path). Everything
else takes the eager path of ``optimizer.py``, which stays the reference.
"""
from __future__ import annotations

from typing import Protocol

import torch

from elsa_ds.admm.kernels import build, select, xstep
from elsa_ds.admm.kernels.ops import PenaltyState, ScoreSource, SliceTable
from elsa_ds.admm.projection import Comm, Slice
from elsa_ds.admm.state import StateDtype

DEEPSPEED_ADAM, ADAM8BIT = "deepspeed_adam", "adam8bit"


class XStep(Protocol):
    """A fused x-step the AdmmOptimizer can hand a flat to instead of its eager path (``FusedPath`` is one)."""

    def steps(self, flat: torch.Tensor, st: dict) -> bool:
        """True when this path steps ``flat`` (then the base optimizer's step skips it)."""

    def step(self, flat: torch.Tensor, slices: list[Slice], st: dict, group: dict, lam: float, zu: PenaltyState) -> None:
        """x ← the base's update of x with gradient ∇f + λ((x − z) + u) on the slices, and its state updated."""


def base_kind(base: torch.optim.Optimizer) -> str | None:
    """Which fused x-step reproduces ``base``'s update, if any (duck-typed: the math core imports no DeepSpeed)."""
    name, module = type(base).__name__, type(base).__module__
    if name == "DeepSpeedCPUAdam" and module.startswith("deepspeed") and getattr(base, "fp32_optimizer_states", True):
        return DEEPSPEED_ADAM
    if name == "Adam8bit" and module == "elsa_ds.admm.adam8bit":
        return ADAM8BIT
    if name == "Adam8bit" and module.startswith("bitsandbytes"):
        args = getattr(base, "args", None)
        plain = args is not None and getattr(args, "percentile_clipping", 100) == 100 and not getattr(args, "max_unorm", 0.0)
        return ADAM8BIT if plain and getattr(args, "block_wise", True) and not getattr(args, "skip_zeros", False) else None
    return None


class FusedPath:
    """Fused kernels for one AdmmOptimizer; ``kernels`` is None when disabled or not buildable (eager everywhere)."""

    def __init__(self, base: torch.optim.Optimizer, enabled: bool = True):
        self.kind = base_kind(base)
        self.kernels = build.load() if enabled else None
        self.adamw = bool(getattr(base, "adam_w_mode", True))  # DeepSpeedCPUAdam: AdamW or L2 weight decay
        self.bias = xstep.DeepSpeedBiasCorrection()
        self._tables: dict[int, tuple[torch.Tensor, SliceTable]] = {}
        self.projection_paths: dict[str, int] = {}  # how the projections found their thresholds (select.thresholds)
        self.x_steps: dict[str, int] = {}  # fused x-steps per kind: deepspeed_adam, adam8bit/bitsandbytes, adam8bit/minifloat

    def table(self, flat: torch.Tensor, slices: list[Slice]) -> SliceTable:
        entry = self._tables.get(id(flat))
        if entry is None or entry[0] is not flat:
            entry = (flat, SliceTable.of(slices))
            self._tables[id(flat)] = entry
        return entry[1]

    # ---- the x-step ---------------------------------------------------------------------------------
    def steps(self, flat: torch.Tensor, st: dict) -> bool:
        """True when the fused x-step runs this flat (its state must already exist: the base creates it)."""
        if self.kernels is None or self.kind is None or flat.grad is None:
            return False
        cpu = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in (flat, flat.grad))
        if not cpu or flat.numel() == 0:
            return False
        if self.kind == DEEPSPEED_ADAM:  # only where its SIMD width is known (x86 with AVX2 or AVX-512)
            return self.kernels.deepspeed_adam_simd_width() > 0 and all(
                torch.is_tensor(st.get(k)) and st[k].dtype == torch.float32 for k in ("exp_avg", "exp_avg_sq"))
        return torch.is_tensor(st.get("state1")) and st["state1"].dtype == torch.uint8 and "absmax1" in st

    def step(self, flat: torch.Tensor, slices: list[Slice], st: dict, group: dict, lam: float, zu: PenaltyState) -> None:
        """x ← Adam(x, ∇f + λ((x − z) + u) on the slices), one pass; ``zu``: z and u as stored, with their scales."""
        kernels = self.kernels
        assert kernels is not None, "stepped only where steps() said so, which needs the kernels"
        table = self.table(flat, slices)
        if self.kind == DEEPSPEED_ADAM:
            xstep.adam_step(kernels, flat, st, group, table, zu, lam, self.adamw, self.bias)
            done = DEEPSPEED_ADAM
        else:
            done = f"{ADAM8BIT}/{xstep.adam8bit_step(kernels, flat, st, group, table, zu, lam)}"
        self.x_steps[done] = self.x_steps.get(done, 0) + 1

    # ---- the projection -----------------------------------------------------------------------------
    def projects(self, flat: torch.Tensor, slices: list[Slice], pattern) -> bool:
        """True when the fused projection handles this flat (CPU, per-layer top-k, layers below 2^31 entries)."""
        return (self.kernels is not None and pattern is None and flat.device.type == "cpu" and flat.dtype == torch.float32
                and flat.is_contiguous() and all(s.numel < 2**31 for s in slices))

    def project(self, flat: torch.Tensor, slices: list[Slice], st: dict, fisher_state: dict | None, keys: tuple,
                dtypes: tuple[StateDtype, StateDtype], comm: Comm, mode: int) -> torch.Tensor:
        """The z/u update (UPDATE), z₀ = Π(x) (INIT) or x ← Π(x) (FINAL) for one flat; [Σ(x−z)², Σx², flips]. Collective."""
        u = st[keys[1]] if mode == select.UPDATE else torch.empty(0)
        source = ScoreSource(flat.detach(), u, st[keys[3]], *select.fisher_source(fisher_state))
        return select.split(self.kernels, st, keys, source, self.table(flat, slices), slices, comm, mode, dtypes,
                            self.projection_paths)
