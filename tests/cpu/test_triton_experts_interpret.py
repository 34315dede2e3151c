"""TritonExperts kernels under the Triton interpreter (CPU), against the float64 math.

The interpreter needs TRITON_INTERPRET=1 before triton is imported, so the cases run in one
subprocess (this process may also hold compiled GPU kernels). Tiny shapes; ~10-20 s in all.
Error bound: bf16 rounding of the gemm1 activation, of each weighted expert output and of the sum
(~2-3e-3 observed) -> 8e-3. fp8/fp4: the reference uses the dequantized weights (and fp8
activations, with the same 1x128 round trip of the intermediate), so the bound is the same.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = [
    "bf16:swiglu",
    "bf16:oai",
    "bf16:ragged",
    "fp8_block:swiglu",
    "fp8_block:relu2",
    "fp8_block:ragged",
    "nvfp4_w4a16:oai",
    "mxfp4_w4a16:relu2",
]
BOUND = 8e-3
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton_interpret_worker.py")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, _WORKER, *CASES], capture_output=True, text=True, env=env, timeout=240
    )
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["case"]] = r
    if not out:
        pytest.fail(f"interpreter worker produced no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_match_float64(results, case):
    r = results.get(case)
    assert r is not None, f"{case}: no result"
    assert r["ok"], f"{case} (seed {r['seed']}) raised:\n{r.get('error')}"
    assert r["finite"], f"{case} (seed {r['seed']}): non-finite output"
    assert r["empty_rows_zero"], f"{case} (seed {r['seed']}): rows with no local expert are not zero"
    assert r["dtype"] == "torch.bfloat16"
    assert r["err"] < BOUND, f"{case} (seed {r['seed']}): relative error {r['err']:.3g} >= {BOUND}"
