"""The packed fp4 -> bf16 conversion of the W4A16 GEMM loops (`_fp4_dequant_packed`) under the Triton
interpreter: bit for bit the legacy conversion (`_fp4_dequant`) on every byte value with every finite
e4m3 scale (nvfp4, where the packed weights carry 2^-7 that the global scale takes back) and e8m0
exponents 0..128 (mxfp4); and the nvfp4 / mxfp4 experts forward (biases, clamped swiglu, invalid
slots) gives the same output bits with either conversion. The interpreter is patched to do bf16
arithmetic like the GPU (`tests/triton_interpret.py`: RNE, subnormals kept)."""

import importlib.util
import math
import os

import pytest

from tests.cpu.interpret import case_result, run_interpret_worker

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CASES = ["convert:mxfp4", "convert:nvfp4", "forward:mxfp4_w4a16", "forward:nvfp4_w4a16"]
TILE_CASES = ["tiles:nvfp4_w4a16", "tiles:mxfp4_w4a16"]
PAIR_CASES = ["pairs:nvfp4_w4a16", "pairs:mxfp4_w4a16"]
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fp4_convert_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES + TILE_CASES + PAIR_CASES)


@pytest.mark.parametrize("case", CASES)
def test_packed_fp4_conversion_is_bit_exact(results, case):
    r = case_result(results, case)
    if case.startswith("convert"):
        assert r["nonzero"] > 1000, r
        assert r["mismatch"] == 0, f"{case} (seed {r['seed']}): {r}"
    else:
        assert r["equal"], f"{case} (seed {r['seed']}): packed vs legacy output differ by {r['max_diff']}"


@pytest.mark.parametrize("case", TILE_CASES)
def test_fp4_row_tiles_give_the_same_output_on_the_triton_kernels(results, case):
    """Option triton_fp4_layout=tiles: the weights are `tile_fp4_rows` of the rows layout, and the
    Triton kernels (their TILED address arithmetic, run by the interpreter) give the rows layout's
    output bit for bit: a forced small preset and the auto presets at decode and prefill sizes."""
    r = case_result(results, case)
    assert r["tiled"] and r["layout_ok"], r
    for name in ("tiny", "decode", "prefill"):
        assert r[f"{name}_equal"], f"{case} (seed {r['seed']}) {name} ({r[f'{name}_preset']}): differ by {r[f'{name}_max_diff']}"


@pytest.mark.parametrize("case", PAIR_CASES)
def test_fp4_scale_pairs_give_the_row_major_output_on_the_triton_kernels(results, case):
    """The scales in K-step pairs (`kernel_formats.pair_fp4_scales`: the backend's layout) and the same
    scales row-major, told apart only by their strides: the Triton kernels (their pair-stride address
    arithmetic, run by the interpreter) give the same output bits, with an odd K-step count (H = 192)."""
    r = case_result(results, case)
    pair = 8 if case.startswith("pairs:nvfp4") else 4
    # w13: 2I = 128 rows, H = 192 -> 2 pairs; a pair of all rows contiguous, then the row-major view
    assert r["strides"]["w13_scale"] == [[2 * 128 * pair, pair, 128 * pair, 1], [128 * 2 * pair, 2 * pair, pair, 1]], r
    assert r["strides"]["w2_scale"] == [[192 * pair, pair, 192 * pair, 1], [192 * pair, pair, pair, 1]], r
    for name in ("tiny", "decode", "prefill"):
        assert r[f"{name}_nonzero"] > 0, r
        assert r[f"{name}_equal"], f"{case} (seed {r['seed']}) {name} ({r[f'{name}_preset']}): differ by {r[f'{name}_max_diff']}"


