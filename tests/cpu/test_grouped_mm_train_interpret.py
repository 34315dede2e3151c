"""The grouped_mm experts' fused training stage under the Triton interpreter (CPU): the gather,
activation and weighted-combine kernels and their backward kernels against the torch composite (the same
float32 arithmetic) and float64 autograd, every activation; bf16 within bf16 error; no local entry;
repeated backward bit-equal (no atomics). The worker: _grouped_mm_train_interpret_worker.py."""

import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytest.importorskip("triton")

WORKER = os.path.join(os.path.dirname(__file__), "_grouped_mm_train_interpret_worker.py")
# bf16 without the clamp: where bf16 rounding moves h across the limit the clamp's gradient flips (0 or
# not) against float64, as in any bf16 arithmetic; the clamp's gradient is checked in float32
CASES = ["silu", "swiglu_clamp", "swiglu_ab", "relu2", "silu:bf16", "swiglu_ab:bf16", "silu:none_local"]


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(WORKER, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_fused_training_stage(results, case):
    r = case_result(results, case)
    assert r["repeat_equal"], r
    assert r["token3_grad_zero"], r
    bound = 3e-2 if case.endswith(":bf16") else 1e-5
    bad = {k: v for k, v in r["vs_float64"].items() if not v <= bound}
    assert not bad, (case, r["seed"], r["vs_float64"])
    if "vs_composite" in r:
        bad = {k: v for k, v in r["vs_composite"].items() if not v <= 1e-5}
        assert not bad, (case, r["seed"], r["vs_composite"])
