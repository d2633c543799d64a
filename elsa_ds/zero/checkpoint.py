"""Checkpoints of an ELSA run: DeepSpeed's layout (tags ``global_step{N}``, a ``latest`` file) plus our state.

What DeepSpeed saves with CPU offload or without offload: the fp32 masters and the base optimizer's
state dict — which holds z and u, since they live in ``optimizer.state`` — per rank. What we add as
``client_state``: the step, λ in force, the run's loss and projection history, and the RNG states; the
data position is the step itself (global batches are a pure function of seed and step).

A checkpoint becomes ``latest`` only after every rank finished writing it (the ranks agree, then an atomic rename of
the ``latest`` file), and only it and the ``keep`` - 1 tags before it are kept (``checkpoint_save.py``). Loading tries
the tags from the newest down, so a checkpoint corrupted by a crash mid-write falls back to the one before. Links a
copied checkpoint folder holds where a save writes are removed, never written through (``checkpoint_save.clear_for_save``,
``publish_latest``).

A checkpoint is read as data: every file of the tags a resume may load is scanned before any model or engine exists
(``check_resume``), and DeepSpeed reads it with ``torch.load(weights_only=True)`` and an allow-list of the classes its
checkpoints hold (``compat.checkpoint_globals``). A file whose pickle names anything else is refused, not run.

NVMe optimizer offload is refused for checkpointing: DeepSpeed's NVMe path restores the masters but
not the optimizer state (notes/deepspeed-zero3.md §5), so a resumed run would silently restart Adam
and ADMM.
"""
from __future__ import annotations

import os
import pickle
import random
import re
import reprlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elsa_ds import json_data, regular_file
from elsa_ds.errors import ElsaError
from elsa_ds.files import aside, torch_files
from elsa_ds.settings.config import RESUME_DEFAULTS
from elsa_ds.settings.config_files import resume_place
from elsa_ds.zero import compat
from elsa_ds.zero.ds_config import DsConfig


TAG = aside.TAG
CLIENT_KEY = "elsa"
RECOVERY_SCRIPTS = aside.RECOVERY_SCRIPTS  # DeepSpeed copies them beside the tags at each save
FINGERPRINT = aside.FINGERPRINT  # the run's settings beside its tags: readable before any model or engine exists
LATEST_BYTES = 255  # what `latest` holds: one tag's folder name


def write_fingerprint(ckpt_dir: Path, fingerprint: dict) -> None:
    """The settings a resumed run must share (``ElsaConfig.resume_fingerprint``), as JSON in ``ckpt_dir`` (rank 0)."""
    from elsa_ds.files.io import write_json

    write_json(ckpt_dir / FINGERPRINT, fingerprint)


_SHORT = reprlib.Repr()  # a written value is data, of any depth and size: at most 3 levels and 120 characters of it
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 120, 120


def resume_changes(written: dict[str, Any], now: dict[str, Any], flag: str = "--resume") -> str | None:
    """What differs between a checkpoint's fingerprint and this run's (``ElsaConfig.resume_fingerprint``), as the
    refusal's text, and what to do (``flag``: the one the user gave, --resume or --resume_if_any); None when nothing does."""
    written = {k: resume_place(k, v) for k, v in written.items()}  # an older checkpoint's paths, as they were typed
    changed = {k: (v, now.get(k)) for k, v in {**RESUME_DEFAULTS, **written}.items() if not json_data.same(now.get(k), v)}
    if not changed:
        return None
    instead = " in place of --resume_if_any" if flag == "--resume_if_any" else " in place of --resume"
    return (f"{flag} with changed settings is not supported (checkpoint vs now): "
            + ", ".join(f"{k} {_SHORT.repr(a)} vs {_SHORT.repr(b)}" for k, (a, b) in changed.items())
            + f"; give the settings the run started with, or start over with --overwrite{instead}")


