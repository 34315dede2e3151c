"""Routing permutation / block alignment (pure torch) on random and adversarial routings."""

import os

import pytest
import torch

from epmoe.experts.triton.align import align_blocks, max_blocks_for, sort_by_expert


def _check(ids: torch.Tensor, E: int, bm: int, seed) -> None:
    N, K = ids.shape
    nk = N * K
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    s = sort_by_expert(ids, E)
    counts = torch.bincount(flat[valid].long(), minlength=E)
    assert torch.equal(s.expert_counts, counts), seed
    assert torch.equal(s.expert_ends, torch.cumsum(counts, 0)), seed
    # stable: by expert, then by entry index
    key = torch.where(valid, flat, torch.full_like(flat, E)).long() * (nk + 1) + torch.arange(nk)
    assert torch.equal(s.order, torch.argsort(key)), seed

    b = align_blocks(s, bm)
    assert b.max_blocks == max_blocks_for(nk, E, bm)
    assert b.sorted_ids.shape == (b.max_blocks * bm,) and b.sorted_ids.dtype == torch.int32
    assert b.block_expert.shape == (b.max_blocks,) and b.block_expert.dtype == torch.int32
    assert b.block_rows.shape == (b.max_blocks,) and b.block_rows.dtype == torch.int32
    need = int(((counts + bm - 1) // bm).sum())
    assert need <= b.max_blocks, (seed, need, b.max_blocks)
    used = b.block_expert >= 0
    assert int(used.sum()) == need, seed
    assert bool(used[:need].all()) and not bool(used[need:].any()), "used tiles come first"
    rows = b.sorted_ids.view(b.max_blocks, bm)
    seen = []
    for t in range(b.max_blocks):
        r = rows[t]
        real = r[r < nk]
        if b.block_expert[t] < 0:
            assert real.numel() == 0, seed
            assert int(b.block_rows[t]) == 0, seed
            continue
        assert real.numel() > 0, "a used tile holds at least one row"
        assert bool((flat[real.long()] == b.block_expert[t]).all()), (seed, t)
        assert bool((r[: real.numel()] == real).all()), "real rows first, then padding"
        assert int(b.block_rows[t]) == real.numel(), (seed, t)
        seen.append(real)
    seen = torch.cat(seen) if seen else torch.empty(0, dtype=torch.int32)
    assert torch.equal(torch.sort(seen.long()).values, torch.nonzero(valid).flatten()), "each valid entry once"
    assert bool((b.sorted_ids[b.sorted_ids >= nk] == nk).all()), "padding rows hold num_entries"


@pytest.mark.parametrize("bm", [1, 4, 16, 64])
@pytest.mark.parametrize("trial", range(4))
def test_random_routings(bm, trial):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(1, 40, (1,), generator=g))
    N = int(torch.randint(1, 300, (1,), generator=g))
    K = int(torch.randint(1, 9, (1,), generator=g))
    ids = torch.randint(-1, E + 1, (N, K), generator=g, dtype=torch.int32)  # -1 and E are invalid
    _check(ids, E, bm, seed)


@pytest.mark.parametrize("bm", [1, 16, 128])
def test_adversarial_routings(bm):
    E = 8
    _check(torch.zeros(100, 8, dtype=torch.int32), E, bm, "all to expert 0")
    _check(torch.full((5, 8), -1, dtype=torch.int32), E, bm, "all invalid")
    _check(torch.arange(8, dtype=torch.int32).repeat(3, 1), E, bm, "every expert")
    _check(torch.tensor([[7]], dtype=torch.int32), E, bm, "one entry, last expert")
    _check(torch.arange(3, dtype=torch.int32).view(1, 3), 64, bm, "fewer entries than experts")
    _check(torch.full((33, 2), 5, dtype=torch.int32), E, bm, "33 rows of one expert")


def test_empty_and_bad_args():
    s = sort_by_expert(torch.empty(0, 4, dtype=torch.int32), 8)
    b = align_blocks(s, 16)
    assert b.max_blocks == 0 and b.sorted_ids.numel() == 0
    with pytest.raises(ValueError, match="block_m"):
        align_blocks(s, 0)
    with pytest.raises(ValueError, match="num_experts"):
        sort_by_expert(torch.zeros(2, 2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="shape"):
        sort_by_expert(torch.zeros(4, dtype=torch.int32), 3)


def test_int64_ids_accepted():
    ids = torch.tensor([[2, 0], [1, -1]], dtype=torch.int64)
    _check(ids, 3, 2, "int64")
