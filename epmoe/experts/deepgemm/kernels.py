"""Triton kernels around DeepGEMM's grouped GEMMs (the memory-bound steps of the `deepgemm` experts).
Imported only when that backend runs (imports triton at the top).

Flat layout (rows of the contiguous layout p = 0..P-1, each expert's rows padded to DeepGEMM's M
alignment; `m_indices[p]` = local expert of row p, -1 for padding; entry j = n * K + k):

    dg_gather_kernel     a[inv[j]] = x[n] for the valid slots k of token n (token-major: x read once);
                         QUANT=1 quantizes the row to e4m3 with 1x128 fp32 scales once per token,
                         QUANT=2 copies e4m3 bytes + scales as they arrived, QUANT=0 copies bf16 rows.
    dg_act_kernel        act(h[p, :I], h[p, I:]) of every valid row, bf16 out or e4m3 + 1x128 scales
                         (flat: rows with m_indices -1 skipped; masked: rows m >= masked_m[g] skipped)
    grouped_combine_kernel (epmoe.experts.triton.triton_kernels) out[n] = sum_k w[n,k] * y[inv[n*K+k]]

Scales are written MN-major, the layout DeepGEMM's SM90 FP8 kernels read through TMA: the scale of
row p and group g at s_ptr + g * stride_sg + p (stride_sg = the TMA-aligned row count), so DeepGEMM
takes them without a transposing copy. The gather can take that row count from the GPU (ROWS_FROM_PTR:
the layout's used rows), so it is launched before the host has read the count back. fp8 quantization
divides with IEEE rounding (`tl.math.div_rn`), bit-identical to the torch codec (`epmoe.quant.fp8_block`).
"""

import triton
import triton.language as tl

from epmoe.experts.triton.triton_kernels import _activation, grouped_combine_kernel  # noqa: F401

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def dg_gather_kernel(
    x_ptr,  # [N, H] bf16 tokens, or e4m3 (QUANT=2)
    xs_ptr,  # [N, H/128] fp32 scales of e4m3 tokens (QUANT=2; else unused)
    ids_ptr,  # [N, K] int32 local expert ids (invalid: < 0 or >= num_experts)
    inv_ptr,  # [N*K] int32 contiguous-layout row of each entry
    a_ptr,  # [P, H] out: bf16 (QUANT=0) or e4m3
    as_ptr,  # out: fp32 scale of (row p, group g) at as_ptr + g * stride_asg + p (QUANT>=1)
    H,
    num_experts,
    stride_xm,
    stride_xsm,
    stride_xsg,
    stride_am,
    stride_asg,
    rows_ptr,  # [1] int32 rows of the layout (ROWS_FROM_PTR): the scales' row stride, at least min_rows
    min_rows,
    TOP_K: tl.constexpr,
    QUANT: tl.constexpr,
    NG: tl.constexpr,  # 128-groups per step
    ROWS_FROM_PTR: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    if ROWS_FROM_PTR:  # the row count is still on its way to the host: the scale stride from the GPU
        stride_asg = tl.maximum(tl.load(rows_ptr), min_rows).to(tl.int64)
    BLOCK: tl.constexpr = NG * 128
    src = x_ptr + n * stride_xm
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        ok = offs < H
        if QUANT == 1:
            v = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
            v2 = tl.reshape(v, (NG, 128))
            scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v2), axis=1), 1e-10), FP8_MAX)
            q = tl.reshape(tl.clamp(tl.math.div_rn(v2, scale[:, None]), -FP8_MAX, FP8_MAX), (BLOCK,))
            q = q.to(a_ptr.dtype.element_ty)
        else:
            q = tl.load(src + offs, mask=ok)
        g = h0 // 128 + tl.arange(0, NG)
        if QUANT == 2:
            scale = tl.load(xs_ptr + n * stride_xsm + g * stride_xsg, mask=g * 128 < H, other=0.0)
        for k in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + n * TOP_K + k)
            valid = (e >= 0) & (e < num_experts)
            lim = tl.where(valid, H, 0)  # invalid slot (another rank's expert): store nothing
            p = tl.where(valid, tl.load(inv_ptr + n * TOP_K + k).to(tl.int64), 0)
            tl.store(a_ptr + p * stride_am + offs, q, mask=offs < lim)
            if QUANT >= 1:
                tl.store(as_ptr + g.to(tl.int64) * stride_asg + p, scale, mask=g * 128 < lim)


