"""What an output folder holds, and whose it is: what an attempt of a job leaves there, whether an elsa_ds command
wrote it (what ``--overwrite`` may replace), and what the job's checks found there, which is all its publication
replaces: an entry that appears while the job runs (another program's file, another job's output or lock) stops the
publication (``files/output.publish``), but for what the run itself writes there (:func:`run_writes`).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from elsa_ds import json_data
from elsa_ds.files.aside import FINGERPRINT, REPORT_NAME, checkpoint_entry
from elsa_ds.files.ownership import held_inside
from elsa_ds.files.weight_files import SPARSE_CONFIG_KEY, sparse_shards

MONITOR_DIR = "monitor"  # where DeepSpeed's file monitors write without an output_path of their own (elsa_ds/monitor.py)
ATTEMPT_LEFTOVERS = ("checkpoints", MONITOR_DIR)  # what a run that published nothing leaves in its output folder
_FOUND: dict[str, frozenset[str]] = {}  # each output's foreign entries as its job's checks last found them (note_entries)
_OWN: dict[str, frozenset[str]] = {}  # what each output's run writes in it besides its leftovers (run_writes)


def foreign_entries(output_dir: Path) -> list[str]:
    """The names in ``output_dir`` (if a folder) that no attempt of a job leaves there: anything but its
    :data:`ATTEMPT_LEFTOVERS`, and those only as real folders, a checkpoints folder holding only what a run writes there
    (a review: a user's ``checkpoints`` of other models counted as a run's and went with --overwrite)."""
    if not output_dir.is_dir() or output_dir.is_symlink():
        return []
    return sorted(p.name for p in output_dir.iterdir() if not _left_by_an_attempt(p))


def _left_by_an_attempt(path: Path) -> bool:
    if path.name not in ATTEMPT_LEFTOVERS or path.is_symlink() or not path.is_dir():
        return False
    try:
        return path.name != "checkpoints" or all(checkpoint_entry(p.name) for p in path.iterdir())
    except OSError:  # a folder it cannot list: nothing says a run wrote it
        return False


def written_by_elsa(folder: Path) -> bool:
    """Whether ``folder`` holds what an elsa_ds command publishes, which --overwrite may replace whole: a pruning job's
    output (its report), a run's checkpoints (their settings' file), an elsa-compress checkpoint (config.json's block
    and its shards' mark: a dense model saved from one may carry the block), each a plain file; or what an attempt that
    published nothing leaves (:data:`ATTEMPT_LEFTOVERS` alone). Not a folder of anything else: a user's
    ``--output_dir ~/models --overwrite`` would have removed every model in it (a session's leftover)."""
    if not foreign_entries(folder):
        return True
    ckpt, config = folder / "checkpoints", folder / "config.json"
    if plain_file(folder / REPORT_NAME) or _left_by_an_attempt(ckpt) and plain_file(ckpt / FINGERPRINT):
        return True
    try:
        data = json_data.read(config) if plain_file(config) else None
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get(SPARSE_CONFIG_KEY), dict) and sparse_shards(folder)


def plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def not_replaced(folder: Path, flag: str, overwrite: bool) -> str | None:
    """The refusal for a non-empty ``folder`` that no elsa_ds command wrote, else None: with ``overwrite`` it would go
    whole; without it, the not-empty refusal must not offer --overwrite (the advice, followed, is refused)."""
    if (busy := held_inside(folder)) is not None:
        return f"{flag} {folder}: {busy} inside it; wait for it to end or choose another folder"
    try:
        if written_by_elsa(folder):
            return None
        names = foreign_entries(folder)
    except OSError as err:  # a folder it may list but not enter: it cannot be checked, nor replaced
        return f"{flag} {folder} cannot be read ({err.strerror or err}); choose another folder"
    held = ", ".join(names[:3]) + (f" and {len(names) - 3:,} more" if len(names) > 3 else "")
    what = (f"{flag} {folder} holds {held}, and no elsa_ds output's mark (a job's {REPORT_NAME}, a run's checkpoints, "
            "elsa-compress's config.json block and marked shards): no elsa_ds command wrote it")
    if overwrite:
        return f"{what}, and --overwrite would replace it whole: choose another folder, or empty it yourself first"
    return f"{what}; choose another folder, or empty it yourself first (--overwrite replaces only an elsa_ds output)"


def note_entries(output_dir: Path) -> None:
    """Its job's checks passed ``output_dir`` as it is now: what publishing replaces is what they found, and an entry that
    appears later (another program's file, another job's output or lock) stops the publication (:func:`appeared`)."""
    _FOUND[os.path.realpath(output_dir)] = frozenset(foreign_entries(Path(output_dir)))
    _OWN.pop(os.path.realpath(output_dir), None)  # an earlier job's of this process are not this one's


def appeared(output_dir: Path) -> str | None:
    """What publishing would remove of ``output_dir`` that its job's checks did not find there, in words; None if nothing
    (an audit: a job started without --overwrite removed another job's output finished inside its own meanwhile, and
    one with --overwrite an elsa-evaluate result written into it while it ran)."""
    key = os.path.realpath(output_dir)
    found = _FOUND.get(key, frozenset()) | _OWN.get(key, frozenset())
    if not (new := [name for name in foreign_entries(output_dir) if name not in found]):
        return None
    names = ", ".join(new[:3]) + (f" and {len(new) - 3:,} more" if len(new) > 3 else "")
    busy = held_inside(output_dir)
    return f"{names} appeared there while the job ran ({busy or 'written by another job or program'}), which publishing would remove"


def run_writes(output_dir: Path, names: Iterable[str]) -> None:
    """The entries ``names`` of ``output_dir`` are written by its run as it runs (a file monitor's ``output_path`` there,
    a review's find): its publication neither stops on them nor leaves them behind (:func:`own_entries`)."""
    _OWN[os.path.realpath(output_dir)] = frozenset(names)


def own_entries(output_dir: Path) -> tuple[str, ...]:
    """What :func:`run_writes` named for ``output_dir``, sorted."""
    return tuple(sorted(_OWN.get(os.path.realpath(output_dir), ())))
