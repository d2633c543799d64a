"""DeepSpeed's NVMe swap files, owned by one job at a time and removed when it ends.

DeepSpeed writes each rank's swapped parameters and optimizer states under ``<nvme_path>/zero_stage_3`` (its layout:
``compat.rank_swap_folders``). It empties a rank's parameter folder when its next engine starts, reuses the optimizer
folder as it finds it, and removes neither at the end: a finished 27B run leaves hundreds of GB there, and a second job
started on the same host with the same ``nvme_path`` deletes the first one's parameter files (the first then reads
zeros back: DeepSpeed's asynchronous reads and writes never check a result). So the job's first rank on each host holds
the swap folder's lock (a second job there is refused in one line); each rank empties its optimizer folder before its
engine is built (stale files of an earlier run are not this run's) and, when the job ends however it ends, removes the
folders its engine used, before the lock goes (``ELSA_DS_KEEP_SWAP_FILES=1`` keeps them for inspection).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from elsa_ds.files.ownership import owned
from elsa_ds.log import get_logger
from elsa_ds.zero import compat
from elsa_ds.zero.ds_config import DsConfig

log = get_logger(__name__)
KEEP_ENV = "ELSA_DS_KEEP_SWAP_FILES"  # =1: leave them for inspection (the next engine on that path clears them)
_USED: list[Path] = []  # the swap folders of the engine this process built (``record``), removed at the job's end


@contextlib.contextmanager
def swap_files_owned(ds: DsConfig) -> Iterator[None]:
    """Inside: this host's swap folders under the config's nvme paths are this job's (its first rank on the host holds
    their lock); on the way out, before the lock goes, each rank removes the folders its engine used (none when the job
    ended before its engine was built: a job refused the lock never touches another's files)."""
    paths = sorted(ds.nvme_paths)
    if not paths:
        yield
        return
    first_on_host = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"
    _USED.clear()
    with contextlib.ExitStack() as locks:
        for path in paths:  # one lock per host: ranks of one job on other hosts of a shared file system use other folders
            locks.enter_context(owned(compat.swap_root(path).with_name(f"zero_stage_3.{socket.gethostname()}"),
                                      "--nvme_path", take=first_on_host))
        try:
            yield
        finally:
            if os.environ.get(KEEP_ENV) != "1":
                for folder in _USED:
                    _remove(folder)
            _USED.clear()


def clear_stale(ds: DsConfig, rank: int | str) -> None:
    """Before the engine is built (every rank has joined the process group, so the job holds the lock): empty this rank's
    optimizer swap folders, which DeepSpeed reuses as it finds them (an earlier run's files are not this run's)."""
    for path in sorted(ds.nvme_paths):
        for folder in compat.rank_swap_folders(path, rank):
            if folder.parent.name == "optimizer" and folder.is_dir() and not folder.is_symlink():
                _remove(folder)


def record(engine) -> None:
    """The engine's swap folders, removed when the job ends (``swap_files_owned``)."""
    _USED.extend(f for f in compat.swap_folders(engine) if f not in _USED)


def _remove(folder: Path) -> None:
    """Remove a rank's swap folder, then its parents left empty; a failure is a warning naming it."""
    try:
        if folder.is_symlink():
            return
        shutil.rmtree(folder)
    except FileNotFoundError:
        return
    except OSError as err:
        log.warning(f"the NVMe swap files in {folder} could not be removed ({err.strerror or err}); delete them yourself")
        return
    for parent in (folder.parent, folder.parent.parent):
        with contextlib.suppress(OSError):
            parent.rmdir()  # only when empty: another rank's or host's folders stay
