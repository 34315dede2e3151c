"""Quantized weight formats of the Hopper backends (plain torch)."""

import os

import pytest
import torch

from epmoe.experts import kernel_formats as kf


def _seed():
    return int.from_bytes(os.urandom(4), "little")


def test_e2m1_grid_roundtrip_and_ties():
    vals = torch.tensor(kf.E2M1_VALUES + tuple(-v for v in kf.E2M1_VALUES[1:]))
    assert torch.equal(kf.e2m1_decode(kf.e2m1_encode(vals)), vals)
    # ties go to the even code (mantissa bit 0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0])
    assert torch.equal(kf.e2m1_decode(kf.e2m1_encode(ties)), want)
    assert torch.equal(kf.e2m1_decode(kf.e2m1_encode(torch.tensor([7.0, 100.0, -9.0]))), torch.tensor([6.0, 6.0, -6.0]))


def test_e2m1_nearest():
    seed = _seed()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(seed)) * 3
    q = kf.e2m1_decode(kf.e2m1_encode(x))
    grid = torch.tensor(kf.E2M1_VALUES)
    best = (x.abs()[:, None] - grid[None, :]).abs().min(dim=1).values
    inside = x.abs() <= 6
    assert bool(((q.abs() - x.abs()).abs()[inside] <= best[inside] + 1e-6).all()), seed
    assert bool((q.abs()[~inside] == 6).all()), seed
    assert bool((torch.sign(q) * torch.sign(x) >= 0).all()), seed


def test_pack_and_interleave_roundtrip():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (3, 5, 128), generator=g, dtype=torch.uint8)
    packed = kf.pack_e2m1(codes)
    assert packed.shape == (3, 5, 64)
    assert torch.equal(packed[..., 0] & 0xF, codes[..., 0]), "element 0 in the low nibble"
    assert torch.equal(kf.unpack_e2m1(packed), codes)
    inter = kf.interleave_fp4_k64(packed)
    assert torch.equal(inter[..., 0] & 0xF, codes[..., 0])
    assert torch.equal(inter[..., 0] >> 4, codes[..., 32]), "byte j of a 64-block: j low, 32 + j high"
    assert torch.equal(inter[..., 33] >> 4, codes[..., 64 + 32 + 1])
    assert torch.equal(kf.deinterleave_fp4_k64(inter), packed)
    with pytest.raises(ValueError, match="64"):
        kf.interleave_fp4_k64(torch.zeros(2, 16, dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(2, 256, 384), (1, 200, 136)])
def test_fp8_block_roundtrip(shape):
    seed = _seed()
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    q, s = kf.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    err = (kf.dequantize_fp8_block(q, s) - w).norm() / w.norm()
    assert err < 0.04, (seed, float(err))  # e4m3: 3 mantissa bits


def test_fp8_gated_scales_do_not_mix_halves():
    w1 = torch.randn(2, 72, 256)
    w3 = torch.randn(2, 72, 256) * 100  # very different range
    q, s = kf.quantize_fp8_gated_w13(w1, w3)
    assert s.shape == (2, 2, 2)  # one 128-row block per half
    deq = kf.dequantize_fp8_gated_w13(q, s, gated=True)
    assert (deq[:, :72] - w1).norm() / w1.norm() < 0.04
    assert (deq[:, 72:] - w3).norm() / w3.norm() < 0.04


def test_fp8_tokens_roundtrip():
    x = torch.randn(7, 300) * torch.logspace(-3, 3, 7)[:, None]
    q, s = kf.quantize_fp8_tokens(x)
    assert s.shape == (7, 3)
    err = (kf.dequantize_fp8_tokens(q, s) - x).norm(dim=1) / x.norm(dim=1)
    assert bool((err < 0.04).all()), err


def test_nvfp4_and_mxfp4_roundtrip():
    seed = _seed()
    w = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(seed))
    p, sf, gs = kf.quantize_nvfp4(w)
    assert p.shape == (2, 64, 64) and sf.shape == (2, 64, 8) and sf.dtype == torch.float8_e4m3fn and gs.shape == (2,)
    err = (kf.dequantize_nvfp4(p, sf, gs) - w).norm() / w.norm()
    assert err < 0.12, (seed, float(err))
    p, sf = kf.quantize_mxfp4(w)
    assert p.shape == (2, 64, 64) and sf.shape == (2, 64, 4) and sf.dtype == torch.uint8
    err = (kf.dequantize_mxfp4(p, sf) - w).norm() / w.norm()
    assert err < 0.15, (seed, float(err))


def test_quantize_expert_weights_containers():
    from epmoe.quant.weights import ExpertWeights

    w = ExpertWeights(w1=torch.randn(2, 64, 128), w3=torch.randn(2, 64, 128), w2=torch.randn(2, 128, 64))
    for mode in ("fp8_block", "nvfp4_w4a16", "mxfp4_w4a16"):
        q = kf.quantize_expert_weights(w, mode)
        assert q.num_experts == 2
        d13 = q.w13.dequantize(gated_w13=True)
        assert d13.shape == (2, 128, 128)
        assert (d13 - w.w13()).norm() / w.w13().norm() < 0.15, mode
    with pytest.raises(ValueError, match="bf16"):
        kf.quantize_expert_weights(w, "bf16")
