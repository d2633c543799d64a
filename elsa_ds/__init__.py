"""elsa_ds: ELSA (ADMM with objective-aware projection) pruning of LLMs under DeepSpeed ZeRO-3.

    import elsa_ds
    elsa_ds.prune("google/gemma-2-2b", "c4", output_dir="out/g2-70", sparsity=0.7)

``prune`` and ``oneshot`` are imported on first use, so ``import elsa_ds`` stays light.
"""
from __future__ import annotations

from typing import Any

from elsa_ds.errors import ElsaError
from elsa_ds.version import __version__

__all__ = ["ElsaConfig", "ElsaError", "__version__", "oneshot", "prune"]


def __getattr__(name: str) -> Any:
    if name in ("prune", "oneshot"):
        from elsa_ds import api

        return getattr(api, name)
    if name == "ElsaConfig":
        from elsa_ds.config import ElsaConfig

        return ElsaConfig
    raise AttributeError(f"module 'elsa_ds' has no attribute {name!r}")
