"""FlashInfer's CUTLASS fused MoE (`flashinfer_cutlass` experts) on a GPU, every SM90 mode:

  * the tactics the loaded module offers per mode, and a tactic it lacks refused with the valid ids;
  * the experts alone against the reference experts (weights quantized here with small torch
    quantizers, the reference gets them dequantized: isolates kernel + layout conversion);
  * through `EPMoE` on one rank (torch and FlashInfer dispatchers), uneven batches including 0 and
    batches above the round size, against the float64 reference that models the plan;
  * 4 ranks sharing the GPU (gloo group, `shared_gpu=True`), both dispatchers, every mode.

Runs only where FlashInfer's CUTLASS fused-MoE module is prebuilt (AOT or JIT cache): building it
JIT takes about 45 minutes on 16 cores, so a missing module is a skip (with the reason), never a
build. A call into a launcher the module lacks ends the process ("symbol lookup error"): run one
mode per process (`-k`) when trying a new FlashInfer build (scripts/gpu_checks.sh cutlass does).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.requires_flashinfer,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
]

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _fused_moe_ready():
    from epmoe.experts.flashinfer_cutlass import _device_arch, fused_moe_module_name, prebuilt_module_status

    arch = _device_arch(torch.device("cuda", torch.cuda.current_device()))
    name = fused_moe_module_name(arch)
    status = prebuilt_module_status(name)
    if status is None:
        pytest.skip(f"FlashInfer module {name!r} is not prebuilt (JIT build > 40 min); nothing to test")
    return arch


def mxfp4_quantize(w):
    """[..., K] float -> (packed uint8 [..., K/2], e8m0 uint8 [..., K/32]) with round-up scales."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6.0)), torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    scaled = blocks / torch.exp2(exp).unsqueeze(-1)
    mag = torch.bucketize(scaled.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=w.device))
    code = (mag | ((scaled < 0).long() << 3)).reshape(*w.shape)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def mxfp4_dequantize(packed, scale):
    lut = E2M1.to(packed.device)
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)
    vals = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    s = torch.exp2(scale.float() - 127.0).repeat_interleave(32, -1)
    return vals * s


def fp8_block_quantize(w):
    """[E, N, K] -> (e4m3 [E, N, K], float32 [E, N/128, K/128])."""
    E, N, K = w.shape
    b = w.float().reshape(E, N // 128, 128, K // 128, 128)
    scale = b.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
    q = (b / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(E, N, K)
    return q, scale


def fp8_block_dequantize(q, scale):
    E, N, K = q.shape
    return (q.float().reshape(E, N // 128, 128, K // 128, 128) * scale[:, :, None, :, None]).reshape(E, N, K)


def _case(mode, *, gpt_oss=False, seed=0):
    from epmoe.config import MoEConfig
    from epmoe.quant.weights import ExpertWeights

    E, K, H, I, T = 8, 2, 256, 256, 64
    extra = dict(has_bias=True, swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0) if gpt_oss else {}
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, **extra)
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, H, generator=g) / H**0.5 for _ in range(2))
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    bias = dict(b13=0.1 * torch.randn(E, 2 * I, generator=g), b2=0.1 * torch.randn(E, H, generator=g)) if gpt_oss else {}
    if mode in ("mxfp4_w4a16", "mxfp4_w4a8"):
        q = {n: mxfp4_quantize(t) for n, t in (("w1", w1), ("w3", w3), ("w2", w2))}
        quant = ExpertWeights(format="mxfp4", **{n: v[0] for n, v in q.items()},
                              **{n + "_scale": v[1] for n, v in q.items()}, **bias)
        deq = {n: mxfp4_dequantize(*v) for n, v in q.items()}
    elif mode == "fp8_block":
        q = {n: fp8_block_quantize(t) for n, t in (("w1", w1), ("w3", w3), ("w2", w2))}
        quant = ExpertWeights(format="fp8_block", **{n: v[0] for n, v in q.items()},
                              **{n + "_scale": v[1] for n, v in q.items()}, **bias)
        deq = {n: fp8_block_dequantize(*v) for n, v in q.items()}
    else:
        deq = dict(w1=w1, w3=w3, w2=w2)
        quant = ExpertWeights(**deq, **bias)
    ref_w = ExpertWeights(**deq, **bias)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K].to(torch.int32)
    ids[torch.rand(T, K, generator=g) < 0.1] = -1
    w = torch.rand(T, K, generator=g)
    return cfg, quant, ref_w, x, ids.to(dev), w.to(dev)


