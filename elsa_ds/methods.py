"""The one registry of method names: ELSA and the one-shot baselines.

Everything that names a method (the ``--method`` and ``--init_mask`` choices, the one-shot dispatch, the
benchmarks) reads it from here.
"""
from __future__ import annotations

from enum import Enum


class OneShot(str, Enum):
    """One-shot pruning baselines, run decoder layer by decoder layer (``elsa_ds/oneshot/``)."""

    magnitude = "magnitude"    # |W| per layer
    wanda = "wanda"            # |W|·‖X‖₂ per output row (Sun et al., 2023)
    sparsegpt = "sparsegpt"    # OBS reconstruction (Frantar & Alistarh, 2023)

    @property
    def calibrated(self) -> bool:
        """Whether the method needs calibration activations."""
        return self is not OneShot.magnitude


ELSA = "elsa"
# ``--method``: ELSA (ADMM on the model's loss under ZeRO-3) or one of the one-shot baselines
Method = Enum("Method", {ELSA: ELSA, **{m.value: m.value for m in OneShot}}, type=str)
Method.__doc__ = "elsa, or a one-shot baseline."


def oneshot_names() -> tuple[str, ...]:
    return tuple(m.value for m in OneShot)
