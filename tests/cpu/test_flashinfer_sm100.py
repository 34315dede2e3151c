"""SM100 FlashInfer experts (CuTe-DSL NVFP4, TRT-LLM-gen MXFP4 W4A16) call assembly on CPU:
W4A16 passes BF16 activations straight through (no scales), W4A4 quantizes to NVFP4 first, the
CuTe-DSL W4A16 version gate, [up; gate] weights to FlashInfer's preparers, global ids."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.dispatch.base import DispatchedTokens
from epmoe.experts.base import ExpertsSpec
from epmoe.experts.flashinfer_sm100 import (
    cutedsl_run_kwargs,
    cutedsl_wrapper_kwargs,
    dequantize_expert_weights,
    sanitized_global_ids,
    trtllm_routed_kwargs,
)
from epmoe.quant.weights import ExpertWeights
from tests.cpu import flashinfer_fakes as ff

PARAMS = {k: torch.full((2,), float(i)) for i, k in enumerate(
    ["w1_weight", "w1_weight_sf", "w1_alpha", "fc2_input_scale", "w2_weight", "w2_weight_sf", "w2_alpha"])}


def test_sanitized_global_ids():
    ids = torch.tensor([[0, -1], [3, 2]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.7], [0.1, 0.2]])
    g, gw = sanitized_global_ids(ids, w, first_local_expert=4, num_local_experts=4, ep_size=2)
    assert g.tolist() == [[4, 0], [7, 6]], "-1 -> first expert of the next rank (skipped as non-local)"
    assert torch.equal(gw, w)
    g, gw = sanitized_global_ids(ids, w, first_local_expert=0, num_local_experts=4, ep_size=1)
    assert g.tolist() == [[0, 0], [3, 2]] and gw[0, 1] == 0.0, "one rank: local expert 0 with weight 0"


def test_cutedsl_w4a16_passes_bf16_through():
    x = torch.randn(3, 8).bfloat16()
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    kw = cutedsl_run_kwargs("w4a16", PARAMS, x=x, x_sf=None, topk_ids=ids, topk_weights=w)
    assert kw["x"] is x and kw["x_sf"] is None and kw["fc2_input_scale"] is None
    with pytest.raises(ValueError, match="x_sf=None"):
        cutedsl_run_kwargs("w4a16", PARAMS, x=x, x_sf=torch.zeros(3, 1), topk_ids=ids, topk_weights=w)
    q = torch.zeros(3, 4, dtype=torch.uint8)
    kw = cutedsl_run_kwargs("w4a4", PARAMS, x=q, x_sf=torch.zeros(3, 1), topk_ids=ids, topk_weights=w)
    assert kw["fc2_input_scale"] is PARAMS["fc2_input_scale"]
    with pytest.raises(ValueError, match="packed NVFP4"):
        cutedsl_run_kwargs("w4a4", PARAMS, x=x, x_sf=None, topk_ids=ids, topk_weights=w)


def test_cutedsl_wrapper_version_gate_and_kwargs():
    c = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=128)
    acc = frozenset({"quant_mode"})
    kw = cutedsl_wrapper_kwargs("w4a4", c, num_local_experts=4, first_local_expert=4, deterministic=True,
                                activation_enum=ff.ActivationType, accepted=acc, version="0.6.17")
    assert "quant_mode" not in kw and kw["use_fused_finalize"] is False and kw["local_expert_offset"] == 4
    kw = cutedsl_wrapper_kwargs("w4a16", c, num_local_experts=4, first_local_expert=0, deterministic=False,
                                activation_enum=ff.ActivationType, accepted=acc, version="0.6.18")
    assert kw["quant_mode"] == "w4a16"
    with pytest.raises(ValueError, match="0.6.18rc1"):
        cutedsl_wrapper_kwargs("w4a16", c, num_local_experts=4, first_local_expert=0, deterministic=False,
                               activation_enum=ff.ActivationType, accepted=acc, version="0.6.18rc1")
    oss = c.replace(has_bias=True, swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)
    kw = cutedsl_wrapper_kwargs("w4a4", oss, num_local_experts=4, first_local_expert=0, deterministic=False,
                                activation_enum=ff.ActivationType, accepted=acc, version="0.7.2")
    assert (kw["swiglu_alpha"], kw["swiglu_beta"], kw["swiglu_limit"]) == (1.702, 1.0, 7.0)


def test_trtllm_w4a16_bf16_pass_through():
    c = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    x = torch.randn(3, 128).bfloat16()
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    p = {k: torch.zeros(1) for k in ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale")}
    kw = trtllm_routed_kwargs(p, c, x=x, topk_ids=ids, topk_weights=w, first_local_expert=4, num_local_experts=4)
    assert kw["hidden_states"] is x and kw["hidden_states_scale"] is None
    assert kw["topk_ids"][0] is ids and kw["local_expert_offset"] == 4 and kw["local_num_experts"] == 4
    with pytest.raises(ValueError, match="BF16"):
        trtllm_routed_kwargs(p, c, x=x.float(), topk_ids=ids, topk_weights=w, first_local_expert=0, num_local_experts=8)


def _backend(monkeypatch, cls_name, mode, config, ep_size=2, ep_rank=1):
    rec = ff.install(monkeypatch)
    import epmoe.experts.flashinfer_sm100 as m
    from epmoe.core.availability import Availability

    cls = getattr(m, cls_name)
    monkeypatch.setattr(cls, "availability", classmethod(lambda c, spec: Availability.yes()))
    spec = ExpertsSpec(config=config, ep_rank=ep_rank, ep_size=ep_size, device=torch.device("cpu"), options=(("mode", mode),))
    return cls(spec), rec


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "nvfp4_w4a4"])
def test_cutedsl_backend(monkeypatch, mode):
    E, I, H = 8, 64, 128
    c = MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I)
    ex, rec = _backend(monkeypatch, "FlashInferCuteDslExperts", mode, c)
    g = torch.Generator().manual_seed(3)
    w = ExpertWeights(w1=torch.randn(4, I, H, generator=g), w3=torch.randn(4, I, H, generator=g),
                      w2=torch.randn(4, H, I, generator=g), first_expert=4)
    ex.load_weights(w)
    prep = rec.named("prepare_cute_dsl_weights")[0]
    assert prep["w1"].equal(torch.cat([w.w3, w.w1], 1).bfloat16()), "FlashInfer's preparer takes [up; gate]"
    ctor = rec.named("CuteDslMoEWrapper")[0]
    assert ctor["num_local_experts"] == 4 and ctor["local_expert_offset"] == 4
    x = torch.randn(3, H).bfloat16()
    ex(DispatchedTokens(x, torch.tensor([[0, -1], [3, 1], [-1, -1]], dtype=torch.int32), torch.rand(3, 2)))
    run = rec.named("cutedsl_run")[0]
    assert run["token_selected_experts"].tolist() == [[4, 0], [7, 5], [0, 0]]
    if mode == "nvfp4_w4a16":
        assert ctor["quant_mode"] == "w4a16" and run["x"] is x and run["x_sf"] is None
        assert not rec.named("fp4_quantize"), "W4A16 must not quantize activations"
    else:
        assert ctor["quant_mode"] == "w4a4" and run["x"].dtype == torch.uint8
        assert run["x_sf"].dtype == torch.float8_e4m3fn and run["x_sf"].shape == (3, H // 16)
        assert rec.named("fp4_quantize")[0]["swizzled"] is False


def test_trtllm_backend(monkeypatch):
    E, I, H = 8, 64, 128
    c = MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, has_bias=True,
                  swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)
    ex, rec = _backend(monkeypatch, "FlashInferTrtllmExperts", "mxfp4_w4a16", c, ep_size=1, ep_rank=0)
    g = torch.Generator().manual_seed(4)
    w = ExpertWeights(w1=torch.randn(E, I, H, generator=g), w3=torch.randn(E, I, H, generator=g),
                      w2=torch.randn(E, H, I, generator=g), b13=torch.randn(E, 2 * I, generator=g), b2=torch.randn(E, H, generator=g))
    ex.load_weights(w)
    p = ex.parameters()
    assert p["gemm1_bias"].dtype == torch.float32
    assert p["gemm1_bias"].equal(torch.cat([w.b13[:, I:], w.b13[:, :I]], 1)), "bias [up; gate]"
    assert p["gemm1_clamp_limit"].tolist() == [7.0] * E
    ptr = p["gemm1_weights"].data_ptr()
    ex.load_weights(w)
    assert ex.parameters()["gemm1_weights"].data_ptr() == ptr, "reload in place"
    x = torch.randn(2, H).bfloat16()
    out = ex(DispatchedTokens(x, torch.tensor([[1, -1], [2, 3]], dtype=torch.int32), torch.rand(2, 2)))
    call = rec.named("trtllm_routed")[0]
    assert call["hidden_states"].data_ptr() == x.data_ptr() and call["hidden_states_scale"] is None
    assert out.shape == (2, H)


def test_dequantize_nvfp4_checkpoint_round_trip():
    from epmoe.experts.flashinfer_cutlass import quantize_weights_online

    g = torch.Generator().manual_seed(5)
    w = ExpertWeights(w1=torch.randn(2, 32, 64, generator=g), w3=torch.randn(2, 32, 64, generator=g),
                      w2=torch.randn(2, 64, 32, generator=g) * 50)
    for fmt in ("nvfp4", "mxfp4", "fp8_block"):
        if fmt == "fp8_block":
            w = ExpertWeights(w1=torch.randn(2, 128, 128, generator=g), w3=torch.randn(2, 128, 128, generator=g),
                              w2=torch.randn(2, 128, 128, generator=g))
        d = dequantize_expert_weights(quantize_weights_online(w, fmt))
        assert d.format is None and d.w1_scale is None
        for n in ("w1", "w3", "w2"):
            err = (getattr(d, n) - getattr(w, n)).norm() / getattr(w, n).norm()
            assert err < 0.2, f"{fmt} {n}: {err:.3f}"
