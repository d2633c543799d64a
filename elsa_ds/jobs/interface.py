"""The lifecycle every pruning job follows (torchtune's ``recipe_interfaces.py`` is the model).

    __init__         the job's state, from the finished plan (``elsa_ds/plan``): settings never change after it
    setup            what needs the process group, the data and the weights: process group, data, model, engine;
                     returns it, and the stages below take it
    load_checkpoint  continue from the latest checkpoint (--resume), or start fresh
    train            the loop; calls save_checkpoint every --save_interval steps
    save_checkpoint  all state needed to continue exactly: weights, optimizer and ADMM state, step, RNG, history
    finish           final validation, export, report (rank 0 returns it)
    evaluate         rank 0 evaluates the saved model alone (--eval_ppl, --eval_tasks), the engine already dropped
    cleanup          whatever happened before

Each job is one class that satisfies :class:`Job` structurally and subclasses no other job (as torchtune's recipes):
``ElsaJob`` (``elsa.py``), ``FinetuneJob`` (``finetune.py``), ``OneShotJob`` (``oneshot.py``). Its state is declared in
``__init__`` from the plan, none of it left None for setup to fill: what setup builds is one object it returns. What the
jobs share are components they call, never a base class: ``training.py`` (the two training jobs' opening, the data,
the loop, checkpoints, validation), ``warm_start.py`` (one-shot masks on rank 0), ``selection.py``, and ``report.py``
(the report, built from a ``ReportRecord`` the job fills). ``tests/jobs/test_job_state.py`` holds them to that.

A job is chosen by ``--method`` (``elsa_ds/jobs/__init__.py``); ``launch/prune.py`` and ``elsa_ds.prune`` only
call ``owner.run_owned``: the inputs kept apart from the output, its lock taken (rank 0), the plan made, then
:func:`run_job`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from elsa_ds.torch_api import resolve_mkl_vml

Built = TypeVar("Built")


class Job(Protocol[Built]):
    def setup(self) -> Built: ...

    def load_checkpoint(self, built: Built) -> None: ...

    def train(self, built: Built) -> None: ...

    def save_checkpoint(self, built: Built) -> None: ...

    def finish(self, built: Built) -> dict[str, Any] | None: ...

    def evaluate(self, report: dict[str, Any] | None) -> None: ...

    def cleanup(self) -> None: ...


def run_job(job: Job[Any], mark: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Run a job through its lifecycle; returns its report on rank 0 (None on other ranks). ``mark`` hears each stage
    as it begins (rank 0's watchdog: the phase a killed job had reached)."""
    resolve_mkl_vml()  # before any op runs on two threads (every rank is its own process)
    mark = mark or (lambda stage: None)
    built: Any = None
    try:
        mark("setup")
        built = job.setup()
        mark("load_checkpoint")
        job.load_checkpoint(built)
        mark("train")
        job.train(built)
        mark("finish")
        result = job.finish(built)
        built = None  # the engine and the model go before rank 0 evaluates the saved model alone
        job.evaluate(result)
        return result
    finally:
        built = None  # however it ended, this frame (held by a traceback) keeps no engine alive
        job.cleanup()
