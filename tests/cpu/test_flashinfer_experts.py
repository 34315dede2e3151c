"""FlashInferCutlassExperts call assembly on CPU: quant_scales slots per variant, mutually exclusive
switches, keywords only when the installed FlashInfer has them, the prerelease version gate,
local -> global expert ids, and in-place reload. cutlass_fused_moe is a recording stand-in."""

from __future__ import annotations

import pytest
import torch

from tests.cpu import flashinfer_fakes as ff
from epmoe.config import MoEConfig
from epmoe.dispatch.base import DispatchedTokens
from epmoe.experts.base import ExpertsSpec
from epmoe.experts.flashinfer_cutlass import (
    QUANT_SCALE_SLOTS,
    ActivationArgs,
    FlashInferCutlassExperts,
    FlashInferFeatures,
    activation_args,
    assemble_quant_scales,
    build_cutlass_call,
    check_flags,
    local_to_global_ids,
    version_at_least,
)
from epmoe.quant.weights import ExpertWeights

ALL = frozenset(ff.CUTLASS_PARAMS_0_7_2)
OLD = frozenset(ff.CUTLASS_PARAMS_0_6_17)
NEW = FlashInferFeatures("0.7.2.post1", ALL, True)


def _params(variant, E=2):
    """Named kernel tensors with distinct values so slot order is visible."""
    t = {
        "fc1_weight": torch.zeros(E, 8, 8, dtype=torch.uint8),
        "fc2_weight": torch.zeros(E, 8, 8, dtype=torch.uint8),
        "fc1_scale": torch.full((E, 8, 4), 1, dtype=torch.uint8),
        "fc2_scale": torch.full((E, 8, 4), 2, dtype=torch.uint8),
        "fc1_residual_scale": torch.full((E,), 3.0),
        "fc2_residual_scale": torch.full((E,), 4.0),
        "fc2_act_scale": torch.tensor(5.0),
        "fc1_input_scale": torch.full((E,), 6.0),
        "fc2_input_scale": torch.full((E,), 7.0),
        "fc1_act_global_scale": torch.tensor(8.0),
        "fc2_act_global_scale": torch.tensor(9.0),
        "fc1_dequant_scale": torch.full((E,), 10.0),
        "fc2_dequant_scale": torch.full((E,), 11.0),
    }
    if variant == "fp8_block":
        t["fc1_scale"], t["fc2_scale"] = torch.full((E, 1, 1), 1.0), torch.full((E, 1, 1), 2.0)
    return t


def _tag(x):
    if x.dtype == torch.int32:
        return ("i32", int(x.view(torch.uint8).flatten()[0]))
    return (str(x.dtype).split(".")[-1], float(x.flatten()[0]))


@pytest.mark.parametrize(
    "variant,expect",
    [
        ("bf16", []),
        ("fp8_block", [("float32", 1.0), ("float32", 2.0)]),
        ("mxfp4_w4a16", [("i32", 1), ("i32", 2)]),
        # FC1 folded scales, FC1 residual x64, FC2 act scale, FC2 folded scales, FC2 residual x64
        ("mxfp4_w4a8_humming", [("i32", 1), ("float32", 3.0), ("float32", 5.0), ("i32", 2), ("float32", 4.0)]),
        ("mxfp8", [("i32", 1), ("float32", 6.0), ("i32", 2), ("float32", 7.0)]),
        ("mxfp8_mxfp4", [("i32", 1), ("float32", 6.0), ("i32", 2), ("float32", 7.0)]),
        ("nvfp4", [("float32", 8.0), ("i32", 1), ("float32", 10.0), ("float32", 9.0), ("i32", 2), ("float32", 11.0)]),
    ],
)
def test_quant_scale_slots(variant, expect):
    got = [_tag(t) for t in assemble_quant_scales(variant, _params(variant))]
    assert got == expect


def test_incomplete_quant_scales_refused():
    p = _params("mxfp4_w4a8_humming")
    del p["fc2_residual_scale"]
    p["fc2_act_scale"] = None
    with pytest.raises(ValueError, match=r"missing \['fc2_act_scale', 'fc2_residual_scale'\]"):
        assemble_quant_scales("mxfp4_w4a8_humming", p)
    with pytest.raises(ValueError, match="unknown CUTLASS variant"):
        assemble_quant_scales("int4", p)


