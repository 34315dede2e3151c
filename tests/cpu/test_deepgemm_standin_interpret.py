"""The `deepgemm` experts backend on CPU: our Triton passes (gather + 1x128 quantization into
DeepGEMM's contiguous layout, activation + re-quantization, combine; the masked-layout passes) under
the Triton interpreter, with a STAND-IN for DeepGEMM's grouped GEMMs (tests/cpu/fake_deep_gemm.py), against
float64 math. Stand-in: this checks the rows, m_indices, counts and scales we hand DeepGEMM, not
DeepGEMM; tests/gpu/test_deepgemm.py runs the real kernels.

Bound: fp8 (weights dequantized in the reference, activations through the same 1x128 round trips) and
bf16 (bf16 rounding of gemm1's output, the activation, y) -> 8e-3 as the triton backend's test."""

import importlib.util
import os

import pytest
import torch

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = [
    "fp8:flat",  # bf16 tokens quantized once per token in the gather
    "fp8:flat:fp8in",  # e4m3 tokens + scales as dispatched, copied
    "fp8:flat:invalid",  # slots of other ranks (-1) and rows with no local expert
    "fp8:flat:relu2",
    "fp8:flat:one",
    "fp8:flat:empty",
    "bf16:flat",
    "bf16:flat:invalid",
    "fp8:flat:big:invalid",  # > 1024 entries: m_indices and inv from the pass that places the rows
    "fp8:flat:big:invalid:overlap",  # ... the row count read while the gather runs: scales at the used rows' stride
    "bf16:flat:big",
    "bf16:flat:big:overlap",
    "bf16:flat:big:invalid:bound",  # option exact_rows off: the GEMMs on the alignment's upper bound of rows
    "fp8:masked",  # bf16 tokens quantized per expert slot
    "fp8:masked:fp8in",
    "bf16:masked",
]
BOUND = 4e-3
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deepgemm_standin_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES, timeout=400)


@pytest.mark.parametrize("case", CASES)
def test_deepgemm_passes_with_standin_gemms_match_float64(results, case):
    r = case_result(results, case)
    if case.endswith(":empty"):
        assert r["calls"] == [], "T = 0 returns without calling DeepGEMM"
        return
    assert r["err"] < BOUND, f"{case}: max rel err {r['err']:.3g} (seed {r['seed']})"
    assert r["ours_mn_major"], f"{case}: activation scales we wrote are not MN-major: {r['calls']}"
    assert len(r["calls"]) == 2
    if "empty_rows_zero" in r:
        assert r["empty_rows_zero"], "rows with no local expert must come out 0"
    if ":big" in case:  # above 1024 entries the row count comes from the GPU (exact_rows) or the bound
        want = r["bound_rows"] if case.endswith(":bound") else r["used_rows"]
        assert r["gemm_rows"] == [want], f"{case}: GEMMs ran on {r['gemm_rows']} rows, expected {want} " \
            f"(used {r['used_rows']}, bound {r['bound_rows']})"
        if ":invalid" in case:  # a third of the entries elsewhere: the bound holds unused tiles
            assert r["used_rows"] < r["bound_rows"], r


def test_deepgemm_refuses_what_it_cannot_run():
    from epmoe.core.capability import BackendRequest
    from epmoe.experts.deepgemm.backend import DeepGEMMExperts

    ok = BackendRequest(expert_mode="fp8_block", arch="sm90", packages=frozenset({"deep_gemm", "triton"}),
                        hidden_size=7168, intermediate_size=2048)
    assert DeepGEMMExperts.supports(ok)
    assert DeepGEMMExperts.supports(ok.with_(layout="masked"))
    for change, words in [
        (dict(expert_mode="nvfp4_w4a16"), "not 'nvfp4_w4a16'"),
        (dict(arch="sm100"), "sm90"),
        (dict(model_dtype="float16"), "bfloat16"),
        (dict(intermediate_size=2880 // 2), "divisible by 128"),
        (dict(has_bias=True), "biases"),
        (dict(packages=frozenset({"triton"})), "deep_gemm is not installed"),
    ]:
        r = DeepGEMMExperts.supports(ok.with_(**change))
        assert not r and words in r.reason, (change, r.reason)


def test_deepgemm_construction_without_a_gpu_says_why():
    from epmoe.config import MoEConfig
    from epmoe.core.errors import BackendUnavailableError
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.deepgemm.backend import DeepGEMMExperts
    from epmoe.quant.plan import QuantPlan

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="deep_gemm is not installed|CUDA device"):
        DeepGEMMExperts(ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode="fp8_block")))
    bias = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16, has_bias=True)
    with pytest.raises(BackendUnavailableError, match="biases"):
        DeepGEMMExperts(ExpertsSpec(bias, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode="bf16")))


def test_deepgemm_options_refuse_bad_values():
    from epmoe.experts.deepgemm.backend import DeepGEMMOptions

    assert DeepGEMMOptions.parse(None).exact_rows is True
    assert DeepGEMMOptions.parse({"exact_rows": False}).exact_rows is False
    for bad in ("false", 0, None):
        with pytest.raises(ValueError, match=r"option exact_rows=.*; use True or False"):
            DeepGEMMOptions.parse({"exact_rows": bad})
    with pytest.raises(TypeError, match="unknown .*option.*exact_row.*valid options"):
        DeepGEMMOptions.parse({"exact_row": True})
