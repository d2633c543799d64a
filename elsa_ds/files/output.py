"""The output directory of a pruning job: checks before work, staging, atomic publication.

Every job (ELSA or one-shot) builds its output in a hidden staging directory beside ``--output_dir``
and renames it into place only when complete, so an existing output is never half-overwritten. The report's per-layer
sparsity is read back from the exported files, never from memory (``evaluation.sparsity.verified_layers``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from elsa_ds.errors import ElsaError, Terminated, signals_held
from elsa_ds.files.aside import (PUBLISH_FAILED, REPORT_NAME, START_OVER, aside_dir, beside, move_in, move_out, moved_away,
                                 old_dir, published)
from elsa_ds.files.aside import side_path  # the jobs import it here
from elsa_ds.files.handed import check_plain_tree
from elsa_ds.files.io import make_folder
from elsa_ds.files.marks import (ATTEMPT_LEFTOVERS, MONITOR_DIR, appeared, foreign_entries, not_replaced, note_entries,
                                 own_entries, plain_file)
from elsa_ds.files.mounts import mount_problem
from elsa_ds.log import get_logger
from elsa_ds.quoting import shell_word

RESUMABLE = ("oneshot", "mask.safetensors", "best_projection")  # side files a --resume of a checkpointed run reads again


def check_output_dir(output_dir: Path, overwrite: bool, resume: bool = False, restart: bool = False) -> None:
    """Refuse a non-empty output directory unless overwriting or resuming, or restarting over what an attempt that
    published nothing left (``restart``: --resume_if_any); cheap, so it runs before heavy work."""
    check_output_path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ElsaError(f"--output_dir {output_dir} exists and is not a directory")
    if resume and overwrite:
        raise ElsaError("--resume and --overwrite exclude each other: --resume continues the run in --output_dir")
    if restart and output_dir.is_dir():  # what goes or is appended to: an attempt's leftovers, nothing published, no link
        left = foreign_entries(output_dir)
        if left or published(output_dir).exists():
            raise ElsaError(f"--resume_if_any: {output_dir} changed since it was read ({', '.join(left) or 'a checkpoint'} "
                            "appeared); run the job again")
        if linked := [name for name in ATTEMPT_LEFTOVERS if (output_dir / name).is_symlink()]:
            raise ElsaError(f"--resume_if_any: {output_dir / linked[0]} is a symbolic link, which no attempt of a job leaves; "
                            "remove it or choose another --output_dir")
        check_plain_tree(output_dir / MONITOR_DIR, "the monitor's logs")  # appended to; the checkpoints' tags go (unfollowed)
    if resume:  # before anything in it is read: no link, no FIFO where the resume reads and writes
        for path, what in [(output_dir / "checkpoints", "the checkpoints"), (output_dir / MONITOR_DIR, "the monitor's logs"),
                           *((side_path(output_dir, n), "the run's side files") for n in RESUMABLE)]:
            check_plain_tree(path, what)
    if resume and not (output_dir / "checkpoints" / "latest").exists():
        if plain_file(output_dir / REPORT_NAME):
            raise ElsaError(f"--resume: {output_dir} holds a finished run ({REPORT_NAME}) and no checkpoint to continue; "
                            "--overwrite in place of --resume replaces it, or choose another --output_dir")
        if refusal := not_replaced(output_dir, "--output_dir", overwrite=True):  # what the advice below would meet
            raise ElsaError(f"--resume: {output_dir / 'checkpoints'} holds no published checkpoint (no 'latest' file); {refusal}")
        raise ElsaError(f"--resume: {output_dir / 'checkpoints'} holds no published checkpoint (no 'latest' file); "
                        + START_OVER)
    if output_dir.is_dir() and not (resume or restart) and (refusal := not_replaced(output_dir, "--output_dir", overwrite)):
        raise ElsaError(refusal)
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (overwrite or resume or restart):
        resumable = "--resume to continue it, " if published(output_dir).exists() else ""  # an audit: offered, then refused
        raise ElsaError(f"--output_dir {output_dir} is not empty; pass --overwrite to replace it, {resumable}or choose another "
                        "directory")
    parent = output_dir.resolve().parent
    try:  # the staging directory, checkpoints and warm-start masks all go beside the output
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ElsaError(f"--output_dir {output_dir}: cannot create its parent directory {parent} ({e.strerror}); "
                        "choose another path") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ElsaError(f"--output_dir {output_dir}: parent directory {parent} is not writable; choose another path")
    check_publishable(output_dir, replaced=not (resume or restart))
    note_entries(output_dir)


def missing_folders(output_dir: Path) -> list[Path]:
    """``output_dir`` and the folders above it that do not exist yet (the deepest first): :func:`check_output_dir` creates
    the parents, a job's first checkpoint the output itself, and a job that ends without an output removes those it left
    empty (:func:`remove_if_empty`; a run stopped at its first checkpoint left an empty output folder)."""
    missing = []
    for folder in [Path(os.path.abspath(output_dir)), *Path(os.path.abspath(output_dir)).parents]:
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    return missing


def remove_if_empty(folders: list[Path]) -> None:
    """Remove each of ``folders`` (the deepest first) that is empty; skip one that is not there (an output never made);
    stop at the first that is not empty (or cannot go)."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return


