"""Triton kernels of the `triton` experts backend. Imported only when that backend runs (this module
imports triton at the top); `epmoe.experts.triton.triton_experts` holds the launch code and the layouts.

Pipeline for the flat layout (rows n, slots k, entry j = n * K + k, all sorted by expert and padded
to BLOCK_M per expert by `epmoe.experts.triton.align`):

    moe_gemm1_kernel   act[p, :]  = act_fn(x[tok(p)] @ w13[e].T + b13[e])     [P, I] (bf16, or fp8 +
                                                                               1x128 scales)
    moe_gemm2_kernel   y[j(p), :] = w[j(p)] * (act[p] @ w2[e].T + b2[e])       [N*K, H] model dtype
    moe_reduce_kernel  out[n, :]  = sum_k y[n*K + k]  over valid k, in k order  [N, H]

fp32 accumulation everywhere; no atomics (deterministic). Weight formats (W_FMT): 0 bf16/fp16,
1 fp8 e4m3 with 128x128 fp32 block scales and per-token 1x128 fp8 activations (W8A8),
2 nvfp4 W4A16 (e4m3 scale per 16 + fp32 global scale), 3 mxfp4 W4A16 (e8m0 scale per 32); fp4
weights are in the k64-interleaved layout of `epmoe.experts.triton.kernel_formats`.

Tile options (constexpr): GATE_UP_IL (bf16/fp16, gated): w13 rows interleaved gate j / up j, one
[BLOCK_M, 2*BLOCK_N] dot per K step instead of two [BLOCK_M, BLOCK_N] dots. SPLIT_M: a tile whose real
rows fit in BLOCK_M/2 (an expert's tail) runs a BLOCK_M/2-row copy of the tile code.
fp8 quantization (input rows and gemm1's output) divides with IEEE rounding (`tl.math.div_rn`), so it
is bit-identical to the torch codec; plain `/` is div.full.f32 (<= 2 ulp) on NVIDIA.
"""

import triton
import triton.language as tl

from epmoe.experts.triton.kernel_formats import NV_SCALE_CODE_BIAS

W_DENSE = 0
W_FP8 = 1
W_NVFP4 = 2
W_MXFP4 = 3

ACT_SILU = 0  # silu(g) * u
ACT_SWIGLU_CLAMP = 1  # g' * sigmoid(alpha g') * (u' + beta), optional limit clamp
ACT_RELU2 = 2  # relu(g)^2 (non-gated)

FP8_MAX = tl.constexpr(448.0)  # globals used inside kernels must be constexpr
TWO_119 = tl.constexpr(2.0**119)
NV_SCALE_F32_BITS = tl.constexpr((127 - NV_SCALE_CODE_BIAS) << 23)  # `_nv_scale_f32`: the code's exponent bias undone


