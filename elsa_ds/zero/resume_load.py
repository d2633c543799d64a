"""Loading a checkpoint on every rank (``--resume``): the folder ``check_resume`` scanned, each rank's files read as data
before DeepSpeed's collective load, and the newest tag every rank can read (``checkpoint.py`` writes them and checks
them before any model exists)."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elsa_ds.admm.loaded import StateMismatch
from elsa_ds.errors import ElsaError
from elsa_ds.files.aside import START_OVER
from elsa_ds.log import get_logger
from elsa_ds.zero import compat
from elsa_ds.zero.dist import same_on_every_rank
from elsa_ds.zero.checkpoint import (CLIENT_KEY, UnsafeCheckpointError, checked_place, checked_root, folder_place,
                                     read_checkpoint_file, resume_order)
from elsa_ds.zero.checkpoint_save import FailedElsewhere, Vote

log = get_logger(__name__)


def _load_root(ckpt_dir: Path, comm) -> Path:
    """The checkpoints folder's real place for ``load_latest``: the folder ``check_resume`` scanned, the same one
    (another put at its path, a link or a moved parent since, or none there, stops every rank). Collective."""
    problem: ElsaError | None = None
    try:
        root = checked_root(ckpt_dir)
        now = folder_place(root)
        if (before := checked_place(ckpt_dir) or now) != now:
            raise UnsafeCheckpointError(f"--resume: refusing {ckpt_dir}: it is not the folder whose files were checked "
                                        f"before loading (then {before[0]}, now {root}, another folder); restore the run "
                                        "from a copy you trust")
    except ElsaError as err:
        problem = err
    if comm.all_reduce_sum(torch.tensor([0.0 if problem is None else 1.0])).item():
        raise problem or UnsafeCheckpointError(f"--resume: another rank refused {ckpt_dir} (see its line)")
    return root


def _read_own_files(engine, ckpt_dir: Path, tag: str, root: Path, comm) -> dict[str, Any] | None:
    """This rank's files of ``tag``, read (as data) before DeepSpeed's load, whose collectives would wait forever for a
    rank that failed to read its own (a walk: one rank's shard truncated, missing or altered hung every rank, deaf to
    Ctrl-C): {path: what it holds}, or None when some rank could not read its files (the previous tag is tried); a
    refused file stops every rank. Collective."""
    own: dict[str, Any] = {}
    refusal: UnsafeCheckpointError | None = None
    try:
        for path in compat.rank_checkpoint_files(engine, ckpt_dir, tag):
            own[os.path.normpath(path)] = read_checkpoint_file(path, "cpu", root=root)
    except UnsafeCheckpointError as err:
        refusal = err
    except Exception as err:  # noqa: BLE001 - a truncated or missing shard: the previous tag is tried
        log.info(f"checkpoint {tag} is unreadable ({type(err).__name__}: {str(err)[:200]}); trying the previous one")
        own = {}
    if not _every_rank(bool(own), refusal, ckpt_dir / tag, comm):
        if own:
            log.info(f"checkpoint {tag} is unreadable on another rank; trying the previous one")
        return None
    return own


def _every_rank(ok: bool, refusal: UnsafeCheckpointError | None, tag: Path, comm) -> bool:
    """Whether every rank's step with ``tag`` went ``ok``; a file refused on any rank (``refusal`` on this one) stops
    every rank. Collective."""
    done, refused = comm.all_reduce_sum(torch.tensor([1.0 if ok and refusal is None else 0.0,
                                                      0.0 if refusal is None else 1.0])).tolist()
    if refused:
        raise refusal or UnsafeCheckpointError(f"--resume: another rank refused a file of {tag} (see its line)")
    return done == comm.world_size


def _read_once(own: dict[str, Any], root: Path, path: str | Path, map_location: Any = None) -> Any:
    """DeepSpeed's read of a checkpoint file: what :func:`_read_own_files` read of it (once), else the file as data."""
    held = own.pop(os.path.normpath(path), None)
    return held if held is not None else read_checkpoint_file(path, map_location, root=root)


def _load_tag(engine, tag: Path, read: Callable[..., Any], comm) -> tuple[bool, Any] | None:
    """DeepSpeed's load of ``tag`` (its files through ``read``), the ranks agreeing once, before its first collective
    (``checkpoint_save.Vote``), whether each one's part went well; a rank that raised before it votes after.
    None when some rank's part failed (the previous tag is tried); a refused file stops every rank. Else (whether this
    rank's load ended well after the vote, what it returned). Collective."""
    vote = Vote(lambda: _every_rank(True, None, tag, comm))  # its raise may also be another rank's refused file
    ok, loaded, refusal = False, None, None
    try:
        with compat.checkpoint_hooks(engine, vote, read):
            path, loaded = engine.load_checkpoint(str(tag.parent), tag=tag.name, load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
        ok = path is not None and isinstance(loaded, dict) and CLIENT_KEY in loaded
    except FailedElsewhere:
        return None
    except (UnsafeCheckpointError, StateMismatch) as err:  # refused on every rank, not skipped for an older tag
        if vote.made:  # the vote's own raise (another rank refused a file): every rank stops
            raise
        refusal = err if isinstance(err, UnsafeCheckpointError) else _altered(tag, str(err))
    except Exception as err:  # noqa: BLE001 - anything else DeepSpeed's load raises (the files were read whole before)
        log.info(f"checkpoint {tag.name} did not load ({type(err).__name__}: {str(err)[:200]}); trying the previous one")
    if not vote.made and not _every_rank(ok, refusal, tag, comm):
        return None
    return ok, loaded


def _altered(tag: Path, problem: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"--resume: {tag} is not what elsa_ds writes ({problem}); it was altered or written by "
                                 f"another program: restore the run from a copy you trust or {START_OVER}")


def load_latest(engine, ckpt_dir: Path, comm, client_problem: Callable[[Any], str | None],
                shared: Callable[[Any], str]) -> dict | None:
    """Load the newest loadable checkpoint, its files read as data only (``read_checkpoint_file``); returns its client
    state (None when there is none). A file that needs a class outside the allow-list, or that loads into something
    elsa_ds never writes (the loop's state as ``client_problem`` judges it, the loss scaler, z and u), or a loop state
    whose ``shared(state)`` differs between the ranks (a walk: one rank's λ or step altered trained on, or hung), stops
    every rank. Collective."""
    root = _load_root(ckpt_dir, comm)  # check_resume's: every file DeepSpeed reads must open inside it
    for tag in resume_order(ckpt_dir):
        own = _read_own_files(engine, ckpt_dir, tag, root, comm)
        loaded = None if own is None else _load_tag(engine, ckpt_dir / tag, functools.partial(_read_once, own, root), comm)
        if loaded is None:
            continue
        ok, client = loaded
        problem = (compat.loss_scaler_problem(engine) or client_problem(client[CLIENT_KEY])) if ok else None
        same = same_on_every_rank(shared(client[CLIENT_KEY]) if ok and problem is None else None)
        if ok and problem is None and not same:
            problem = "its ranks' loop states differ: step, λ or settings"
        refusal = None if problem is None else _altered(ckpt_dir / tag, problem)
        if _every_rank(ok and problem is None, refusal, ckpt_dir / tag, comm):  # loaded everywhere, nothing refused
            log.info(f"resumed from {ckpt_dir / tag}")
            compat.replay_cpu_adam(engine)  # the C++ Adam's β^t as the uninterrupted run holds it
            return client[CLIENT_KEY]
    return None
