"""A job's sparse export: the verified dense export in its staging folder, re-encoded as elsa-sparse in place."""
from __future__ import annotations

import shutil
from pathlib import Path

from elsa_ds.sparse.compress import DEFAULT_MIN_SPARSITY, compress
from elsa_ds.sparse.loader import verify


def compress_in_place(folder: Path, min_sparsity: float = DEFAULT_MIN_SPARSITY) -> dict:
    """Replace the dense model in ``folder`` (a job's unpublished staging folder) by its elsa-sparse checkpoint.

    The checkpoint is built and checked beside ``folder`` first; the dense files are removed only once it is complete.
    Returns what ``compress`` stored.
    """
    sparse = folder.with_name(f"{folder.name}.sparse")
    if sparse.exists():
        shutil.rmtree(sparse)
    stored = compress(folder, sparse, min_sparsity=min_sparsity)
    verify(sparse)
    shutil.rmtree(folder)
    sparse.rename(folder)
    return stored
