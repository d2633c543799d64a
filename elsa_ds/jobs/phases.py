"""Timestamped phase markers of a job, for benchmarks that sample its memory over time (``bench/scale.py``).

ELSA's jobs and the retraining baselines' (which have no projection phases) mark them alike. Off unless the environment
variable ``ELSA_DS_PHASE_LOG`` names a file; rank 0 then appends one JSON line per
phase as it begins, ``{"phase": "projection", "step": 1, "t": 1732390000.123}`` (t: seconds since the epoch, the
clock a sampler in another process reads too). A phase lasts until the next marker; the last one is ``done``.
Whatever the variable, rank 0 forwards each marker to its watchdog (``elsa_ds/files/watchdog.py``), which names the last one
should the job be killed.

    load              from the job's start (checks, process group, data, model, engine) to the first step
    first step        step 0: the base optimizer's and ADMM's lazy state is created (z = Π(x))
    step              a plain step: forward, backward, the penalised optimizer step
    projection        a step that ends with z = Π(x + u), u = u + x − z
    final projection  the last step: x = Π(x)
    validation        perplexity of the pruned model (skipped with --val_windows 0)
    export            rank 0 writes the consolidated model, one gathered tensor at a time
    verify            rank 0 reads the exported files back (per-layer sparsity) and writes the report
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

PHASE_LOG_ENV = "ELSA_DS_PHASE_LOG"


class PhaseLog:
    """Appends phase markers to ``$ELSA_DS_PHASE_LOG`` on rank 0 (a no-op elsewhere, or when the variable is unset)."""

    def __init__(self, rank: int):
        path = os.environ.get(PHASE_LOG_ENV)
        self.path: Path | None = Path(path) if path and rank == 0 else None
        self.forward: Callable[[str, int | None], None] | None = None  # rank 0's watchdog, set by jobs/owner.py

    def mark(self, phase: str, step: int | None = None) -> None:
        if self.forward is not None:
            self.forward(phase, step)
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"phase": phase, "step": step, "t": time.time()}) + "\n")


def step_phase(step: int, projects: bool, final: bool) -> str:
    """The phase name of engine step ``step`` (0-based)."""
    if final:
        return "final projection"
    if step == 0:
        return "first step"
    return "projection" if projects else "step"


def read_phases(path: Path) -> list[dict]:
    """The markers of a phase log, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
