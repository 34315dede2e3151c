"""Hopper experts backends (`triton`, `grouped_mm`) on the GPU against float64 math.

Shapes: DeepSeek-V3-like (32 local experts, H=7168, I=2048, top-8, N up to 4096 and N=1) and
GPT-OSS-like (16 local experts, H=2880, I=2880, top-4, biases, clamped swiglu).
Fresh random seeds per test (printed on failure); the CUDA caching allocator is poisoned with NaN
before each call so an unwritten output element (or a read of an unwritten row) shows up as NaN.

Error bounds (||out - ref|| / ||ref||): 1e-2 everywhere. bf16: the operands are exact, the error is
bf16 rounding of the activation, of each weighted expert output and of the sum (~3e-3). Quantized
modes are compared with the float64 math on the dequantized weights (fp8_block also on the fp8
1x128 activations and the same 1x128 round trip of the intermediate activation), so the bound is
the bf16 one; the quantization error itself is the quant module's business.

fp8_block, why the bound holds only if the kernels quantize exactly as the reference: an e4m3 step
is 6-12% of a value, so when the kernel's fp8 input differs from the reference's in a fraction p of
elements, gemm1's output moves by ~0.1*sqrt(p) relative, which flips the 1x128 re-quantization of
the intermediate in proportion (measured on CPU in float64: a relative perturbation d of gemm1's
output gives 4e-3 (d=1e-4), 1.1e-2 (d=1e-3), 1.8e-2 (d=3e-3) output error). The first H200 run
(1.3-1.5e-2, N-dependent) was the in-kernel quantizer dividing with div.full.f32 instead of IEEE
division: bf16 inputs put many quotients exactly on an e4m3 tie, and the 1-ulp different scale
flipped ~0.1% of x (emulated on CPU: 1.55e-2; rows without a flipped value stay at 2e-3, hence the
low N=1 errors). Fixed with tl.math.div_rn; `test_fp8_quantizer_is_the_codec` pins it bit for bit.
What remains is the Hopper fp8 MMA's own accumulation (~13-bit alignment inside each 128-K block,
promoted to fp32 per block): d ~1e-4, ~4e-3 output error by the numbers above.
"""

from dataclasses import replace

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.dispatch.base import DispatchedTokens
from epmoe.experts.triton import kernel_formats as kf
from tests import experts_testing as T
from epmoe.experts.base import ExpertsSpec
from epmoe.experts.triton.triton_experts import FP8_BLOCK_PAYLOAD
from epmoe.quant.payload import QuantizedActivation
from epmoe.quant.plan import QuantPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BOUND = 1e-2
DS = dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048)  # 8 ranks -> 32 local
DS_EP = 8
GPTOSS = dict(
    num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880, has_bias=True,
    swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
)  # fmt: skip
GPTOSS_EP = 8  # 16 local experts
RELU2 = dict(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1024, activation="relu2")


_CACHE = {}
_REF_CACHE = {}


def _backend(name: str, mode: str, cfg_kwargs: dict, ep_size: int, seed: int, options: tuple = ()):
    """(experts, canonical weights); cached per (backend, mode, shape, options) to save load time."""
    key = (name, mode, tuple(sorted(cfg_kwargs.items())), ep_size, options)
    if key not in _CACHE:
        from epmoe.experts import EXPERTS

        cfg = MoEConfig(**cfg_kwargs)
        spec = ExpertsSpec(cfg, ep_size - 1, ep_size, torch.device("cuda"), plan=QuantPlan(expert_mode=mode),
                           options=options)  # fmt: skip
        cls = EXPERTS.get(name)
        avail = cls.availability(spec)
        if not avail:
            pytest.skip(f"{name}/{mode}: {avail.describe()}")
        ex = cls(spec)
        w = T.random_expert_weights(
            cfg, spec.num_local_experts, device="cuda", seed=seed, first_expert=spec.first_local_expert
        )
        ex.load_weights(w)
        _CACHE.clear()  # keep one backend's weights resident at a time
        _REF_CACHE.clear()
        _CACHE[key] = (ex, w)
    return _CACHE[key]


def _reference(ex, w, x, ids, tw):
    cfg, mode = ex.config, ex.spec.plan.expert_mode
    if mode == "bf16":
        grouped = ex.name == "grouped_mm" or getattr(ex, "uses_grouped_mm", lambda n: False)(x.shape[0] * ids.shape[1])
        rt = (lambda a: a.bfloat16().double()) if grouped else None
        return T.experts_reference(cfg, w, x, ids, tw, act_roundtrip=rt)
    key = ("dequantized", id(w), mode)
    if key not in _REF_CACHE:  # the backend quantized the same float weights the same way at load
        _REF_CACHE.clear()
        d = kf.dequantize_expert_weights(kf.quantize_expert_weights(w, mode))
        _REF_CACHE[key] = (d.w13(), d.w2)
    w13, w2 = _REF_CACHE[key]
    if mode != "fp8_block":
        return T.experts_reference(cfg, w, x, ids, tw, w13=w13, w2=w2)
    xq, xs = kf.quantize_fp8_tokens(x)

    def rt(a):
        aq, a_s = kf.quantize_fp8_tokens(a.float())
        return kf.dequantize_fp8_tokens(aq, a_s).double()

    return T.experts_reference(cfg, w, kf.dequantize_fp8_tokens(xq, xs), ids, tw, w13=w13, w2=w2, act_roundtrip=rt)


