"""TritonExperts kernels under the Triton interpreter (CPU), against the float64 math.

The interpreter needs TRITON_INTERPRET=1 before triton is imported, so the cases run in one
subprocess (this process may also hold compiled GPU kernels). Tiny shapes; ~10-20 s in all.
Error bound: bf16 rounding of the gemm1 activation, of each weighted expert output and of the sum
(~2-3e-3 observed) -> 8e-3. fp8/fp4: the reference uses the dequantized weights (and fp8
activations, with the same 1x128 round trip of the intermediate), so the bound is the same.
Case options: split (32-row tiles, expert tails <= 16 rows on the half-height path; the routing
forces both kinds), blocked ([gate; up] w13 instead of interleaved rows), nonuniform (x groups and
weight blocks scaled by 2^k, so fp8 groups have very different amax), stages (fp8: the quantizer
bit for bit vs the torch codec, gemm1's fp8 bytes and scales vs float64 math); grouped_mm / gmm: the
torch._grouped_mm path with the fused Triton epilogues (reference with its bf16 roundings of gemm1's
output, the activation and y).
Note: the interpreter divides with numpy (IEEE), so it cannot show the GPU's div.full.f32 rounding;
tests/cpu/test_triton_aot_sm90.py checks the compiled fp8 quantization divides with div.rn.f32.
"""

import importlib.util
import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = [
    "bf16:swiglu",  # gate/up interleaved (the default layout)
    "bf16:swiglu:blocked",
    "bf16:oai",
    "bf16:ragged",
    "bf16:ragged:split",
    "bf16:swiglu:split+blocked",
    "fp8_block:swiglu",
    "fp8_block:relu2",
    "fp8_block:ragged",
    "fp8_block:groups:nonuniform+stages",
    "fp8_block:groups:split+stages",
    "nvfp4_w4a16:oai",
    "mxfp4_w4a16:relu2",
    "mxfp4_w4a16:swiglu:split",
    # torch._grouped_mm (CPU fallback) + the fused gather / activation / combine kernels
    "grouped_mm:swiglu",
    "grouped_mm:oai",
    "grouped_mm:relu2",
    "bf16:swiglu:gmm",  # the triton backend's grouped_mm path (gate/up interleaved weights)
    "bf16:oai:gmm+blocked",
    "bf16:ragged:gmm",
    "bf16:ragged:gmm+talign",  # grouped_mm path with the torch alignment (inverse by torch scatter)
    "bf16:ragged:talign",
]
BOUND = 8e-3
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton_interpret_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES)


@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_match_float64(results, case):
    r = case_result(results, case)
    assert r["finite"], f"{case} (seed {r['seed']}): non-finite output"
    assert r["empty_rows_zero"], f"{case} (seed {r['seed']}): rows with no local expert are not zero"
    assert r["dtype"] == "torch.bfloat16"
    assert r["err"] < BOUND, f"{case} (seed {r['seed']}): relative error {r['err']:.3g} >= {BOUND}"
    if "split" in case:
        assert r["tiles_full"] >= 1 and r["tiles_half"] >= 1, f"{case}: both tile heights must run: {r}"
    if "stages" in case:
        # The in-kernel quantizer is the torch codec bit for bit; gemm1's fp8 output equals the
        # float64 math quantized the same way (a rounding flip needs an fp32-vs-float64 difference
        # within ~1e-7 of an e4m3 tie: ~0 of these few thousand values; a wrong group scale
        # would flip most of a group, the pow2-scaled groups make it a x2..x256 error).
        assert r["xq_mismatch"] == 0.0 and r["xs_equal"], f"{case}: input quantizer != torch codec: {r}"
        assert r["act_mismatch"] < 2e-3, f"{case}: gemm1 fp8 bytes differ from float64 math: {r}"
        assert r["act_scale_rel"] < 1e-5, f"{case}: gemm1 1x128 scales differ from float64 math: {r}"
