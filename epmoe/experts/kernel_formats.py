"""Quantized weight formats of the Hopper experts backends, with plain-torch quantizers and
dequantizers (device-agnostic; run once at `load_weights`, never per forward).

Formats (canonical, checkpoint-style; what `load_quantized` accepts):

    fp8_block   q [E, R, C] float8_e4m3fn, scale [E, ceil(R/128), ceil(C/128)] float32;
                dequant w[e, r, c] = q[e, r, c] * scale[e, r // 128, c // 128]
                (DeepSeek-V3 `weight_scale_inv`; the gated w13 keeps one scale grid per half, so a
                 128-row block never mixes gate and up rows: scale [E, 2 * ceil(I/128), ...])
    nvfp4       packed [E, R, C/2] uint8 (e2m1 codes, element 2j in the LOW nibble of byte j),
                scale [E, R, C/16] float8_e4m3fn, global_scale [E, G] float32 (G = 2 for w13: gate,
                up; 1 for w2 / relu2);  dequant = e2m1 * float(scale) * global_scale[e, half]
    mxfp4       packed [E, R, C/2] uint8 as above, scale [E, R, C/32] uint8 e8m0 (2^(s - 127));
                dequant = e2m1 * 2^(s - 127)
    e2m1 code   bit 3 sign, bits 2..1 exponent, bit 0 mantissa: magnitudes 0 0.5 1 1.5 2 3 4 6

Kernel-facing fp4 layout (`interleave_fp4_k64`): the Triton kernels read fp4 weights in blocks of 64
K-elements, where byte j (0 <= j < 32) of block b holds element 64b + j in its low nibble and
element 64b + 32 + j in its high nibble, so a K-tile splits into two contiguous halves with no
register shuffles. Scales stay in their canonical layout. C must be a multiple of 64.

Activation format of fp8_block (W8A8): per token, 1x128 groups along H: q [N, H] e4m3,
scale [N, ceil(H/128)] float32, scale = amax / 448 (amax floored at 1e-12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FP8_MAX = 448.0
FP8_BLOCK = 128
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP4_K_INTERLEAVE = 64
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_SCALE_FLOOR = 1e-12


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- fp8 block


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK):
    """w [E, R, C] float -> (q [E, R, C] float8_e4m3fn, scale [E, ceil(R/b), ceil(C/b)] float32)."""
    E, R, C = w.shape
    Rp, Cp = _cdiv(R, block) * block, _cdiv(C, block) * block
    wf = torch.zeros(E, Rp, Cp, dtype=torch.float32, device=w.device)
    wf[:, :R, :C] = w.float()
    blocks = wf.view(E, Rp // block, block, Cp // block, block)
    amax = blocks.abs().amax(dim=(2, 4))
    scale = amax.clamp_min(_SCALE_FLOOR) / FP8_MAX
    q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(E, Rp, Cp)[:, :R, :C].to(torch.float8_e4m3fn).contiguous()
    return q, scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of `quantize_fp8_block` (float32)."""
    E, R, C = q.shape
    s = scale.repeat_interleave(block, dim=1)[:, :R].repeat_interleave(block, dim=2)[:, :, :C]
    return q.float() * s


def quantize_fp8_gated_w13(w1: torch.Tensor, w3: Optional[torch.Tensor]):
    """Gate and up quantized separately (their own 128x128 grids), concatenated along rows:
    q [E, 2I, H], scale [E, 2 * ceil(I/128), ceil(H/128)] (gate grid first)."""
    qg, sg = quantize_fp8_block(w1)
    if w3 is None:
        return qg, sg
    qu, su = quantize_fp8_block(w3)
    return torch.cat([qg, qu], dim=1).contiguous(), torch.cat([sg, su], dim=1).contiguous()


