"""Sparse checkpoints: ``compress`` a pruned model folder, load it back with ``from_pretrained`` (dense or sparse);
``sparsify`` a pruned model already loaded."""
from __future__ import annotations

from elsa_ds.sparse.compress import compress
from elsa_ds.sparse.convert import sparsify
from elsa_ds.sparse.integrity import SparseArgumentError, SparseArgumentTypeError, SparseCheckpointError
from elsa_ds.sparse.linear import SparseLinear
from elsa_ds.sparse.loader import from_pretrained, verify

__all__ = ["compress", "from_pretrained", "sparsify", "verify", "SparseLinear", "SparseCheckpointError", "SparseArgumentError",
           "SparseArgumentTypeError"]
