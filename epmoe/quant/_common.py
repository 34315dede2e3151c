"""Small helpers shared by the format modules (input checks, E8M0 scales)."""

from __future__ import annotations

import torch

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
E4M3_MAX = 448.0
# Input dtypes the reference quantizers accept (computation is always float32).
QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_quantize_input(x: torch.Tensor, block: int, fmt: str) -> None:
    """TypeError for a non-float input, ValueError for a last dim that is not a multiple of `block`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fmt}.quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in QUANTIZABLE_DTYPES:
        raise TypeError(
            f"{fmt}.quantize got dtype {x.dtype}; pass bfloat16, float16 or float32 values "
            "(quantized dtypes cannot be re-quantized directly: dequantize first)"
        )
    if x.dim() == 0:
        raise ValueError(f"{fmt}.quantize needs at least 1 dimension, got a scalar")
    if x.shape[-1] % block:
        raise ValueError(
            f"{fmt}: last dimension {x.shape[-1]} is not a multiple of the block size {block}; "
            f"pad the hidden size to a multiple of {block}"
        )


def blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 view [..., H / block, block] of x [..., H]."""
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def check_dequant_dtype(dtype: torch.dtype, fmt: str) -> None:
    if dtype not in QUANTIZABLE_DTYPES:
        raise TypeError(f"{fmt}.dequantize: output dtype {dtype} is not a float dtype; use bfloat16/float16/float32")


# ---------------------------------------------------------------- E8M0 (OCP MX shared scale)
E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_ROUNDINGS = ("floor", "ceil")


def e8m0_from_amax(amax: torch.Tensor, elem_emax: int, elem_max: float, rounding: str) -> torch.Tensor:
    """Biased E8M0 exponent (uint8) for block maxima `amax` (float32, >= 0 or NaN).

    "floor" (OCP MX v1.0): e = floor(log2(amax)) - elem_emax; the largest element may then exceed
            the element format's max and saturates.
    "ceil"  (FlashInfer / TRT-LLM kernels): e = ceil(log2(amax * fl32(1 / elem_max))), i.e. the
            smallest power of two that keeps every element in range (no saturation).
    Both clamp to [-127, 127] (codes 0..254). amax == 0 -> code 0; NaN -> 255 (NaN scale);
    +inf -> 254 (saturating, like `__NV_SATFINITE`).
    """
    if rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding={rounding!r}; use one of {SCALE_ROUNDINGS}")
    finite = torch.isfinite(amax)
    a = torch.where(finite, amax, torch.zeros_like(amax))
    if rounding == "floor":
        mant, exp = torch.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1)
        e = exp.to(torch.int32) - 1 - elem_emax
    else:
        v = a * torch.tensor(1.0 / elem_max, dtype=torch.float32)
        mant, exp = torch.frexp(v)
        # v is an exact power of two iff mant == 0.5; otherwise round the exponent up.
        e = torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)
    code = (e + E8M0_BIAS).clamp(0, 254)
    code = torch.where(a == 0, torch.zeros_like(code), code)
    code = torch.where(torch.isinf(amax), torch.full_like(code, 254), code)
    code = torch.where(torch.isnan(amax), torch.full_like(code, E8M0_NAN), code)
    return code.to(torch.uint8)


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes -> float32 2^(code - 127); 255 -> NaN.

    Built from bits, so it is exact on every device: codes 1..254 are the float32 exponent field
    itself, code 0 is the float32 subnormal 2^-127 (bit pattern 0x00400000)."""
    if code.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 (biased exponent), got {code.dtype}")
    c = code.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
    val = bits.view(torch.float32)
    return torch.where(code == E8M0_NAN, torch.full_like(val, float("nan")), val)