def dequantize_fp8_gated_w13(q: torch.Tensor, scale: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return dequantize_fp8_block(q, scale)
    I = q.shape[1] // 2
    SI = scale.shape[1] // 2
    return torch.cat(
        [dequantize_fp8_block(q[:, :I], scale[:, :SI]), dequantize_fp8_block(q[:, I:], scale[:, SI:])],
        dim=1,
    )


def quantize_fp8_tokens(x: torch.Tensor, group: int = FP8_BLOCK):
    """x [N, C] -> (q [N, C] float8_e4m3fn, scale [N, ceil(C/group)] float32), 1 x group blocks."""
    N, C = x.shape
    Cp = _cdiv(C, group) * group
    xf = torch.zeros(N, Cp, dtype=torch.float32, device=x.device)
    xf[:, :C] = x.float()
    g = xf.view(N, Cp // group, group)
    scale = g.abs().amax(dim=2).clamp_min(_SCALE_FLOOR) / FP8_MAX
    q = (g / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(N, Cp)[:, :C]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_fp8_tokens(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_BLOCK) -> torch.Tensor:
    C = q.shape[1]
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :C]


# --------------------------------------------------------------------------- e2m1


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> e2m1 codes (uint8 in [0, 16)), round to nearest, ties to even, saturating at 6."""
    a = x.abs().float()
    # Boundaries between neighbouring magnitudes; `>=` where the upper neighbour has the even code.
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8) -> float32."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=code.device)
    return table[code.long()]


def pack_e2m1(code: torch.Tensor) -> torch.Tensor:
    """[..., C] codes -> [..., C/2] uint8, element 2j in the low nibble of byte j."""
    if code.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even last dimension, got {code.shape[-1]}")
    c = code.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., C/2] uint8 -> [..., C] codes."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def interleave_fp4_k64(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packing [..., C/2] -> kernel packing (see module docstring). C % 64 == 0."""
    C = packed.shape[-1] * 2
    if C % FP4_K_INTERLEAVE:
        raise ValueError(f"fp4 kernel layout needs K % {FP4_K_INTERLEAVE} == 0, got K={C}")
    codes = unpack_e2m1(packed).reshape(*packed.shape[:-1], C // 64, 2, 32)
    out = codes[..., 0, :] | (codes[..., 1, :] << 4)
    return out.reshape(*packed.shape[:-1], C // 2).contiguous()


def deinterleave_fp4_k64(kpacked: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_fp4_k64`."""
    C = kpacked.shape[-1] * 2
    b = kpacked.reshape(*kpacked.shape[:-1], C // 64, 32)
    codes = torch.stack([b & 0xF, b >> 4], dim=-2).reshape(*kpacked.shape[:-1], C)
    return pack_e2m1(codes)


# --------------------------------------------------------------------------- nvfp4 / mxfp4


def quantize_nvfp4(w: torch.Tensor, global_scale: Optional[torch.Tensor] = None):
    """w [E, R, C] -> (packed [E, R, C/2] uint8, scale [E, R, C/16] e4m3, global_scale [E] f32).

    global_scale (dequant multiplier) defaults to amax(w[e]) / (6 * 448), so block scales use
    e4m3's range."""
    E, R, C = w.shape
    if C % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs K % {NVFP4_BLOCK} == 0, got K={C}")
    wf = w.float()
    if global_scale is None:
        global_scale = wf.abs().amax(dim=(1, 2)).clamp_min(_SCALE_FLOOR) / (6.0 * FP8_MAX)
    gs = global_scale.float().view(E, 1, 1)
    blocks = wf.view(E, R, C // NVFP4_BLOCK, NVFP4_BLOCK)
    bscale = (blocks.abs().amax(dim=3) / 6.0 / gs).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = bscale.float() * gs
    vals = torch.where(denom[..., None] > 0, blocks / denom[..., None], torch.zeros_like(blocks))
    codes = e2m1_encode(vals).view(E, R, C)
    return pack_e2m1(codes), bscale.contiguous(), global_scale.float().contiguous()


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    E, R, C2 = packed.shape
    vals = e2m1_decode(unpack_e2m1(packed)).view(E, R, C2 * 2 // NVFP4_BLOCK, NVFP4_BLOCK)
    out = vals * scale.float()[..., None] * global_scale.float().view(E, 1, 1, 1)
    return out.view(E, R, C2 * 2)


def quantize_mxfp4(w: torch.Tensor):
    """w [E, R, C] -> (packed [E, R, C/2] uint8, scale [E, R, C/32] uint8 e8m0).

    OCP MX: shared exponent floor(log2(amax)) - 2 (e2m1's largest exponent), values saturate at 6."""
    E, R, C = w.shape
    if C % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 needs K % {MXFP4_BLOCK} == 0, got K={C}")
    blocks = w.float().view(E, R, C // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=3)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2
    exp = exp.clamp(-127, 127)
    codes = e2m1_encode(blocks / torch.exp2(exp)[..., None]).view(E, R, C)
    return pack_e2m1(codes), (exp + 127).to(torch.uint8).contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    E, R, C2 = packed.shape
    vals = e2m1_decode(unpack_e2m1(packed)).view(E, R, C2 * 2 // MXFP4_BLOCK, MXFP4_BLOCK)
    out = vals * torch.exp2(scale.float() - 127.0)[..., None]
    return out.view(E, R, C2 * 2)


# --------------------------------------------------------------------------- containers


@dataclass(frozen=True)
class QuantizedExpertTensor:
    """One quantized projection of all local experts, canonical layout (module docstring).

    format:       "fp8_block" | "nvfp4" | "mxfp4"
    data:         fp8 [E, R, C] or packed uint8 [E, R, C/2]
    scale:        block scales (see format)
    global_scale: nvfp4 only, [E, G] float32 (G = 2 for gated w13: gate, up)
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    global_scale: Optional[torch.Tensor] = None

    def dequantize(self, gated_w13: bool = False) -> torch.Tensor:
        """float32 [E, R, C]."""
        if self.format == "fp8_block":
            return dequantize_fp8_gated_w13(self.data, self.scale, gated_w13)
        if self.format == "mxfp4":
            return dequantize_mxfp4(self.data, self.scale)
        if self.format == "nvfp4":
            gs = self.global_scale.float()
            if gated_w13 and gs.shape[-1] == 2:
                R = self.data.shape[1] // 2
                return torch.cat(
                    [
                        dequantize_nvfp4(self.data[:, :R], self.scale[:, :R], gs[:, 0]),
                        dequantize_nvfp4(self.data[:, R:], self.scale[:, R:], gs[:, 1]),
                    ],
                    dim=1,
                )
            return dequantize_nvfp4(self.data, self.scale, gs[:, 0] if gs.dim() == 2 else gs)
        raise ValueError(f"unknown quantized format {self.format!r}")


@dataclass(frozen=True)
class QuantizedExpertWeights:
    """Quantized local experts: w13 ([gate; up] rows, or gate only for relu2) and w2, plus float
    biases. Produced by `quantize_expert_weights` or by a checkpoint loader."""

    w13: QuantizedExpertTensor
    w2: QuantizedExpertTensor
    b13: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    first_expert: int = 0

    @property
    def num_experts(self) -> int:
        return self.w13.data.shape[0]


WEIGHT_FORMAT_OF_MODE = {
    "fp8_block": "fp8_block",
    "nvfp4_w4a16": "nvfp4",
    "mxfp4_w4a16": "mxfp4",
}


def quantize_expert_weights(weights, mode: str) -> QuantizedExpertWeights:
    """Canonical float `ExpertWeights` -> `QuantizedExpertWeights` for `mode`."""
    fmt = WEIGHT_FORMAT_OF_MODE.get(mode)
    if fmt is None:
        raise ValueError(f"mode {mode!r} has no quantized weight format; use one of {sorted(WEIGHT_FORMAT_OF_MODE)}")
    w1, w3, w2 = weights.w1, weights.w3, weights.w2
    if fmt == "fp8_block":
        q13, s13 = quantize_fp8_gated_w13(w1, w3)
        q2, s2 = quantize_fp8_block(w2)
        t13 = QuantizedExpertTensor(fmt, q13, s13)
        t2 = QuantizedExpertTensor(fmt, q2, s2)
    elif fmt == "nvfp4":
        parts = [quantize_nvfp4(w1)] + ([quantize_nvfp4(w3)] if w3 is not None else [])
        t13 = QuantizedExpertTensor(
            fmt,
            torch.cat([p[0] for p in parts], dim=1).contiguous(),
            torch.cat([p[1] for p in parts], dim=1).contiguous(),
            torch.stack([p[2] for p in parts], dim=1).contiguous(),
        )
        p2 = quantize_nvfp4(w2)
        t2 = QuantizedExpertTensor(fmt, p2[0], p2[1], p2[2][:, None].contiguous())
    else:
        parts = [quantize_mxfp4(w1)] + ([quantize_mxfp4(w3)] if w3 is not None else [])
        t13 = QuantizedExpertTensor(
            fmt,
            torch.cat([p[0] for p in parts], dim=1).contiguous(),
            torch.cat([p[1] for p in parts], dim=1).contiguous(),
        )
        p2 = quantize_mxfp4(w2)
        t2 = QuantizedExpertTensor(fmt, p2[0], p2[1])
    return QuantizedExpertWeights(t13, t2, weights.b13, weights.b2, weights.first_expert)
