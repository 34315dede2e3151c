"""MXFP4 (OCP Microscaling v1.0): FP4 E2M1 values, one E8M0 shared scale per 32 values (pure torch).

Layout:
    packed  uint8 [..., H / 2]     two E2M1 codes per byte, element 2i in the low nibble
    scales  uint8 [..., H / 32]    E8M0 biased exponent: scale = 2^(code - 127); 255 = NaN

Scale rounding (`scale_rounding`):
    "floor" (default, OCP MX v1.0 section 6.3): shared exponent = floor(log2(amax)) - 2 (2 = emax of
            E2M1). Blocks whose amax lies in (6, 8) * 2^k saturate their largest values to +-6.
    "ceil"  (FlashInfer / TRT-LLM `fp4_quantize(sf_use_ue8m0=True)`): scale = 2^ceil(log2(amax/6)),
            never saturates, one binade coarser for those blocks.
Elements: x / scale (exact: the scale is a power of two) rounded to E2M1, round-to-nearest-even,
saturating at +-6.

Special values:
    zeros      an all-zero block gets code 0 (2^-127) and zero elements -> dequantizes to 0.
    subnormals the shared exponent clamps at -127; E2M1's subnormal 0.5 is used; smaller values
               round to +-0.
    +-inf      saturates: the block scale is 2^127 (code 254), the inf element +-6 (which
               dequantizes to 6 * 2^127, i.e. +-inf in float32); the block's finite values -> 0.
    NaN        poisons its block: scale code 255, the whole block dequantizes to NaN.
Known difference from FlashInfer's kernel in "ceil" mode: for blocks with amax <= 6 * 2^-127 the kernel
multiplies by 1 instead of 2^127 (all zeros), this reference keeps the values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from epmoe.quant._common import (
    blocks,
    check_dequant_dtype,
    check_quantize_input,
    e8m0_from_amax,
    e8m0_to_float,
)
from epmoe.quant.e2m1 import E2M1_MAX, e2m1_codes_to_float, float_to_e2m1_codes, pack_nibbles, unpack_nibbles

BLOCK_SIZE = 32
ELEM_EMAX = 2  # E2M1 largest exponent: 6 = 1.5 * 2^2


class MXFP4Tensor(NamedTuple):
    """packed uint8 [..., H/2]; scales uint8 E8M0 [..., H/32]."""

    packed: torch.Tensor
    scales: torch.Tensor


def quantize(x: torch.Tensor, *, scale_rounding: str = "floor") -> MXFP4Tensor:
    """Quantize x [..., H] (bf16/fp16/fp32, H % 32 == 0) to MXFP4; see the module docstring."""
    check_quantize_input(x, BLOCK_SIZE, "mxfp4")
    xb = blocks(x, BLOCK_SIZE)
    amax = xb.abs().amax(dim=-1)
    code = e8m0_from_amax(amax, ELEM_EMAX, E2M1_MAX, scale_rounding)
    scale = e8m0_to_float(code)
    codes = float_to_e2m1_codes(xb / scale.unsqueeze(-1))
    return MXFP4Tensor(pack_nibbles(codes.reshape(*x.shape)), code)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., H/2], scales uint8 [..., H/32] -> [..., H] `dtype` (e2m1 * 2^(code-127))."""
    check_dequant_dtype(dtype, "mxfp4")
    if packed.dtype != torch.uint8:
        raise TypeError(f"mxfp4 packed data must be uint8, got {packed.dtype}")
    H = packed.shape[-1] * 2
    if H % BLOCK_SIZE:
        raise ValueError(f"mxfp4 packed rows hold {H} values, not a multiple of {BLOCK_SIZE}")
    nb = H // BLOCK_SIZE
    if scales.shape != (*packed.shape[:-1], nb):
        raise ValueError(
            f"mxfp4 scales have shape {list(scales.shape)}; expected {[*packed.shape[:-1], nb]} "
            f"for packed data of shape {list(packed.shape)}"
        )
    vals = e2m1_codes_to_float(unpack_nibbles(packed)).reshape(*packed.shape[:-1], nb, BLOCK_SIZE)
    out = vals * e8m0_to_float(scales).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], H).to(dtype)
