"""The environment's switches a job reads, checked before its work: a value none of their readers reads is said, not
taken for the default (an audit, 2026-12-06: ELSA_DS_COMPILED=abc switched the opt-in path on, ELSA_DS_KERNELS=disable
left the kernels on, ELSA_DS_SPARSE_LOOPS=avx-512 let the CPU vendor decide; ELSA_DS_PHASE_LOG naming a folder and
TORCH_EXTENSIONS_DIR naming a file were tracebacks at the job's start)."""
from __future__ import annotations

import os
from pathlib import Path

from elsa_ds import launch_env
from elsa_ds.admm.kernels import build
from elsa_ds.errors import ElsaError

# each switch and the values its reader knows (empty or unset: the reader's default). The sparse decode's three are
# spelt here, not imported: importing elsa_ds.sparse imports triton, which a job loads only for its kernels
# (tests/test_early_errors.py holds these names and values to sparse/kernels.py, linear.py and siblings.py)
CHOICES: dict[str, tuple[str, ...]] = {
    "ELSA_DS_KERNELS": build.ON_OFF, "ELSA_DS_COMPILED": build.ON_OFF, "ELSA_DS_CPU_BF16": ("1", "0"),
    "ELSA_DS_KEEP_SWAP_FILES": ("1", "0"), "ELSA_DS_SPARSE_LOOPS": ("portable", "avx512"), "ELSA_DS_FUSE_SIBLINGS": ("1", "0"),
    "ELSA_DS_GPU_LAYOUT": ("cols16", "delta8"),
}
# the switches checked where they are read (tests/test_structure.py: every ELSA_DS_* name the package spells is here or above)
READ_ELSEWHERE: dict[str, str] = {
    "ELSA_DS_LOSS": "loss.check_loss_choice, among the plan's checks before the work",
    "ELSA_DS_TRITON_ROWS": "a benchmark's knob, read at each sparse product on a GPU (sparse/triton_spmv.py)",
    "ELSA_DS_PROFILE_STEPS": "a diagnostic (step_profile.py): a malformed value is one warning, never a stop",
    "ELSA_DS_PROFILE_OUT": "a diagnostic (step_profile.py): a profile it cannot write is one warning",
}
FILE_ENV = "ELSA_DS_PHASE_LOG"  # jobs/phases.py: rank 0 appends to this file
FOLDER_ENV = "TORCH_EXTENSIONS_DIR"  # where torch builds DeepSpeed's and elsa_ds's C++ ops, on every rank
MINUTES_ENV = "DEEPSPEED_TIMEOUT"  # DeepSpeed's collectives' and rendezvous' timeout, int() of it at its import


def switch_problem(deepspeed: bool = True) -> str | None:
    """What is wrong with the switches set in the environment, as one line that says what to do; None when nothing is.
    ``deepspeed``: the command imports DeepSpeed (which reads DEEPSPEED_TIMEOUT at its import; elsa-evaluate does not)."""
    env = os.environ
    for name, known in CHOICES.items():
        if why := build.switch_problem(name, known):
            return why
    path = env.get(FILE_ENV)
    if path and launch_env.writes() and (Path(path).is_dir() or not Path(path).parent.is_dir()):
        return f"{FILE_ENV}={path!r}: name a file (rank 0 appends the job's phases to it) in a folder that exists, or unset it"
    if (path := env.get(FOLDER_ENV)) and Path(path).exists() and not Path(path).is_dir():
        return f"{FOLDER_ENV}={path!r} is not a folder: torch builds the C++ ops in it; name a folder, or unset it"
    if deepspeed and (minutes := env.get(MINUTES_ENV)) is not None and not _whole_above_zero(minutes):
        return (f"{MINUTES_ENV}={minutes!r}: DeepSpeed reads it as whole minutes, the time a rank waits for the others "
                "(default 10); give a whole number of at least 1, or unset it")
    return None


def _whole_above_zero(text: str) -> bool:
    """Whether ``int(text)``, as DeepSpeed reads the value, is a count of at least 1."""
    try:
        return int(text) >= 1
    except ValueError:
        return False


def check_switches(deepspeed: bool = True) -> None:
    if why := switch_problem(deepspeed):
        raise ElsaError(why)
