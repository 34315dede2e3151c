"""Triton kernels of the fused routing (`epmoe.routing`, impl "triton"): router logits [T, E] ->
topk_ids [T, K] int32, topk_weights [T, K] float32 in one launch instead of ~7 torch ops. Imports
triton at the top: imported only when the fused routing runs.

Each program takes BLOCK_T rows whole (E <= E_PAD columns in registers) and repeats the torch math of
`epmoe.routing.route` in float32: exp and sigmoid with the precise exponential (libdevice expf, as
torch's kernels; PRECISE=False under the Triton interpreter, which has no libdevice) and IEEE
division (`tl.math.div_rn`, as torch). Top-k is K rounds of "largest remaining score, lowest expert
id among equal scores": ids come out by descending score (softmax: the weight; sigmoid_grouped: the
weight + correction bias), ties by ascending id; a row whose values
are all NaN gets id -1 and weight 0.

`route_align_kernel` (decode, one rank): the routing of all rows and then the block alignment of the
ids for the grouped expert GEMMs (`epmoe.experts.triton.align`, one program) in one launch.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from epmoe.experts.triton.triton_kernels import align_small

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _load_rows(ptr, rows, cols, T, E, stride, other):
    ok = (rows[:, None] < T) & (cols[None, :] < E)
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=ok, other=other).to(tl.float32)


@triton.jit
def _top_k(choice, value, avail, cols, E, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
           BLOCK_T: tl.constexpr):
    """K rounds of argmax over `choice` where `avail` (ties: lowest column); -> (ids, value at each id)."""
    kcols = tl.arange(0, K_PAD)
    ids = tl.full([BLOCK_T, K_PAD], -1, tl.int32)
    ws = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    for k in tl.static_range(K):
        cand = tl.where(avail, choice, NEG_INF)
        best = tl.max(cand, axis=1)
        idx = tl.min(tl.where(avail & (cand == best[:, None]), cols[None, :], E_PAD), axis=1)
        ok = idx < E
        pick = cols[None, :] == idx[:, None]
        wk = tl.sum(tl.where(pick, value, 0.0), axis=1)  # the one picked value (+ exact zeros)
        ids = tl.where(kcols[None, :] == k, tl.where(ok, idx, -1)[:, None], ids)
        ws = tl.where(kcols[None, :] == k, tl.where(ok, wk, 0.0)[:, None], ws)
        avail = avail & ~pick
    return ids, ws


@triton.jit
def _store_rows(ids_ptr, w_ptr, ids, ws, rows, T, K: tl.constexpr, K_PAD: tl.constexpr):
    kcols = tl.arange(0, K_PAD)
    ok = (rows[:, None] < T) & (kcols[None, :] < K)
    off = rows[:, None] * K + kcols[None, :]
    tl.store(ids_ptr + off, ids, mask=ok)
    tl.store(w_ptr + off, tl.where(ids >= 0, ws, 0.0), mask=ok)  # no expert: weight 0 (not 0 / 0)


@triton.jit
def route_softmax_kernel(
    logits_ptr,  # [T, E] float (any float dtype), last dim contiguous
    ids_ptr,  # [T, K] int32 out
    w_ptr,  # [T, K] float32 out
    T,
    E,
    stride_l,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORM: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """p = softmax(logits); top-k of p; if RENORM: p / sum of the chosen p."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _softmax_rows(logits_ptr, ids_ptr, w_ptr, rows, T, E, stride_l, K, K_PAD, E_PAD, BLOCK_T, RENORM, PRECISE)


@triton.jit
def _softmax_rows(logits_ptr, ids_ptr, w_ptr, rows, T, E, stride_l, K: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, RENORM: tl.constexpr, PRECISE: tl.constexpr):
    """route_softmax_kernel on the rows `rows` (BLOCK_T of them; those >= T are skipped)."""
    cols = tl.arange(0, E_PAD)
    x = _load_rows(logits_ptr, rows, cols, T, E, stride_l, NEG_INF)
    m = tl.max(x, axis=1)
    e = tl.where(cols[None, :] < E, _exp(x - m[:, None], PRECISE), 0.0)
    s = tl.sum(e, axis=1)
    p = tl.math.div_rn(e, tl.broadcast_to(s[:, None], [BLOCK_T, E_PAD]))
    avail = (cols[None, :] < E) & (rows[:, None] >= 0)
    ids, ws = _top_k(p, p, avail, cols, E, K, K_PAD, E_PAD, BLOCK_T)
    if RENORM:
        tot = tl.sum(ws, axis=1)
        ws = tl.math.div_rn(ws, tl.broadcast_to(tot[:, None], [BLOCK_T, K_PAD]))
    _store_rows(ids_ptr, w_ptr, ids, ws, rows, T, K, K_PAD)


