"""Reference quantization formats: bit-exact hand-computed vectors, an independent scalar
re-implementation, round-trip error bounds on random data, the 128x4 swizzle, bad inputs."""

import math
import random

import numpy as np
import pytest
import torch

from epmoe.quant import e2m1, fp8_block, mxfp4, mxfp8, nvfp4

NAN = float("nan")
INF = float("inf")


@pytest.fixture
def seed():
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    return s


def u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


# ------------------------------------------------------------------ e2m1
E2M1_CASES = [
    (0.0, 0), (0.1, 0), (0.25, 0), (0.26, 1), (0.5, 1), (0.75, 2), (0.76, 2), (1.0, 2),
    (1.25, 2), (1.26, 3), (1.5, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.6, 5), (3.0, 5),
    (3.5, 6), (4.0, 6), (5.0, 6), (5.01, 7), (6.0, 7), (7.0, 7), (1e30, 7), (INF, 7),
    (-0.0, 8), (-1e-9, 8), (-0.25, 8), (-0.75, 10), (-5.0, 14), (-6.0, 15), (-INF, 15), (NAN, 0),
]


def test_e2m1_rounding_table():
    vals = torch.tensor([v for v, _ in E2M1_CASES], dtype=torch.float32)
    got = e2m1.float_to_e2m1_codes(vals).tolist()
    assert got == [c for _, c in E2M1_CASES], list(zip([v for v, _ in E2M1_CASES], got))


def test_e2m1_decode_and_pack_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1.e2m1_codes_to_float(codes)
    assert vals[:8].tolist() == list(e2m1.E2M1_VALUES)
    assert vals[8:].tolist() == [-v for v in e2m1.E2M1_VALUES]
    assert math.copysign(1.0, vals[8].item()) == -1.0  # code 8 is -0.0
    packed = e2m1.pack_nibbles(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F]]  # element 0 -> low nibble
    assert e2m1.unpack_nibbles(packed).tolist() == [[1, 2, 15, 0]]
    every = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    assert torch.equal(e2m1.pack_nibbles(e2m1.unpack_nibbles(every)), every)
    with pytest.raises(ValueError, match="odd"):
        e2m1.pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError):
        e2m1.float_to_e2m1_codes(torch.zeros(2, dtype=torch.float64))


# ------------------------------------------------------------------ nvfp4: hand-computed vectors
BLOCK_A = [6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0.1, 4, 3, 2, 1.5, 1, 0.5]
BLOCK_A_PACKED = [0xF7, 0x20, 0x42, 0x64, 0x06, 0x56, 0x34, 0x12]
BLOCK_A_DEQ = [6, -6, 0, 1, 1, 2, 2, 4, 4, 0, 4, 3, 2, 1.5, 1, 0.5]


def _nv(values, gs=1.0):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    q = nvfp4.quantize(x, gs)
    return q, nvfp4.dequantize(*q, dtype=torch.float32)


def test_nvfp4_unit_scale_ties_and_packing():
    q, d = _nv(BLOCK_A)
    assert q.packed.tolist() == [BLOCK_A_PACKED]
    assert u8(q.scales).tolist() == [[0x38]]  # e4m3 1.0
    assert q.global_scale.dtype == torch.float32 and q.global_scale.item() == 1.0
    assert d.tolist() == [BLOCK_A_DEQ]
    packed, scales, gs = q  # NamedTuple unpacks
    assert packed is q.packed and scales.dtype == torch.float8_e4m3fn and gs is q.global_scale


def test_nvfp4_zeros():
    x = torch.zeros(2, 32)
    q = nvfp4.quantize(x)
    assert q.global_scale.item() == 1.0  # all-zero tensor: global scale 1
    assert q.packed.eq(0).all() and u8(q.scales).eq(0).all()
    d = nvfp4.dequantize(*q, dtype=torch.float32)
    assert d.eq(0).all()


