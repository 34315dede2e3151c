"""`align.split_tail_tiles` (torch): every real row of the alignment lands in exactly one tile, big or
small; the small tiles are the experts' last tiles with <= tail_rows real rows, split into sub_m-row
sub-tiles that name their expert, and nothing else; bad arguments are refused naming the value. (The
Triton form equals it bit for bit under the interpreter: tests/cpu/test_align_triton_interpret.py.)"""

import pytest
import torch

from epmoe.experts.triton import align as A


def _covered(blocks, tails):
    """{padded row: expert} of the real rows the big tiles and the sub-tiles cover (asserting no row twice)."""
    seen = {}
    for b in range(blocks.max_blocks):
        e = int(tails.block_expert[b])
        if e >= 0:
            for r in range(b * blocks.block_m, b * blocks.block_m + int(blocks.block_rows[b])):
                assert r not in seen
                seen[r] = e
    for s in range(tails.num_tail_tiles):
        e = int(tails.tail_expert[s])
        if e >= 0:
            r0, n = int(tails.tail_row0[s]), int(tails.tail_rows[s])
            assert 1 <= n <= tails.sub_m
            for r in range(r0, r0 + n):
                assert r not in seen
                seen[r] = e
        else:
            assert int(tails.tail_rows[s]) == 0 and int(tails.tail_row0[s]) == 0
    return seen


@pytest.mark.parametrize("E,K,N,block_m,tail,sub", [(8, 4, 300, 128, 32, 16), (16, 8, 700, 128, 48, 16),
                                                      (5, 2, 40, 16, 8, 4), (3, 1, 1, 128, 32, 16),
                                                      (6, 8, 96, 64, 16, 16)])
def test_every_real_row_in_exactly_one_tile(E, K, N, block_m, tail, sub):
    g = torch.Generator().manual_seed(E * 1000 + N)
    ids = torch.randint(-1, E + 1, (N, K), generator=g, dtype=torch.int32)
    hot = torch.rand(N, K, generator=g) < 0.3  # one expert over several tiles, some experts empty
    ids = torch.where(hot, torch.zeros_like(ids), ids)
    blocks = A.align_blocks(A.sort_by_expert(ids, E), block_m)
    tails = A.split_tail_tiles(blocks, E, tail, sub)
    seen = _covered(blocks, tails)
    real = {r: int(blocks.block_expert[r // block_m]) for r in range(blocks.num_padded_rows)
            if int(blocks.sorted_ids[r]) < N * K}
    assert seen == real
    for b in range(blocks.max_blocks):
        e, n = int(blocks.block_expert[b]), int(blocks.block_rows[b])
        assert int(tails.block_expert[b]) == (-1 if e < 0 or n <= tail else e)
    assert tails.num_tail_tiles == E * (tail // sub)


def test_exact_counts():
    """Expert 0: 130 rows (a 2-row tail), 1: 128 (no tail), 2: none, 3: 20 rows (its only tile is small),
    4: 33 rows with tail 32 (stays big)."""
    counts = [130, 128, 0, 20, 33]
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])[:, None]
    blocks = A.align_blocks(A.sort_by_expert(ids, 5), 128)
    tails = A.split_tail_tiles(blocks, 5, 32, 16)
    assert blocks.block_expert[:5].tolist() == [0, 0, 1, 3, 4]
    assert tails.block_expert[:5].tolist() == [0, -1, 1, -1, 4]
    assert tails.tail_expert.tolist() == [0, -1, -1, -1, -1, -1, 3, 3, -1, -1]
    assert tails.tail_row0.tolist() == [128, 0, 0, 0, 0, 0, 384, 400, 0, 0]
    assert tails.tail_rows.tolist() == [2, 0, 0, 0, 0, 0, 16, 4, 0, 0]


@pytest.mark.parametrize("tail,sub,match", [(128, 16, "tail_rows \\(128\\) must be below"), (40, 16, "\\(40\\).*\\(16\\)"),
                                            (32, 0, "sub_m \\(0\\)"), (0, 16, "tail_rows \\(0\\)")])
def test_bad_arguments_refused(tail, sub, match):
    blocks = A.align_blocks(A.sort_by_expert(torch.zeros(4, 1, dtype=torch.int32), 2), 128)
    with pytest.raises(ValueError, match=match):
        A.split_tail_tiles(blocks, 2, tail, sub)
    with pytest.raises(ValueError, match="num_experts must be positive, got 0"):
        A.split_tail_tiles(blocks, 0, 32, 16)