def _run_case(name, mode, cfg_kwargs, ep_size, N, invalid_frac=0.25, options=()):
    seed = T.fresh_seed()
    ex, w = _backend(name, mode, cfg_kwargs, ep_size, seed, options)
    cfg = ex.config
    E = ex.spec.num_local_experts
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(N, cfg.hidden_size, generator=g, device="cuda").bfloat16()
    empty = min(2, N - 1) if N > 1 else 0
    ids, tw = T.random_local_routing(N, cfg.top_k, E, "cuda", seed + 2, invalid_frac=invalid_frac, empty_rows=empty)
    T.poison_cuda_allocator()
    out = ex(DispatchedTokens(x, ids, tw))
    torch.cuda.synchronize()
    msg = f"{name}/{mode}{list(options) if options else ''} N={N} seed={seed}"
    assert out.shape == (N, cfg.hidden_size) and out.dtype == torch.bfloat16, msg
    assert bool(torch.isfinite(out).all()), f"{msg}: NaN/inf (unwritten output or unwritten row read)"
    if empty:
        assert bool((out[-empty:] == 0).all()), f"{msg}: rows with no local expert must be 0"
    ref = _reference(ex, w, x, ids, tw)
    err = T.relative_error(out, ref)
    print(f"{msg}: rel err {err:.2e}")
    assert err < BOUND, f"{msg}: relative error {err:.3g} >= {BOUND}"
    out2 = ex(DispatchedTokens(x, ids, tw))
    assert torch.equal(out, out2), f"{msg}: not deterministic"
    return ex, x, ids, tw, out


TRITON_MODES = ["bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16"]
# (mode, N): decode (N=1), a medium batch and a prefill batch; the W4A16 modes are the decode /
# small-batch path, their large-tile kernels are covered by the GPT-OSS N=512 case. Kept lean:
# every distinct (mode, tile preset, shape) costs a Triton compile (~1-2 s).
DS_CASES = [
    ("bf16", 1), ("bf16", 256), ("bf16", 4096),
    ("fp8_block", 1), ("fp8_block", 4096),
    ("nvfp4_w4a16", 1), ("mxfp4_w4a16", 1),
]  # fmt: skip


# bf16 forwards with >= GROUPED_MM_MIN_ROWS rows per local expert run the grouped_mm path by default;
# "off" keeps these cases on the Triton GEMMs (both stay covered).
TRITON_GEMMS = (("triton_grouped_mm", "off"),)
GMM_ON = (("triton_grouped_mm", "on"),)


@pytest.mark.parametrize("mode,N", DS_CASES)
def test_triton_deepseek_shape(mode, N):
    _run_case("triton", mode, DS, DS_EP, N, options=TRITON_GEMMS if mode == "bf16" else ())


@pytest.mark.parametrize("N", [1, 512])
@pytest.mark.parametrize("mode", TRITON_MODES)
def test_triton_gptoss_shape(mode, N):
    _run_case("triton", mode, GPTOSS, GPTOSS_EP, N, options=TRITON_GEMMS if mode == "bf16" else ())


@pytest.mark.parametrize("N", [1, 256, 4096])
def test_triton_bf16_grouped_mm_path(N):
    """The triton backend's bf16 prefill path (torch._grouped_mm + fused gather / activation /
    combine, gate/up interleaved weights); N = 4096 is what `auto` picks at this shape."""
    ex, *_ = _run_case("triton", "bf16", DS, DS_EP, N, options=GMM_ON)
    assert ex.uses_grouped_mm(N * DS["top_k"])
    auto, _ = _backend("triton", "bf16", DS, DS_EP, T.fresh_seed())
    assert auto.uses_grouped_mm(4096 * DS["top_k"]), "auto: T=4096 over 32 local experts takes grouped_mm"


def test_triton_bf16_grouped_mm_path_gptoss():
    """Biases and the clamped swiglu on the grouped_mm path (gate/up interleaved)."""
    _run_case("triton", "bf16", GPTOSS, GPTOSS_EP, 512, options=GMM_ON)


def test_triton_relu2():
    _run_case("triton", "bf16", RELU2, 8, 300)


@pytest.mark.parametrize("N", [1, 4096])
def test_grouped_mm_deepseek_shape(N):
    _run_case("grouped_mm", "bf16", DS, DS_EP, N)


def test_grouped_mm_gptoss_shape():
    _run_case("grouped_mm", "bf16", GPTOSS, GPTOSS_EP, 512)


@pytest.mark.parametrize("cfg_kwargs,ep", [(DS, DS_EP), (GPTOSS, GPTOSS_EP)], ids=["ds", "gptoss"])
def test_grouped_mm_torch_epilogue_still_selectable(cfg_kwargs, ep):
    """The plain-torch composite (grouped_mm_epilogue=torch), kept to revert by configuration."""
    ex, *_ = _run_case("grouped_mm", "bf16", cfg_kwargs, ep, 512, options=(("grouped_mm_epilogue", "torch"),))
    assert ex.epilogue == "torch"


def test_triton_fp8_payload_matches_bf16_input():
    """An fp8_block payload (quantized by the dispatcher with the torch codec) gives exactly the
    result of bf16 tokens quantized inside the backend (the in-kernel quantizer is the codec)."""
    ex, x, ids, tw, out = _run_case("triton", "fp8_block", DS, DS_EP, 64)
    xq, xs = kf.quantize_fp8_tokens(x)
    payload = QuantizedActivation(FP8_BLOCK_PAYLOAD, xq, xs, x.shape[1])
    out_q = ex(DispatchedTokens(payload, ids, tw))
    assert torch.equal(out_q, out), f"payload vs in-kernel quantization: rel diff {T.relative_error(out_q, out.double()):.3g}"


