"""The lifecycle every pruning job follows (torchtune's ``recipe_interfaces.py`` is the model).

    setup            every cheap check first, then the process group, data, model and engine
    load_checkpoint  continue from the latest checkpoint (--resume), or start fresh
    train            the loop; calls save_checkpoint every --save_interval steps
    save_checkpoint  all state needed to continue exactly: weights, optimizer and ADMM state, step, RNG, history
    finish           final evaluation, export, report (rank 0 returns it), evaluation of the saved model
    cleanup          tear down the process group, whatever happened before

Each job is one class that satisfies :class:`Job` structurally and subclasses no other job (as torchtune's recipes):
``ElsaJob`` (``elsa.py``), ``FinetuneJob`` (``finetune.py``), ``OneShotJob`` (``oneshot.py``). Its whole state is
declared in ``__init__`` ("set by setup" / "set by the checkpoint loader" where so); its setup helpers return what
they build. What the jobs share are components they call, never a base class: ``checks.py`` (the checks before any
work), ``training.py`` (process group start, data, the loop, checkpoints, validation), ``warm_start.py`` (one-shot
masks on rank 0), ``selection.py``, and ``report.py`` (the report, built from a ``ReportRecord`` the job fills).
``tests/jobs/test_job_state.py`` holds them to that.

A job is chosen by ``--method`` (``elsa_ds/jobs/__init__.py``); ``launch/prune.py`` and ``elsa_ds.prune`` only
call ``owner.run_owned``: the inputs kept apart from the output, its lock taken (rank 0), then :func:`run_job`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol


class Job(Protocol):
    def setup(self) -> None: ...

    def load_checkpoint(self) -> None: ...

    def train(self) -> None: ...

    def save_checkpoint(self) -> None: ...

    def finish(self) -> dict[str, Any] | None: ...

    def cleanup(self) -> None: ...


def run_job(job: Job, mark: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Run a job through its lifecycle; returns its report on rank 0 (None on other ranks). ``mark`` hears each stage
    as it begins (rank 0's watchdog: the phase a killed job had reached)."""
    mark = mark or (lambda stage: None)
    try:
        mark("setup")
        job.setup()
        mark("load_checkpoint")
        job.load_checkpoint()
        mark("train")
        job.train()
        mark("finish")
        return job.finish()
    finally:
        job.cleanup()


class Printer:
    """Rank-0 console output, through the ``elsa_ds`` logger (``elsa_ds/log.py``: level, streams, rank tags)."""

    def __init__(self, rank: int):
        from elsa_ds.log import get_logger

        self.rank = rank
        self.log: logging.Logger = get_logger("elsa_ds.jobs")

    def __call__(self, msg: str) -> None:
        if self.rank == 0:  # messages may carry the console's "[elsa_ds] " prefix, which the logger adds itself
            self.log.info(msg.removeprefix("[elsa_ds] "))

    def every_rank(self, msg: str) -> None:
        """A line each rank shows (tagged with its rank), e.g. why a rank has nothing to do."""
        from elsa_ds.log import EVERY_RANK

        self.log.info(msg.removeprefix("[elsa_ds] "), extra=EVERY_RANK)
