"""What an --overwrite job sets aside of the previous output until the new one is published: its checkpoints and
monitor logs, and the side files a --resume of it would read. Moved, never deleted, before any work; put back by the
job's exit path (``jobs/owner.py``) or its watchdog (``watchdog.py``) when the job does not publish. Stdlib only."""
from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

from elsa_ds.errors import ElsaError


FINGERPRINT = "elsa_fingerprint.json"  # a run's settings beside its checkpoints' tags (zero/checkpoint.py writes it)
TAG = re.compile(r"^global_step(\d+)$")  # a checkpoint's tag, DeepSpeed's folder name
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them beside the tags at each save
START_OVER = "start over with --overwrite in place of --resume"  # a refused --resume's other way: what --overwrite replaces


def checkpoint_entry(name: str) -> bool:
    """Whether an entry of a run's checkpoints folder may bear ``name``: a tag, ``latest``, the run's settings, DeepSpeed's
    recovery scripts, or a hidden name (a file written whole, a script kept aside during a save)."""
    return bool(TAG.match(name)) or name in ("latest", FINGERPRINT, *RECOVERY_SCRIPTS) or name.startswith(".")


def published(output_dir: Path) -> Path:
    """The file that says a run published a checkpoint a --resume continues (with --overwrite the previous run's went
    aside first, so it is this run's)."""
    return output_dir / "checkpoints" / "latest"


def side_path(output_dir: Path, name: str) -> Path:
    """``.NAME.<name>`` beside the output: where a job keeps a side file until it consumes it (the warm start's mask and
    weights, a retraining run's one-shot model, the best projection's snapshot); ``jobs/owner.py`` lists them all."""
    return output_dir.resolve().parent / f".{output_dir.name}.{name}"


def beside(output_dir: Path, what: str, pid: int | None = None) -> Path:
    """``.NAME.<what>.<pid>`` beside the output: a folder of one job's rank 0 (this process by default)."""
    return side_path(output_dir, f"{what}.{pid or os.getpid()}")


def aside_dir(output_dir: Path, pid: int | None = None) -> Path:
    """Where an --overwrite job keeps what the run would replace before it publishes (the previous output's checkpoints
    and monitor logs, the side files a --resume of it would read), until the new output is published (then removed) or
    the job fails (then put back). ``pid``: the job's rank 0 (this process by default; the watchdog names it)."""
    return beside(output_dir, "replaced", pid)


def old_dir(output_dir: Path, pid: int | None = None) -> Path:
    """Where the publication moves the previous output (or, with checkpoints kept, its files) just before the new one
    takes its place; removed right after. ``pid``: the job's rank 0 (this process by default; the watchdog names it)."""
    return beside(output_dir, "old", pid)


REPORT_NAME = "elsa_report.json"  # a job's report: moved in last, so that an output holding one is whole
ALL_MOVED_OUT = ".elsa_all_moved_out"  # made in old_dir once every file of a kept-checkpoints output is in it
PUBLICATIONS = ("publish", "publish_into")  # what rank 0 announces just before it moves anything: a swap, or files into
PUBLISH_FAILED = "publish_failed"  # what it announces when a move failed (PublishFailed): its staging folder is kept