def test_exclusive_flags():
    with pytest.raises(ValueError, match="mutually exclusive"):
        check_flags({"use_wfp4afp8_humming": True, "use_w4_group_scaling": True, "use_mxfp8_act_scaling": True})
    with pytest.raises(ValueError, match="mutually exclusive"):
        check_flags({"use_deepseek_fp8_block_scale": True, "use_mxfp8_act_scaling": True})
    with pytest.raises(ValueError, match="requires use_w4_group_scaling"):
        check_flags({"use_wfp4afp8_humming": True})
    check_flags({"use_wfp4afp8_humming": True, "use_w4_group_scaling": True})


def test_version_gate_rejects_prereleases():
    assert not version_at_least("0.6.18rc1", "0.6.18")
    assert not version_at_least("0.6.17", "0.6.18")
    assert version_at_least("0.6.18", "0.6.18") and version_at_least("0.7.2.post1", "0.6.18")
    assert not version_at_least(None, "0.6.18") and not version_at_least("garbage", "0.6.18")
    assert not FlashInferFeatures("0.6.18rc1", ALL, True).supports_humming
    assert FlashInferFeatures("0.6.18", ALL, True).supports_humming
    assert not FlashInferFeatures("0.6.18", OLD, True).supports_humming, "attribute probe: kwarg missing"
    assert not FlashInferFeatures("0.6.18", ALL, False).supports_humming, "attribute probe: preprocessor missing"


def _call(variant, features=NEW, **kw):
    N, K = 3, 2
    args = dict(
        x=torch.zeros(N, 8, dtype=torch.bfloat16), topk_ids=torch.zeros(N, K, dtype=torch.int32),
        topk_weights=torch.ones(N, K), output=torch.empty(N, 8, dtype=torch.bfloat16), output_dtype=torch.bfloat16,
        ep_size=4, ep_rank=1, activation=ActivationArgs(3), features=features,
    )
    args.update(kw)
    return build_cutlass_call(variant, _params(variant), **args)


def test_keywords_only_when_needed_and_supported():
    k = _call("mxfp4_w4a16")
    assert k["use_w4_group_scaling"] is True and "use_wfp4afp8_humming" not in k, "humming kwarg only when on"
    assert "use_mxfp8_act_scaling" not in k and "use_deepseek_fp8_block_scale" not in k
    assert k["profile_ids"] == [-1, -1], "default tactics: the autotuner must not run"
    assert (k["ep_size"], k["ep_rank"], k["activation_type"]) == (4, 1, 3)
    assert "workspace_buffer" not in k and "fc1_expert_biases" not in k and "use_fused_finalize" not in k
    h = _call("mxfp4_w4a8_humming")
    assert h["use_wfp4afp8_humming"] is True and h["use_w4_group_scaling"] is True and len(h["quant_scales"]) == 5
    ws = torch.empty(16, dtype=torch.uint8)
    assert _call("bf16", workspace=ws)["workspace_buffer"] is ws
    old = FlashInferFeatures("0.6.17", OLD, False)
    assert "workspace_buffer" not in _call("bf16", features=old, workspace=ws), "0.6.17 has no workspace_buffer"
    with pytest.raises(ValueError, match=r"FlashInfer >= 0.6.18.*0.6.18rc1"):
        _call("mxfp4_w4a8_humming", features=FlashInferFeatures("0.6.18rc1", ALL, True))
    assert _call("bf16", deterministic=True)["use_fused_finalize"] is False
    nv = _call("nvfp4", input_sf=torch.zeros(3, 1, dtype=torch.uint8), swizzled_input_sf=False)
    assert nv["fc1_expert_weights"].dtype == torch.int64 and nv["swizzled_input_sf"] is False
    mx = _call("mxfp8_mxfp4")
    assert mx["fc1_expert_weights"].dtype == torch.int64 and mx["use_mxfp8_act_scaling"] is True
    acts = ActivationArgs(3, torch.ones(2), torch.zeros(2), torch.full((2,), 7.0))
    g = _call("bf16", activation=acts)
    assert g["swiglu_limit"].tolist() == [7.0, 7.0]
    no_swiglu = FlashInferFeatures("0.7.2", ALL - {"swiglu_alpha"}, True)
    with pytest.raises(ValueError, match="lacks 'swiglu_alpha'"):
        _call("bf16", activation=acts, features=no_swiglu)


