"""Weight formats of the Hopper experts backends: how canonical (quantized) `ExpertWeights` map to
the Triton kernels' layout, plus load-time quantization of float weights. Plain torch.

Canonical formats are `epmoe.quant.weights` (w1/w3/w2 quantized per projection, scales are
dequantization factors, nvfp4 global scale = dequant multiplier per expert and projection).
The element codecs are `epmoe.quant.{e2m1, nvfp4, mxfp4, fp8_block}`.

Kernel layout (what `TritonExperts.parameters()` holds), R = 2I ([gate; up]) or I (relu2):
    bf16        w13 [E, R, H] model dtype, rows interleaved gate j / up j (`interleave_gate_up`) by
                default, [gate; up] with the backend option triton_gate_up=blocked; w2 [E, H, I]
    fp8_block   w13 [E, R, H] e4m3, w13_scale [E, 2*ceil(I/128), ceil(H/128)] f32 (gate grid, then up
                grid: a 128-row block never mixes gate and up), w2 [E, H, I], w2_scale f32
    nvfp4       w13 [E, R, H/2] uint8 k64-interleaved (below), w13_scale e4m3 [E, R, H/16] as scale codes
                (`encode_nvfp4_scales`) in K-step pairs [E, R, ceil(H/128), 8] (`pair_fp4_scales`),
                w13_global_scale [E, 2] f32 (gate, up; [E, 1] for relu2), w2 .., w2_global_scale [E, 1]
    mxfp4       as nvfp4 with e8m0 (uint8) scales [.., K/32], paired [.., ceil(K/128), 4], no global scale
k64 interleave (`interleave_fp4_k64`): canonical packing has element 2j in the low nibble of byte j;
the kernels read 64-element K blocks where byte j (0 <= j < 32) of block b holds element 64b + j in
its low nibble and 64b + 32 + j in its high nibble, so a K tile splits into two contiguous halves
with no register shuffles. K must be a multiple of 64.
Word bit permutation (`permute_fp4_words`, the triton backend's fp4 conversion "words", on the GPU):
the k64-interleaved bytes with the 32 bits of every aligned 4-byte word permuted so that the PTX
conversion of that mode (8 instructions per word) gives the bf16 values the per-byte one gives on the
plain word.
Row tiles (`tile_fp4_rows`; the triton backend's option triton_fp4_layout=tiles, its default):
for every expert, group of 8 rows and 64-element K step, the 8 x 32 bytes contiguous, so one warp load
of the Gluon decode kernel (8 rows x 32 bytes) covers two whole 128-byte lines.
nvfp4 scale normalization (`normalize_nvfp4_scales`, every nvfp4 load of the triton backend): block
scales >= +0 and the weights of zero scales +0, the same values (the Gluon kernels' scale conversion
needs it).

fp8_block with dimensions that are not multiples of 128 (e.g. GPT-OSS H = 2880): the last block
row/column is partial; quantization here pads it (`quantize_fp8_block`), with the same scale
formula as `epmoe.quant.fp8_block` (scale = max(amax, 1e-10) / 448).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch

from epmoe.quant import fp8_block, mxfp4, nvfp4
from epmoe.quant.weights import ExpertWeights

FP8_BLOCK = 128
FP4_K_INTERLEAVE = 64
FORMAT_OF_MODE = {"fp8_block": "fp8_block", "nvfp4_w4a16": "nvfp4", "mxfp4_w4a16": "mxfp4"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- fp8 block (padded)


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK):
    """w [..., R, C] float -> (q e4m3 [..., R, C], scale f32 [..., ceil(R/b), ceil(C/b)]); partial edge
    blocks padded with zeros (epmoe.quant.fp8_block.quantize_weight, the format's one quantizer)."""
    q = fp8_block.quantize_weight(w.float(), (block, block), pad_edges=True)
    return q.data, q.scales


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of `quantize_fp8_block` (float32); any R, C."""
    return fp8_block.dequantize_weight(q, scale, torch.float32, (block, block))


def quantize_fp8_tokens(x: torch.Tensor, group: int = FP8_BLOCK):
    """x [N, C] -> (q e4m3 [N, C], scale f32 [N, ceil(C/group)]), 1 x group blocks, any C
    (epmoe.quant.fp8_block.quantize_activation, the format's one quantizer)."""
    q = fp8_block.quantize_activation(x.float(), group, pad_edges=True)
    return q.data, q.scales


def dequantize_fp8_tokens(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_BLOCK) -> torch.Tensor:
    C = q.shape[1]
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :C]


# --------------------------------------------------------------------------- gate/up row interleave


def interleave_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """w1, w3 [E, I, H] -> w13 [E, 2I, H] with row 2j = w1[:, j] (gate) and row 2j+1 = w3[:, j] (up):
    the bf16 `triton` layout, where one tile of 2*BN rows holds gate and up of BN columns."""
    if w1.shape != w3.shape:
        raise ValueError(f"w1 {list(w1.shape)} and w3 {list(w3.shape)} must have the same shape")
    E, I, H = w1.shape
    return torch.stack([w1, w3.to(w1.dtype)], dim=2).reshape(E, 2 * I, H)


def deinterleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_gate_up`: [E, 2I, H] interleaved -> [E, 2I, H] as [gate; up]."""
    E, R, H = w13.shape
    return w13.reshape(E, R // 2, 2, H).transpose(1, 2).reshape(E, R, H)


# --------------------------------------------------------------------------- fp4 kernel layout


def interleave_fp4_k64(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packing [..., C/2] uint8 -> kernel packing (module docstring). C % 64 == 0."""
    C = packed.shape[-1] * 2
    if C % FP4_K_INTERLEAVE:
        raise ValueError(f"the fp4 kernel layout needs K % {FP4_K_INTERLEAVE} == 0, got K={C}")
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], C // 64, 2, 32)
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(*packed.shape[:-1], C // 2).contiguous()


def deinterleave_fp4_k64(kpacked: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_fp4_k64`."""
    C = kpacked.shape[-1] * 2
    b = kpacked.reshape(*kpacked.shape[:-1], C // 64, 32)
    codes = torch.stack([b & 0xF, b >> 4], dim=-2).reshape(*kpacked.shape[:-1], C)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


# Bit positions of the words of convert mode "words" (`triton_kernels._E2M1_BF16_WORDS_ASM`): output word
# j of the conversion holds, in its low / high bf16, the nibble of FP4_WORD_NIBBLES[j] (0-3: low nibble
# of byte 0-3, 4-7: high nibble), whose bits 0..3 land on bf16 bits 6, 7, 8, 15 (+ 16 for the high bf16).
# FP4_WORD_SOURCE[j][i] is where the permuted word stores nibble bit i of output j's low bf16 (+ 16 mod 32:
# high bf16): output 0 in place, outputs 1 and 2 one rotation (right by 22, 19), output 3 the bits
# 0, 1, 3, 4 (+ 16) that one multiply by 2^2 + 2^7 + 2^12 spreads (no two copies overlap: no carries).
FP4_WORD_NIBBLES = ((0, 1), (2, 3), (4, 5), (6, 7))
FP4_WORD_SOURCE = ((6, 7, 8, 15), (28, 29, 30, 5), (25, 26, 27, 2), (4, 0, 1, 3))


def _fp4_word_moves():
    """[(bit of the plain word, bit of the permuted word)] of `permute_fp4_words`, 32 pairs: nibble bit i
    of byte j's low / high nibble is plain bit 8j + i / 8j + 4 + i."""
    return [
        (8 * (nib % 4) + 4 * (nib // 4) + i, (src + 16 * half) % 32)
        for (nibs, srcs) in zip(FP4_WORD_NIBBLES, FP4_WORD_SOURCE)
        for half, nib in enumerate(nibs)
        for i, src in enumerate(srcs)
    ]


def permute_fp4_words(kpacked: torch.Tensor, chunk_words: int = 1 << 22, inplace: bool = False) -> torch.Tensor:
    """fp4 kernel packing [..., C/2] uint8 (C/2 % 4 == 0) -> the same bytes with the 32 bits of every
    aligned 4-byte word permuted for the conversion of mode "words" (above); inverse
    `unpermute_fp4_words`. New storage on the input's device, or with inplace (a contiguous input the
    caller owns) the input itself, chunk by chunk: no second copy of the weights at load. int32
    scratch of ~10 x chunk_words."""
    if kpacked.shape[-1] % 4:
        raise ValueError(f"the fp4 word layout needs K/2 % 4 == 0 bytes per row, got {kpacked.shape[-1]}")
    if inplace and not kpacked.is_contiguous():
        raise ValueError("permute_fp4_words(inplace=True) needs a contiguous tensor")
    src = kpacked.contiguous().view(torch.int32).reshape(-1)  # little-endian words: byte j at bits 8j
    out = src if inplace else torch.empty_like(src)
    moves = _fp4_word_moves()
    for lo in range(0, src.numel(), chunk_words):
        w = src[lo:lo + chunk_words]
        acc = torch.zeros_like(w)
        for src_bit, dst in moves:
            acc |= ((w >> src_bit) & 1) << dst
        out[lo:lo + chunk_words] = acc  # (inplace: this chunk is read before it is written)
    return out.view(torch.uint8).reshape(kpacked.shape)


FP4_TILE_ROWS = 8  # rows per tile of `tile_fp4_rows` (the 8 rows of one mma.sync A-fragment load)


def tile_fp4_rows(kpacked: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """fp4 kernel packing [E, R, K/2] uint8 (R % 8 == 0, K % 64 == 0) -> the same bytes, same shape,
    reordered [E, R/8, 8, K/64, 32] -> [E, R/8, K/64, 8, 32]: byte b of K step s of row r sits at
    (r // 8) * 8 * K/2 + s * 256 + (r % 8) * 32 + b of its expert. Inverse `untile_fp4_rows`. New
    storage, or with inplace (a contiguous input the caller owns) the input itself, expert by expert
    (as `permute_fp4_words`: no second copy of the weights at load, one expert's scratch)."""
    E, R, KB = kpacked.shape
    if R % FP4_TILE_ROWS or KB % 32:
        raise ValueError(f"fp4 row tiles need rows % {FP4_TILE_ROWS} == 0 and K/2 % 32 == 0, got [{E}, {R}, {KB}]")
    if inplace and not kpacked.is_contiguous():
        raise ValueError("tile_fp4_rows(inplace=True) needs a contiguous tensor")
    out = kpacked if inplace else torch.empty_like(kpacked, memory_format=torch.contiguous_format)
    for e in range(E):
        t = kpacked[e].reshape(R // FP4_TILE_ROWS, FP4_TILE_ROWS, KB // 32, 32).permute(0, 2, 1, 3)
        out[e] = t.reshape(R, KB)  # (a copy: the permuted view is not contiguous; inplace: read before written)
    return out


FP4_SCALE_STEP = 64  # K elements per step of `pair_fp4_scales` (the kernels' K step)


def pair_fp4_scales(scales: torch.Tensor, group: int) -> torch.Tensor:
    """fp4 block scales [E, R, K/group] uint8 (nvfp4 codes: group 16, mxfp4 e8m0: group 32; K % 64 == 0)
    -> scale pairs [E, R, ceil(S/2), 2 * (64 / group)] (S = K/64 steps): a row's scales of K steps 2p and
    2p + 1 (8 bytes nvfp4, 4 mxfp4) as pair p, a view of new storage [E, ceil(S/2), R, pair] in which pair p
    of all R rows is contiguous (strides (ceil(S/2) * R * pair, pair, R * pair, 1)); an odd step count's last
    pair ends in zero bytes. The kernels read a K step's scales of the consecutive rows of a tile from one
    contiguous span (coalesced; row-major scales put every row's word in its own 32-byte sector), and two
    steps' scales of a row as one 8- / 4-byte word. Inverse `unpair_fp4_scales`."""
    if scales.dim() != 3 or scales.dtype != torch.uint8:
        raise ValueError(f"fp4 scales must be uint8 [E, R, K/group], got {scales.dtype} {list(scales.shape)}")
    if group not in (16, 32):
        raise ValueError(f"fp4 scale group must be 16 (nvfp4) or 32 (mxfp4), got {group}")
    E, R, G = scales.shape
    per_step = FP4_SCALE_STEP // group
    if G % per_step:
        raise ValueError(f"fp4 scales [{E}, {R}, {G}] do not cover whole K steps of 64 (K/{group} per row)")
    steps = G // per_step
    pairs, pair = -(-steps // 2), 2 * per_step
    out = torch.zeros(E, pairs, R, pair, dtype=torch.uint8, device=scales.device)
    for e in range(E):  # one expert at a time: no second full copy at load
        src = scales[e]
        if steps % 2:
            padded = torch.zeros(R, pairs * pair, dtype=torch.uint8, device=scales.device)
            padded[:, :G] = src
            src = padded
        out[e] = src.reshape(R, pairs, pair).transpose(0, 1)
    return out.permute(0, 2, 1, 3)


def unpair_fp4_scales(paired: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Inverse of `pair_fp4_scales` for reduction size k: [E, R, K/group] uint8, contiguous."""
    E, R, pairs, pair = paired.shape
    return paired.reshape(E, R, pairs * pair)[:, :, : k // group].contiguous()


def normalize_nvfp4_scales(kpacked: torch.Tensor, scales: torch.Tensor, name: str = "w13", first_expert: int = 0) -> None:
    """In place, the same weights value for value: nvfp4 weights k64-interleaved [E, R, K/2] uint8 and
    their e4m3 block scales [E, R, K/16], so that every scale is >= +0 and the weights of a zero scale
    (+0 or -0) are +0: a negative scale's 16 values change sign (s * v = -s * -v), a zero scale's become
    +0 (0 * v = 0 * 0). The Gluon kernels' scale conversion (`gluon_w4a16._SCALE_PAIR_NV_ASM`) needs it.
    NaN scales (e4m3 0x7F / 0xFF) are refused, naming the tensor (`name`), the expert (global index: local
    + `first_expert`), the row and the K range. Touches the weights only where a scale is zero or negative."""
    E, R, KB = kpacked.shape
    sb = scales.view(torch.uint8)
    if tuple(sb.shape) != (E, R, KB // 8) or KB % 32:
        raise ValueError(f"nvfp4 scales {list(sb.shape)} do not match weights {[E, R, KB]} (K/16 per row, K % 64 == 0)")
    nan = (sb & 0x7F) == 0x7F
    if bool(nan.any()):
        e, r, g = (int(i) for i in nan.nonzero()[0])
        raise ValueError(f"nvfp4 {name} block scale of expert {first_expert + e}, row {r}, K {16 * g}..{16 * g + 15} is "
                         f"NaN (e4m3 0x{int(sb[e, r, g]):02x}): the checkpoint's scales are corrupt; re-export it")
    zero = (sb & 0x7F) == 0
    neg = ((sb & 0x80) != 0) & ~zero
    if not bool(zero.any() or neg.any()):
        return
    # K step s, group g = 2n + h of its 4: bytes 16h .. 16h + 15 of the step, nibble n (0 low, 1 high)
    wv = kpacked.view(E, R, KB // 32, 2, 16)
    groups = lambda m: m.view(E, R, KB // 32, 2, 2)  # noqa: E731  [.., n, h]
    for n, (keep, sign) in enumerate(((0xF0, 0x08), (0x0F, 0x80))):
        z, ng = groups(zero)[:, :, :, n], groups(neg)[:, :, :, n]  # [E, R, S, h]
        if bool(z.any()):
            wv &= torch.where(z, keep, 0xFF).to(torch.uint8)[..., None]
        if bool(ng.any()):
            wv ^= torch.where(ng, sign, 0).to(torch.uint8)[..., None]
    sb &= 0x7F


# nvfp4 scale codes (`encode_nvfp4_scales`): a normalized e4m3 block scale s > 0 is 2^E * (1 + m/8) with
# E in -9..8 (e4m3's subnormals m * 2^-9 included, as normals) and m in 0..7; its code is
# ((E + NV_SCALE_CODE_BIAS) << 3) | m (8..151), and +0 is code 0. Every code > 0 is then a normal float
# whose bits are the code shifted into the exponent's low bits: fp32 (code << 20) + ((127 - 10) << 23)
# (`triton_kernels._nv_scale_f32`), a bf16 pair s * 2^112 one multiply-add (`gluon_w4a16._SCALE_PAIR_NV_ASM`).
NV_SCALE_CODE_BIAS = 10


def _nv_scale_code_table() -> torch.Tensor:
    """[128] uint8: the code of each e4m3 byte without its sign (0x7F, NaN: 0, refused before use)."""
    vals = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()
    codes = []
    for v in vals:
        if not v or v != v:
            codes.append(0)
            continue
        E = int(math.floor(math.log2(v)))
        m = (v / 2.0**E - 1) * 8
        assert m == int(m) and -9 <= E <= 8, (v, E, m)
        codes.append(((E + NV_SCALE_CODE_BIAS) << 3) | int(m))
    return torch.tensor(codes, dtype=torch.uint8)


def encode_nvfp4_scales(scales: torch.Tensor) -> torch.Tensor:
    """In place: e4m3 block scales >= +0 (`normalize_nvfp4_scales`) -> their codes (above), the same
    storage viewed as uint8. The value of each scale is unchanged: `decode_nvfp4_scales` gives it back."""
    sb = scales.view(torch.uint8)
    if sb.numel() and int(sb.max()) >= 0x7F:
        raise ValueError(f"encode_nvfp4_scales needs e4m3 scales >= +0 and not NaN (byte 0x{int(sb.max()):02x} found); "
                         "run normalize_nvfp4_scales on them and their weights first")
    table = _nv_scale_code_table().to(sb.device)
    sub = sb < 8  # +0 and e4m3's subnormals (rare): looked up; normals: the byte + 24 ((e - 7 + 10) << 3 | m)
    small = sb[sub]
    sb += 24
    if small.numel():
        sb[sub] = table[small.long()]
    return sb


def decode_nvfp4_scales(codes: torch.Tensor) -> torch.Tensor:
    """nvfp4 scale codes (`encode_nvfp4_scales`) -> float32 values."""
    c = codes.view(torch.uint8).to(torch.int32)
    v = ((c << 20) + ((127 - NV_SCALE_CODE_BIAS) << 23)).view(torch.float32)
    return torch.where(c == 0, torch.zeros_like(v), v)


def untile_fp4_rows(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of `tile_fp4_rows`."""
    E, R, KB = tiled.shape
    t = tiled.reshape(E, R // FP4_TILE_ROWS, KB // 32, FP4_TILE_ROWS, 32).permute(0, 1, 3, 2, 4)
    return t.contiguous().reshape(E, R, KB)


def unpermute_fp4_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute_fp4_words`."""
    w = words.contiguous().view(torch.int32).reshape(-1)
    acc = torch.zeros_like(w)
    for src_bit, dst in _fp4_word_moves():
        acc |= ((w >> dst) & 1) << src_bit
    return acc.view(torch.uint8).reshape(words.shape)


# --------------------------------------------------------------------------- ExpertWeights


def quantize_expert_weights(weights: ExpertWeights, mode: str) -> ExpertWeights:
    """Float canonical weights -> quantized canonical `ExpertWeights` (format set) for `mode`:
    fp8_block 128x128 (padded edges), nvfp4 (global scale per expert and projection, the
    `epmoe.quant.nvfp4` recipe), mxfp4 (OCP floor scales). Biases are kept as they are."""
    fmt = FORMAT_OF_MODE.get(mode)
    if fmt is None:
        raise ValueError(f"mode {mode!r} has no quantized weight format; use one of {sorted(FORMAT_OF_MODE)}")
    if weights.is_quantized:
        raise ValueError(f"weights are already quantized ({weights.format}); pass float weights")
    fields = {}
    for name in ("w1", "w3", "w2"):
        w = getattr(weights, name)
        if w is None:
            continue
        if fmt == "fp8_block":
            fields[name], fields[name + "_scale"] = quantize_fp8_block(w)
        elif fmt == "mxfp4":
            t = mxfp4.quantize(w)
            fields[name], fields[name + "_scale"] = t.packed, t.scales
        else:
            # One global scale per expert: the codec's is the quantization multiplier 2688 / amax;
            # ExpertWeights keeps the dequantization factor (its inverse).
            E = w.shape[0]
            gs = torch.stack([nvfp4.compute_global_scale(w[e]) for e in range(E)])
            t = nvfp4.quantize(w, gs[:, None].expand(w.shape[:-1]).contiguous())
            fields[name], fields[name + "_scale"] = t.packed, t.scales
            fields[name + "_global_scale"] = (1.0 / gs).to(torch.float32)
    return replace(weights, format=fmt, **fields)


# One dequantization of canonical expert weights for every format: epmoe.quant.weights (re-exported).
from epmoe.quant.weights import dequantize_expert_weights  # noqa: E402,F401


def kernel_tensors(weights: ExpertWeights, gated: bool, device: torch.device) -> dict:
    """Quantized canonical `ExpertWeights` -> the kernel-layout tensors (new storage on `device`)."""
    fmt = weights.format

    def own(t: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return torch.empty(t.shape, dtype=dtype or t.dtype, device=device).copy_(t)

    def cat(a, b):
        return own(a) if b is None else torch.cat([a.to(device), b.to(device)], dim=1).contiguous()

    w3 = weights.w3 if gated else None
    w3s = weights.w3_scale if gated else None
    out = {
        "w13": cat(weights.w1, w3),
        "w13_scale": cat(weights.w1_scale, w3s),
        "w2": own(weights.w2),
        "w2_scale": own(weights.w2_scale),
    }
    if fmt == "fp8_block":
        for k in ("w13", "w2"):
            if out[k].dtype == torch.uint8:
                out[k] = out[k].view(torch.float8_e4m3fn)
    if fmt == "nvfp4":
        for k in ("w13_scale", "w2_scale"):
            if out[k].dtype == torch.uint8:
                out[k] = out[k].view(torch.float8_e4m3fn)
        gs = [weights.w1_global_scale] + ([weights.w3_global_scale] if gated else [])
        out["w13_global_scale"] = torch.stack([g.to(device, torch.float32) for g in gs], dim=1).contiguous()
        out["w2_global_scale"] = own(weights.w2_global_scale, torch.float32).reshape(-1, 1)
    if fmt in ("nvfp4", "mxfp4"):
        out["w13"] = interleave_fp4_k64(out["w13"])
        out["w2"] = interleave_fp4_k64(out["w2"])
    return out
