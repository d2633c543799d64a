"""One-shot pruning (magnitude, Wanda, SparseGPT), layer by layer.

``elsa_ds.oneshot(...)`` is also the Python API's one-shot entry point (``elsa_ds/api.py``). Once this package is
imported (any job imports it), the attribute ``elsa_ds.oneshot`` is the package, not the function; calling the package
therefore calls the function, so ``elsa_ds.oneshot(model, "sparsegpt", ...)`` works whatever was imported first.
"""
from __future__ import annotations

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from elsa_ds.api import oneshot

        return oneshot(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