@pytest.mark.parametrize(
    "mode,gpt_oss,tol",
    [("bf16", False, 0.02), ("bf16", True, 0.02), ("fp8_block", False, 0.06), ("mxfp4_w4a16", False, 0.02),
     ("mxfp4_w4a16", True, 0.02), ("mxfp4_w4a8", False, 0.08)],
)
def test_cutlass_mode_matches_reference(mode, gpt_oss, tol):
    arch = _fused_moe_ready()
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.flashinfer_cutlass import FlashInferCutlassExperts
    from epmoe.experts.reference import ReferenceExperts

    seed = 123
    cfg, quant, ref_w, x, ids, w = _case(mode, gpt_oss=gpt_oss, seed=seed)
    dev = x.device
    spec = ExpertsSpec(config=cfg, ep_rank=0, ep_size=1, device=dev, max_tokens=x.shape[0], options=(("mode", mode),))
    avail = FlashInferCutlassExperts.availability(spec)
    if not avail:
        pytest.skip(avail.describe())
    ex = FlashInferCutlassExperts(spec)
    ex.load_weights(quant)
    ref = ReferenceExperts(ExpertsSpec(config=cfg, ep_rank=0, ep_size=1, device=dev))
    ref.load_weights(ref_w)
    tokens = DispatchedTokens(x, ids, w)
    out = ex(tokens).float()
    want = ref(tokens).float()
    err = (out - want).norm() / want.norm().clamp_min(1e-6)
    print(f"[flashinfer-cutlass] SM{arch} {mode}{' gpt-oss' if gpt_oss else ''}: rel err {err:.4f} (tol {tol})")
    assert torch.isfinite(out).all()
    assert err < tol, f"seed={seed}: {mode} relative error {err:.4f} >= {tol}"
    # reload in place keeps storage (captured CUDA graphs stay valid) and the numbers
    ptrs = {k: v.data_ptr() for k, v in ex.parameters().items()}
    ex.load_weights(quant)
    assert {k: v.data_ptr() for k, v in ex.parameters().items()} == ptrs
    again = ex(tokens).float()  # fused finalize adds with atomics: equal up to summation order
    assert (again - out).norm() / out.norm().clamp_min(1e-6) < 1e-2


SM90_MODES = ["bf16", "fp8_block", "mxfp4_w4a16", "mxfp4_w4a8"]
# the float64 reference models the plan's activation rounding; the kernels round partial sums in
# their own order (and Humming quantizes activations per token rather than per 1x128 group)
LAYER_TOL = {"bf16": 2e-2, "fp8_block": 6e-2, "mxfp4_w4a16": 3e-2, "mxfp4_w4a8": 8e-2}


@pytest.mark.parametrize("mode", SM90_MODES)
def test_tactics_offered_by_the_module(mode):
    arch = _fused_moe_ready()
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.flashinfer_cutlass import FlashInferCutlassExperts
    from epmoe.config import MoEConfig

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, dtype=torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    spec = ExpertsSpec(config=cfg, ep_rank=0, ep_size=1, device=dev, max_tokens=64, options=(("mode", mode),))
    ex = FlashInferCutlassExperts(spec)
    t = ex.tactics
    print(f"[flashinfer-cutlass] SM{arch} {mode}: {len(t.gemm1)} GEMM1 + {len(t.gemm2)} GEMM2 tactics ({t.describe()})")
    assert t.gemm1 and t.gemm2
    bad = (t.gemm1[0], t.gemm2[-1] + 1)
    with pytest.raises(ValueError, match="is not offered"):
        FlashInferCutlassExperts(ExpertsSpec(config=cfg, ep_rank=0, ep_size=1, device=dev, max_tokens=64,
                                             options=(("mode", mode), ("tactics", bad))))


