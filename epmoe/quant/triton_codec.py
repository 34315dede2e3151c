"""Triton kernels for the activation payload codec: NVFP4, FP8 1x128 and MXFP8 quantize / dequantize,
bit-exact with the torch reference (`epmoe.quant.nvfp4` recipe "rn", `fp8_block.*_activation`,
`mxfp8` scale_rounding "floor").

Imported lazily by `epmoe.quant.codec` (this module imports triton at the top; importing `epmoe`
never imports it). The torch reference launches ~20-40 elementwise kernels per call (~1.5-2 ms for
[4096, 7168] on an H200); here NVFP4 is two launches (a tensor amax pass, then one fused
quantize pass; one launch when the global scale is given), FP8 / MXFP8 one, each dequantize one.

    quantize_nvfp4(x [..., H], global_scale=None)       -> nvfp4.NVFP4Tensor (linear scales)
    quantize_fp8_block(x [..., H])                      -> fp8_block.FP8BlockTensor (1x128 groups)
    quantize_mxfp8(x [..., H])                          -> mxfp8.MXFP8Tensor (floor scales)
    dequantize_nvfp4(packed, scales, global_scale, dtype)
    dequantize_fp8_block(data, scales, dtype)
    dequantize_mxfp8(data, scales, dtype)

Inputs bf16 / fp16 / fp32 on CUDA (CPU tensors only under TRITON_INTERPRET=1); outputs bf16 / fp16 /
fp32. No host synchronisation: the NVFP4 global scale 448*6/amax is computed on the device (a
partial-amax kernel, then every quantize program reduces the <= 256 partials itself), so the calls
are CUDA-graph capturable.

How bit-exactness is guaranteed (the reference is a chain of IEEE float32 round-to-nearest-even torch
ops; every step here is the same operation, in the same order):
  * every float32 multiply, divide and add that can round is `mul.rn` / `div.rn` / `add.rn.f32` PTX:
    Triton's `/` is an approximate division, its `tl.math.div_rn` goes through libdevice with
    flush-to-zero enabled, and a plain `*` next to an add may be contracted into an FMA; explicit
    `.rn` instructions keep IEEE rounding and subnormals. Under the interpreter the same helpers use
    numpy's float32 multiply / divide / add (IEEE).
  * float32 -> E4M3 is torch's own integer algorithm (c10 `fp8e4m3fn_from_fp32_value`: round to
    nearest even, subnormals kept, overflow saturates to 0x7E, NaN -> 0x7F | sign) written with
    integer ops, so the interpreter and the GPU agree by construction; E2M1 rounds on the bits too
    (nearest, ties to even, saturating); E4M3 / E2M1 / E8M0 are decoded from bits.
  * block maxima are integer maxima of |x|'s bit patterns: exact, order-independent, and they
    propagate NaN the way torch's amax does (a NaN's bits exceed +inf's).
  * bf16 inputs are read as raw 16-bit words and widened by a shift (exact); fp16 / fp32 by the exact
    widening cast. Outputs: bf16 / fp16 through the hardware `cvt.rn` (the instruction torch's CUDA
    casts use); under the interpreter (whose fp32 -> bf16 cast truncates) an explicit integer
    round-to-nearest-even (= torch's CPU cast, NaN -> 0x7FC0).

Special values (the reference's policy, docs/formats.md): zeros, E4M3 subnormal scales, saturation
and +-inf give the same bytes as the reference. NaN poisons its block exactly as in the reference
(NVFP4: scale 0x7F, codes 0; FP8: NaN scale, NaN data; MXFP8: scale code 255); only the sign bit of a
NaN *result* can differ from the torch CPU reference, as torch CUDA's own does (the GPU returns the
canonical positive NaN), so NaN outputs are compared as "is NaN", not bytewise. A negative NVFP4
global scale (meaningless) follows torch >= 2.13's saturating E4M3 cast.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from epmoe.quant import fp8_block, mxfp8, nvfp4
from epmoe.quant._common import check_dequant_dtype, check_quantize_input

# The interpreter cannot run inline PTX; it runs the numpy (IEEE) form of the same operations.
# triton.jit reads TRITON_INTERPRET when a kernel is decorated, i.e. when this module is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_PTX = not INTERPRET

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_IN_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

NVFP4_BLOCKS_PER_PROGRAM = 256  # 16-value blocks per program: 4096 values
FP8_GROUPS_PER_PROGRAM = 32  # 128-value groups: 4096 values
MXFP8_BLOCKS_PER_PROGRAM = 128  # 32-value blocks: 4096 values
AMAX_TILE = 8192  # values per iteration of the partial-amax kernel (32 per thread in flight)
MAX_PARTIALS = 256  # partial maxima each NVFP4 quantize program reduces for the global scale


# ------------------------------------------------------------------ exact scalar helpers
@triton.jit
def _mul_rn(a, b, PTX: tl.constexpr):
    """IEEE float32 a * b, round to nearest even, subnormals kept (never fused into an FMA)."""
    if PTX:
        r = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        r = a * b
    return r


@triton.jit
def _div_rn(a, b, PTX: tl.constexpr):
    """IEEE float32 a / b, round to nearest even, subnormals kept (Triton's `/` is approximate)."""
    if PTX:
        r = tl.inline_asm_elementwise(
            "div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        r = tl.math.div_rn(a, b)
    return r


@triton.jit
def _add_rn(a, b, PTX: tl.constexpr):
    """IEEE float32 a + b, round to nearest even (never fused with a multiply)."""
    if PTX:
        r = tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        r = a + b
    return r


@triton.jit
def _load_f32(ptr, mask, IN_KIND: tl.constexpr):
    """Load values as float32, exactly. IN_KIND 0: float32; 1: bf16 passed as int16 words; 2: fp16."""
    if IN_KIND == 1:
        w = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        v = (w << 16).to(tl.float32, bitcast=True)  # bf16 is the top half of a float32
    else:
        v = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _abs_bits(v):
    """int32 bit pattern of |v| (v float32): ordered like |v|, NaN above +inf."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _e4m3_code(f, PTX: tl.constexpr):
    """float32 -> float8_e4m3fn byte (int32 0..255), torch's c10 `fp8e4m3fn_from_fp32_value`:
    round to nearest even, subnormals kept, |f| >= 480 saturates to 0x7E, NaN -> 0x7F | sign."""
    b = f.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # normal results (|f| >= 2^-6): torch's rounding-bias trick on the bits
    norm = ((a + (0x7FFFF - (120 << 23)) + ((a >> 20) & 1)) >> 20) & 0xFF
    norm = tl.where(norm == 0x7F, 0x7E, norm)
    # subnormal results: torch adds 2^14 (float32 ulp 2^-9 there: the add rounds |f| to a multiple of
    # 2^-9, nearest even) and keeps the low bits; exact for any |f| < 2^-6, and flushing a float32
    # subnormal |f| would not change the sum
    big = _add_rn(a.to(tl.float32, bitcast=True), tl.full(f.shape, 16384.0, tl.float32), PTX)
    sub = big.to(tl.int32, bitcast=True) - (141 << 23)
    r = tl.where(a < (121 << 23), sub, norm)
    r = tl.where(a >= 0x43F00000, tl.where(a > 0x7F800000, 0x7F, 0x7E), r)
    return r | sign


@triton.jit
def _e4m3_value(c):
    """float8_e4m3fn byte (int32 0..255) -> float32, exact (0x7F / 0xFF -> NaN)."""
    mag = c & 0x7F
    e = mag >> 3
    m = mag & 7
    normal = ((e + 120) << 23) | (m << 20)
    # subnormal m * 2^-9: the bits of float(m) with the exponent lowered by 9 (0 stays 0)
    sub = tl.where(m > 0, m.to(tl.float32).to(tl.int32, bitcast=True) - (9 << 23), 0)
    bits = tl.where(e > 0, normal, sub)
    bits = tl.where(mag == 0x7F, 0x7FC00000, bits)
    return (bits | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_code(v):
    """float32 -> E2M1 code (int32 0..15): nearest, ties to even, |v| > 6 -> 6, sign bit kept,
    NaN -> 0 (`epmoe.quant.e2m1.float_to_e2m1_codes`), with integer ops on the bits."""
    b = v.to(tl.int32, bitcast=True)
    a = b & 0x7FFFFFFF
    # |v| >= 1: round the float32 to one mantissa bit (nearest, ties to even: the bf16 trick at bit
    # 22); exponent|mantissa then counts E2M1 codes upwards from 1.0 = code 2 (0x3F800000 >> 22 = 254)
    big = tl.minimum(((a + 0x1FFFFF + ((a >> 22) & 1)) >> 22) - 252, 7)
    # |v| < 1: steps of 0.5; the ties 0.25 -> 0 and 0.75 -> 1.0 go to the even code
    small = tl.where(a > 0x3E800000, 1, 0) + tl.where(a >= 0x3F400000, 1, 0)
    code = tl.where(a >= 0x3F800000, big, small) | ((b >> 28) & 8)
    return tl.where(a > 0x7F800000, 0, code)


@triton.jit
def _e2m1_value(c):
    """E2M1 code (int32 0..15) -> float32 (0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.0), exact."""
    mag = c & 7
    bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 0x3F000000, 0))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _to_out(v, OUT_KIND: tl.constexpr, PTX: tl.constexpr):
    """float32 -> the output dtype, round to nearest even (OUT_KIND 0 fp32, 1 bf16, 2 fp16)."""
    if OUT_KIND == 0:
        r = v
    elif OUT_KIND == 1:
        if PTX:
            r = v.to(tl.bfloat16)  # cvt.rn.bf16.f32, as torch's CUDA cast
        else:  # the interpreter truncates this cast: round like torch's CPU cast instead
            b = v.to(tl.int32, bitcast=True)
            h = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            h = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, h)
            r = h.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        r = v.to(tl.float16)
    return r


# ------------------------------------------------------------------ NVFP4
@triton.jit(do_not_specialize=["n_groups", "iters"])
def _absmax_partial_kernel(x_ptr, part_ptr, n_groups, iters, IN_KIND: tl.constexpr, TILE: tl.constexpr):
    """part[pid] = bits of max |x| over this program's grid-stride tiles (int32; NaN wins).
    x is read as n_groups groups of 16 values (H % 16 == 0), so the mask is constant per group and
    the loads vectorise."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([TILE // 16, 16], dtype=tl.int32)
    for i in range(iters):
        grp = (i * nprog + pid).to(tl.int64) * (TILE // 16) + tl.arange(0, TILE // 16)
        v = _load_f32(x_ptr + grp[:, None] * 16 + tl.arange(0, 16)[None, :], (grp < n_groups)[:, None], IN_KIND)
        acc = tl.maximum(acc, _abs_bits(v))
    tl.store(part_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit(do_not_specialize=["gs_stride", "n_partials", "n_blocks", "blocks_per_row"])
def _nvfp4_quant_kernel(
    x_ptr, q_ptr, sf_ptr,
    gs_ptr, gs_stride, gs_out_ptr, part_ptr, n_partials,
    n_blocks, blocks_per_row,
    IN_KIND: tl.constexpr, COMPUTE_GS: tl.constexpr, NPART: tl.constexpr, BLK: tl.constexpr,
    PTX: tl.constexpr,
):  # fmt: skip
    """One program = BLK 16-value blocks of the flattened [rows, H] input (recipe "rn")."""
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BLK + tl.arange(0, BLK)
    bmask = blk < n_blocks
    xf = _load_f32(x_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :], bmask[:, None], IN_KIND)
    amax_bits = tl.max(_abs_bits(xf), axis=1)  # [BLK]
    ones = tl.full([BLK], 1.0, tl.float32)
    if COMPUTE_GS:
        # global_scale = 448 * 6 / amax(|x|), 1 when amax is 0, inf or NaN (nvfp4.compute_global_scale)
        pidx = tl.arange(0, NPART)
        g_bits = tl.max(tl.load(part_ptr + pidx, mask=pidx < n_partials, other=0), axis=0)
        g_bits = tl.where(bmask, g_bits, 0)  # as a [BLK] vector
        ok = (g_bits > 0) & (g_bits < 0x7F800000)
        g_amax = tl.where(ok, g_bits, 0x3F800000).to(tl.float32, bitcast=True)
        gs = tl.where(ok, _div_rn(tl.full([BLK], 2688.0, tl.float32), g_amax, PTX), ones)
        lane = tl.arange(0, BLK)
        tl.store(gs_out_ptr + lane * 0, gs, mask=(lane + pid) == 0)  # lane 0 of program 0 writes it
    else:
        gs = tl.load(gs_ptr + (blk // blocks_per_row) * gs_stride, mask=bmask, other=1.0)
    # sf = e4m3_satfinite(amax * (gs * fl32(1/6))), 0 for an all-zero block
    one_sixth = tl.full([BLK], 0x3E2AAAAB, tl.int32).to(tl.float32, bitcast=True)
    amax = amax_bits.to(tl.float32, bitcast=True)
    sf_f = _mul_rn(amax, _mul_rn(gs, one_sixth, PTX), PTX)
    zero = amax_bits == 0
    sf_f = tl.where(zero, 0.0, sf_f)
    sf_f = tl.where(sf_f > 448.0, 448.0, sf_f)  # clamp(max=448) keeps NaN
    sf_code = _e4m3_code(sf_f, PTX)
    # out_scale = min(1 / (float(sf) * (1 / gs)), FLT_MAX), 0 for an all-zero block
    inv_gs = _div_rn(ones, gs, PTX)
    out_scale = _div_rn(ones, _mul_rn(_e4m3_value(sf_code), inv_gs, PTX), PTX)
    out_scale = tl.where(out_scale > 3.4028234663852886e38, 3.4028234663852886e38, out_scale)
    out_scale = tl.where(zero, 0.0, out_scale)
    v = _mul_rn(xf, tl.broadcast_to(out_scale[:, None], [BLK, 16]), PTX)
    lo, hi = tl.split(tl.reshape(_e2m1_code(v), [BLK, 8, 2]))  # element 2i -> low nibble
    packed = (lo | (hi << 4)).to(tl.uint8)
    tl.store(q_ptr + blk[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=bmask[:, None])
    tl.store(sf_ptr + blk, sf_code.to(tl.uint8), mask=bmask)


@triton.jit(do_not_specialize=["gs_stride", "n_blocks", "blocks_per_row"])
def _nvfp4_dequant_kernel(
    q_ptr, sf_ptr, gs_ptr, gs_stride, out_ptr, n_blocks, blocks_per_row,
    OUT_KIND: tl.constexpr, BLK: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """out = e2m1 * (float(sf) * (1 / gs[row])) per 16-value block (nvfp4.dequantize)."""
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BLK + tl.arange(0, BLK)
    bmask = blk < n_blocks
    gs = tl.load(gs_ptr + (blk // blocks_per_row) * gs_stride, mask=bmask, other=1.0)
    inv_gs = _div_rn(tl.full([BLK], 1.0, tl.float32), gs, PTX)
    sf = tl.load(sf_ptr + blk, mask=bmask, other=0).to(tl.int32)
    block_scale = _mul_rn(_e4m3_value(sf), inv_gs, PTX)
    byte = tl.load(q_ptr + blk[:, None] * 8 + tl.arange(0, 8)[None, :], mask=bmask[:, None], other=0).to(tl.int32)
    vals = tl.reshape(tl.join(_e2m1_value(byte & 15), _e2m1_value(byte >> 4)), [BLK, 16])
    out = _mul_rn(vals, tl.broadcast_to(block_scale[:, None], [BLK, 16]), PTX)
    tl.store(
        out_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :], _to_out(out, OUT_KIND, PTX), mask=bmask[:, None]
    )


# ------------------------------------------------------------------ FP8 1x128
@triton.jit(do_not_specialize=["n_groups"])
def _fp8_block_quant_kernel(
    x_ptr, q_ptr, s_ptr, n_groups, IN_KIND: tl.constexpr, GB: tl.constexpr, PTX: tl.constexpr
):
    """scale = clamp(amax, 1e-10, FLT_MAX) / 448; data = e4m3(clamp(x / scale, -448, 448))."""
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * GB + tl.arange(0, GB)
    gmask = g < n_groups
    offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    xf = _load_f32(x_ptr + offs, gmask[:, None], IN_KIND)
    amax = tl.max(_abs_bits(xf), axis=1).to(tl.float32, bitcast=True)
    eps = tl.full([GB], 0x2EDBE6FF, tl.int32).to(tl.float32, bitcast=True)  # fl32(1e-10)
    amax = tl.where(amax < eps, eps, amax)  # clamp keeps NaN
    amax = tl.where(amax > 3.4028234663852886e38, 3.4028234663852886e38, amax)
    scale = _div_rn(amax, tl.full([GB], 448.0, tl.float32), PTX)
    v = _div_rn(xf, tl.broadcast_to(scale[:, None], [GB, 128]), PTX)
    v = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v))
    tl.store(q_ptr + offs, _e4m3_code(v, PTX).to(tl.uint8), mask=gmask[:, None])
    tl.store(s_ptr + g, scale, mask=gmask)


@triton.jit(do_not_specialize=["n_groups"])
def _fp8_block_dequant_kernel(
    q_ptr, s_ptr, out_ptr, n_groups, OUT_KIND: tl.constexpr, GB: tl.constexpr, PTX: tl.constexpr
):
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * GB + tl.arange(0, GB)
    gmask = g < n_groups
    offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    vals = _e4m3_value(tl.load(q_ptr + offs, mask=gmask[:, None], other=0).to(tl.int32))
    scale = tl.load(s_ptr + g, mask=gmask, other=1.0)
    out = _mul_rn(vals, tl.broadcast_to(scale[:, None], [GB, 128]), PTX)
    tl.store(out_ptr + offs, _to_out(out, OUT_KIND, PTX), mask=gmask[:, None])


# ------------------------------------------------------------------ MXFP8 (floor scales)
@triton.jit
def _e8m0_inverse(code):
    """float32 2^(127 - code) = 1 / 2^(code - 127) for E8M0 codes 0..254 (exact; 254 -> the
    subnormal 2^-127); 255 -> NaN. x * this == x / scale bit for bit: both round the same real."""
    bits = tl.where(code == 254, 0x00400000, (254 - code) << 23)
    return tl.where(code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_value(code):
    """float32 2^(code - 127) (code 0 -> subnormal 2^-127, 255 -> NaN), as `_common.e8m0_to_float`."""
    bits = tl.where(code == 0, 0x00400000, code << 23)
    return tl.where(code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n_blocks"])
def _mxfp8_quant_kernel(
    x_ptr, q_ptr, s_ptr, n_blocks, IN_KIND: tl.constexpr, BLK: tl.constexpr, PTX: tl.constexpr
):
    """code = clamp(floor(log2 amax) - 8 + 127, 0, 254) (0 for amax 0, 254 for inf, 255 for NaN);
    data = e4m3(clamp(x / 2^(code - 127), -448, 448))."""
    pid = tl.program_id(0)
    b = pid.to(tl.int64) * BLK + tl.arange(0, BLK)
    bmask = b < n_blocks
    offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    xf = _load_f32(x_ptr + offs, bmask[:, None], IN_KIND)
    amax_bits = tl.max(_abs_bits(xf), axis=1)
    # floor(log2 a) = biased exponent - 127 for normal a; subnormal a (exponent 0) clamps to code 0
    code = tl.maximum((amax_bits >> 23) - 8, 0)
    code = tl.where(amax_bits == 0x7F800000, 254, code)
    code = tl.where(amax_bits > 0x7F800000, 255, code)
    v = _mul_rn(xf, tl.broadcast_to(_e8m0_inverse(code)[:, None], [BLK, 32]), PTX)
    v = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v))
    tl.store(q_ptr + offs, _e4m3_code(v, PTX).to(tl.uint8), mask=bmask[:, None])
    tl.store(s_ptr + b, code.to(tl.uint8), mask=bmask)


@triton.jit(do_not_specialize=["n_blocks"])
def _mxfp8_dequant_kernel(
    q_ptr, s_ptr, out_ptr, n_blocks, OUT_KIND: tl.constexpr, BLK: tl.constexpr, PTX: tl.constexpr
):
    pid = tl.program_id(0)
    b = pid.to(tl.int64) * BLK + tl.arange(0, BLK)
    bmask = b < n_blocks
    offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    vals = _e4m3_value(tl.load(q_ptr + offs, mask=bmask[:, None], other=0).to(tl.int32))
    scale = _e8m0_value(tl.load(s_ptr + b, mask=bmask, other=127).to(tl.int32))
    out = _mul_rn(vals, tl.broadcast_to(scale[:, None], [BLK, 32]), PTX)
    tl.store(out_ptr + offs, _to_out(out, OUT_KIND, PTX), mask=bmask[:, None])


# ------------------------------------------------------------------ launch helpers
def supports_input(x: torch.Tensor) -> bool:
    """True when these kernels quantize x's dtype (bf16/fp16/fp32; float64 is the reference's only)."""
    return isinstance(x, torch.Tensor) and x.dtype in INPUT_DTYPES


def _check_device(t: torch.Tensor, what: str) -> None:
    if not (t.is_cuda or INTERPRET):
        raise ValueError(
            f"the triton codec needs CUDA tensors, got {what} on {t.device} "
            "(use the torch reference, or set TRITON_INTERPRET=1 before importing triton)"
        )


def _input_words(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Validated, contiguous input as the kernels read it (bf16 as int16 words)."""
    check_quantize_input(x, block, fmt)
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{fmt}: the triton codec quantizes bf16/fp16/fp32, got {x.dtype}; use the torch reference")
    _check_device(x, "x")
    x = x.contiguous()
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _check_out_dtype(dtype: torch.dtype, fmt: str) -> None:
    check_dequant_dtype(dtype, fmt)
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"{fmt}: the triton codec dequantizes to bf16/fp16/fp32, got {dtype}; use the torch reference")


class _on_device:
    """Launch on the tensor's GPU (Triton launches on the current device's stream)."""

    def __init__(self, t: torch.Tensor):
        self.ctx = torch.cuda.device(t.device) if t.is_cuda and t.device.index != torch.cuda.current_device() else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ public API
def quantize_nvfp4(x: torch.Tensor, global_scale: Optional[Union[torch.Tensor, float]] = None) -> nvfp4.NVFP4Tensor:
    """x [..., H] (bf16/fp16/fp32, H % 16 == 0) -> NVFP4Tensor(packed uint8 [..., H/2],
    scales float8_e4m3fn [..., H/16] linear, global_scale float32), bit-identical to
    `nvfp4.quantize(x, global_scale)` (recipe "rn").

    global_scale: None -> 448*6/amax(|x|) computed on the device (0-dim float32, 1.0 when amax is 0,
    inf or NaN); a float / 0-dim / [1] tensor; or one per row (shape x.shape[:-1])."""
    xw = _input_words(x, "nvfp4", nvfp4.BLOCK_SIZE)
    H = x.shape[-1]
    rows_shape = x.shape[:-1]
    dev = x.device
    packed = torch.empty(*rows_shape, H // 2, dtype=torch.uint8, device=dev)
    sf = torch.empty(*rows_shape, H // nvfp4.BLOCK_SIZE, dtype=torch.uint8, device=dev)
    if global_scale is None:
        gs = torch.empty((), dtype=torch.float32, device=dev)
    else:
        gs = nvfp4._as_global_scale(global_scale, rows_shape, dev).contiguous()
    numel = x.numel()
    if numel == 0:
        if global_scale is None:
            gs.fill_(1.0)  # amax of nothing is 0 -> 1.0, as the reference
        return nvfp4.NVFP4Tensor(packed, sf.view(nvfp4.SCALE_DTYPE), gs)
    n_blocks = numel // nvfp4.BLOCK_SIZE
    blocks_per_row = H // nvfp4.BLOCK_SIZE
    kind = _IN_KIND[x.dtype]
    grid = (_cdiv(n_blocks, NVFP4_BLOCKS_PER_PROGRAM),)
    with _on_device(x):
        if global_scale is None:
            n_part = min(MAX_PARTIALS, _cdiv(numel, AMAX_TILE))
            iters = _cdiv(numel, n_part * AMAX_TILE)
            part = torch.empty(n_part, dtype=torch.int32, device=dev)
            _absmax_partial_kernel[(n_part,)](xw, part, n_blocks, iters, IN_KIND=kind, TILE=AMAX_TILE, num_warps=8)
            gs_in, gs_stride = gs, 0
        else:
            part, n_part = gs, 0  # unused pointer
            gs_in, gs_stride = gs, (0 if gs.dim() == 0 else 1)
        _nvfp4_quant_kernel[grid](
            xw, packed, sf, gs_in, gs_stride, gs, part, n_part, n_blocks, blocks_per_row,
            IN_KIND=kind, COMPUTE_GS=global_scale is None, NPART=MAX_PARTIALS, BLK=NVFP4_BLOCKS_PER_PROGRAM,
            PTX=_PTX, num_warps=4,
        )  # fmt: skip
    return nvfp4.NVFP4Tensor(packed, sf.view(nvfp4.SCALE_DTYPE), gs)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: Union[torch.Tensor, float],
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """packed uint8 [..., H/2], scales float8_e4m3fn (or uint8 bytes) [..., H/16] linear, global_scale
    float / 0-dim / one per row -> [..., H] `dtype`, bit-identical to `nvfp4.dequantize`."""
    _check_out_dtype(dtype, "nvfp4")
    if packed.dtype != torch.uint8:
        raise TypeError(f"nvfp4 packed data must be uint8, got {packed.dtype}")
    if scales.dtype not in (torch.uint8, nvfp4.SCALE_DTYPE):
        raise TypeError(f"nvfp4 scales must be float8_e4m3fn (or its uint8 bytes), got {scales.dtype}")
    if packed.dim() == 0:
        raise ValueError("nvfp4 packed data needs at least 1 dimension")
    _check_device(packed, "packed")
    H = packed.shape[-1] * 2
    if H % nvfp4.BLOCK_SIZE:
        raise ValueError(f"nvfp4 packed rows hold {H} values, not a multiple of {nvfp4.BLOCK_SIZE}")
    nb = H // nvfp4.BLOCK_SIZE
    if scales.shape != (*packed.shape[:-1], nb):
        raise ValueError(
            f"nvfp4 scales have shape {list(scales.shape)}; expected {[*packed.shape[:-1], nb]} "
            f"for packed data of shape {list(packed.shape)}"
        )
    gs = nvfp4._as_global_scale(global_scale, packed.shape[:-1], packed.device).contiguous()
    out = torch.empty(*packed.shape[:-1], H, dtype=dtype, device=packed.device)
    n_blocks = scales.numel()
    if n_blocks == 0:
        return out
    grid = (_cdiv(n_blocks, NVFP4_BLOCKS_PER_PROGRAM),)
    with _on_device(packed):
        _nvfp4_dequant_kernel[grid](
            packed.contiguous(), scales.contiguous().view(torch.uint8), gs, 0 if gs.dim() == 0 else 1, out,
            n_blocks, nb, OUT_KIND=_OUT_KIND[dtype], BLK=NVFP4_BLOCKS_PER_PROGRAM, PTX=_PTX, num_warps=4,
        )  # fmt: skip
    return out


def quantize_fp8_block(x: torch.Tensor) -> fp8_block.FP8BlockTensor:
    """x [..., H] (bf16/fp16/fp32, H % 128 == 0) -> FP8BlockTensor(data float8_e4m3fn [..., H],
    scales float32 [..., H/128]), bit-identical to `fp8_block.quantize_activation(x)` (eps 1e-10)."""
    xw = _input_words(x, "fp8_block", fp8_block.ACT_GROUP)
    H = x.shape[-1]
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*x.shape[:-1], H // fp8_block.ACT_GROUP, dtype=torch.float32, device=x.device)
    n_groups = scales.numel()
    if n_groups:
        with _on_device(x):
            _fp8_block_quant_kernel[(_cdiv(n_groups, FP8_GROUPS_PER_PROGRAM),)](
                xw, data, scales, n_groups, IN_KIND=_IN_KIND[x.dtype], GB=FP8_GROUPS_PER_PROGRAM, PTX=_PTX,
                num_warps=8,
            )  # fmt: skip
    return fp8_block.FP8BlockTensor(data.view(fp8_block.DATA_DTYPE), scales)


def dequantize_fp8_block(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """data float8_e4m3fn (or uint8 bytes) [..., H], scales float32 [..., H/128] -> [..., H] `dtype`,
    bit-identical to `fp8_block.dequantize_activation`."""
    _check_out_dtype(dtype, "fp8_block")
    if data.dtype not in (torch.uint8, fp8_block.DATA_DTYPE):
        raise TypeError(f"fp8_block data must be float8_e4m3fn (or its uint8 bytes), got {data.dtype}")
    if data.dim() == 0:
        raise ValueError("fp8_block data needs at least 1 dimension")
    _check_device(data, "data")
    H = data.shape[-1]
    G = fp8_block.ACT_GROUP
    if H % G:
        raise ValueError(f"fp8_block rows hold {H} values, not a multiple of {G}")
    if scales.shape != (*data.shape[:-1], H // G):
        raise ValueError(
            f"fp8_block scales have shape {list(scales.shape)}; expected {[*data.shape[:-1], H // G]} "
            f"for data of shape {list(data.shape)}"
        )
    if scales.dtype != torch.float32:
        raise TypeError(f"fp8_block scales must be float32, got {scales.dtype}")
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    n_groups = scales.numel()
    if n_groups:
        with _on_device(data):
            _fp8_block_dequant_kernel[(_cdiv(n_groups, FP8_GROUPS_PER_PROGRAM),)](
                data.contiguous().view(torch.uint8), scales.contiguous(), out, n_groups,
                OUT_KIND=_OUT_KIND[dtype], GB=FP8_GROUPS_PER_PROGRAM, PTX=_PTX, num_warps=8,
            )  # fmt: skip
    return out


def quantize_mxfp8(x: torch.Tensor) -> mxfp8.MXFP8Tensor:
    """x [..., H] (bf16/fp16/fp32, H % 32 == 0) -> MXFP8Tensor(data float8_e4m3fn [..., H],
    scales uint8 E8M0 [..., H/32]), bit-identical to `mxfp8.quantize(x)` (scale_rounding "floor")."""
    xw = _input_words(x, "mxfp8", mxfp8.BLOCK_SIZE)
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*x.shape[:-1], x.shape[-1] // mxfp8.BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    n_blocks = scales.numel()
    if n_blocks:
        with _on_device(x):
            _mxfp8_quant_kernel[(_cdiv(n_blocks, MXFP8_BLOCKS_PER_PROGRAM),)](
                xw, data, scales, n_blocks, IN_KIND=_IN_KIND[x.dtype], BLK=MXFP8_BLOCKS_PER_PROGRAM, PTX=_PTX,
                num_warps=8,
            )  # fmt: skip
    return mxfp8.MXFP8Tensor(data.view(mxfp8.DATA_DTYPE), scales)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """data float8_e4m3fn (or uint8 bytes) [..., H], scales uint8 E8M0 [..., H/32] -> [..., H] `dtype`,
    bit-identical to `mxfp8.dequantize`."""
    _check_out_dtype(dtype, "mxfp8")
    if data.dtype not in (torch.uint8, mxfp8.DATA_DTYPE):
        raise TypeError(f"mxfp8 data must be float8_e4m3fn (or its uint8 bytes), got {data.dtype}")
    if data.dim() == 0:
        raise ValueError("mxfp8 data needs at least 1 dimension")
    if scales.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 (biased exponent), got {scales.dtype}")
    _check_device(data, "data")
    H = data.shape[-1]
    B = mxfp8.BLOCK_SIZE
    if H % B:
        raise ValueError(f"mxfp8 rows hold {H} values, not a multiple of {B}")
    if scales.shape != (*data.shape[:-1], H // B):
        raise ValueError(
            f"mxfp8 scales have shape {list(scales.shape)}; expected {[*data.shape[:-1], H // B]} "
            f"for data of shape {list(data.shape)}"
        )
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    n_blocks = scales.numel()
    if n_blocks:
        with _on_device(data):
            _mxfp8_dequant_kernel[(_cdiv(n_blocks, MXFP8_BLOCKS_PER_PROGRAM),)](
                data.contiguous().view(torch.uint8), scales.contiguous(), out, n_blocks,
                OUT_KIND=_OUT_KIND[dtype], BLK=MXFP8_BLOCKS_PER_PROGRAM, PTX=_PTX, num_warps=8,
            )  # fmt: skip
    return out
