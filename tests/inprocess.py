"""The entry points run in this process (milliseconds, not a new interpreter each): argv in, exit code and streams out.

A pruning job that gets past every check stops where it would start its process group (``ReachedTheJob``, exit 0
here), so what these tests hold to the one-line promise is everything before the first weight is loaded."""
from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest

from elsa_ds.settings.config import DEMO_MODEL_DIR


class ReachedTheJob(Exception):
    """Raised in place of the process group: every check passed."""


def _reached(*args, **kwargs):
    raise ReachedTheJob()


@pytest.fixture
def stop_at_the_job(monkeypatch):
    """ELSA and retraining jobs stop where their process group would start."""
    import elsa_ds.jobs.elsa as elsa_job
    import elsa_ds.jobs.finetune as finetune_job

    monkeypatch.setattr(elsa_job, "open_training", _reached)
    monkeypatch.setattr(finetune_job, "open_training", _reached)


def run_main(main, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stderr, stdout) of ``main(argv)``; argparse's SystemExit and ReachedTheJob become their codes."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
        except ReachedTheJob:
            code = 0
    return code, err.getvalue(), out.getvalue()


def one_line(code: int, err: str, *needles: str) -> str:
    """Exit 2, no traceback, every stderr line the project's (``elsa_ds: ...``) and exactly one error line holding
    ``needles``; returns that line."""
    assert code == 2, f"exit {code}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert all(line.startswith("elsa_ds: ") for line in err.splitlines()), err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1, err[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def demo_copy(where: Path) -> Path:
    """A copy of the embedded demo model (config.json, tokenizer, model.safetensors) to damage."""
    return Path(shutil.copytree(DEMO_MODEL_DIR, where))