def _pow2_groups(shape, block_rows, block_cols, lo, hi, g):
    """Factors 2^k (k uniform in [lo, hi]) constant on block_rows x block_cols blocks: exact in bf16;
    the fp8 groups' amax then differ by up to 2^(hi-lo), so a wrong group scale is a large error."""
    *lead, R, C = shape
    k = torch.randint(lo, hi + 1, (*lead, -(-R // block_rows), -(-C // block_cols)), generator=g, device="cuda")
    f = torch.exp2(k.float()).repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return f[..., :R, :C]


def test_fp8_quantizer_is_the_codec():
    """The in-kernel 1x128 quantizer equals `kernel_formats.quantize_fp8_tokens` (the torch codec the
    dispatcher and the reference use) bit for bit, on plain and on pow2-scaled bf16 rows."""
    seed = T.fresh_seed()
    ex, _ = _backend("triton", "fp8_block", DS, DS_EP, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2048, DS["hidden_size"], generator=g, device="cuda")
    for name, xx in (("plain", x), ("pow2 groups", x * _pow2_groups(x.shape, 1, 128, -6, 6, g))):
        xb = xx.bfloat16()
        q, s = ex._input_activations(xb)
        tq, ts = kf.quantize_fp8_tokens(xb)
        bad = (q.view(torch.uint8) != tq.view(torch.uint8)).float().mean().item()
        assert bad == 0 and torch.equal(s, ts), f"{name} seed={seed}: {bad:.2e} of bytes differ, scales equal {torch.equal(s, ts)}"


@pytest.mark.parametrize("N", [64, 4096])
def test_triton_fp8_nonuniform_groups(N):
    """fp8_block with activation groups and weight blocks scaled by 2^-4..2^4 / 2^-3..2^3: every
    scale-indexing mistake (row, K step, gate/up grid, n tile) becomes a large error."""
    seed = T.fresh_seed()
    _CACHE.clear()
    _REF_CACHE.clear()
    from epmoe.experts import EXPERTS

    cfg = MoEConfig(**DS)
    spec = ExpertsSpec(cfg, DS_EP - 1, DS_EP, torch.device("cuda"), plan=QuantPlan(expert_mode="fp8_block"))
    ex = EXPERTS.get("triton")(spec)
    E = spec.num_local_experts
    w = T.random_expert_weights(cfg, E, device="cuda", seed=seed, first_expert=spec.first_local_expert)
    g = torch.Generator(device="cuda").manual_seed(seed + 5)
    w = replace(w, **{k: (getattr(w, k).float() * _pow2_groups(getattr(w, k).shape, 128, 128, -3, 3, g)).bfloat16()
                      for k in ("w1", "w3", "w2")})  # fmt: skip
    ex.load_weights(w)
    x = torch.randn(N, cfg.hidden_size, generator=g, device="cuda")
    x = (x * _pow2_groups(x.shape, 1, 128, -4, 4, g)).bfloat16()
    ids, tw = T.random_local_routing(N, cfg.top_k, E, "cuda", seed + 2, invalid_frac=0.25)
    T.poison_cuda_allocator()
    out = ex(DispatchedTokens(x, ids, tw))
    err = T.relative_error(out, _reference(ex, w, x, ids, tw))
    print(f"triton/fp8_block nonuniform N={N} seed={seed}: rel err {err:.2e}")
    assert err < BOUND, f"nonuniform fp8 N={N} seed={seed}: relative error {err:.3g} >= {BOUND}"
    _REF_CACHE.clear()


def test_triton_bf16_blocked_gate_up_layout():
    """The [gate; up] w13 layout (option triton_gate_up=blocked) on the prefill tiles (split tails)."""
    seed = T.fresh_seed()
    _CACHE.clear()
    from epmoe.experts import EXPERTS

    cfg = MoEConfig(**GPTOSS)
    spec = ExpertsSpec(cfg, 0, GPTOSS_EP, torch.device("cuda"), plan=QuantPlan(expert_mode="bf16"),
                       options=(("triton_gate_up", "blocked"),) + TRITON_GEMMS)  # fmt: skip
    ex = EXPERTS.get("triton")(spec)
    assert not ex.gate_up_interleaved
    E = spec.num_local_experts
    w = T.random_expert_weights(cfg, E, device="cuda", seed=seed, first_expert=spec.first_local_expert)
    ex.load_weights(w)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(2048, cfg.hidden_size, generator=g, device="cuda").bfloat16()
    ids, tw = T.random_local_routing(2048, cfg.top_k, E, "cuda", seed + 2, invalid_frac=0.25)
    out = ex(DispatchedTokens(x, ids, tw))
    err = T.relative_error(out, _reference(ex, w, x, ids, tw))
    print(f"triton/bf16 blocked gate/up N=2048 seed={seed}: rel err {err:.2e}")
    assert err < BOUND, f"blocked layout seed={seed}: relative error {err:.3g}"


@pytest.mark.parametrize("name", ["triton", "grouped_mm"])
def test_reload_in_place_on_gpu(name):
    seed = T.fresh_seed()
    ex, w = _backend(name, "bf16", GPTOSS, GPTOSS_EP, seed)
    ptrs = {k: v.data_ptr() for k, v in ex.parameters().items()}
    w2 = T.random_expert_weights(ex.config, ex.spec.num_local_experts, "cuda", seed + 7, first_expert=w.first_expert)
    ex.load_weights(w2)
    assert {k: v.data_ptr() for k, v in ex.parameters().items()} == ptrs
    ex.load_weights(w)  # restore for the cached instance


@pytest.mark.parametrize(
    "name,mode,options",
    [("triton", "bf16", ()), ("triton", "fp8_block", ()), ("triton", "mxfp4_w4a16", ()),
     ("triton", "nvfp4_w4a16", ()), ("grouped_mm", "bf16", ()), ("triton", "bf16", GMM_ON)],
)  # fmt: skip
def test_cuda_graph_replay_equals_eager(name, mode, options):
    from epmoe.experts.graphs import CapturedExperts

    seed = T.fresh_seed()
    ex, w = _backend(name, mode, DS, DS_EP, seed, options)
    E, K, H = ex.spec.num_local_experts, ex.config.top_k, ex.config.hidden_size
    # 32 rows x top-8 over 32 experts: the decode tile preset (kernels already built by the N=1 tests)
    graph = CapturedExperts(ex, max_rows=32, top_k=K)
    for n in (32, 25, 1):
        g = torch.Generator(device="cuda").manual_seed(seed + n)
        x = torch.randn(n, H, generator=g, device="cuda").bfloat16()
        ids, tw = T.random_local_routing(n, K, E, "cuda", seed + 3 * n, invalid_frac=0.3)
        eager = ex(DispatchedTokens(x, ids, tw))
        replay = graph(DispatchedTokens(x, ids, tw)).clone()
        assert torch.equal(eager, replay), f"{name}/{mode} n={n} seed={seed}: graph replay != eager"
    # a weight reload (in place) is seen by the captured graph
    w_new = T.random_expert_weights(ex.config, E, "cuda", seed + 11, first_expert=w.first_expert)
    ex.load_weights(w_new)
    eager = ex(DispatchedTokens(x, ids, tw))
    assert torch.equal(eager, graph(DispatchedTokens(x, ids, tw))), f"{name}/{mode}: graph missed the reload"
    ex.load_weights(w)


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("shape,N", [("ds", 1), ("ds", 256), ("gptoss", 512)])
def test_fp4_packed_conversion_equals_legacy(mode, shape, N):
    """The fp4 -> bf16 conversions give the legacy conversion's output bit for bit on the GPU
    (decode, small and prefill tiles): the default (bf16 bits from inline PTX, on bit-permuted weight
    words where `auto` picks the words conversion; the CPU interpreter cannot run PTX: with
    test_fp4_words_conversion_equals_asm, its only check) and the packed Triton-ops one. bf16 subnormal
    operands (code 0.5 -> 2^-127) survive the bf16 multiply, and the nvfp4 2^-7 folded into the
    global scale changes no bit."""
    seed = T.fresh_seed()
    cfg_kwargs, ep = (DS, DS_EP) if shape == "ds" else (GPTOSS, GPTOSS_EP)
    # the Triton kernels at every tile size (decode tiles would otherwise run the Gluon kernels,
    # which sum K in another order: test_w4a16_gluon_decode)
    tk = (("triton_w4a16_decode", "triton"),)
    default, w = _backend("triton", mode, cfg_kwargs, ep, seed, tk)
    from epmoe.experts.triton import triton_experts as TE

    conv = TE.resolve_fp4_convert("auto")
    assert default.fp4_packed and default.fp4_convert == conv, "auto (words) is the default for bf16 models"
    assert default._fp4_kernel_convert == {"words": 3, "asm": 2}[conv]
    from epmoe.experts import EXPERTS

    def other(conv):
        ex = EXPERTS.get("triton")(ExpertsSpec(default.config, ep - 1, ep, torch.device("cuda"),
                                               plan=QuantPlan(expert_mode=mode),
                                               options=(("triton_fp4_convert", conv),) + tk))  # fmt: skip
        ex.load_weights(w)
        return ex

    E = default.spec.num_local_experts
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(N, default.config.hidden_size, generator=g, device="cuda").bfloat16()
    ids, tw = T.random_local_routing(N, default.config.top_k, E, "cuda", seed + 2, invalid_frac=0.2)
    # Triton kernels' tiles for every conversion: where the auto table picks the Gluon wgmma preset (64 rows
    # per expert at ds N = 256 since 2026-12-02), which only the default conversion runs, the preset auto
    # picked here before ("medium")
    cfg_t = default.tile_config(N * default.config.top_k)
    pin = TE.presets_for(mode)["medium"] if cfg_t.wgmma else None
    default.config_override = pin
    try:
        out_a = default(DispatchedTokens(x, ids, tw))
    finally:
        default.config_override = None
    assert not (pin or cfg_t).wgmma
    for conv in ("legacy", "packed"):
        ex = other(conv)
        ex.config_override = pin
        assert ex.fp4_packed == (conv == "packed")
        out_o = ex(DispatchedTokens(x, ids, tw))
        del ex
        diff = (out_a.float() - out_o.float()).abs().max().item()
        assert torch.equal(out_a, out_o), f"{mode} {shape} N={N} seed={seed}: asm != {conv} (max diff {diff:.3g})"


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("shape,N,preset,decode", [
    ("ds", 1, None, "gluon"), ("ds", 1, None, "triton"), ("ds", 256, None, "gluon"), ("ds", 600, None, "gluon"),
    ("ds", 600, "prefill_n128", "gluon"), ("gptoss", 1, None, "gluon"), ("gptoss", 512, None, "gluon"),
    ("relu2", 300, None, "gluon"),
])  # fmt: skip
def test_fp4_words_conversion_equals_asm(mode, shape, N, preset, decode):
    """Convert mode "words" (weights bit-permuted per 4-byte word at load, `_E2M1_BF16_WORDS_ASM`)
    gives the asm mode's output bit for bit on every kernel that reads W4A16 weights: the Gluon
    decode kernel (N = 1), the Triton kernels (decode tiles with triton_w4a16_decode=triton, the
    64-row tiles at N = 256, prefill_n128, GPT-OSS prefill), and the Gluon wgmma kernel in the decode
    kernel's K order (the auto prefill preset at N = 600). Each conversion call must take one whole
    word of the weights; a kernel that packed other bytes would give other values."""
    from epmoe.experts import EXPERTS

    seed = T.fresh_seed()
    cfg_kwargs, ep = {"ds": (DS, DS_EP), "gptoss": (GPTOSS, GPTOSS_EP), "relu2": (RELU2, 8)}[shape]
    opts = (("triton_w4a16_decode", decode),) + ((("triton_config", preset),) if preset else ())
    asm, w = _backend("triton", mode, cfg_kwargs, ep, seed, (("triton_fp4_convert", "asm"),) + opts)
    words = EXPERTS.get("triton")(ExpertsSpec(asm.config, ep - 1, ep, torch.device("cuda"),
                                              plan=QuantPlan(expert_mode=mode),
                                              options=(("triton_fp4_convert", "words"),) + opts))  # fmt: skip
    words.load_weights(w)
    assert asm._fp4_kernel_convert == 2 and words._fp4_kernel_convert == 3
    E = asm.spec.num_local_experts
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(N, asm.config.hidden_size, generator=g, device="cuda").bfloat16()
    ids, tw = T.random_local_routing(N, asm.config.top_k, E, "cuda", seed + 2, invalid_frac=0.2)
    cfg = asm.tile_config(N * asm.config.top_k)
    out_a = asm(DispatchedTokens(x, ids, tw))
    out_w = words(DispatchedTokens(x, ids, tw))
    del words
    diff = (out_a.float() - out_w.float()).abs().max().item()
    print(f"{mode} {shape} N={N} {cfg.name} gluon={asm.uses_gluon_w4a16(cfg)}: words vs asm max diff {diff:.3g}")
    assert torch.equal(out_a, out_w), f"{mode} {shape} N={N} {cfg.name} seed={seed}: words != asm (max diff {diff:.3g})"


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("shape,N", [("ds", 1), ("ds", 60), ("gptoss", 1), ("gptoss", 60), ("relu2", 16)])
def test_w4a16_gluon_decode(mode, shape, N):
    """W4A16 decode tiles run the Gluon kernels (weights straight into the mma registers, K summed in
    the swap-AB order) by default: within the bound of the float64 math and close to the Triton
    kernels' output; GPT-OSS has K // 64 = 45 (the one-step loop) plus biases and the clamped swiglu,
    relu2 is not gated."""
    cfg_kwargs, ep = {"ds": (DS, DS_EP), "gptoss": (GPTOSS, GPTOSS_EP), "relu2": (RELU2, 8)}[shape]
    ex, x, ids, tw, out = _run_case("triton", mode, cfg_kwargs, ep, N)
    from epmoe.experts.triton.triton_experts import pick_config

    cfg = pick_config(mode, N * ex.config.top_k, ex.spec.num_local_experts)
    assert ex.uses_gluon_w4a16(cfg), f"{mode} {shape} N={N}: {cfg.describe()} should run the Gluon kernels"
    from epmoe.experts import EXPERTS

    tk = EXPERTS.get("triton")(ExpertsSpec(ex.config, ep - 1, ep, torch.device("cuda"), plan=QuantPlan(expert_mode=mode),
                                           options=(("triton_w4a16_decode", "triton"),)))  # fmt: skip
    tk.load_weights(_CACHE[next(iter(_CACHE))][1])
    assert not tk.uses_gluon_w4a16(cfg)
    out_t = tk(DispatchedTokens(x, ids, tw))
    del tk
    diff = T.relative_error(out, out_t.double())
    print(f"{mode} {shape} N={N}: gluon vs triton kernels rel diff {diff:.2e}")
    assert diff < 5e-3, f"{mode} {shape} N={N}: gluon and triton kernels differ by {diff:.3g}"


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("shape,N", [("ds", 1), ("ds", 60), ("gptoss", 40), ("relu2", 30)])
def test_w4a16_gluon_decode_split(mode, shape, N):
    """Preset `decode_split` (16-row tiles whose <= 8 real rows run the kernel's 8-row code, SPLIT_M)
    against the float64 math, and bit for bit against `decode` (each routed row is an mma column,
    computed alike whether its tile runs 8 or 16 rows). N = 1: every tile half; DeepSeek N = 60 (~11
    rows per local expert), GPT-OSS N = 40 (~7.5) and relu2 (not gated) N = 30 (~2.8): both kinds."""
    from epmoe.experts.triton import triton_experts as TE

    cfg_kwargs, ep = {"ds": (DS, DS_EP), "gptoss": (GPTOSS, GPTOSS_EP), "relu2": (RELU2, 8)}[shape]
    ex, _ = _backend("triton", mode, cfg_kwargs, ep, T.fresh_seed())
    ex.config_override = TE.presets_for(mode)["decode_split"]
    try:
        assert ex.uses_gluon_w4a16(ex.config_override)
        _, x, ids, tw, out = _run_case("triton", mode, cfg_kwargs, ep, N)
        ex.config_override = TE.presets_for(mode)["decode"]
        out_full = ex(DispatchedTokens(x, ids, tw))
    finally:
        ex.config_override = None
    diff = (out.double() - out_full.double()).abs().max().item()
    assert torch.equal(out, out_full), f"{mode} {shape} N={N}: decode_split differs from decode (max {diff:.3g})"


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("unroll,preset,block_n,warps", [
    (1, "decode", 64, 4), (4, "decode", 64, 4), (2, "decode_m8", 64, 4), (4, "decode_m8", 64, 4), (2, "decode", 128, 4),
    (2, "decode", 128, 8), (2, "decode", 256, 16), (2, "decode", 64, 2),
])  # fmt: skip
def test_w4a16_gluon_variants(mode, unroll, preset, block_n, warps, monkeypatch):
    """The Gluon W4A16 kernel's variants (K steps per iteration, 8- or 16-row tiles, 64 to 256 weight
    rows per program over 2 to 16 warps) against the float64 math, DeepSeek and GPT-OSS shapes (45 K steps: the
    unroll falls back to one)."""
    from epmoe.experts.triton import triton_experts as TE

    monkeypatch.setattr(TE, "GLUON_W4A16_UNROLL", unroll)
    monkeypatch.setattr(TE, "GLUON_W4A16_BLOCK_N", block_n)
    monkeypatch.setattr(TE, "GLUON_W4A16_WARPS", warps)
    monkeypatch.setattr(TE, "GLUON_W4A16_WORDS_TILES", {})  # the variant as given, for every conversion
    for cfg_kwargs, ep, N in ((DS, DS_EP, 60), (GPTOSS, GPTOSS_EP, 40)):
        if cfg_kwargs["intermediate_size"] % block_n or cfg_kwargs["hidden_size"] % block_n:
            continue  # (GPT-OSS 2880 rows: 64-row programs only)
        ex, w = _backend("triton", mode, cfg_kwargs, ep, T.fresh_seed())
        ex.config_override = TE.presets_for(mode)[preset]
        try:
            assert ex.uses_gluon_w4a16(ex.config_override)
            _run_case("triton", mode, cfg_kwargs, ep, N)
        finally:
            ex.config_override = None


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("shape,N", [("ds", 1), ("ds", 60), ("ds", 600), ("gptoss", 40), ("gptoss", 700),
                                     ("relu2", 30), ("relu2", 300)])
def test_w4a16_fp4_row_tiles(mode, shape, N):
    """Option triton_fp4_layout=tiles (the default: fp4 weights in row tiles, `kernel_formats.tile_fp4_rows`;
    every kernel's TILED) against the float64 math, and bit for bit against triton_fp4_layout=rows (the
    same bytes read from other addresses) with the auto presets: decode sizes (the Gluon decode kernel,
    half tiles and full) and prefill sizes (the Gluon wgmma kernel; GPT-OSS: the Triton kernels)."""
    from epmoe.experts import EXPERTS

    cfg_kwargs, ep = {"ds": (DS, DS_EP), "gptoss": (GPTOSS, GPTOSS_EP), "relu2": (RELU2, 8)}[shape]
    tiles = (("triton_fp4_layout", "tiles"),)
    ex_t, x, ids, tw, out_t = _run_case("triton", mode, cfg_kwargs, ep, N, options=tiles)
    _, w = _backend("triton", mode, cfg_kwargs, ep, T.fresh_seed(), tiles)  # cached: the weights _run_case used
    assert ex_t.fp4_tiles
    ex = EXPERTS.get("triton")(ExpertsSpec(ex_t.config, ep - 1, ep, torch.device("cuda"), plan=QuantPlan(expert_mode=mode),
                                           options=(("triton_fp4_layout", "rows"),)))  # fmt: skip
    assert not ex.fp4_tiles
    ex.load_weights(w)
    out = ex(DispatchedTokens(x, ids, tw))
    del ex
    diff = (out.double() - out_t.double()).abs().max().item()
    assert torch.equal(out, out_t), f"{mode} {shape} N={N}: row tiles differ from rows (max {diff:.3g})"


@pytest.mark.parametrize("N", [1, 60, 600])
def test_nvfp4_zero_and_negative_block_scales(N):
    """An nvfp4 checkpoint whose block scales include +0, -0 and negative e4m3 values (loaded as shipped:
    quantized weights): the Gluon kernels' scale conversion needs scales >= +0 and zero-scale weights 0,
    which `kernel_formats.normalize_nvfp4_scales` makes so at load, value for value. Decode sizes (the
    Gluon decode kernel, half and full tiles) and a prefill size (the Gluon wgmma kernel) against the
    float64 math on the checkpoint's own dequantized weights; the caller's scale tensors untouched."""
    from epmoe.experts import EXPERTS

    seed = T.fresh_seed()
    cfg = MoEConfig(**DS)
    spec = ExpertsSpec(cfg, DS_EP - 1, DS_EP, torch.device("cuda"), plan=QuantPlan(expert_mode="nvfp4_w4a16"))
    w = T.random_expert_weights(cfg, spec.num_local_experts, device="cuda", seed=seed, first_expert=spec.first_local_expert)
    q = kf.quantize_expert_weights(w, "nvfp4_w4a16")
    g = torch.Generator(device="cuda").manual_seed(seed + 3)
    for name in ("w1_scale", "w3_scale", "w2_scale"):
        sb = getattr(q, name).view(torch.uint8)
        u = torch.rand(sb.shape, generator=g, device="cuda")
        sb[u < 0.2] |= 0x80  # negative
        sb[(u >= 0.2) & (u < 0.25)] = 0x00
        sb[(u >= 0.25) & (u < 0.3)] = 0x80  # -0
    before = {n: getattr(q, n).clone() for n in ("w1_scale", "w3_scale", "w2_scale")}
    ex = EXPERTS.get("triton")(spec)
    ex.load_weights(q)
    assert all(torch.equal(getattr(q, n).view(torch.uint8), t.view(torch.uint8)) for n, t in before.items())
    d = kf.dequantize_expert_weights(q)
    x = torch.randn(N, cfg.hidden_size, generator=g, device="cuda").bfloat16()
    ids, tw = T.random_local_routing(N, cfg.top_k, spec.num_local_experts, "cuda", seed + 4, invalid_frac=0.25)
    T.poison_cuda_allocator()
    out = ex(DispatchedTokens(x, ids, tw))
    cfg_t = ex.tile_config(N * cfg.top_k)
    assert ex.uses_gluon_w4a16(cfg_t), cfg_t.describe()
    ref = T.experts_reference(cfg, w, x, ids, tw, w13=d.w13(), w2=d.w2)
    err = T.relative_error(out, ref)
    print(f"nvfp4 zero / negative scales N={N} ({cfg_t.name}) seed={seed}: rel err {err:.2e}")
    assert bool(torch.isfinite(out).all()) and err < BOUND, f"N={N} seed={seed}: relative error {err:.3g}"


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("preset", ["wgmma_w4r128_kp", "wgmma_w4r128_kp_m64", "wgmma_w4r128_kp_pend"])
def test_w4a16_gluon_wgmma(mode, preset):
    """The Gluon wgmma W4A16 kernel (prefill tiles of 64 / 128 routed rows) against the float64 math and
    the Triton kernels with the same tiles: DeepSeek shape (rows per expert 1-2 tiles, padding and empty
    tiles), relu2 (not gated) and GPT-OSS (2880 = 45 K steps: the 128-output gemm2 does not tile it, so
    the Triton kernels run). K is summed in another order than the Triton kernels (the decode kernel's),
    hence the bound; the pending-wgmma pipeline (the auto preset) gives the output of `wgmma_w4r128_kp`
    (the same K steps in the same order) bit for bit."""
    from epmoe.experts import EXPERTS
    from epmoe.experts.triton import triton_experts as TE

    cfg_t = TE.presets_for(mode)[preset]
    for cfg_kwargs, ep, N in ((DS, DS_EP, 600), (RELU2, 8, 300), (GPTOSS, GPTOSS_EP, 700)):  # GPT-OSS: 2880 = 45 x 64
        ex, w = _backend("triton", mode, cfg_kwargs, ep, T.fresh_seed())
        runs = ex.uses_gluon_w4a16(cfg_t)
        divides = (cfg_kwargs["intermediate_size"] % ex._wgmma_block_n(True, cfg_t) == 0
                   and cfg_kwargs["hidden_size"] % ex._wgmma_block_n(False, cfg_t) == 0
                   # nvfp4 scale rows of K / 16 bytes, 16-byte aligned (GPT-OSS 2880 / 16 = 180: no)
                   and (mode != "nvfp4_w4a16" or cfg_kwargs["hidden_size"] % 256 == 0))
        assert runs == divides, f"{preset} {cfg_kwargs}: uses_gluon_w4a16 {runs}"
        ex.config_override = cfg_t
        try:
            _, x, ids, tw, out = _run_case("triton", mode, cfg_kwargs, ep, N)
        finally:
            ex.config_override = None
        if not runs:
            continue
        tk = EXPERTS.get("triton")(ExpertsSpec(ex.config, ep - 1, ep, torch.device("cuda"),
                                               plan=QuantPlan(expert_mode=mode)))  # fmt: skip
        tk.load_weights(w)
        tk.config_override = replace(cfg_t, wgmma=False)
        assert not tk.uses_gluon_w4a16(tk.config_override)
        out_t = tk(DispatchedTokens(x, ids, tw))
        del tk
        diff = T.relative_error(out, out_t.double())
        print(f"{mode} {preset} N={N}: gluon wgmma vs triton kernels rel diff {diff:.2e}")
        assert diff < 5e-3, f"{mode} {preset}: gluon and triton kernels differ by {diff:.3g}"
        kp = TE.presets_for(mode)["wgmma_w4r128_kp"]
        if cfg_t.block_m >= 128 and preset != "wgmma_w4r128_kp" and ex.uses_gluon_w4a16(kp):
            ex.config_override = kp
            try:
                out_128 = ex(DispatchedTokens(x, ids, tw))
            finally:
                ex.config_override = None
            assert torch.equal(out_128, out), (
                f"{mode} {preset} N={N}: differs from wgmma_w4r128_kp "
                f"(max {(out_128.double() - out.double()).abs().max().item():.3g})")


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("tail", [16, 32, 48])
def test_w4a16_wgmma_tail_tiles(mode, tail):
    """The wgmma preset with tail_rows (the auto preset's 32, and 16 / 48): each expert's last tile of <= tail
    real rows runs on the Gluon decode kernel (16-row tiles at the rows of `align.split_tail_tiles`' table),
    the others on the wgmma kernel. Against the float64 math, and bit for bit against the same preset
    without tails (both kernels sum K in the decode kernel's order: H200 2026-12-02, relative difference 0
    in every run), skewed routing (tails of every size, empty experts, invalid slots); the GPU tail split
    equals the torch one; deterministic."""
    from epmoe.experts.triton import align as A
    from epmoe.experts.triton import triton_experts as TE

    seed = T.fresh_seed()
    ex, w = _backend("triton", mode, DS, DS_EP, seed)
    E, cfg = ex.spec.num_local_experts, ex.config
    with_tails = replace(TE.presets_for(mode)["wgmma_w4r128_kp_pend_t32"], tail_rows=tail, name=f"tails{tail}")
    assert ex.runs_tails(with_tails), with_tails.describe()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    N = 1500
    x = torch.randn(N, cfg.hidden_size, generator=g, device="cuda").bfloat16()
    for r in range(50):  # the first routing of this seed with >= 3 small tiles
        ids, tw = T.skewed_local_routing(N, cfg.top_k, E, "cuda", seed + 2 + r, invalid_frac=0.1)
        blocks = A.align_blocks(A.sort_by_expert(ids, E), 128)
        small = int(((blocks.block_expert >= 0) & (blocks.block_rows <= tail)).sum())
        if small >= 3:
            break
    assert small >= 3, f"seed {seed}: no routing with small tiles"
    launch = lambda name, grid, args, kwargs: getattr(TE.kernel_module(torch.device("cuda")), name)[grid](*args, **kwargs)
    want, got = A.split_tail_tiles(blocks, E, tail, 16), A.split_tail_tiles_triton(blocks, E, tail, 16, launch)
    for n in ("block_expert", "tail_expert", "tail_row0", "tail_rows"):
        assert torch.equal(getattr(got, n), getattr(want, n)), n
    outs = {}
    for cfg_t in (with_tails, TE.presets_for(mode)["wgmma_w4r128_kp_pend"]):
        ex.config_override = cfg_t
        try:
            T.poison_cuda_allocator()
            outs[cfg_t.name] = ex(DispatchedTokens(x, ids, tw))
            again = ex(DispatchedTokens(x, ids, tw))
        finally:
            ex.config_override = None
        assert torch.equal(outs[cfg_t.name], again), f"{cfg_t.name}: not deterministic"
    out, plain = outs[with_tails.name], outs["wgmma_w4r128_kp_pend"]
    ref = _reference(ex, w, x, ids, tw)
    err, diff = T.relative_error(out, ref), T.relative_error(out, plain.double())
    print(f"{mode} tails <= {tail} ({small} small tiles) seed={seed}: rel err {err:.2e}, vs no tails {diff:.2e}")
    assert bool(torch.isfinite(out).all()) and err < BOUND, f"seed {seed}: relative error {err:.3g}"
    assert torch.equal(out, plain), f"seed {seed}: with and without tails differ by {diff:.3g}"


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("preset", ["wgmma_w4r128_kp_pend", "wgmma_w4r128_kp_m64"])
def test_w4a16_wgmma_scale_ring(mode, preset, monkeypatch):
    """The wgmma kernel's scales through its cp.async ring (WGMMA_SCALE_RING, the default) give the output of
    the scales loaded from global memory one K step ahead bit for bit (the same values, the same math), and
    stay within the float64 bound: DeepSeek shape (skewed routing: tiles of every size, invalid slots) and
    relu2 (not gated: the MMA tile's rows one projection)."""
    from epmoe.experts.triton import triton_experts as TE

    for cfg_kwargs, ep, N in ((DS, DS_EP, 900), (RELU2, 8, 300)):
        seed = T.fresh_seed()
        ex, w = _backend("triton", mode, cfg_kwargs, ep, seed)
        ex.config_override = TE.presets_for(mode)[preset]
        assert ex.uses_gluon_w4a16(ex.config_override)
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        x = torch.randn(N, ex.config.hidden_size, generator=g, device="cuda").bfloat16()
        ids, tw = T.skewed_local_routing(N, ex.config.top_k, ex.spec.num_local_experts, "cuda", seed + 2,
                                         invalid_frac=0.1)
        outs = {}
        for ring in (True, False):
            monkeypatch.setattr(TE, "WGMMA_SCALE_RING", ring)
            T.poison_cuda_allocator()
            outs[ring] = ex(DispatchedTokens(x, ids, tw))
        err = T.relative_error(outs[True], _reference(ex, w, x, ids, tw))
        print(f"{mode} {preset} H={ex.config.hidden_size} seed={seed}: scale ring rel err {err:.2e}")
        assert bool(torch.isfinite(outs[True]).all()) and err < BOUND, f"seed {seed}: relative error {err:.3g}"
        assert torch.equal(outs[True], outs[False]), (
            f"seed {seed}: scale ring and register scales differ by "
            f"{(outs[True].double() - outs[False].double()).abs().max().item():.3g}")


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_w4a16_tail_tiles_in_cuda_graph(mode):
    """The auto prefill preset with its tail tiles (wgmma kernel + decode kernel on the small tiles' table,
    the table made on the GPU), captured in a CUDA graph at a prefill row count: each replay, queued behind
    other work on the stream, equals the eager call bit for bit and stays within the float64 bound."""
    from epmoe.experts.graphs import CapturedExperts

    seed = T.fresh_seed()
    ex, w = _backend("triton", mode, DS, DS_EP, seed)
    E, K, H = ex.spec.num_local_experts, ex.config.top_k, ex.config.hidden_size
    n = 1024  # 256 rows per expert on average: the wgmma preset, tails of every size
    assert ex.runs_tails(ex.tile_config(n * K)), ex.tile_config(n * K).describe()
    graph = CapturedExperts(ex, max_rows=n, top_k=K)
    for r in range(2):
        g = torch.Generator(device="cuda").manual_seed(seed + r)
        x = torch.randn(n, H, generator=g, device="cuda").bfloat16()
        ids, tw = T.skewed_local_routing(n, K, E, "cuda", seed + 5 + r, invalid_frac=0.1)
        eager = ex(DispatchedTokens(x, ids, tw))
        torch.cuda._sleep(50_000_000)  # the stream busy ahead of the copies and the replay
        replay = graph(DispatchedTokens(x, ids, tw)).clone()
        assert torch.equal(eager, replay), f"{mode} r={r} seed={seed}: graph replay != eager"
        ref = _reference(ex, w, x, ids, tw)
        assert T.relative_error(eager, ref) < BOUND


@pytest.mark.parametrize("E,K,N,block_m", [(32, 8, 4096, 128), (128, 8, 4096, 16), (128, 8, 128, 16), (16, 4, 1, 64)])
def test_triton_alignment_equals_torch(E, K, N, block_m):
    """The routing alignment kernels (default) give the torch sort / padding bit for bit."""
    from epmoe.experts.triton import align as A
    from epmoe.experts.triton.triton_experts import kernel_module

    def launch(name, grid, args, kwargs):
        getattr(kernel_module(torch.device("cuda")), name)[grid](*args, **kwargs)

    seed = T.fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(-1, E + 1, (N, K), generator=g, device="cuda", dtype=torch.int32)
    ref_sort = A.sort_by_expert(ids, E)
    ref = A.align_blocks(ref_sort, block_m)
    got = A.align_blocks_triton(ids, E, block_m, launch)
    srt = A.sort_by_expert_triton(ids, E, launch)
    msg = f"E={E} K={K} N={N} block_m={block_m} seed={seed}"
    assert got.max_blocks == ref.max_blocks, msg
    for name in ("sorted_ids", "block_expert", "block_rows"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), f"{msg}: {name}"
    assert torch.equal(srt.order.long(), ref_sort.order), f"{msg}: order"
    assert torch.equal(srt.sorted_expert, ref_sort.sorted_expert), f"{msg}: sorted_expert"
    assert torch.equal(srt.expert_ends.long(), ref_sort.expert_ends), f"{msg}: expert_ends"
    assert torch.equal(srt.inverse.long()[ref_sort.order], torch.arange(N * K, device="cuda")), f"{msg}: inverse"