@contextlib.contextmanager
def made_folders(files: list[Path | None]):
    """The missing folders above each of ``files`` (what a command writes, None for one it does not), made for the
    command, removed again when it fails and leaves them empty (a user's walk: the README's ``--output results/x.json``
    was refused on a clean clone, where --output_dir's folders are made)."""
    made = [missing_folders(Path(file).parent) for file in files if file is not None]
    try:
        for folders in made:
            if folders:
                make_folder(folders[0])
        yield
    except BaseException:
        for folders in made:
            remove_if_empty(folders)
        raise


def check_output_path(output_dir: Path) -> None:
    """The output is named by its own path: no symbolic link at it (its lock, staging and side files are named from the
    path, so a second name for one folder would give a second owner, and a dangling link would build beside its
    target), no ``.`` or ``..`` as its last part, and no folder a replaced or continued output would take with it: the
    current directory, this Python environment, the installed elsa_ds, the home directory, the Hugging Face cache, or
    one containing them. Whatever the other flags."""
    real = os.path.realpath(output_dir)
    if output_dir.is_symlink():
        raise ElsaError(f"--output_dir {output_dir} is a symbolic link (to {os.readlink(output_dir)}): give the folder's own "
                        f"path, e.g. {real}")
    if output_dir.name in ("", ".", ".."):
        raise ElsaError(f"--output_dir {output_dir}: name a folder of its own, not /, . or .. (e.g. {Path(real) / 'out'})")
    out = Path(real)
    for what, path in _kept_folders():
        if out == path or out in path.parents:
            raise ElsaError(f"--output_dir {output_dir} {'is' if out == path else 'contains'} {what} ({path}): a replaced or "
                            "continued output would take it along; choose a folder of its own")


def _kept_folders() -> list[tuple[str, Path]]:
    """The folders no output may be or contain; one that cannot be told (no home, a deleted working directory) is left out."""
    found: list[tuple[str, Callable[[], str | Path]]] = [
        ("this Python environment", lambda: sys.prefix), ("the installed elsa_ds", lambda: Path(__file__).parents[1]),
        ("the current directory", Path.cwd), ("the home directory", Path.home),
        ("the Hugging Face cache", lambda: _hub("HF_HUB_CACHE")), ("the Hugging Face home", lambda: _hub("HF_HOME"))]
    kept = []
    for what, where in found:
        try:
            kept.append((what, Path(os.path.realpath(Path(where()).expanduser()))))
        except (OSError, RuntimeError):
            continue
    return kept


def _hub(name: str) -> str:
    """A folder of the Hugging Face hub's as the hub itself resolves it (HF_HUB_CACHE, the older HUGGINGFACE_HUB_CACHE,
    HF_HOME, XDG_CACHE_HOME, ``~`` and ``$VAR`` in them: an audit found an output over $XDG_CACHE_HOME/huggingface
    allowed, and the cache removed with it)."""
    from huggingface_hub import constants

    return getattr(constants, name)


