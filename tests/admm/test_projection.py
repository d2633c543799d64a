from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elsa_ds.admm.projection import NM, LocalComm, Slice, TorchDistComm, keep_count, nm_masks, projection_masks, scores, select_masks
from elsa_ds.zero.dist import free_port  # the rendezvous port


def _whole(name: str, numel: int, sparsity: float) -> Slice:
    return Slice(layer=name, offset=0, length=numel, start=0, numel=numel, keep=keep_count(numel, sparsity))


def test_keep_count_rounds_zeros():
    assert keep_count(10, 0.7) == 3
    assert keep_count(7, 0.5) == 3  # round(3.5) = 4 zeros (banker's rounding), 3 kept
    assert keep_count(100, 0.0) == 100


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.9, 0.99])
def test_exact_keep_count_matches_sort(sparsity):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1000, generator=g)
    f = torch.rand(1000, generator=g)
    sl = _whole("w", 1000, sparsity)
    (mask,) = projection_masks([v], [f], [sl], LocalComm())
    assert int(mask.sum()) == sl.keep
    expected = torch.zeros(1000, dtype=torch.bool)
    expected[torch.argsort(f * v * v, descending=True, stable=True)[: sl.keep]] = True
    assert torch.equal(mask, expected)


def test_ties_keep_exactly_k_lowest_index_first():
    v = torch.tensor([1.0, 2.0, 2.0, -2.0, 2.0, 0.5, 3.0])
    sl = _whole("w", 7, 4 / 7)  # keep 3: the 3.0 and the first two of the four tied |2.0|
    (mask,) = projection_masks([v], None, [sl], LocalComm())
    assert mask.tolist() == [False, True, True, False, False, False, True]


def test_all_equal_and_zero_scores():
    v = torch.zeros(50)
    sl = _whole("w", 50, 0.8)
    (mask,) = projection_masks([v], None, [sl], LocalComm())
    assert mask.tolist() == [True] * 10 + [False] * 40


def test_scores_are_nonnegative_and_finite():
    s = scores(torch.tensor([-0.0, float("nan"), 1e30, -2.0]), torch.tensor([-1.0, 1.0, 1e30, 1.0]))
    assert (s >= 0).all() and torch.isfinite(s).all()
    assert s.view(torch.int32)[0] == 0  # -0.0 normalized, bit order intact


def test_batched_layers_are_independent():
    g = torch.Generator().manual_seed(1)
    vs = [torch.randn(n, generator=g) for n in (10, 333, 1)]
    sls = [_whole(f"l{i}", v.numel(), 0.5) for i, v in enumerate(vs)]
    masks = projection_masks(vs, None, sls, LocalComm())
    for v, sl, m in zip(vs, sls, masks):
        (alone,) = projection_masks([v], None, [sl], LocalComm())
        assert torch.equal(m, alone)
        assert int(m.sum()) == sl.keep


def _rank_worker(rank: int, world: int, port: int, values: list[torch.Tensor], out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    slices, parts = [], []
    for i, v in enumerate(values):
        pn = -(-v.numel() // world)
        start = rank * pn
        real = max(0, min(pn, v.numel() - start))
        slices.append(Slice(f"l{i}", 0, real, start, v.numel(), keep_count(v.numel(), 0.6)))
        parts.append(v[start:start + real])
    masks = select_masks([p.abs() for p in parts], slices, TorchDistComm())
    torch.save(masks, os.path.join(out_dir, f"r{rank}.pt"))
    dist.destroy_process_group()


def test_distributed_select_equals_single_process(tmp_path):
    """Slices on 3 ranks (ties and an all-padding rank included) select exactly the reference entries."""
    g = torch.Generator().manual_seed(2)
    values = [
        torch.randint(0, 4, (101,), generator=g).float(),  # heavy ties across rank boundaries
        torch.randn(64, generator=g),
        torch.tensor([5.0]),  # 1 entry: ranks 1 and 2 hold pure padding
    ]
    world = 3
    mp.start_processes(_rank_worker, args=(world, free_port(), values, str(tmp_path)), nprocs=world, start_method="spawn")
    per_rank = [torch.load(tmp_path / f"r{r}.pt") for r in range(world)]
    for i, v in enumerate(values):
        got = torch.cat([per_rank[r][i] for r in range(world)])
        (ref,) = select_masks([v.abs()], [_whole(f"l{i}", v.numel(), 0.6)], LocalComm())
        assert torch.equal(got, ref)
        assert int(got.sum()) == keep_count(v.numel(), 0.6)


def _nm_reference(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Per group of m: keep the m − n largest, ties to the lower index (a plain loop)."""
    mask = torch.zeros_like(score, dtype=torch.bool)
    for g in range(score.numel() // m):
        group = score[g * m:(g + 1) * m].tolist()
        for i in sorted(range(m), key=lambda i: (-group[i], i))[: m - n]:
            mask[g * m + i] = True
    return mask


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (1, 4)])
def test_nm_keeps_the_top_of_every_group(n, m):
    g = torch.Generator().manual_seed(3)
    v = torch.randint(-3, 4, (12 * m,), generator=g).float()  # small integers: many ties inside groups
    pattern = NM(n, m)
    sl = _whole("w", v.numel(), pattern.ratio)
    (mask,) = projection_masks([v], None, [sl], LocalComm(), pattern)
    assert torch.equal(mask, _nm_reference(v * v, n, m))
    assert torch.equal(mask.view(-1, m).sum(1), torch.full((12,), m - n))
    assert int(mask.sum()) == sl.keep


def test_nm_parse_and_errors():
    assert NM.parse("2:4") == NM(2, 4) and str(NM(4, 8)) == "4:8" and NM(2, 4).ratio == 0.5
    for bad in ("2-4", "4:2", "0:4", "a:b", "2:4:8"):
        with pytest.raises(ValueError):
            NM.parse(bad)


def _nm_rank_worker(rank: int, world: int, port: int, values: list[torch.Tensor], n: int, m: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    slices, parts = [], []
    for i, v in enumerate(values):
        pn = -(-v.numel() // world)  # ZeRO-3's partition rule: pn need not be a multiple of m
        start = rank * pn
        real = max(0, min(pn, v.numel() - start))
        slices.append(Slice(f"l{i}", 0, real, start, v.numel(), keep_count(v.numel(), n / m)))
        parts.append(v[start:start + real])
    masks = nm_masks([p.abs() for p in parts], slices, NM(n, m), TorchDistComm())
    torch.save(masks, os.path.join(out_dir, f"r{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world, n, m", [(3, 2, 4), (2, 4, 8)])
def test_nm_groups_cut_by_rank_boundaries(tmp_path, world, n, m):
    """Groups straddling 2 (and 3, for tiny layers) ranks get the same entries as in one process."""
    g = torch.Generator().manual_seed(4)
    values = [
        torch.randint(0, 3, (m * 37,), generator=g).float(),  # 37 groups: every rank boundary cuts a group
        torch.randn(m * 5, generator=g),
        torch.randn(m, generator=g),                           # one group spread over several ranks
    ]
    mp.start_processes(_nm_rank_worker, args=(world, free_port(), values, n, m, str(tmp_path)), nprocs=world, start_method="spawn")
    per_rank = [torch.load(tmp_path / f"r{r}.pt") for r in range(world)]
    for i, v in enumerate(values):
        got = torch.cat([per_rank[r][i] for r in range(world)])
        assert torch.equal(got, _nm_reference(v.abs(), n, m)), i