def _run_ptx(asm: str, word: int, extra: dict = None) -> dict:
    """A model of the few PTX b32 instructions the conversions use (prmt default mode, shr, shl,
    and, or, shf.r.wrap, mul.lo.u32, mad.lo.u32, mov to 16-bit halves), run on one input word ($4) or,
    with `extra`, on those registers. Checks the text of the asm (operands, constants, selectors);
    whether the GPU executes it so is checked on the device
    (tests/gpu/test_hopper_experts.py::test_fp4_packed_conversion_equals_legacy)."""
    import re

    regs = {"$4": word, **(extra or {})}
    M = 0xFFFFFFFF

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) if re.match(r"^(0x[0-9a-fA-F]+|\d+)$", tok) else regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        if line.startswith("mov.b32 {"):  # mov.b32 {lo, hi}, src: the two 16-bit halves
            lo, hi, src = (a.strip(" {}") for a in line[len("mov.b32 "):].split(","))
            regs[lo], regs[hi] = val(src) & 0xFFFF, (val(src) >> 16) & 0xFFFF
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        v = [val(a) for a in src]
        if op == "prmt.b32":
            pool = (v[0] & M) | ((v[1] & M) << 32)
            regs[d] = sum(((pool >> (8 * ((v[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "shr.b32":
            regs[d] = (v[0] & M) >> v[1]
        elif op == "shl.b32":
            regs[d] = (v[0] << v[1]) & M
        elif op == "and.b32":
            regs[d] = v[0] & v[1]
        elif op == "or.b32":
            regs[d] = v[0] | v[1]
        elif op == "shf.r.wrap.b32":  # funnel shift right of (v[1]:v[0]) by v[2] mod 32: a rotation when v[0] == v[1]
            n = v[2] & 31
            regs[d] = ((((v[1] & M) << 32) | (v[0] & M)) >> n) & M
        elif op == "mul.lo.u32":
            regs[d] = (v[0] * v[1]) & M
        elif op == "mad.lo.u32":
            regs[d] = (v[0] * v[1] + v[2]) & M
        else:
            raise AssertionError(f"model has no {op}")
    return regs


def test_asm_conversion_text_builds_the_packed_bits():
    """The inline-PTX conversion (default on the GPU) builds, for every byte in every one of the 4 lanes
    of its input word, the bf16 words `_fp4_dequant_packed` builds with Triton integer ops:
    low nibble -> outputs $0 / $1, high nibble -> $2 / $3 (PTX model, see `_run_ptx`)."""
    import random

    from epmoe.experts.triton.triton_kernels import _E2M1_BF16_ASM

    asm = _E2M1_BF16_ASM.value if hasattr(_E2M1_BF16_ASM, "value") else _E2M1_BF16_ASM

    def packed(b):  # the Triton-ops formula of _fp4_dequant_packed: (low nibble, high nibble) bf16 bits
        w = ((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & 0x80008000)
        return w & 0xFFFF, w >> 16

    rng = random.Random(0)
    words = [b * 0x01010101 for b in range(256)] + [rng.getrandbits(32) for _ in range(2000)]
    for word in words:
        r = _run_ptx(asm, word)
        b = [(word >> (8 * i)) & 0xFF for i in range(4)]
        lo = [packed(x)[0] for x in b]
        hi = [packed(x)[1] for x in b]
        assert r["$0"] == lo[0] | (lo[1] << 16) and r["$1"] == lo[2] | (lo[3] << 16), hex(word)
        assert r["$2"] == hi[0] | (hi[1] << 16) and r["$3"] == hi[2] | (hi[3] << 16), hex(word)


def test_words_conversion_text_builds_the_same_words_from_permuted_bits():
    """Convert mode "words": its PTX (`_E2M1_BF16_WORDS_ASM`: masks, rotations, one multiply) on a word permuted by
    `kernel_formats.permute_fp4_words` gives the 4 output words `_E2M1_BF16_ASM` gives on the original
    word (PTX model, see `_run_ptx`; on the device: tests/gpu/test_hopper_experts.py), for every byte
    value in every lane and random words; the permutation is a bijection of the 32 bits and
    `unpermute_fp4_words` inverts it."""
    import random

    import torch

    from epmoe.experts.triton import kernel_formats as kf
    from epmoe.experts.triton.triton_kernels import _E2M1_BF16_ASM, _E2M1_BF16_WORDS_ASM

    def text(a):
        return a.value if hasattr(a, "value") else a

    moves = kf._fp4_word_moves()
    assert sorted(dst for _, dst in moves) == list(range(32)) and sorted(src for src, _ in moves) == list(range(32))
    rng = random.Random(1)
    words = [b << (8 * lane) for b in range(256) for lane in range(4)] + [rng.getrandbits(32) for _ in range(3000)]
    raw = torch.tensor([[(w >> (8 * i)) & 0xFF for i in range(4)] for w in words], dtype=torch.uint8)
    perm = kf.permute_fp4_words(raw)
    assert torch.equal(kf.unpermute_fp4_words(perm), raw)
    for word, p in zip(words, perm.tolist()):
        pw = p[0] | (p[1] << 8) | (p[2] << 16) | (p[3] << 24)
        want = _run_ptx(text(_E2M1_BF16_ASM), word)
        got = _run_ptx(text(_E2M1_BF16_WORDS_ASM), pw)
        assert [got[f"${j}"] for j in range(4)] == [want[f"${j}"] for j in range(4)], hex(word)


def test_permute_fp4_words_in_place_equals_the_copy():
    """inplace=True (the backend's load path) permutes the caller's tensor chunk by chunk to the same
    bytes as the copying call, chunks not dividing the words included; a non-contiguous tensor is
    refused."""
    import torch

    from epmoe.experts.triton import kernel_formats as kf

    x = torch.randint(0, 256, (3, 7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    want = kf.permute_fp4_words(x)
    y = x.clone()
    got = kf.permute_fp4_words(y, chunk_words=5, inplace=True)
    assert got.data_ptr() == y.data_ptr() and torch.equal(got, want) and torch.equal(y, want)
    assert torch.equal(kf.unpermute_fp4_words(y), x)
    with pytest.raises(ValueError, match="contiguous"):
        kf.permute_fp4_words(x.transpose(0, 1), inplace=True)


def test_permute_fp4_words_rejects_rows_of_partial_words():
    import torch

    from epmoe.experts.triton import kernel_formats as kf

    with pytest.raises(ValueError, match="K/2 % 4 == 0"):
        kf.permute_fp4_words(torch.zeros(2, 6, dtype=torch.uint8))


def test_tile_fp4_rows_places_each_byte_where_the_tiled_decode_kernel_reads_it():
    """`tile_fp4_rows` (option triton_fp4_layout=tiles): byte b of K step s of row r at
    (r // 8) * 8 * K/2 + s * 256 + (r % 8) * 32 + b of its expert (the kernels' address arithmetic),
    the up rows of w13 a whole number of tiles on (I % 8 == 0); in place equals the copy; untile is the
    inverse; shapes that do not tile and in-place calls on non-contiguous tensors are refused."""
    import torch

    from epmoe.experts.triton import kernel_formats as kf

    E, R, KB = 3, 48, 96  # K = 192: three 64-element steps of 32 bytes
    w = torch.randint(0, 256, (E, R, KB), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    t = kf.tile_fp4_rows(w)
    assert t.shape == w.shape and torch.equal(kf.untile_fp4_rows(t), w)
    y = w.clone()  # in place (the backend's load path), expert by expert: the same bytes, the caller's storage
    got = kf.tile_fp4_rows(y, inplace=True)
    assert got.data_ptr() == y.data_ptr() and torch.equal(y, t)
    with pytest.raises(ValueError, match="contiguous"):
        kf.tile_fp4_rows(w.clone().transpose(1, 2).contiguous().transpose(1, 2), inplace=True)
    flat = t.reshape(E, -1)
    r, s, b = torch.meshgrid(torch.arange(R), torch.arange(KB // 32), torch.arange(32), indexing="ij")
    addr = (r // 8) * 8 * KB + s * 256 + (r % 8) * 32 + b
    for e in range(E):
        assert torch.equal(flat[e][addr], w[e][r, s * 32 + b])
    half = R // 2  # gate rows, then up rows: row half + j is j's address + half * K/2
    assert torch.equal(addr[half:], addr[:half] + half * KB)
    for shape in ((1, 12, 64), (1, 16, 48)):
        with pytest.raises(ValueError, match="rows % 8 == 0 and K/2 % 32 == 0"):
            kf.tile_fp4_rows(torch.zeros(shape, dtype=torch.uint8))


@pytest.mark.parametrize("group,K", [(16, 192), (32, 192), (16, 256), (32, 64)])
def test_pair_fp4_scales_places_each_scale_where_the_kernels_read_it(group, K):
    """`pair_fp4_scales`: scale byte j of K step s of row r at (s // 2) * R * pair + r * pair + (s % 2) *
    (pair / 2) + j of its expert's storage (pair = 128 / group bytes; the kernels' address arithmetic with
    stride_wsn = pair, stride_wsp = R * pair), an odd step count's last half zero; the view's strides say
    so; `unpair_fp4_scales` is the inverse; bad dtypes, groups and partial K steps are refused."""
    import torch

    from epmoe.experts.triton import kernel_formats as kf

    E, R = 3, 40
    G = K // group
    s = torch.randint(1, 256, (E, R, G), dtype=torch.uint8, generator=torch.Generator().manual_seed(group + K))
    p = kf.pair_fp4_scales(s, group)
    per_step, steps = 64 // group, K // 64
    pairs, pair = -(-steps // 2), 2 * per_step
    assert p.shape == (E, R, pairs, pair) and p.stride() == (pairs * R * pair, pair, R * pair, 1)
    assert torch.equal(kf.unpair_fp4_scales(p, group, K), s)
    storage = p.permute(0, 2, 1, 3).contiguous().reshape(E, -1)  # (the storage's own order)
    assert torch.equal(storage, p.as_strided((E, pairs * R * pair), (pairs * R * pair, 1)))
    r, st, j = torch.meshgrid(torch.arange(R), torch.arange(steps), torch.arange(per_step), indexing="ij")
    addr = (st // 2) * R * pair + r * pair + (st % 2) * per_step + j
    for e in range(E):
        assert torch.equal(storage[e][addr], s[e][r, st * per_step + j])
    if steps % 2:
        assert not bool(p[:, :, -1, per_step:].any()), "an odd step count's last half is zero"
    with pytest.raises(ValueError, match="uint8"):
        kf.pair_fp4_scales(s.float(), group)
    with pytest.raises(ValueError, match="16 .nvfp4. or 32"):
        kf.pair_fp4_scales(s, 8)
    with pytest.raises(ValueError, match="whole K steps"):
        kf.pair_fp4_scales(s[:, :, : G - 1], group)


def test_normalize_nvfp4_scales_keeps_every_weight_value():
    """`normalize_nvfp4_scales` (nvfp4 loads of the triton backend): on k64-interleaved weights with
    zero (+0 / -0), negative and positive e4m3 scales, every dequantized weight keeps its value exactly
    (float64), every scale ends >= +0 (no sign bit), the weights of zero scales are +0 codes, the weights
    of scales that were positive and nonzero are untouched bytes; NaN scales are refused naming the group."""
    import torch

    from epmoe.experts.triton import kernel_formats as kf
    from epmoe.quant import nvfp4

    g = torch.Generator().manual_seed(11)
    E, R, K = 2, 8, 192
    packed = torch.randint(0, 256, (E, R, K // 2), dtype=torch.uint8, generator=g)
    sbytes = torch.randint(0, 0x7F, (E, R, K // 16), dtype=torch.uint8, generator=g)  # finite, >= 0
    sign = torch.rand(E, R, K // 16, generator=g) < 0.3
    sbytes[sign] |= 0x80
    sbytes[0, 0, :4] = torch.tensor([0x00, 0x80, 0x00, 0x80], dtype=torch.uint8)  # +0 / -0 in one K step
    sbytes[1, 3, 5] = 0x80
    scales = sbytes.view(torch.float8_e4m3fn)
    want = nvfp4.dequantize(packed, scales, 1.0, torch.float64)
    kp = kf.interleave_fp4_k64(packed)
    s2 = scales.clone()
    kf.normalize_nvfp4_scales(kp, s2)
    got = nvfp4.dequantize(kf.deinterleave_fp4_k64(kp), s2, 1.0, torch.float64)
    assert torch.equal(got, want)
    sb = s2.view(torch.uint8)
    assert not bool((sb & 0x80).any())
    codes = torch.stack([kf.deinterleave_fp4_k64(kp) & 0x0F, kf.deinterleave_fp4_k64(kp) >> 4], -1).reshape(E, R, K // 16, 16)
    assert bool((codes[sb == 0] == 0).all())
    untouched = (sbytes & 0x80 == 0) & (sbytes != 0)
    orig = torch.stack([packed & 0x0F, packed >> 4], -1).reshape(E, R, K // 16, 16)
    assert torch.equal(codes[untouched], orig[untouched])
    for nan in (0x7F, 0xFF):
        bad = sbytes.clone()
        bad[1, 2, 7] = nan
        with pytest.raises(ValueError, match=r"nvfp4 w2 block scale of expert 9, row 2, K 112..127 is NaN .*re-export"):
            kf.normalize_nvfp4_scales(kf.interleave_fp4_k64(packed), bad.view(torch.float8_e4m3fn), "w2", 8)


def test_gluon_scale_pair_bit_trick_gives_the_scale_times_a_power_of_two():
    """The Gluon kernels' scale conversion (`gluon_w4a16._SCALE_PAIR_NV_ASM` / `_MX_ASM`), emulated on
    32-bit words for every pair of scale bytes it is given (nvfp4: every e4m3 >= +0 but NaN after
    `normalize_nvfp4_scales`, mxfp4: every e8m0 exponent <= 128): the f16 pair from the e4m3 pair,
    shifted right by 3 and or'd with 0x7000 per half, is the bf16 pair s * 2^112 (+0: 2^97, finite);
    e * 128 + 0x3F00 per half is the bf16 2^(e - 1). Halves do not leak into each other. (The byte
    permute and the hardware e4m3 -> f16 conversion run only on the GPU: tests/gpu.)"""
    import torch

    from epmoe.experts.triton.gluon_w4a16 import NV_SCALE_EPILOGUE

    assert NV_SCALE_EPILOGUE == 2.0**14  # s * 2^112 times the weights' value * 2^-126
    e4 = torch.arange(0, 0x7F, dtype=torch.uint8)  # +0 .. 448, no NaN
    f16 = e4.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    lo, hi = torch.meshgrid(f16, f16, indexing="ij")
    r = (((hi << 16) | lo) >> 3) | 0x70007000
    as_bf16 = lambda h: (h & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()  # noqa: E731
    s = e4.view(torch.float8_e4m3fn).double()
    want = torch.where(s == 0, torch.tensor(2.0**97, dtype=torch.float64), s * 2.0**112)
    assert torch.equal(as_bf16(r), want[:, None].expand(-1, len(s)))
    assert torch.equal(as_bf16(r >> 16), want[None, :].expand(len(s), -1))
    e8 = torch.arange(0, 129, dtype=torch.int64)
    lo, hi = torch.meshgrid(e8, e8, indexing="ij")
    r = (((hi << 16) | lo) * 128 + 0x3F003F00) & 0xFFFFFFFF
    want = torch.pow(2.0, e8.double() - 1)
    assert torch.equal(as_bf16(r), want[:, None].expand(-1, len(e8)))
    assert torch.equal(as_bf16(r >> 16), want[None, :].expand(len(e8), -1))


def test_gluon_scale_pair_conversion_text():
    """The Gluon kernels' scale-pair PTX (`gluon_w4a16._SCALE_PAIR_NV_ASM` / `_MX_ASM`, PTX model of
    `_run_ptx`) with the byte selectors of `_scale_selectors` (mirrored here: lane t's nvfp4 selector
    (t // 2) | ((t // 2 + 2) << 8) | 0x4040, mxfp4 0x4140): for every nvfp4 scale code of every finite
    e4m3 scale >= +0 (`kernel_formats.encode_nvfp4_scales`) in every byte of the step's word, the two bf16
    factors are the low / high half's scale * 2^112 (a +0 scale: any finite factor, its weights are +0);
    for every e8m0 exponent 0..128, 2^(e - 1)."""
    import random

    import torch

    from epmoe.experts.triton import gluon_w4a16 as G
    from epmoe.experts.triton import kernel_formats as kf

    def text(a):
        return a.value if hasattr(a, "value") else a

    def bf16(bits):
        return torch.tensor([bits], dtype=torch.int16 if bits < 0x8000 else torch.int32).to(torch.int16).view(
            torch.bfloat16).double().item()

    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F: NaN, refused at load
    codes = kf.encode_nvfp4_scales(e4m3.clone()).tolist()
    values = e4m3.view(torch.float8_e4m3fn).double().tolist()
    rng = random.Random(2)
    for _ in range(3000):
        idx = [rng.randrange(len(codes)) for _ in range(4)]
        word = sum(codes[i] << (8 * j) for j, i in enumerate(idx))
        for t in range(4):
            sel = (t // 2) | ((t // 2 + 2) << 8) | 0x4040
            r = _run_ptx(text(G._SCALE_PAIR_NV_ASM), 0, {"$2": word, "$3": sel})
            for out, g in (("$0", t // 2), ("$1", t // 2 + 2)):
                got, want = bf16(r[out]), values[idx[g]] * 2.0**112
                assert got == want or (want == 0 and math.isfinite(got)), (hex(word), t, out, got, want)
    for e in range(129):
        for e2 in (e, 128 - e, rng.randrange(129)):
            r = _run_ptx(text(G._SCALE_PAIR_MX_ASM), 0, {"$2": e | (e2 << 8), "$3": 0x4140})
            assert (bf16(r["$0"]), bf16(r["$1"])) == (2.0 ** (e - 1), 2.0 ** (e2 - 1)), (e, e2)
