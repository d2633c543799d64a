"""The fused projection Π on CPU flats: exact per-layer top-k, reading the data twice.

The eager reference (``projection.select_masks``) finds each layer's threshold key with four 8-bit
passes over stored scores; here (csrc/select.cpp) every pass recomputes the key of each entry from
x, u and F, so no score buffer exists. On flats whose large layers (``CENSUS_NUMEL`` entries and more, the ones
sampled) hold ``BRACKET_MIN_NUMEL`` active entries:

    sample   high-16-bit histogram of 1/16 of the keys (256-entry blocks at hashed places), and of all the
             keys of a layer under ``CENSUS_NUMEL`` entries (a census)                   all-reduce (sum)
             -> per layer a bracket [lo, hi] of keys around the keep-th largest, with a margin of
                ``MARGIN_SIGMAS`` standard deviations of the sampled rank (blocks counted as correlated)
    pass 1   count the keys above hi, collect those inside [lo, hi]; peak |v| per slice     all-reduce (sum)
                                                                                           [all-reduce (max): fp8 scales]
             -> if every layer's keep-th largest key lies in its bracket (global counts), the two 16-bit
                digits of the exact threshold T come from histograms of the collected keys alone
                                                                                           2 all-reduces (sum)
                this rank's ties (key == T: all inside the bracket)                        all-gather (tie counts)
    pass 2   the split below

and when a bracket misses (a skewed sample, or a flood of equal keys overflowing the collection), the exact
passes run instead, the same on every rank since the decision reads global counts only:

    pass 1   histogram of the keys' high 16 bits, per slice; peak |v| per slice           all-reduce (sum)
                                                                                           [all-reduce (max)]
    pass 2   histogram of the low 16 bits among keys whose high half is T's               all-reduce (sum)
             -> T; this rank's ties                                                        all-gather (tie counts)
    pass 3   the split

The split: z = v·[key > T], u = v − z; the tied entries (key == T) kept in index order up to this rank's
share (lower global index first, the reference's rule); residual and flip counts. A bounded number of
collectives per flat, whatever its number of layers; masks equal the reference's bit for bit, on any number
of ranks, whichever way T was found.
"""
from __future__ import annotations

import torch

from elsa_ds.admm.kernels import ops
from elsa_ds.admm.kernels.ops import ScoreSource, SliceTable
from elsa_ds.admm.projection import Comm, Slice
from elsa_ds.admm.state import StateDtype, layer_scales

UPDATE, INIT, FINAL = 0, 1, 2
_DIGIT = 16
_BINS = 1 << _DIGIT
_NO_KEY = (1 << 31) - 1  # above every score key (keys are non-negative fp32 bit patterns <= FLT_MAX's)
_EMPTY = torch.empty(0)
_EMPTY_I64 = torch.empty(0, dtype=torch.int64)
BRACKET_MIN_NUMEL = 1 << 20  # flats whose active layers hold fewer entries (globally) take the exact passes
SAMPLE_STRIDE = 16  # one sampled block (256 entries, csrc/select.cpp's kSample) in every 16
MARGIN_SIGMAS = 6.0  # the bracket's half-width in standard deviations of the sampled rank...
DESIGN_EFFECT = 4.0  # ...whose variance is taken as this many times a simple random sample's (neighbours correlate)
# A layer smaller than this is counted whole instead of sampled: its 1/16 sample would hold under 256 blocks of 256
# entries, and a block is often a whole row (or most of one) of a weight whose rows differ in scale, so the few
# blocks are far more correlated than DESIGN_EFFECT allows. Seen on the demo (2 ranks, 70 %): a 32K-entry k_proj
# (10 sampled blocks) and a 196K-entry up_proj (48) missed their brackets, 1-2 layers in every projection, and each
# miss costs the whole flat the exact passes. The census costs one full read of these small layers only.
CENSUS_NUMEL = SAMPLE_STRIDE * 256 * 256


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


