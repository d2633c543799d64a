"""Writing a checkpoint on every rank: a tag is published as ``latest`` once every rank wrote it, and a rank that cannot
write its part (a full disk) stops every rank, none left waiting in DeepSpeed's collectives (``checkpoint.py`` reads
them and checks them before any model exists)."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import DiskFull, writer_ran_out
from elsa_ds.files.io import write_atomic
from elsa_ds.log import get_logger
from elsa_ds.regular_file import open_regular
from elsa_ds.zero import compat
from elsa_ds.zero.checkpoint import CLIENT_KEY, LATEST_BYTES, RECOVERY_SCRIPTS, tags_newest_first, write_fingerprint
from elsa_ds.zero.dist import agreed, every_rank


_WRITING: list[str] = []  # the tag this process's save began and has not seen every rank finish (more than one rank)


def take_tags_being_written() -> tuple[str, ...]:
    """The tag whose save this process began and did not see every rank finish, if any (then forgotten: the next job of
    this process starts clear): after a failure here another rank may still be writing its files, by path, into the
    output's checkpoints folder. Empty with one rank."""
    tags = tuple(_WRITING)
    _WRITING.clear()
    return tags


def save(engine, ckpt_dir: Path, step: int, client: dict, keep: int, rank: int, fingerprint: dict) -> str:
    """Save after ``step`` (0-based) as tag global_step{step+1} (rank 0 writes the run's ``fingerprint`` beside the tags
    first); publish it as latest; prune old tags. A rank that could not write its part (a full disk) stops every rank,
    the tag gone, none waiting for it (for an exception; a signal ends that rank as it would anywhere). Collective."""
    import torch.distributed as dist

    tag = f"global_step{step + 1}"
    what = f"checkpoint {ckpt_dir / tag}"
    failure = _rank_zero_part(what, rank, lambda: _prepare(ckpt_dir, tag, fingerprint))
    written = failure is None  # DeepSpeed's writes begin: its copies of the recovery scripts may follow
    if written:
        _WRITING[:] = [tag] if dist.get_world_size() > 1 else []
        failure = _write_tag(engine, ckpt_dir, tag, client)
        _WRITING.clear()  # every rank is past its writes
    if failure is None:
        failure = _rank_zero_part(what, rank, lambda: publish_latest(ckpt_dir, tag, keep))
        if failure is None:
            return tag
    if rank == 0:
        discard_unpublished_tag(ckpt_dir, tag, copied=written)
    dist.barrier()  # the files gone before a rank measures the free space it reports
    raise failure.measured_again() if isinstance(failure, DiskFull) else failure


def _rank_zero_part(what: str, rank: int, part: Callable[[], None]) -> Exception | None:
    """``part()`` on rank 0, the ranks agreeing after it (``dist.agreed``): None when it went well, else the error this
    rank raises (rank 0's own, or another rank's failure named by ``what``). Collective."""
    try:
        with agreed(what):
            if rank == 0:
                part()
    except Exception as err:  # noqa: BLE001 - raised by the caller once the tag is gone
        return err
    return None


def _prepare(ckpt_dir: Path, tag: str, fingerprint: dict) -> None:
    """Rank 0, before every rank writes ``tag``: the folder, the run's fingerprint, no earlier copy of the tag."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_fingerprint(ckpt_dir, fingerprint)
    clear_for_save(ckpt_dir, tag)


def discard_unpublished_tag(ckpt_dir: Path, tag: str, copied: bool = True) -> None:
    """Rank 0, after a save of ``tag`` that failed, once no rank writes: the tag goes unless ``latest`` names it, the
    recovery scripts the last good save left are back (``clear_for_save`` set them aside: DeepSpeed's copy over them may
    stop half-way on a full disk), and a checkpoints folder with nothing published goes (this run made it: an older
    run's went with --overwrite, and --resume needs a ``latest``). ``copied``: DeepSpeed's writes began, so a script
    with nothing set aside is this save's copy, whole or not (else it is the last good save's: an audit, the fingerprint's
    write failing on a full disk had them removed). A script that cannot be put back stays aside for the next save."""
    if published_tag(ckpt_dir) != tag and (why := remove_tag(ckpt_dir / tag)) is not None:
        get_logger(__name__).warning(f"the failed save's checkpoint {ckpt_dir / tag} stays: it could not be removed ({why}); "
                                     "remove it yourself to free its space")
    for name in RECOVERY_SCRIPTS:
        path, aside = ckpt_dir / name, _aside(ckpt_dir, name)
        with contextlib.suppress(OSError):  # the save's own error is the one said
            if aside.is_file() and not aside.is_symlink():
                os.replace(aside, path)
            elif copied and (path.is_symlink() or path.is_file()):
                path.unlink()
    if not (ckpt_dir / "latest").exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def published_tag(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names, None where it is no regular file of at most a tag's name (a link is not followed, and
    at most ``LATEST_BYTES`` + 2 bytes are read: a name and DeepSpeed's newline)."""
    try:
        with open_regular(ckpt_dir / "latest") as fh:
            raw = fh.read(LATEST_BYTES + 2)
    except OSError:  # NotRegularFile too
        return None
    if len(raw) > LATEST_BYTES + 1:
        return None
    return raw.decode("utf-8", "replace").strip()