def read_fingerprint(ckpt_dir: Path) -> dict | None:
    """The fingerprint ``write_fingerprint`` left, or None (a checkpoint written before it existed, or unreadable: the
    check against the checkpoint's own client state still runs once the engine loads it)."""
    try:
        written = json_data.read(Path(ckpt_dir) / FINGERPRINT)
    except (OSError, ValueError):
        return None
    return written if isinstance(written, dict) else None


def resumed_fingerprint(output_dir: Path, resume: bool) -> dict | None:
    """The fingerprint of the checkpoint a ``--resume`` run continues (None: a fresh run, or none written)."""
    return read_fingerprint(Path(output_dir) / "checkpoints") if resume else None


def tags_newest_first(ckpt_dir: Path) -> list[str]:
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p.name) for p in ckpt_dir.iterdir() if p.is_dir() and (m := TAG.match(p.name))]
    return [name for _, name in sorted(found, reverse=True)]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def check_supported(ds: DsConfig) -> None:
    if ds.optimizer_on_nvme:
        raise ElsaError("--save_interval/--resume with NVMe optimizer offload is not supported: DeepSpeed does not restore "
                        "NVMe-offloaded optimizer state (Adam moments, z, u); use zero3_offload.json (without --nvme_path) for "
                        "resumable runs")
    section = ds.raw.get("checkpoint")
    section = section if isinstance(section, dict) else {}
    if section.get("load_universal"):
        raise ElsaError('--save_interval/--resume with "checkpoint": {"load_universal": true} is not supported: DeepSpeed\'s '
                        "universal loader drops z and u and unpickles its files with weights_only=False; remove it")
    if ds.zero.get("pipeline_loading_checkpoint"):  # a review: its send/recv between ranks comes before the agreement
        raise ElsaError('--save_interval/--resume with "zero_optimization": {"pipeline_loading_checkpoint": true} is not '
                        "supported: its ranks wait on each other inside DeepSpeed's load, where one that refuses a file "
                        "leaves the others waiting for good; remove it")
    if section.get("checkpoint_serialization") is False:
        raise ElsaError('--save_interval/--resume with "checkpoint": {"checkpoint_serialization": false} is not supported: '
                        "elsa_ds scans a checkpoint for code before loading it, which needs torch's zip format; remove it")


class UnsafeCheckpointError(ElsaError):
    """A checkpoint file whose pickle names a class outside the allow-list: loading it could run code, so it is refused."""


def _refusal(path: Path, what: str) -> UnsafeCheckpointError:
    allowed = ", ".join(name.rsplit(".", 1)[-1] for _, name in compat.checkpoint_globals())
    return UnsafeCheckpointError(f"--resume: refusing checkpoint file {path}: it needs {what}, which an elsa_ds checkpoint "
                                 f"never holds (tensors, plain containers, {allowed}), and loading it could run code; it "
                                 "was not written by elsa_ds or was altered: restore the run from a copy you trust")


def _altered(path: Path, problem: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"--resume: refusing checkpoint file {path}: {problem}; it was not written by elsa_ds or "
                                 "was altered: restore the run from a copy you trust")


def _check_zip(path: Path, fh: BinaryIO) -> None:
    """UnsafeCheckpointError for a zip no torch.save writes (``torch_files.zip_problem``), ValueError for one that may
    only be cut short (an unreadable tag: a resume falls back past it); nothing for a whole torch file. ``fh``: the
    file as opened by :func:`_open_checkpoint_file`, which torch then reads, so the file checked is the file read."""
    if (problem := torch_files.zip_problem(fh)) is not None:
        raise _altered(path, problem.text) if problem.altered else ValueError(f"{path}: {problem.text}")
    head = fh.read(len(torch_files.ZIP_MAGIC))
    fh.seek(0)
    if len(head) < len(torch_files.ZIP_MAGIC):
        raise ValueError(f"{path}: cut short ({len(head)} bytes)")
    if head != torch_files.ZIP_MAGIC:  # torch's legacy format: all pickle, no size a check could read before unpickling
        raise _altered(path, "it is not in torch.save's zip format (the legacy format, which torch.save has not written "
                             "since torch 1.6, has no directory to check before unpickling it)")