def move_out(output_dir: Path, old: Path) -> None:
    """The first half of a publication into a kept-checkpoints output: every file of the previous output (its folders,
    the run's checkpoints and logs, stay) moves into ``old``; then :data:`ALL_MOVED_OUT` marks it done (an OSError
    leaves what moved in ``old``, unmarked). Run again after a kill, it moves what is left."""
    for entry in sorted(output_dir.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            entry.rename(old / entry.name)
    (old / ALL_MOVED_OUT).touch()


def move_in(staging: Path, output_dir: Path) -> None:
    """The second half: each file of the finished ``staging`` folder moves into ``output_dir``, in place of its
    namesake, the report last; the emptied ``staging`` goes. Run again after a kill, it moves what is left."""
    for f in sorted(staging.iterdir(), key=lambda f: (f.name == REPORT_NAME, f.name)):
        f.replace(output_dir / f.name)
    staging.rmdir()


class Settled(NamedTuple):
    """What :func:`settle_old` found: whether the output in place is the job's whole new one, a warning to give, and
    a folder the watchdog must keep (the finished output, when its publication could not be completed)."""
    published: bool
    warning: str | None = None
    kept: Path | None = None


def settle_old(output_dir: Path, pid: int, kind: str) -> Settled:
    """After rank 0 was killed inside its publication (``kind``, as it announced it just before the first move; any
    earlier job's :func:`old_dir` renamed away by then), complete it: its staging folder is the finished output (a job
    publishes only that). ``publish``: the previous output to :func:`old_dir`, the staging folder in its place;
    ``publish_into`` (checkpoints kept): the previous files into :func:`old_dir` (:func:`move_out`, unless marked done),
    then the staged ones in (:func:`move_in`). Then what is left of the previous output, and what --overwrite set
    aside, is removed. Should it fail, everything stays, named in the warning. ``publish_failed`` (rank 0's publication
    had failed, its exit path was cut short): its staging folder is kept (what the error named), nothing moved."""
    old, staging = old_dir(output_dir, pid), beside(output_dir, "partial", pid)
    if kind == PUBLISH_FAILED:  # the exit path of a failed publication, cut short: as its error said, nothing more moves
        whole = staging.is_dir() and not staging.is_symlink()
        previous = f", the previous output's files in {old}" if old.exists() else ""
        return Settled(False, f"its publication had failed: the finished output stays in {staging}{previous}; move them "
                              "yourself" if whole else None, staging if whole else None)
    if staging.is_dir() and not staging.is_symlink():
        try:
            if kind == "publish_into" and output_dir.is_dir() and not output_dir.is_symlink():
                old.mkdir(exist_ok=True)
                if not (old / ALL_MOVED_OUT).exists():
                    move_out(output_dir, old)
                move_in(staging, output_dir)
            elif kind == "publish" and not old.exists() and (output_dir.exists() or output_dir.is_symlink()):
                output_dir.rename(old)
            if kind == "publish" and not (output_dir.exists() or output_dir.is_symlink()):
                staging.rename(output_dir)
            if staging.exists():
                raise OSError(f"{output_dir} is no longer the folder it was")
        except OSError as err:
            return Settled(False, f"its publication, cut short, could not be completed ({err.strerror or err}): the "
                                  f"finished output is in {staging}, the previous output's files in {old}; move them yourself",
                           staging)
    remove_published_aside(output_dir, pid)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    return Settled(True, None if not old.exists() else f"the previous output, half removed, is left in {old}: delete it")


def tags_begun(output_dir: Path) -> tuple[str, ...]:
    """The checkpoint tags in ``output_dir/checkpoints`` while none is published: a save the run began (an --overwrite
    run's folder is its own), whose files other ranks may still be writing after rank 0 was killed."""
    ckpt = output_dir / "checkpoints"
    if published(output_dir).exists() or ckpt.is_symlink() or not ckpt.is_dir():
        return ()
    return tuple(sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step")))


def remove_published_aside(output_dir: Path, pid: int | None = None) -> None:
    """What --overwrite set aside, once the new output is published (renamed ``.published.*`` first): never put back."""
    aside = aside_dir(output_dir, pid)
    for gone in (aside, *aside.parent.glob(f"{aside.name}.published.*")):
        if gone.is_dir() and not gone.is_symlink():
            shutil.rmtree(gone, ignore_errors=True)


def set_aside(output_dir: Path, paths: list[Path]) -> None:
    """Rank 0 of an --overwrite job, before any work: ``paths`` (in the output or beside it) move aside, not deleted, so
    the previous output stays whole until the new one is complete. An aside folder an earlier job of this process id
    left (containers reuse ids) is renamed first, never merged into."""
    aside = aside_dir(output_dir)
    try:
        moved_away(aside, "earlier")
        for path in paths:
            if path.exists() or path.is_symlink():
                aside.mkdir(exist_ok=True)
                path.rename(aside / path.name)
    except OSError as err:
        raise ElsaError(f"--overwrite: the previous output's {err.filename or 'files'} could not be moved aside to {aside} "
                        f"({err.strerror or err}); nothing was replaced") from None


def put_back(output_dir: Path, pid: int | None = None, busy: Collection[str] = ()) -> str | None:
    """A job that did not publish: what :func:`set_aside` moved goes back, each in place of what the run wrote there
    (that moved away first, then removed), unless the run published a checkpoint of its own (a --resume continues it),
    or another rank may still be writing a checkpoint tag (one of ``busy``) the previous checkpoints hold too (its files
    would land in theirs): then all of it stays aside. Returns the warning to give (what stays aside, where), never
    raises: an error here would hide the job's own. Stdlib only: the watchdog calls it too, after a SIGKILL (``busy``:
    :func:`tags_begun`)."""
    aside = aside_dir(output_dir, pid)
    if not aside.is_dir():
        return None
    if published(output_dir).exists():  # this run's: the previous output's went aside before any work
        return (f"this run's checkpoints in {output_dir / 'checkpoints'} can be resumed (--resume); what it would have "
                f"replaced of the previous output is in {aside} (delete it once not wanted)")
    if tag := next((t for t in busy if (aside / "checkpoints" / t).exists()), None):
        return (f"another rank may still be writing checkpoint {tag} into {output_dir / 'checkpoints'}, and the previous "
                f"output's checkpoints hold a {tag} of their own: they stay in {aside} with its logs and side files "
                "(move them back once the job's processes are gone)")
    try:
        for entry in sorted(aside.iterdir()):
            target = (output_dir.resolve().parent if entry.name.startswith(f".{output_dir.name}.") else output_dir) / entry.name
            trash = moved_away(target, "unpublished")
            entry.rename(target)
            if trash is not None and trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash, ignore_errors=True)
            elif trash is not None:
                trash.unlink()
        aside.rmdir()
    except OSError as err:
        return (f"the previous output's checkpoints, logs or side files could not all be put back ({err}): what is left of "
                f"them is in {aside}")
    return None


def moved_away(path: Path, why: str) -> Path | None:
    """Rename ``path`` (if there) to a new name beside it; that name, or None when there was nothing to move."""
    if not (path.exists() or path.is_symlink()):
        return None
    away = path.with_name(f"{path.name}.{why}.{time.time_ns()}")
    path.rename(away)
    return away
