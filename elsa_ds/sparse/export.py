"""A job's sparse export: the verified dense export in its staging folder, re-encoded as elsa-sparse in place."""
from __future__ import annotations

import shutil
from pathlib import Path

from elsa_ds.errors import ElsaError, Terminated
from elsa_ds.files.disk_room import OUTPUT_DIR_FIX, DiskFull
from elsa_ds.files.output import PublishFailed, staging_dir
from elsa_ds.files.ownership import lock_path
from elsa_ds.sparse.compress import DEFAULT_MIN_SPARSITY, compress
from elsa_ds.sparse.loader import verify


def sparse_sibling(folder: Path) -> Path:
    """Where :func:`compress_in_place` builds ``folder``'s elsa-sparse checkpoint."""
    return folder.with_name(f"{folder.name}.sparse")


def sparse_paths(folder: Path) -> list[Path]:
    """What :func:`compress_in_place` may leave beside ``folder`` when it is stopped part-way (a job's exit path and its
    watchdog remove them): the checkpoint being built and checked, and compress's own staging folder and lock."""
    sparse = sparse_sibling(folder)
    return [sparse, staging_dir(sparse), lock_path(sparse)]


def compress_in_place(folder: Path, min_sparsity: float = DEFAULT_MIN_SPARSITY) -> dict:
    """Replace the dense model in ``folder`` (a job's unpublished staging folder) by its elsa-sparse checkpoint.

    The checkpoint is built and checked beside ``folder`` first; the dense files are removed only once it is complete.
    Returns what ``compress`` stored.
    """
    sparse = sparse_sibling(folder)
    if sparse.exists():
        shutil.rmtree(sparse)
    try:
        stored = compress(folder, sparse, min_sparsity=min_sparsity)
    except PublishFailed as err:  # compress's own staging, inside this job's: not what the job's error may point a user to
        raise ElsaError(f"the elsa-sparse export could not be built: {str(err).partition(';')[0]}") from None
    except DiskFull as full:  # a job's export: the user chooses another --output_dir, not another compress output
        raise full.measured_again(fix=OUTPUT_DIR_FIX) from None
    except (KeyboardInterrupt, Terminated) as stop:  # held through compress's own publication: not the job's output
        stop.published = None  # type: ignore[union-attr]
        raise stop from None  # nor is a compress staging folder its context may name (owner.kept_output)
    verify(sparse)
    shutil.rmtree(folder)
    sparse.rename(folder)
    return stored