def cum_search_reference(hist: torch.Tensor, target: torch.Tensor, from_top: bool, right: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``hist`` (counts, [rows, bins]): the first position, scanning bins upward (or downward when
    ``from_top``), where the running count exceeds ``target`` (``right``) or reaches it, clamped at bins − 1; and the
    running count there. The readable form of ``kernels.select_cum_search``, which tests hold it to."""
    cum = (hist.flip(1) if from_top else hist).cumsum(1, dtype=torch.int64)
    index = torch.searchsorted(cum, target.unsqueeze(1), right=right).squeeze(1).clamp_max(hist.shape[1] - 1)
    return index, cum.gather(1, index.unsqueeze(1)).squeeze(1)


def _next_digit(kernels, hist: torch.Tensor, need: torch.Tensor, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slice, the digit whose bin holds the need-th largest key, and the count of keys above that bin.

    With c = cumsum(hist) and t = c[-1], bin b holds it when c[b − 1] ≤ t − (need − above) < c[b]: the first b with
    c[b] > t − (need − above). (A scan in C++: torch's cumsum, searchsorted and gather on [slices, 65536] cost ~3 ms
    a call, a tenth of a projection's passes.)
    """
    total = ops.select_row_totals(kernels, hist=hist)  # (= hist.sum(1, dtype=torch.int64), which takes ~0.5 ms here)
    digit, cum = ops.select_cum_search(kernels, hist=hist, target=total - (need - above), from_top=False, right=True)
    return digit, above + total - cum


def exact_thresholds(kernels, source: ScoreSource, table: SliceTable, slices: list[Slice], comm: Comm,
                     scaled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, take, peaks, ties) by two full histogram passes; see ``thresholds``. Collective."""
    need = torch.tensor([s.keep for s in slices], dtype=torch.int64)
    active = need > 0
    hist, peaks = ops.select_histogram(kernels, source=source, table=table, prefix=_EMPTY_I64, stride=1)
    comm.all_reduce_sum(hist)
    if scaled:
        comm.all_reduce_max(peaks)
    high, above = _next_digit(kernels, hist, need, torch.zeros_like(need))
    prefix = torch.where(active, high, torch.full_like(high, -1))
    local, _ = ops.select_histogram(kernels, source=source, table=table, prefix=prefix, stride=1)
    threshold, take, ties = _low_digit(kernels, high, above, local, need, active, comm)
    return threshold, take, peaks, ties


def _low_digit(kernels, high, above, local, need, active, comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, take, ties) from the high digit and this rank's low-digit histogram under it (``local``): the merged
    histogram gives T's low digit; this rank's ties are local's count in T's bin, and the lower ranks' ties go first
    (the reference's index order), so this rank keeps ``take`` of them. Collective (all-reduce, all-gather)."""
    merged = comm.all_reduce_sum(local.clone())
    low, above = _next_digit(kernels, merged, need, above)
    threshold = torch.where(active, (high << _DIGIT) | low, torch.full_like(high, _NO_KEY))
    ties = torch.where(active, local.gather(1, low.clamp_min(0).unsqueeze(1)).squeeze(1).to(torch.int64), 0)
    before = comm.all_gather(ties)[: comm.rank].sum(0)
    take = torch.minimum((need - above - before).clamp_min(0), ties)
    return threshold, take, ties


def _brackets(kernels, sample: torch.Tensor, need: torch.Tensor, numel: torch.Tensor,
              active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, keys [lo, hi] (whole high-digit bins) that should hold the need-th largest key, from the sample's
    high-digit histogram; lo > hi for a layer that keeps nothing."""
    # from the top, position i is bin 65535 - i; the running count there: sampled keys in bins >= 65535 - i
    m = ops.select_row_totals(kernels, hist=sample).double()
    rank = need.double() * m / numel.clamp_min(1).double()
    sigma = torch.sqrt((rank * (1 - rank / m.clamp_min(1))).clamp_min(0) * DESIGN_EFFECT)
    margin = MARGIN_SIGMAS * sigma + 2 * DESIGN_EFFECT
    upper, lower = (rank - margin).floor().to(torch.int64), (rank + margin).ceil().to(torch.int64)
    i_hi, _ = ops.select_cum_search(kernels, hist=sample, target=upper, from_top=True, right=True)
    i_lo, _ = ops.select_cum_search(kernels, hist=sample, target=lower, from_top=True, right=False)
    hi = ((_BINS - 1 - i_hi) << _DIGIT) | (_BINS - 1)
    lo = (_BINS - 1 - i_lo) << _DIGIT
    return torch.where(active, lo, 1), torch.where(active, hi, 0)


def bracket_thresholds(kernels, source: ScoreSource, table: SliceTable, slices: list[Slice], comm: Comm,
                       scaled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(T, take, peaks, ties) from a sampled bracket and one full pass; None (on every rank) when a bracket missed."""
    need = torch.tensor([s.keep for s in slices], dtype=torch.int64)
    numel = torch.tensor([s.numel for s in slices], dtype=torch.int64)
    active = need > 0
    sample, _ = ops.select_histogram(kernels, source=source, table=table, prefix=_EMPTY_I64, stride=SAMPLE_STRIDE)
    small = (active & (numel < CENSUS_NUMEL)).nonzero().flatten()  # global sizes: the same layers on every rank
    if small.numel():
        us = source.u_scale
        census = source._replace(u_scale=us[small] if us.numel() else us)
        sample[small], _ = ops.select_histogram(kernels, source=census, table=table.rows(small), prefix=_EMPTY_I64, stride=1)
    comm.all_reduce_sum(sample)
    lo, hi = _brackets(kernels, sample, need, numel, active)
    counts, peaks, keys, found, overflow, high_hist = ops.select_bracket(kernels, source=source, table=table, lo=lo, hi=hi)
    totals = comm.all_reduce_sum(torch.cat([counts.flatten(), overflow.to(torch.int64)]))
    n = len(slices)
    above, inside, spilled = totals[0:2 * n:2], totals[1:2 * n:2], totals[2 * n:]
    hit = ~active | ((above < need) & (need <= above + inside) & (spilled == 0))
    if not bool(hit.all()):
        return None
    if scaled:
        comm.all_reduce_max(peaks)
    comm.all_reduce_sum(high_hist)
    high, above = _next_digit(kernels, high_hist, need, above)
    local = ops.select_key_histogram(kernels, keys=keys, found=found, prefix=torch.where(active, high, -1))
    threshold, take, ties = _low_digit(kernels, high, above, local, need, active, comm)
    return threshold, take, peaks, ties


def thresholds(kernels, source: ScoreSource, table: SliceTable, slices: list[Slice], comm: Comm, scaled: bool,
               stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, take, peaks, ties): per slice the exact threshold key, this rank's count of tied entries to keep, the
    layer's peak |v| over all ranks (max all-reduced only when ``scaled``), this rank's tied entries. Collective.

    ``stats`` (optional) counts the paths taken: "bracket", "missed" (bracket tried, exact passes run), "exact"."""
    stats = {} if stats is None else stats
    # the bracket pays where it samples: counted whole, small layers cost it a full pass on top of its own (a flat of
    # 40 layers of 32K entries: 51 ms against 32 ms by the exact passes), so only the large layers' entries count here
    sampled = sum(s.numel for s in slices if s.keep > 0 and s.numel >= CENSUS_NUMEL)
    if sampled >= BRACKET_MIN_NUMEL:  # global sizes: the same choice on every rank
        found = bracket_thresholds(kernels, source, table, slices, comm, scaled)
        if found is not None:
            stats["bracket"] = stats.get("bracket", 0) + 1
            return found
        stats["missed"] = stats.get("missed", 0) + 1
    else:
        stats["exact"] = stats.get("exact", 0) + 1
    return exact_thresholds(kernels, source, table, slices, comm, scaled)


def split(kernels, st: dict, keys: tuple[str, str, str, str], source: ScoreSource, table: SliceTable, slices: list[Slice],
          comm: Comm, mode: int, dtypes: tuple[StateDtype, StateDtype], stats: dict | None = None) -> torch.Tensor:
    """z, u ← split of v by Π (mode UPDATE), z ← Π(x) (INIT), or x, z ← Π(x), u ← 0 (FINAL), in place.

    Returns this rank's [Σ(x − z)², Σx², flips] (UPDATE; zeros otherwise). Collective.
    """
    z_key, u_key, zs_key, us_key = keys
    threshold, take, peaks, ties = thresholds(kernels, source, table, slices, comm, any(d.scaled for d in dtypes), stats)
    z_scale, u_scale = layer_scales(peaks, dtypes[0]), layer_scales(peaks, dtypes[1])
    if mode != UPDATE:  # v = x: no u to read (INIT) or u is written as zeros (FINAL)
        source = source._replace(u=_EMPTY, u_scale=_EMPTY)
    metrics, seen = ops.select_split(kernels, source=source, z=st[z_key], z_scale_old=st[zs_key].clone(), z_scale=z_scale,
                                     u_scale=u_scale, table=table, threshold=threshold, take=take, mode=mode)
    if not torch.equal(seen, ties):  # the threshold search and the split compute the same keys: a mismatch is a kernel bug
        raise RuntimeError(f"fused projection: tie counts {seen.tolist()} differ from the histogram's {ties.tolist()}")
    st[zs_key].copy_(z_scale)
    if mode == FINAL:
        st[u_key].zero_()
    if mode != INIT:
        st[us_key].copy_(u_scale)
    return metrics
