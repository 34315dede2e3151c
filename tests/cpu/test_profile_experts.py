"""benchmarks/profile_experts.py's idle-gap arithmetic on hand-made kernel spans (the trace itself
needs a GPU)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from profile_experts import idle_before  # noqa: E402


def test_gaps_are_attributed_to_the_kernel_after_them_per_forward():
    # two forwards: align 0-10, (sync gap 40) gather 50-60, gemm 65-100; align 130-140, gather 200-210, gemm 210-250
    spans = [("align", 0, 10), ("gather", 50, 60), ("gemm", 65, 100),
             ("align", 130, 140), ("gather", 200, 210), ("gemm", 210, 250)]
    got = dict(idle_before(spans, iters=2))
    assert got["gather"] == pytest.approx((40 + 60) / 1000 / 2)
    assert got["gemm"] == pytest.approx(5 / 1000 / 2)
    assert got["align"] == pytest.approx(30 / 1000 / 2)  # the first kernel has no gap before it
    assert [k for k, _ in idle_before(spans, 2)] == ["gather", "align", "gemm"]


def test_overlapping_and_unsorted_spans_leave_no_false_gap():
    spans = [("b", 5, 8), ("a", 0, 20), ("c", 20, 30), ("d", 31, 32)]
    assert idle_before(spans, iters=1) == [("d", pytest.approx(0.001))]
    assert idle_before([], iters=1) == []