def check_publishable(output_dir: Path, replaced: bool) -> None:
    """The final rename will work: an existing output is no mount point (the staging directory beside it sits on its
    parent's filesystem, and a rename cannot cross filesystems or replace a mount), holds none where it is ``replaced``
    whole (not continued: --resume), renames on an overlay file system, and can be written into and removed."""
    if not output_dir.is_dir():
        return
    if os.stat(output_dir).st_dev != os.stat(output_dir.resolve().parent).st_dev:
        raise ElsaError(f"--output_dir {output_dir} is a mount point (another filesystem than its parent): the finished output "
                        f"is built beside it and renamed into place, which cannot cross filesystems; use a folder inside it")
    if why := mount_problem(output_dir, "--output_dir", replaced):
        raise ElsaError(why)
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ElsaError(f"--output_dir {output_dir} is not writable, so it cannot be continued or replaced; choose another path")


def staging_dir(output_dir: Path) -> Path:
    """Where rank 0 of this job builds the output before it is renamed into place: named for its process, so two jobs
    (or a dead job's leftover) never share one. Its siblings (warm-start masks, snapshots) take their names from it."""
    return beside(output_dir, "partial")


def fresh_staging(output_dir: Path, overwriting: bool = False) -> Path:
    """An empty staging directory for this job. Leftovers of earlier jobs (one of this process id renamed first) are
    named, not removed: one may hold a finished output whose final rename failed. ``overwriting``: this job is an
    --overwrite job, whose own folder of what it set aside (``aside.aside_dir``: any earlier job's of this process id
    was renamed before it) is no leftover."""
    staging = staging_dir(output_dir)
    moved_away(staging, "earlier")  # an earlier job of this process id (containers reuse ids): it may hold a finished output
    own = {staging, *([aside_dir(output_dir)] if overwriting else [])}
    leftovers = sorted(str(p) for pattern in (".partial*", ".replaced.*", ".old.*")
                       for p in staging.parent.glob(f".{output_dir.name}{pattern}") if p not in own)
    if leftovers:  # a failed final rename's finished output; what a killed --overwrite job had set aside of the output before
        get_logger(__name__).warning(f"folders of earlier jobs on {output_dir} remain: {', '.join(leftovers)} "
                                     "(delete them once you know nothing in them is wanted)")
    staging.mkdir(parents=True)
    return staging


class PublishFailed(ElsaError):
    """The finished output could not be renamed into place: it stays where the message says (``kept``), and no exit path
    may remove it."""

    def __init__(self, message: str, kept: Path):
        super().__init__(message)
        self.kept = kept


def publish(staging: Path, output_dir: Path, keep_checkpoints: bool, carry: tuple[str, ...] = ("monitor",),
            announce: Callable[[str], None] | None = None) -> None:
    """Swap the finished staging directory in for ``output_dir`` (old contents removed only afterwards).

    With ``keep_checkpoints`` the output's folders stay (the run's checkpoints, its logs): the previous output's files
    move aside first (none stays mixed with the new ones), then each finished file is renamed into place. The folders named in
    ``carry`` that the run wrote into ``output_dir`` while it ran (the monitor's logs) move along (with
    ``keep_checkpoints`` they stay where they are). Should a rename fail, a :class:`PublishFailed` says where the
    finished output is. Ctrl-C and SIGTERM wait until it is done (then take effect). ``announce`` (rank 0's watchdog)
    hears the publication's kind (``aside.PUBLICATIONS``) just before anything moves: after a SIGKILL the watchdog
    completes it (``aside.settle_old``). A stop held through a publication that succeeded carries the output's path
    (``published``): the entry point's line then says the output is whole.
    """
    done: list[bool] = []
    try:
        _publish(staging, output_dir, keep_checkpoints, carry, done, announce)
    except (KeyboardInterrupt, Terminated) as stop:
        if done:  # raised as the held signals were let through, the publication complete
            stop.published = output_dir  # type: ignore[union-attr]
        raise


