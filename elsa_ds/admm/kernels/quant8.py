"""The 8-bit code formats of Adam's moments, the Python twin of csrc/quant8.h: maps, encoders, (de)quantization.

A moment tensor is stored as uint8 codes, one per entry, into a 256-entry fp32 map, with one fp32 absmax per block of
``BLOCK`` = 256 entries:  m ≈ qmap[code] · absmax[block]  (bitsandbytes' blockwise layout). Two formats share it:

``bitsandbytes``  its dynamic map (``dynamic_map``) and its CPU quantizer: a 65536-bin grid over [−1, 1], each bin
                  mapped to the code whose midpoints bracket it (``quantize_lut``; not the exact nearest code: values
                  below ~1.5e-5 of a block's absmax collapse).
``minifloat``     elsa_ds's own: a 4-bit octave and a 3-bit (m, with a sign bit) or 4-bit (v) mantissa relative to the
                  block's absmax, 2^-15 … 1 (``minifloat_map``); a value is encoded arithmetically to its nearest code
                  (``minifloat_encode``: round the fp32 bit pattern, no table). Rounding error ≤ 6.25 % (m) and
                  ≤ 3.2 % (v) of the value from 2^-14 to 1 of the absmax, where the dynamic map is finer near the
                  block's absmax (0.7 %) and coarser below a tenth of it (its step doubles every decade).
                  tests/admm/test_adam8bit_formats.py holds both formats against fp32 Adam.

The map is what marks a state's format (``map_format``, ``state_format``), so a checkpoint carries it. This module
is a leaf: the 8-bit Adam (``admm/adam8bit.py``), the fused x-step (``xstep.py``) and the readers of the second
moment import it; it imports nothing of theirs.
"""
from __future__ import annotations

import math
import struct
import weakref

import torch

BLOCK = 256        # bitsandbytes' block size for optimizer states (fixed in 0.50: `blocksize = 256`)
LUT_BINS = 65536   # bins of bitsandbytes' CPU quantization grid


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic 8-bit map (``create_dynamic_map``, 7 exponent bits): 256 sorted fp32 values.

    Decade i = 0..6 covers 10^(i−6)·[0.1, 1] with 2^i (signed, ± each) or 2^(i+1) (unsigned) codes at the
    midpoints of a fp32 linspace; plus 0 and 1.
    """
    values = [0.0, 1.0]
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float32)
        decade = (10 ** (i - 6)) * ((edges[:-1] + edges[1:]) / 2.0)
        values += decade.tolist() + ((-decade).tolist() if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float32)


BITSANDBYTES, MINIFLOAT = "bitsandbytes", "minifloat"
FORMATS = (BITSANDBYTES, MINIFLOAT)
MINIFLOAT_MANTISSA = {True: 3, False: 4}  # mantissa bits: m (signed: a sign bit too), v (unsigned)
MINIFLOAT_MIN_OCTAVE = -15  # the smallest nonzero code is 2^-15 · (1 + 2^-M) of the block's absmax (quant8.h: 127 − 15 = 112)


def minifloat_map(signed: bool) -> torch.Tensor:
    """The minifloat codes' values, indexed by code (not sorted): magnitude c → 0 (c = 0) or
    2^((c >> M) − 15) · (1 + (c mod 2^M) / 2^M); signed codes carry the sign in bit 7. 1.0 is the code
    15·2^M; the codes above it (values in (1, 2)) are never written, since values are ≤ the block's absmax."""
    mbits = MINIFLOAT_MANTISSA[signed]
    codes = torch.arange(256, dtype=torch.int64)
    mag = codes & 0x7F if signed else codes
    octave, frac = mag >> mbits, (mag & ((1 << mbits) - 1)).double()
    values = torch.where(mag == 0, 0.0, torch.ldexp(1.0 + frac / (1 << mbits), octave + MINIFLOAT_MIN_OCTAVE))
    if signed:
        values = torch.where(codes >= 0x80, -values, values)
    return values.float()  # every value is exact in fp32


