"""MXFP8 (OCP Microscaling v1.0, E4M3 elements): one E8M0 shared scale per 32 values (pure torch).

Layout:
    data    float8_e4m3fn [..., H]
    scales  uint8 [..., H / 32]     E8M0 biased exponent: scale = 2^(code - 127); 255 = NaN

Scale rounding (`scale_rounding`):
    "floor" (default, OCP MX v1.0): shared exponent = floor(log2(amax)) - 8 (8 = emax of E4M3);
            values of blocks whose amax lies in (448, 512) * 2^k saturate to +-448.
    "ceil"  (FlashInfer / TRT-LLM `mxfp8_quantize`): scale = 2^ceil(log2(amax * fl32(1/448))).
Elements: clamp(x / scale, -448, 448) cast to E4M3 (round-to-nearest-even, subnormals kept).

Special values: zeros -> code 0 and zero elements; +-inf saturates (scale 2^127, element +-448,
which dequantizes to +-inf in float32);
NaN poisons its block (scale code 255 -> the whole block dequantizes to NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from epmoe.quant._common import (
    E4M3_MAX,
    blocks,
    check_dequant_dtype,
    check_quantize_input,
    e8m0_from_amax,
    e8m0_to_float,
)

BLOCK_SIZE = 32
ELEM_EMAX = 8  # E4M3 largest exponent: 448 = 1.75 * 2^8
DATA_DTYPE = torch.float8_e4m3fn


class MXFP8Tensor(NamedTuple):
    """data float8_e4m3fn [..., H]; scales uint8 E8M0 [..., H/32]."""

    data: torch.Tensor
    scales: torch.Tensor


def quantize(x: torch.Tensor, *, scale_rounding: str = "floor") -> MXFP8Tensor:
    """Quantize x [..., H] (bf16/fp16/fp32, H % 32 == 0) to MXFP8; see the module docstring."""
    check_quantize_input(x, BLOCK_SIZE, "mxfp8")
    xb = blocks(x, BLOCK_SIZE)
    amax = xb.abs().amax(dim=-1)
    code = e8m0_from_amax(amax, ELEM_EMAX, E4M3_MAX, scale_rounding)
    scale = e8m0_to_float(code)
    q = (xb / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(DATA_DTYPE)
    return MXFP8Tensor(q.reshape(*x.shape), code)


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """data float8_e4m3fn (or its uint8 bytes) [..., H], scales uint8 [..., H/32] -> [..., H] `dtype`."""
    check_dequant_dtype(dtype, "mxfp8")
    if data.dtype == torch.uint8:
        data = data.view(DATA_DTYPE)
    if data.dtype != DATA_DTYPE:
        raise TypeError(f"mxfp8 data must be float8_e4m3fn (or its uint8 bytes), got {data.dtype}")
    H = data.shape[-1]
    if H % BLOCK_SIZE:
        raise ValueError(f"mxfp8 rows hold {H} values, not a multiple of {BLOCK_SIZE}")
    nb = H // BLOCK_SIZE
    if scales.shape != (*data.shape[:-1], nb):
        raise ValueError(
            f"mxfp8 scales have shape {list(scales.shape)}; expected {[*data.shape[:-1], nb]} "
            f"for data of shape {list(data.shape)}"
        )
    vals = data.to(torch.float32).reshape(*data.shape[:-1], nb, BLOCK_SIZE)
    out = vals * e8m0_to_float(scales).unsqueeze(-1)
    return out.reshape(data.shape).to(dtype)