def test_nvfp4_subnormal_block_scale():
    # sf = 0.01 / 6 = 0.001667 -> nearest E4M3 is the smallest subnormal 2^-9 (code 0x01);
    # 0.01 * 512 = 5.12 -> e2m1 6 (code 7); dequant 6 * 2^-9.
    q, d = _nv([0.01] + [0.0] * 15)
    assert u8(q.scales).tolist() == [[0x01]]
    assert q.packed.tolist() == [[0x07] + [0] * 7]
    assert d[0, 0].item() == 6 * 2.0**-9 and d[0, 1:].eq(0).all()


def test_nvfp4_scale_tie_rounds_to_even_and_element_saturates():
    # amax 6.375 -> sf = 1.0625 exactly, an E4M3 tie between 1.0 and 1.125 -> 1.0 (even);
    # 6.375 / 1.0 then saturates to 6.
    q, d = _nv([6.375] + [0.0] * 15)
    assert u8(q.scales).tolist() == [[0x38]]
    assert d[0, 0].item() == 6.0


def test_nvfp4_saturation_inf_and_nan_policy():
    # block 0: +-1e6 with global scale 1 -> sf saturates at 448 (0x7E), elements at +-6
    # block 1: inf -> scale 448, inf -> 6, 1.0 / 448 -> 0
    # block 2: NaN poisons its block (scale 0x7F), block 3 is unaffected
    vals = [1e6, -1e6] + [0.0] * 14 + [INF, 1.0] + [0.0] * 14 + [NAN, 1.0] + [0.0] * 14 + BLOCK_A
    q, d = _nv(vals)
    assert u8(q.scales).tolist() == [[0x7E, 0x7E, 0x7F, 0x38]]
    assert d[0, :2].tolist() == [2688.0, -2688.0] and d[0, 2:16].eq(0).all()
    assert d[0, 16].item() == 2688.0 and d[0, 17:32].eq(0).all()
    assert torch.isnan(d[0, 32:48]).all()
    assert d[0, 48:].tolist() == BLOCK_A_DEQ


def test_nvfp4_default_global_scale_convention():
    x = torch.tensor([[2688.0] + [1.0] * 15])
    q = nvfp4.quantize(x)
    assert q.global_scale.item() == 1.0  # 448 * 6 / 2688
    x2 = torch.randn(4, 64) * 3
    gs = nvfp4.quantize(x2).global_scale
    assert gs.dim() == 0 and gs.item() == pytest.approx(2688.0 / x2.abs().max().item(), rel=1e-6)
    # non-finite amax -> 1.0
    assert nvfp4.compute_global_scale(torch.tensor([1.0, INF])).item() == 1.0
    assert nvfp4.compute_global_scale(torch.tensor([1.0, NAN])).item() == 1.0


def test_nvfp4_per_row_global_scale():
    x = torch.tensor([BLOCK_A, [v * 2 for v in BLOCK_A]], dtype=torch.float32)
    q = nvfp4.quantize(x, torch.tensor([1.0, 0.5]))
    assert q.global_scale.shape == (2,)
    # row 1: sf = 12 * 0.5 / 6 = 1.0 -> same codes and scales as row 0
    assert q.packed[0].tolist() == q.packed[1].tolist() == BLOCK_A_PACKED
    d = nvfp4.dequantize(*q, dtype=torch.float32)
    assert d[1].tolist() == [2 * v for v in BLOCK_A_DEQ]


def test_nvfp4_negative_zero_and_bf16_input():
    x = torch.tensor([[-0.0, 0.0] + [1.0] * 14], dtype=torch.bfloat16)
    q = nvfp4.quantize(x, 6.0)  # sf = 1 * 6 / 6 = 1.0
    assert q.packed[0, 0].item() == 0x08  # -0 in the low nibble, +0 in the high nibble
    d = nvfp4.dequantize(*q)
    # sf = 1 * (6 * fl(1/6)) rounds to 1.0; 1.0 * (1 / fl(1/6)) -> e2m1 6; 6 * fl(1/6) -> 1.0 in bf16
    assert d.dtype == torch.bfloat16 and d.float()[0, 2:].eq(1.0).all()
    assert math.copysign(1.0, d[0, 0].item()) == -1.0


