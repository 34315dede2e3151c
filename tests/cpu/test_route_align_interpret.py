"""The routing launch that also aligns (`Router.route_aligned`: `route_align_kernel`, one program) under
the Triton interpreter equals the two launches it replaces (fused routing, one-program alignment) and
the torch alignment field by field: softmax and sigmoid_grouped (with and without correction bias),
one token, T * top_k at the one-program limit (1024), E not a power of two, block_m 8 / 16 / 32, a row
of NaN logits (ids -1), strided logits; where it does not apply (too many entries, no tokens, torch
routing) the routing alone. And the ep = 1 layer (torch dispatcher, triton experts) launches it instead
of the routing and alignment kernels, with the same bits as without it and within bf16 error of the
float64 reference."""

import importlib.util
import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = [  # route,routing,E,K,T,block_m,extra
    "route,softmax,16,4,1,16,none", "route,softmax,60,6,37,16,nan", "route,softmax,128,8,128,16,none",
    "route,softmax,24,3,9,8,strided", "route,sigmoid_grouped,64,8,33,32,none",
    "route,sigmoid_grouped,72,6,17,16,nobias", "route,sigmoid_grouped,32,4,11,16,nan",
    "not_applied", "layer,softmax,13", "layer,sigmoid_grouped,6",
]
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_route_align_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES)


@pytest.mark.parametrize("case", CASES)
def test_route_align_equals_the_two_launches(results, case):
    r = case_result(results, case)
    assert r["all_equal"], f"{case} (seed {r['seed']}): {r}"
