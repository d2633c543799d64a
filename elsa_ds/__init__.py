"""elsa_ds: ELSA (ADMM with objective-aware projection) pruning of LLMs under DeepSpeed ZeRO-3."""
from __future__ import annotations

from elsa_ds.errors import ElsaError

__all__ = ["ElsaError"]
__version__ = "0.1.0"
