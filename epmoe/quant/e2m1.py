"""FP4 E2M1 element codec shared by NVFP4 and MXFP4 (pure torch, any device).

E2M1: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit; no inf, no NaN.

    code (low 3 bits)   0    1    2    3    4    5    6    7
    magnitude           0    0.5  1    1.5  2    3    4    6        bit 3 = sign

Rounding (`float_to_e2m1_codes`): round-to-nearest, ties to the even code (even mantissa), the
same as PTX `cvt.rn.satfinite.e2m1x2.f32` and TRT-LLM's host `floatToE2M1`:
    tie 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
|v| > 6 (and +-inf) saturates to +-6. The sign is the input's sign bit, so -0.0 and negative values
that round to zero give code 8 (-0). NaN gives code 0: the block codecs poison a block containing
NaN through its *scale* instead (see nvfp4 / mxfp4).

Packing (`pack_nibbles`): two codes per byte, element 2i in the low nibble and 2i+1 in the high
nibble (FlashInfer / TRT-LLM `FLOAT4_E2M1X2`).
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoint between code i-1 and code i, for i = 1..7.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Midpoints where a tie rounds *up* (to the even code i = 2, 4, 6).
_TIES_UP = (0.75, 1.75, 3.5)

_lut_cache: dict = {}


def e2m1_lut(device: torch.device) -> torch.Tensor:
    """[16] float32: value of each 4-bit code (code 8 is -0.0)."""
    key = torch.device(device)
    if key not in _lut_cache:
        vals = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
        _lut_cache[key] = torch.tensor(vals, dtype=torch.float32, device=key)
    return _lut_cache[key]


def float_to_e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """Round float32 `values` (any shape, already divided by their block scale) to E2M1 codes.

    Returns uint8 codes of the same shape, values 0..15 (bit 3 = sign). See the module docstring
    for rounding, saturation, signed zero and NaN.
    """
    if values.dtype != torch.float32:
        raise TypeError(f"float_to_e2m1_codes expects float32 values, got {values.dtype}")
    mag = values.abs()
    boundaries = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=values.device)
    # bucketize(right=False) counts the midpoints strictly below |v| (ties stay below) ...
    codes = torch.bucketize(mag, boundaries, right=False)
    # ... and a tie at a midpoint whose upper neighbour is even rounds up.
    ties_up = (mag == _TIES_UP[0]) | (mag == _TIES_UP[1]) | (mag == _TIES_UP[2])
    codes = codes + ties_up.to(codes.dtype)
    codes = codes.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)
    return torch.where(torch.isnan(values), torch.zeros_like(codes), codes)


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) -> float32 values of the same shape."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"e2m1 codes must be uint8, got {codes.dtype}")
    return e2m1_lut(codes.device)[(codes & 0xF).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> packed uint8 [..., n] (element 2i in the low nibble)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of fp4 values per row")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., n] -> codes uint8 [..., 2n] (inverse of `pack_nibbles`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed fp4 data must be uint8, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