def test_activation_mapping():
    c = MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=4)
    a = activation_args(c, 2, "cpu", ff.ActivationType)
    assert a.activation_type == 3 and a.swiglu_alpha is None
    oss = c.replace(swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)
    a = activation_args(oss, 2, "cpu", ff.ActivationType)
    torch.testing.assert_close(a.swiglu_alpha, torch.full((2,), 1.702))
    assert a.swiglu_beta.tolist() == [1.0, 1.0] and a.swiglu_limit.tolist() == [7.0, 7.0]
    assert activation_args(c.replace(activation="relu2"), 2, "cpu", ff.ActivationType).activation_type == 6


def test_local_to_global_ids():
    ids = torch.tensor([[0, -1], [3, 2]], dtype=torch.int32)
    assert local_to_global_ids(ids, 8).tolist() == [[8, -1], [11, 10]]
    assert local_to_global_ids(ids, 0).tolist() == ids.tolist()


# ----------------------------------------------------------------------------- the backend on CPU
def _experts(monkeypatch, mode, config, ep_size=2, ep_rank=1, max_tokens=16, arch=90, **fake_kw):
    rec = ff.install(monkeypatch, **fake_kw)
    import epmoe.experts.flashinfer_cutlass as fc
    from epmoe.core.availability import Availability

    monkeypatch.setattr(fc.FlashInferCutlassExperts, "availability", classmethod(lambda cls, spec: Availability.yes()))
    monkeypatch.setattr(fc, "_device_arch", lambda device: arch)
    spec = ExpertsSpec(config=config, ep_rank=ep_rank, ep_size=ep_size, device=torch.device("cpu"),
                       max_tokens=max_tokens, options=(("mode", mode),))
    return fc.FlashInferCutlassExperts(spec), rec


def _bf16_weights(E, I, H, first, seed):
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(w1=torch.randn(E, I, H, generator=g), w3=torch.randn(E, I, H, generator=g),
                         w2=torch.randn(E, H, I, generator=g), first_expert=first)


def test_backend_forward_and_inplace_reload(monkeypatch):
    E, I, H = 8, 16, 32
    c = MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I)
    ex, rec = _experts(monkeypatch, "bf16", c)
    assert ex.variant == "bf16" and ex.payload_format.dtype == torch.bfloat16
    ex.load_weights(_bf16_weights(4, I, H, 4, 1))
    ptrs = {k: v.data_ptr() for k, v in ex.parameters().items()}
    ids = torch.tensor([[0, -1], [3, 1], [-1, -1]], dtype=torch.int32)
    tokens = DispatchedTokens(torch.randn(3, H).bfloat16(), ids, torch.rand(3, 2))
    out = ex(tokens)
    kw = rec.named("cutlass_fused_moe")[-1]
    assert kw["token_selected_experts"].tolist() == [[4, -1], [7, 5], [-1, -1]], "local -> global at the boundary"
    assert kw["token_selected_experts"].dtype == torch.int32 and (kw["ep_size"], kw["ep_rank"]) == (2, 1)
    assert kw["fc1_expert_weights"].shape == (4, 2 * I, H) and kw["profile_ids"] == [-1, -1]
    assert out.shape == (3, H) and out.dtype == torch.bfloat16
    # reload: same storage, new values
    w2 = _bf16_weights(4, I, H, 4, 2)
    ex.load_weights(w2)
    assert {k: v.data_ptr() for k, v in ex.parameters().items()} == ptrs
    assert ex.parameters()["fc1_weight"].equal(torch.cat([w2.w3, w2.w1], 1).bfloat16())
    with pytest.raises(ValueError, match="owns experts \\[4, 8\\)"):
        ex.load_weights(_bf16_weights(4, I, H, 0, 3))


def test_backend_pads_hidden_and_slices_output(monkeypatch):
    E, I, H = 4, 128, 96  # quantized modes pad H to 128
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I)
    ex, rec = _experts(monkeypatch, "mxfp4_w4a16", c, ep_size=1, ep_rank=0)
    from tests.cpu.test_flashinfer_layouts import _mx_weights

    ex.load_weights(_mx_weights(E, I, H, 5))
    tokens = DispatchedTokens(torch.randn(2, H).bfloat16(), torch.tensor([[1], [-1]], dtype=torch.int32), torch.ones(2, 1))
    out = ex(tokens)
    kw = rec.named("cutlass_fused_moe")[-1]
    assert kw["input"].shape == (2, 128) and kw["input"][:, H:].eq(0).all()
    assert out.shape == (2, H)
    assert kw["quant_scales"][0].dtype == torch.int32 and kw["use_w4_group_scaling"] is True