# ------------------------------------------------------------------ nvfp4: independent scalar model
def _e4m3_table():
    codes = torch.arange(0, 127, dtype=torch.uint8)  # non-negative finite codes
    return codes.view(torch.float8_e4m3fn).float().numpy().astype(np.float32)


E4M3_POS = _e4m3_table()


def _round_to_table(v, table):
    """Nearest entry of a sorted non-negative table, ties to the even index; saturating."""
    if v >= table[-1]:
        return len(table) - 1
    i = int(np.searchsorted(table, v))
    if table[i] == v:
        return i
    lo, hi = i - 1, i
    dlo, dhi = v - table[lo], table[hi] - v
    if dlo < dhi:
        return lo
    if dhi < dlo:
        return hi
    return lo if lo % 2 == 0 else hi


E2M1_POS = np.array(e2m1.E2M1_VALUES, dtype=np.float32)


def _scalar_nvfp4_rn(row, gs):
    f = np.float32
    one_sixth = f(1.0) / f(6.0)
    codes, sfs = [], []
    for b in range(0, len(row), 16):
        blk = [f(v) for v in row[b : b + 16]]
        amax = max(abs(v) for v in blk)
        sf_f = amax * (f(gs) * one_sixth) if amax != 0 else f(0)
        sf_i = _round_to_table(min(sf_f, f(448)), E4M3_POS)
        sf = E4M3_POS[sf_i]
        with np.errstate(divide="ignore"):  # sf underflowed to 0: 1/0 = inf, clamped to FLT_MAX
            out = min(f(1) / (sf * (f(1) / f(gs))), np.finfo(np.float32).max) if amax != 0 else f(0)
        for v in blk:
            s = f(v) * f(out)
            c = _round_to_table(abs(s), E2M1_POS) | (8 if np.signbit(s) else 0)
            codes.append(c)
        sfs.append(sf_i)
    return codes, sfs


def test_nvfp4_matches_independent_scalar_model(seed):
    x = (torch.randn(6, 64) * torch.logspace(-3, 3, 6).unsqueeze(1)).to(torch.bfloat16)
    gs = nvfp4.compute_global_scale(x)
    q = nvfp4.quantize(x, gs)
    codes = e2m1.unpack_nibbles(q.packed)
    for r in range(x.shape[0]):
        ref_codes, ref_sf = _scalar_nvfp4_rn(x[r].float().tolist(), gs.item())
        assert codes[r].tolist() == ref_codes, f"seed={seed} row={r}"
        assert u8(q.scales[r]).tolist() == ref_sf, f"seed={seed} row={r}"


def test_nvfp4_fast_recipe_close_to_rn(seed):
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    a = nvfp4.quantize(x, recipe="rn")
    b = nvfp4.quantize(x, recipe="fast")
    # association order differs only in the last bit of the unrounded scale, so only scales sitting on
    # an E4M3 rounding boundary differ (worst of 300 seeds: 3.0 % of scales, 1.2 % of packed bytes)
    assert (u8(a.scales) != u8(b.scales)).float().mean().item() < 0.06, f"seed={seed}"
    assert (a.packed != b.packed).float().mean().item() < 0.03, f"seed={seed}"


# ------------------------------------------------------------------ round-trip error bounds
def _blocks_amax(x, block):
    return x.float().reshape(*x.shape[:-1], -1, block).abs().amax(-1, keepdim=True)


