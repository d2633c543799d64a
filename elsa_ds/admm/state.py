"""Storage of the ADMM states z and u: fp32, bf16, or fp8 (e4m3) with one scale per layer.

Low-precision storage (ELSA-L) rounds on store and widens to fp32 to compute:

    bf16:  stored = bf16(v)                   v ≈ stored · s      (bf16 has fp32's exponent range: no scale)
    fp8:   stored = fp8(clamp(v / s, ±448))   v ≈ stored · s,     s = max(peak / 448, 2^-126)

fp8's 448 is its largest finite value; ``peak`` is the layer's largest |v| over *all* ranks (one max
all-reduce per projection for every layer of a sub-group), so the scale, and hence every stored code,
does not depend on how many ranks share the layer. A store resets a bf16 slice's s to 1; s only moves
off 1 through the dual rescaling u ← u·λ_old/λ_new, which multiplies the scale instead of rounding
every entry again.
"""
from __future__ import annotations

from enum import Enum

import torch

Z, U, Z_SCALE, U_SCALE = "admm_z", "admm_u", "admm_z_scale", "admm_u_scale"  # keys of a flat's optimizer state
LAM = "admm_lmda"  # per-slice λ of the adaptive schedule (fp32, one per slice of the flat)
FP8_MAX = 448.0
# the scale floor keeps s a normal fp32 number: an all-zero layer (peak 0) gets a finite, non-zero scale
SCALE_FLOOR = torch.finfo(torch.float32).tiny


class StateDtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[self.value]

    @property
    def scaled(self) -> bool:
        """True for fp8: its range needs a per-layer scale taken from the values."""
        return self is StateDtype.fp8


def allocate(numel: int, dtype: StateDtype, n_slices: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero storage for one flat tensor on its device: (data [numel] in the storage dtype, scales [n_slices] fp32)."""
    return torch.zeros(numel, dtype=dtype.torch_dtype, device=device), torch.ones(n_slices, dtype=torch.float32, device=device)


def layer_scales(peaks: torch.Tensor, dtype: StateDtype) -> torch.Tensor:
    """Per-layer scales s (fp32) for storing values whose largest magnitude per layer is ``peaks``.

    fp8: s = max(peak / 448, 2^-126), computed in fp32 so that kernels and this reference divide by
    the same number; bf16 and fp32: s = 1 (stored plainly).
    """
    peaks = peaks.to(torch.float32)
    if not dtype.scaled:
        return torch.ones_like(peaks)
    return (peaks / FP8_MAX).clamp_min_(SCALE_FLOOR)


def store(data: torch.Tensor, scales: torch.Tensor, j: int, offset: int, values: torch.Tensor,
          scale: torch.Tensor | float | None = None) -> None:
    """Write fp32 ``values`` into slice ``j`` (at ``offset``) of ``data``.

    fp8 uses the layer's ``scale`` (from ``layer_scales``); without one, the slice's own peak (right when
    the slice is the whole layer, as on a single rank).
    """
    dest = data.narrow(0, offset, values.numel())
    if data.dtype == torch.float8_e4m3fn:
        if scale is None:
            peak = values.abs().max() if values.numel() else torch.zeros(())
            scale = layer_scales(peak.view(1), StateDtype.fp8)[0]
        scales[j] = scale
        # clamp guards against fp32 rounding pushing v/s one ulp past 448 (saturation, never inf or NaN)
        dest.copy_((values / scales[j]).clamp_(-FP8_MAX, FP8_MAX))
        return
    if data.dtype != torch.float32:
        scales[j] = 1.0
    dest.copy_(values)


def load(data: torch.Tensor, scales: torch.Tensor, j: int, offset: int, length: int) -> torch.Tensor:
    """Slice ``j`` of ``data`` as fp32 (dequantized)."""
    src = data.narrow(0, offset, length)
    if data.dtype == torch.float32:
        return src
    return src.float() * scales[j]
