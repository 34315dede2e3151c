"""Our reference formats and workspace sizing against FlashInfer 0.7.2.post1 on a GPU.

Run:  python -m pytest tests/gpu/test_flashinfer_quant.py -q -s -rs
Uses only FlashInfer modules prebuilt for SM90 (`fp4_quantization_90`, `mnnvl_moe_alltoall`);
kernels that only exist for SM100+ are compared there and skipped (with the reason) elsewhere.

What SM90 can and cannot check (read from FlashInfer's source):
  * `block_scale_interleave` (GPU kernel, not arch-guarded)       -> bit-exact vs swizzle_scales_128x4
  * `e2m1_and_ufp8sf_scale_to_float` (host op of the SM90 module)  -> bit-exact vs nvfp4.dequantize
  * `fp4_quantize` on SM90: `quantize_with_block_size`'s body is compiled only for
    __CUDA_ARCH__ >= 1000 (csrc/nv_internal/tensorrt_llm/kernels/quantization.cuh), so on Hopper the
    call returns its torch.empty buffers untouched. `test_fp4_quantize_writes_nothing_on_sm90`
    pins that down (it fails, telling us to enable the bit-exact test, if FlashInfer changes).
  * `moe_a2a_get_workspace_size_per_rank`                          -> equals our formula
"""

import random

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.quant import e2m1, fp8_block, mxfp4, mxfp8, nvfp4
from epmoe.resolve import resolve_quant_plan
from epmoe.quant.workspace import flashinfer_a2a_aux_bytes, workspace_breakdown

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.requires_flashinfer,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
flashinfer = pytest.importorskip("flashinfer")

POISON = 0xA5


@pytest.fixture
def seed():
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    return s


def _major():
    return torch.cuda.get_device_capability()[0]


