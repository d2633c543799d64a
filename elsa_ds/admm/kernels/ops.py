"""The compiled kernels' entry points with keyword parameters: one small function per binding of csrc/bindings.cpp.

The bindings take positional arguments only (up to 22 of them); every caller goes through these functions, so each
argument is named where it is passed. ``kernels`` is the module ``build.load()`` returns. The argument checks (device,
dtype, length) stay in the binding; the arithmetic in the kernels' readable references (``select.py``,
``admm/adam8bit.py``, the eager path of ``optimizer.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class SliceTable:
    """A flat's slices as the kernels take them: int64 offsets and lengths."""

    offsets: Tensor
    lengths: Tensor

    @classmethod
    def of(cls, slices) -> SliceTable:
        return cls(torch.tensor([s.offset for s in slices], dtype=torch.int64),
                   torch.tensor([s.length for s in slices], dtype=torch.int64))

    @classmethod
    def empty(cls) -> SliceTable:
        """No slices: the plain optimizer step."""
        return cls(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))

    def rows(self, index: Tensor) -> SliceTable:
        """The slices at ``index`` only."""
        return SliceTable(self.offsets[index], self.lengths[index])


class ScoreSource(NamedTuple):
    """What the projection kernels compute a score key from: v = x + u·u_scale (u empty: v = x), times F (empty for
    magnitude; fp32, or 8-bit codes with ``f_qmap`` and ``f_absmax``)."""

    x: Tensor
    u: Tensor
    u_scale: Tensor
    f: Tensor
    f_qmap: Tensor
    f_absmax: Tensor


class PenaltyState(NamedTuple):
    """z and u as stored, with their per-slice scales; all empty (with no slices) for the plain optimizer step."""

    z: Tensor
    u: Tensor
    z_scale: Tensor
    u_scale: Tensor

    @classmethod
    def none(cls) -> PenaltyState:
        return cls(*(torch.empty(0),) * 4)


def adam_step(kernels: ModuleType, *, p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, zu: PenaltyState,
              table: SliceTable, lam: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              adamw: bool, bias_correction1: float, bias_correction2: float) -> None:
    """DeepSpeedCPUAdam's step of ``p`` in place, with λ((x − z) + u) added to ``grad`` on the slices (csrc/xstep.cpp)."""
    kernels.adam_step(p, grad, exp_avg, exp_avg_sq, zu.z, zu.u, zu.z_scale, zu.u_scale, table.offsets, table.lengths, lam, lr,
                      beta1, beta2, eps, weight_decay, adamw, bias_correction1, bias_correction2)


def adam8bit_step(kernels: ModuleType, *, p: Tensor, grad: Tensor, state1: Tensor, state2: Tensor, qmap1: Tensor,
                  qmap2: Tensor, absmax1: Tensor, absmax2: Tensor, zu: PenaltyState, table: SliceTable, lam: float, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float, step: int, minifloat: bool) -> None:
    """The blockwise 8-bit Adam step of ``p`` in place (codes and absmax rewritten), with the penalty on the slices
    (csrc/xstep8bit.cpp); ``minifloat`` picks the code format (False: bitsandbytes')."""
    kernels.adam8bit_step(p, grad, state1, state2, qmap1, qmap2, absmax1, absmax2, zu.z, zu.u, zu.z_scale, zu.u_scale,
                          table.offsets, table.lengths, lam, lr, beta1, beta2, eps, weight_decay, step, int(minifloat))


def select_histogram(kernels: ModuleType, *, source: ScoreSource, table: SliceTable, prefix: Tensor,
                     stride: int) -> tuple[Tensor, Tensor]:
    """Per slice, the 65536-bin histogram of the keys' high 16 bits (``prefix`` empty) or of the low 16 bits of the
    keys whose high half is ``prefix[slice]``, over one 256-entry block in ``stride``; and the peak |v| per slice."""
    hist, peaks = kernels.select_histogram(*_source(source), table.offsets, table.lengths, prefix, stride)
    return hist, peaks


def select_bracket(kernels: ModuleType, *, source: ScoreSource, table: SliceTable, lo: Tensor,
                   hi: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(counts [slices, 2]: keys above ``hi`` and inside [lo, hi]; peaks; the keys inside, concatenated; how many per
    slice; overflow per slice; the high-half histogram of the keys inside)."""
    counts, peaks, keys, found, overflow, high_hist = kernels.select_bracket(*_source(source), table.offsets, table.lengths,
                                                                            lo, hi)
    return counts, peaks, keys, found, overflow, high_hist


def select_key_histogram(kernels: ModuleType, *, keys: Tensor, found: Tensor, prefix: Tensor) -> Tensor:
    """Per slice, the low-half histogram of its collected ``keys`` whose high half is ``prefix[slice]``."""
    return kernels.select_key_histogram(keys, found, prefix)


def select_row_totals(kernels: ModuleType, *, hist: Tensor) -> Tensor:
    """Per row of an int32 histogram, its sum (int64)."""
    return kernels.select_row_totals(hist)


def select_cum_search(kernels: ModuleType, *, hist: Tensor, target: Tensor, from_top: bool,
                      right: bool) -> tuple[Tensor, Tensor]:
    """Per row, the first bin where the running count passes ``target``, and the count there
    (``select.cum_search_reference`` is its readable form)."""
    index, cum = kernels.select_cum_search(hist, target, from_top, right)
    return index, cum


def select_split(kernels: ModuleType, *, source: ScoreSource, z: Tensor, z_scale_old: Tensor, z_scale: Tensor,
                 u_scale: Tensor, table: SliceTable, threshold: Tensor, take: Tensor, mode: int) -> tuple[Tensor, Tensor]:
    """z = v·[key > T] (plus this rank's ``take`` tied entries), u = v − z, written in place in their storage with the
    new scales; returns ([Σ(x − z)², Σx², flips], the tied entries met per slice)."""
    metrics, seen = kernels.select_split(*_source(source), z, z_scale_old, z_scale, u_scale, table.offsets, table.lengths,
                                         threshold, take, mode)
    return metrics, seen


def _source(source: ScoreSource) -> tuple[Tensor, ...]:
    """The score source in the bindings' order: x, u, u_scale, F, F's map, F's absmax."""
    return source.x, source.u, source.u_scale, source.f, source.f_qmap, source.f_absmax
