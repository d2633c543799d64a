"""A run's folder read again by ``--resume`` may come from elsewhere (copied, unpacked, handed over): what the resume reads
and writes in it (the checkpoints, the monitor's logs, the side files beside the output) is read and written only inside
it. So none of it may be a symbolic link (a link sends the resume's reads, DeepSpeed's writes and the old tags' removal
to wherever it points) or anything but a folder or a regular file (a FIFO at ``latest`` would hang the job while it
holds the output's lock). Checked with ``lstat``, before anything in it is opened. Stdlib only."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from elsa_ds.errors import ElsaError


def check_plain_tree(path: Path, what: str) -> None:
    """ElsaError when ``path`` (if there) or anything below it is a symbolic link or neither a folder nor a regular file;
    ``what`` names it for the user (e.g. "the checkpoints")."""
    if not (path.exists() or path.is_symlink()):
        return
    if _check_entry(path, what):
        for root, folders, files in os.walk(path, followlinks=False, onerror=_unreadable):
            for name in [*folders, *files]:
                _check_entry(Path(root) / name, what)


def _check_entry(path: Path, what: str) -> bool:
    """Refuse a link or a special file at ``path``; whether it is a folder."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise ElsaError(f"--resume: {path} in {what} is a symbolic link (to {os.readlink(path)}): a resumed run reads and "
                        "writes only inside its own folder; put the files themselves there (cp -rL) or start without --resume")
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise ElsaError(f"--resume: {path} in {what} is not a regular file (a FIFO, socket or device): replace it with "
                        "the file a run wrote or start without --resume")
    return stat.S_ISDIR(mode)


def _unreadable(err: OSError) -> None:
    raise ElsaError(f"--resume: cannot read {err.filename} ({err.strerror}); fix its permissions or start without --resume")