def _u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _poisoned_empty(monkeypatch):
    """Make every uint8 CUDA torch.empty come back filled with 0xA5, so bytes a kernel did not
    write are recognisable (FlashInfer allocates its outputs with torch.empty)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype == torch.uint8 and t.is_cuda:
            t.fill_(POISON)
        return t

    monkeypatch.setattr(torch, "empty", empty)


# ------------------------------------------------------------------ layouts and host dequant (SM90+)
@pytest.mark.parametrize("shape", [(1, 1), (127, 3), (128, 4), (300, 16), (513, 448), (3, 130, 6)])
def test_block_scale_interleave_matches_swizzle(shape, seed):
    from flashinfer.fp4_quantization import block_scale_interleave

    s = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    got = block_scale_interleave(s).cpu()
    want = nvfp4.swizzle_scales_128x4(s.cpu()).reshape(-1)
    assert got.shape == want.shape and torch.equal(got, want), f"seed={seed} shape={shape}"
    print(f"block_scale_interleave {list(shape)}: bit-exact ({want.numel()} bytes)")


@pytest.mark.parametrize("M,K", [(1, 16), (7, 64), (128, 256), (300, 1024), (129, 7168)])
@pytest.mark.parametrize("swizzled", [False, True])
def test_host_dequant_matches_ours(M, K, swizzled, seed):
    from flashinfer.fp4_quantization import e2m1_and_ufp8sf_scale_to_float

    x = torch.randn(M, K, dtype=torch.bfloat16) * torch.rand(M, 1).add(0.05).to(torch.bfloat16) * 10
    q = nvfp4.quantize(x)
    inv_gs = (1.0 / q.global_scale).reshape(1)  # FlashInfer takes the decode (inverse) global scale
    sf = nvfp4.swizzle_scales_128x4(q.scales) if swizzled else q.scales
    got = e2m1_and_ufp8sf_scale_to_float(q.packed, _u8(sf).reshape(-1), inv_gs, 16, 1, swizzled)
    want = nvfp4.dequantize(*q, dtype=torch.float32)
    assert torch.equal(got.cpu(), want), f"seed={seed} M={M} K={K} swizzled={swizzled}"


# ------------------------------------------------------------------ fp4_quantize
def test_fp4_quantize_writes_nothing_on_sm90(monkeypatch):
    if _major() >= 10:
        pytest.skip("SM100+: fp4_quantize is compared bit-for-bit in test_fp4_quantize_bit_exact")
    from flashinfer.fp4_quantization import fp4_quantize

    _poisoned_empty(monkeypatch)
    x = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    gs = (2688.0 / x.float().abs().amax()).reshape(1)
    xq, sf = fp4_quantize(x, gs, 16, False, is_sf_swizzled_layout=False, nvfp4_4over6=None)
    torch.cuda.synchronize()
    untouched = (xq.eq(POISON).float().mean().item(), _u8(sf).eq(POISON).float().mean().item())
    print(f"fp4_quantize on sm{_major()}x: fraction of output bytes left unwritten (data, scales) = {untouched}")
    assert untouched == (1.0, 1.0), (
        "FlashInfer's fp4_quantize now writes its outputs on this GPU: enable the bit-exact comparison "
        "(test_fp4_quantize_bit_exact) for this arch"
    )


@pytest.mark.parametrize("M,K", [(1, 64), (100, 512), (1024, 2048), (1300, 7168)])
@pytest.mark.parametrize("swizzled", [False, True])
def test_fp4_quantize_bit_exact(M, K, swizzled, monkeypatch, seed):
    """FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1 selects the kernel's IEEE recipe, which our "rn"
    recipe reproduces operation for operation (M >= 1024 with K % 512 == 0 takes the TMA kernel)."""
    if _major() < 10:
        pytest.skip("fp4_quantize's kernels are compiled only for SM100+ (see test_fp4_quantize_writes_nothing_on_sm90)")
    from flashinfer.fp4_quantization import fp4_quantize

    monkeypatch.setenv("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "1")
    x = (torch.randn(M, K, device="cuda") * torch.rand(M, 1, device="cuda").add(0.05) * 4).to(torch.bfloat16)
    gs = (2688.0 / x.float().abs().amax()).reshape(1)
    xq, sf = fp4_quantize(x, gs, 16, False, is_sf_swizzled_layout=swizzled, nvfp4_4over6=None)
    ref = nvfp4.quantize(x.cpu(), gs.cpu(), scale_layout="swizzled_128x4" if swizzled else "linear")
    assert torch.equal(xq.cpu(), ref.packed), f"seed={seed} M={M} K={K}"
    assert torch.equal(_u8(sf).cpu().reshape(_u8(ref.scales).shape), _u8(ref.scales)), f"seed={seed} M={M} K={K}"
    d = nvfp4.dequantize(xq.cpu(), sf.cpu().view(torch.float8_e4m3fn).reshape(ref.scales.shape), gs.cpu(),
                         torch.float32, scale_layout="swizzled_128x4" if swizzled else "linear")
    assert torch.equal(d, nvfp4.dequantize(*ref, dtype=torch.float32))


def test_fp4_quantize_fast_math_close(seed):
    if _major() < 10:
        pytest.skip("fp4_quantize's kernels are compiled only for SM100+")
    from flashinfer.fp4_quantization import fp4_quantize

    x = torch.randn(512, 4096, dtype=torch.bfloat16, device="cuda")
    gs = (2688.0 / x.float().abs().amax()).reshape(1)
    xq, sf = fp4_quantize(x, gs, 16, False, is_sf_swizzled_layout=False, nvfp4_4over6=None)
    ref = nvfp4.quantize(x.cpu(), gs.cpu(), recipe="fast")
    code_mismatch = (e2m1.unpack_nibbles(xq.cpu()) != e2m1.unpack_nibbles(ref.packed)).float().mean().item()
    sf_mismatch = (_u8(sf).cpu().reshape(512, 256) != _u8(ref.scales)).float().mean().item()
    print(f"fp4_quantize fast-math vs recipe='fast': code mismatch {code_mismatch:.2e}, scale mismatch {sf_mismatch:.2e}")
    assert code_mismatch < 1e-3 and sf_mismatch < 1e-3, f"seed={seed}"


def test_mxfp4_and_mxfp8_quantize_sm100(seed):
    """FlashInfer's UE8M0 paths round the scale up (our scale_rounding="ceil"); its 1/6 and 1/448 are
    rcp.approx, so allow rare last-bit scale differences."""
    if _major() < 10:
        pytest.skip("FlashInfer's MXFP4/MXFP8 quantize kernels are compiled only for SM100+")
    from flashinfer import mxfp8_quantize
    from flashinfer.fp4_quantization import fp4_quantize

    x = torch.randn(256, 2048, dtype=torch.bfloat16, device="cuda") * 3
    xq, sf = fp4_quantize(x, None, 32, True, is_sf_swizzled_layout=False)
    ref = mxfp4.quantize(x.cpu(), scale_rounding="ceil")
    assert (_u8(sf).cpu().reshape(ref.scales.shape) != ref.scales).float().mean().item() < 1e-3, f"seed={seed}"
    assert (xq.cpu() != ref.packed).float().mean().item() < 1e-3, f"seed={seed}"
    q8, sf8 = mxfp8_quantize(x, is_sf_swizzled_layout=False)
    ref8 = mxfp8.quantize(x.cpu(), scale_rounding="ceil")
    assert (_u8(sf8).cpu().reshape(ref8.scales.shape) != ref8.scales).float().mean().item() < 1e-3
    assert (_u8(q8).cpu() != _u8(ref8.data)).float().mean().item() < 1e-3


# ------------------------------------------------------------------ our reference on the GPU
def test_reference_formats_same_bits_on_gpu_and_cpu(seed):
    x = torch.randn(96, 1024) * torch.rand(96, 1).add(0.01) * 8
    xb = x.to(torch.bfloat16)
    for recipe in ("rn", "fast"):
        c, g = nvfp4.quantize(xb, recipe=recipe), nvfp4.quantize(xb.cuda(), recipe=recipe)
        assert torch.equal(c.packed, g.packed.cpu()) and torch.equal(_u8(c.scales), _u8(g.scales).cpu()), f"seed={seed}"
        assert torch.equal(nvfp4.dequantize(*c, dtype=torch.float32), nvfp4.dequantize(*g, dtype=torch.float32).cpu())
    for rounding in ("floor", "ceil"):
        c, g = mxfp4.quantize(x, scale_rounding=rounding), mxfp4.quantize(x.cuda(), scale_rounding=rounding)
        assert torch.equal(c.packed, g.packed.cpu()) and torch.equal(c.scales, g.scales.cpu()), f"seed={seed}"
        c, g = mxfp8.quantize(x, scale_rounding=rounding), mxfp8.quantize(x.cuda(), scale_rounding=rounding)
        assert torch.equal(_u8(c.data), _u8(g.data).cpu()) and torch.equal(c.scales, g.scales.cpu()), f"seed={seed}"
    c, g = fp8_block.quantize_activation(x), fp8_block.quantize_activation(x.cuda())
    assert torch.equal(_u8(c.data), _u8(g.data).cpu()) and torch.equal(c.scales, g.scales.cpu()), f"seed={seed}"


# ------------------------------------------------------------------ A2A workspace size
CASES = [  # (ep_size, max_tokens_per_rank, eplb_stats_num_experts)
    (1, 1, 0), (2, 16, 0), (4, 100, 0), (8, 256, 0), (8, 4096, 0), (16, 33, 64), (64, 8, 256),
]


# (no fp8 case: the FlashInfer dispatcher has no FP8 payload layout and the resolver rejects it)
@pytest.mark.parametrize("mode,dispatch", [("bf16", "bf16"), ("nvfp4_w4a4", "nvfp4"), ("fp8_block", "bf16"),
                                           ("nvfp4_w4a16", "bf16"), ("mxfp4_w4a16", "bf16")])
def test_a2a_workspace_matches_flashinfer(mode, dispatch):
    from flashinfer.comm.trtllm_moe_alltoall import get_moe_alltoall_module, moe_a2a_get_workspace_size_per_rank

    module = get_moe_alltoall_module("trtllm")
    for hidden, top_k, E in ((7168, 8, 256), (3072, 4, 128), (2048, 22, 64)):
        cfg = MoEConfig(num_experts=E, top_k=top_k, hidden_size=hidden, intermediate_size=512)
        plan = resolve_quant_plan(cfg, requested_mode=mode, dispatch_dtype=dispatch, dispatcher="flashinfer",
                                  arch="sm100", flashinfer_version=flashinfer.__version__)
        for ep, max_tokens, eplb in CASES:
            if E % ep:
                continue
            ws = workspace_breakdown(plan, cfg, ep, max_tokens, eplb_stats_num_experts=eplb)
            want = moe_a2a_get_workspace_size_per_rank(ep, max_tokens, ws.dispatch_bytes_per_token,
                                                       ws.combine_bytes_per_token, eplb)
            assert ws.a2a_bytes == want, (mode, hidden, top_k, ep, max_tokens, eplb)
            assert flashinfer_a2a_aux_bytes(ep, max_tokens, eplb) == module.moe_a2a_get_aux_data_size(ep, max_tokens, eplb)
    print(f"a2a workspace ({mode}, dispatch {dispatch}): equals moe_a2a_get_workspace_size_per_rank")


def test_a2a_bf16_convenience_size():
    from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll

    cfg = MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048)
    plan = resolve_quant_plan(cfg, dispatcher="flashinfer", arch="sm90", flashinfer_version=flashinfer.__version__)
    for ep, max_tokens, _ in CASES:
        want = MoeAlltoAll.get_moe_workspace_size_per_rank(ep, 8, max_tokens, 7168)
        assert workspace_breakdown(plan, cfg, ep, max_tokens).a2a_bytes == want
