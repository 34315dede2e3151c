"""The GPU routing alignment (`align_blocks_triton`: three Triton kernels, or the one-program
`align_small_kernel`, both run on every case; `sort_by_expert_triton`: one launch of
`align_sort_kernel`; `split_tail_tiles_triton`: one launch of `tail_tiles_kernel`) under the Triton interpreter equals the
torch one (`align_blocks(sort_by_expert(...))`) field by field: invalid ids on both sides, empty
experts, one hot expert over several tiles, more entries than one scan chunk (1024), a single entry,
no entry, E not a power of two, E = 1000, top_k = 1, block_m not a power of two."""

import importlib.util
import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = ["4,3,9,16", "8,2,37,4", "5,4,300,16", "3,1,1,32", "16,8,700,128", "6,8,128,16", "100,4,256,8",
         "1000,2,9,16", "7,1,5,16", "4,2,0,16", "5,3,40,24"]  # E, K, N, block_m
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_align_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES)


@pytest.mark.parametrize("case", CASES)
def test_triton_alignment_equals_torch(results, case):
    r = case_result(results, case)
    assert r["all_equal"], f"{case} (seed {r['seed']}): {r}"
