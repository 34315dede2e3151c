"""Triton-interpreter worker (TRITON_INTERPRET=1): the GPU routing alignment
(`align_blocks_triton`, `sort_by_expert_triton`, `split_tail_tiles_triton`) against the torch one, field by field, exactly.
Case "E,K,N,block_m"; one JSON line per case."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.cpu.interpret import report_cases  # noqa: E402
from epmoe.experts.triton import align as A  # noqa: E402
from epmoe.experts.triton import triton_kernels as TK  # noqa: E402


def launch(name, grid, args, kwargs):
    getattr(TK, name)[grid](*args, **kwargs)


def _count_launches(fn) -> int:
    """How many kernels fn launches (recorded, not run: no output of fn is read)."""
    global launch
    n, real = [0], launch

    def counting(*a):
        n[0] += 1

    launch = counting
    try:
        fn()
    finally:
        launch = real
    return n[0]


def run_case(E: int, K: int, N: int, bm: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # ids in [-2, E + 1]: invalid on both sides; a skewed routing so some experts are empty and
    # some span several tiles
    ids = torch.randint(-2, E + 2, (N, K), generator=g, dtype=torch.int32)
    hot = torch.rand(N, K, generator=g) < 0.3
    ids = torch.where(hot, torch.zeros_like(ids), ids)
    ref_sort = A.sort_by_expert(ids, E)
    ref = A.align_blocks(ref_sort, bm)
    A.SINGLE_LAUNCH_MAX_ENTRIES = 0  # three kernels
    got = A.align_blocks_triton(ids, E, bm, launch)
    A.SINGLE_LAUNCH_MAX_ENTRIES = 1 << 30  # one program (align_small_kernel), whatever the size
    one = A.align_blocks_triton(ids, E, bm, launch)
    srt = A.sort_by_expert_triton(ids, E, launch)
    res = dict(
        max_blocks=(got.max_blocks, ref.max_blocks),
        sorted_ids=bool(torch.equal(got.sorted_ids, ref.sorted_ids)),
        block_expert=bool(torch.equal(got.block_expert, ref.block_expert)),
        block_rows=bool(torch.equal(got.block_rows, ref.block_rows)),
        single_launch=bool(one.max_blocks == ref.max_blocks and torch.equal(one.sorted_ids, ref.sorted_ids)
                           and torch.equal(one.block_expert, ref.block_expert)
                           and torch.equal(one.block_rows, ref.block_rows)),
        order=bool(torch.equal(srt.order.long(), ref_sort.order)),
        sorted_expert=bool(torch.equal(srt.sorted_expert, ref_sort.sorted_expert)),
        expert_ends=bool(torch.equal(srt.expert_ends.long(), ref_sort.expert_ends)),
        expert_counts=bool(torch.equal(srt.expert_counts.long(), ref_sort.expert_counts)),
        inverse=bool(torch.equal(srt.inverse.long()[ref_sort.order], torch.arange(N * K))),
        launches_one=_count_launches(lambda: A.align_blocks_triton(ids, E, bm, launch)) == (1 if N else 0),
        sort_one_launch=_count_launches(lambda: A.sort_by_expert_triton(ids, E, launch)) == 1,
        invalid=int(((ids < 0) | (ids >= E)).sum()),
    )
    if ref.max_blocks and bm >= 3:  # the tail split (`tail_tiles_kernel`) against its torch form
        sub = max(1, bm // 8)
        want = A.split_tail_tiles(ref, E, 2 * sub, sub)
        tails = A.split_tail_tiles_triton(ref, E, 2 * sub, sub, launch)
        res["tail_tiles"] = all(bool(torch.equal(getattr(tails, n), getattr(want, n)))
                                for n in ("block_expert", "tail_expert", "tail_row0", "tail_rows"))
    res["all_equal"] = all(v for k, v in res.items() if isinstance(v, bool)) and res["max_blocks"][0] == res["max_blocks"][1]
    return res


def main() -> None:
    report_cases(sys.argv[1:], lambda case, seed: run_case(*(int(v) for v in case.split(",")), seed))


if __name__ == "__main__":
    main()
