"""Adam with 8-bit blockwise moments, fast on CPU flats (ELSA-L's base optimizer): bitsandbytes' format or ours.

State per parameter, exactly bitsandbytes' ``Adam8bit`` layout (so its checkpoints, ``second_moment``
and the fused ADMM x-step read it unchanged):

    step                 int
    state1, state2       uint8 codes of m and v, one per entry
    qmap1, qmap2         the signed (m) and unsigned (v) maps, 256 fp32 values each
    absmax1, absmax2     fp32, one per block of BLOCK = 256 entries: m ≈ qmap1[state1] · absmax1[block]

One step, per block (bitsandbytes 0.50's CPU path, ``_optimizer_update_8bit_blockwise_cpu``):

    m, v  ← dequantized;   m ← β1 m + (1 − β1) g;   v ← β2 v + (1 − β2) g²
    x     ← x (1 − lr·wd) − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)
    codes ← the nearest code of m / max|m| (likewise v), by the format's quantizer

The code formats (bitsandbytes' dynamic map and CPU quantizer, or elsa_ds's minifloat codes) live in
``kernels/quant8.py``. Parameters below ``min_8bit_size`` entries keep fp32 ``state1``/``state2``, as bitsandbytes
does. The compiled kernel (``kernels/xstep.py``, csrc/xstep8bit.cpp) steps CPU tensors; ``adam8bit_reference`` here is
its readable reference (tests/admm hold the kernel to it) and the path for other devices. The minifloat step costs
about what DeepSpeedCPUAdam's fp32 step does (bench/optimizer_step.py); bitsandbytes' quantizer reads a 64 KiB table
per code, which makes its step compute-bound.

This is a base optimizer like DeepSpeedCPUAdam, not a kernel: it lives beside the ADMM wrapper that steps it, and
``kernels/`` holds only the compiled kernels and their references.
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Literal

import torch

from elsa_ds.admm.kernels import build, xstep
from elsa_ds.admm.kernels.ops import PenaltyState, SliceTable
from elsa_ds.admm.kernels.quant8 import (BITSANDBYTES, BLOCK, FORMATS, MINIFLOAT, dequantize_blockwise, dynamic_map, f32,
                                         minifloat_map, quantize_blockwise_, state_format)


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
        denom = (v.sqrt() * f32(1.0 / f32(correction2))).add_(eps)
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
    update with elsa_ds's own codes (``kernels/quant8.py``), faster again. Other devices run the torch reference
    above (``adam8bit_reference``).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, min_8bit_size: int = 4096, kernels: bool = True, format: str = BITSANDBYTES):
        if format not in FORMATS:
            raise ValueError(f"8-bit Adam format {format!r}: expected one of {', '.join(FORMATS)}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.format = format
        self.min_8bit_size = min_8bit_size
        self._use_kernels = kernels
        self._kernels: ModuleType | Literal[False] | None = None  # None: not loaded yet; False: unavailable
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

    def _compiled(self) -> ModuleType | None:
        if self._use_kernels and self._kernels is None:
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
        grad = p.grad
        assert grad is not None, "step() skips parameters without a gradient"
        hyper = dict(lr=group["lr"], betas=tuple(group["betas"][:2]), eps=group["eps"], weight_decay=group["weight_decay"])
        if st["state1"].dtype == torch.float32:
            st["step"] += 1
            adam32_reference(p.data, grad, st, **hyper)
            return
        kernels = self._compiled()
        flat_cpu = p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() and grad.is_contiguous()
        if kernels is not None and flat_cpu and grad.dtype == torch.float32:
            xstep.adam8bit_step(kernels, p, st, group, SliceTable.empty(), PenaltyState.none(), 0.0)
            return
        st["step"] += 1
        adam8bit_reference(p.data, grad, st, **hyper)


def second_moment(state: dict) -> torch.Tensor | None:
    """The optimizer's diagonal second-moment estimate F for one flat, as fp32, or None if absent.

    Adam, AdamW and DeepSpeedCPUAdam keep it as ``exp_avg_sq``; 8-bit Adam in bitsandbytes' format keeps
    it block-quantized as ``state2`` (codes into ``qmap2``, one ``absmax2`` per block of 256 entries).
    """
    if "exp_avg_sq" in state:
        return state["exp_avg_sq"].float()
    if "state2" in state and state["state2"].dtype == torch.float32:  # bnb keeps small tensors in 32 bit
        return state["state2"]
    if "state2" in state and "qmap2" in state:
        return dequantize_blockwise(state["state2"], state["qmap2"], state["absmax2"])
    return None