def test_backend_refuses_wrong_checkpoint_format(monkeypatch):
    c = MoEConfig(num_experts=2, top_k=1, hidden_size=128, intermediate_size=128)
    ex, _ = _experts(monkeypatch, "mxfp4_w4a16", c, ep_size=1, ep_rank=0)
    from tests.cpu.test_flashinfer_layouts import _mx_weights

    with pytest.raises(ValueError, match="needs mxfp4 expert weights, got mxfp8"):
        ex.load_weights(_mx_weights(2, 128, 128, 1, fmt="mxfp8"))


def test_nongated_w13_truncated_at_load(monkeypatch):
    E, I, H = 2, 128, 128
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I, activation="relu2")
    ex, rec = _experts(monkeypatch, "mxfp4_w4a16", c, ep_size=1, ep_rank=0)
    from tests.cpu.test_flashinfer_layouts import _mx_weights

    w = _mx_weights(E, 2 * I, H, 2, gated=False)  # a checkpoint storing 2I fc1 rows
    w = ExpertWeights(format="mxfp4", w1=w.w1, w1_scale=w.w1_scale, w2=w.w2[:, :, : I // 2], w2_scale=w.w2_scale[:, :, : I // 32])
    ex.load_weights(w)
    assert rec.named("interleave_weights")[0]["weight"].equal(w.w1[:, :I])


def test_quant_slot_table_covers_every_variant():
    from epmoe.quant.flashinfer_layout import CUTLASS_VARIANTS

    assert set(QUANT_SCALE_SLOTS) == set(CUTLASS_VARIANTS)


def test_online_quantization_round_trips():
    """Unquantized checkpoints are quantized at load with epmoe's codecs, in ExpertWeights' layout
    and scale convention (dequantization factors)."""
    from epmoe.experts.flashinfer_cutlass import quantize_weights_online
    from epmoe.quant import fp8_block, mxfp4, mxfp8, nvfp4

    seed = 21
    g = torch.Generator().manual_seed(seed)
    E, I, H = 2, 128, 256
    c = MoEConfig(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I)
    w = ExpertWeights(w1=torch.randn(E, I, H, generator=g), w3=torch.randn(E, I, H, generator=g),
                      w2=torch.randn(E, H, I, generator=g) * torch.tensor([1.0, 30.0]).view(E, 1, 1))
    deq = {
        "mxfp4": lambda q, n: mxfp4.dequantize(getattr(q, n), getattr(q, n + "_scale"), torch.float32),
        "mxfp8": lambda q, n: mxfp8.dequantize(getattr(q, n), getattr(q, n + "_scale"), torch.float32),
        "fp8_block": lambda q, n: fp8_block.dequantize_weight(getattr(q, n), getattr(q, n + "_scale"), torch.float32),
        "nvfp4": lambda q, n: nvfp4.dequantize(
            getattr(q, n), getattr(q, n + "_scale"),
            (1.0 / getattr(q, n + "_global_scale"))[:, None].expand(getattr(q, n).shape[:-1]), torch.float32),
    }
    tol = {"mxfp4": 0.2, "nvfp4": 0.15, "mxfp8": 0.05, "fp8_block": 0.05}
    for fmt, fn in deq.items():
        q = quantize_weights_online(w, fmt)
        q.validate(c)
        for n in ("w1", "w3", "w2"):
            ref = getattr(w, n)
            err = (fn(q, n) - ref).norm() / ref.norm()
            assert err < tol[fmt], f"seed={seed} {fmt} {n}: rel err {err:.3f}"
    q = quantize_weights_online(w, "nvfp4")
    assert q.w2_global_scale[1] > 10 * q.w2_global_scale[0], "one global scale per expert"


def test_two_phase_reload_is_all_or_nothing(monkeypatch):
    E, I, H = 8, 16, 32
    c = MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I)
    ex, _ = _experts(monkeypatch, "bf16", c)
    w = _bf16_weights(4, I, H, 4, 1)
    ex.commit_weights(ex.prepare_weights(w))
    before = {k: v.clone() for k, v in ex.parameters().items()}
    prepared = ex.prepare_weights(_bf16_weights(4, I, H, 4, 2))  # phase 1 changes nothing live
    assert all(torch.equal(before[k], v) for k, v in ex.parameters().items())
    ex.commit_weights(prepared)
    assert not torch.equal(before["fc1_weight"], ex.parameters()["fc1_weight"])
    bad = dict(prepared)
    bad["fc2_weight"] = bad["fc2_weight"][:, :, :8]
    snapshot = {k: v.clone() for k, v in ex.parameters().items()}
    with pytest.raises(ValueError, match="fc2_weight"):
        ex.commit_weights(bad)
    assert all(torch.equal(snapshot[k], v) for k, v in ex.parameters().items()), "nothing copied"


# ----------------------------------------------------------------------------- tactics
def test_tactics_check_names_the_valid_ids():
    from epmoe.experts.flashinfer_cutlass import CutlassTactics

    t = CutlassTactics(gemm1=(0, 1), gemm2=(2, 3, 4))
    assert t.check([-1, -1]) == [-1, -1] and t.check((1, 4)) == [1, 4] and t.check([0, -1]) == [0, -1]
    for bad in ([2, 2], [0, 1], [5, 2], [0], (0, 2, 3), "0,2", [True, 2], [0.0, 2], None):
        with pytest.raises(ValueError, match=r"tactics=.*GEMM1 ids 0\.\.1, GEMM2 ids 2\.\.4") as e:
            t.check(bad)
        assert "\n" not in str(e.value)
    fixed = CutlassTactics(gemm1=(0,), gemm2=(1,), fixed=True)
    assert "built-in tile" in fixed.describe()


def test_backend_reads_tactics_from_the_module_standin(monkeypatch):
    """Stand-in module (made-up tactic counts): proves the count is read and the option checked,
    not which tactics a real build has."""
    E, I, H = 8, 16, 32
    c = MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I)
    ex, rec = _experts(monkeypatch, "bf16", c)
    assert ex.tactics.gemm1 == (0, 1) and ex.tactics.gemm2 == (2, 3, 4) and ex.profile_ids == [-1, -1]
    runner = rec.named("MoERunner")[-1]
    assert runner["x_dtype"] == torch.bfloat16 and runner["weight_dtype"] == torch.bfloat16
    import epmoe.experts.flashinfer_cutlass as fc

    spec = ExpertsSpec(config=c, ep_rank=1, ep_size=2, device=torch.device("cpu"), max_tokens=16,
                       options=(("mode", "bf16"), ("tactics", (1, 3))))
    ex = fc.FlashInferCutlassExperts(spec)
    ex.load_weights(_bf16_weights(4, I, H, 4, 1))
    ids = torch.tensor([[0, -1]], dtype=torch.int32)
    ex(DispatchedTokens(torch.randn(1, H).bfloat16(), ids, torch.rand(1, 2)))
    assert rec.named("cutlass_fused_moe")[-1]["profile_ids"] == [1, 3]
    bad = ExpertsSpec(config=c, ep_rank=1, ep_size=2, device=torch.device("cpu"), max_tokens=16,
                      options=(("mode", "bf16"), ("tactics", (0, 7))))
    with pytest.raises(ValueError, match=r"tactics=\(0, 7\) is not offered.*GEMM2 ids 2\.\.4"):
        fc.FlashInferCutlassExperts(bad)


