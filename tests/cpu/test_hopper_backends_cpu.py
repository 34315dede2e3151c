"""`triton` and `grouped_mm` experts backends on CPU: availability, registry, weight loading (in place),
validation, and grouped_mm's math through PyTorch's CPU grouped-GEMM fallback."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.core.availability import Availability
from epmoe.core.errors import BackendUnavailableError
from epmoe.dispatch.base import DispatchedTokens
from epmoe.experts import EXPERTS
from epmoe.experts.triton import kernel_formats as kf
from tests import experts_testing as T
from epmoe.experts.base import ExpertsSpec
from epmoe.experts.triton.grouped_mm import GroupedMMExperts
from epmoe.experts.triton.triton_experts import AUTO_PRESETS, TritonExperts, pick_config, presets_for
from epmoe.quant.plan import QuantPlan

CPU = torch.device("cpu")
GPTOSS_TINY = dict(
    num_experts=8, top_k=2, hidden_size=128, intermediate_size=64, has_bias=True,
    swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
)  # fmt: skip


def _spec(mode="bf16", ep_size=2, ep_rank=1, **cfg):
    cfg = {**dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64), **cfg}
    return ExpertsSpec(MoEConfig(**cfg), ep_rank, ep_size, CPU, plan=QuantPlan(expert_mode=mode))


@pytest.fixture
def force_available(monkeypatch):
    for cls in (TritonExperts, GroupedMMExperts):
        monkeypatch.setattr(cls, "availability", classmethod(lambda c, s: Availability.yes("test")))


def test_registry_and_lazy_import():
    assert EXPERTS.get("triton") is TritonExperts
    assert EXPERTS.get("grouped_mm") is GroupedMMExperts
    code = (
        "import sys, epmoe, epmoe.experts, epmoe.experts.triton.triton_experts, epmoe.experts.triton.grouped_mm, "
        "epmoe.experts.graphs; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": root})


def test_availability_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = TritonExperts.availability(_spec())
    if importlib.util.find_spec("triton") is None:
        assert not a and "triton is not installed" in a.reason and "pip install triton" in a.hint
        return
    assert not a and "CUDA" in a.reason and "TRITON_INTERPRET" in a.hint
    a = TritonExperts.availability(_spec("mxfp4_w4a8"))
    assert not a and "mxfp4_w4a8" in a.reason
    a = TritonExperts.availability(_spec(dtype=torch.float32))
    assert not a and "float32" in a.reason
    a = TritonExperts.availability(_spec("nvfp4_w4a16", hidden_size=96))
    assert not a and "64" in a.reason
    a = GroupedMMExperts.availability(_spec())
    assert not a and "CUDA" in a.reason
    a = GroupedMMExperts.availability(_spec("fp8_block"))
    assert not a and "triton" in a.hint
    with pytest.raises(BackendUnavailableError, match="triton"):
        TritonExperts(_spec())


def test_pick_config_by_rows_per_expert():
    assert pick_config("bf16", 128 * 8, 128).name == "decode"
    assert pick_config("bf16", 4096 * 8, 128).name == "prefill"
    assert pick_config("fp8_block", 4096 * 8, 128).gemm1.block_k == 128
    assert pick_config("bf16", 4096 * 8, 128).split_m, "prefill splits expert tails"
    for mode, table in AUTO_PRESETS.items():
        assert all(name in presets_for(mode) for _, name in table), mode
        assert table[-1][0] is None, f"{mode}: the last AUTO_PRESETS entry must take any size"
    for mode in ("nvfp4_w4a16", "mxfp4_w4a16"):
        assert all(c.gemm1.block_k == 64 and c.gemm2.block_k == 64 for c in presets_for(mode).values())


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_w4a16_prefill_wgmma_preset_falls_back_where_gluon_cannot_run(force_available, monkeypatch, mode):
    """The auto presets for W4A16 prefill and decode run the Gluon kernels (wgmma; 16-row half tiles);
    where those cannot run (no Gluon, the Triton interpreter, shapes they do not tile) the forward takes
    WGMMA_FALLBACK's / SPLIT_FALLBACK_WIDE's Triton tiles instead; a forced preset stays as given."""
    from epmoe.experts.triton import triton_experts as TE

    ex = TritonExperts(_spec(mode))
    auto = pick_config(mode, 4096 * 8, 128)
    assert auto.wgmma
    monkeypatch.setattr(TE, "_gluon_available", lambda: False)
    assert not ex.uses_gluon_w4a16(auto)
    assert ex.tile_config(4096 * 8).name == TE.WGMMA_FALLBACK
    decode = pick_config(mode, 8, ex.num_experts)  # 16-row half tiles: the Gluon decode kernel only
    assert decode.split_m and decode.block_m == 16 and not ex.uses_gluon_w4a16(decode)
    assert ex.tile_config(1 * 8).name == TE.SPLIT_FALLBACK
    assert not presets_for(mode)[TE.SPLIT_FALLBACK].split_m
    wide = pick_config(mode, 24 * ex.num_experts, ex.num_experts)  # 24 rows per expert: still half tiles
    assert wide.split_m and wide.block_m == 16
    assert ex.tile_config(24 * ex.num_experts).name == "small"
    monkeypatch.setattr(ex, "uses_gluon_w4a16", lambda cfg: True)
    assert ex.tile_config(4096 * 8) is auto
    assert ex.tile_config(1 * 8) is decode
    monkeypatch.setattr(ex, "uses_gluon_w4a16", lambda cfg: False)
    ex.config_override = auto
    assert ex.tile_config(4096 * 8) is auto


@pytest.mark.parametrize("mode", ["bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("backend", [TritonExperts, GroupedMMExperts])
def test_reload_is_in_place(force_available, backend, mode):
    if backend is GroupedMMExperts and mode != "bf16":
        pytest.skip("grouped_mm is bf16 only")
    spec = _spec(mode, **GPTOSS_TINY)
    ex = backend(spec)
    E = spec.num_local_experts
    w_a = T.random_expert_weights(spec.config, E, seed=1, first_expert=spec.first_local_expert)
    w_b = T.random_expert_weights(spec.config, E, seed=2, first_expert=spec.first_local_expert)
    ex.load_weights(w_a)
    params = ex.parameters()
    assert params, "parameters() lists the kernel tensors"
    ptrs = {k: v.data_ptr() for k, v in params.items()}
    before = {k: v.clone() for k, v in params.items()}
    ex.load_weights(w_b)
    after = ex.parameters()
    assert {k: v.data_ptr() for k, v in after.items()} == ptrs, "reload must copy in place"
    assert any(not torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in after)


@pytest.mark.parametrize("backend", [TritonExperts, GroupedMMExperts])
def test_bad_weights_rejected(force_available, backend):
    spec = _spec()
    ex = backend(spec)
    E = spec.num_local_experts
    w = T.random_expert_weights(spec.config, E, first_expert=spec.first_local_expert)
    with pytest.raises(ValueError, match="w2"):
        ex.load_weights(T.ExpertWeights(w1=w.w1, w3=w.w3, w2=w.w2[:, :, :32], first_expert=w.first_expert))
    with pytest.raises(ValueError, match="owns experts"):
        ex.load_weights(T.random_expert_weights(spec.config, E, first_expert=0))
    with pytest.raises(RuntimeError, match="load_weights"):
        ex(DispatchedTokens(torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)))


def test_triton_gate_up_layouts(force_available):
    """bf16 gated: w13 rows interleaved (gate j, up j) by default, [gate; up] with
    triton_gate_up=blocked; relu2 and quantized modes keep their own layouts."""
    spec = _spec()
    w = T.random_expert_weights(spec.config, spec.num_local_experts, first_expert=spec.first_local_expert)
    ex = TritonExperts(spec)
    ex.load_weights(w)
    assert ex.gate_up_interleaved
    assert torch.equal(ex.parameters()["w13"], kf.interleave_gate_up(w.w1, w.w3))
    blocked = TritonExperts(ExpertsSpec(spec.config, 1, 2, CPU, plan=QuantPlan(expert_mode="bf16"),
                                        options=(("triton_gate_up", "blocked"),)))  # fmt: skip
    blocked.load_weights(w)
    assert not blocked.gate_up_interleaved and torch.equal(blocked.parameters()["w13"], w.w13())
    assert not TritonExperts(_spec("fp8_block")).gate_up_interleaved
    assert not TritonExperts(_spec(activation="relu2")).gate_up_interleaved
    with pytest.raises(ValueError, match="triton_gate_up"):
        TritonExperts(ExpertsSpec(spec.config, 1, 2, CPU, options=(("triton_gate_up", "both"),)))


def test_triton_takes_quantized_checkpoints(force_available):
    spec = _spec("fp8_block")
    ex = TritonExperts(spec)
    w = T.random_expert_weights(spec.config, spec.num_local_experts, first_expert=spec.first_local_expert)
    q = kf.quantize_expert_weights(w, "fp8_block")
    ex.load_weights(q)  # quantized canonical weights are taken as they are ...
    assert torch.equal(ex.parameters()["w2"].view(torch.uint8), q.w2.view(torch.uint8))
    ex.load_weights(w)  # ... float ones are quantized the same way at load
    assert torch.equal(ex.parameters()["w2"].view(torch.uint8), q.w2.view(torch.uint8))
    with pytest.raises(ValueError, match="mxfp4"):
        ex.load_weights(kf.quantize_expert_weights(w, "mxfp4_w4a16"))
    bf = TritonExperts(_spec("bf16"))
    bf.load_weights(q)  # a quantized checkpoint runs in bf16 mode dequantized
    assert torch.allclose(bf.parameters()["w2"].float(), kf.dequantize_expert_weights(q).w2.bfloat16().float())


def test_triton_forward_validates_before_launch(force_available):
    spec = _spec()
    ex = TritonExperts(spec)
    ex.load_weights(T.random_expert_weights(spec.config, 4, first_expert=4))
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="hidden"):
        ex(DispatchedTokens(torch.zeros(3, 64, dtype=torch.bfloat16), ids, torch.ones(3, 2)))
    with pytest.raises(ValueError, match="topk_weights"):
        ex(DispatchedTokens(torch.zeros(3, 128, dtype=torch.bfloat16), ids, torch.ones(3, 3)))
    with pytest.raises(TypeError, match="dtype"):
        ex(DispatchedTokens(torch.zeros(3, 128, dtype=torch.float16), ids, torch.ones(3, 2)))
    out = ex(DispatchedTokens(torch.zeros(0, 128, dtype=torch.bfloat16), ids[:0], torch.ones(0, 2)))
    assert out.shape == (0, 128)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        GPTOSS_TINY,
        dict(activation="relu2"),
    ],
    ids=["swiglu", "gptoss", "relu2"],
)
def test_grouped_mm_math_on_cpu_fallback(force_available, cfg):
    seed = int.from_bytes(os.urandom(2), "little")
    spec = _spec(**cfg)
    ex = GroupedMMExperts(spec)
    E = spec.num_local_experts
    w = T.random_expert_weights(spec.config, E, seed=seed, first_expert=spec.first_local_expert)
    ex.load_weights(w)
    N = 37
    x = torch.randn(N, 128, generator=torch.Generator().manual_seed(seed)).bfloat16()
    ids, tw = T.random_local_routing(N, 2, E, seed=seed + 1, invalid_frac=0.3, empty_rows=3)
    out = ex(DispatchedTokens(x, ids, tw))
    # reference rounds the first projection and the activation to bf16 like the backend does
    ref = T.experts_reference(spec.config, w, x, ids, tw, act_roundtrip=lambda a: a.bfloat16().double())
    assert out.dtype == torch.bfloat16 and out.shape == (N, 128)
    assert bool((out[-3:] == 0).all()), "rows with no local expert are zero"
    err = T.relative_error(out, ref)
    assert err < 1e-2, (seed, err)


def test_bf16_prefill_preference_hook(force_available, monkeypatch):
    """The triton backend runs bf16 forwards with >= GROUPED_MM_MIN_ROWS mean rows per local expert
    through torch._grouped_mm + fused epilogues (option triton_grouped_mm = auto | on | off); never
    in quantized modes, never on CPU without the interpreter. Selection logic only (no kernels run)."""
    from epmoe.experts.triton import triton_experts as TE

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU counts as a place the path can run
    ex = TritonExperts(_spec())
    E = ex.num_experts
    rows = TE.GROUPED_MM_MIN_ROWS
    assert rows is not None and not ex.uses_grouped_mm(int(E * rows) - 1) and ex.uses_grouped_mm(int(E * rows))
    ex.config_override = presets_for("bf16")["prefill"]  # a forced tile preset keeps the Triton GEMMs
    assert not ex.uses_grouped_mm(int(E * rows))

    def with_opt(value, mode="bf16"):
        return TritonExperts(ExpertsSpec(MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64),
                                         1, 2, CPU, plan=QuantPlan(expert_mode=mode),
                                         options=(("triton_grouped_mm", value),)))  # fmt: skip

    assert with_opt("on").uses_grouped_mm(1)
    assert not with_opt("off").uses_grouped_mm(10**6)
    assert not TritonExperts(_spec("fp8_block")).uses_grouped_mm(10**6)
    with pytest.raises(ValueError, match="bf16 only"):
        with_opt("on", "fp8_block")
    with pytest.raises(ValueError, match="triton_grouped_mm"):
        with_opt("maybe")
    monkeypatch.setattr(TE, "GROUPED_MM_MIN_ROWS", None)
    assert not TritonExperts(_spec()).uses_grouped_mm(10**6)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not TritonExperts(_spec()).uses_grouped_mm(10**6), "CPU without the interpreter: no Triton"


def test_grouped_mm_epilogue_option(force_available, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert GroupedMMExperts(_spec()).epilogue == "torch", "no CUDA, no interpreter: torch composite"
    with pytest.raises(ValueError, match="grouped_mm_epilogue"):
        GroupedMMExperts(ExpertsSpec(_spec().config, 1, 2, CPU, options=(("grouped_mm_epilogue", "fast"),)))
    with pytest.raises(ValueError, match="grouped_mm_epilogue=torch"):
        GroupedMMExperts(ExpertsSpec(_spec().config, 1, 2, CPU, options=(("grouped_mm_epilogue", "triton"),)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert GroupedMMExperts(_spec()).epilogue == "triton"


def test_mxfp4_packed_conversion_range_at_load(force_available):
    """mxfp4 scale exponents above 128 fall back to the legacy fp4 conversion at the first load and
    are refused on a reload of a backend running the packed one (its graphs keep the conversion)."""
    spec = _spec("mxfp4_w4a16")
    w = T.random_expert_weights(spec.config, spec.num_local_experts, first_expert=spec.first_local_expert)
    q = kf.quantize_expert_weights(w, "mxfp4_w4a16")
    ex = TritonExperts(spec)
    ex.load_weights(q)
    assert ex.fp4_packed, "random weights are in the packed range"
    big = T.ExpertWeights(**{**q.__dict__, "w2_scale": q.w2_scale.clone().fill_(140)})
    with pytest.raises(ValueError, match="triton_fp4_convert=legacy"):
        ex.load_weights(big)
    assert ex.fp4_packed
    fresh = TritonExperts(spec)
    fresh.load_weights(big)
    assert not fresh.fp4_packed, "first load with exponents > 128: legacy conversion"


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_words_conversion_stores_bit_permuted_words(force_available, monkeypatch, mode):
    """Convert mode "words" (outside the interpreter, where its PTX runs): the fp4 weights are the asm
    mode's bytes with every 4-byte word bit-permuted (`kernel_formats.permute_fp4_words`), the scales
    unchanged; the kernels get conversion 3 (`WORDS` for the Gluon kernels). Under the interpreter
    the bytes stay plain. This checks the layout and the kernel choice only; the kernels' results
    are GPU tests."""
    from epmoe.experts.triton import triton_experts as TE

    monkeypatch.setattr(TE, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(TE, "_gluon_available", lambda: True)
    base = _spec(mode, hidden_size=256, intermediate_size=256)  # shapes the wgmma presets tile
    w = T.random_expert_weights(base.config, base.num_local_experts, first_expert=base.first_local_expert)
    q = kf.quantize_expert_weights(w, mode)
    runs = {}
    for conv in ("asm", "words"):
        ex = TritonExperts(ExpertsSpec(base.config, 1, 2, CPU, plan=base.plan, options=(("triton_fp4_convert", conv),)))
        ex.load_weights(q)
        runs[conv] = ex
    asm, words = runs["asm"].parameters(), runs["words"].parameters()
    for k in ("w13", "w2"):
        assert not torch.equal(words[k], asm[k])
        assert torch.equal(kf.unpermute_fp4_words(words[k]), asm[k]), k
    for k in asm:
        if k not in ("w13", "w2"):
            assert torch.equal(words[k], asm[k]), k
    ex = runs["words"]
    assert ex._fp4_kernel_convert == 3 and runs["asm"]._fp4_kernel_convert == 2
    presets = presets_for(mode)
    for name in ("wgmma_w4r128_kp", "decode"):  # every Gluon kernel converts whole words
        assert ex.uses_gluon_w4a16(presets[name]) and runs["asm"].uses_gluon_w4a16(presets[name]), name
    monkeypatch.setattr(TE, "interpreter_enabled", lambda: True)
    plain = TritonExperts(ExpertsSpec(base.config, 1, 2, CPU, plan=base.plan, options=(("triton_fp4_convert", "words"),)))
    plain.load_weights(q)
    assert torch.equal(plain.parameters()["w13"], asm["w13"]) and plain._fp4_kernel_convert == 1


def test_auto_fp4_conversion_by_mode_and_shape(force_available, monkeypatch):
    """triton_fp4_convert=auto (the default) runs words for every mode and shape (GPT-OSS's 2880, which
    GLUON_W4A16_WORDS_TILES' rows do not divide, included); a conversion given explicitly stays as
    given; an unknown one is refused naming the choices."""
    from epmoe.experts.triton import triton_experts as TE

    assert TE.FP4_CONVERT == "auto"
    assert TE.resolve_fp4_convert("auto") == "words"
    assert TE.resolve_fp4_convert("words") == "words"
    assert TE.resolve_fp4_convert("asm") == "asm"
    for mode in ("nvfp4_w4a16", "mxfp4_w4a16"):  # DeepSeek-like, GPT-OSS-like (2880 = 22.5 x 128), small shapes
        for h, i in ((7168, 2048), (2880, 2880), (192, 128), (256, 128)):
            assert TritonExperts(_spec(mode, hidden_size=h, intermediate_size=i)).fp4_convert == "words", (mode, h, i)
    bad = ExpertsSpec(_spec().config, 1, 2, CPU, plan=QuantPlan(expert_mode="nvfp4_w4a16"),
                      options=(("triton_fp4_convert", "fast"),))
    with pytest.raises(ValueError, match="triton_fp4_convert='fast'.*auto"):
        TritonExperts(bad)


def test_words_conversion_refuses_a_reload_that_changes_the_layout(force_available, monkeypatch):
    """mxfp4 in convert mode "words": a first load with scale exponents > 128 keeps plain bytes (legacy
    conversion); a reload in the packed range would need the permuted words, which the loaded
    backend (and its captured graphs) do not read: refused with the fix, weights unchanged."""
    from epmoe.experts.triton import triton_experts as TE

    monkeypatch.setattr(TE, "interpreter_enabled", lambda: False)
    spec = _spec("mxfp4_w4a16")
    spec = ExpertsSpec(spec.config, 1, 2, CPU, plan=spec.plan, options=(("triton_fp4_convert", "words"),))
    w = T.random_expert_weights(spec.config, spec.num_local_experts, first_expert=spec.first_local_expert)
    q = kf.quantize_expert_weights(w, "mxfp4_w4a16")
    big = T.ExpertWeights(**{**q.__dict__, "w2_scale": q.w2_scale.clone().fill_(140)})
    ex = TritonExperts(spec)
    ex.load_weights(big)
    assert ex._fp4_kernel_convert == 0 and not ex._fp4_words
    before = ex.parameters()["w13"].clone()
    with pytest.raises(ValueError, match="triton_fp4_convert=asm"):
        ex.load_weights(q)
    assert torch.equal(ex.parameters()["w13"], before)


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_tile_plan_follows_the_decode_kernel_choice(force_available, monkeypatch, mode):
    """The per-preset launch plan (`_tile_plan`, kept between calls) follows what may change after it is
    built: switching `w4a16_decode` or GLUON_W4A16_BLOCK_N gives a new plan whose kernel choice is
    `uses_gluon_w4a16`'s at that moment, not the cached one."""
    from epmoe.experts.triton import triton_experts as TE

    ex = TritonExperts(_spec(mode))
    monkeypatch.setattr(TE, "_gluon_available", lambda: True)
    monkeypatch.setattr(type(ex), "_fp4_kernel_convert", property(lambda self: 2))
    cfg = presets_for(mode)["decode"]
    assert ex._tile_plan(cfg, 8)[1] is True
    ex.w4a16_decode = "triton"
    assert ex._tile_plan(cfg, 8)[1] is False
    ex.w4a16_decode = "gluon"
    assert ex._tile_plan(cfg, 8)[1] is True
    monkeypatch.setattr(TE, "GLUON_W4A16_BLOCK_N", 3 * ex.intermediate_size)  # divides nothing
    assert ex._tile_plan(cfg, 8)[1] is False


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_decode_split_runs_on_the_gluon_decode_kernel_only(force_available, monkeypatch, mode):
    """Preset decode_split (16-row tiles split to 8 rows) exists only in the Gluon decode kernel: its
    plan takes that kernel where it can run; where the Triton kernels would run it (their half tiles
    need >= 16 rows: `triton_w4a16_decode=triton`, or the interpreter) it is refused before any launch,
    naming the preset and where it runs."""
    from epmoe.experts.triton import triton_experts as TE

    ex = TritonExperts(_spec(mode))
    monkeypatch.setattr(TE, "_gluon_available", lambda: True)
    monkeypatch.setattr(type(ex), "_fp4_kernel_convert", property(lambda self: 3))
    cfg = presets_for(mode)["decode_split"]
    assert cfg.split_m and cfg.block_m == 16 and ex.uses_gluon_w4a16(cfg)
    assert ex._tile_plan(cfg, 8)[1] is True
    ex.w4a16_decode = "triton"
    with pytest.raises(ValueError, match="decode_split.*Gluon W4A16 decode kernel only|Gluon W4A16 decode kernel only.*decode_split"):
        ex._tile_plan(cfg, 8)


def test_nvfp4_load_normalizes_scales_and_refuses_nan(force_available):
    """nvfp4 loads (kernel layout on CPU; the kernels are not run here): negative and zero block scales
    come out >= +0 (`normalize_nvfp4_scales`; value for value: test_fp4_convert_interpret) and are stored
    as scale codes (`encode_nvfp4_scales`) that decode to the scales' magnitudes, the caller's
    tensors untouched; a NaN scale is refused naming the tensor, the global expert index and the K
    range, and a backend already loaded keeps its weights."""
    spec = _spec("nvfp4_w4a16")
    w = T.random_expert_weights(spec.config, spec.num_local_experts, first_expert=spec.first_local_expert)
    q = kf.quantize_expert_weights(w, "nvfp4_w4a16")
    s = q.w2_scale.view(torch.uint8)
    s[0, 0, 0] |= 0x80
    s[0, 1, 1] = 0x00
    s[1, 2, 3] = 0x80
    before = q.w2_scale.clone()
    ex = TritonExperts(spec)
    ex.load_weights(q)
    assert torch.equal(q.w2_scale.view(torch.uint8), before.view(torch.uint8))
    # stored as scale codes, in K-step pairs (`kernel_formats.pair_fp4_scales`)
    got = kf.decode_nvfp4_scales(kf.unpair_fp4_scales(ex.parameters()["w2_scale"], 16, spec.config.intermediate_size))
    assert torch.equal(got, before.float().abs()), "each scale's magnitude, +0 for +-0"
    bad = T.ExpertWeights(**{**q.__dict__, "w1_scale": q.w1_scale.clone()})
    bad.w1_scale.view(torch.uint8)[1, 5, 2] = 0x7F
    kept = ex.parameters()["w13"].clone()
    first = spec.first_local_expert
    with pytest.raises(ValueError, match=rf"nvfp4 w13 block scale of expert {first + 1}, row 5, K 32..47 is NaN"):
        ex.load_weights(bad)
    assert torch.equal(ex.parameters()["w13"], kept)
