"""Adam with 8-bit blockwise moments, fast on CPU flats (ELSA-L's base optimizer): bitsandbytes' format or ours.

State per parameter, exactly bitsandbytes' ``Adam8bit`` layout (so its checkpoints, ``second_moment``
and the fused ADMM x-step read it unchanged):

    step                 int
    state1, state2       uint8 codes of m and v, one per entry
    qmap1, qmap2         the signed (m) and unsigned (v) dynamic maps, 256 fp32 values each
    absmax1, absmax2     fp32, one per block of BLOCK = 256 entries: m ≈ qmap1[state1] · absmax1[block]

One step, per block (bitsandbytes 0.50's CPU path, ``_optimizer_update_8bit_blockwise_cpu``):

    m, v  ← dequantized;   m ← β1 m + (1 − β1) g;   v ← β2 v + (1 − β2) g²
    x     ← x (1 − lr·wd) − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)
    codes ← lut[⌊(clamp(m / max|m|, ±1) + 1)/2 · 65535 + ½⌋]   (likewise v)

``lut`` is bitsandbytes' CPU quantizer: a 65536-bin grid over [−1, 1], each bin mapped to the code whose
midpoints bracket it (not the exact nearest code: values below ~1.5e-5 of a block's absmax collapse).
Parameters below ``min_8bit_size`` entries keep fp32 ``state1``/``state2``, as bitsandbytes does.
The compiled kernel (csrc/xstep8bit.cpp) runs CPU tensors; the torch code here is its reference and
the path for other devices.

``format="minifloat"`` is elsa_ds's own code format, in the same state layout (codes, a 256-entry map, one
absmax per block; ``dequantize_blockwise`` and every reader of ``state2`` work unchanged): the map is a
4-bit octave and a 3-bit (m, with a sign bit) or 4-bit (v) mantissa relative to the block's absmax,
2^-15 … 1 (``minifloat_map``), and a value is encoded arithmetically to its nearest code
(``minifloat_encode``: round the fp32 bit pattern, no table). bitsandbytes' quantizer needs a 64 KiB
table read per code, which made the CPU step compute-bound; the minifloat step costs about what
DeepSpeedCPUAdam's fp32 step does (bench/optimizer_step.py). Precision: a rounding error ≤ 6.25 % (m)
and ≤ 3.2 % (v) of the value from 2^-14 to 1 of the absmax, where the dynamic map is finer near the block's
absmax (0.7 %) and coarser below a tenth of it (its step doubles every decade);
tests/admm/test_adam8bit_formats.py holds both against fp32 Adam. The map is what marks a state's format,
so a checkpoint carries it.
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


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def adam8bit_reference(p: torch.Tensor, grad: torch.Tensor, st: dict, lr: float, betas: tuple[float, float], eps: float,
                       weight_decay: float) -> None:
    """One 8-bit Adam step in torch ops (bitsandbytes' CPU sequence); ``st['step']`` must already count it."""
    beta1, beta2 = betas
    m = dequantize_blockwise(st["state1"], st["qmap1"], st["absmax1"])
    v = dequantize_blockwise(st["state2"], st["qmap2"], st["absmax2"])
    grad = grad.float()
    m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    correction1 = 1.0 - beta1 ** st["step"]
    correction2 = math.sqrt(1.0 - beta2 ** st["step"])
    if state_format(st) == MINIFLOAT:  # one division fewer per entry in the kernel; the same update to fp32 rounding
        denom = (v.sqrt() * _f32(1.0 / _f32(correction2))).add_(eps)
    else:
        denom = (v.sqrt() / correction2).add_(eps)
    if weight_decay > 0.0:
        p.mul_(1.0 - lr * weight_decay)
    p.addcdiv_(m, denom, value=-lr / correction1)
    quantize_blockwise_(m, st["qmap1"], st["absmax1"], st["state1"])
    quantize_blockwise_(v, st["qmap2"], st["absmax2"], st["state2"])


def adam32_reference(p: torch.Tensor, grad: torch.Tensor, st: dict, lr: float, betas: tuple[float, float], eps: float,
                     weight_decay: float) -> None:
    """bitsandbytes' 32-bit Adam (its path for parameters below ``min_8bit_size``): fp32 state1/state2."""
    beta1, beta2 = betas
    grad = grad.float()
    st["state1"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
    st["state2"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    correction1 = 1.0 - beta1 ** st["step"]
    correction2 = math.sqrt(1.0 - beta2 ** st["step"])
    if weight_decay > 0.0:
        p.mul_(1.0 - lr * weight_decay)
    update = st["state1"] / (st["state2"].sqrt() + eps * correction2)
    p.add_(update, alpha=-lr * correction2 / correction1)


class Adam8bit(torch.optim.Optimizer):
    """Adam with 8-bit blockwise moments; CPU tensors are stepped by the compiled kernel.

    ``format="bitsandbytes"``: a drop-in for ``bitsandbytes.optim.Adam8bit`` under CPU offload (same state,
    same update), several times faster than bitsandbytes' CPU path. ``format="minifloat"``: the same
    update with elsa_ds's own codes (module docstring), faster again. Other devices run the torch reference above.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, min_8bit_size: int = 4096, kernels: bool = True, format: str = BITSANDBYTES):
        if format not in FORMATS:
            raise ValueError(f"8-bit Adam format {format!r}: expected one of {', '.join(FORMATS)}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.format = format
        self.min_8bit_size = min_8bit_size
        self._use_kernels = kernels
        self._kernels = None
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _init_state(self, p: torch.Tensor, st: dict) -> None:
        st["step"] = 0
        if p.numel() < self.min_8bit_size:
            st["state1"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            st["state2"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            return
        if p.device not in self._maps:  # shared by every parameter, as bitsandbytes shares its name2qmap
            make = minifloat_map if self.format == MINIFLOAT else dynamic_map
            self._maps[p.device] = (make(True).to(p.device), make(False).to(p.device))
        blocks = -(-p.numel() // BLOCK)
        st["state1"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        st["qmap1"] = self._maps[p.device][0]
        st["state2"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        st["qmap2"] = self._maps[p.device][1]
        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating-point parameter's state tensors to the parameter's dtype, which would
        turn the uint8 codes into fp32 (and the next step into the 32-bit path), and with bf16 parameters round the
        absmax and the maps: every state whose dtype it changed is restored from the saved tensor itself."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = dict(zip(saved_ids, (p for group in self.param_groups for p in group["params"])))
        saved = {i: {k: v for k, v in st.items() if torch.is_tensor(v)} for i, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        for i, tensors in saved.items():
            st = self.state[params[i]]
            for key, value in tensors.items():
                if st[key].dtype != value.dtype:
                    st[key] = value.to(device=st[key].device, copy=True)

    def _compiled(self):
        if self._use_kernels and self._kernels is None:
            from elsa_ds.admm.kernels import build

            self._kernels = build.load() or False
        return self._kernels or None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    self._init_state(p, st)
                self._step_one(p, st, group)
        return loss

    def _step_one(self, p: torch.Tensor, st: dict, group: dict) -> None:
        args = (group["lr"], tuple(group["betas"][:2]), group["eps"], group["weight_decay"])
        if st["state1"].dtype == torch.float32:
            st["step"] += 1
            adam32_reference(p.data, p.grad, st, *args)
            return
        kernels = self._compiled()
        flat_cpu = p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() and p.grad.is_contiguous()
        if kernels is not None and flat_cpu and p.grad.dtype == torch.float32:
            from elsa_ds.admm.kernels import xstep

            xstep.adam8bit_step(kernels, p, st, group, xstep.SliceTable.empty(), (torch.empty(0),) * 4, 0.0)
            return
        st["step"] += 1
        adam8bit_reference(p.data, p.grad, st, *args)