def checked_root(folder: Path, flag: str = "--resume") -> Path:
    """Where ``folder`` (a resumed run's checkpoints, or its best projection's snapshot folder: trees
    ``check_plain_tree`` walked) really is, taken before its files are read (``torch_files.real_folder``): the
    ``root`` they must then open inside. UnsafeCheckpointError when ``folder`` itself is a link (``flag`` names
    the setting that reads it), ElsaError when it cannot be read."""
    try:
        return torch_files.real_folder(folder)
    except regular_file.NotRegularFile as err:
        raise UnsafeCheckpointError(f"{flag}: refusing {folder}: it is {err.what}, where a folder of this run's own must be; "
                                    "remove it, or restore the run from a copy you trust") from None
    except OSError as err:
        raise ElsaError(f"{flag}: cannot read {folder} ({err.strerror}); restore it or start over with --overwrite in place "
                        f"of {flag}") from None


# each checkpoints folder as check_resume took it in this process: its real place and its (device, inode)
_ROOTS: dict[str, tuple[Path, tuple[int, int]]] = {}


def folder_place(root: Path) -> tuple[Path, tuple[int, int]]:
    """A folder's real place and its (device, inode)."""
    st = os.stat(root)
    return root, (st.st_dev, st.st_ino)


def checked_place(ckpt_dir: Path) -> tuple[Path, tuple[int, int]] | None:
    """:func:`folder_place` of ``ckpt_dir`` as :func:`check_resume` took it in this process (None: not checked here)."""
    return _ROOTS.get(str(ckpt_dir))


def _open_checkpoint_file(path: Path, root: Path | None) -> BinaryIO:
    """``path`` opened once for its check and its read: a file swapped in after a check is never the one read. Not
    through a link (a resumed folder holds none: ``check_plain_tree``), and a FIFO put there is refused, not waited on.
    With ``root`` (:func:`checked_root` of the folder ``path`` lies in), where the file really opened must lie inside
    it: a folder on the way swapped for a link after the checks (which ``O_NOFOLLOW`` does not see) is refused."""
    try:
        fh = regular_file.open_regular(path)
    except regular_file.NotRegularFile as err:
        raise _not_a_file(path, err.what) from None
    if root is not None and (opened := torch_files.opened_path(fh)) is not None and not opened.is_relative_to(root):
        fh.close()
        raise _not_a_file(path, f"a file outside {root} (at {opened}: a folder on its way became a link)")
    return fh


def _not_a_file(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"--resume: refusing checkpoint file {path}: it is {what}, which no checkpoint holds, and "
                                 "it appeared after the checks before loading; restore the run from a copy you trust")


def unsafe_classes(path: Path, root: Path | None = None) -> list[str]:
    """The globals ``path``'s pickle names beyond torch's weights-only set and ``compat.checkpoint_globals``, read from the
    pickle's instructions (nothing is unpickled). Raises UnsafeCheckpointError for instructions the scan cannot follow or
    a zip no torch.save writes (``torch_files.zip_problem``), another exception for a file that is not a whole torch zip.
    ``root``: the folder it must open inside (:func:`_open_checkpoint_file`)."""
    allowed = {name for _, name in compat.checkpoint_globals()}
    with _open_checkpoint_file(Path(path), root) as fh:
        _check_zip(Path(path), fh)  # before the scan, which unpacks the pickle's entry whole
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(fh)
        except pickle.UnpicklingError as err:  # an opcode torch.save (protocol 2) never writes
            raise _refusal(Path(path), f"pickle instructions a checkpoint does not use ({err})") from None
    return sorted(set(found) - allowed)


def _scan(path: Path, root: Path) -> str | None:
    """Why ``path`` is unreadable as a torch file (truncated, not a torch zip), or None; UnsafeCheckpointError when its
    pickle names a class outside the allow-list (scanned, nothing run)."""
    try:
        classes = unsafe_classes(path, root)
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated, missing or not a torch zip: the scan reads, never runs
        return f"{type(err).__name__}: {' '.join(str(err).split())[:120]}"
    if classes:
        raise _refusal(path, ", ".join(classes))
    return None