def test_nvfp4_roundtrip_bound(seed):
    # Per element: |x - x^| <= s, s = decoded block scale <= amax_blk / 6 / (1 - 2^-4) (E4M3 scale
    # rounding) for normal, unsaturated scales; the e2m1 half-step is <= 1 (x/s in [4, 6]) and
    # saturation overshoot <= 6/(1-2^-4) - 6 < 1. So |x - x^| <= amax_blk * 16/90.
    x = torch.randn(64, 512, dtype=torch.bfloat16) * torch.rand(64, 1).add(0.01).to(torch.bfloat16)
    q = nvfp4.quantize(x)
    d = nvfp4.dequantize(*q, dtype=torch.float32)
    err = (d - x.float()).reshape(64, -1, 16).abs()
    normal = ((u8(q.scales) >> 3) > 0).unsqueeze(-1)  # E4M3 exponent bits non-zero
    bound = _blocks_amax(x, 16) * (16.0 / 90.0) * (1 + 1e-6)
    assert bool(((err <= bound) | ~normal).all()), f"seed={seed}"
    rel = ((d - x.float()).norm() / x.float().norm()).item()
    assert rel < 0.11, f"seed={seed} rel={rel}"


@pytest.mark.parametrize("rounding,bound_frac", [("floor", 0.25), ("ceil", 0.25)])
def test_mxfp4_roundtrip_bound(seed, rounding, bound_frac):
    # floor: amax/s in [4, 8): err <= s <= amax/4 (half-step 1 at [4, 6]; saturation (t-6)s < amax/4)
    # ceil:  amax/s in (3, 6]: err <= s/2 below 4, <= s <= amax/4 at [4, 6]
    x = torch.randn(32, 512) * torch.rand(32, 1).add(0.01)
    q = mxfp4.quantize(x, scale_rounding=rounding)
    d = mxfp4.dequantize(*q, dtype=torch.float32)
    err = (d - x).reshape(32, -1, 32).abs()
    assert bool((err <= _blocks_amax(x, 32) * bound_frac).all()), f"seed={seed}"
    rel = ((d - x).norm() / x.norm()).item()
    assert rel < 0.13, f"seed={seed} rel={rel}"


@pytest.mark.parametrize("rounding,bound_frac", [("floor", 1 / 8), ("ceil", 1 / 16)])
def test_mxfp8_roundtrip_bound(seed, rounding, bound_frac):
    # E4M3 relative half-ulp 2^-4 -> err <= amax/16; floor mode saturates amax/s in (448, 512):
    # err < (512 - 448)/512 amax = amax/8.
    x = torch.randn(32, 512) * torch.rand(32, 1).add(0.01)
    q = mxfp8.quantize(x, scale_rounding=rounding)
    d = mxfp8.dequantize(*q, dtype=torch.float32)
    err = (d - x).reshape(32, -1, 32).abs()
    assert bool((err <= _blocks_amax(x, 32) * bound_frac * (1 + 1e-6)).all()), f"seed={seed}"
    rel = ((d - x).norm() / x.norm()).item()
    assert rel < 0.035, f"seed={seed} rel={rel}"


def test_fp8_block_roundtrip_bound(seed):
    # |x - x^| <= 2^-4 |x| (+ 2^-10 * scale for E4M3 subnormals) with scale = amax / 448
    x = torch.randn(8, 2, 256, 384) * torch.rand(8, 1, 1, 1).add(0.01)
    qa = fp8_block.quantize_activation(x)
    da = fp8_block.dequantize_activation(*qa, dtype=torch.float32)
    sa = qa.scales.repeat_interleave(128, dim=-1)
    assert bool(((da - x).abs() <= x.abs() * 2**-4 * (1 + 1e-5) + sa * 2**-10).all()), f"seed={seed}"
    qw = fp8_block.quantize_weight(x)
    assert qw.scales.shape == (8, 2, 2, 3)
    dw = fp8_block.dequantize_weight(*qw, dtype=torch.float32)
    sw = qw.scales.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    assert bool(((dw - x).abs() <= x.abs() * 2**-4 * (1 + 1e-5) + sw * 2**-10).all()), f"seed={seed}"
    for d in (da, dw):
        assert ((d - x).norm() / x.norm()).item() < 0.03, f"seed={seed}"


