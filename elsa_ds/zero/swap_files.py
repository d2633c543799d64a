"""DeepSpeed's NVMe swap files, owned by one job at a time and removed when it ends.

DeepSpeed writes each rank's swapped parameters and optimizer states under ``<nvme_path>/zero_stage_3`` (its layout:
``compat.rank_swap_folders``). It empties a rank's parameter folder when its next engine starts (at model load,
before any collective), reuses the optimizer folder as it finds it, and removes neither at the end: a finished 27B run
leaves hundreds of GB there, and a second job started with the same ``nvme_path`` and rank numbers deletes the first
one's files (the first then reads zeros back: DeepSpeed's asynchronous reads and writes never check a result). So each
rank holds the lock of its own swap folders for the whole job (a second job is refused in one line before it loads
anything), empties them when it takes it (an earlier run's files are not this run's) and removes them when the job
ends, however it ends, before the lock goes (``ELSA_DS_KEEP_SWAP_FILES=1`` keeps them for inspection).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from elsa_ds import launch_env
from elsa_ds.errors import ElsaError
from elsa_ds.files.output import remove_if_empty
from elsa_ds.files.ownership import lock_path, owned
from elsa_ds.log import get_logger
from elsa_ds.zero import compat
from elsa_ds.zero.ds_config import DsConfig

log = get_logger(__name__)
KEEP_ENV = "ELSA_DS_KEEP_SWAP_FILES"  # =1: leave them for inspection (the next job on that path removes them)


@contextlib.contextmanager
def swap_files_owned(ds: DsConfig) -> Iterator[None]:
    """Inside: this rank's swap folders under each of the config's nvme paths are this job's (their lock held, any
    earlier run's files gone); on the way out, before the lock goes, they are removed."""
    paths = sorted(ds.nvme_paths)
    if not paths:
        yield
        return
    rank = str(launch_env.rank())
    with contextlib.ExitStack() as locks:
        for path in paths:  # per rank: one job's ranks on other hosts of a shared file system use other folders
            lock = lock_path(compat.swap_root(path).with_name(f"zero_stage_3.rank{rank}"))
            locks.enter_context(owned(Path(path), "--nvme_path", lock=lock))  # named as given (an audit: not by the lock)
            check_no_links(path, rank)
        _remove_rank_folders(paths, rank)
        try:
            yield
        finally:
            if os.environ.get(KEEP_ENV, "").strip() != "1":
                _remove_rank_folders(paths, rank)


def check_no_links(path: str, rank: str) -> None:
    """ElsaError when a symbolic link stands where this rank's swap files go under ``path`` (``zero_stage_3``, its
    ``optimizer`` and ``{dtype}params`` folders, their ``rank{R}``): DeepSpeed would write its swap files through it
    and the job's cleanup would remove what is there."""
    for folder in [compat.swap_root(path), *compat.swap_kinds(path), *compat.rank_swap_folders(path, rank)]:
        if folder.is_symlink():
            raise ElsaError(f"--nvme_path {path}: {folder} is a symbolic link (to {os.readlink(folder)}); DeepSpeed would "
                            "write its swap files through it and the job would remove them there at its end: remove the "
                            "link or choose another nvme_path")


def _remove_rank_folders(paths: list[str], rank: str) -> None:
    """Remove this rank's swap folders under ``paths``, then their parents left empty; a failure is a warning."""
    for path in paths:
        for folder in compat.rank_swap_folders(path, rank):
            try:
                if folder.is_symlink() or not folder.is_dir():
                    continue
                shutil.rmtree(folder)
            except OSError as err:
                log.warning(f"the NVMe swap files in {folder} could not be removed ({err.strerror or err}); delete them yourself")
                continue
            remove_if_empty([folder.parent, folder.parent.parent])  # other ranks' folders stay