def check_file(path: Path, what: str, root: Path) -> None:
    """ElsaError unless ``path`` is a torch file whose pickle names only what a checkpoint holds (:func:`_scan`), opened
    inside ``root`` (:func:`checked_root`): for files a resume reads later than the checkpoint itself (``what``)."""
    if (why := _scan(path, root)) is not None:
        raise ElsaError(f"--resume: {what} {path} is unreadable ({why}); {aside.START_OVER}")


def read_checkpoint_file(path: str | Path, map_location: Any = None, *, root: Path | None = None) -> Any:
    """``torch.load`` as data only: tensors, plain containers and ``compat.checkpoint_globals``. A pickle naming anything
    else raises UnsafeCheckpointError; nothing of it runs. ``root``: the folder it must open inside
    (:func:`checked_root`). The loader ``resume_load.load_latest`` gives DeepSpeed, bound to its checkpoints folder's root."""
    opened = _open_checkpoint_file(Path(path), root)
    with torch.serialization.safe_globals([*compat.checkpoint_globals()]), opened as fh:
        _check_zip(Path(path), fh)  # not left to the scan before: torch would unpack it whole
        try:
            loaded = torch.load(fh, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            named = re.search(r"GLOBAL (\S+)", str(err)) or re.search(r"WeightsUnpickler error: ([^\n]+)", str(err))
            raise _refusal(Path(path), named.group(1) if named else "objects torch's weights-only loader refuses") from None
    if (inflated := torch_files.inflated_tensor(loaded)) is not None:  # a copy or a contiguous() would make it whole
        raise _altered(Path(path), inflated)
    return loaded


def resume_order(ckpt_dir: Path) -> list[str]:
    """The tags a ``--resume`` tries, newest first from the one ``latest`` names (a newer, unpublished tag is never tried);
    ElsaError when ``latest`` is unreadable or names no tag on disk."""
    latest_file = ckpt_dir / "latest"
    try:
        with latest_file.open("rb") as fh:  # a tag name: a folder's, at most 255 bytes; a longer file is no `latest`
            raw = fh.read(LATEST_BYTES + 2)  # and DeepSpeed's newline
        latest = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ElsaError(f"--resume: cannot read {latest_file} ({err}); {aside.START_OVER}") from None
    if len(raw) > LATEST_BYTES + 1:
        raise ElsaError(f"--resume: {latest_file} holds more than a tag's name ({LATEST_BYTES} bytes at most); restore "
                        f"the run from a copy you trust or {aside.START_OVER}")
    tags = tags_newest_first(ckpt_dir)
    if latest not in tags:
        raise ElsaError(f"--resume: {latest_file} names {latest[:80]!r}, which is not a checkpoint in {ckpt_dir} (there: "
                        f"{', '.join(tags) or 'none'}); restore that tag or {aside.START_OVER}")
    return tags[tags.index(latest):]


def check_resume(ckpt_dir: Path) -> None:
    """Before any model or engine exists (on every rank; they read the same files): ``latest`` names a tag on disk, some
    tag a resume may load is readable, and no file of those tags names a class outside the allow-list (refused,
    UnsafeCheckpointError). An unreadable newer tag is left to ``resume_load.load_latest``, which falls back past it."""
    unreadable = {}
    tags, root = resume_order(ckpt_dir), checked_root(ckpt_dir)
    _ROOTS[str(ckpt_dir)] = folder_place(root)
    for tag in tags:
        files = sorted((ckpt_dir / tag).glob("*.pt"))  # check_plain_tree has refused links and special files there
        if not files:
            unreadable[tag] = "no checkpoint files"
        for path in files:
            if (why := _scan(path, root)) is not None:
                unreadable.setdefault(tag, f"{path.name}: {why}")
    if len(unreadable) == len(tags):
        raise ElsaError(f"--resume: no checkpoint in {ckpt_dir} is readable ("
                        + "; ".join(f"{tag}: {why}" for tag, why in unreadable.items())
                        + f"); {aside.START_OVER}")
