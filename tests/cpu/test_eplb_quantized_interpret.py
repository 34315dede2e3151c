"""Quantized experts move between ranks as stored: a triton layer (fp8 blocks, NVFP4 / MXFP4 W4A16 with
their paired scales, global scales and fp4 layouts) rebalanced to a placement that moves slots between
and within ranks holds, byte for byte, what a layer loaded directly under that placement holds. 2 gloo
ranks under the Triton interpreter (CPU), in a subprocess (TRITON_INTERPRET must be set before triton
is imported). grouped_mm (bf16, biases with a padding row) the same way."""

import importlib.util
import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = ["triton:fp8_block", "triton:nvfp4_w4a16", "triton:mxfp4_w4a16", "triton:bf16", "grouped_mm:bf16"]
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_eplb_triton_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_moved_slots_hold_the_bytes_of_a_load_under_the_placement(results, case):
    r = case_result(results, case)
    mode = case.split(":")[1]
    for rank, got in enumerate(r["ranks"]):
        assert not got["differ"], (case, rank, got)
        assert got["moved"] == 4 and got["bytes"] > 0, got  # 2 from the other rank, 2 within the rank
        if mode != "bf16":
            assert "w13_scale" in got["names"] and "w2_scale" in got["names"], got
        if mode == "nvfp4_w4a16":
            assert "w13_global_scale" in got["names"], got
