"""The one registry of method names: ELSA, the one-shot baselines, the dense control, and how a mask is retrained.

Everything that names a method (the ``--method``, ``--init_mask`` and ``--finetune`` choices, the one-shot
dispatch, the benchmarks) reads it from here.
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


class Finetune(str, Enum):
    """Training after a one-shot mask (or of the dense model), the mask held fixed (``elsa_ds/finetune/``)."""

    full = "full"    # every weight trains, pruned entries stay exactly zero (masked gradients and weights)
    lora = "lora"    # LoRA adapters on the pruned layers, merged at the end with the mask re-applied


ELSA = "elsa"
DENSE = "dense"  # no pruning: the control every table needs ("dense fine-tuned on the same tokens")


class Method(str, Enum):
    """elsa, a one-shot baseline, or dense (no pruning; with --finetune)."""

    # ``--method``: ELSA (ADMM on the model's loss under ZeRO-3), a one-shot baseline, or the dense control.
    # Spelled out (not built from OneShot) so a type checker knows its members; the check below keeps the two in step.
    elsa = ELSA
    magnitude = "magnitude"
    wanda = "wanda"
    sparsegpt = "sparsegpt"
    dense = DENSE


if [m.value for m in Method] != [ELSA, *(m.value for m in OneShot), DENSE]:
    raise AssertionError("Method must list elsa, every OneShot method in its order, then dense")


def oneshot_names() -> tuple[str, ...]:
    return tuple(m.value for m in OneShot)
