"""The job's own optimizer step and projection timed on this host beside DeepSpeedCPUAdam, for ``elsa-estimate --measure``.

Under optimizer offload the estimate prices ELSA's host work in DeepSpeedCPUAdam steps: the fused step's cost and one
projection's, relative to DeepSpeedCPUAdam on the same entries. Those ratios move with the host (its memory channels,
its cores, its caches) and with the job's settings (base optimizer, z and u dtypes, N:M, the authors' remedies), and
the typical profiles hold figures measured on two machines only (the 2-core box; the lent GPU host, whose projection
figure predates a fix). :func:`measure_optimizer` times them here instead: one fp32 flat of :data:`PROBE_ENTRIES`
entries cut into :data:`PROBE_LAYERS` layer slices at the job's sparsity (a rank's partition of a sub-group), a fixed
gradient, DeepSpeedCPUAdam alone and the job's optimizer (``AdmmOptimizer`` around the job's base, the job's ADMM
settings but a projection every :data:`PROBE_INTERVAL` steps) in blocks of that many steps in the order A B B A, so
both see the same noise; medians per step (``bench/optimizer_step.py``'s protocol, which measured the profiles'
figures). ~5-12 s on 2 cores and up to ~2.3 GiB of host memory (the adaptive λ's eager state); a base optimizer too slow
for :data:`PROBE_BUDGET_S` (bitsandbytes' CPU path) is found on a small flat first and left to the profile. The threads
are this process's (all the host's cores, as ``measure`` times DeepSpeedCPUAdam): the node's rate the estimate shares
among its ranks.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

from elsa_ds.log import get_logger

log = get_logger(__name__)

PROBE_ENTRIES = 32 * 2**20  # 128 MiB an fp32 array: past a server's last-level cache, as a real partition is
PROBE_LAYERS = 8
PROBE_INTERVAL = 4          # a projection every 4 steps: 2 rounds give 4 of them
PROBE_ROUNDS = 2
PROBE_BUDGET_S = 30.0       # the whole probe: a base whose steps would pass it (bitsandbytes' CPU path) is not timed


@dataclass(frozen=True)
class OptimizerTimings:
    """Medians per step, ms, on :data:`PROBE_ENTRIES` entries: DeepSpeedCPUAdam alone, the job's optimizer on a step
    without a projection, and one projection (a projecting step less a plain one)."""

    key: str                # the base optimizer, with "+<remedy>" when the job takes one of the authors' remedies
    adam_ms: float
    step_ms: float
    projection_ms: float
    entries: int
    threads: int            # torch's (OpenMP's) threads in the probe

    @property
    def kernel(self) -> float:
        """The job's step in DeepSpeedCPUAdam steps."""
        return self.step_ms / self.adam_ms

    @property
    def projection(self) -> float:
        """One projection in DeepSpeedCPUAdam steps."""
        return self.projection_ms / self.adam_ms

    def to_dict(self) -> dict:
        return {**asdict(self), "kernel": self.kernel, "projection": self.projection}


def rate_key(base: str, remedy: str) -> str:
    """Where a base optimizer's ratios sit in ``Rates.kernel`` / ``Rates.projection``: the base's name, and
    ``base+remedy`` for a figure timed with one of the authors' remedies (it then includes the remedy's cost)."""
    return f"{base}+{remedy}" if remedy else base


def measure_optimizer(cfg, ds) -> OptimizerTimings | None:
    """The job's optimizer timed here (module docstring); None where the estimate prices it otherwise (the optimizer
    on the GPU: its state traffic at the device's memory rate) or where it cannot run here (no compiler for
    DeepSpeed's CPU Adam, a base optimizer whose package is missing, a step past the probe's budget): the profile's
    figures then stand, and the log says why. ``cfg``: the job's ElsaConfig; ``ds``: its DsConfig."""
    if not ds.optimizer_offloaded:
        return None
    try:
        return _timed(cfg, ds)
    except Exception as err:  # noqa: BLE001 - any failure here leaves the typical figures, said in one line
        log.warning(f"the job's optimizer could not be timed here ({type(err).__name__}: {err}); its step and projection "
                    "are priced with the profile's ratios to DeepSpeedCPUAdam")
        return None