class FailedElsewhere(Exception):
    """Another rank's part of a collective save or load failed: this rank leaves DeepSpeed's call before its collective."""


class Vote:
    """The ranks' one agreement, just before DeepSpeed's first collective after a tag's reads or writes
    (``compat.checkpoint_hooks``), whether each one's part went well (``every_ok()``, a collective): FailedElsewhere
    when some rank's did not. ``made``: this rank has voted (set first: a vote that raises counts as made)."""

    def __init__(self, every_ok: Callable[[], bool]):
        self.every_ok, self.made = every_ok, False

    def __call__(self) -> None:
        self.made = True
        if not self.every_ok():
            raise FailedElsewhere


def _write_tag(engine, ckpt_dir: Path, tag: str, client: dict) -> Exception | None:
    """DeepSpeed's save of ``tag``, the ranks voting whether each one wrote its files; a rank whose writes raised votes
    after. None when every rank wrote them, else the error this rank raises (its own: a full disk as
    :class:`DiskFull`; or another rank's failure). Collective."""
    vote = Vote(lambda: every_rank(True))
    try:
        with compat.checkpoint_hooks(engine, vote):
            engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={CLIENT_KEY: client}, save_latest=False)
        return None
    except FailedElsewhere:
        return ElsaError(f"checkpoint {ckpt_dir / tag}: another rank could not write its files (its line says why); the "
                         "run stopped there, the tag was not kept")
    except Exception as err:
        if vote.made:  # raised inside the collectives after the vote: no rank waits for this one's
            raise
        every_rank(False)
        return writer_ran_out(err, ckpt_dir / tag) or err


def clear_for_save(ckpt_dir: Path, tag: str) -> None:
    """Rank 0, before every rank writes ``tag``: a killed run's unpublished copy of it goes; so do the recovery scripts
    DeepSpeed copies beside the tags at each save where that copy would write through them (``shutil.copyfile`` writes
    into the file there, then makes it executable: through a link, or into every other name of a hard-linked file, that
    a copied folder may hold); a file of one name is set aside (renamed: no byte written), for the copy may stop half-way
    on a full disk: a failed save puts it back (``discard_unpublished_tag``; a walk: a full disk's save left none, and a
    truncated one is worse), a published one drops it (``publish_latest``). One set aside by a killed save is back first."""
    remove_tag(ckpt_dir / tag)
    for name in RECOVERY_SCRIPTS:
        path, aside = ckpt_dir / name, _aside(ckpt_dir, name)
        if aside.is_file() and not aside.is_symlink() and aside.stat().st_nlink == 1:
            os.replace(aside, path)
        elif aside.is_symlink() or aside.is_file():  # our name, holding something else (a copied folder's): it goes
            aside.unlink()
        elif aside.exists():
            shutil.rmtree(aside)
        if path.is_symlink() or (path.is_file() and path.stat().st_nlink > 1):
            path.unlink()
        elif path.is_file():
            os.replace(path, aside)


def _aside(ckpt_dir: Path, name: str) -> Path:
    """Where ``clear_for_save`` keeps a recovery script while a save copies a new one."""
    return ckpt_dir / f".{name}.before-save"


def remove_tag(path: Path) -> str | None:
    """A tag's folder gone; a link there is removed itself, never followed. Returns why not all of it went (None: gone)."""
    failed: list[str] = []

    def said(_function: Callable, where: str, err: BaseException) -> None:
        failed.append(f"{where}: {getattr(err, 'strerror', None) or err}")

    if path.is_symlink():
        path.unlink(missing_ok=True)
    elif sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=said)
    else:
        shutil.rmtree(path, onerror=lambda function, where, info: said(function, where, info[1]))
    return None if not failed or not path.exists() else failed[0]


def publish_latest(ckpt_dir: Path, tag: str, keep: int) -> None:
    """Rank 0, once every rank wrote ``tag``: ``latest`` names it (``write_atomic``: a new temp file, never written through
    a link a copied checkpoint may hold, renamed over it; an ElsaError when it cannot be written), then every tag but
    ``tag`` and the ``keep`` - 1 before it goes: newer ones a killed run never published (never tried by a resume) must
    not push ``tag`` out."""
    write_atomic(ckpt_dir / "latest", tag)
    for name in RECOVERY_SCRIPTS:  # the save copied them whole: the ones set aside before it are not needed
        _aside(ckpt_dir, name).unlink(missing_ok=True)
    tags = tags_newest_first(ckpt_dir)
    at = tags.index(tag)
    for old in tags[:at] + tags[at + keep:]:  # one left says so (an audit: a read-only tag stayed, its bytes unsaid)
        if (why := remove_tag(ckpt_dir / old)) is not None:
            get_logger(__name__).warning(f"checkpoint {ckpt_dir / old} stays beside the {keep} kept (--keep_checkpoints): "
                                         f"it could not be removed ({why}); remove it yourself to free its space")
