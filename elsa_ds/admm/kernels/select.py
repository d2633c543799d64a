"""The fused projection Π on CPU flats: exact per-layer top-k in two 16-bit radix passes, then one split pass.

The eager reference (``projection.select_masks``) finds each layer's threshold key with four 8-bit
passes over stored scores; here (csrc/select.cpp) every pass recomputes the key of each entry from
x, u and F, so no score buffer exists, and

    pass 1   histogram of the keys' high 16 bits, per slice; peak |v| per slice      all-reduce (sum)
                                                                                      [all-reduce (max): fp8 scales]
    pass 2   histogram of the low 16 bits among keys whose high half is T's           all-reduce (sum)
             -> T, the exact key of each layer's keep-th largest score; this rank's ties
                                                                                      all-gather (tie counts)
    pass 3   z = v·[key > T], u = v − z; the tied entries (key == T) kept in index order up to this
             rank's share (lower global index first, the reference's rule); residual and flip counts

Three passes over the data and three (four with fp8) collectives per flat, whatever its number of
layers; masks equal the reference's bit for bit, on any number of ranks. (csrc/select.cpp also has a
sampled histogram (``stride``) and a bracket pass, ``select_bracket``, for a cheaper pass 1 and 2: not
wired in yet.)
"""
from __future__ import annotations

import torch

from elsa_ds.admm.projection import Comm, Slice
from elsa_ds.admm.state import StateDtype, layer_scales

UPDATE, INIT, FINAL = 0, 1, 2
_DIGIT = 16
_BINS = 1 << _DIGIT
_NO_KEY = (1 << 31) - 1  # above every score key (keys are non-negative fp32 bit patterns <= FLT_MAX's)
_EMPTY = torch.empty(0)
_EMPTY_I64 = torch.empty(0, dtype=torch.int64)


def fisher_source(state: dict | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(F, qmap, absmax) as the kernels read F: exp_avg_sq fp32, or bitsandbytes' 8-bit state2; empty for magnitude."""
    if state is None:
        return _EMPTY, _EMPTY, _EMPTY
    if "exp_avg_sq" in state and state["exp_avg_sq"].dtype == torch.float32:
        return state["exp_avg_sq"], _EMPTY, _EMPTY
    if "state2" in state and state["state2"].dtype == torch.float32:
        return state["state2"], _EMPTY, _EMPTY
    if "state2" in state and state["state2"].dtype == torch.uint8:
        return state["state2"], state["qmap2"], state["absmax2"]
    raise RuntimeError("fisher projection needs the base optimizer's second moment (exp_avg_sq or state2); none was found")


def _next_digit(hist: torch.Tensor, need: torch.Tensor, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slice, the digit whose bin holds the need-th largest key, and the count of keys above that bin.

    With c = cumsum(hist) and t = c[-1], bin b holds it when c[b − 1] ≤ t − (need − above) < c[b]: one binary search.
    """
    cum = hist.cumsum(1, dtype=torch.int64)
    total = cum[:, -1]
    digit = torch.searchsorted(cum, (total - (need - above)).unsqueeze(1), right=True).squeeze(1).clamp_max(_BINS - 1)
    return digit, above + total - cum.gather(1, digit.unsqueeze(1)).squeeze(1)


def thresholds(kernels, source: tuple, table, slices: list[Slice], comm: Comm,
               scaled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, take, peaks, ties): per slice the exact threshold key, this rank's count of tied entries to keep, the
    layer's peak |v| over all ranks (max all-reduced only when ``scaled``), this rank's tied entries. Collective."""
    x, u, us, f, qmap, absmax = source
    need = torch.tensor([s.keep for s in slices], dtype=torch.int64)
    active = need > 0
    hist, peaks = kernels.select_histogram(x, u, us, f, qmap, absmax, table.offsets, table.lengths, _EMPTY_I64, 1)
    comm.all_reduce_sum(hist)
    if scaled:
        comm.all_reduce_max(peaks)
    high, above = _next_digit(hist, need, torch.zeros_like(need))
    prefix = torch.where(active, high, torch.full_like(high, -1))
    local, _ = kernels.select_histogram(x, u, us, f, qmap, absmax, table.offsets, table.lengths, prefix, 1)
    merged = comm.all_reduce_sum(local.clone())
    low, above = _next_digit(merged, need, above)
    threshold = torch.where(active, (high << _DIGIT) | low, torch.full_like(high, _NO_KEY))
    ties = torch.where(active, local.to(torch.int64).gather(1, low.clamp_min(0).unsqueeze(1)).squeeze(1), 0)
    before = comm.all_gather(ties)[: comm.rank].sum(0)
    take = torch.minimum((need - above - before).clamp_min(0), ties)
    return threshold, take, peaks, ties


def split(kernels, flat: torch.Tensor, st: dict, keys: tuple[str, str, str, str], source: tuple, table,
          slices: list[Slice], comm: Comm, mode: int, dtypes: tuple[StateDtype, StateDtype]) -> torch.Tensor:
    """z, u ← split of v by Π (mode UPDATE), z ← Π(x) (INIT), or x, z ← Π(x), u ← 0 (FINAL), in place.

    Returns this rank's [Σ(x − z)², Σx², flips] (UPDATE; zeros otherwise). Collective.
    """
    z_key, u_key, zs_key, us_key = keys
    threshold, take, peaks, ties = thresholds(kernels, source, table, slices, comm, any(d.scaled for d in dtypes))
    z_scale, u_scale = layer_scales(peaks, dtypes[0]), layer_scales(peaks, dtypes[1])
    x, u, us_old = source[0], source[1], source[2]
    metrics, seen = kernels.select_split(
        x, u if mode == UPDATE else _EMPTY, us_old if mode == UPDATE else _EMPTY, *source[3:], st[z_key],
        st[zs_key].clone(), z_scale, u_scale, table.offsets, table.lengths, threshold, take, ties, mode)
    if not torch.equal(seen, ties):  # pass 2 and pass 3 recompute the same keys: a mismatch is a kernel bug
        raise RuntimeError(f"fused projection: tie counts {seen.tolist()} differ from the histogram's {ties.tolist()}")
    st[zs_key].copy_(z_scale)
    if mode == FINAL:
        st[u_key].zero_()
    if mode != INIT:
        st[us_key].copy_(u_scale)
    return metrics
