from __future__ import annotations

import math
import random

import pytest
import torch

from elsa_ds.admm.projection import NM
from elsa_ds.oneshot.masks import layer_keep_mask, magnitude_mask, prune_counts, row_keep_mask
from elsa_ds.oneshot.sparsegpt import Hessian, sparsify_weight
from elsa_ds.oneshot.wanda import InputNorms, wanda_mask, wanda_score


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pruned_per_group(keep: torch.Tensor, m: int) -> torch.Tensor:
    return (~keep).reshape(keep.shape[0], -1, m).sum(-1)


def _correlated_inputs(tokens: int, cols: int, seed: int = 0) -> torch.Tensor:
    """[tokens, cols]: low-rank correlated channels with unequal scales, plus a little noise."""
    g = _gen(seed)
    x = torch.randn(tokens, 8, generator=g) @ torch.randn(8, cols, generator=g)
    x = x + 0.1 * torch.randn(tokens, cols, generator=g)
    return x * torch.exp(torch.randn(cols, generator=g))


# --- prune_counts ----------------------------------------------------------------------------------------

CASES = [([10] * 7, 0.3), ([3, 2], 0.5), ([896, 896, 308], 0.7), ([10] * 9, 0.35), ([1] * 4, 0.5),
         ([5, 5], 0.0), ([7] * 13, 0.5), ([1] * 7, 0.5), ([128, 128, 44], 0.25), ([2, 1, 2, 1, 2], 0.5)]
_rng = random.Random(0)
CASES += [([_rng.randint(1, 40) for _ in range(_rng.randint(1, 12))], _rng.choice([0.1, 0.3, 0.5, 0.6, 0.75, 0.9])) for _ in range(40)]


@pytest.mark.parametrize("sizes,sparsity", CASES)
def test_prune_counts_exact_total_and_fair_parts(sizes, sparsity):
    counts = prune_counts(sizes, sparsity)
    assert sum(counts) == round(sparsity * sum(sizes))
    for n, c in zip(sizes, counts):
        assert math.floor(sparsity * n) <= c <= math.ceil(sparsity * n), (n, c)


def test_prune_counts_zero_and_half_to_even_total():
    assert prune_counts([5, 7, 3], 0.0) == [0, 0, 0]
    # round(2.5) = 2 in total; the literal round(s·c_{i+1}) − round(s·c_i) would give [2, 0] here
    assert prune_counts([3, 2], 0.5) == [1, 1]


# --- magnitude -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.77])
def test_magnitude_exact_count_equals_argsort(sparsity):
    w = torch.randn(37, 53, generator=_gen())
    keep = magnitude_mask(w, sparsity)
    assert int((~keep).sum()) == round(sparsity * w.numel())
    expected = torch.zeros(w.numel(), dtype=torch.bool)
    expected[torch.argsort(w.flatten() ** 2, descending=True, stable=True)[: keep.sum()]] = True
    assert torch.equal(keep, expected.view_as(w))


def test_magnitude_ties_keep_lowest_flat_index():
    w = torch.ones(4, 6)
    w[:, 1::2] = -1.0                                    # equal magnitudes, both signs
    keep = magnitude_mask(w, 0.5)
    assert keep.flatten()[:12].all() and not keep.flatten()[12:].any()


def test_magnitude_nm_exact_per_group():
    w = torch.randn(8, 16, generator=_gen(1))
    keep = magnitude_mask(w, NM(2, 4))
    assert (_pruned_per_group(keep, 4) == 2).all()
    s = (w ** 2).reshape(8, 4, 4)
    k = keep.reshape(8, 4, 4)
    kept_min = torch.where(k, s, torch.inf).amin(-1)
    pruned_max = torch.where(~k, s, -torch.inf).amax(-1)
    assert (pruned_max <= kept_min).all()
    ties = magnitude_mask(torch.ones(3, 8), NM(2, 4)).reshape(3, 2, 4)
    assert ties[..., :2].all() and not ties[..., 2:].any()   # ties: the higher index is pruned


def test_nm_shape_and_sparsity_errors():
    with pytest.raises(ValueError, match=r"\(8, 10\)"):
        magnitude_mask(torch.randn(8, 10), NM(2, 4))
    with pytest.raises(ValueError, match=r"\(8, 10\)"):
        wanda_mask(torch.randn(8, 10), torch.ones(10), NM(2, 4))
    with pytest.raises(ValueError, match=r"\(8, 10\)"):
        sparsify_weight(torch.randn(8, 10), torch.eye(10), NM(2, 4))
    with pytest.raises(ValueError, match="blocksize"):
        sparsify_weight(torch.randn(8, 12), torch.eye(12), NM(2, 4), blocksize=6)
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match="sparsity"):
            layer_keep_mask(torch.rand(4, 4), bad)