def minifloat_encode(normed: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes of ``normed`` (values / the block's absmax, so |normed| ≤ 1 up to rounding): the nearest code,
    ties away from zero, by rounding fp32 bits to M mantissa bits. Below the smallest code, a signed value goes to
    the nearer of 0 and that code, an unsigned positive one to that code (v stays > 0). NaN → 0.

    The kernel (quant8.h: MiniFloat8::quantize) does the same integer arithmetic; tests also hold this to the
    definition, the nearest entry of ``minifloat_map``."""
    mbits = MINIFLOAT_MANTISSA[signed]
    shift = 23 - mbits
    offset = (127 + MINIFLOAT_MIN_OCTAVE) << mbits                       # the fp32 exponent bias, re-biased
    a = normed.float().abs()
    smallest = math.ldexp(1.0 + 2.0**-mbits, MINIFLOAT_MIN_OCTAVE)
    keep = a >= 0.5 * smallest if signed else a > 0                      # false for NaN
    bits = a.clamp(max=1.0).view(torch.int32)
    code = (((bits + (1 << (shift - 1))) >> shift) - offset).clamp(min=1)
    if signed:
        code = code | (normed.float() < 0).int() << 7
    return torch.where(keep, code, 0).to(torch.uint8)


def map_format(qmap: torch.Tensor) -> tuple[str, bool]:
    """(format, signed) of a 256-entry map: one of the two minifloat maps, else bitsandbytes' (any other map).

    Remembered per map tensor (the maps are shared by every parameter and never written in place; a loaded
    checkpoint brings new tensors), so a step costs no device sync after the first."""
    known = _FORMAT_OF.get(id(qmap))
    if known is None:
        known = _detect(qmap)
        _FORMAT_OF[id(qmap)] = known
        weakref.finalize(qmap, _FORMAT_OF.pop, id(qmap), None)  # a freed map's id may be reused
    return known


def _detect(qmap: torch.Tensor) -> tuple[str, bool]:
    host = qmap.detach().float().cpu()
    for signed in (True, False):
        if torch.equal(host, _minifloat_maps()[signed]):
            return MINIFLOAT, signed
    return BITSANDBYTES, bool(host.min() < 0)


def state_format(state: dict) -> str:
    """The code format of an 8-bit Adam state (``qmap1`` signed, ``qmap2`` unsigned, the same format)."""
    f1, f2 = map_format(state["qmap1"]), map_format(state["qmap2"])
    if f1[0] != f2[0] or (f1[0] == MINIFLOAT and (not f1[1] or f2[1])):
        raise ValueError(f"8-bit Adam state with mixed maps: qmap1 is {f1}, qmap2 is {f2}")
    return f1[0]


_MAPS: dict[bool, torch.Tensor] = {}
_FORMAT_OF: dict[int, tuple[str, bool]] = {}  # id of a live map tensor -> map_format


def _minifloat_maps() -> dict[bool, torch.Tensor]:
    if not _MAPS:
        _MAPS.update({s: minifloat_map(s) for s in (True, False)})
    return _MAPS


def dequantize_blockwise(codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """qmap[codes] · absmax[block] in fp32, blocks of BLOCK entries (the last one may be short)."""
    n = codes.numel()
    if absmax.numel() != -(-n // BLOCK):
        raise ValueError(f"{absmax.numel()} absmax values for {n} entries: expected one per block of {BLOCK}")
    values = qmap.float()[codes.view(-1).long()]
    return (values.view(-1) * absmax.float().repeat_interleave(BLOCK)[:n]).view(codes.shape)


def quantize_lut(qmap: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU quantizer table: grid point i → number of qmap midpoints below −1 + 2i/65535."""
    midpoints = 0.5 * (qmap[:-1] + qmap[1:])
    grid = -1.0 + (2.0 * torch.arange(LUT_BINS, dtype=torch.float32)) / float(LUT_BINS - 1)
    return torch.searchsorted(midpoints.contiguous(), grid).to(torch.uint8)


def quantize_blockwise_(values: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor) -> None:
    """Write the codes and per-block absmax of fp32 ``values`` into ``codes`` and ``absmax`` (in place).

    The quantizer follows the map: minifloat's arithmetic nearest code, or bitsandbytes' CPU grid table."""
    n = values.numel()
    blocks = -(-n // BLOCK)
    padded = torch.nn.functional.pad(values.reshape(-1).float(), (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    peak = padded.abs().amax(1)
    normed = padded * (1.0 / peak).unsqueeze(1)
    fmt, signed = map_format(qmap)
    if fmt == MINIFLOAT:
        out = minifloat_encode(normed, signed)
    else:
        index = ((normed.clamp(-1.0, 1.0) + 1.0) * 0.5 * float(LUT_BINS - 1) + 0.5).to(torch.int64)
        index = torch.where(torch.isnan(normed), 0, index)
        out = quantize_lut(qmap)[index]
    out[peak == 0] = 0
    codes.view(-1).copy_(out.view(-1)[:n])
    absmax.copy_(peak)


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (one IEEE operation on float32 inputs, emulated exactly)."""
    return struct.unpack("f", struct.pack("f", x))[0]
