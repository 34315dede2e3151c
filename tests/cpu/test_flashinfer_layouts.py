"""Weight conversion for FlashInfer CUTLASS (epmoe.quant.flashinfer_layout) on CPU: [w1; w3] and
GPT-OSS interleaved -> [w3; w1] for weights, scales and biases; padding that keeps each expert's
scale range; the pre-rounded hidden tail; non-gated truncation; per-variant FlashInfer layout calls
(recorded by the stand-ins in flashinfer_fakes)."""

from __future__ import annotations

import pytest
import torch

from tests.cpu import flashinfer_fakes as ff
from epmoe.config import MoEConfig
from epmoe.quant.flashinfer_layout import (
    bias13_to_w31,
    convert_for_cutlass,
    cutlass_geometry,
    pad_expert_tensor,
    resolve_cutlass_variant,
    split_w13,
    swap_w13_to_w31,
    truncate_nongated_w13,
    w31,
)
from epmoe.quant.weights import ExpertWeights


def _mx_weights(E, I, H, seed, *, fmt="mxfp4", lo=110, hi=121, gated=True, bias=False):
    """Random MX-format expert weights: data bytes and E8M0 scales in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    vpe = 2 if fmt == "mxfp4" else 1

    def data(r, c):
        t = torch.randint(0, 256, (E, r, c // vpe), generator=g, dtype=torch.uint8)
        return t if fmt == "mxfp4" else t.view(torch.float8_e4m3fn)

    def scale(r, c):
        return torch.randint(lo, hi, (E, r, -(-c // 32)), generator=g, dtype=torch.uint8)

    kw = dict(format=fmt, w1=data(I, H), w1_scale=scale(I, H), w2=data(H, I), w2_scale=scale(H, I))
    if gated:
        kw.update(w3=data(I, H), w3_scale=scale(I, H))
    if bias:
        kw.update(b13=torch.randn(E, 2 * I if gated else I, generator=g), b2=torch.randn(E, H, generator=g))
    return ExpertWeights(**kw)


@pytest.fixture
def rec(monkeypatch):
    return ff.install(monkeypatch)


# ----------------------------------------------------------------------------- reordering
def test_split_and_swap_fused_and_interleaved():
    E, I, K = 2, 3, 4
    gate = torch.arange(E * I * K).view(E, I, K).float()
    up = -gate - 1
    fused = torch.cat([gate, up], dim=1)
    inter = torch.stack([gate, up], dim=2).reshape(E, 2 * I, K)  # [g0, u0, g1, u1, ...]
    assert inter[0, 1].equal(up[0, 0]) and inter[0, 2].equal(gate[0, 1])
    for layout, w13 in (("fused", fused), ("interleaved", inter)):
        g, u = split_w13(w13, layout)
        assert g.equal(gate) and u.equal(up), layout
        assert swap_w13_to_w31(w13, layout).equal(torch.cat([up, gate], dim=1)), layout
    # scales and biases follow the same rows
    bias_inter = torch.stack([torch.ones(E, I), 2 * torch.ones(E, I)], dim=2).reshape(E, 2 * I)
    assert swap_w13_to_w31(bias_inter, "interleaved").equal(torch.cat([2 * torch.ones(E, I), torch.ones(E, I)], 1))
    with pytest.raises(ValueError, match="layout 'mixed'"):
        split_w13(fused, "mixed")
    with pytest.raises(ValueError, match="even row count"):
        split_w13(torch.zeros(1, 3, 2))


def test_bias_to_w31_is_bf16_and_swapped():
    b13 = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float32)  # [gate(2); up(2)]
    out = bias13_to_w31(b13, gated=True)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[3.0, 4.0, 1.0, 2.0]]
    assert bias13_to_w31(b13, gated=False).tolist() == b13.tolist()


def test_nongated_truncation():
    w13 = torch.arange(2 * 8 * 4).view(2, 8, 4)
    s13 = torch.arange(2 * 8 * 1).view(2, 8, 1)
    w, s = truncate_nongated_w13(w13, 5, s13)
    assert w.equal(w13[:, :5]) and s.equal(s13[:, :5])
    w, s = truncate_nongated_w13(w13, 5, torch.zeros(2, 1, 1), scale_rows_per_block=128)
    assert s.shape == (2, 1, 1)
    with pytest.raises(ValueError, match="fewer than"):
        truncate_nongated_w13(w13, 9)


# ----------------------------------------------------------------------------- padding
def test_padding_preserves_each_experts_scale_range():
    seed = 7
    g = torch.Generator().manual_seed(seed)
    E = 5
    s = torch.stack([torch.randint(100 + 3 * e, 110 + 3 * e, (6, 3), generator=g, dtype=torch.uint8) for e in range(E)])
    padded = pad_expert_tensor(s, 16, 8, preserve_expert_range=True)
    assert padded[:, :6, :3].equal(s)
    for e in range(E):
        assert padded[e].min() == s[e].min() and padded[e].max() == s[e].max(), f"seed={seed} expert {e}"
    zero = pad_expert_tensor(s, 16, 8)
    assert zero[:, 6:].eq(0).all() and zero[:, :, 3:].eq(0).all()
    # fp8 / packed data move as bytes
    f8 = torch.randn(2, 3, 4).to(torch.float8_e4m3fn)
    p = pad_expert_tensor(f8, 4, 8)
    assert p.dtype == torch.float8_e4m3fn and p[:, :3, :4].view(torch.uint8).equal(f8.view(torch.uint8))
    with pytest.raises(ValueError, match="cannot pad"):
        pad_expert_tensor(s, 4, 8)


def test_prerounded_tail_is_not_copied():
    """GPT-OSS style: hidden 2880 stored in a 3072-wide tensor whose tail scales hold a filler (2^0,
    byte 127) outside the expert's real range. Only the real K columns may be copied."""
    E, real_cols, cols = 2, 90, 96  # 2880/32 and 3072/32 scale columns
    s = torch.full((E, 4, cols), 127, dtype=torch.uint8)
    s[:, :, :real_cols] = torch.randint(105, 115, (E, 4, real_cols), dtype=torch.uint8)
    out = pad_expert_tensor(s, 4, cols, copy_cols=real_cols, preserve_expert_range=True)
    assert (out <= 114).all(), "the filler tail leaked into the expert's range"
    assert out[:, :, :real_cols].equal(s[:, :, :real_cols])