class _Timed:
    """One optimizer on its own copy of the flat; ``run(n)`` gives each step's seconds and whether it projected."""

    def __init__(self, opt, flat, grad, admm: bool):
        self.opt, self.flat, self.grad, self.admm, self.t = opt, flat, grad, admm, 0

    def run(self, steps: int, deadline: float) -> list[tuple[float, bool]]:
        out = []
        for _ in range(steps):
            self.flat.grad.copy_(self.grad)
            if self.admm:
                self.opt.begin_step(self.t)
            projected = self.admm and self.opt.projected_this_step
            start = time.perf_counter()
            self.opt.step()
            out.append((time.perf_counter() - start, projected))
            self.t += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"a step took {out[-1][0]:.2f} s on {self.flat.numel():,} entries, past the probe's "
                                   f"{PROBE_BUDGET_S:g} s")
        return out


def layer_slices(numel: int, count: int, sparsity: float) -> list:
    """``count`` equal layer slices of one flat of ``numel`` entries (the last takes the remainder), each keeping what
    ``sparsity`` leaves: a rank's partition of a sub-group, as bench/optimizer_step.py cuts its flat too."""
    from elsa_ds.admm.projection import Slice, keep_count

    size = numel // count
    lengths = [size] * (count - 1) + [numel - size * (count - 1)]
    return [Slice(f"layer{j}", j * size, n, 0, n, keep_count(n, sparsity)) for j, n in enumerate(lengths)]


def _runners(cfg, ds, entries: int) -> tuple[_Timed, _Timed]:
    """DeepSpeedCPUAdam and the job's optimizer, each on its own copy of one flat of ``entries`` and one gradient."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from elsa_ds.admm.optimizer import AdmmOptimizer
    from elsa_ds.targets import goal_ratio
    from elsa_ds.zero.engine import base_optimizer

    g = torch.Generator().manual_seed(0)
    x0, grad = torch.randn(entries, generator=g), torch.randn(entries, generator=g) * 1e-3
    slices = layer_slices(entries, PROBE_LAYERS, goal_ratio(cfg.goal))
    settings = replace(cfg.admm_settings(), total_steps=1 << 30, interval=PROBE_INTERVAL, hold_steps=0)
    runners = []
    for admm in (False, True):
        flat = torch.nn.Parameter(x0.clone())
        flat.grad = torch.zeros_like(flat)
        opt = base_optimizer(cfg, [flat], ds) if admm else DeepSpeedCPUAdam([flat], lr=cfg.lr)
        if admm:
            opt = AdmmOptimizer(opt, settings)
            opt.assign(flat, slices)
        runners.append(_Timed(opt, flat, grad, admm))
    return runners[0], runners[1]


def _timed(cfg, ds) -> OptimizerTimings:
    import torch

    from elsa_ds.capacity.resident import job_optimizer

    small = PROBE_ENTRIES // 32                                     # the job's optimizer on 1M entries first:
    _, job = _runners(cfg, ds, small)                               # a base too slow for the budget stops here
    job.run(PROBE_INTERVAL, time.monotonic() + PROBE_BUDGET_S)      # (its first steps make the states and z₀)
    small_steps = job.run(2 * PROBE_INTERVAL, time.monotonic() + PROBE_BUDGET_S)
    # a step's median and the projections' excess over it, amortized: one slow step on a loaded host (a CI running two
    # test workers on 2 cores: ~30x a step) or the projection alone must not stop the probe
    plain_s = statistics.median(s for s, p in small_steps if not p)
    excess = max(0.0, statistics.median([s for s, p in small_steps if p] or [plain_s]) - plain_s)
    projected = 32 * (plain_s + excess / PROBE_INTERVAL)
    if projected * (2 + 2 * PROBE_ROUNDS * PROBE_INTERVAL) > PROBE_BUDGET_S:
        raise TimeoutError(f"a step would take ~{projected:.1f} s on {PROBE_ENTRIES:,} entries, past the probe's "
                           f"{PROBE_BUDGET_S:g} s")
    del job
    plain, job = _runners(cfg, ds, PROBE_ENTRIES)
    deadline = time.monotonic() + PROBE_BUDGET_S
    for r in (plain, job):
        r.run(2, deadline)                                          # the states made, z₀ = Π(x) taken
    times: dict[bool, list[tuple[float, bool]]] = {False: [], True: []}
    for _ in range(PROBE_ROUNDS):
        for r in (plain, job, job, plain):
            times[r.admm] += r.run(PROBE_INTERVAL, deadline)
    adam = statistics.median(s for s, _ in times[False])
    step = statistics.median(s for s, projected in times[True] if not projected)
    projection = max(0.0, statistics.median(s for s, projected in times[True] if projected) - step)
    key = rate_key(*job_optimizer(ds.raw, cfg.model_dump(mode="json")))
    return OptimizerTimings(key, 1e3 * adam, 1e3 * step, 1e3 * projection, PROBE_ENTRIES, torch.get_num_threads())
