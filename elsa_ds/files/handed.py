"""A run's folder read again by ``--resume`` may come from elsewhere (copied, unpacked, handed over): what the resume reads
and writes in it (the checkpoints, the monitor's logs, the side files beside the output) is read and written only inside
it. So none of it may be a symbolic link (a link sends the resume's reads, DeepSpeed's writes and the old tags' removal
to wherever it points) or anything but a folder or a regular file (a FIFO at ``latest`` would hang the job while it
holds the output's lock). Checked with ``lstat``, before anything in it is opened. Stdlib only."""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from elsa_ds.errors import ElsaError
from elsa_ds.files.aside import START_OVER


def check_plain_tree(path: Path, what: str) -> None:
    """ElsaError when ``path`` (if there) or anything below it is a symbolic link or neither a folder nor a regular file;
    ``what`` names it for the user (e.g. "the checkpoints")."""
    if not (path.exists() or path.is_symlink()):
        return
    if _check_entry(path, what):
        for root, folders, files in walk(path, what):
            for name in [*folders, *files]:
                _check_entry(Path(root) / name, what)


MAX_DEPTH = 64  # folders below a handed-over folder: a run writes 3 at most (checkpoints/global_stepN/offloaded_tensors/..)


def walk(path: Path, what: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(path)`` top-down, not following links, without recursion (Python 3.11's recurses: a walk's 1,500 nested
    folders were a RecursionError) and refusing a tree deeper than ``MAX_DEPTH`` (ElsaError naming ``what``)."""
    todo = [(str(path), 0)]
    while todo:
        root, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ElsaError(f"--resume: {what} nest folders more than {MAX_DEPTH} deep ({root[:200]}...), which no run "
                            f"writes; restore the run from a copy you trust or {START_OVER}")
        try:
            entries = list(os.scandir(root))
        except OSError as err:
            _unreadable(err)
        folders = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        yield root, folders, [e.name for e in entries if not e.is_dir(follow_symlinks=False)]
        todo.extend((os.path.join(root, name), depth + 1) for name in reversed(folders))


def _check_entry(path: Path, what: str) -> bool:
    """Refuse a link or a special file at ``path``; whether it is a folder."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise ElsaError(f"--resume: {path} in {what} is a symbolic link (to {os.readlink(path)}): a resumed run reads and "
                        f"writes only inside its own folder; put the files themselves there (cp -rL) or {START_OVER}")
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise ElsaError(f"--resume: {path} in {what} is not a regular file (a FIFO, socket or device): replace it with "
                        f"the file a run wrote or {START_OVER}")
    return stat.S_ISDIR(mode)


def _unreadable(err: OSError) -> None:
    raise ElsaError(f"--resume: cannot read {err.filename} ({err.strerror}); fix its permissions or {START_OVER}")


def own_copies(path: Path) -> None:
    """Each regular file below ``path`` (a resumed run's folder, checked by :func:`check_plain_tree`) that has other
    names (hard links, as ``cp -al`` makes) becomes a copy of its own, so that what the run appends to it (DeepSpeed's
    CSV monitor opens its files for appending) stays in this folder, the other names as they were."""
    if not path.is_dir() or path.is_symlink():
        return
    for root, _, files in walk(path, "the resumed folder"):
        for name in files:
            file = Path(root) / name
            st = os.lstat(file)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
                continue
            own = file.with_name(f".{name}.{os.getpid()}.own")
            try:
                own.unlink(missing_ok=True)  # a link left at the name is removed, never written through
                shutil.copy2(file, own)
                os.replace(own, file)
            except OSError as err:
                with contextlib.suppress(OSError):
                    own.unlink(missing_ok=True)
                raise ElsaError(f"--resume: {file} has {st.st_nlink - 1} other name(s) (a hard link) and the run appends to "
                                f"it; a copy of its own could not be made ({err.strerror or err}): copy it yourself "
                                f"(cp --remove-destination) or {START_OVER}") from None
