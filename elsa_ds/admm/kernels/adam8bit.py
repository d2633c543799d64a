"""Adam with 8-bit blockwise moments in bitsandbytes' format, fast on CPU flats (ELSA-L's base optimizer).

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
"""
from __future__ import annotations

import math

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
    """Write the codes and per-block absmax of fp32 ``values`` into ``codes`` and ``absmax`` (in place)."""
    n = values.numel()
    blocks = -(-n // BLOCK)
    padded = torch.nn.functional.pad(values.reshape(-1).float(), (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    peak = padded.abs().amax(1)
    normed = padded * (1.0 / peak).unsqueeze(1)
    index = ((normed.clamp(-1.0, 1.0) + 1.0) * 0.5 * float(LUT_BINS - 1) + 0.5).to(torch.int64)
    index = torch.where(torch.isnan(normed), 0, index)
    out = quantize_lut(qmap)[index]
    out[peak == 0] = 0
    codes.view(-1).copy_(out.view(-1)[:n])
    absmax.copy_(peak)


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
    """Adam with bitsandbytes-format 8-bit moments; CPU tensors are stepped by the compiled kernel.

    A drop-in for ``bitsandbytes.optim.Adam8bit`` under CPU offload (same state, same update), at memory
    speed instead of bitsandbytes' CPU path; other devices run the torch reference above.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, min_8bit_size: int = 4096, kernels: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
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
            self._maps[p.device] = (dynamic_map(True).to(p.device), dynamic_map(False).to(p.device))
        blocks = -(-p.numel() // BLOCK)
        st["state1"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        st["qmap1"] = self._maps[p.device][0]
        st["state2"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        st["qmap2"] = self._maps[p.device][1]
        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

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