# ------------------------------------------------------------------ mxfp4 / mxfp8 / fp8 vectors
def test_mxfp4_vectors():
    def q(vals, rounding="floor"):
        x = torch.tensor(vals + [0.0] * (32 - len(vals)), dtype=torch.float32).reshape(1, 32)
        r = mxfp4.quantize(x, scale_rounding=rounding)
        return r, mxfp4.dequantize(*r, dtype=torch.float32)[0]

    r, d = q(BLOCK_A)  # amax 6: floor(log2 6) - 2 = 0 -> code 127, scale 1
    assert r.scales.tolist() == [[127]] and r.packed[0, :8].tolist() == BLOCK_A_PACKED
    assert d[:16].tolist() == BLOCK_A_DEQ
    r, d = q([7.0])  # floor: scale 1, 7 saturates to 6;  ceil: scale 2, 3.5 -> 4 -> 8
    assert r.scales.tolist() == [[127]] and d[0].item() == 6.0
    r, d = q([7.0], "ceil")
    assert r.scales.tolist() == [[128]] and d[0].item() == 8.0
    r, d = q([6.0], "ceil")  # exact power-of-two boundary: 6/6 = 1 -> scale 1
    assert r.scales.tolist() == [[127]] and d[0].item() == 6.0
    r, d = q([])  # zeros
    assert r.scales.tolist() == [[0]] and d.eq(0).all()
    r, d = q([2.0**-130])  # subnormal input: exponent clamps at -127, 0.125 -> 0
    assert r.scales.tolist() == [[0]] and d[0].item() == 0.0
    r, d = q([1.5 * 2.0**127])  # largest normal binade: code 252, element 6
    assert r.scales.tolist() == [[252]] and d[0].item() == 1.5 * 2.0**127
    r, d = q([INF, 1.0])  # saturates: scale 2^127, element 6; 6 * 2^127 overflows float32 -> inf
    assert r.scales.tolist() == [[254]] and d[0].item() == INF and d[1].item() == 0.0
    r, d = q([NAN, 1.0])
    assert r.scales.tolist() == [[255]] and torch.isnan(d).all()


def test_mxfp8_vectors():
    def q(vals, rounding="floor"):
        x = torch.tensor(vals + [0.0] * (32 - len(vals)), dtype=torch.float32).reshape(1, 32)
        r = mxfp8.quantize(x, scale_rounding=rounding)
        return r, mxfp8.dequantize(*r, dtype=torch.float32)[0]

    # amax 448: floor(log2 448) - 8 = 0 -> scale 1; 1.0625 ties to 1.0, 2^-10 ties to 0, 300 -> 288
    r, d = q([448.0, -448.0, 1.0625, 2.0**-9, 2.0**-10, 300.0])
    assert r.scales.tolist() == [[127]]
    assert d[:6].tolist() == [448.0, -448.0, 1.0, 2.0**-9, 0.0, 288.0]
    r, d = q([500.0])  # floor: scale 1, saturates to 448; ceil: scale 2, 250 -> 256 -> 512
    assert r.scales.tolist() == [[127]] and d[0].item() == 448.0
    r, d = q([500.0], "ceil")
    assert r.scales.tolist() == [[128]] and d[0].item() == 512.0
    r, d = q([])
    assert r.scales.tolist() == [[0]] and d.eq(0).all()
    r, d = q([NAN])
    assert r.scales.tolist() == [[255]] and torch.isnan(d).all()
    r, d = q([-INF, 1.0])
    assert r.scales.tolist() == [[254]] and d[0].item() == -INF  # -448 * 2^127 overflows float32