def test_geometry_and_variants():
    c = MoEConfig(num_experts=8, top_k=2, hidden_size=3072, intermediate_size=2880, hidden_size_unpadded=2880)
    g = cutlass_geometry(c, "mxfp4_w4a8_humming")
    assert (g.hidden_real, g.hidden_kernel, g.intermediate_kernel, g.fc1_rows) == (2880, 3072, 2944, 5888)
    assert not g.pads_hidden
    assert cutlass_geometry(c, "bf16").intermediate_kernel == 2880
    assert resolve_cutlass_variant("mxfp4_w4a8", 90) == "mxfp4_w4a8_humming"
    assert resolve_cutlass_variant("mxfp4_w4a8", 100) == "mxfp8_mxfp4"
    assert resolve_cutlass_variant("mxfp4_w4a16", 90) == "mxfp4_w4a16"
    with pytest.raises(ValueError, match="SM\\[90\\]"):
        resolve_cutlass_variant("fp8_block", 100)
    with pytest.raises(ValueError, match="flashinfer_sm100"):
        resolve_cutlass_variant("nvfp4_w4a16", 100)


# ----------------------------------------------------------------------------- per variant
def test_w4a16_swaps_then_interleaves_weights_and_scales(rec):
    E, I, H = 2, 128, 128
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I, has_bias=True)
    w = _mx_weights(E, I, H, 3, bias=True)
    out = convert_for_cutlass(w, c, "mxfp4_w4a16")
    wi = rec.named("interleave_weights")
    si = rec.named("interleave_scales")
    assert [k["quant_type"] for k in wi] == ["fp4", "fp4"] and len(si) == 2
    assert wi[0]["weight"].equal(torch.cat([w.w3, w.w1], 1)), "fc1 must be [w3; w1] before interleaving"
    assert wi[1]["weight"].equal(w.w2)
    assert si[0]["scales"].equal(torch.cat([w.w3_scale, w.w1_scale], 1)) and si[1]["scales"].equal(w.w2_scale)
    assert out["fc1_weight"].equal(torch.cat([w.w3, w.w1], 1).flip(-1))  # the stand-in's visible change
    assert out["fc1_bias"].dtype == torch.bfloat16 and out["fc2_bias"].dtype == torch.bfloat16
    b_gate, b_up = w.b13.chunk(2, 1)
    assert out["fc1_bias"].equal(torch.cat([b_up, b_gate], 1).bfloat16())
    assert not rec.named("block_scale_interleave") and not rec.named("humming")