def _publish(staging: Path, output_dir: Path, keep_checkpoints: bool, carry: tuple[str, ...], done: list[bool],
             announce: Callable[[str], None] | None) -> None:
    with signals_held():  # a Ctrl-C between the renames, or while the previous output goes, would leave it half there
        as_created(staging)
        old = old_dir(output_dir)
        try:
            moved_away(old, "earlier")  # an earlier job of this process id left it (containers reuse ids): never merged into
            if (new := appeared(output_dir)) is not None:
                raise _not_published(f"the finished output was not moved to {output_dir}: {new}", staging, output_dir,
                                     False, announce)  # nothing moved yet: its staging folder is whole
            into = keep_checkpoints and output_dir.is_dir()
            if announce is not None:
                announce("publish_into" if into else "publish")
            for name in (*carry, *own_entries(output_dir)):  # the run's own logs, written in place
                if (output_dir / name).is_dir() and not (staging / name).exists() and not keep_checkpoints:
                    (output_dir / name).rename(staging / name)
            if into:
                _publish_into(staging, output_dir, old)
            else:
                if output_dir.exists():
                    output_dir.rename(old)
                try:
                    staging.rename(output_dir)
                except OSError:
                    if old.exists() and not output_dir.exists():
                        old.rename(output_dir)  # the previous output back where it was
                    raise
        except OSError as err:
            raise _not_published(f"the finished output could not be moved to {output_dir} ({err.strerror or err})", staging,
                                 output_dir, keep_checkpoints, announce) from None
        set_aside = moved_away(aside_dir(output_dir), "published")  # what --overwrite set aside: never put back now
        for gone in (set_aside, old):  # the old folder last: while it is there, a watchdog finishes this (aside.settle_old)
            try:
                if gone is not None and gone.exists():
                    shutil.rmtree(gone)
            except (OSError, RecursionError) as err:  # Python 3.11's rmtree recurses: a tree 1,000 folders deep (a walk)
                text = getattr(err, "strerror", None) or err
                get_logger(__name__).warning(f"wrote {output_dir}, but the previous output moved aside to {gone} could not be "
                                             f"removed ({text}); delete it yourself")
        done.append(True)


def _not_published(why: str, staging: Path, output_dir: Path, keep_checkpoints: bool,
                   announce: Callable[[str], None] | None) -> PublishFailed:
    """The error of a publication that stopped (``why``), saying where the finished output is and how to finish it."""
    if announce is not None:  # the watchdog keeps the staging folder this error names, should rank 0 die on its way out
        with contextlib.suppress(OSError):  # the phase log's own failure must not replace the error that keeps it
            announce(PUBLISH_FAILED)
    there = "NEW_PATH" if output_dir.exists() else shell_word(os.path.abspath(output_dir))  # mv would move it into a folder
    where = (f"the files not moved yet are in {staging}: move them into {output_dir} yourself" if keep_checkpoints else
             f"it is complete in {staging}: move it {'to a new path' if output_dir.exists() else 'there'} yourself (mv "
             f"{shell_word(str(staging))} {there})")
    where += f"; the previous output's files are in {old}" if (old := old_dir(output_dir)).exists() else ""
    return PublishFailed(f"{why}; {where}", staging)


def as_created(folder: Path) -> None:
    """The files directly in ``folder`` readable as any file this process creates (0666 less the umask): transformers 5
    writes ``model.safetensors`` through a private temporary file (0600), which left a one-shot job's export unreadable
    to the group that reads the run's other files."""
    mode = 0o666 & ~_umask()
    for entry in folder.iterdir():
        if entry.is_file() and not entry.is_symlink() and entry.stat().st_mode & 0o777 != mode:
            entry.chmod(mode)


def _umask() -> int:
    """This process's umask, read without changing it (Linux: /proc/self/status), else set and restored at once."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish_into(staging: Path, output_dir: Path, old: Path) -> None:
    """``output_dir`` keeps its folders (the run's checkpoints and logs): every file of the previous output moves into
    ``old`` (removed by the caller), then each finished file moves in (``aside.move_out``, ``aside.move_in``: a watchdog
    completes them after a kill). A failure while the previous files move aside puts them back."""
    old.mkdir()
    try:
        move_out(output_dir, old)
    except OSError:  # unmarked: the marker is move_out's last step
        for entry in sorted(old.iterdir()):
            entry.rename(output_dir / entry.name)
        old.rmdir()
        raise
    move_in(staging, output_dir)
