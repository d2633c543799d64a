"""Storage of the ADMM states z and u: fp32, or bf16 / fp8 (e4m3) with one scale per layer slice.

Low-precision storage (ELSA-L) quantizes on store and dequantizes to fp32 to compute:

    s = max|v| / v_max,   stored = round_to_dtype(v / s),   v ≈ stored · s

with v_max the largest finite value of the storage dtype (448 for fp8 e4m3). One scale per slice keeps
a layer with small weights from being flushed to zero by a layer with large ones.
"""
from __future__ import annotations

from enum import Enum

import torch


class StateDtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[self.value]

    @property
    def scaled(self) -> bool:
        return self is not StateDtype.fp32


def allocate(numel: int, dtype: StateDtype, n_slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero storage for one flat tensor: (data [numel] in the storage dtype, scales [n_slices] fp32)."""
    return torch.zeros(numel, dtype=dtype.torch_dtype), torch.ones(n_slices, dtype=torch.float32)


def store(data: torch.Tensor, scales: torch.Tensor, j: int, offset: int, values: torch.Tensor) -> None:
    """Write fp32 ``values`` into slice ``j`` (at ``offset``) of ``data``, quantizing when low precision."""
    dest = data.narrow(0, offset, values.numel())
    if data.dtype == torch.float32:
        dest.copy_(values)
        return
    v_max = torch.finfo(data.dtype).max
    peak = float(values.abs().max()) if values.numel() else 0.0
    scale = peak / v_max if peak > 0.0 else 1.0
    scales[j] = scale
    # clamp guards against fp32 rounding pushing v/s one ulp past v_max, which would store inf
    dest.copy_((values / scale).clamp_(-v_max, v_max))


def load(data: torch.Tensor, scales: torch.Tensor, j: int, offset: int, length: int) -> torch.Tensor:
    """Slice ``j`` of ``data`` as fp32 (dequantized)."""
    src = data.narrow(0, offset, length)
    if data.dtype == torch.float32:
        return src
    return src.float() * scales[j]