def _layer_case(mode, dispatcher, dev, world=1, shared_gpu=False):
    from epmoe import EPMoE, MoEConfig

    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=256, dtype=torch.bfloat16)
    opts = {"one_rank_local": False} if dispatcher == "flashinfer" and world == 1 else None
    layer = EPMoE(cfg, dispatcher=dispatcher, device=dev, experts="flashinfer_cutlass", quant=mode,
                  max_num_tokens_per_rank=32, dispatcher_options=opts, shared_gpu=shared_gpu)
    assert layer.plan.experts_backend == "flashinfer_cutlass", layer.plan.describe()
    return cfg, layer


def _check_counts(cfg, layer, mode, weights, counts, rank, seed, dev):
    """One step with per-rank token counts `counts` against reference_moe(plan=layer.plan)."""
    from epmoe import reference_moe
    from tests.cpu.helpers import max_rel_err, random_inputs

    x, logits = random_inputs(cfg, counts[rank], seed + 101 * rank)
    out = layer(x.to(dev), logits.to(dev), return_stats=True)
    y = out.hidden_states
    assert y.shape == (counts[rank], cfg.hidden_size) and torch.isfinite(y).all()
    assert out.stats.rounds == -(-max(counts) // 32) or max(counts) == 0
    if counts[rank] == 0:
        return 0.0
    err = max_rel_err(y, reference_moe(cfg, x, weights, logits, plan=layer.plan))
    assert err < LAYER_TOL[mode], f"{mode} T={counts}: max rel err {err:.3g} >= {LAYER_TOL[mode]}"
    return err


@pytest.mark.parametrize("dispatcher", ["torch", "flashinfer"])
@pytest.mark.parametrize("mode", SM90_MODES)
def test_layer_one_rank_matches_plan_reference(mode, dispatcher):
    _fused_moe_ready()
    from tests.cpu.helpers import random_weights

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, layer = _layer_case(mode, dispatcher, dev)
    w = random_weights(cfg, 31)
    layer.load_weights(w)
    errs = [_check_counts(cfg, layer, mode, w, [T], 0, 40 + T, dev) for T in (0, 1, 20, 32, 70)]
    print(f"[flashinfer-cutlass] ep=1 {dispatcher} {mode}: T in (0, 1, 20, 32, 70 = 3 rounds) "
          f"max rel err {max(errs):.3g} (tol {LAYER_TOL[mode]}) plan: {layer.plan.describe()}")
    layer.close()


def _shared_worker(rank, world, seed, dispatcher):
    import torch.distributed as dist

    from tests.cpu.helpers import random_weights
    from tests.cpu.mp import run_checks

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)

    def one_mode(mode):
        def check():
            cfg, layer = _layer_case(mode, dispatcher, dev, world=world, shared_gpu=True)
            w = random_weights(cfg, seed)
            layer.load_weights(w)
            errs = [_check_counts(cfg, layer, mode, w, counts, rank, seed + i, dev)
                    for i, counts in enumerate(([70, 0, 33, 5], [0, 0, 0, 0], [32, 32, 32, 32], [1, 0, 0, 9]))]
            layer.close()
            return f"T=[70,0,33,5] (3 rounds), all 0, all 32, [1,0,0,9]: max rel err {max(errs):.2e}"

        return check

    results = run_checks(f"shared-gpu ep={world} cutlass {dispatcher}", [(m, one_mode(m)) for m in SM90_MODES])
    dist.barrier()
    return results


@pytest.mark.parametrize("dispatcher", ["torch", "flashinfer"])
def test_four_ranks_sharing_the_gpu(dispatcher):
    _fused_moe_ready()
    from tests.cpu.helpers import fresh_seed
    from tests.cpu.mp import assert_checks, run_group

    seed = fresh_seed()
    res = run_group(_shared_worker, 4, seed, dispatcher, timeout=240, pg_timeout=120)
    assert_checks(res, SM90_MODES, seed)