# --- Wanda -----------------------------------------------------------------------------------------------

def _row_reference(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    rows, cols = score.shape
    keep = torch.zeros_like(score, dtype=torch.bool)
    for r, c in enumerate(prune_counts([cols] * rows, sparsity)):
        keep[r, torch.argsort(score[r], descending=True, stable=True)[: cols - c]] = True
    return keep


@pytest.mark.parametrize("sparsity", [0.35, 0.5, 0.8])
def test_wanda_with_unit_norms_is_per_row_magnitude(sparsity):
    w = torch.randn(9, 10, generator=_gen(2))
    keep = wanda_mask(w, torch.ones(10), sparsity)
    assert torch.equal(keep, _row_reference(w.abs(), sparsity))
    pruned_rows = (~keep).sum(1)
    assert int(pruned_rows.sum()) == round(sparsity * w.numel())
    assert ((pruned_rows == math.floor(sparsity * 10)) | (pruned_rows == math.ceil(sparsity * 10))).all()


def test_row_ties_keep_lowest_columns():
    keep = wanda_mask(-torch.ones(3, 7), torch.full((7,), 2.0), 0.5)
    # round(10.5) = 10 pruned over rows of 3.5: 3, 4, 3, each keeping its leftmost columns
    assert keep.sum(1).tolist() == [4, 3, 4]
    assert all(keep[r, : int(keep[r].sum())].all() for r in range(3))


def test_wanda_score_scales_with_input_channel():
    g = _gen(3)
    w, x = torch.randn(6, 16, generator=g), torch.randn(2, 10, 16, generator=g)
    scaled = x.clone()
    scaled[..., 5] *= -3.0
    plain, loud = InputNorms(16), InputNorms(16)
    plain.add_batch(x)
    loud.add_batch(scaled)
    s, s_loud = wanda_score(w, plain.scaler_row), wanda_score(w, loud.scaler_row)
    assert torch.allclose(s_loud[:, 5], 3.0 * s[:, 5], rtol=1e-5)
    others = torch.arange(16) != 5
    assert torch.allclose(s_loud[:, others], s[:, others])
    scaled[..., 5] *= 1e4                                # a dominant channel is kept in every row
    loud = InputNorms(16)
    loud.add_batch(scaled)
    assert wanda_mask(w, loud.scaler_row, 0.5)[:, 5].all()


def test_input_norms_running_mean_equals_one_shot():
    g = _gen(4)
    x1, x2 = torch.randn(2, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    norms = InputNorms(8)
    norms.add_batch(x1)
    norms.add_batch(x2)
    everything = torch.cat([x1, x2]).reshape(-1, 8)
    assert norms.nsamples == 5
    assert torch.allclose(norms.scaler_row, everything.pow(2).sum(0) / 5, rtol=1e-5)
    single = InputNorms(8)
    single.add_batch(x1[0])                              # a 2-D input is one sequence
    assert single.nsamples == 1 and torch.allclose(single.scaler_row, x1[0].pow(2).sum(0))


def test_wanda_nm_prunes_smallest_scores_per_group():
    g = _gen(5)
    w, scaler = torch.randn(6, 16, generator=g), torch.rand(16, generator=g) * 4
    keep = wanda_mask(w, scaler, NM(2, 4))
    assert (_pruned_per_group(keep, 4) == 2).all()
    s = wanda_score(w, scaler).reshape(6, 4, 4)
    expected = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, s.topk(2, dim=-1).indices, True)
    assert torch.equal(keep, expected.reshape(6, 16))
    assert torch.equal(row_keep_mask(wanda_score(w, scaler), NM(2, 4)), keep)


# --- SparseGPT -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", [0.5, NM(2, 4)])
def test_sparsegpt_identity_hessian_is_magnitude_without_update(target):
    w = torch.randn(16, 64, generator=_gen(6))
    new, keep, _ = sparsify_weight(w, torch.eye(64), target)
    assert torch.equal(keep, magnitude_mask(w, target))
    assert torch.equal(new[keep], w[keep])
    assert (new[~keep] == 0).all()


@pytest.mark.parametrize("q", [0, 5])
def test_sparsegpt_single_prune_matches_obs_closed_form(q):
    g = _gen(7)
    cols = 16
    a = torch.randn(cols, cols, generator=g, dtype=torch.float64)
    H = (a @ a.T / cols + 0.5 * torch.eye(cols, dtype=torch.float64)).float()
    w = (1 + torch.rand(1, cols, generator=g)).float()
    w[0, q] = 0.01                                       # by far the smallest: the one weight pruned
    new, keep, loss = sparsify_weight(w, H, 1 / cols, percdamp=0.01)
    assert torch.equal(~keep[0], torch.arange(cols) == q)
    # the reference freezes columns left of q, so OBS acts on the trailing block of the damped H
    Hd = H.double() + 0.01 * torch.diag(H.double()).mean() * torch.eye(cols, dtype=torch.float64)
    Hi = torch.linalg.inv(Hd[q:, q:])
    delta = -w[0, q].double() / Hi[0, 0] * Hi[:, 0]
    expected = w[0, q:].double() + delta
    assert torch.equal(new[0, :q], w[0, :q])
    assert new[0, q] == 0
    assert torch.allclose(new[0, q:].double(), expected, atol=1e-5)
    assert loss == pytest.approx(float(w[0, q].double() ** 2 / (2 * Hi[0, 0])), rel=1e-4)


@pytest.mark.parametrize("target", [0.5, NM(2, 4)])
def test_sparsegpt_reconstructs_better_than_magnitude_and_wanda(target):
    x = _correlated_inputs(512, 96)
    w = torch.randn(48, 96, generator=_gen(8))
    hessian, norms = Hessian(96), InputNorms(96)
    for chunk in x.reshape(4, 128, 96).split(2):         # two batches of two sequences
        hessian.add_batch(chunk)
        norms.add_batch(chunk)

    def error(w_hat: torch.Tensor) -> float:
        return float(((x @ (w - w_hat).T) ** 2).sum())

    new, keep, _ = sparsify_weight(w, hessian.H, target, blocksize=32)
    sgpt = error(new)
    mag = error(w * magnitude_mask(w, target))
    wanda = error(w * wanda_mask(w, norms.scaler_row, target))
    assert sgpt < wanda and sgpt < mag, (sgpt, wanda, mag)


def test_hessian_running_mean_equals_one_shot():
    g = _gen(9)
    x1, x2 = torch.randn(2, 7, 12, generator=g), torch.randn(3, 7, 12, generator=g)
    hessian = Hessian(12)
    hessian.add_batch(x1)
    hessian.add_batch(x2)
    everything = torch.cat([x1, x2]).reshape(-1, 12)
    assert hessian.nsamples == 5
    assert torch.allclose(hessian.H, 2 / 5 * everything.T @ everything, rtol=1e-5, atol=1e-5)
    single = Hessian(12)
    single.add_batch(x1[0])                              # a 2-D input is one sequence
    assert single.nsamples == 1 and torch.allclose(single.H, 2 * x1[0].T @ x1[0], rtol=1e-5, atol=1e-5)


def test_sparsegpt_exact_counts_across_blocks():
    x = _correlated_inputs(256, 300, seed=10)
    H = 2 * x.T @ x / 256
    w = torch.randn(7, 300, generator=_gen(11))
    new, keep, loss = sparsify_weight(w, H, 0.7, blocksize=128)
    assert int((~keep).sum()) == round(0.7 * w.numel())
    per_block = [int((~keep[:, i:i + 128]).sum()) for i in range(0, 300, 128)]
    assert per_block == prune_counts([7 * 128, 7 * 128, 7 * 44], 0.7)
    assert (new[~keep] == 0).all() and (new[keep] != 0).all() and loss > 0
    new, keep, _ = sparsify_weight(w[:, :256], H[:256, :256], NM(2, 4), blocksize=128)
    assert (_pruned_per_group(keep, 4) == 2).all() and (new[~keep] == 0).all()


def test_sparsegpt_dead_column_kept_unchanged_and_hessian_untouched():
    x = _correlated_inputs(256, 32, seed=12)
    x[:, 3] = 0                                          # input channel 3 never fires in calibration
    H = 2 * x.T @ x / 256
    H_before = H.clone()
    w = torch.randn(8, 32, generator=_gen(13))
    w[:, 3] = 10.0
    new, keep, _ = sparsify_weight(w.bfloat16(), H, 0.5)
    assert torch.equal(H, H_before)
    assert new.dtype == torch.bfloat16
    assert keep[:, 3].all() and torch.equal(new[:, 3], w[:, 3].bfloat16())   # the reference zeroes it
    assert int((~keep).sum()) == 128