@triton.jit
def _nv_scale_f32(code):
    """nvfp4 scale code (uint8, `kernel_formats.encode_nvfp4_scales`) -> its fp32 value: the code shifted
    into the exponent's low bits (code 0, a +0 scale, gives 2^-10: its weights are +0 after load)."""
    return ((code.to(tl.int32) << 20) + NV_SCALE_F32_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_scales(s_ptrs, kk, stride_wsp, W_FMT: tl.constexpr):
    """The scales of one k64 block for each column: nvfp4 4 scale codes (groups 4kk .. 4kk+3), mxfp4 2 e8m0
    (2kk, 2kk+1), loaded as one [BN, 4] / [BN, 2] tile (a 4- / 2-byte vector per column, which the
    pipeliner can stage like the weights) instead of one byte load per group. The scales come in K-step
    pairs (`kernel_formats.pair_fp4_scales`): step kk's at pair kk // 2 (stride_wsp bytes apart), half kk % 2."""
    pair_off = (kk // 2) * stride_wsp
    if W_FMT == 2:
        s = tl.load(s_ptrs[:, None] + (pair_off + (kk % 2) * 4) + tl.arange(0, 4)[None, :])
        s_even, s_odd = tl.split(tl.reshape(s, (s.shape[0], 2, 2)))  # (s0, s2), (s1, s3)
        s0, s2 = tl.split(s_even)
        s1, s3 = tl.split(s_odd)
        return s0, s1, s2, s3
    else:
        e = tl.load(s_ptrs[:, None] + (pair_off + (kk % 2) * 2) + tl.arange(0, 2)[None, :])
        e_lo, e_hi = tl.split(e)
        return e_lo, e_hi, e_lo, e_hi


@triton.jit
def _fp4_dequant(p, s0, s1, s2, s3, HALF: tl.constexpr, W_FMT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One k64 block of fp4 weights -> (w_lo, w_hi) [HALF, BN] in OUT_DTYPE, exact.

    p:      [HALF, BN] uint8, k64-interleaved: byte j holds K elements 64kk + j (low nibble) and
            64kk + HALF + j (high nibble)
    s0..s3: [BN] the block's scales per column (`_fp4_scales`: nvfp4 scale codes of groups 0..3 of the block,
            mxfp4 e8m0 groups 0, 1 of the block in s0, s1)
    e2m1 -> fp16 bits by shifts alone (sign -> bit 15, exponent|mantissa -> bits 11..9) is exactly
    value * 2^-14, subnormal 0.5 included; the 2^14 is folded into the scale. ~8 ops per value."""
    q = p.to(tl.int32)
    lo = (((q & 7) << 9) | ((q & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((q & 0x70) << 5) | ((q & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if W_FMT == 2:
        # nvfp4: groups 4kk .. 4kk+3 cover the block; each half holds two of them.
        first = (tl.arange(0, HALF) < 16)[:, None]
        s0 = _nv_scale_f32(s0) * 16384.0
        s1 = _nv_scale_f32(s1) * 16384.0
        s2 = _nv_scale_f32(s2) * 16384.0
        s3 = _nv_scale_f32(s3) * 16384.0
        w_lo = lo * tl.where(first, s0[None, :], s1[None, :])
        w_hi = hi * tl.where(first, s2[None, :], s3[None, :])
    else:
        # mxfp4: groups 2kk (low half) and 2kk+1 (high half); 2^(s-127) * 2^14 built as fp32 bits
        # (exact for s <= 240, i.e. any weight below 2^113).
        w_lo = lo * ((s0.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)[None, :]
        w_hi = hi * ((s1.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)[None, :]
    return w_lo.to(OUT_DTYPE), w_hi.to(OUT_DTYPE)


# e2m1 nibbles -> bf16 bit patterns (value * 2^-126), 4 bytes = 8 values per call, ~2 instructions per
# value. Per byte i of $4 (any 4 elements Triton packs: each output depends on its own byte only):
# prmt spreads bytes (0, 1) / (2, 3) to bits 8..15 and 24..31 of a word a; then the high nibbles
# (bits 12..15, 28..31) give bf16 pairs (a & 0x80008000) | ((a >> 6) & 0x01C001C0) and the low nibbles
# ((a << 4) & 0x80008000) | ((a >> 2) & 0x01C001C0): sign to bit 15, exponent|mantissa to bits 8..6,
# exactly the words `_fp4_dequant_packed` builds with Triton integer ops. $0, $1: low nibbles of
# bytes (0, 1), (2, 3); $2, $3: high nibbles.
def _e2m1_bf16_asm() -> str:
    """The PTX of `_E2M1_BF16_ASM`: bytes (0, 1) then (2, 3) of $4, each pair spread by one prmt."""
    lines = ["{", ".reg .b32 a, t, u;"]
    for selector, lo_out, hi_out in (("0x1404", "$0", "$2"), ("0x3424", "$1", "$3")):
        lines += [
            f"prmt.b32 a, $4, 0, {selector};",
            "shr.b32 t, a, 2;", "and.b32 t, t, 0x01C001C0;", "shl.b32 u, a, 4;", "and.b32 u, u, 0x80008000;",
            f"or.b32 {lo_out}, t, u;",  # low nibbles
            "shr.b32 t, a, 6;", "and.b32 t, t, 0x01C001C0;", "and.b32 u, a, 0x80008000;",
            f"or.b32 {hi_out}, t, u;",  # high nibbles
        ]  # fmt: skip
    return "\n".join(lines + ["}"])


_E2M1_BF16_ASM = tl.constexpr(_e2m1_bf16_asm())

# The same 4 output words from a 4-byte word whose 32 bits were permuted at load time
# (`kernel_formats.permute_fp4_words`, convert mode "words"), 8 instructions per 8 values: output $0's bits
# are stored where the bf16 pair wants them (mask FP4_WORD_PAIR = 0x81C081C0: sign at 15, exponent|
# mantissa at 8..6, and the same + 16): one mask; $1 and $2's 22 and 19 places above (mod 32): one
# rotation (funnel shift) and one mask each; $3's at bits 0, 1, 3, 4 (+ 16), which one multiply by
# 2^2 + 2^7 + 2^12 copies to 2, 7 and 12 places higher (the three copies of those 8 bits never share a
# position: no carries) for the mask to keep the right one of each: mask, multiply, mask. (The previous
# layout needed 11 sm90 instructions per word: no four shifts of the pair mask tile the 32 bits.)
# Every output is the `_E2M1_BF16_ASM` output of the original word, so a kernel's result does not
# change, but the 4 bytes packed into one call must be one aligned word of the weights (each call
# reads bits of all four bytes).
FP4_WORD_PAIR = 0x81C081C0


def _e2m1_bf16_words_asm() -> str:
    """The PTX of `_E2M1_BF16_WORDS_ASM` (input: a word permuted by `kernel_formats.permute_fp4_words`)."""
    return "\n".join([
        "{", ".reg .b32 t;",
        f"and.b32 $0, $4, {FP4_WORD_PAIR:#x};",
        "shf.r.wrap.b32 t, $4, $4, 22;", f"and.b32 $1, t, {FP4_WORD_PAIR:#x};",
        "shf.r.wrap.b32 t, $4, $4, 19;", f"and.b32 $2, t, {FP4_WORD_PAIR:#x};",
        "and.b32 t, $4, 0x001B001B;", "mul.lo.u32 t, t, 0x1084;", f"and.b32 $3, t, {FP4_WORD_PAIR:#x};",
        "}",
    ])  # fmt: skip


_E2M1_BF16_WORDS_ASM = tl.constexpr(_e2m1_bf16_words_asm())


@triton.jit
def _fp4_dequant_packed(p, s0, s1, s2, s3, HALF: tl.constexpr, W_FMT: tl.constexpr, FP4_PACKED: tl.constexpr = 1):
    """`_fp4_dequant` with bf16 built from the bits, two values per integer op (bf16 models only).

    For each byte b (low nibble = K element j, high nibble = j + HALF), one 32-bit word holds both
    values as bf16 bit patterns: magnitudes (b * 0x40040) & 0x01C001C0 put the 3 exponent|mantissa
    bits of the low nibble at bf16 bits 8..6 and those of the high nibble at 24..22; signs
    (b * 0x1001000) & 0x80008000 put bit 3 at 15 and bit 7 at 31 (the two shifted copies of b never
    overlap: no carries). Read as bf16 with a zero exponent bias, each half is exactly
    value * 2^-126 (0.5 -> the subnormal 2^-127); one bf16 multiply by the block scale folded with
    2^126 gives the exact product (<= 6 significant bits: no rounding):
      mxfp4  scale bits (e + 126) << 7 = 2^(e-1): weights = value * 2^(e-127), exactly those of
             `_fp4_dequant`, for scale exponents e <= 128 (the loader checks; else `_fp4_dequant`)
      nvfp4  s * 2^119 (e4m3 s <= 448: finite): weights = value * s * 2^-7 exactly; the 2^7 goes
             into the per-expert global scale on the fp32 accumulator (power-of-two scaling
             commutes with fp32 rounding: the same result bit for bit)
    bf16 multiplies keep subnormal operands (PTX mul/fma .bf16 have no flush-to-zero).
    FP4_PACKED 1: these Triton integer ops; 2: the same bit patterns from inline PTX (`_E2M1_BF16_ASM`,
    4 bytes per call: ~2 instructions per value instead of ~5); 3: from the bit-permuted words of
    convert mode "words" (`_E2M1_BF16_WORDS_ASM`); the interpreter cannot run PTX, so launches under
    it pass 1."""
    if FP4_PACKED >= 2:
        ASM: tl.constexpr = _E2M1_BF16_WORDS_ASM if FP4_PACKED == 3 else _E2M1_BF16_ASM
        lo, hi = tl.inline_asm_elementwise(
            ASM, "=r,=r,=r,=r,r", [p], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        b = p.to(tl.uint32)
        w = ((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & 0x80008000)
        lo = w.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (w >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    if W_FMT == 2:
        first = (tl.arange(0, HALF) < 16)[:, None]
        w_lo = lo * tl.where(first, (_nv_scale_f32(s0) * TWO_119).to(tl.bfloat16)[None, :],
                             (_nv_scale_f32(s1) * TWO_119).to(tl.bfloat16)[None, :])
        w_hi = hi * tl.where(first, (_nv_scale_f32(s2) * TWO_119).to(tl.bfloat16)[None, :],
                             (_nv_scale_f32(s3) * TWO_119).to(tl.bfloat16)[None, :])
    else:
        w_lo = lo * ((s0.to(tl.uint16) + 126) << 7).to(tl.bfloat16, bitcast=True)[None, :]
        w_hi = hi * ((s1.to(tl.uint16) + 126) << 7).to(tl.bfloat16, bitcast=True)[None, :]
    return w_lo, w_hi


@triton.jit
def _fp4_block(p, s_ptrs, n0, n1, n2, n3, kk, num_k, stride_wsp, HALF: tl.constexpr, W_FMT: tl.constexpr,
               FP4_PACKED: tl.constexpr, FP4_PREFETCH: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """K step kk of a W4A16 loop: bytes p -> (w_lo, w_hi) and the scales the next step uses.
    FP4_PREFETCH: n0..n3 are step kk's scales (read one step earlier) and step kk + 1's are read
    now; otherwise step kk's are read here (n0..n3 pass through). FP4_PACKED: 0 `_fp4_dequant`,
    1 `_fp4_dequant_packed`, 2 the same with inline PTX, 3 inline PTX on bit-permuted words."""
    c0, c1, c2, c3 = n0, n1, n2, n3
    if FP4_PREFETCH:
        n0, n1, n2, n3 = _fp4_scales(s_ptrs, tl.minimum(kk + 1, num_k - 1), stride_wsp, W_FMT)
    else:
        c0, c1, c2, c3 = _fp4_scales(s_ptrs, kk, stride_wsp, W_FMT)
    if FP4_PACKED:
        w_lo, w_hi = _fp4_dequant_packed(p, c0, c1, c2, c3, HALF, W_FMT, FP4_PACKED)
    else:
        w_lo, w_hi = _fp4_dequant(p, c0, c1, c2, c3, HALF, W_FMT, OUT_DTYPE)
    return w_lo, w_hi, n0, n1, n2, n3


@triton.jit
def _activation(g, u, alpha, beta, limit, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr):
    if ACT == 0:
        r = g * tl.sigmoid(g) * u
    elif ACT == 1:
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        r = g * tl.sigmoid(alpha * g) * (u + beta)
    else:
        p = tl.maximum(g, 0.0)
        r = p * p
    return r


@triton.jit
def _tile_ids(max_blocks, num_n, GROUP_M: tl.constexpr):
    """Program id -> (m tile, n tile): GROUP_M m tiles (mostly one expert) sweep n together, so a
    weight tile is read by its expert's m tiles at about the same time (L2 reuse)."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_n
    group_id = pid // in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _fp4_row_offsets(n, stride_wn, TILED: tl.constexpr):
    """Byte offsets (int64) of K step 0 of fp4 weight rows n within their expert: n * K/2, or in row
    tiles (`kernel_formats.tile_fp4_rows`: 8 rows x 32 bytes per K step contiguous) (n // 8) * 8 * K/2
    + (n % 8) * 32, K steps 256 bytes apart (the Gluon kernels' `gluon_w4a16._fp4_row_offsets`)."""
    if TILED:
        return (n // 8).to(tl.int64) * (8 * stride_wn) + (n % 8) * 32
    else:
        return n.to(tl.int64) * stride_wn


@triton.jit
def _gemm1_tile(
    pid_m, pid_n, e64,
    x_ptr, xs_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, outs_ptr, sorted_ids_ptr,
    num_entries, H, I,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsp, stride_wge, stride_be,
    stride_om, stride_osm,
    alpha, beta, limit,
    TOP_K: tl.constexpr, W_FMT: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_FP8: tl.constexpr, GATE_UP_IL: tl.constexpr,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP4_PACKED: tl.constexpr, FP4_PREFETCH: tl.constexpr, TILED: tl.constexpr,
):
    """One gemm1 output tile: rows [pid_m*BLOCK_M, +TILE_M) of the padded routing (TILE_M is BLOCK_M,
    or BLOCK_M/2 for a tail tile whose real rows fit in the first half), intermediate columns
    [pid_n*BLOCK_N, +BLOCK_N)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, TILE_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < num_entries
    # Padding rows read token 0 (in bounds, finite); their results are never used.
    tok = tl.where(row_ok, ids // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    n_c = tl.where(n_ok, offs_n, 0)  # in-bounds column for loads; stores are masked

    acc_g = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + e64 * stride_we
    ws_base = ws_ptr + e64 * stride_wse
    num_k = tl.cdiv(H, BLOCK_K)

    if W_FMT == 0 and GATED and GATE_UP_IL:
        # Interleaved rows (w13 row 2j = gate j, 2j+1 = up j): ONE [TILE_M, 2*BLOCK_N] dot per K step
        # (wgmma n256 for BLOCK_N=128: the A tile is read from shared memory once, not once per half);
        # the pair (gate j, up j) sits in adjacent accumulator columns of one thread, so the split is
        # free.
        offs_k = tl.arange(0, BLOCK_K)
        offs_r = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        r_c = tl.where(offs_r < 2 * I, offs_r, 0)
        a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_base + r_c[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        acc = tl.zeros((TILE_M, 2 * BLOCK_N), dtype=tl.float32)
        for kk in range(0, num_k):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = offs_k < H - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc_g, acc_u = tl.split(tl.reshape(acc, (TILE_M, BLOCK_N, 2)))
    elif W_FMT == 0 or W_FMT == 1:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
        g_ptrs = w_base + n_c[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + I * stride_wn
        if W_FMT == 1:
            # BLOCK_N == 128: the tile's columns share one 128-row weight block, so its scale is a
            # scalar per K step and the promotion is one FMA per accumulator element.
            s_half = tl.cdiv(I, 128)
            sg_ptr = ws_base + pid_n * stride_wsn
            su_ptr = ws_base + (s_half + pid_n) * stride_wsn
            as_ptrs = xs_ptr + tok * stride_xsm
        for kk in range(0, num_k):
            if EVEN_K:
                a = tl.load(a_ptrs)
                g = tl.load(g_ptrs)
                if GATED:
                    u = tl.load(u_ptrs)
            else:
                k_ok = offs_k < H - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
                if GATED:
                    u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
            if W_FMT == 0:
                acc_g = tl.dot(a, g, acc_g)
                if GATED:
                    acc_u = tl.dot(a, u, acc_u)
            else:
                # Scale promotion per 128-K block (BLOCK_K == 128): each fp8 dot covers one block of
                # the activation's 1x128 and the weight's 128x128 scale grids.
                a_s = tl.load(as_ptrs + kk)
                acc_g += tl.dot(a, g) * (a_s * tl.load(sg_ptr + kk))[:, None]
                if GATED:
                    acc_u += tl.dot(a, u) * (a_s * tl.load(su_ptr + kk))[:, None]
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    else:
        # fp4 W4A16, k64-interleaved bytes (see _fp4_dequant). BLOCK_K == 64 and H % 64 == 0
        # (checked by the launcher).
        HALF: tl.constexpr = BLOCK_K // 2
        offs_h = tl.arange(0, HALF)
        a_lo_ptrs = x_ptr + tok[:, None] * stride_xm + offs_h[None, :]
        g_ptrs = w_base + _fp4_row_offsets(n_c, stride_wn, TILED)[None, :] + offs_h[:, None]
        u_ptrs = g_ptrs + I * stride_wn
        WSTEP: tl.constexpr = 8 * HALF if TILED else HALF  # bytes from one K step of a row to the next
        sg_ptrs = ws_base + n_c.to(tl.int64) * stride_wsn
        su_ptrs = sg_ptrs + I * stride_wsn
        # Scales are read one K step ahead (FP4_PREFETCH): their loads are too small for the
        # pipeliner's async copies, so without this each step waits for a global load.
        g0, g1, g2, g3 = _fp4_scales(sg_ptrs, 0, stride_wsp, W_FMT)
        if GATED:
            u0, u1, u2, u3 = _fp4_scales(su_ptrs, 0, stride_wsp, W_FMT)
        for kk in range(0, num_k):
            a_lo = tl.load(a_lo_ptrs)
            a_hi = tl.load(a_lo_ptrs + HALF)
            w_lo, w_hi, g0, g1, g2, g3 = _fp4_block(tl.load(g_ptrs), sg_ptrs, g0, g1, g2, g3, kk, num_k, stride_wsp, HALF, W_FMT,
                                                    FP4_PACKED, FP4_PREFETCH, x_ptr.dtype.element_ty)
            acc_g = tl.dot(a_lo, w_lo, acc_g)
            acc_g = tl.dot(a_hi, w_hi, acc_g)
            if GATED:
                v_lo, v_hi, u0, u1, u2, u3 = _fp4_block(tl.load(u_ptrs), su_ptrs, u0, u1, u2, u3, kk, num_k, stride_wsp, HALF, W_FMT,
                                                        FP4_PACKED, FP4_PREFETCH, x_ptr.dtype.element_ty)
                acc_u = tl.dot(a_lo, v_lo, acc_u)
                acc_u = tl.dot(a_hi, v_hi, acc_u)
            a_lo_ptrs += BLOCK_K
            g_ptrs += WSTEP
            u_ptrs += WSTEP
        if W_FMT == 2:
            # the packed conversion leaves 2^-7 in the weights (see _fp4_dequant_packed)
            gs = 128.0 if FP4_PACKED else 1.0
            acc_g = acc_g * (tl.load(wg_ptr + e64 * stride_wge) * gs)
            if GATED:
                acc_u = acc_u * (tl.load(wg_ptr + e64 * stride_wge + 1) * gs)

    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e64 * stride_be + n_c)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + e64 * stride_be + I + n_c)[None, :]
    act = _activation(acc_g, acc_u, alpha, beta, limit, ACT, HAS_LIMIT)

    rows = offs_m.to(tl.int64)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    if OUT_FP8:
        # 1x128 quantization of the activation row for the fp8 down projection (BLOCK_N == 128).
        # IEEE divisions (div_rn), as the torch codec: `/` compiles to an approximate division
        # (div.full.f32, up to 2 ulp), which moves values that sit exactly on an e4m3 rounding tie.
        act = tl.where(n_ok[None, :], act, 0.0)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(act), axis=1), 1e-10), FP8_MAX)
        q8 = tl.clamp(tl.math.div_rn(act, scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(out_ptrs, q8.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])
        tl.store(outs_ptr + rows * stride_osm + pid_n, scale)
    else:
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_entries", "max_blocks"])
def moe_gemm1_kernel(
    x_ptr,  # [N, H] activations (bf16/fp16, or fp8 for W_FMT 1)
    xs_ptr,  # [N, ceil(H/128)] fp32 activation scales (W_FMT 1)
    w_ptr,  # [E, R, H] (fp4: [E, R, H/2] packed) R = 2I (gate rows, then up rows; or interleaved
    #         gate j, up j for GATE_UP_IL) or I
    ws_ptr,  # weight scales: fp8 [E, 2*ceil(I/128), ceil(H/128)]; fp4 [E, R, H/group]
    wg_ptr,  # nvfp4 global scales [E, G] fp32
    b_ptr,  # [E, R] fp32 bias (gate, then up: never interleaved)
    out_ptr,  # [P, I] activation out (model dtype, or fp8 for OUT_FP8)
    outs_ptr,  # [P, ceil(I/128)] fp32 scales of out (OUT_FP8)
    sorted_ids_ptr,  # [P] int32 entry of each padded row (>= num_entries: padding)
    block_expert_ptr,  # [max_blocks] int32 expert of each m tile (-1: unused)
    block_rows_ptr,  # [max_blocks] int32 real rows of each m tile (SPLIT_M)
    num_entries,
    max_blocks,
    H,
    I,
    stride_xm,
    stride_xsm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsp,  # fp4: bytes from one K-step pair of a row's scales to the next (`kernel_formats.pair_fp4_scales`)
    stride_wge,
    stride_be,
    stride_om,
    stride_osm,
    alpha,
    beta,
    limit,
    TOP_K: tl.constexpr,
    W_FMT: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_FP8: tl.constexpr,
    GATE_UP_IL: tl.constexpr,
    SPLIT_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP4_PACKED: tl.constexpr,  # fp4 -> bf16: 0 _fp4_dequant, 1 _fp4_dequant_packed, 2 the same with inline PTX, 3 on permuted words
    FP4_PREFETCH: tl.constexpr = True,  # fp4: load the scales one K step ahead
    TILED: tl.constexpr = False,  # fp4 weights in row tiles (`kernel_formats.tile_fp4_rows`)
):
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_ids(max_blocks, num_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    # SPLIT_M: an expert's tail tile with <= BLOCK_M/2 real rows runs the half-height code path, so
    # the padding costs at most BLOCK_M/2 rows of MMA work per expert instead of BLOCK_M - 1.
    half = False
    if SPLIT_M:
        half = tl.load(block_rows_ptr + pid_m) <= BLOCK_M // 2
    if half:
        _gemm1_tile(
            pid_m, pid_n, e64, x_ptr, xs_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, outs_ptr,
            sorted_ids_ptr, num_entries, H, I, stride_xm, stride_xsm, stride_we, stride_wn, stride_wse,
            stride_wsn, stride_wsp, stride_wge, stride_be, stride_om, stride_osm, alpha, beta, limit,
            TOP_K, W_FMT, GATED, ACT, HAS_LIMIT, HAS_BIAS, OUT_FP8, GATE_UP_IL,
            BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP4_PACKED, FP4_PREFETCH, TILED,
        )  # fmt: skip
    else:
        _gemm1_tile(
            pid_m, pid_n, e64, x_ptr, xs_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, outs_ptr,
            sorted_ids_ptr, num_entries, H, I, stride_xm, stride_xsm, stride_we, stride_wn, stride_wse,
            stride_wsn, stride_wsp, stride_wge, stride_be, stride_om, stride_osm, alpha, beta, limit,
            TOP_K, W_FMT, GATED, ACT, HAS_LIMIT, HAS_BIAS, OUT_FP8, GATE_UP_IL,
            BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP4_PACKED, FP4_PREFETCH, TILED,
        )  # fmt: skip


@triton.jit
def _gemm2_tile(
    pid_m, pid_n, e64,
    a_ptr, as_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr,
    num_entries, N, K,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsp, stride_wge, stride_be, stride_ym,
    W_FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP4_PACKED: tl.constexpr, FP4_PREFETCH: tl.constexpr, TILED: tl.constexpr,
):
    """One gemm2 output tile: padded rows [pid_m*BLOCK_M, +TILE_M), hidden columns [pid_n*BLOCK_N, +BLOCK_N)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, TILE_M)
    rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_c = tl.where(n_ok, offs_n, 0)

    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + e64 * stride_we
    ws_base = ws_ptr + e64 * stride_wse
    num_k = tl.cdiv(K, BLOCK_K)

    if W_FMT == 0 or W_FMT == 1:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = w_base + n_c[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        if W_FMT == 1:
            if BLOCK_N <= 128:  # one weight block per tile (BLOCK_N divides 128): scalar scale
                bs_ptr = ws_base + (pid_n * BLOCK_N // 128) * stride_wsn
            else:
                bs_ptrs = ws_base + (n_c // 128) * stride_wsn
            as_ptrs = as_ptr + rows * stride_asm
        for kk in range(0, num_k):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if W_FMT == 0:
                acc = tl.dot(a, b, acc)
            else:
                a_s = tl.load(as_ptrs + kk)
                if BLOCK_N <= 128:
                    acc += tl.dot(a, b) * (a_s * tl.load(bs_ptr + kk))[:, None]
                else:
                    acc += tl.dot(a, b) * a_s[:, None] * tl.load(bs_ptrs + kk)[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        offs_h = tl.arange(0, HALF)
        a_lo_ptrs = a_ptr + rows[:, None] * stride_am + offs_h[None, :]
        b_ptrs = w_base + _fp4_row_offsets(n_c, stride_wn, TILED)[None, :] + offs_h[:, None]
        WSTEP: tl.constexpr = 8 * HALF if TILED else HALF
        s_ptrs = ws_base + n_c.to(tl.int64) * stride_wsn
        n0, n1, n2, n3 = _fp4_scales(s_ptrs, 0, stride_wsp, W_FMT)
        for kk in range(0, num_k):
            a_lo = tl.load(a_lo_ptrs)
            a_hi = tl.load(a_lo_ptrs + HALF)
            w_lo, w_hi, n0, n1, n2, n3 = _fp4_block(tl.load(b_ptrs), s_ptrs, n0, n1, n2, n3, kk, num_k, stride_wsp, HALF, W_FMT,
                                                    FP4_PACKED, FP4_PREFETCH, a_ptr.dtype.element_ty)
            acc = tl.dot(a_lo, w_lo, acc)
            acc = tl.dot(a_hi, w_hi, acc)
            a_lo_ptrs += BLOCK_K
            b_ptrs += WSTEP
        if W_FMT == 2:
            gs = 128.0 if FP4_PACKED else 1.0
            acc = acc * (tl.load(wg_ptr + e64 * stride_wge) * gs)

    if HAS_BIAS:
        acc += tl.load(b_ptr + e64 * stride_be + n_c)[None, :]
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < num_entries
    ids64 = tl.where(row_ok, ids, 0).to(tl.int64)
    rw = tl.load(topk_w_ptr + ids64, mask=row_ok, other=0.0)
    acc = acc * rw[:, None]
    y_ptrs = y_ptr + ids64[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_entries", "max_blocks"])
def moe_gemm2_kernel(
    a_ptr,  # [P, K] activations from gemm1 (model dtype, or fp8)
    as_ptr,  # [P, ceil(K/128)] fp32 (W_FMT 1)
    w_ptr,  # [E, N, K] (fp4: [E, N, K/2])
    ws_ptr,  # fp8 [E, ceil(N/128), ceil(K/128)]; fp4 [E, N, K/group]
    wg_ptr,  # nvfp4 [E, 1] fp32
    b_ptr,  # [E, N] fp32
    y_ptr,  # [num_entries, N] model dtype: routing-weighted expert outputs by entry
    topk_w_ptr,  # [num_entries] fp32
    sorted_ids_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_entries,
    max_blocks,
    N,
    K,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsp,  # fp4: bytes from one K-step pair of a row's scales to the next (`kernel_formats.pair_fp4_scales`)
    stride_wge,
    stride_be,
    stride_ym,
    W_FMT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP4_PACKED: tl.constexpr,  # fp4 -> bf16: 0 _fp4_dequant, 1 _fp4_dequant_packed, 2 the same with inline PTX, 3 on permuted words
    FP4_PREFETCH: tl.constexpr = True,  # fp4: load the scales one K step ahead
    TILED: tl.constexpr = False,  # fp4 weights in row tiles (`kernel_formats.tile_fp4_rows`)
):
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_ids(max_blocks, num_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    half = False
    if SPLIT_M:
        half = tl.load(block_rows_ptr + pid_m) <= BLOCK_M // 2
    if half:
        _gemm2_tile(
            pid_m, pid_n, e64, a_ptr, as_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, y_ptr, topk_w_ptr,
            sorted_ids_ptr, num_entries, N, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
            stride_wsn, stride_wsp, stride_wge, stride_be, stride_ym,
            W_FMT, HAS_BIAS, BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP4_PACKED, FP4_PREFETCH, TILED,
        )  # fmt: skip
    else:
        _gemm2_tile(
            pid_m, pid_n, e64, a_ptr, as_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, y_ptr, topk_w_ptr,
            sorted_ids_ptr, num_entries, N, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
            stride_wsn, stride_wsp, stride_wge, stride_be, stride_ym,
            W_FMT, HAS_BIAS, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP4_PACKED, FP4_PREFETCH, TILED,
        )  # fmt: skip


@triton.jit
def moe_reduce_kernel(
    y_ptr,  # [N*K, H] weighted expert outputs by entry (rows of invalid entries are never read)
    ids_ptr,  # [N, K] int32 local expert ids
    out_ptr,  # [N, H]
    H,
    num_experts,
    stride_ym,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + k)
        # Invalid slot (id < 0: expert not on this rank) -> load nothing; y's row was never written.
        lim = tl.where((e >= 0) & (e < num_experts), H, 0)
        v = tl.load(y_ptr + (t * TOP_K + k) * stride_ym + offs, mask=offs < lim, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def quant_fp8_rows_kernel(
    x_ptr,  # [N, C] model dtype
    q_ptr,  # [N, C] fp8 e4m3
    s_ptr,  # [N, ceil(C/GROUP)] fp32
    C,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    ok = offs < C
    x = tl.load(x_ptr + r * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    # IEEE divisions, bit-identical to the torch codec (`epmoe.quant.fp8_block`): `/` would compile to
    # div.full.f32 (up to 2 ulp off), and bf16 inputs put many quotients exactly on an e4m3 rounding
    # tie, where a 1-ulp change of the scale or quotient flips the rounding.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10), FP8_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + r * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + r * stride_sm + g, scale)


# --------------------------------------------------------------------------- grouped_mm epilogues
# Around torch._grouped_mm (CUTLASS grouped GEMMs on contiguous expert-sorted rows): one pass each,
# bf16 in / bf16 out with fp32 math, no atomics. Rows are the sorted positions p of
# `epmoe.experts.triton.align.sort_by_expert` (entries by expert; invalid entries last, skipped).


@triton.jit
def gather_rows_kernel(
    x_ptr,  # [N, H] tokens (model dtype)
    ids_ptr,  # [N, K] int32 local expert ids (invalid: < 0 or >= num_experts)
    inv_ptr,  # [N*K] int32 sorted position of each entry j = n*K + k
    xs_ptr,  # [N*K, H] out: xs[inv[n*K+k]] = x[n] for the valid slots (other rows are not written)
    H,
    num_experts,
    stride_xm,
    stride_sm,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Token-major gather: each token row is read once and written to its K sorted positions."""
    n = tl.program_id(0).to(tl.int64)
    src = x_ptr + n * stride_xm
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(src + offs, mask=offs < H)
        for k in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + n * TOP_K + k)
            lim = tl.where((e >= 0) & (e < num_experts), H, 0)
            p = tl.load(inv_ptr + n * TOP_K + k).to(tl.int64)
            tl.store(xs_ptr + p * stride_sm + offs, v, mask=offs < lim)


@triton.jit
def permute_k_kernel(
    x_ptr,  # [N, K] 16-bit values as int32 pairs [N, K / 2] (K % 32 == 0, unit column stride)
    out_ptr,  # [N, K / 2] int32 out: the same values in the K order of the Gluon wgmma kernel
    N,
    Q,  # K / 2 pairs per row
    stride_xm,  # in pairs
    stride_om,
    BLOCK_R: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # pairs per program and row (a multiple of 16)
):
    """out[n, p(k)] = x[n, k] with p(8t + 2c + b) = 8c + 2t + b within each 32-wide group of K
    (`gluon_w4a16._permuted_k`, `gluon_w4a16.permute_k`): value pair 4t + c of a 16-pair group goes to pair
    4c + t, a 4 x 4 transpose of 4-byte pairs (contiguous 16-byte loads, 4-byte stores)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    ok = (rows < N)[:, None] & (q < Q)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(x_ptr + r64 * stride_xm + q[None, :], mask=ok)
    p = (q & ~15) | ((q & 3) << 2) | ((q >> 2) & 3)
    tl.store(out_ptr + r64 * stride_om + p[None, :], v, mask=ok)


@triton.jit
def grouped_act_kernel(
    h_ptr,  # [N*K, R] gemm1 output by sorted position (model dtype); R = 2I (gated) or I
    b_ptr,  # [>=E, R] fp32 bias (gate, then up: never interleaved)
    a_ptr,  # [N*K, I] out: activation (model dtype); invalid rows not written
    sorted_expert_ptr,
    num_experts,
    I,
    stride_hm,
    stride_be,
    stride_am,
    alpha,
    beta,
    limit,
    ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    GATE_UP_IL: tl.constexpr,  # h columns 2j / 2j+1 = gate j / up j
    BLOCK_I: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    e = tl.load(sorted_expert_ptr + p)
    if e < num_experts:
        offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        ok = offs < I
        row = h_ptr + p * stride_hm
        if GATED and GATE_UP_IL:
            # [BLOCK_I, 2] tile: each thread holds its (gate j, up j) pairs, so the split is free
            offs2 = offs[:, None] * 2 + tl.arange(0, 2)[None, :]
            hv = tl.load(row + offs2, mask=offs2 < 2 * I, other=0.0).to(tl.float32)
            g, u = tl.split(hv)
            # the column index in g's own layout (bias loads and the store need no layout change)
            offs = tl.split(offs2)[0] // 2
            ok = offs < I
        else:
            g = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
            u = g
            if GATED:
                u = tl.load(row + I + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = b_ptr + e.to(tl.int64) * stride_be
            g += tl.load(bias + offs, mask=ok, other=0.0)
            if GATED:
                u += tl.load(bias + I + offs, mask=ok, other=0.0)
        act = _activation(g, u, alpha, beta, limit, ACT, HAS_LIMIT)
        tl.store(a_ptr + p * stride_am + offs, act.to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def grouped_combine_kernel(
    y_ptr,  # [N*K, H] gemm2 output by sorted position (model dtype; invalid rows never read)
    inv_ptr,  # [N*K] int32 sorted position of entry j
    ids_ptr,  # [N, K] int32 local expert ids (invalid: < 0 or >= num_experts)
    w_ptr,  # [N, K] fp32 routing weights
    b_ptr,  # [>=E, H] fp32 bias
    out_ptr,  # [N, H] out
    H,
    num_experts,
    stride_ym,
    stride_be,
    stride_om,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[n] = sum_k w[n,k] * (y[inv[n*K+k]] + b2[e]) over valid k, in k order, fp32."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + n * TOP_K + k)
        valid = (e >= 0) & (e < num_experts)
        lim = tl.where(valid, H, 0)
        p = tl.load(inv_ptr + n * TOP_K + k).to(tl.int64)
        p = tl.where(valid, p, 0)
        v = tl.load(y_ptr + p * stride_ym + offs, mask=offs < lim, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e64 = tl.where(valid, e, 0).to(tl.int64)
            v += tl.load(b_ptr + e64 * stride_be + offs, mask=offs < lim, other=0.0)
        wk = tl.where(valid, tl.load(w_ptr + n * TOP_K + k), 0.0)
        acc += wk * v
    tl.store(out_ptr + n * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


# --------------------------------------------------------------------------- training (backward)
# The memory-bound steps of the grouped_mm experts' backward (`grouped_mm.fused_grouped_mm_train_forward`):
# fp32 arithmetic, one rounding per output, no atomics. The forward reuses gather_rows_kernel,
# grouped_act_kernel and grouped_combine_kernel.


@triton.jit
def grouped_act_bwd_kernel(
    h_ptr,  # [n, R] gemm1 output (model dtype); R = 2I (gate then up) or I
    ga_ptr,  # [n, I] gradient of the activation output
    gh_ptr,  # [n, R] out: gradient of h (model dtype)
    I,
    stride_hm,
    stride_gam,
    stride_ghm,
    alpha,
    beta,
    limit,
    ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """d/dh of `_activation` in fp32. A clamp passes the gradient where its input is within the limit
    (torch.clamp's rule: at the limit too), zero beyond."""
    p = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = offs < I
    row = h_ptr + p * stride_hm
    g = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
    ga = tl.load(ga_ptr + p * stride_gam + offs, mask=ok, other=0.0).to(tl.float32)
    out = gh_ptr + p * stride_ghm
    if ACT == 2:  # relu(g)^2
        tl.store(out + offs, (ga * 2.0 * tl.maximum(g, 0.0)).to(gh_ptr.dtype.element_ty), mask=ok)
    else:
        u = tl.load(row + I + offs, mask=ok, other=0.0).to(tl.float32)
        if ACT == 0:  # silu(g) * u
            s = tl.sigmoid(g)
            dg = ga * u * s * (1.0 + g * (1.0 - s))
            du = ga * g * s
        else:  # g' sigmoid(alpha g') (u' + beta), g' = min(g, limit), u' = clamp(u, -limit, limit)
            gc = g
            uc = u
            if HAS_LIMIT:
                gc = tl.minimum(g, limit)
                uc = tl.minimum(tl.maximum(u, -limit), limit)
            s = tl.sigmoid(alpha * gc)
            dg = ga * (uc + beta) * (s + alpha * gc * s * (1.0 - s))
            du = ga * gc * s
            if HAS_LIMIT:
                dg = tl.where(g <= limit, dg, 0.0)
                du = tl.where((u >= -limit) & (u <= limit), du, 0.0)
        tl.store(out + offs, dg.to(gh_ptr.dtype.element_ty), mask=ok)
        tl.store(out + I + offs, du.to(gh_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_bwd_kernel(
    gout_ptr,  # [N, H] gradient of the combined output
    y_ptr,  # [n, H] gemm2 output by sorted position (model dtype)
    inv_ptr,  # [N*K] int32 sorted position of entry j
    ids_ptr,  # [N, K] int32 local expert ids (invalid: < 0 or >= num_experts)
    w_ptr,  # [N, K] fp32 routing weights
    gy_ptr,  # [n, H] out: gy[inv[j]] = w[j] * gout[n] (model dtype)
    gw_ptr,  # [N, K] fp32 out: <y[inv[j]], gout[n]> (0 for invalid entries)
    H,
    num_experts,
    stride_gom,
    stride_ym,
    stride_gym,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The backward of grouped_combine_kernel (no bias), one program per entry j = n*K + k (a token's K
    programs run next to each other: its gradient row is read from L2 after the first)."""
    j = tl.program_id(0).to(tl.int64)
    n = j // TOP_K
    e = tl.load(ids_ptr + j)
    valid = (e >= 0) & (e < num_experts)
    lim = tl.where(valid, H, 0)  # an invalid entry reads and writes no row: its gradient is 0
    p = tl.where(valid, tl.load(inv_ptr + j), 0).to(tl.int64)
    wk = tl.load(w_ptr + j)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, lim, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = offs < H
        g = tl.load(gout_ptr + n * stride_gom + offs, mask=m, other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + p * stride_ym + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(gy_ptr + p * stride_gym + offs, (wk * g).to(gy_ptr.dtype.element_ty), mask=m)
        acc += g * yv
    tl.store(gw_ptr + j, tl.sum(acc, axis=0))


# --------------------------------------------------------------------------- routing alignment
# `epmoe.experts.triton.align` on the GPU: the same outputs bit for bit (stable order by expert, invalid
# entries last), no atomics, no host sync, fixed shapes. Program e of a grid over experts (plus one
# for the invalid bin, key num_experts) scans the entries in j order.


@triton.jit
def _align_keys(ids_ptr, offs, NK, num_experts):
    ok = offs < NK
    e = tl.load(ids_ptr + offs, mask=ok, other=-1)
    key = tl.where((e >= 0) & (e < num_experts), e, num_experts)
    return key, ok


@triton.jit
def align_count_kernel(
    ids_ptr,  # [N*K] int32 local expert ids (invalid: < 0 or >= num_experts)
    counts_ptr,  # [num_experts + 1] int32 out: entries per expert, then invalid entries
    NK,
    num_experts,
    CHUNK: tl.constexpr,
):
    e = tl.program_id(0)
    cnt = tl.zeros((CHUNK,), dtype=tl.int32)
    for start in range(0, NK, CHUNK):
        key, ok = _align_keys(ids_ptr, start + tl.arange(0, CHUNK), NK, num_experts)
        cnt += ((key == e) & ok).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(cnt, axis=0))


@triton.jit
def align_plan_kernel(
    counts_ptr,  # [num_experts + 1] int32
    starts_ptr,  # [num_experts + 1] int32 out: first padded row of each expert; [E] = all padded rows
    ends_ptr,  # [num_experts] int32 out: cumulative (unpadded) counts
    block_expert_ptr,  # [max_blocks] int32 out (-1 unused)
    block_rows_ptr,  # [max_blocks] int32 out (0 unused)
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 out (WITH_PAD): NK in each tile's padding rows
    num_experts,
    max_blocks,
    NK,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two > num_experts
    NB: tl.constexpr,  # blocks per step
    BLOCKS_PER_PROGRAM: tl.constexpr,  # tiles per program (a multiple of NB; the grid covers max_blocks)
    WITH_PAD: tl.constexpr = False,
    BM_PAD: tl.constexpr = 1,  # WITH_PAD: power of two >= BLOCK_M
):
    """Each program plans BLOCKS_PER_PROGRAM tiles from the counts (the prefix sums over the experts are
    recomputed per program: E_PAD values); program 0 also writes starts / ends."""
    eidx = tl.arange(0, E_PAD)
    emask = eidx < num_experts
    cnt = tl.load(counts_ptr + eidx, mask=emask, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(starts_ptr + eidx, pad_start, mask=emask)
        tl.store(ends_ptr + eidx, tl.cumsum(cnt, axis=0), mask=emask)
        tl.store(starts_ptr + num_experts, tl.sum(padded, axis=0))
    b_lo = pid * BLOCKS_PER_PROGRAM
    b_hi = tl.minimum(b_lo + BLOCKS_PER_PROGRAM, max_blocks)
    _align_tiles(cnt, pad_start, pad_end, eidx, emask, block_expert_ptr, block_rows_ptr, sorted_ids_ptr,
                 num_experts, max_blocks, NK, BLOCK_M, NB, WITH_PAD, BM_PAD, b_lo, b_hi)


@triton.jit
def _align_tiles(cnt, pad_start, pad_end, eidx, emask, block_expert_ptr, block_rows_ptr, sorted_ids_ptr,
                 num_experts, max_blocks, NK, BLOCK_M: tl.constexpr, NB: tl.constexpr, WITH_PAD: tl.constexpr,
                 BM_PAD: tl.constexpr, b_lo, b_hi):
    """Tiles [b_lo, b_hi) of the tile list from the per-expert counts and padded segments (b_hi - b_lo a
    multiple of NB, or b_hi = max_blocks); WITH_PAD: also NK into every padding row of the tiles (the real
    rows are the scatter's)."""
    pad_end_m = tl.where(emask, pad_end, 2147483647)
    for b0 in range(b_lo, b_hi, NB):
        b = b0 + tl.arange(0, NB)
        first = b * BLOCK_M
        # tile b belongs to the first expert whose padded segment ends after its first row
        be = tl.sum((pad_end_m[None, :] <= first[:, None]).to(tl.int32), axis=1)
        used = be < num_experts
        hit = eidx[None, :] == be[:, None]
        c_be = tl.sum(tl.where(hit, cnt[None, :], 0), axis=1)
        s_be = tl.sum(tl.where(hit, pad_start[None, :], 0), axis=1)
        rows = tl.where(used, tl.minimum(tl.maximum(c_be - (first - s_be), 0), BLOCK_M), 0)
        bok = b < max_blocks
        tl.store(block_expert_ptr + b, tl.where(used, be, -1), mask=bok)
        tl.store(block_rows_ptr + b, rows, mask=bok)
        if WITH_PAD:
            r = tl.arange(0, BM_PAD)
            pad = (r[None, :] >= rows[:, None]) & (r[None, :] < BLOCK_M) & bok[:, None]
            tl.store(sorted_ids_ptr + first[:, None] + r[None, :], tl.zeros([NB, BM_PAD], tl.int32) + NK, mask=pad)


@triton.jit
def tail_tiles_kernel(
    block_expert_ptr,  # [max_blocks] int32 (-1 unused)
    block_rows_ptr,  # [max_blocks] int32 real rows of each tile
    big_expert_ptr,  # [max_blocks] int32 out: block_expert with the small tiles -1
    tail_expert_ptr,  # [num_experts * TAIL_ROWS // SUB_M] int32 out (-1 unused)
    tail_row0_ptr,  # [same] int32 out: first padded row of each sub-tile (0 unused)
    tail_rows_ptr,  # [same] int32 out: real rows of each sub-tile (0 unused)
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    TAIL_ROWS: tl.constexpr,  # tiles with 1..TAIL_ROWS real rows are small (< BLOCK_M: an expert's last)
    SUB_M: tl.constexpr,  # rows per sub-tile (TAIL_ROWS % SUB_M == 0)
    E_PAD: tl.constexpr,  # power of two >= num_experts
    NB: tl.constexpr,  # tiles per step
):
    """`align.split_tail_tiles` in one program: each expert's small tile (at most one: its last) found
    over the tile list, then listed as TAIL_ROWS // SUB_M sub-tiles per expert (expert-major)."""
    eidx = tl.arange(0, E_PAD)
    emask = eidx < num_experts
    tail_b = tl.full([E_PAD], -1, tl.int32)
    tail_n = tl.zeros([E_PAD], tl.int32)
    for b0 in range(0, max_blocks, NB):
        b = b0 + tl.arange(0, NB)
        bok = b < max_blocks
        be = tl.load(block_expert_ptr + b, mask=bok, other=-1)
        rows = tl.load(block_rows_ptr + b, mask=bok, other=0)
        small = (be >= 0) & (rows <= TAIL_ROWS)
        tl.store(big_expert_ptr + b, tl.where(small, -1, be), mask=bok)
        hit = (eidx[None, :] == be[:, None]) & small[:, None]
        tail_b = tl.maximum(tail_b, tl.max(tl.where(hit, b[:, None], -1), axis=0))
        tail_n = tl.maximum(tail_n, tl.max(tl.where(hit, rows[:, None], 0), axis=0))
    NSUB: tl.constexpr = TAIL_ROWS // SUB_M
    for i in tl.static_range(NSUB):
        n = tail_n - i * SUB_M
        ok = (tail_b >= 0) & (n > 0)
        slot = eidx * NSUB + i
        tl.store(tail_expert_ptr + slot, tl.where(ok, eidx, -1), mask=emask)
        tl.store(tail_row0_ptr + slot, tl.where(ok, tail_b * BLOCK_M + i * SUB_M, 0), mask=emask)
        tl.store(tail_rows_ptr + slot, tl.where(ok, tl.minimum(n, SUB_M), 0), mask=emask)


@triton.jit
def align_small_kernel(
    ids_ptr,  # [N*K] int32 local expert ids (invalid: < 0 or >= num_experts)
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [max_blocks] int32 out (-1 unused)
    block_rows_ptr,  # [max_blocks] int32 out (0 unused)
    scratch_ptr,  # [3 * E_PAD] int32 scratch: per-expert values read back by sorted entry
    NK,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two > num_experts (histogram bins; bin num_experts: invalid)
    N_PAD: tl.constexpr,  # power of two >= NK: every entry in registers at once
    LOG_N: tl.constexpr,  # log2(N_PAD)
    RB: tl.constexpr,  # padding rows per step ([E_PAD, RB])
    TB: tl.constexpr,  # tiles / rows per fill step
):
    """count + plan + scatter (+ the padding rows) in ONE program for up to N_PAD entries (decode):
    the outputs of align_count / align_plan / align_scatter (and the fill of sorted_ids) bit for bit
    (`align_small`; `epmoe.routing_kernels.route_align_kernel` runs it after the routing)."""
    align_small(ids_ptr, sorted_ids_ptr, block_expert_ptr, block_rows_ptr, scratch_ptr, NK, num_experts, max_blocks,
                BLOCK_M, E_PAD, N_PAD, LOG_N, RB, TB)


@triton.jit
def align_small(ids_ptr, sorted_ids_ptr, block_expert_ptr, block_rows_ptr, scratch_ptr, NK, num_experts, max_blocks,
                BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr, LOG_N: tl.constexpr,
                RB: tl.constexpr, TB: tl.constexpr):
    """The body of align_small_kernel (arguments as there), for one program. Counts: a histogram of the
    keys. Order: one sort of (key, j) pairs (key * N_PAD + j, unique), so the sorted position of an
    entry minus its expert's first position is its rank among that expert's entries in j order; each
    tile's expert and real rows come from the entry at its first row."""
    offs = tl.arange(0, N_PAD)
    key, ok = _align_keys(ids_ptr, offs, NK, num_experts)  # past NK: key num_experts (invalid)
    eidx = tl.arange(0, E_PAD)
    emask = eidx < num_experts
    cnt = tl.where(emask, tl.histogram(key, E_PAD), 0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    first = tl.cumsum(cnt, axis=0) - cnt  # each expert's first sorted position
    tl.store(scratch_ptr + eidx, first)
    tl.store(scratch_ptr + E_PAD + eidx, pad_start)
    tl.store(scratch_ptr + 2 * E_PAD + eidx, cnt)
    # padding rows of each expert's last tile
    for r0 in tl.static_range(0, BLOCK_M, RB):
        r = r0 + tl.arange(0, RB)
        tl.store(sorted_ids_ptr + (pad_start + cnt)[:, None] + r[None, :], tl.zeros([E_PAD, RB], tl.int32) + NK,
                 mask=r[None, :] < (padded - cnt)[:, None])
    # unused tiles and their rows
    total = tl.sum(padded, axis=0)
    for t0 in range(0, max_blocks, TB):
        t = t0 + tl.arange(0, TB)
        unused = (t >= total // BLOCK_M) & (t < max_blocks)
        tl.store(block_expert_ptr + t, tl.zeros([TB], tl.int32) - 1, mask=unused)
        tl.store(block_rows_ptr + t, tl.zeros([TB], tl.int32), mask=unused)
    for q0 in range(0, max_blocks * BLOCK_M, TB):
        q = q0 + tl.arange(0, TB)
        tl.store(sorted_ids_ptr + q, tl.zeros([TB], tl.int32) + NK, mask=(q >= total) & (q < max_blocks * BLOCK_M))
    tl.debug_barrier()  # the scratch stores are seen by every thread below
    srt = tl.sort(key * N_PAD + offs)
    e = srt >> LOG_N
    j = srt & (N_PAD - 1)
    valid = e < num_experts
    ec = tl.where(valid, e, 0)
    rank = offs - tl.load(scratch_ptr + ec, mask=valid, other=0)
    row = tl.load(scratch_ptr + E_PAD + ec, mask=valid, other=0) + rank
    tl.store(sorted_ids_ptr + row, j, mask=valid)
    head = valid & (rank % BLOCK_M == 0)  # the first row of a tile
    c = tl.load(scratch_ptr + 2 * E_PAD + ec, mask=head, other=0)
    tl.store(block_expert_ptr + row // BLOCK_M, e, mask=head)
    tl.store(block_rows_ptr + row // BLOCK_M, tl.minimum(c - rank, BLOCK_M), mask=head)


@triton.jit
def align_scatter_kernel(
    ids_ptr,  # [N*K] int32
    starts_ptr,  # [num_experts + 1] int32 from align_plan_kernel
    sorted_ids_ptr,  # out: entry j at padded row starts[e] + rank (rank = order among e's entries)
    sorted_expert_ptr,  # out (WITH_EXPERT): key of each written row
    inv_ptr,  # out (WITH_INV): [N*K] int32 row of each entry j (the inverse permutation)
    NK,
    num_experts,
    CHUNK: tl.constexpr,
    WITH_INVALID: tl.constexpr,  # also place the invalid entries (after every expert's rows)
    WITH_EXPERT: tl.constexpr,
    WITH_INV: tl.constexpr,
):
    e = tl.program_id(0)
    if (e < num_experts) | WITH_INVALID:
        _place_key(ids_ptr, e, tl.load(starts_ptr + e), sorted_ids_ptr, sorted_expert_ptr, inv_ptr, NK, num_experts,
                   CHUNK, WITH_EXPERT, WITH_INV)


@triton.jit
def _place_key(ids_ptr, e, base, sorted_ids_ptr, sorted_expert_ptr, inv_ptr, NK, num_experts, CHUNK: tl.constexpr,
               WITH_EXPERT: tl.constexpr, WITH_INV: tl.constexpr):
    """Write the entries j of key e in j order from sorted position base on: sorted_ids[pos] = j (and
    the key, and inv[j] = pos)."""
    for start in range(0, NK, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        key, ok = _align_keys(ids_ptr, offs, NK, num_experts)
        m = ((key == e) & ok).to(tl.int32)
        pos = base + tl.cumsum(m, axis=0) - 1
        tl.store(sorted_ids_ptr + pos, offs, mask=m > 0)
        if WITH_EXPERT:
            tl.store(sorted_expert_ptr + pos, key, mask=m > 0)
        if WITH_INV:
            tl.store(inv_ptr + offs, pos, mask=m > 0)
        base += tl.sum(m, axis=0)


@triton.jit
def align_sort_kernel(
    ids_ptr,  # [N*K] int32 local expert ids (invalid: < 0 or >= num_experts)
    counts_ptr,  # [num_experts] int32 out: entries per expert
    ends_ptr,  # [num_experts] int32 out: cumulative counts (expert e owns sorted positions [ends[e-1], ends[e]))
    order_ptr,  # [N*K] int32 out: entry j of each sorted position
    sorted_expert_ptr,  # [N*K] int32 out: key of each sorted position (num_experts: invalid)
    inv_ptr,  # [N*K] int32 out: sorted position of each entry j
    NK,
    num_experts,
    CHUNK: tl.constexpr,
):
    """`sort_by_expert` (align_count + align_plan + align_scatter with block_m 1) in ONE launch of
    num_experts + 1 programs, bit for bit: program e (the last one: the invalid entries) counts the
    entries of smaller keys (its first sorted position) and of its own key in one scan, then places its
    entries in j order in a second scan (the scans of align_count and align_scatter; no plan step)."""
    e = tl.program_id(0)
    below = tl.zeros((CHUNK,), dtype=tl.int32)
    mine = tl.zeros((CHUNK,), dtype=tl.int32)
    for start in range(0, NK, CHUNK):
        key, ok = _align_keys(ids_ptr, start + tl.arange(0, CHUNK), NK, num_experts)
        below += ((key < e) & ok).to(tl.int32)
        mine += ((key == e) & ok).to(tl.int32)
    base = tl.sum(below, axis=0)
    if e < num_experts:
        cnt = tl.sum(mine, axis=0)
        tl.store(counts_ptr + e, cnt)
        tl.store(ends_ptr + e, base + cnt)
    _place_key(ids_ptr, e, base, order_ptr, sorted_expert_ptr, inv_ptr, NK, num_experts, CHUNK, True, True)