def test_fp8_block_vectors():
    g = [448.0, -448.0, 1.0625, 2.0**-9, 2.0**-10, 300.0] + [0.0] * 122
    x = torch.tensor([g, [0.0] * 128, [INF, 1.0] + [0.0] * 126, [NAN] + [1.0] * 127])
    q = fp8_block.quantize_activation(x)
    d = fp8_block.dequantize_activation(*q, dtype=torch.float32)
    assert q.scales[0].item() == 1.0 and d[0, :6].tolist() == [448.0, -448.0, 1.0, 2.0**-9, 0.0, 288.0]
    assert q.scales[1].item() == np.float32(1e-10) / np.float32(448) and d[1].eq(0).all()
    assert d[2, 0].item() == 448.0 * q.scales[2].item() and d[2, 1].item() == 0.0
    assert torch.isnan(q.scales[3]) and torch.isnan(d[3]).all()
    w = torch.zeros(256, 128)
    w[:128] = 448.0
    w[128:, 0] = 896.0
    qw = fp8_block.quantize_weight(w)
    assert qw.scales.tolist() == [[1.0], [2.0]]
    assert torch.equal(fp8_block.dequantize_weight(*qw, dtype=torch.float32), w)


def test_e8m0_decode_exact():
    from epmoe.quant._common import e8m0_to_float

    codes = torch.arange(0, 255, dtype=torch.uint8)
    vals = e8m0_to_float(codes)
    assert all(vals[i].item() == 2.0 ** (i - 127) for i in range(255))
    assert torch.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