def test_sm90_fp4_modes_refuse_fp16_models():
    from epmoe.core.capability import BackendRequest
    from epmoe.experts.flashinfer_cutlass import FlashInferCutlassExperts, fused_moe_package

    req = BackendRequest(expert_mode="mxfp4_w4a16", arch="sm90", flashinfer_version="0.7.2.post1",
                         packages=frozenset({"flashinfer", fused_moe_package("sm90")}), model_dtype="float16")
    for mode in ("mxfp4_w4a16", "mxfp4_w4a8"):
        a = FlashInferCutlassExperts.supports(req.with_(expert_mode=mode, humming=mode == "mxfp4_w4a8"))
        assert not a and "bfloat16 activations only" in a.describe()
        assert FlashInferCutlassExperts.supports(req.with_(expert_mode=mode, model_dtype="bfloat16",
                                                           humming=mode == "mxfp4_w4a8"))


def test_backend_empty_batch_skips_the_kernel_standin(monkeypatch):
    """FlashInfer's kernel asserts on 0 rows (seen on the H200); the backend returns [0, H] itself.
    Stand-in module: proves the call is skipped, the GPU tests prove the kernel path."""
    E, I, H = 8, 16, 32
    c = MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I)
    ex, rec = _experts(monkeypatch, "bf16", c)
    ex.load_weights(_bf16_weights(4, I, H, 4, 1))
    out = ex(DispatchedTokens(torch.randn(0, H).bfloat16(), torch.zeros(0, 2, dtype=torch.int32), torch.rand(0, 2)))
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    assert rec.named("cutlass_fused_moe") == []
