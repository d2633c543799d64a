"""The pruning jobs, each a lifecycle (``interface.py``): ELSA under ZeRO-3, a one-shot baseline, or the retraining of
one (``--finetune``, also the dense control).

``make_job`` is the one place a ``--method`` becomes a job; every job is built from the finished plan (``elsa_ds/plan``).
"""
from __future__ import annotations

from typing import Any

from elsa_ds.jobs.interface import Job, run_job
from elsa_ds.plan import Plan

__all__ = ["Job", "make_job", "run_job"]


def make_job(plan: Plan) -> Job[Any]:
    """The job ``plan.cfg.method`` names."""
    if plan.cfg.finetune is not None:
        from elsa_ds.jobs.finetune import FinetuneJob

        return FinetuneJob(plan)
    if plan.cfg.oneshot is not None:
        from elsa_ds.jobs.oneshot import OneShotJob

        return OneShotJob(plan)
    from elsa_ds.jobs.elsa import ElsaJob

    return ElsaJob(plan)