@triton.jit
def route_sigmoid_grouped_kernel(
    logits_ptr,  # [T, E] float, last dim contiguous
    bias_ptr,  # [E] float32 e_score_correction_bias (read only with HAS_BIAS)
    ids_ptr,  # [T, K] int32 out
    w_ptr,  # [T, K] float32 out
    T,
    E,
    stride_l,
    scale,  # routed_scaling_factor (fp32)
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # E // N_GROUP
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """DeepSeek-V3 noaux_tc: s = sigmoid(logits), c = s + bias; keep the TOPK_GROUP groups with the
    largest sum of their top-2 c; top-k of c inside them; weights s (renormalized: / (sum + 1e-20)),
    times scale."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _sigmoid_grouped_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, rows, T, E, stride_l, scale, K, K_PAD, E_PAD,
                          BLOCK_T, N_GROUP, G_PAD, TOPK_GROUP, GROUP_SIZE, HAS_BIAS, RENORM, PRECISE)


@triton.jit
def _sigmoid_grouped_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, rows, T, E, stride_l, scale, K: tl.constexpr,
                          K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, N_GROUP: tl.constexpr,
                          G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, PRECISE: tl.constexpr):
    """route_sigmoid_grouped_kernel on the rows `rows` (BLOCK_T of them; those >= T are skipped)."""
    cols = tl.arange(0, E_PAD)
    cmask = cols < E
    x = _load_rows(logits_ptr, rows, cols, T, E, stride_l, 0.0)
    s = tl.math.div_rn(tl.full([BLOCK_T, E_PAD], 1.0, tl.float32), 1.0 + _exp(-x, PRECISE))
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    grp = cols // GROUP_SIZE
    gcols = tl.arange(0, G_PAD)
    gscore = tl.full([BLOCK_T, G_PAD], NEG_INF, tl.float32)
    for g in tl.static_range(N_GROUP):
        cg = tl.where(((grp == g) & cmask)[None, :], c, NEG_INF)
        top1 = tl.max(cg, axis=1)
        i1 = tl.min(tl.where(cg == top1[:, None], cols[None, :], E_PAD), axis=1)
        top2 = tl.max(tl.where(cols[None, :] == i1[:, None], NEG_INF, cg), axis=1)
        gscore = tl.where(gcols[None, :] == g, (top1 + top2)[:, None], gscore)
    gavail = (gcols[None, :] < N_GROUP) & (rows[:, None] >= 0)
    allowed = (cols[None, :] < 0) & (rows[:, None] >= 0)  # all False, [BLOCK_T, E_PAD]
    for r in tl.static_range(TOPK_GROUP):
        cand = tl.where(gavail, gscore, NEG_INF)
        best = tl.max(cand, axis=1)
        gi = tl.min(tl.where(gavail & (cand == best[:, None]), gcols[None, :], G_PAD), axis=1)
        gavail = gavail & (gcols[None, :] != gi[:, None])
        allowed = allowed | (grp[None, :] == gi[:, None])
    allowed = allowed & cmask[None, :]
    ids, ws = _top_k(c, s, allowed, cols, E, K, K_PAD, E_PAD, BLOCK_T)
    if RENORM:
        tot = tl.sum(ws, axis=1) + 1e-20
        ws = tl.math.div_rn(ws, tl.broadcast_to(tot[:, None], [BLOCK_T, K_PAD]))
    ws = ws * scale
    _store_rows(ids_ptr, w_ptr, ids, ws, rows, T, K, K_PAD)


@triton.jit
def route_align_kernel(
    logits_ptr,  # [T, E] float, last dim contiguous
    bias_ptr,  # [E] float32 e_score_correction_bias (sigmoid_grouped with HAS_BIAS)
    ids_ptr,  # [T, K] int32 out
    w_ptr,  # [T, K] float32 out
    T,
    E,
    stride_l,
    scale,  # routed_scaling_factor (sigmoid_grouped)
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 out: the alignment of ids (align_small_kernel's outputs)
    block_expert_ptr,  # [max_blocks] int32 out
    block_rows_ptr,  # [max_blocks] int32 out
    scratch_ptr,  # [3 * A_E_PAD] int32 scratch
    max_blocks,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORM: tl.constexpr,
    PRECISE: tl.constexpr,
    SIGMOID: tl.constexpr,  # False: softmax (bias and scale unused)
    BLOCK_M: tl.constexpr,
    A_E_PAD: tl.constexpr,  # align_small's E_PAD: power of two > E
    N_PAD: tl.constexpr,
    LOG_N: tl.constexpr,
    RB: tl.constexpr,
    TB: tl.constexpr,
    N_GROUP: tl.constexpr = 1,
    G_PAD: tl.constexpr = 1,
    TOPK_GROUP: tl.constexpr = 1,
    GROUP_SIZE: tl.constexpr = 1,
    HAS_BIAS: tl.constexpr = False,
):
    """The routing of all T rows (route_softmax_kernel / route_sigmoid_grouped_kernel, BLOCK_T rows at a
    time) and then the block alignment of the ids it wrote over E experts (`align_small`: the ids are
    the local ones of a single rank) in ONE program: the outputs of the two launches bit for bit, for
    up to N_PAD = T * K entries (decode). The alignment reads the ids back after a barrier."""
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        if SIGMOID:
            _sigmoid_grouped_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, rows, T, E, stride_l, scale, K, K_PAD, E_PAD,
                                  BLOCK_T, N_GROUP, G_PAD, TOPK_GROUP, GROUP_SIZE, HAS_BIAS, RENORM, PRECISE)
        else:
            _softmax_rows(logits_ptr, ids_ptr, w_ptr, rows, T, E, stride_l, K, K_PAD, E_PAD, BLOCK_T, RENORM, PRECISE)
    tl.debug_barrier()  # the ids stores are seen by every thread of the alignment
    align_small(ids_ptr, sorted_ids_ptr, block_expert_ptr, block_rows_ptr, scratch_ptr, T * K, E, max_blocks,
                BLOCK_M, A_E_PAD, N_PAD, LOG_N, RB, TB)