@triton.jit
def _act_row(h_ptr, a_ptr, as_ptr, r, m, grp, offs, ok, gi, I, stride_hm, stride_am, stride_asb, stride_asg, alpha, beta,
             limit, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, GATED: tl.constexpr, QUANT: tl.constexpr,
             NG: tl.constexpr):
    row = h_ptr + r * stride_hm
    g = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
    u = g
    if GATED:
        u = tl.load(row + I + offs, mask=ok, other=0.0).to(tl.float32)
    act = tl.where(ok, _activation(g, u, alpha, beta, limit, ACT, HAS_LIMIT), 0.0)
    if QUANT:
        v2 = tl.reshape(act, (NG, 128))
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v2), axis=1), 1e-10), FP8_MAX)
        q = tl.reshape(tl.clamp(tl.math.div_rn(v2, scale[:, None]), -FP8_MAX, FP8_MAX), (NG * 128,))
        tl.store(a_ptr + r * stride_am + offs, q.to(a_ptr.dtype.element_ty), mask=ok)
        tl.store(as_ptr + grp * stride_asb + gi.to(tl.int64) * stride_asg + m, scale, mask=gi * 128 < I)
    else:
        tl.store(a_ptr + r * stride_am + offs, act.to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def dg_act_kernel(
    h_ptr,  # [rows, R] gemm1 output (bf16); R = 2I (gated: gate then up) or I
    valid_ptr,  # flat: [rows] int32 m_indices (-1: padding); masked: [G] int32 valid rows per expert
    a_ptr,  # [rows, I] out: bf16, or e4m3 (QUANT)
    as_ptr,  # out (QUANT): fp32 scale of (row, group g) at as_ptr + grp * stride_asb + g * stride_asg + m
    I,
    M,  # masked: rows per expert (row r = grp * M + m); flat: unused
    stride_hm,
    stride_am,
    stride_asb,
    stride_asg,
    alpha,
    beta,
    limit,
    ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    GATED: tl.constexpr,
    MASKED: tl.constexpr,
    QUANT: tl.constexpr,
    NG: tl.constexpr,
    ROWS: tl.constexpr,  # masked: rows per program (the program stops at the expert's count)
):
    """flat: grid (rows, column blocks); masked: grid (G, row blocks of ROWS, column blocks), so the
    empty slots of the masked layout cost no programs."""
    BLOCK: tl.constexpr = NG * 128
    if MASKED:
        grp = tl.program_id(0).to(tl.int64)
        m0 = tl.program_id(1) * ROWS
        col = tl.program_id(2)
        m_end = tl.minimum(m0 + ROWS, tl.load(valid_ptr + grp))
        offs = col * BLOCK + tl.arange(0, BLOCK)
        gi = col * NG + tl.arange(0, NG)
        for m in range(m0, m_end):
            _act_row(h_ptr, a_ptr, as_ptr, grp * M + m, m, grp, offs, offs < I, gi, I, stride_hm, stride_am,
                     stride_asb, stride_asg, alpha, beta, limit, ACT, HAS_LIMIT, GATED, QUANT, NG)
    else:
        r = tl.program_id(0).to(tl.int64)
        if tl.load(valid_ptr + r) >= 0:
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            gi = tl.program_id(1) * NG + tl.arange(0, NG)
            _act_row(h_ptr, a_ptr, as_ptr, r, r, r * 0, offs, offs < I, gi, I, stride_hm, stride_am, stride_asb,
                     stride_asg, alpha, beta, limit, ACT, HAS_LIMIT, GATED, QUANT, NG)


@triton.jit
def dg_quant_masked_kernel(
    x_ptr,  # [G * M, H] bf16 rows of the masked layout (row r = grp * M + m)
    counts_ptr,  # [G] int32 valid rows per expert
    q_ptr,  # [G * M, H] e4m3 out
    s_ptr,  # fp32 scale of (row, group g) at s_ptr + grp * stride_sb + g * stride_sg + m
    H,
    M,
    stride_xm,
    stride_qm,
    stride_sb,
    stride_sg,
    NG: tl.constexpr,
    ROWS: tl.constexpr,
):
    """grid (G, row blocks of ROWS, column blocks): rows past an expert's count cost nothing."""
    BLOCK: tl.constexpr = NG * 128
    grp = tl.program_id(0).to(tl.int64)
    m0 = tl.program_id(1) * ROWS
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    gi = tl.program_id(2) * NG + tl.arange(0, NG)
    for m in range(m0, tl.minimum(m0 + ROWS, tl.load(counts_ptr + grp))):
        r = grp * M + m
        v = tl.load(x_ptr + r * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        v2 = tl.reshape(v, (NG, 128))
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v2), axis=1), 1e-10), FP8_MAX)
        q = tl.reshape(tl.clamp(tl.math.div_rn(v2, scale[:, None]), -FP8_MAX, FP8_MAX), (BLOCK,))
        tl.store(q_ptr + r * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + grp * stride_sb + gi.to(tl.int64) * stride_sg + m, scale, mask=gi * 128 < H)
