"""elsa_ds: ELSA (ADMM with objective-aware projection) pruning of LLMs under DeepSpeed ZeRO-3.

    import elsa_ds
    elsa_ds.prune("google/gemma-2-2b", "c4", output_dir="out/g2-70", sparsity=0.7)

``prune`` and ``oneshot`` are imported on first use, so ``import elsa_ds`` stays light.
"""
from __future__ import annotations

import types
from typing import Any

from elsa_ds import oneshot as _oneshot_package
from elsa_ds.errors import ElsaError
from elsa_ds.version import __version__

__all__ = ["ElsaConfig", "ElsaError", "__version__", "oneshot", "prune"]


class _CallablePackage(types.ModuleType):
    """``elsa_ds.oneshot`` names both the one-shot subpackage and the API function; whichever Python binds (importing
    the subpackage rebinds the attribute), calling it runs the API function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from elsa_ds.api import oneshot

        return oneshot(*args, **kwargs)

    @property
    def __signature__(self) -> Any:
        """The API function's parameters for ``inspect.signature`` and a notebook's hints (an audit: ``(*args, **kwargs)``)."""
        import inspect

        from elsa_ds.api import oneshot

        return inspect.signature(oneshot)


_oneshot_package.__class__ = _CallablePackage


def __getattr__(name: str) -> Any:
    if name == "prune":
        from elsa_ds import api

        return api.prune
    if name == "ElsaConfig":
        from elsa_ds.settings.config import ElsaConfig

        return ElsaConfig
    raise AttributeError(f"module 'elsa_ds' has no attribute {name!r}")