# ------------------------------------------------------------------ 128x4 swizzled layout
@pytest.mark.parametrize("rows,cols", [(1, 1), (127, 3), (128, 4), (129, 5), (300, 16), (256, 448)])
def test_swizzle_known_positions_and_round_trip(rows, cols):
    s = torch.randint(1, 256, (rows, cols), dtype=torch.uint8)
    sw = nvfp4.swizzle_scales_128x4(s)
    Mp, Cp = nvfp4.swizzled_shape_128x4(rows, cols)
    assert sw.shape == (Mp, Cp)
    flat = sw.reshape(-1)
    rr = list(range(0, rows, max(1, rows // 13))) + [rows - 1]
    for r in rr:
        for c in range(cols):
            assert flat[nvfp4.swizzled_offset_128x4(r, c, cols)].item() == s[r, c].item()
    assert int((flat != 0).sum()) == rows * cols  # padding is zero, every value placed once
    assert torch.equal(nvfp4.unswizzle_scales_128x4(sw, rows, cols), s)
    assert torch.equal(nvfp4.unswizzle_scales_128x4(flat, rows, cols), s)


def test_swizzle_known_offsets_by_hand():
    # C++ comment: tileOffset = ((mi / 128) * numSfTilesK + ki / 4) * 512;
    # dstIdx = tileOffset + (mi % 32) * 16 + ((mi % 128) / 32) * 4 + ki % 4
    assert nvfp4.swizzled_offset_128x4(0, 0, 8) == 0
    assert nvfp4.swizzled_offset_128x4(0, 1, 8) == 1
    assert nvfp4.swizzled_offset_128x4(1, 0, 8) == 16
    assert nvfp4.swizzled_offset_128x4(32, 0, 8) == 4
    assert nvfp4.swizzled_offset_128x4(0, 4, 8) == 512
    assert nvfp4.swizzled_offset_128x4(128, 0, 8) == 1024
    assert nvfp4.swizzled_offset_128x4(130, 6, 5) == 1 * 1024 + 512 + 2 * 16 + 2  # cols padded to 8


def test_swizzle_batched_float8_and_quantize_layout(seed):
    s = torch.randint(0, 120, (3, 130, 6), dtype=torch.uint8).view(torch.float8_e4m3fn)
    sw = nvfp4.swizzle_scales_128x4(s)
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == (3, 256, 8)
    for e in range(3):
        assert torch.equal(u8(sw[e]), u8(nvfp4.swizzle_scales_128x4(s[e])))
    assert torch.equal(u8(nvfp4.unswizzle_scales_128x4(sw, 130, 6)), u8(s))
    x = torch.randn(2, 70, 96, dtype=torch.bfloat16)
    lin = nvfp4.quantize(x)
    swz = nvfp4.quantize(x, scale_layout="swizzled_128x4")
    assert swz.scales.shape == (256, 8)
    assert torch.equal(u8(swz.scales), u8(nvfp4.swizzle_scales_128x4(lin.scales.reshape(140, 6))))
    assert torch.equal(swz.packed, lin.packed)
    assert torch.equal(
        nvfp4.dequantize(*swz, dtype=torch.float32, scale_layout="swizzled_128x4"),
        nvfp4.dequantize(*lin, dtype=torch.float32),
    )


# ------------------------------------------------------------------ bad inputs
def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="17 is not a multiple of the block size 16"):
        nvfp4.quantize(torch.randn(2, 17))
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        mxfp4.quantize(torch.randn(2, 48))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mxfp8.quantize(torch.randn(2, 16))
    with pytest.raises(ValueError, match="multiple of the block size 128"):
        fp8_block.quantize_activation(torch.randn(2, 64))
    with pytest.raises(ValueError, match="N=64 are not a multiple"):
        fp8_block.quantize_weight(torch.randn(64, 128))
    for fn in (nvfp4.quantize, mxfp4.quantize, mxfp8.quantize, fp8_block.quantize_activation):
        with pytest.raises(TypeError, match="dtype torch.int32"):
            fn(torch.ones(2, 128, dtype=torch.int32))
        with pytest.raises(TypeError, match="float8_e4m3fn"):
            fn(torch.ones(2, 128).to(torch.float8_e4m3fn))
        with pytest.raises(ValueError, match="scalar"):
            fn(torch.tensor(1.0))
    with pytest.raises(ValueError, match="global_scale has shape"):
        nvfp4.quantize(torch.randn(4, 16), torch.ones(3))
    with pytest.raises(TypeError, match="global_scale"):
        nvfp4.quantize(torch.randn(4, 16), "1.0")
    with pytest.raises(ValueError, match="recipe"):
        nvfp4.quantize(torch.randn(4, 16), recipe="exact")
    with pytest.raises(ValueError, match="scale_layout"):
        nvfp4.quantize(torch.randn(4, 16), scale_layout="8x4")
    with pytest.raises(ValueError, match="scale_rounding"):
        mxfp4.quantize(torch.randn(4, 32), scale_rounding="nearest")
    q = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"scales have shape \[4, 1\]; expected \[4, 2\]"):
        nvfp4.dequantize(q.packed, q.scales[:, :1], q.global_scale)
    with pytest.raises(TypeError, match="must be uint8"):
        nvfp4.dequantize(q.packed.to(torch.int32), q.scales, q.global_scale)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        nvfp4.dequantize(q.packed, q.scales.float(), q.global_scale)
    with pytest.raises(TypeError, match="not a float dtype"):
        nvfp4.dequantize(*q, dtype=torch.int8)
    with pytest.raises(ValueError, match="swizzled scales have shape"):
        nvfp4.unswizzle_scales_128x4(torch.zeros(100, 4, dtype=torch.uint8), 100, 4)
    m = mxfp4.quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="expected"):
        mxfp4.dequantize(m.packed, m.scales[:, :1])
    with pytest.raises(TypeError, match="uint8"):
        mxfp4.dequantize(m.packed, m.scales.float())
    w = fp8_block.quantize_weight(torch.randn(128, 256))
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        fp8_block.dequantize_weight(w.data, w.scales.t())
    with pytest.raises(TypeError, match="float32"):
        fp8_block.dequantize_weight(w.data, w.scales.double())
