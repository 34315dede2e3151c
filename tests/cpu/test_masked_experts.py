"""MaskedReferenceExperts (the masked layout of DeepEP's low-latency dispatcher) against a float64
per-token reference written from MoEConfig's math; the masked-layout plan rules."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.dispatch.base import DispatchedTokens
from epmoe.experts import EXPERTS, ExpertsSpec
from epmoe.experts.masked import MaskedReferenceExperts, masked_expert_mode_support
from epmoe.quant.payload import QuantizedActivation
from epmoe.quant.plan import QuantPlan
from tests.cpu.helpers import fresh_seed, random_weights

CONFIGS = {
    "swiglu": dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=48),
    "gpt_oss_bias": dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=32, has_bias=True,
                         swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0),
    "relu2_bias": dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=40, activation="relu2",
                       has_bias=True),
}


def _expert_f64(cfg: MoEConfig, w, e: int, x: torch.Tensor) -> torch.Tensor:
    """One token x [H] through global expert e, float64, straight from the MoEConfig docstring."""
    x = x.double()
    I = cfg.intermediate_size
    g = w.w1[e].double() @ x
    u = w.w3[e].double() @ x if cfg.is_gated else None
    if cfg.has_bias:
        b13 = w.b13[e].double()
        g = g + b13[:I]
        if cfg.is_gated:
            u = u + b13[I:]
    if cfg.activation == "relu2":
        a = torch.clamp(g, min=0) ** 2
    elif cfg.swiglu_alpha is None:
        a = g * torch.sigmoid(g) * u
    else:
        g = torch.clamp(g, max=cfg.swiglu_limit)
        u = torch.clamp(u, -cfg.swiglu_limit, cfg.swiglu_limit)
        a = g * torch.sigmoid(cfg.swiglu_alpha * g) * (u + cfg.swiglu_beta)
    y = w.w2[e].double() @ a
    return y + w.b2[e].double() if cfg.has_bias else y


def _experts(cfg, ep_rank=1, ep_size=2, plan=None, **opts):
    spec = ExpertsSpec(config=cfg, ep_rank=ep_rank, ep_size=ep_size, device=torch.device("cpu"), plan=plan,
                       options=tuple(sorted(opts.items())))
    return MaskedReferenceExperts(spec)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_reference_matches_float64_per_token(name, dtype):
    seed = fresh_seed()
    cfg = MoEConfig(dtype=dtype, **CONFIGS[name])
    w = random_weights(cfg, seed)
    ex = _experts(cfg)
    first = ex.spec.first_local_expert
    ex.load_weights(w.slice_experts(first, first + ex.spec.num_local_experts))
    E, M, H = ex.spec.num_local_experts, 6, cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(E, M, H, generator=g).to(dtype)
    counts = torch.tensor([M, 0, 3, 1], dtype=torch.int32)
    x[1:, M - 1] = float("nan")  # past the counts: must never be read
    out = ex(DispatchedTokens(hidden=x, topk_ids=None, topk_weights=None, layout="masked", expert_counts=counts))
    assert out.shape == (E, M, H) and out.dtype == dtype
    for e in range(E):
        n = int(counts[e])
        assert (out[e, n:] == 0).all(), f"{name} seed {seed}: rows past count of expert {e} are not zero"
        for r in range(n):
            ref = _expert_f64(cfg, w, first + e, x[e, r])
            err = (out[e, r].double() - ref).abs().max() / ref.abs().max()
            # fp32 math: ~1e-6; bf16: the output rounding (half an ulp, 2^-9) on top
            tol = 2e-5 if dtype == torch.float32 else 4e-3
            assert err < tol, f"{name} {dtype} seed {seed}: expert {e} row {r} rel err {err:.3g}"


def test_fp8_activations_are_dequantized_like_the_wire_format():
    from epmoe.dispatch.deepep import fp8_block_format, fp8_block_quantize  # test-only: the dispatcher's format

    seed = fresh_seed()
    cfg = MoEConfig(dtype=torch.bfloat16, **CONFIGS["swiglu"])
    w = random_weights(cfg, seed)
    plan = QuantPlan(expert_mode="fp8_block", dispatch_dtype="fp8", experts_backend="masked_reference")
    ex = _experts(cfg, ep_rank=0, plan=plan)
    assert ex.payload_format == fp8_block_format()
    ex.load_weights(w.slice_experts(0, 4))
    E, M, H = 4, 4, cfg.hidden_size
    x = torch.randn(E * M, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    data, scales = fp8_block_quantize(x)
    # scales with DeepEP's strides: a transposed view of a column-major [E, H/128, M] buffer
    cm = torch.empty(E, H // 128, M).transpose(1, 2)
    cm.copy_(scales.view(E, M, H // 128))
    q = QuantizedActivation(format=fp8_block_format(), data=data.view(E, M, H), scales=cm, hidden_size=H)
    counts = torch.tensor([4, 2, 0, 1], dtype=torch.int32)
    out = ex(DispatchedTokens(hidden=q, topk_ids=None, topk_weights=None, layout="masked", expert_counts=counts))
    deq = (data.float().view(E * M, H // 128, 128) * scales.unsqueeze(-1)).view(E, M, H)
    for e in range(E):
        for r in range(int(counts[e])):
            ref = _expert_f64(cfg, w, e, deq[e, r])
            err = (out[e, r].double() - ref).abs().max() / ref.abs().max()
            assert err < 4e-3, f"seed {seed}: expert {e} row {r} rel err {err:.3g}"


def test_bad_inputs_name_the_problem():
    cfg = MoEConfig(dtype=torch.float32, **CONFIGS["swiglu"])
    ex = _experts(cfg)
    x = torch.zeros(4, 3, 128)
    ok = torch.tensor([1, 0, 0, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="before load_weights"):
        ex(DispatchedTokens(hidden=x, topk_ids=None, topk_weights=None, layout="masked", expert_counts=ok))
    ex.load_weights(random_weights(cfg, 1).slice_experts(4, 8))
    with pytest.raises(ValueError, match="takes the masked layout, got 'flat'.*deepep_ll"):
        ex(DispatchedTokens(hidden=x[0], topk_ids=torch.zeros(3, 2, dtype=torch.int32),
                            topk_weights=torch.ones(3, 2)))
    with pytest.raises(ValueError, match=r"shape \[4, 3, 64\]; expected \[4, max_rows, 128\]"):
        ex(DispatchedTokens(hidden=torch.zeros(4, 3, 64), topk_ids=None, topk_weights=None, layout="masked",
                            expert_counts=ok))
    with pytest.raises(ValueError, match=r"expert_counts has shape \[3\]; expected \[4\]"):
        ex(DispatchedTokens(hidden=x, topk_ids=None, topk_weights=None, layout="masked",
                            expert_counts=ok[:3]))
    with pytest.raises(ValueError, match=r"\(2, 4\).*outside \[0, 3\]"):
        ex(DispatchedTokens(hidden=x, topk_ids=None, topk_weights=None, layout="masked",
                            expert_counts=torch.tensor([0, 0, 4, 0], dtype=torch.int32)))
    with pytest.raises(ValueError, match="expert weights lack"):
        ex.load_weights(random_weights(cfg, 1).slice_experts(0, 4).__class__(
            w1=torch.zeros(4, 48, 128), w2=torch.zeros(4, 128, 48), first_expert=4))


def test_masked_layout_plan_rules():
    for mode in ("bf16", "fp8_block", "nvfp4_w4a4"):
        assert masked_expert_mode_support(mode), mode
    a = masked_expert_mode_support("nvfp4_w4a16")
    assert not a and "W4A4 only" in a.reason and "nvfp4_w4a4" in a.hint
    for mode in ("mxfp4_w4a16", "mxfp4_w4a8", "mxfp8"):
        a = masked_expert_mode_support(mode)
        assert not a and mode in a.reason and "flat-layout" in a.hint
    cfg = MoEConfig(dtype=torch.bfloat16, **CONFIGS["swiglu"])

    def spec(mode):
        return ExpertsSpec(config=cfg, ep_rank=0, ep_size=1, device=torch.device("cpu"),
                           plan=QuantPlan(expert_mode=mode, experts_backend="masked_reference"))

    assert MaskedReferenceExperts.availability(spec("bf16"))
    a = MaskedReferenceExperts.availability(spec("nvfp4_w4a16"))
    assert not a and "W4A4 only" in a.reason
    a = MaskedReferenceExperts.availability(spec("nvfp4_w4a4"))  # a masked mode, but not in the reference
    assert not a and "masked reference implements" in a.reason
    with pytest.raises(ValueError, match="W4A4 only"):
        MaskedReferenceExperts(spec("nvfp4_w4a16"))


def test_registered_and_reload_in_place():
    assert EXPERTS.get("masked_reference") is MaskedReferenceExperts
    assert MaskedReferenceExperts.accepted_layouts == ("masked",)
    cfg = MoEConfig(dtype=torch.float32, **CONFIGS["relu2_bias"])
    ex = _experts(cfg, ep_rank=0)
    ex.load_weights(random_weights(cfg, 1).slice_experts(0, 4))
    before = {k: v.data_ptr() for k, v in ex.parameters().items()}
    ex.load_weights(random_weights(cfg, 2).slice_experts(0, 4))
    assert {k: v.data_ptr() for k, v in ex.parameters().items()} == before
    assert torch.equal(ex.parameters()["w2"], random_weights(cfg, 2).w2[:4])
