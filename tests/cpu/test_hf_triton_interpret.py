"""The bf16 logits bound of tests/gpu/test_hf_integration_gpu.py on CPU, with the triton experts under
the Triton interpreter (GPU rounding), for the tiny GPT-OSS model (biases, clamped swiglu, gate/up
interleaved in the checkpoint) that failed on the H200 with a max error of 0.896 (bound 0.046).

That failure was a routing flip, not the experts' numerics: a layer-1 token's 2nd and 3rd router
scores are 0.0054 apart in float32, within the bf16 models' noise, and the epmoe model picked the
other expert. The comparison now replays the float32 model's routing in both bf16 models
(`tests.cpu.hf_models.routing`); the triton experts are then as close to the truth as transformers'
own bf16 model."""

import importlib.util
import os

import pytest

from tests.cpu.interpret import run_interpret_worker

pytest.importorskip("transformers", minversion="5.17")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = ["gpt_oss:0"]
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hf_triton_interpret_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES)


def _bound(r):
    return 2 * r["hf"] + 2 ** -8 * r["scale"]


def test_gpt_oss_triton_bf16_logits_within_bound_on_replayed_routing(results):
    r = results["gpt_oss:0"]
    assert r["ok"], r.get("error")
    assert r["experts_backend"] == "triton", r
    assert r["ep"] <= _bound(r), (r, _bound(r))

