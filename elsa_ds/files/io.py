"""Small file helpers every job shares: atomic writes (temp name, then rename) and the versions a result records."""
from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

from elsa_ds.errors import ElsaError
from elsa_ds.version import __version__

RECORDED_PACKAGES = ("torch", "deepspeed", "transformers", "bitsandbytes", "lm_eval", "peft")
ATOMIC_ROOM = len(f"..{2**22}.tmp")  # bytes write_atomic's temporary name adds to a file's: Linux's PIDs have up to 7 digits


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write next to ``path`` then rename: a reader never sees half a file, an old file is never half-overwritten."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per process: two writers never share it
    try:
        tmp.unlink(missing_ok=True)  # a link left at that name (a copied folder's) goes; "x" then never writes through one
        with open(tmp, "xb") as fh:
            fh.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException as err:  # Ctrl-C or SIGTERM mid-write too: no temp file stays beside the path
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise ElsaError(f"cannot write {path}: {err.strerror or err}") from None
        raise


def make_folder(folder: Path) -> None:
    """``folder`` and the missing ones above it, or an ElsaError naming the one that could not be made (a full disk, a
    file in the way, no permission: an audit found a traceback where ``elsa-evaluate --output new/r.json`` met one)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ElsaError(f"cannot create the folder {err.filename or folder}: {err.strerror or err}") from None


def write_json(path: Path, payload: Any) -> None:
    write_atomic(path, json.dumps(payload, indent=2) + "\n")


def versions() -> dict[str, str]:
    """elsa_ds and the installed versions of the packages that shape a result (absent ones are left out)."""
    found = {"elsa_ds": __version__}
    for name in RECORDED_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
