"""W4A16 GEMMs in Gluon (Triton's explicit-layout dialect): the dequantized fp4 weights are the
tensor-core operand in registers. Decode tiles (`w4a16_swap_kernel`, mma.sync): fp4 bytes from global
memory straight into the operand registers, no shared memory. Prefill tiles (`w4a16_wgmma_kernel`,
wgmma; its section below): weights, scales and routed rows through a cp.async ring.

Imported only when the `triton` experts backend runs an nvfp4 / mxfp4 tile of these kernels on an
NVIDIA GPU (the Triton interpreter cannot run Gluon; there the Triton kernels of `triton_kernels.py`
run).

Why: the Triton kernels dequantize the weights in a blocked layout, store the bf16 values to shared
memory and read them back in the MMA layout, and Triton picks a k-width of 4 for an operand that
comes from bytes, which costs register moves around every mma. At decode (~8 rows per expert) that
made W4A16 instruction-bound (~6 SASS instructions per weight value) at 30-43 % of the HBM limit.

Swap-AB: per expert, out^T [weight rows, tokens] = W [rows, K] @ X^T [K, tokens]; the weights are the
A operand of mma.sync m16n8k16 (rows = M), the <= 16 routed rows of the tile are N.

K order. The MMA's result does not depend on which logical K each of its k positions holds, as long
as A and B agree. Thread (lane 4g + t) holds A's k positions 2t, 2t+1, 2t+8, 2t+9 (+16 per k16
repetition), i.e. k = 8c + 2t + b (c = 0..3, b = 0..1) over a 32-wide half block. We give k position
8c + 2t + b the logical K 8t + 2c + b, so each thread's 8 K values are 8 consecutive bytes of the
k64-interleaved weights (`kernel_formats.interleave_fp4_k64`: byte j = K j, j + 32) and 8 consecutive
bf16 of the token row: one 8-byte load per weight row, one 16-byte load per token row and half.
The loads are 3D tensors [rows, 4 (t), 8 (q = 2c + b)] in a linear layout whose lanes and warps are
those of the MMA operand; reshape / permute to [rows, 32] then only renames registers
(`convert_layout(..., assert_trivial=True)` checks it at compile time).

Scales: logical K 8t + 2c + b of the low half is in nvfp4 group 4kk + t // 2 (+ 2 for the high half),
mxfp4 group 2kk (high half 2kk + 1), so each thread needs one scale per row and half: it takes both
from the row's scale word of the K step (nvfp4 4 bytes, mxfp4 2; the decode kernel loads two steps'
words at once), which every lane of the row loads, and turns the pair into two bf16 factors with 2^126
folded in by two PTX instructions (`_SCALE_PAIR_*_ASM`): one byte permute puts the two scale bytes in
the two 16-bit halves of a word, then one integer multiply-add: mxfp4 bf16 bits (e + 126) << 7 =
2^(e-1), nvfp4 code * 16 + (229 << 7) = s * 2^112 (the 2^14 left goes on the global scale). nvfp4
scales are stored as codes for it (`kernel_formats.encode_nvfp4_scales`: every scale a normal number
whose exponent and mantissa are the code's bits), after `kernel_formats.normalize_nvfp4_scales` made
them >= +0 with the weights of zero scales zero (exactly: a negative scale's weights change sign).
The e2m1 -> bf16 bits are `triton_kernels._E2M1_BF16_ASM` (value * 2^-126), or with WORDS (convert
mode "words": weights bit-permuted per 4-byte word at load) `_E2M1_BF16_WORDS_ASM`, the same bits;
times the bf16 scale factors above, as the packed conversion (power-of-two factors: the same products,
the same sums bit for bit).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from epmoe.experts.triton.kernel_formats import NV_SCALE_CODE_BIAS
from epmoe.experts.triton.triton_kernels import _E2M1_BF16_ASM, _E2M1_BF16_WORDS_ASM

# The bf16 factors of a K step's two scales of a thread's row (low half, high half), with 2^126 folded in:
# $2 the step's scale word, $3 a byte-permute selector whose low two nibbles pick the two scale bytes
# (upper two: 4, the zero byte of the second prmt operand), then one multiply-add per pair. nvfp4: the
# scales are codes (`kernel_formats.encode_nvfp4_scales`, at load): a scale 2^E * (1 + m/8) > 0 is the
# byte ((E + 10) << 3) | m, so code * 16 + (229 << 7) is the bf16 with exponent field E + 239 and
# mantissa m: s * 2^112 (E <= 8: <= 247, finite), e4m3's subnormal scales included; code 0 (a +0 scale)
# gives 2^102 (finite: the weights of zero scales are +0, `kernel_formats.normalize_nvfp4_scales`).
# mxfp4: e8m0 byte e -> (e + 126) << 7 = e * 128 + 0x3F00 per half (e <= 128, checked at load). Neither
# carries between the halves (nvfp4 codes <= 151).
def _scale_pair_asm(mul: int, add: int) -> str:
    """The PTX of a scale pair: permute the two scale bytes into the word's 16-bit halves, then
    bf16 bits = byte * mul + add per half (`add` given for one half)."""
    return "\n".join(["{", ".reg .b32 p;", "prmt.b32 p, $2, 0, $3;",
                      f"mad.lo.u32 p, p, {mul}, 0x{add * 0x10001:08X};", "mov.b32 {$0, $1}, p;", "}"])


# nvfp4: code * 16 puts the code's exponent bits at the bf16 exponent's low bits; exponent field E + 239
_SCALE_PAIR_NV_ASM = gl.constexpr(_scale_pair_asm(16, (239 - NV_SCALE_CODE_BIAS) << 7))
_SCALE_PAIR_MX_ASM = gl.constexpr(_scale_pair_asm(128, 126 << 7))
NV_SCALE_EPILOGUE = gl.constexpr(2.0**14)  # nvfp4: the power of two the scale factors leave (s * 2^112 * 2^-126)


@gluon.constexpr_function
def _mma_layout(num_warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _operand3_layout(rows, reg_rows, warp_rows, warps):
    """[rows, 4 (t), 8 (q)]: lane 4g + t holds row g and its t's 8 consecutive values (registers q),
    plus the rows of `reg_rows` (register bases) and `warp_rows` (warp bases, 0 = every warp the same)."""
    reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4]] + [[r, 0, 0] for r in reg_rows]
    assert len(warp_rows) == warps.bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=reg,
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[r, 0, 0] for r in warp_rows],
        block_bases=[],
        shape=[rows, 4, 8],
    )


@gluon.constexpr_function
def _w3_layout(BN, num_warps):
    """[BN rows, 4 (t), 8 (q)] bytes: lane 4g + t holds rows g (+8, + 16 * warps * rep) and its t's 8
    bytes; warps stack 16-row groups (the mma's warps_per_cta [num_warps, 1])."""
    reps = [16 * num_warps * (1 << i) for i in range(max(0, (BN // (16 * num_warps)).bit_length() - 1))]
    warp_rows = [16 * (1 << i) for i in range(num_warps.bit_length() - 1)]
    return _operand3_layout(BN, [8] + reps, warp_rows, num_warps)


@gluon.constexpr_function
def _x3_layout(BM, num_warps):
    """[BM tokens, 4 (t), 8 (q)] bf16: lane 4g + t holds tokens g (+8) and its t's 8 values; every warp
    holds the same (B is shared by the warps of the M dimension)."""
    return _operand3_layout(BM, [8] if BM == 16 else [], [0] * (num_warps.bit_length() - 1), num_warps)


@gluon.jit
def _to_a(w3, BN: gl.constexpr, A_LAYOUT: gl.constexpr):
    """[BN, 4 (t), 8 (q = 2c + b)] -> [BN, 32] at k positions 8c + 2t + b (register renaming only)."""
    w = gl.reshape(w3, [BN, 4, 4, 2])
    w = gl.permute(w, [0, 2, 1, 3])
    w = gl.reshape(w, [BN, 32])
    return gl.convert_layout(w, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _to_b(x3, BM: gl.constexpr, B_LAYOUT: gl.constexpr):
    """[BM, 4 (t), 8 (q = 2c + b)] -> [32, BM] at k positions 8c + 2t + b (register renaming only)."""
    x = gl.reshape(x3, [BM, 4, 4, 2])
    x = gl.permute(x, [2, 1, 3, 0])
    x = gl.reshape(x, [32, BM])
    return gl.convert_layout(x, B_LAYOUT, assert_trivial=True)


@gluon.jit
def _scale_words(s_ptrs, kk, W_FMT: gl.constexpr, PAIR: gl.constexpr, PAIR_WORDS: gl.constexpr):
    """The scale words (int32) of K step kk, and of kk + 1 with PAIR (kk even): one load per row for
    both (every lane of a row reads the same word). nvfp4: 4 bytes per step (int32; a pair int64),
    mxfp4: 2 bytes per step (int16; a pair int32). The scales come in K-step pairs
    (`kernel_formats.pair_fp4_scales`), PAIR_WORDS of s_ptrs' words from one pair to the next."""
    if PAIR:
        w = gl.load(s_ptrs + (kk // 2) * PAIR_WORDS)
        if W_FMT == 2:
            w0 = w.to(gl.int32)
            w1 = (w >> 32).to(gl.int32)
        else:
            w0 = w & 0xFFFF
            w1 = (w >> 16) & 0xFFFF
    else:
        w0 = gl.load(s_ptrs + ((kk // 2) * PAIR_WORDS + kk % 2)).to(gl.int32)
        w1 = w0
    return w0, w1


@gluon.jit
def _step_scales(w, sel, W_FMT: gl.constexpr):
    """bf16 scale factors (low half, high half) [BN, 4] from a step's scale word (int32); sel: the
    thread's byte selector (`_scale_selectors`)."""
    ASM: gl.constexpr = _SCALE_PAIR_NV_ASM if W_FMT == 2 else _SCALE_PAIR_MX_ASM
    lo, hi = gl.inline_asm_elementwise(ASM, "=h,=h,r,r", [w, sel], dtype=(gl.bfloat16, gl.bfloat16),
                                       is_pure=True, pack=1)
    return lo, hi


@gluon.jit
def _scale_selectors(ts, W_FMT: gl.constexpr):
    """Byte selectors of `_step_scales` for lanes t = ts: the low / high half's scale byte (nvfp4 bytes
    t // 2 and 2 + t // 2 of the step's 4, mxfp4 bytes 0 and 1 of its 2) into bytes 0 and 2 of the
    permuted word, zeros (byte 4) into bytes 1 and 3: one scale per 16-bit half."""
    if W_FMT == 2:
        return (ts // 2) | ((ts // 2 + 2) << 8) | 0x4040
    else:
        return ts * 0 + 0x4140


@gluon.jit
def _loads(x_ptrs, g_ptrs, u_ptrs, kk, gw, uw, sel, W_FMT: gl.constexpr, GATED: gl.constexpr,
           WSTEP: gl.constexpr = 32):
    """Everything K step kk reads: token halves [BM, 4, 8], weight bytes [BN, 4, 8] and, from the
    step's scale words gw / uw (`_scale_words`), the scale factors [BN, 4] (low / high half) of gate
    (and up).
    WSTEP: bytes from one K step of a weight row to the next (32; 256 in row tiles)."""
    xo = kk * 64
    wo = kk * WSTEP
    xl = gl.load(x_ptrs + xo)
    xh = gl.load(x_ptrs + (xo + 32))
    gb = gl.load(g_ptrs + wo)
    gsl, gsh = _step_scales(gw, sel, W_FMT)
    if GATED:
        ub = gl.load(u_ptrs + wo)
        usl, ush = _step_scales(uw, sel, W_FMT)
    else:
        ub = gb
        usl = gsl
        ush = gsh
    return xl, xh, gb, gsl, gsh, ub, usl, ush


@gluon.jit
def _step(acc_g, acc_u, xl, xh, gb, gsl, gsh, ub, usl, ush, W_FMT: gl.constexpr, GATED: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr,
          WORDS: gl.constexpr = False):
    """One K step of 64: both halves of gate (and up) against the token halves."""
    x_lo = _to_b(xl, BLOCK_M, B_L)
    x_hi = _to_b(xh, BLOCK_M, B_L)
    w_lo, w_hi = _dequant3(gb, gl.expand_dims(gsl, 2), gl.expand_dims(gsh, 2), WORDS)
    acc_g = mma_v2(_to_a(w_lo, BLOCK_N, A_L), x_lo, acc_g)
    acc_g = mma_v2(_to_a(w_hi, BLOCK_N, A_L), x_hi, acc_g)
    if GATED:
        v_lo, v_hi = _dequant3(ub, gl.expand_dims(usl, 2), gl.expand_dims(ush, 2), WORDS)
        acc_u = mma_v2(_to_a(v_lo, BLOCK_N, A_L), x_lo, acc_u)
        acc_u = mma_v2(_to_a(v_hi, BLOCK_N, A_L), x_hi, acc_u)
    return acc_g, acc_u


@gluon.jit
def _dequant3(p3, f_lo, f_hi, WORDS: gl.constexpr = False):
    """bytes [BN, 4, 8] + per (row, t) bf16 scale factors [BN, 4, 1] (`_step_scales`) -> bf16 (lo, hi)
    [BN, 4, 8]. WORDS: the bytes are bit-permuted words (convert mode "words"); each conversion call
    takes 4 of a thread's 8 contiguous bytes, i.e. one aligned word."""
    ASM: gl.constexpr = _E2M1_BF16_WORDS_ASM if WORDS else _E2M1_BF16_ASM
    lo, hi = gl.inline_asm_elementwise(
        ASM, "=r,=r,=r,=r,r", [p3], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4
    )
    return lo * f_lo, hi * f_hi


@gluon.constexpr_function
def _fp4_step_bytes(tiled):
    """Bytes from one K step of an fp4 weight row to the next: 32, or 256 in row tiles (`_fp4_row_offsets`)."""
    return 256 if tiled else 32


@gluon.jit
def _fp4_row_offsets(rows, stride_wn, TILED: gl.constexpr):
    """Byte offsets (int64) of K step 0 of fp4 weight rows within their expert: rows * K/2, or in row
    tiles (`kernel_formats.tile_fp4_rows`) (rows // 8) * 8 * K/2 + (rows % 8) * 32, K steps 256 bytes
    apart (the Triton kernels' `triton_kernels._fp4_row_offsets`)."""
    if TILED:
        return (rows // 8).to(gl.int64) * (8 * stride_wn) + (rows % 8) * 32
    else:
        return rows.to(gl.int64) * stride_wn


@gluon.jit
def _program_tile(block_expert_ptr, N_OUT, BLOCK_N: gl.constexpr):
    """(routed-row tile, output block, expert of the tile: -1 unused) of this program; programs go
    output block fastest, BLOCK_N outputs each."""
    num_n = N_OUT // BLOCK_N
    pid = gl.program_id(0)
    pid_m = pid // num_n
    return pid_m, pid % num_n, gl.load(block_expert_ptr + pid_m)


@gluon.jit
def _tile_tokens(sorted_ids_ptr, row0, num_entries, BLOCK_M: gl.constexpr, TOP_K: gl.constexpr,
                 GEMM1: gl.constexpr, LAYOUT: gl.constexpr):
    """Rows (int64) of the B operand for the BLOCK_M padded rows from row0 on: gemm1 the tokens of their
    routed entries (padding reads token 0), gemm2 the padded rows of the activation themselves."""
    offs = row0 + gl.arange(0, BLOCK_M, layout=LAYOUT)
    if GEMM1:
        ids = gl.load(sorted_ids_ptr + offs)
        rows = gl.where(ids < num_entries, ids // TOP_K, 0).to(gl.int64)
    else:
        rows = offs.to(gl.int64)
    return rows


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))  # what tl.sigmoid computes


@gluon.jit
def _act(g, u, alpha, beta, limit, ACT: gl.constexpr, HAS_LIMIT: gl.constexpr):
    if ACT == 0:
        r = g * _sigmoid(g) * u
    elif ACT == 1:
        if HAS_LIMIT:
            g = gl.minimum(g, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
        r = g * _sigmoid(alpha * g) * (u + beta)
    else:
        p = gl.maximum(g, 0.0)
        r = p * p
    return r


@gluon.jit(do_not_specialize=["num_entries", "max_blocks"])
def w4a16_swap_kernel(
    x_ptr,  # gemm1: [N, H] tokens (bf16); gemm2: [P, I] activations of gemm1 (rows = padded positions)
    w_ptr,  # [E, R, K/2] uint8 k64-interleaved (gemm1 R = 2I gate then up, or I; gemm2 R = H)
    ws_ptr,  # [E, R, K/group] e4m3 (nvfp4) / e8m0 (mxfp4)
    wg_ptr,  # nvfp4 [E, G] fp32 global scales
    b_ptr,  # [E, R] fp32 bias
    out_ptr,  # gemm1: [P, I] bf16 activation; gemm2: [num_entries, H] bf16 y by entry
    topk_w_ptr,  # gemm2: [num_entries] fp32 routing weights
    sorted_ids_ptr,  # [P] int32 entry of each padded row (>= num_entries: padding)
    block_expert_ptr,  # [max_blocks] int32 (-1: unused tile)
    block_rows_ptr,  # [max_blocks] int32 real rows of each tile (SPLIT_M)
    block_row0_ptr,  # ROW_TABLE: [max_blocks] int32 first padded row of each tile (else unread)
    num_entries,
    max_blocks,
    stride_xm,
    stride_we,
    stride_wse,
    stride_wge,
    stride_be,
    stride_om,
    alpha,
    beta,
    limit,
    GEMM1: gl.constexpr,
    TOP_K: gl.constexpr,
    W_FMT: gl.constexpr,  # 2 nvfp4, 3 mxfp4
    GATED: gl.constexpr,
    ACT: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr,  # routed rows per tile: 8 or 16 (the mma's N)
    BLOCK_N: gl.constexpr,  # weight rows per program (per projection)
    UNROLL: gl.constexpr,  # K steps per loop iteration: 1, 2 or 4 (dividing K // 64)
    # the shape as constants (a model has two per kernel: gemm1 and gemm2): every load's address in a K
    # step is its row's plus a constant, no 64-bit pointer arithmetic per row and step (sm90: 342 -> 319
    # instructions per two K steps of gemm1's half tiles, nvfp4; H200 decode T = 128: 1.080 / 1.081 ms
    # against 1.097 nvfp4, 1.019 / 1.019 against 1.040 mxfp4, same run)
    N_OUT: gl.constexpr,  # weight rows per projection: gemm1 I, gemm2 H
    K: gl.constexpr,  # reduction: gemm1 H, gemm2 I
    stride_wn: gl.constexpr,  # K / 2 (contiguous weight rows)
    stride_wsn: gl.constexpr,  # bytes from one row's scales to the next (scale pairs: 8 nvfp4, 4 mxfp4)
    stride_wsp: gl.constexpr,  # bytes from one K-step pair of a row's scales to the next (`kernel_formats.pair_fp4_scales`)
    WORDS: gl.constexpr = False,  # bit-permuted weight words (convert mode "words", `_dequant3`)
    SPLIT_M: gl.constexpr = False,  # a tile with <= BLOCK_M / 2 real rows runs BLOCK_M / 2 of them
    TILED: gl.constexpr = False,  # weights in row tiles (`kernel_formats.tile_fp4_rows`, option triton_fp4_layout=tiles)
    # tiles at the rows block_row0_ptr lists instead of pid_m * BLOCK_M (`align.TailTiles`: a prefill
    # alignment's small tiles, which the wgmma kernel leaves to this one)
    ROW_TABLE: gl.constexpr = False,
):
    pid_m, pid_n, expert = _program_tile(block_expert_ptr, N_OUT, BLOCK_N)
    row0 = pid_m * BLOCK_M
    if ROW_TABLE:
        row0 = gl.load(block_row0_ptr + pid_m)
    if expert >= 0:
        # SPLIT_M: a tile with <= BLOCK_M / 2 real rows (at decode sizes most experts' only tile) loads and
        # multiplies the token rows of its first half only; the weights are read and converted once either way
        half = False
        if SPLIT_M:  # (a constexpr branch: without SPLIT_M no half-tile code is generated)
            half = gl.load(block_rows_ptr + pid_m) <= BLOCK_M // 2
            if half:
                _swap_tile(x_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, expert.to(gl.int64),
                           row0, pid_n, num_entries, N_OUT, K, stride_xm, stride_we, stride_wn, stride_wse,
                           stride_wsn, stride_wsp, stride_wge, stride_be, stride_om, alpha, beta, limit, GEMM1, TOP_K, W_FMT,
                           GATED, ACT, HAS_LIMIT, HAS_BIAS, BLOCK_M // 2, BLOCK_N, UNROLL, WORDS, TILED)
        if not half:
            _swap_tile(x_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, expert.to(gl.int64),
                       row0, pid_n, num_entries, N_OUT, K, stride_xm, stride_we, stride_wn, stride_wse,
                       stride_wsn, stride_wsp, stride_wge, stride_be, stride_om, alpha, beta, limit, GEMM1, TOP_K, W_FMT, GATED,
                       ACT, HAS_LIMIT, HAS_BIAS, BLOCK_M, BLOCK_N, UNROLL, WORDS, TILED)


@gluon.jit
def _swap_tile(x_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, e64, row0, pid_n,
               num_entries, N_OUT, K, stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsp, stride_wge,
               stride_be, stride_om, alpha, beta, limit,
               GEMM1: gl.constexpr, TOP_K: gl.constexpr, W_FMT: gl.constexpr, GATED: gl.constexpr,
               ACT: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, UNROLL: gl.constexpr, WORDS: gl.constexpr, TILED: gl.constexpr):
    """The padded rows [row0, row0 + BLOCK_M) x program pid_n's BLOCK_N outputs, of expert e64."""
    num_warps: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = _mma_layout(num_warps)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    W3: gl.constexpr = _w3_layout(BLOCK_N, num_warps)
    X3: gl.constexpr = _x3_layout(BLOCK_M, num_warps)
    S2: gl.constexpr = gl.SliceLayout(2, W3)  # [BN, 4] scales per (row, t)

    # token rows of this tile, in the layout of the X3 row axis
    xrow = _tile_tokens(sorted_ids_ptr, row0, num_entries, BLOCK_M, TOP_K, GEMM1,
                        gl.SliceLayout(1, gl.SliceLayout(2, X3)))
    t3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3)))
    q3 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
    x_ptrs = (x_ptr + xrow[:, None, None] * stride_xm + (t3 * 8)[None, :, None] + q3[None, None, :])

    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, W3)))
    tw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, W3)))
    qw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, W3)))
    w_base = w_ptr + e64 * stride_we
    WSTEP: gl.constexpr = _fp4_step_bytes(TILED)  # row tiles: the 8 rows of a warp load and one K step contiguous
    g_ptrs = w_base + _fp4_row_offsets(rows, stride_wn, TILED)[:, None, None] + (tw * 8)[None, :, None] + qw[None, None, :]
    u_ptrs = g_ptrs + N_OUT * stride_wn  # (N_OUT % 8 == 0: whole tiles)
    rs = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    ts = gl.arange(0, 4, layout=gl.SliceLayout(0, S2))
    s_rows = ws_ptr + e64 * stride_wse + rs.to(gl.int64)[:, None] * stride_wsn + (ts * 0)[None, :]
    # scale words (a K step's groups of a row: nvfp4 4 bytes, mxfp4 2) and the bytes of t's groups in
    # them: nvfp4 group 4kk + t // 2 (low half), + 2 (high half); mxfp4 2kk (low), 2kk + 1 (high)
    PAIR: gl.constexpr = UNROLL >= 2  # one scale load per row for two K steps
    if W_FMT == 2:
        WORD: gl.constexpr = 8 if PAIR else 4  # bytes per scale word
    else:
        WORD: gl.constexpr = 4 if PAIR else 2
    s_sel = _scale_selectors(ts, W_FMT)[None, :] + (rs * 0)[:, None]
    WTYPE: gl.constexpr = gl.int64 if WORD == 8 else (gl.int32 if WORD == 4 else gl.int16)
    sg_ptrs = s_rows.to(gl.pointer_type(WTYPE), bitcast=True)
    su_ptrs = sg_ptrs + N_OUT * stride_wsn // WORD
    PAIR_WORDS: gl.constexpr = stride_wsp // WORD

    acc_g = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    acc_u = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    num_k = K // 64
    # UNROLL K steps per iteration: all their loads are issued before any of their math (bytes in
    # flight per warp; a loop-carried prefetch would keep each loaded byte in its own register)
    for kk in range(0, num_k, UNROLL):
        ga, gb_ = _scale_words(sg_ptrs, kk, W_FMT, PAIR, PAIR_WORDS)
        ua, ub_ = _scale_words(su_ptrs, kk, W_FMT, PAIR, PAIR_WORDS) if GATED else (ga, gb_)
        a_xl, a_xh, a_gb, a_gsl, a_gsh, a_ub, a_usl, a_ush = _loads(
            x_ptrs, g_ptrs, u_ptrs, kk, ga, ua, s_sel, W_FMT, GATED, WSTEP)
        if UNROLL >= 2:
            b_xl, b_xh, b_gb, b_gsl, b_gsh, b_ub, b_usl, b_ush = _loads(
                x_ptrs, g_ptrs, u_ptrs, kk + 1, gb_, ub_, s_sel, W_FMT, GATED, WSTEP)
        if UNROLL == 4:
            gc, gd = _scale_words(sg_ptrs, kk + 2, W_FMT, PAIR, PAIR_WORDS)
            uc, ud = _scale_words(su_ptrs, kk + 2, W_FMT, PAIR, PAIR_WORDS) if GATED else (gc, gd)
            c_xl, c_xh, c_gb, c_gsl, c_gsh, c_ub, c_usl, c_ush = _loads(
                x_ptrs, g_ptrs, u_ptrs, kk + 2, gc, uc, s_sel, W_FMT, GATED, WSTEP)
            d_xl, d_xh, d_gb, d_gsl, d_gsh, d_ub, d_usl, d_ush = _loads(
                x_ptrs, g_ptrs, u_ptrs, kk + 3, gd, ud, s_sel, W_FMT, GATED, WSTEP)
        acc_g, acc_u = _step(acc_g, acc_u, a_xl, a_xh, a_gb, a_gsl, a_gsh, a_ub, a_usl, a_ush,
                             W_FMT, GATED, BLOCK_M, BLOCK_N, A_L, B_L, WORDS)
        if UNROLL >= 2:
            acc_g, acc_u = _step(acc_g, acc_u, b_xl, b_xh, b_gb, b_gsl, b_gsh, b_ub, b_usl, b_ush,
                                 W_FMT, GATED, BLOCK_M, BLOCK_N, A_L, B_L, WORDS)
        if UNROLL == 4:
            acc_g, acc_u = _step(acc_g, acc_u, c_xl, c_xh, c_gb, c_gsl, c_gsh, c_ub, c_usl, c_ush,
                                 W_FMT, GATED, BLOCK_M, BLOCK_N, A_L, B_L, WORDS)
            acc_g, acc_u = _step(acc_g, acc_u, d_xl, d_xh, d_gb, d_gsl, d_gsh, d_ub, d_usl, d_ush,
                                 W_FMT, GATED, BLOCK_M, BLOCK_N, A_L, B_L, WORDS)

    _epilogue(acc_g, acc_u, e64, row0, pid_n, wg_ptr, b_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr,
              num_entries, N_OUT, stride_wge, stride_be, stride_om, alpha, beta, limit,
              GEMM1, W_FMT, GATED, ACT, HAS_LIMIT, HAS_BIAS, BLOCK_M, BLOCK_N, MMA)


@gluon.jit
def _permuted_k(n):
    """Where natural K index n sits in the wgmma kernel's K order: within each 32-wide group, index 8t + 2c + b
    goes to position 8c + 2t + b (the k position at which the wgmma kernel's A fragment holds the
    thread's natural weight byte; `permute_k` does the same to a tensor)."""
    return (n & ~31) | (n & 1) | (((n >> 3) & 3) << 1) | (((n >> 1) & 3) << 3)


def permute_k(x):
    """[..., K] -> the same values in the K order of the wgmma kernel (`_permuted_k`), a copy."""
    shape = x.shape
    return x.reshape(*shape[:-1], shape[-1] // 32, 4, 4, 2).transpose(-3, -2).reshape(shape)


@gluon.jit
def _epilogue(acc_g, acc_u, e64, row0, pid_n, wg_ptr, b_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, num_entries,
              N_OUT, stride_wge, stride_be, stride_om, alpha, beta, limit,
              GEMM1: gl.constexpr, W_FMT: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
              HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              MMA: gl.constexpr, K_PERM: gl.constexpr = False):
    # epilogue in the accumulator layout: rows n (weight rows), columns p (the BLOCK_M padded rows from row0)
    n_acc = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    offs_p = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    if W_FMT == 2:
        # the scale factors leave 2^-14 in the weights (`_step_scales`)
        acc_g = acc_g * (gl.load(wg_ptr + e64 * stride_wge) * NV_SCALE_EPILOGUE)
        if GATED:
            acc_u = acc_u * (gl.load(wg_ptr + e64 * stride_wge + 1) * NV_SCALE_EPILOGUE)
    if HAS_BIAS:
        acc_g += gl.load(b_ptr + e64 * stride_be + n_acc)[:, None]
        if GATED:
            acc_u += gl.load(b_ptr + e64 * stride_be + N_OUT + n_acc)[:, None]
    if GEMM1:
        act = _act(acc_g, acc_u, alpha, beta, limit, ACT, HAS_LIMIT)
        n_out = _permuted_k(n_acc) if K_PERM else n_acc  # the wgmma kernel's gemm2 reads act in the permuted K order
        o_ptrs = out_ptr + offs_p.to(gl.int64)[None, :] * stride_om + n_out[:, None]
        gl.store(o_ptrs, act.to(out_ptr.dtype.element_ty))
    else:
        ids = gl.load(sorted_ids_ptr + offs_p)
        row_ok = ids < num_entries
        ids64 = gl.where(row_ok, ids, 0).to(gl.int64)
        rw = gl.load(topk_w_ptr + ids64, mask=row_ok, other=0.0)
        y = acc_g * rw[None, :]
        y_ptrs = out_ptr + ids64[None, :] * stride_om + n_acc[:, None]
        gl.store(y_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & (n_acc < N_OUT)[:, None])


# --------------------------------------------------------------------------- prefill: wgmma
# Tiles of 64 or 128 routed rows run warpgroup MMAs (wgmma), swap-AB as above: the weights are the A
# operand, dequantized into registers (wgmma reads A from registers), the routed rows the B operand.
# One cp.async ring (STAGES K steps deep) brings the gathered token rows, the weight bytes and (SCALE_RING,
# the default) each row's scale pair of the step into shared memory; the scales are stored in K-step
# pairs (`kernel_formats.pair_fp4_scales`: a step's pairs of the tile's rows contiguous; row-major
# scales, one 32-byte sector per row and step, were 5.3 % / 2.8 % slower nvfp4 / mxfp4), and through the
# ring instead of a global load one K step ahead they were 3.6 % / 5.2 % faster (T = 4096, H200,
# 2026-12-03, the same output bit for bit). A program's MMA tile has 16 * num_warps * 2^i weight rows; gated
# (gemm1): its first half are gate rows, its second half the up rows of the same outputs, joined in the
# epilogue through shared memory (one accumulator). Each K step's wgmmas are issued before the next
# step's weights are read from the ring and dequantized; with PENDING they stay in flight meanwhile.
#
# K order: the decode kernel's. Each thread reads its 8 contiguous weight bytes of a row (one 8-byte
# shared load), which hold A's k positions 8c + 2t + b for logical K 8t + 2c + b; the hardware reads
# the token tile from shared memory in k order, so gemm1's tokens are copied with their K permuted
# the same way (`permute_k`) and gemm1's epilogue writes act in that order for gemm2 (`_permuted_k`).
# (The natural K order, two-byte shared loads and their byte assembly: 763 instead of 604 loop
# instructions, 3-8 % slower; removed after 2026-12-02.)
#
# H200, T = 4096 (2026-12-02, words conversion, PENDING, the auto preset): 8.5-8.7 / 8.1-8.2 ms nvfp4 /
# mxfp4, against the Triton kernels' 10.2-10.6; measurements, profiles and next steps in
# docs/hopper-experts.md.


@gluon.constexpr_function
def _wgmma_layout(num_warps, BM):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 16])


@gluon.jit
def _ring_copy(ring, ptrs, kk, num_k, STAGES: gl.constexpr, TILED: gl.constexpr = False,
               SCALE_RING: gl.constexpr = False):
    """cp.async everything K step kk reads from the ring into its stage (nothing past K): the token
    tile (two 32-wide halves), the weight bytes (TILED: row tiles, K steps 256 bytes apart) and, with
    SCALE_RING, each row's scale pair of the step (its K-step pair, `kernel_formats.pair_fp4_scales`);
    one commit group."""
    x_lo, x_hi, w_s, s_s = ring
    x_ptrs, cols, w_ptrs, wcols, sc_ptrs = ptrs
    s = kk % STAGES
    ok = (cols * 0 + kk) < num_k
    async_copy.async_copy_global_to_shared(x_lo.index(s), x_ptrs + kk * 64, mask=ok[None, :])
    async_copy.async_copy_global_to_shared(x_hi.index(s), x_ptrs + (kk * 64 + 32), mask=ok[None, :])
    okw = (wcols * 0 + kk) < num_k
    async_copy.async_copy_global_to_shared(w_s.index(s), w_ptrs + kk * _fp4_step_bytes(TILED), mask=okw[None, :])
    if SCALE_RING:
        row_ptrs, zeros, pair_elems = sc_ptrs
        async_copy.async_copy_global_to_shared(s_s.index(s), row_ptrs + (kk // 2) * pair_elems, mask=(zeros + kk) < num_k)
    async_copy.commit_group()


@gluon.jit
def _scale_word(sr_ptrs, kk, num_k):
    """K step kk's scale words [R, 4] (int32; past K: the last step's, unused): half kk % 2 of K-step pair
    kk // 2 (`kernel_formats.pair_fp4_scales`; sr_ptrs: (word pointers of pair 0, selectors, words from
    one pair to the next))."""
    w_ptrs, _, pair_words = sr_ptrs
    k = gl.minimum(kk, num_k - 1)
    return gl.load(w_ptrs + ((k // 2) * pair_words + k % 2)).to(gl.int32)


@gluon.jit
def _ring_operands(ring, sr_ptrs, kk, num_k, word, STAGES: gl.constexpr, W_FMT: gl.constexpr, R: gl.constexpr,
                   WN: gl.constexpr, A_L: gl.constexpr, WORDS: gl.constexpr = False, SCALE_RING: gl.constexpr = False):
    """The A operands of K step kk: each thread's 8 contiguous weight bytes of a row from the ring stage
    (WN: `_w3_layout`) and its scales: with SCALE_RING from its rows' scale pairs in the same stage (`word`
    unread), else from the row's scale word `word` (loaded one step ahead; sr_ptrs: (scale-word pointers
    [R, 4], bit offsets of the thread's low-half group)). -> (operands, step kk + 1's scale words; with
    SCALE_RING this step's, unread): a scale word from global memory used in the step it is loaded in
    stalls the warp for the whole load."""
    x_lo, x_hi, w_s, s_s = ring
    s = kk % STAGES
    _, sel, _ = sr_ptrs
    if SCALE_RING:  # the step's scale pairs from the ring stage; the half of step kk
        pair = s_s.index(s).load(gl.SliceLayout(1, gl.SliceLayout(2, WN)))
        if W_FMT == 2:
            half = (pair >> ((kk % 2) * 32)).to(gl.int32)
        else:
            half = (pair >> ((kk % 2) * 16)) & 0xFFFF
        word = gl.expand_dims(half, 1) + sel * 0
        nxt = word
    else:
        nxt = _scale_word(sr_ptrs, kk + 1, num_k)
    b3 = w_s.index(s).reshape([R, 4, 8]).load(WN)
    f_lo, f_hi = _step_scales(word, sel, W_FMT)
    lo, hi = _dequant3(b3, gl.expand_dims(f_lo, 2), gl.expand_dims(f_hi, 2), WORDS)
    return _to_a(lo, R, A_L), _to_a(hi, R, A_L), nxt


@gluon.jit
def _wgmma_step(acc, a_lo, a_hi, word, kk, num_k, ring, ptrs, sr_ptrs, STAGES: gl.constexpr, W_FMT: gl.constexpr,
                R: gl.constexpr, WN: gl.constexpr, A_L: gl.constexpr, WORDS: gl.constexpr = False,
                PENDING: gl.constexpr = False, TILED: gl.constexpr = False, SCALE_RING: gl.constexpr = False):
    """K step kk: its wgmmas (operands a_lo / a_hi) run while step kk + 1's operands are dequantized
    from the ring (word: step kk + 1's scale words). -> step kk + 1's operands and step kk + 2's scale
    words. Without PENDING the step ends waiting for its wgmmas; with PENDING (the order of CUTLASS's
    mainloops) it leaves them in flight and waits, after issuing them, for step kk - 1's only."""
    if not PENDING:
        _ring_refill(ring, ptrs, kk, num_k, STAGES, TILED, SCALE_RING)
    x_lo, x_hi, w_s, s_s = ring
    s = kk % STAGES
    acc = warpgroup_mma(a_lo, x_lo.index(s).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(a_hi, x_hi.index(s).permute((1, 0)), acc, is_async=True)
    if PENDING:
        acc, a_lo, a_hi = warpgroup_mma_wait(2, deps=[acc, a_lo, a_hi])  # two groups: step kk's
        _ring_refill(ring, ptrs, kk, num_k, STAGES, TILED, SCALE_RING)
    n_lo, n_hi, word = _ring_operands(ring, sr_ptrs, kk + 1, num_k, word, STAGES, W_FMT, R, WN, A_L, WORDS,
                                      SCALE_RING)
    if not PENDING:
        acc, a_lo, a_hi = warpgroup_mma_wait(0, deps=[acc, a_lo, a_hi])
    return acc, n_lo, n_hi, word


@gluon.jit
def _ring_refill(ring, ptrs, kk, num_k, STAGES: gl.constexpr, TILED: gl.constexpr = False,
                 SCALE_RING: gl.constexpr = False):
    """In K step kk, once this warpgroup is done with step kk - 1's wgmmas: steps <= kk + 1 have landed
    (for every thread) and every warpgroup is done with step kk - 1 and with the weights of step kk
    (the barrier), so step kk - 1's stage takes the copies of step kk + STAGES - 1."""
    async_copy.wait_group(STAGES - 3)
    fence_async_shared()
    gl.thread_barrier()
    _ring_copy(ring, ptrs, kk + STAGES - 1, num_k, STAGES, TILED, SCALE_RING)


@gluon.jit
def _tile_rows(pid_n, N_OUT, R: gl.constexpr, BLOCK_N: gl.constexpr, GATED: gl.constexpr, LAYOUT: gl.constexpr):
    """Weight rows (int64) of program pid_n's MMA tile: BLOCK_N rows from pid_n * BLOCK_N on; gated, the
    gate rows and then the up rows of the same outputs (N_OUT rows later)."""
    r = gl.arange(0, R, layout=LAYOUT)
    if GATED:
        rows = pid_n * BLOCK_N + (r % BLOCK_N) + (r // BLOCK_N) * N_OUT
    else:
        rows = pid_n * BLOCK_N + r
    return rows.to(gl.int64)


@gluon.jit(do_not_specialize=["num_entries", "max_blocks"])
def w4a16_wgmma_kernel(
    x_ptr, w_ptr, ws_ptr, wg_ptr, b_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, block_expert_ptr,
    num_entries, max_blocks, N_OUT, K,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsp, stride_wge, stride_be, stride_om,
    alpha, beta, limit,
    GEMM1: gl.constexpr, TOP_K: gl.constexpr, W_FMT: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
    HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr,  # routed rows per tile: 64 or 128 (the wgmma's N)
    BLOCK_N: gl.constexpr,  # outputs per program (MMA tile rows R: BLOCK_N, gated 2 * BLOCK_N; 16 * num_warps * 2^i)
    STAGES: gl.constexpr,  # K steps in flight (cp.async ring: tokens, weights); >= 3
    WORDS: gl.constexpr = False,  # bit-permuted weight words (convert mode "words", `_dequant3`)
    PENDING: gl.constexpr = False,  # each K step's wgmmas stay in flight while the next step's operands are made
    TILED: gl.constexpr = False,  # weights in row tiles (`kernel_formats.tile_fp4_rows`)
    # the rows' scale pairs of each K step through the cp.async ring with the weights (one 8 / 4-byte copy per
    # row and step: nvfp4 / mxfp4), read from shared memory where they are used; else loaded from global
    # memory one K step ahead into registers
    SCALE_RING: gl.constexpr = False,
):
    """`w4a16_swap_kernel`'s arguments and results (see there), for tiles of 64 / 128 routed rows; x's
    K in the order of `permute_k` for gemm1 (gemm2 reads the act gemm1 wrote in it)."""
    num_warps: gl.constexpr = gl.num_warps()
    R: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N  # MMA tile rows (gated: BLOCK_N gate rows, then up rows)
    gl.static_assert(R % (16 * num_warps) == 0)
    gl.static_assert(STAGES >= 3)
    MMA: gl.constexpr = _wgmma_layout(num_warps, BLOCK_M)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WN: gl.constexpr = _w3_layout(R, num_warps)  # [R, 4, 8] weight bytes of a K step, 8 contiguous per thread
    S2: gl.constexpr = gl.SliceLayout(2, WN)  # [R, 4 (t)] scales
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])  # [BLOCK_M, 32] token halves
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    WC: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [num_warps, 1], [1, 0])  # [R, 32] weight bytes
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    pid_m, pid_n, expert = _program_tile(block_expert_ptr, N_OUT, BLOCK_N)
    if expert >= 0:
        e64 = expert.to(gl.int64)
        row0 = pid_m * BLOCK_M
        xrow = _tile_tokens(sorted_ids_ptr, row0, num_entries, BLOCK_M, TOP_K, GEMM1, gl.SliceLayout(1, XL))
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, XL))
        x_ptrs = x_ptr + xrow[:, None] * stride_xm + cols[None, :]

        wrow = _tile_rows(pid_n, N_OUT, R, BLOCK_N, GATED, gl.SliceLayout(1, WC))
        wcols = gl.arange(0, 32, layout=gl.SliceLayout(0, WC))
        w_ptrs = w_ptr + e64 * stride_we + _fp4_row_offsets(wrow, stride_wn, TILED)[:, None] + wcols[None, :]
        # a K step's scale word per row (nvfp4 4 bytes, mxfp4 2), read by every lane of the row; the rows'
        # words of a K step sit stride_wsn bytes apart (scale pairs, `kernel_formats.pair_fp4_scales`)
        srow3 = _tile_rows(pid_n, N_OUT, R, BLOCK_N, GATED, gl.SliceLayout(1, S2))
        ts = gl.arange(0, 4, layout=gl.SliceLayout(0, S2))
        s_rows = ws_ptr + e64 * stride_wse + srow3[:, None] * stride_wsn + (ts * 0)[None, :]
        WTYPE: gl.constexpr = gl.int32 if W_FMT == 2 else gl.int16
        sr_ptrs = (s_rows.to(gl.pointer_type(WTYPE), bitcast=True),
                   _scale_selectors(ts, W_FMT)[None, :] + (srow3 * 0).to(gl.int32)[:, None],
                   stride_wsp // (4 if W_FMT == 2 else 2))

        x_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 32], XS)
        x_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 32], XS)
        w_s = gl.allocate_shared_memory(gl.uint8, [STAGES, R, 32], PLAIN)
        if SCALE_RING:
            PTYPE: gl.constexpr = gl.int64 if W_FMT == 2 else gl.int32  # a row's scale pair (two K steps)
            SC: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            s_s = gl.allocate_shared_memory(PTYPE, [STAGES, R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            crow = _tile_rows(pid_n, N_OUT, R, BLOCK_N, GATED, SC)
            sc_ptrs = ((ws_ptr + e64 * stride_wse + crow * stride_wsn).to(gl.pointer_type(PTYPE), bitcast=True),
                       (crow * 0).to(gl.int32), stride_wsp // (8 if W_FMT == 2 else 4))
        else:
            s_s = w_s
            sc_ptrs = (x_ptrs, 0, 0)
        ring = (x_lo, x_hi, w_s, s_s)
        ptrs = (x_ptrs, cols, w_ptrs, wcols, sc_ptrs)

        num_k = K // 64
        for i in gl.static_range(STAGES - 1):
            _ring_copy(ring, ptrs, i, num_k, STAGES, TILED, SCALE_RING)
        async_copy.wait_group(STAGES - 2)
        if PENDING:  # step 0's wgmmas read the ring before any step's fence
            fence_async_shared()
        gl.thread_barrier()
        acc = gl.zeros([R, BLOCK_M], gl.float32, MMA)
        word0 = sr_ptrs[1] if SCALE_RING else _scale_word(sr_ptrs, 0, num_k)  # (with SCALE_RING: unread)
        a_lo, a_hi, word = _ring_operands(ring, sr_ptrs, 0, num_k, word0, STAGES, W_FMT, R, WN, A_L, WORDS, SCALE_RING)
        # two K steps per iteration, so that the operands of the step in flight and of the next one can
        # live in different registers (sm90 SASS: ptxas does so with PENDING; without it, it copies the
        # loop-carried operands and waits for the wgmmas before one of the two conversions)
        for kk in range(0, num_k - 1, 2):
            acc, a_lo, a_hi, word = _wgmma_step(acc, a_lo, a_hi, word, kk, num_k, ring, ptrs, sr_ptrs, STAGES,
                                                W_FMT, R, WN, A_L, WORDS, PENDING, TILED, SCALE_RING)
            acc, a_lo, a_hi, word = _wgmma_step(acc, a_lo, a_hi, word, kk + 1, num_k, ring, ptrs, sr_ptrs, STAGES,
                                                W_FMT, R, WN, A_L, WORDS, PENDING, TILED, SCALE_RING)
        if num_k % 2:
            acc, a_lo, a_hi, word = _wgmma_step(acc, a_lo, a_hi, word, num_k - 1, num_k, ring, ptrs, sr_ptrs,
                                                STAGES, W_FMT, R, WN, A_L, WORDS, PENDING, TILED, SCALE_RING)
        if PENDING:
            acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)

        if GATED:
            _gated_epilogue(acc, e64, row0, pid_n, wg_ptr, b_ptr, out_ptr, N_OUT, stride_wge, stride_be, stride_om,
                            alpha, beta, limit, W_FMT, ACT, HAS_LIMIT, HAS_BIAS, BLOCK_M, BLOCK_N, R, num_warps)
        else:
            _epilogue(acc, acc, e64, row0, pid_n, wg_ptr, b_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, num_entries,
                      N_OUT, stride_wge, stride_be, stride_om, alpha, beta, limit,
                      GEMM1, W_FMT, False, ACT, HAS_LIMIT, HAS_BIAS, BLOCK_M, BLOCK_N, MMA, True)


@gluon.jit
def _gated_epilogue(acc, e64, row0, pid_n, wg_ptr, b_ptr, out_ptr, N_OUT, stride_wge, stride_be, stride_om,
                    alpha, beta, limit, W_FMT: gl.constexpr, ACT: gl.constexpr, HAS_LIMIT: gl.constexpr,
                    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, R: gl.constexpr,
                    num_warps: gl.constexpr):
    """acc [gate rows; up rows] x [tile rows] -> act [tile rows, BLOCK_N outputs] (through shared memory:
    gate and up of one output live in different warpgroups), at act's K positions for gemm2
    (`_permuted_k`)."""
    EL: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, num_warps], [0, 1])  # [BN, BM], n fastest
    ES: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    buf = gl.allocate_shared_memory(gl.float32, [R, BLOCK_M], ES)
    buf.store(acc)
    gl.thread_barrier()
    g = buf.slice(0, BLOCK_N, dim=0).load(EL)
    u = buf.slice(BLOCK_N, BLOCK_N, dim=0).load(EL)
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, EL))
    p = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, EL))
    if W_FMT == 2:
        # the scale factors leave 2^-14 in the weights (`_step_scales`)
        g = g * (gl.load(wg_ptr + e64 * stride_wge) * NV_SCALE_EPILOGUE)
        u = u * (gl.load(wg_ptr + e64 * stride_wge + 1) * NV_SCALE_EPILOGUE)
    if HAS_BIAS:
        g += gl.load(b_ptr + e64 * stride_be + n)[:, None]
        u += gl.load(b_ptr + e64 * stride_be + N_OUT + n)[:, None]
    act = _act(g, u, alpha, beta, limit, ACT, HAS_LIMIT)
    n_out = _permuted_k(n)  # gemm2 reads act in the permuted K order
    gl.store(out_ptr + p.to(gl.int64)[None, :] * stride_om + n_out[:, None], act.to(out_ptr.dtype.element_ty))
