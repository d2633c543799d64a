"""DeepSpeed's NVMe swap files, owned by one job at a time and removed when it ends.

DeepSpeed writes each rank's swapped parameters and optimizer states under ``<nvme_path>/zero_stage_3`` (its layout:
``compat.rank_swap_folders``), deletes that rank's folder when the next engine starts and never at the end: a finished
27B run leaves hundreds of GB there, and a second job started on the same host with the same ``nvme_path`` deletes the
first one's files under it (the first one then reads zeros back; DeepSpeed's asynchronous reads and writes never check
a result). So the job's first rank on each host holds the swap folder's lock (a second job there is refused in one
line), and every rank removes the swap folders it made when the job ends, however it ends (``ELSA_DS_KEEP_SWAP_FILES=1``
keeps them for inspection).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from elsa_ds.files.ownership import owned
from elsa_ds.log import get_logger
from elsa_ds.zero import compat
from elsa_ds.zero.ds_config import DsConfig

log = get_logger(__name__)
KEEP_ENV = "ELSA_DS_KEEP_SWAP_FILES"  # =1: leave them for inspection (DeepSpeed deletes a rank's at its next start)


@contextlib.contextmanager
def swap_files_owned(ds: DsConfig) -> Iterator[None]:
    """Inside: this host's swap folders under each of the config's nvme paths are this job's (the local rank 0 holds their
    lock); on the way out each rank removes the ones it made (created after the block began: DeepSpeed made them anew)."""
    paths = sorted(ds.nvme_paths)
    if not paths:
        yield
        return
    started, rank = time.time(), os.environ.get("RANK", "0")
    first_on_host = os.environ.get("LOCAL_RANK", "0") == "0"
    try:
        with contextlib.ExitStack() as locks:
            for path in paths:  # one lock per host: ranks of one job on other hosts of a shared file system use other folders
                locks.enter_context(owned(compat.swap_root(path).with_name(f"zero_stage_3.{socket.gethostname()}"),
                                          "--nvme_path", take=first_on_host))
            yield
    finally:
        if os.environ.get(KEEP_ENV) != "1":
            for path in paths:
                for folder in compat.rank_swap_folders(path, rank):
                    _remove_if_made_since(folder, started)


def _remove_if_made_since(folder: Path, started: float) -> None:
    """Remove ``folder`` (a rank's swap folder) when it was made after ``started``, then its parents left empty."""
    try:
        if folder.is_symlink() or folder.lstat().st_ctime < started - 1:
            return
        shutil.rmtree(folder)
    except OSError as err:
        log.warning(f"the NVMe swap files in {folder} could not be removed ({err.strerror or err}); delete them yourself")
        return
    for parent in (folder.parent, folder.parent.parent):
        with contextlib.suppress(OSError):
            parent.rmdir()  # only when empty: another rank's or host's folders stay
