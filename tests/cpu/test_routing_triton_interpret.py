"""The fused routing kernels (`epmoe.routing_kernels`, impl "triton") under the Triton interpreter
equal the torch routing: the same experts per token (ties at the k-th place: the lowest expert ids,
in the order of descending weight then ascending id) and weights to ~1 ulp, for softmax and
sigmoid_grouped, T = 0 / 1 / more rows than one program, E not a power of two, top_k = 1, bf16 and
strided logits, no renormalization, no correction bias, and a row of NaN logits (-> id -1, weight 0)."""

import importlib.util
import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = [  # routing, E, K, T, extra
    "softmax,16,4,37,none", "softmax,60,1,5,none", "softmax,128,8,1,none", "softmax,128,8,0,none",
    "softmax,24,6,19,ties", "softmax,32,2,17,bf16", "softmax,20,3,9,strided", "softmax,16,4,21,norenorm",
    "sigmoid_grouped,64,6,23,none", "sigmoid_grouped,72,1,7,none", "sigmoid_grouped,32,4,18,ties",
    "sigmoid_grouped,64,8,5,nobias", "sigmoid_grouped,64,8,9,norenorm", "sigmoid_grouped,64,8,0,none",
    "nan",
]
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_routing_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES)


@pytest.mark.parametrize("case", CASES)
def test_fused_routing_equals_torch(results, case):
    r = case_result(results, case)
    assert r["all_equal"], f"{case} (seed {r['seed']}): {r}"
