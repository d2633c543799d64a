"""AdmmOptimizer: ELSA's ADMM around any torch optimizer, on flat tensors cut into layer slices.

ELSA solves  min f(x)  s.t.  ‖x_l‖₀ ≤ k_l  for every pruned layer l  by ADMM with scaled dual u:

    x-update (every step)      : one base-optimizer step on  f(x) + λ/2 ‖x − z + u‖²,
                                 i.e.  ∇ ← ∇f(x) + λ (x − z + u)
    z, u-update (every interval): z ← Π(x + u),   u ← u + x − z   (u ← u + α (x − z) with over-relaxation α)
    end                        : x ← Π(x)

With ``hold_steps`` h > 0 (ours, not the paper's: the masked retraining of ADMM pruning, Zhang et al. 2018) the hard
projection x ← Π(x) comes h steps before the end, and the last h steps train inside that mask: no penalty, the
gradient of every pruned entry zeroed before the base step and the entry itself after it, so pruned entries stay
exactly 0 (as one-shot + fine-tuning does for its whole run). λ's schedule then runs over the first T − h steps.

Π keeps per layer the k entries with the largest F_ii (x+u)_i² (F = the base optimizer's second
moment) or (x+u)_i² (magnitude), see ``projection.py``.

With the ``adaptive`` λ schedule (``balance.py``) each layer has its own λ, kept per slice in ``state[flat]`` beside z
and u (partitioned, offloaded and checkpointed with them), moved at each projection, its u rescaled at once; those runs
take the eager path (the fused kernels take one λ).

The optimizer never needs whole weights: a parameter tensor it steps ("flat") carries a list of
``Slice``s saying which of its entries belong to which pruned layer. Under ZeRO-3 a flat is one rank's
fp32 partition of a sub-group; on an ordinary model every pruned weight is a flat with one slice — the
single-process reference. z and u live in ``state[flat]`` beside the base optimizer's moments, so
whatever partitions, offloads or checkpoints those moments does the same for z and u.

Per engine step the caller calls ``begin_step(t)`` once, then ``step()`` may be called several times
(ZeRO-3 steps one sub-group per call); every flat must be stepped exactly once per engine step, on
every rank in the same order, since projections are collective.

On CPU flats the fused kernels (``kernels/``) take over where they reproduce the base optimizer: the
penalty and the Adam update in one pass, the projection in three passes with no score buffer. The
eager code below is their reference and the path for everything else (GPU flats, N:M, other bases).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from elsa_ds.admm import state as admm_state
from elsa_ds.admm.state import LAM, U, U_SCALE, Z, Z_SCALE
from elsa_ds.admm.adam8bit import second_moment
from elsa_ds.admm.balance import balanced_lambdas, lambda_summary, residual_sums
from elsa_ds.admm.kernels.compiled import CompiledStep
from elsa_ds.admm.kernels.fused import FusedPath, XStep
from elsa_ds.admm.kernels.ops import PenaltyState
from elsa_ds.admm.kernels.select import FINAL, INIT, UPDATE
from elsa_ds.admm.loaded import StateMismatch, state_problem
from elsa_ds.admm.penalty import Term, add_penalties, queue_penalty
from elsa_ds.admm.projection import Comm, LocalComm, Slice, projection_masks
from elsa_ds.admm.schedule import LambdaSchedule, dual_rescale, interval_lambda
from elsa_ds.admm.settings import AdmmSettings, Projection
from elsa_ds.admm.wrapper import OptimizerWrapper

METRIC_NAMES = ("residual_sq", "x_sq", "flips", "pruned_entries", "state_bytes", "state_entries")


class AdmmOptimizer(OptimizerWrapper):
    """Wraps ``base``; shares its ``param_groups`` and ``state`` so wrappers that edit them reach the base."""

    def __init__(self, base: torch.optim.Optimizer, settings: AdmmSettings, comm: Comm | None = None):
        super().__init__(base)
        self.settings = settings
        self.comm = comm or LocalComm()
        # called with a flat's state dict right after z and u were created (the base state exists by then)
        self.on_state_created: Callable[[dict], None] | None = None
        # warm start: the keep-mask of a slice (from a one-shot method) for z₀ = x ⊙ m instead of z₀ = Π(x)
        self.initial_mask: Callable[[Slice], torch.Tensor] | None = None
        self.step_index = -1
        self.lam = 0.0
        self._dual_factor = 1.0
        self._project_now = False
        self._finalize_now = False
        self._holding = False
        self._metrics = dict.fromkeys(METRIC_NAMES, 0.0)  # this rank's sums since begin_step
        self._per_layer = settings.lmda_schedule is LambdaSchedule.adaptive
        self.layer_lambdas: dict[str, float] = {}  # adaptive λ: each layer's, as of its flat's last step (same on every rank)
        self._fused = FusedPath(base, settings.kernels)
        self._compiled = CompiledStep(base, settings.kernels)  # GPU flats under torch's Adam (opt-in: ELSA_DS_COMPILED=1)
        self._penalties: list[Term] = []  # the eager path's penalty terms of the step in progress

    def load_state_dict(self, state_dict):
        """The base's state, then z, u, their scales and λ checked against this run's flats (``loaded.state_problem``)."""
        result = super().load_state_dict(state_dict)
        if (problem := state_problem(self, self.settings)) is not None:
            raise StateMismatch(f"its ADMM state does not fit this run: {problem}")
        return result

    # ---- schedule -----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Set λ and the projection / finalization flags for engine step ``step`` (0-based)."""
        s = self.settings
        admm_steps = s.total_steps - s.hold_steps  # steps 0 .. admm_steps − 1 are ADMM, the rest hold the mask
        self._holding = step >= admm_steps
        lam = interval_lambda(min(step, admm_steps - 1), admm_steps, s.interval, s.lmda, s.lmda_schedule)
        self._dual_factor = dual_rescale(self.lam, lam) if step > 0 and not self._holding else 1.0
        self.lam = lam
        self.step_index = step
        self._finalize_now = step in (admm_steps - 1, s.total_steps - 1)
        self._project_now = (step + 1) % s.interval == 0 and not self._finalize_now and not self._holding
        self._metrics = dict.fromkeys(METRIC_NAMES, 0.0)

    def lambda_now(self) -> float:
        """λ in force: the schedule's, or with the adaptive schedule the geometric mean of the layers' λ."""
        summary = lambda_summary(self.layer_lambdas) if self._per_layer else None
        return self.lam if summary is None else summary[0]

    def lambda_range(self) -> tuple[float, float] | None:
        """(smallest, largest) of the layers' λ with the adaptive schedule, else None."""
        summary = lambda_summary(self.layer_lambdas) if self._per_layer else None
        return None if summary is None else summary[1:]

    @property
    def holding(self) -> bool:
        """True in the last ``hold_steps`` steps: training inside the fixed mask, no penalty."""
        return self._holding

    @property
    def projected_this_step(self) -> bool:
        return self._project_now or self._finalize_now

    @property
    def finalized_this_step(self) -> bool:
        """True when this step ends with the hard projection x ← Π(x) (the last step; with hold_steps also T − h − 1)."""
        return self._finalize_now

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        flats = [(p, sl) for g in self.param_groups for p in g["params"] if (sl := self.slices_of(p)) is not None]
        fused, held, self._penalties = [], [], []
        for flat, slices in flats:
            st = self.state[flat]
            if Z not in st:
                continue  # the first step: no z yet, and the base optimizer must see an empty state to init
            if LAM in st and any(sl.layer not in self.layer_lambdas for sl in slices):
                self._note_lambdas(slices, st)  # a resumed run: its λs came back in the state
            if self._holding:
                held.append(self._hold_before(flat, slices))
            elif self._dual_factor != 1.0:
                self._rescale_dual(st)
            path = self._x_step_path(flat, slices, st)
            if path is not None:
                fused.append((path, flat, slices, st))
        try:
            add_penalties(self._penalties)  # the eager path's, every flat's at once
        finally:
            self._penalties = []
        loss = self._base_step(closure, {id(flat) for _, flat, _, _ in fused})
        lam = 0.0 if self._holding else self.lam
        for path, flat, slices, st in fused:  # penalty and the base's update in one pass, on the base's state
            path.step(flat, slices, st, self._group_of(flat), lam, PenaltyState(st[Z], st[U], st[Z_SCALE], st[U_SCALE]))
        for pruned in held:
            for x, gone in pruned:
                x.masked_fill_(gone, 0.0)
        for flat, slices in flats:
            st = self.state[flat]
            if Z not in st:
                # created inside the base optimizer's first step, so ZeRO's NVMe swapper registers z, u too
                self._init_state(flat, slices, st)
                if self.on_state_created is not None:
                    self.on_state_created(st)
            if self._finalize_now:
                self._finalize(flat, slices, st)
            elif self._project_now:
                self._update_z_u(flat, slices, st)
        return loss

    def _x_step_path(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> XStep | None:
        """The x-step's one fused-or-eager choice, made before the base step: the fused path that steps ``flat`` after
        it (penalty and update in one pass; the base step skips ``flat``), or None for the eager path, the reference:
        ∇ ← ∇ + λ (x − z + u) added here, then the base step updates ``flat`` (no penalty while holding)."""
        if not self._per_layer and self._fused.steps(flat, st):
            return self._fused
        if not self._per_layer and self._compiled.steps(flat, st):
            return self._compiled
        if flat.grad is not None and not self._holding and self.lam > 0.0:
            self._add_penalty(flat, slices, st)
        return None

    def _hold_before(self, flat: torch.Tensor, slices: list[Slice]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A held step, before the base step: the pruned entries (x == 0 since the early x ← Π(x); a kept entry that is
        exactly 0 would stay 0, never more than the requested sparsity) get a zero gradient; returns (x, pruned) per
        slice for zeroing them again after the step (Adam's momentum would move them)."""
        out = []
        for sl in slices:
            if sl.length == 0:
                continue
            x = sl.view(flat.detach())
            gone = x == 0
            if flat.grad is not None:
                sl.view(flat.grad).masked_fill_(gone, 0.0)
            out.append((x, gone))
        return out

    def _base_step(self, closure, skip: set[int]):
        """base.step() on every parameter but those in ``skip`` (stepped by the fused kernel instead)."""
        if not skip:
            return self.base.step(closure) if closure is not None else self.base.step()
        saved = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in skip]
            if closure is None and not any(g["params"] for g in self.param_groups):
                return None
            return self.base.step(closure) if closure is not None else self.base.step()
        finally:
            for g, params in zip(self.param_groups, saved):
                g["params"] = params

    def _group_of(self, flat: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(p is flat for p in g["params"]))

    def _rescale_dual(self, st: dict) -> None:
        if st[U].dtype == torch.float32:
            st[U].mul_(self._dual_factor)
        else:  # u = stored · s: rescaling the scales rescales u exactly
            st[U_SCALE].mul_(self._dual_factor)

    def _add_penalty(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> None:
        """∇ ← ∇ + λ (x − z + u) on the pruned entries (λ the slice's own with the adaptive schedule). Where x, z and u
        are fp32 (views, no copies) queued and added for every flat of the step at once before the base step
        (``penalty.add_penalties``); else (ELSA-L's z, u dequantized) slice by slice, one fp32 copy alive at a time."""
        assert flat.grad is not None, "the penalty is added only to a flat with a gradient"
        lams = [self.layer_lambdas[sl.layer] for sl in slices] if LAM in st else [self.lam] * len(slices)
        queue_penalty(self._penalties, flat, slices, (st[Z], st[U], st[Z_SCALE], st[U_SCALE]), lams)

    # ---- the projection: z₀ = Π(x), z ← Π(x + u), x ← Π(x) --------------------------------------
    def _init_state(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> None:
        """z = Π(x) after the first x-step (objective-aware: the second moment exists by then), or z = x ⊙ m
        with a warm-start mask m; u = 0. Collective."""
        s = self.settings
        st[Z], st[Z_SCALE] = admm_state.allocate(flat.numel(), s.z_dtype, len(slices), flat.device)
        st[U], st[U_SCALE] = admm_state.allocate(flat.numel(), s.u_dtype, len(slices), flat.device)
        if self._per_layer:
            st[LAM] = torch.full((len(slices),), s.lmda, dtype=torch.float32, device=flat.device)
            self._note_lambdas(slices, st)
        self._project_flat(flat, slices, st, INIT)

    def _update_z_u(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> None:
        """z ← Π(x + u), u ← u + x − z; accumulates residual and mask-flip metrics. Collective."""
        self._project_flat(flat, slices, st, UPDATE)
        self._count_state(flat, st)

    def _finalize(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> None:
        """x ← Π(x): the hard projection that leaves exactly k entries per layer; then z = x, u = 0. Collective."""
        self._project_flat(flat, slices, st, FINAL)
        self._count_state(flat, st)

    def _project_flat(self, flat: torch.Tensor, slices: list[Slice], st: dict, mode: int) -> None:
        """The projection's one fused-or-eager choice, for one flat and ``mode`` (INIT, UPDATE, FINAL): the fused kernel
        on CPU flats with a per-layer top-k (and no warm-start mask), else the eager reference. Collective."""
        warm_start = mode == INIT and self.initial_mask is not None
        # the kernel neither sums each layer's residuals (adaptive λ) nor over-relaxes u
        eager_only = mode == UPDATE and (self._per_layer or self.settings.relaxation != 1.0)
        if not warm_start and not eager_only and self._fused.projects(flat, slices, self.settings.pattern):
            sums = self._fused.project(flat, slices, st, self._fisher_state(st), (Z, U, Z_SCALE, U_SCALE),
                                       (self.settings.z_dtype, self.settings.u_dtype), self.comm, mode)
            if mode == UPDATE:
                self._add_metrics(residual_sq=float(sums[0]), x_sq=float(sums[1]), flips=float(sums[2]),
                                  pruned_entries=sum(sl.length for sl in slices))
            return
        eager = {INIT: self._init_eager, UPDATE: self._update_eager, FINAL: self._finalize_eager}[mode]
        eager(flat, slices, st)

    def _init_eager(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> None:
        xs = [sl.view(flat.detach()).float() for sl in slices]
        masks = [self.initial_mask(sl) for sl in slices] if self.initial_mask is not None else self._project(xs, st, slices)
        z_scales, _ = self._layer_scales(xs)
        for j, (sl, x, m) in enumerate(zip(slices, xs, masks)):
            admm_state.store(st[Z], st[Z_SCALE], j, sl.offset, x * m.to(x.device), z_scales[j])

    def _update_eager(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> None:
        xs, vs, old_keep = [], [], []
        for j, sl in enumerate(slices):
            x = sl.view(flat.detach()).float()
            u = admm_state.load(st[U], st[U_SCALE], j, sl.offset, sl.length)
            z_old = admm_state.load(st[Z], st[Z_SCALE], j, sl.offset, sl.length)
            xs.append(x)
            vs.append(x + u)
            old_keep.append(z_old != 0)
        masks = self._project(vs, st, slices)
        factors, u_peaks = [1.0] * len(slices), None  # |u| ≤ |v| in plain ADMM: v's peak scales u too
        if self._per_layer or self.settings.relaxation != 1.0:  # u may exceed v: its own peak, one layer at a time
            sums, u_peaks = [], []
            for j, (sl, x, v, m) in enumerate(zip(slices, xs, vs, masks)):
                z = v * m
                if self._per_layer:  # z_prev is still in the state
                    sums.append(residual_sums(x, z, admm_state.load(st[Z], st[Z_SCALE], j, sl.offset, sl.length)))
                u_peaks.append(_peak(self._dual(x, v, z, 1.0)))
            if self._per_layer:
                factors = self._balance(slices, st, sums)
                u_peaks = [peak * f for peak, f in zip(u_peaks, factors)]
        z_scales, u_scales = self._layer_scales(vs, u_peaks)
        for j, (sl, x, v, mask, old) in enumerate(zip(slices, xs, vs, masks, old_keep)):
            z = v * mask
            admm_state.store(st[Z], st[Z_SCALE], j, sl.offset, z, z_scales[j])
            admm_state.store(st[U], st[U_SCALE], j, sl.offset, self._dual(x, v, z, factors[j]), u_scales[j])
            self._add_metrics(residual_sq=float((x - z).square().sum()), x_sq=float(x.square().sum()),
                              flips=float((mask != old).sum()), pruned_entries=sl.length)

    def _dual(self, x: torch.Tensor, v: torch.Tensor, z: torch.Tensor, factor: float) -> torch.Tensor:
        """The new u: u + α (x − z) = v − z + (α − 1)(x − z), times the adaptive λ's λ_old/λ_new."""
        alpha = self.settings.relaxation
        u = v - z if alpha == 1.0 else (v - z).add_(x - z, alpha=alpha - 1.0)
        return u if factor == 1.0 else u.mul_(factor)

    def _balance(self, slices: list[Slice], st: dict, sums: list[list[float]]) -> list[float]:
        """Each layer's next λ from this rank's ``residual_sums`` (``balance.py``) into ``st[LAM]``; returns u's
        λ_old/λ_new. Collective."""
        old = st[LAM].tolist()
        cfg = self.settings
        st[LAM].copy_(torch.tensor(balanced_lambdas(sums, old, self.comm, cfg.balance_mu, cfg.balance_tau, cfg.lmda), dtype=torch.float32))
        self._note_lambdas(slices, st)
        return [dual_rescale(a, b) for a, b in zip(old, st[LAM].tolist())]

    def _note_lambdas(self, slices: list[Slice], st: dict) -> None:
        for sl, lam in zip(slices, st[LAM].tolist()):
            self.layer_lambdas[sl.layer] = lam

    def _finalize_eager(self, flat: torch.Tensor, slices: list[Slice], st: dict) -> None:
        xs = [sl.view(flat.detach()) for sl in slices]
        masks = self._project(xs, st, slices)
        z_scales, u_scales = self._layer_scales(xs)
        for x, mask in zip(xs, masks):
            x.mul_(mask)
        # z = x, u = 0 after the hard projection: a resumed or continued run starts feasible
        for j, (sl, x) in enumerate(zip(slices, xs)):
            admm_state.store(st[Z], st[Z_SCALE], j, sl.offset, x.float(), z_scales[j])
            admm_state.store(st[U], st[U_SCALE], j, sl.offset, torch.zeros_like(x, dtype=torch.float32), u_scales[j])

    def _fisher_state(self, st: dict) -> dict | None:
        return None if self.settings.projection is Projection.magnitude else st

    def _layer_scales(self, values: list[torch.Tensor], u_peaks: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 scales of z and u per layer, from the layer's peak |v| over all ranks (one max all-reduce for every layer
        of the flat, only when a state is fp8); ones otherwise. u = v − z needs no peak of its own (|u| ≤ |v|); ``u_peaks``
        (this rank's, per layer): a u that may exceed v (over-relaxed, or rescaled by an adaptive λ). Collective."""
        peaks = torch.stack([_peak(v) for v in values] + [p.to(values[0].device) for p in u_peaks or []]).float() \
            if values else torch.zeros(0)
        if self.settings.z_dtype.scaled or self.settings.u_dtype.scaled:
            self.comm.all_reduce_max(peaks)
        z_peaks, u_peaks_all = peaks.split(len(values)) if u_peaks is not None else (peaks, peaks)
        return admm_state.layer_scales(z_peaks, self.settings.z_dtype), admm_state.layer_scales(u_peaks_all, self.settings.u_dtype)

    def _project(self, values: list[torch.Tensor], st: dict, slices: list[Slice]) -> list[torch.Tensor]:
        """Keep-masks of Π(values) with this run's scores and pattern. Collective."""
        return projection_masks(values, self._fisher(st, slices), slices, self.comm, self.settings.pattern)

    def _fisher(self, st: dict, slices: list[Slice]) -> list[torch.Tensor] | None:
        if self.settings.projection is Projection.magnitude:
            return None
        f = second_moment(st)
        if f is None:
            raise RuntimeError("fisher projection needs the base optimizer's second moment (exp_avg_sq); none was found")
        return [sl.view(f) for sl in slices]

    # ---- metrics ------------------------------------------------------------------------------
    def _add_metrics(self, **values: float) -> None:
        """Add to this rank's metric sums by name (METRIC_NAMES)."""
        for name, value in values.items():
            self._metrics[name] += value

    def _count_state(self, flat: torch.Tensor, st: dict) -> None:
        """Bytes of z, u and their scales actually held for ``flat``, per entry of the flat."""
        self._add_metrics(state_bytes=sum(st[k].numel() * st[k].element_size() for k in (Z, U, Z_SCALE, U_SCALE)),
                          state_entries=flat.numel())

    def local_metrics(self) -> torch.Tensor:
        """This rank's metric sums since ``begin_step`` (see METRIC_NAMES); all-reduce to combine."""
        return torch.tensor([self._metrics[name] for name in METRIC_NAMES], dtype=torch.float64)

    def kernel_report(self) -> dict:
        """Whether the fused kernels were available, how the fused projections found their thresholds so far
        ({"bracket": n, "missed": n, "exact": n}: decided from global counts, so the same on every rank), and this
        rank's fused x-steps per kind ({"deepspeed_adam": n} or {"adam8bit/<code format>": n}; "compiled": n on GPU flats)."""
        compiled = {"compiled": self._compiled.x_steps} if self._compiled.x_steps else {}
        return {"available": self._fused.kernels is not None, "projection_paths": dict(self._fused.projection_paths),
                "x_steps": {**self._fused.x_steps, **compiled}}


def summarize_metrics(sums: torch.Tensor, lam: float) -> dict[str, float]:
    """Turn all-reduced metric sums into the per-projection log line's numbers."""
    d = dict(zip(METRIC_NAMES, sums.tolist()))
    return {
        "lambda": lam,
        "residual": (d["residual_sq"] ** 0.5) / max(d["x_sq"] ** 0.5, 1e-30),
        "mask_flip_frac": d["flips"] / max(d["pruned_entries"], 1.0),
        "admm_state_bytes_per_param": d["state_bytes"] / max(d["state_entries"], 1.0),
    }


def _peak(t: torch.Tensor) -> torch.Tensor:
    """max |t| (0 for an empty slice: a rank may hold none of a layer)."""
    return t.abs().max() if t.numel() else torch.zeros((), device=t.device)
