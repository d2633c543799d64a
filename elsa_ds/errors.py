"""The one exception type users see."""
from __future__ import annotations


class ElsaError(Exception):
    """A problem with the user's input or environment: the message says what is wrong and how to fix it.

    Entry points print it as one line on stderr and exit with code 2.
    """


def require(module: str, extra: str, feature: str):
    """Import an optional dependency, or raise ElsaError naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ElsaError(f"{feature} needs the optional package {module.split('.')[0]}: pip install 'elsa_ds[{extra}]'") from None
