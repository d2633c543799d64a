"""The pruning jobs, each a lifecycle (``interface.py``): ELSA under ZeRO-3, a one-shot baseline, or the retraining of
one (``--finetune``, also the dense control).

``make_job`` is the one place a ``--method`` becomes a job.
"""
from __future__ import annotations

from elsa_ds.config import ElsaConfig
from elsa_ds.options import JobOptions
from elsa_ds.jobs.interface import Job, run_job
from elsa_ds.zero.ds_config import DsConfig

__all__ = ["Job", "make_job", "run_job"]


def make_job(cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig) -> Job:
    """The job ``cfg.method`` names."""
    if cfg.finetune is not None:
        from elsa_ds.jobs.finetune import FinetuneJob

        return FinetuneJob(cfg, opts, ds_config)
    if cfg.oneshot is not None:
        from elsa_ds.jobs.oneshot import OneShotJob

        return OneShotJob(cfg, opts, ds_config)
    from elsa_ds.jobs.elsa import ElsaJob

    return ElsaJob(cfg, opts, ds_config)
