"""The launcher's variables, read in one place: RANK, WORLD_SIZE, LOCAL_RANK, the ranks on this node (LOCAL_SIZE from
``deepspeed``, LOCAL_WORLD_SIZE from ``torchrun``), MASTER_ADDR and MASTER_PORT.

A job refuses a set of them that no launcher writes (:func:`problem`, before any work): a value that is not a plain
count, a RANK outside WORLD_SIZE, a RANK without the others. Before that refusal the readers below agree anyway: each
takes a count only as ``str(int(v)) == v`` spells it, else its default. An audit (2026-12-06) found RANK=00 taken for rank
0 by torch and the logger but for another rank by the output's lock, so a second job wrote into a locked output; a stray
RANK=1 a job that did nothing and exited 0; a RANK without LOCAL_RANK a traceback from DeepSpeed after the warm start.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

COUNTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")
LAUNCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what a rank of a launched group needs
MAX_PORT = 65535


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."


def _plain_count(text: str) -> bool:
    return text.isascii() and text.isdigit() and str(int(text)) == text


def _count(name: str, default: int) -> int:
    text = os.environ.get(name)
    return int(text) if text is not None and _plain_count(text) else default


def rank() -> int:
    """This process's rank in the launched group (0 when none launched it)."""
    return _count("RANK", 0)


def writes() -> bool:
    """Whether this process is the rank that writes the output (rank 0)."""
    return rank() == 0


def world_size() -> int:
    """The ranks the launcher started (1 when none did), before the process group exists."""
    return max(_count("WORLD_SIZE", 1), 1)


def local_rank() -> int:
    """This process's rank on its node: its accelerator's index."""
    return _count("LOCAL_RANK", 0)


def local_size(default: int) -> int:
    """The ranks on this node: ``deepspeed``'s LOCAL_SIZE or ``torchrun``'s LOCAL_WORLD_SIZE, else ``default``."""
    return max(_on_node(default), 1)


def _on_node(default: int) -> int:
    return _count("LOCAL_SIZE", _count("LOCAL_WORLD_SIZE", default))


def launched() -> bool:
    """Whether a launcher started this process as one of several ranks."""
    return "LOCAL_RANK" in os.environ and world_size() > 1


def problem(group: bool = True) -> str | None:
    """What is wrong with the launcher's variables, as one line that says what to do; None when a launcher or nobody set
    them (a plain ``python`` run sets them for itself later: ``zero.dist.init_distributed``). ``group``: the job starts
    a process group (DeepSpeed's engine), which needs them all; a one-shot job's rank 0 works alone, so RANK and
    WORLD_SIZE suffice (a Kubeflow PyTorchJob's pod sets no LOCAL_RANK)."""
    env = os.environ
    if "RANK" not in env:
        given = [name for name in ("WORLD_SIZE", "LOCAL_RANK") if name in env] if group else []
        return (f"{' and '.join(given)} set without RANK: a process either belongs to a launched group (all of "
                f"{', '.join(LAUNCHED)}) or runs alone (none of them); launch with `deepspeed` or `torchrun`, or unset "
                f"{' and '.join(given)}") if given else None
    for name in (*COUNTS, "MASTER_PORT"):
        if name in env and not _plain_count(env[name]):
            return (f"the launcher's variable {name}={_shown(env[name])} is not a count written plainly (digits alone, no "
                    "sign, space or leading zero); launch with `deepspeed` or `torchrun`, which set it, or unset it")
    if missing := [name for name in (LAUNCHED if group else LAUNCHED[:2]) if not env.get(name)]:
        return (f"RANK={env['RANK']} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: a launched rank "
                f"needs all of {', '.join(LAUNCHED)}; launch with `deepspeed` or `torchrun`, which set them, or unset RANK "
                "to run in one process")
    return _disagreement(int(env["WORLD_SIZE"]), group)


def _disagreement(ranks: int, group: bool) -> str | None:
    env = os.environ
    if None not in (sizes := (env.get("LOCAL_SIZE"), env.get("LOCAL_WORLD_SIZE"))) and sizes[0] != sizes[1]:
        return (f"LOCAL_SIZE={env['LOCAL_SIZE']} (deepspeed's) and LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']} (torchrun's) "
                "disagree on the ranks of this node: unset the one your launcher did not set")
    node = _on_node(ranks)
    if not rank() < ranks or group and (not local_rank() < node <= ranks or local_rank() > rank()):
        return (f"the launcher's variables disagree: RANK={rank()}, LOCAL_RANK={local_rank()}, WORLD_SIZE={ranks}, "
                f"{node} ranks on this node (each rank is below WORLD_SIZE, each local rank below the node's ranks and "
                "no larger than the rank); launch with `deepspeed` or `torchrun`, which set them together")
    if "MASTER_PORT" in env and not 0 < int(env["MASTER_PORT"]) <= MAX_PORT:
        return f"MASTER_PORT={env['MASTER_PORT']} is not a TCP port (1-{MAX_PORT}); give a free port, or let the launcher choose"
    if any(c.isspace() or not c.isprintable() for c in env.get("MASTER_ADDR", "")):
        return (f"MASTER_ADDR={_shown(env['MASTER_ADDR'])} holds a space or a control character: one host name or "
                "address is expected (`hostname -I` prints several; take the first)")
    return None


@contextlib.contextmanager
def environ_restored(names: Iterable[str]) -> Iterator[None]:
    """The variables ``names`` put back on the way out as they were before the block: set to their values, or unset."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