def test_mxfp8_activation_variant_interleaves_scales_only(rec):
    E, I, H = 2, 128, 256
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I)
    w = _mx_weights(E, I, H, 4)
    out = convert_for_cutlass(w, c, "mxfp8_mxfp4")
    assert not rec.named("interleave_weights"), "MXFP8-activation variant must not interleave weights"
    bs = rec.named("block_scale_interleave")
    assert len(bs) == 2 and bs[0]["sf"].equal(torch.cat([w.w3_scale, w.w1_scale], 1))
    assert out["fc1_scale"].shape == (E, 2 * I, H // 32)
    assert out["fc1_input_scale"].tolist() == [1.0, 1.0]
    w8 = _mx_weights(E, I, H, 5, fmt="mxfp8")
    out8 = convert_for_cutlass(w8, c, "mxfp8")
    assert out8["fc1_weight"].dtype == torch.float8_e4m3fn
    assert out8["fc1_weight"].view(torch.uint8).equal(torch.cat([w8.w3, w8.w1], 1).view(torch.uint8))


def test_humming_residuals_per_local_expert_and_padding_invariant(rec):
    """Humming residuals (x64, one per local expert) equal those of the unpadded expert: padding
    copies the expert's own scales and the pre-rounded tail (filler 127 outside the range) is dropped."""
    E, I, H_real, H = 3, 96, 96, 128
    seed = 11
    base = _mx_weights(E, I, H, seed, lo=100, hi=111)
    # pre-rounded tensors: columns beyond H_real are an untouched filler: data 0, scale 127 (2^0)
    w1s, w3s, w2s = base.w1_scale.clone(), base.w3_scale.clone(), base.w2_scale.clone()
    for s in (w1s, w3s):
        s[:, :, H_real // 32:] = 127
    w2s[:, H_real:, :] = 127
    pre = ExpertWeights(format="mxfp4", w1=base.w1, w3=base.w3, w2=base.w2, w1_scale=w1s, w3_scale=w3s, w2_scale=w2s)
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I, hidden_size_unpadded=H_real)
    out = convert_for_cutlass(pre, c, "mxfp4_w4a8_humming")
    calls = rec.named("humming")
    assert len(calls) == 2
    fc1_scale_in = calls[0]["raw_scale"]
    assert fc1_scale_in.shape == (E, 2 * 128, H // 32), "I padded to 128, both halves"
    assert (fc1_scale_in <= 110).all() and (calls[1]["raw_scale"] <= 110).all(), f"seed={seed}: filler leaked"
    # expected residual from the real scales only
    for fc, real in (("fc1", torch.cat([base.w3_scale[:, :, : H_real // 32], base.w1_scale[:, :, : H_real // 32]], 1)),
                     ("fc2", base.w2_scale[:, :H_real])):
        flat = real.reshape(E, -1)
        lo = torch.maximum(flat.max(1).values.int() - 11, flat.min(1).values.int())
        want = torch.exp2(lo.float() - 127.0) * 0.5 * 64.0
        assert out[f"{fc}_residual_scale"].shape == (E,)
        torch.testing.assert_close(out[f"{fc}_residual_scale"], want, rtol=0, atol=0, msg=f"seed={seed} {fc}")
    assert out["fc2_act_scale"].shape == () and float(out["fc2_act_scale"]) == 1.0
    # the same experts without pre-rounding give the same residuals
    rec.calls.clear()
    c2 = MoEConfig(num_experts=E, top_k=1, hidden_size=H_real, intermediate_size=I)
    real_w = ExpertWeights(
        format="mxfp4", w1=base.w1[:, :, : H_real // 2], w3=base.w3[:, :, : H_real // 2], w2=base.w2[:, :H_real],
        w1_scale=base.w1_scale[:, :, : H_real // 32], w3_scale=base.w3_scale[:, :, : H_real // 32],
        w2_scale=base.w2_scale[:, :H_real],
    )
    out2 = convert_for_cutlass(real_w, c2, "mxfp4_w4a8_humming")
    for fc in ("fc1", "fc2"):
        assert out2[f"{fc}_residual_scale"].equal(out[f"{fc}_residual_scale"]), fc
    # and a naive zero fill would have changed them (the test can fail)
    naive = pad_expert_tensor(base.w2_scale[:, :H_real], 128, H // 32)
    assert naive.reshape(E, -1).min(1).values.lt(base.w2_scale[:, :H_real].reshape(E, -1).min(1).values).all()


def test_fp8_block_scales_follow_the_swap():
    E, I, H = 2, 256, 128
    g = torch.Generator().manual_seed(5)
    w = ExpertWeights(
        format="fp8_block",
        w1=torch.randn(E, I, H, generator=g).to(torch.float8_e4m3fn), w3=torch.randn(E, I, H, generator=g).to(torch.float8_e4m3fn),
        w2=torch.randn(E, H, I, generator=g).to(torch.float8_e4m3fn),
        w1_scale=torch.rand(E, 2, 1, generator=g), w3_scale=torch.rand(E, 2, 1, generator=g), w2_scale=torch.rand(E, 1, 2, generator=g),
    )
    out = convert_for_cutlass(w, MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I), "fp8_block")
    assert out["fc1_scale"].equal(torch.cat([w.w3_scale, w.w1_scale], 1)) and out["fc1_scale"].dtype == torch.float32
    assert out["fc1_weight"].view(torch.uint8).equal(torch.cat([w.w3, w.w1], 1).view(torch.uint8))
    # I not a multiple of 128: each half pads to 128 rows so the seam stays on a block boundary
    w_odd = ExpertWeights(
        format="fp8_block", w1=w.w1[:, :200], w3=w.w3[:, :200], w2=w.w2[:, :, :200],
        w1_scale=w.w1_scale, w3_scale=w.w3_scale, w2_scale=w.w2_scale,
    )
    out = convert_for_cutlass(w_odd, MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=200), "fp8_block")
    assert out["fc1_weight"].shape == (E, 512, H) and out["fc1_scale"].shape == (E, 4, 1)
    assert out["fc1_weight"][:, 200:256].view(torch.uint8).eq(0).all()


def test_nvfp4_global_factors(rec):
    E, I, H = 2, 128, 128
    g = torch.Generator().manual_seed(9)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    sc = lambda *s: torch.rand(*s, generator=g).to(torch.float8_e4m3fn)  # noqa: E731
    gs = torch.tensor([0.5, 0.25])
    w = ExpertWeights(
        format="nvfp4", w1=u8(E, I, H // 2), w3=u8(E, I, H // 2), w2=u8(E, H, I // 2),
        w1_scale=sc(E, I, H // 16), w3_scale=sc(E, I, H // 16), w2_scale=sc(E, H, I // 16),
        w1_global_scale=gs, w3_global_scale=gs.clone(), w2_global_scale=torch.tensor([2.0, 4.0]),
        w13_input_scale=torch.tensor([0.1, 0.2]), w2_input_scale=torch.tensor([0.05, 0.01]),
    )
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I)
    out = convert_for_cutlass(w, c, "nvfp4")
    torch.testing.assert_close(out["fc1_act_global_scale"], torch.tensor(5.0))
    torch.testing.assert_close(out["fc1_dequant_scale"], torch.tensor([0.1, 0.05]))
    torch.testing.assert_close(out["fc2_dequant_scale"], torch.tensor([0.1, 0.2]))
    assert len(rec.named("block_scale_interleave")) == 2
    from dataclasses import replace

    # gate and up with different weight_scale_2: the shared max per expert, the smaller side's block
    # scales rescaled (as vLLM / SGLang do; quant.checkpoint_formats.shared_gate_up_global_scale)
    rec.calls.clear()
    out = convert_for_cutlass(replace(w, w3_global_scale=torch.tensor([0.5, 0.3])), c, "nvfp4")
    torch.testing.assert_close(out["fc1_dequant_scale"], torch.tensor([0.2 * 0.5, 0.2 * 0.3]))
    with pytest.raises(ValueError, match="static activation scales"):
        convert_for_cutlass(replace(w, w13_input_scale=None), c, "nvfp4")


def test_bf16_variant_and_wrong_format():
    E, I, H = 2, 4, 8
    w = ExpertWeights(w1=torch.randn(E, I, H), w3=torch.randn(E, I, H), w2=torch.randn(E, H, I))
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I)
    out = convert_for_cutlass(w, c, "bf16")
    assert out["fc1_weight"].equal(torch.cat([w.w3, w.w1], 1).bfloat16()) and out["fc2_weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="takes mxfp4 expert weights, got unquantized"):
        convert_for_cutlass(w, c, "mxfp4_w4a16")


def test_nongated_conversion_has_no_up_half(rec):
    E, I, H = 2, 128, 128
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I, activation="relu2")
    w = _mx_weights(E, I, H, 8, gated=False)
    out = convert_for_cutlass(w, c, "mxfp4_w4a16")
    assert rec.named("interleave_weights")[0]["weight"].equal(w.w1)
    assert out["fc1_weight"].shape == (E, I, H // 2)
