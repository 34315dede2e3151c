"""The packed fp4 -> bf16 conversion of the W4A16 GEMM loops (`_fp4_dequant_packed`) under the Triton
interpreter: bit for bit the legacy conversion (`_fp4_dequant`) on every byte value with every finite
e4m3 scale (nvfp4, where the packed weights carry 2^-7 that the global scale takes back) and e8m0
exponents 0..128 (mxfp4); and the nvfp4 / mxfp4 experts forward (biases, clamped swiglu, invalid
slots) gives the same output bits with either conversion. The interpreter is patched to do bf16
arithmetic like the GPU (`tests/triton_interpret.py`: RNE, subnormals kept)."""

import importlib.util
import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = ["convert:mxfp4", "convert:nvfp4", "forward:mxfp4_w4a16", "forward:nvfp4_w4a16"]
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fp4_convert_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES)


@pytest.mark.parametrize("case", CASES)
def test_packed_fp4_conversion_is_bit_exact(results, case):
    r = case_result(results, case)
    if case.startswith("convert"):
        assert r["nonzero"] > 1000, r
        assert r["mismatch"] == 0, f"{case} (seed {r['seed']}): {r}"
    else:
        assert r["equal"], f"{case} (seed {r['seed']}): packed vs legacy output differ by {r['max_diff']}"
