"""Weight formats of the Hopper backends: k64 fp4 interleave, padded fp8 blocks, quantize /
dequantize of canonical ExpertWeights and their conversion to the kernel layout."""

import os

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.experts.triton import kernel_formats as kf
from tests import experts_testing as T
from epmoe.quant import fp8_block
from epmoe.quant.e2m1 import pack_nibbles, unpack_nibbles


def _seed():
    return int.from_bytes(os.urandom(4), "little")


def test_interleave_roundtrip_and_layout():
    seed = _seed()
    codes = torch.randint(0, 16, (3, 5, 128), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    inter = kf.interleave_fp4_k64(packed)
    assert inter.shape == packed.shape
    assert torch.equal(inter[..., 0] & 0xF, codes[..., 0])
    assert torch.equal(inter[..., 0] >> 4, codes[..., 32]), "byte j of a 64-block: j low, 32 + j high"
    assert torch.equal(inter[..., 33] >> 4, codes[..., 64 + 32 + 1])
    assert torch.equal(kf.deinterleave_fp4_k64(inter), packed)
    assert torch.equal(unpack_nibbles(kf.deinterleave_fp4_k64(inter)), codes)
    with pytest.raises(ValueError, match="64"):
        kf.interleave_fp4_k64(torch.zeros(2, 16, dtype=torch.uint8))


def test_gate_up_interleave():
    g = torch.Generator().manual_seed(_seed())
    w1, w3 = torch.randn(2, 6, 5, generator=g), torch.randn(2, 6, 5, generator=g)
    w13 = kf.interleave_gate_up(w1, w3)
    assert torch.equal(w13[:, 0::2], w1) and torch.equal(w13[:, 1::2], w3), "row 2j gate j, 2j+1 up j"
    assert torch.equal(kf.deinterleave_gate_up(w13), torch.cat([w1, w3], dim=1))
    with pytest.raises(ValueError, match="same shape"):
        kf.interleave_gate_up(w1, w3[:, :4])


def test_fp8_block_matches_quant_module_and_pads():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2, 256, 384, generator=g)
    q, s = kf.quantize_fp8_block(w)
    ref = fp8_block.quantize_weight(w)
    assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(s, ref.scales), seed
    w = torch.randn(1, 200, 136, generator=g)  # partial edge blocks
    q, s = kf.quantize_fp8_block(w)
    assert s.shape == (1, 2, 2)
    err = (kf.dequantize_fp8_block(q, s) - w).norm() / w.norm()
    assert err < 0.04, (seed, float(err))


def test_fp8_tokens_match_quant_module():
    x = torch.randn(7, 256) * torch.logspace(-3, 3, 7)[:, None]
    q, s = kf.quantize_fp8_tokens(x)
    ref = fp8_block.quantize_activation(x)
    assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(s, ref.scales)
    q, s = kf.quantize_fp8_tokens(x[:, :200])
    assert s.shape == (7, 2)
    err = (kf.dequantize_fp8_tokens(q, s) - x[:, :200]).norm(dim=1) / x[:, :200].norm(dim=1)
    assert bool((err < 0.04).all()), err


@pytest.mark.parametrize("mode,bound", [("fp8_block", 0.04), ("nvfp4_w4a16", 0.12), ("mxfp4_w4a16", 0.15)])
@pytest.mark.parametrize("gated", [True, False])
def test_quantize_expert_weights_roundtrip(mode, bound, gated):
    seed = _seed()
    act = dict() if gated else dict(activation="relu2")
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=192, intermediate_size=128, **act)
    w = T.random_expert_weights(cfg, 4, seed=seed, dtype=torch.float32)
    q = kf.quantize_expert_weights(w, mode)
    assert q.format == kf.FORMAT_OF_MODE[mode]
    q.validate(cfg, 4)  # a valid canonical quantized container
    d = kf.dequantize_expert_weights(q)
    assert not d.is_quantized
    for name in ("w1", "w3", "w2"):
        if getattr(w, name) is None:
            continue
        a, b = getattr(d, name), getattr(w, name)
        assert (a - b).norm() / b.norm() < bound, (mode, name, seed)
    kt = kf.kernel_tensors(q, gated, torch.device("cpu"))
    R = 256 if gated else 128
    assert kt["w13"].shape[:2] == (4, R) and kt["w2"].shape[:2] == (4, 192)
    if mode == "nvfp4_w4a16":
        assert kt["w13_global_scale"].shape == (4, 2 if gated else 1) and kt["w2_global_scale"].shape == (4, 1)
    if mode != "fp8_block":
        assert torch.equal(kf.deinterleave_fp4_k64(kt["w2"]), q.w2)
    with pytest.raises(ValueError, match="already quantized"):
        kf.quantize_expert_weights(q, mode)
    with pytest.raises(ValueError, match="bf16"):
        kf.quantize_expert_weights(w, "bf16")


def test_nvfp4_scale_codes_round_trip_every_e4m3_value():
    """`encode_nvfp4_scales` (the triton backend's nvfp4 loads): every finite e4m3 scale >= +0, subnormals
    included, becomes a code whose bits as a float exponent / mantissa give the same value back
    (`decode_nvfp4_scales`, the Triton kernels' `_nv_scale_f32`), in place; a sign bit or NaN is refused."""
    b = torch.arange(0, 0x7F, dtype=torch.uint8)
    want = b.view(torch.float8_e4m3fn).float()
    t = b.clone()
    codes = kf.encode_nvfp4_scales(t)
    assert codes.data_ptr() == t.data_ptr() and codes.dtype == torch.uint8
    assert torch.equal(kf.decode_nvfp4_scales(codes), want)
    assert int(codes[0]) == 0 and int(codes[1:].min()) >= 8 and int(codes.max()) <= 151
    for bad in (0x80 | 0x38, 0x7F, 0xFF):
        with pytest.raises(ValueError, match="normalize_nvfp4_scales"):
            kf.encode_nvfp4_scales(torch.tensor([0x38, bad], dtype=torch.uint8))


def test_fp4_word_layout_is_one_the_search_finds():
    """The shipped bit layout of the fp4 words conversion (`kf.FP4_WORD_SOURCE`: output 0 in place, outputs 1
    and 2 rotated by 22 and 19, output 3 from the bits a multiply by 0x1084 spreads) is one of the layouts
    `scripts/fp4_word_layouts.py` derives from the constraints (rotations that tile, a carry-free multiply)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "scripts", "fp4_word_layouts.py")
    spec = importlib.util.spec_from_file_location("fp4_word_layouts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rest = frozenset(s + 16 * h for s in kf.FP4_WORD_SOURCE[3] for h in (0, 1))
    for j, r in ((1, 22), (2, 19)):  # outputs 1 and 2: the rotation's sources, bit for bit
        assert [(s + 16 * h) % 32 for h in (0, 1) for s in kf.FP4_WORD_SOURCE[j]] == \
            [(p + r) % 32 for p in mod.T], j
    found = {(frozenset((r1, r2)), rest_, sum(1 << a for a in shifts)) for r1, r2, rest_, shifts in mod.layouts()}
    assert (frozenset((22, 19)), rest, 0x1084) in found
