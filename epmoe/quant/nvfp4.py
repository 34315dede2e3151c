"""NVFP4: FP4 E2M1 values, one FP8-E4M3 scale per 16 values, one FP32 global scale (pure torch).

Layout (FlashInfer / TRT-LLM compatible):
    packed        uint8 [..., H / 2]                    two E2M1 codes per byte, element 2i in the
                                                        low nibble (see `epmoe.quant.e2m1`)
    scales        float8_e4m3fn [..., H / 16]           linear layout, or the 128x4 swizzled layout
                                                        (`swizzle_scales_128x4`) the kernels consume
    global_scale  float32, 0-dim (one per tensor) or [...] (one per row)

Convention: global_scale = 448 * 6 / amax(|x|) (FlashInfer's `fp4_quantize` input), so block scales
use the full E4M3 range. Dequantization:  x ~= e2m1 * (float(scale) * (1 / global_scale)).

Quantization recipe (`recipe="rn"`, the default) reproduces FlashInfer's CUDA kernel with
FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1 (TransformerEngine's recipe) operation for operation, all
float32 round-to-nearest-even:
    amax    = max |x| over the 16-value block
    sf      = e4m3_satfinite(amax * (global_scale * fl32(1/6)))            (amax == 0 -> 0)
    out_scl = min(1 / (float(sf) * (1 / global_scale)), FLT_MAX)          (amax == 0 -> 0)
    code    = e2m1_rn_satfinite(x * out_scl)
`recipe="fast"` follows the default (fast-math) kernel's association order,
global_scale * (amax * fl32(1/6)) and 1 / (float(sf) * (1 / global_scale)), with IEEE reciprocals;
the kernel uses `rcp.approx.ftz` (<= 1 ulp), so it can differ from "fast" in rare last-bit cases.

Special values (stated policy; the GPU test compares finite inputs only):
    zeros      an all-zero block has scale 0 and codes 0 (dequantizes to exact zeros); an all-zero
               tensor gets global_scale = 1.
    subnormals E4M3 subnormal block scales are used as is (no flush); values that fall below the
               E2M1 grid round to +-0.
    +-inf      saturates: the block scale becomes 448 (E4M3 max), the inf element +-6.
    overflow   block scales above 448 saturate to 448 (global_scale too small), elements to +-6.
    NaN        poisons its block: the block's scale is E4M3 NaN (0x7F), so every value of that block
               dequantizes to NaN; other blocks are unaffected. A tensor whose amax is NaN or inf
               gets global_scale = 1 when it is computed here. (FlashInfer's kernel instead drops
               NaN from the block max; inputs with NaN are a bug upstream either way.)
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from epmoe.quant._common import (
    E4M3_MAX,
    FLOAT32_MAX,
    blocks,
    check_dequant_dtype,
    check_quantize_input,
)
from epmoe.quant.e2m1 import E2M1_MAX, e2m1_codes_to_float, float_to_e2m1_codes, pack_nibbles, unpack_nibbles

BLOCK_SIZE = 16
SCALE_DTYPE = torch.float8_e4m3fn
GLOBAL_AMAX = E4M3_MAX * E2M1_MAX  # 2688 = 448 * 6
RECIPES = ("rn", "fast")
SCALE_LAYOUTS = ("linear", "swizzled_128x4")


class NVFP4Tensor(NamedTuple):
    """packed uint8 [..., H/2]; scales float8_e4m3fn [..., H/16] (linear) or [Mp, Kp] (swizzled);
    global_scale float32 (0-dim, or one per row)."""

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor


def compute_global_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 0-dim: 448 * 6 / amax(|x|); 1.0 when amax is 0, inf or NaN (see module docstring)."""
    amax = x.detach().abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
    gs = torch.tensor(GLOBAL_AMAX, dtype=torch.float32, device=x.device) / amax
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, gs, torch.ones_like(gs))


def compute_row_global_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 [...]: 448 * 6 / amax(|row|) per row of x [..., H] (1.0 for rows whose amax is 0, inf
    or NaN). A row's quantization then depends on that row only, not on the batch it travels in."""
    amax = x.detach().abs().amax(dim=-1).to(torch.float32) if x.shape[-1] else torch.zeros(x.shape[:-1], device=x.device)
    gs = torch.tensor(GLOBAL_AMAX, dtype=torch.float32, device=x.device) / amax
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, gs, torch.ones_like(gs))


def _as_global_scale(global_scale, rows_shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Normalise a user global scale to float32, either 0-dim or `rows_shape` (one per row)."""
    if isinstance(global_scale, (int, float)):
        return torch.tensor(float(global_scale), dtype=torch.float32, device=device)
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(f"global_scale must be a float or a float32 tensor, got {type(global_scale).__name__}")
    if not global_scale.is_floating_point():
        raise TypeError(f"global_scale has dtype {global_scale.dtype}; expected float32")
    gs = global_scale.to(device=device, dtype=torch.float32)
    if gs.numel() == 1:
        return gs.reshape(())
    if gs.shape != rows_shape:
        if gs.numel() == rows_shape.numel():
            return gs.reshape(rows_shape)
        raise ValueError(
            f"global_scale has shape {list(global_scale.shape)}; expected one value (shape [] or [1]) "
            f"or one per row (shape {list(rows_shape)})"
        )
    return gs


def quantize(
    x: torch.Tensor,
    global_scale: Optional[Union[torch.Tensor, float]] = None,
    *,
    scale_layout: str = "linear",
    recipe: str = "rn",
) -> NVFP4Tensor:
    """Quantize x [..., H] (bf16/fp16/fp32, H % 16 == 0) to NVFP4.

    global_scale: None -> `compute_global_scale(x)`; a float / 0-dim / [1] tensor; or one per row
                  (shape x.shape[:-1]), like FlashInfer's per-token global scale.
    scale_layout: "linear" -> scales [..., H/16]; "swizzled_128x4" -> rows (all leading dims
                  flattened, like `fp4_quantize`) padded to 128, scale columns to 4: [Mp, Kp].
    Returns NVFP4Tensor(packed, scales, global_scale); it unpacks as a 3-tuple.
    """
    check_quantize_input(x, BLOCK_SIZE, "nvfp4")
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}; use one of {RECIPES}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r}; use one of {SCALE_LAYOUTS}")
    rows_shape = x.shape[:-1]
    gs = compute_global_scale(x) if global_scale is None else _as_global_scale(global_scale, rows_shape, x.device)
    xb = blocks(x, BLOCK_SIZE)  # [..., nb, 16] float32
    gsb = gs.reshape(*gs.shape, 1) if gs.dim() else gs  # broadcast over blocks

    amax = xb.abs().amax(dim=-1)  # NaN propagates: poisons the block
    one_sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32, device=x.device)
    if recipe == "rn":
        sf_f = amax * (gsb * one_sixth)
    else:
        sf_f = gsb * (amax * one_sixth)
    sf_f = torch.where(amax == 0, torch.zeros_like(sf_f), sf_f)
    # Saturating E4M3 cast (__NV_SATFINITE): clamp keeps NaN, then round to nearest even.
    sf = sf_f.clamp(max=E4M3_MAX).to(SCALE_DTYPE)
    sf_dec = sf.to(torch.float32)
    inv_gs = 1.0 / gsb
    out_scale = 1.0 / (sf_dec * inv_gs)
    if recipe == "rn":
        out_scale = out_scale.clamp(max=FLOAT32_MAX)
    out_scale = torch.where(amax == 0, torch.zeros_like(out_scale), out_scale)
    codes = float_to_e2m1_codes(xb * out_scale.unsqueeze(-1))
    packed = pack_nibbles(codes.reshape(*x.shape))
    if scale_layout == "swizzled_128x4":
        sf = swizzle_scales_128x4(sf.reshape(-1, sf.shape[-1]))
    return NVFP4Tensor(packed, sf, gs)


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: Union[torch.Tensor, float],
    dtype: torch.dtype = torch.bfloat16,
    *,
    scale_layout: str = "linear",
) -> torch.Tensor:
    """packed uint8 [..., H/2], scales [..., H/16] (float8_e4m3fn, or its uint8 bytes) -> [..., H] dtype.

    Computes e2m1 * (float(scale) * (1 / global_scale)) in float32 (bit-identical to FlashInfer's
    host `e2m1_and_ufp8sf_scale_to_float` given the same 1 / global_scale), then casts to `dtype`.
    With scale_layout="swizzled_128x4", `scales` is the [Mp, Kp] (or flat) swizzled tensor for the
    rows of `packed` flattened to 2D.
    """
    check_dequant_dtype(dtype, "nvfp4")
    if packed.dtype != torch.uint8:
        raise TypeError(f"nvfp4 packed data must be uint8, got {packed.dtype}")
    if scales.dtype == torch.uint8:
        scales = scales.view(SCALE_DTYPE)
    if scales.dtype != SCALE_DTYPE:
        raise TypeError(f"nvfp4 scales must be float8_e4m3fn (or its uint8 bytes), got {scales.dtype}")
    if packed.dim() == 0:
        raise ValueError("nvfp4 packed data needs at least 1 dimension")
    H = packed.shape[-1] * 2
    if H % BLOCK_SIZE:
        raise ValueError(f"nvfp4 packed rows hold {H} values, not a multiple of {BLOCK_SIZE}")
    nb = H // BLOCK_SIZE
    if scale_layout == "swizzled_128x4":
        rows = packed.numel() // packed.shape[-1]
        scales = unswizzle_scales_128x4(scales, rows, nb).reshape(*packed.shape[:-1], nb)
    elif scale_layout != "linear":
        raise ValueError(f"scale_layout={scale_layout!r}; use one of {SCALE_LAYOUTS}")
    if scales.shape != (*packed.shape[:-1], nb):
        raise ValueError(
            f"nvfp4 scales have shape {list(scales.shape)}; expected {[*packed.shape[:-1], nb]} "
            f"for packed data of shape {list(packed.shape)}"
        )
    gs = _as_global_scale(global_scale, packed.shape[:-1], packed.device)
    inv_gs = 1.0 / (gs.reshape(*gs.shape, 1) if gs.dim() else gs)
    block_scale = scales.to(torch.float32) * inv_gs  # [..., nb]
    vals = e2m1_codes_to_float(unpack_nibbles(packed)).reshape(*packed.shape[:-1], nb, BLOCK_SIZE)
    out = vals * block_scale.unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], H).to(dtype)


# ------------------------------------------------------------------ 128x4 swizzled scale layout
def swizzled_offset_128x4(row: int, col: int, num_cols: int) -> int:
    """Flat offset of scale (row, col) in the 128x4 swizzled layout of a [rows, num_cols] scale matrix.

    TRT-LLM `get_sf_out_offset_128x4` / FlashInfer `block_scale_interleave`:
        ((row // 128) * ceil4(num_cols) / 4 + col // 4) * 512
        + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4
    """
    padded_cols = -(-num_cols // 4) * 4
    tile = (row // 128) * (padded_cols // 4) + col // 4
    return tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


def swizzled_shape_128x4(num_rows: int, num_cols: int) -> tuple:
    """(rows padded to 128, cols padded to 4): the 2D shape FlashInfer's `fp4_quantize` returns."""
    return (-(-num_rows // 128) * 128, -(-num_cols // 4) * 4)


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear block scales [..., M, C] -> 128x4 swizzled [..., Mp, Cp] (same dtype; pads with 0).

    2D input is one matrix (FlashInfer `block_scale_interleave` on [M, C]); a 3D input [E, M, C]
    swizzles each expert separately (flattened, the result equals `block_scale_interleave`'s 1D
    output). Row-major flattening of the result gives the byte order the kernels read.
    """
    if scales.dim() < 2:
        raise ValueError(f"scales must be at least 2D [rows, cols], got shape {list(scales.shape)}")
    dtype = scales.dtype
    s = scales.view(torch.uint8) if scales.element_size() == 1 and dtype != torch.uint8 else scales
    *lead, M, C = s.shape
    Mp, Cp = swizzled_shape_128x4(M, C)
    if (Mp, Cp) != (M, C):
        padded = s.new_zeros(*lead, Mp, Cp)
        padded[..., :M, :C] = s
        s = padded
    s = s.reshape(*lead, Mp // 128, 4, 32, Cp // 4, 4)
    nl = len(lead)
    s = s.permute(*range(nl), nl + 0, nl + 3, nl + 2, nl + 1, nl + 4).contiguous()
    s = s.reshape(*lead, Mp, Cp)
    return s.view(dtype) if s.dtype != dtype else s


def unswizzle_scales_128x4(swizzled: torch.Tensor, num_rows: int, num_cols: int) -> torch.Tensor:
    """Inverse of `swizzle_scales_128x4`: [..., Mp, Cp] or flat [..., Mp * Cp] -> [..., num_rows, num_cols]."""
    Mp, Cp = swizzled_shape_128x4(num_rows, num_cols)
    dtype = swizzled.dtype
    s = swizzled.view(torch.uint8) if swizzled.element_size() == 1 and dtype != torch.uint8 else swizzled
    if s.dim() >= 2 and tuple(s.shape[-2:]) == (Mp, Cp):
        lead = list(s.shape[:-2])
    elif s.dim() >= 1 and s.shape[-1] == Mp * Cp:
        lead = list(s.shape[:-1])
    else:
        raise ValueError(
            f"swizzled scales have shape {list(swizzled.shape)}; expected [..., {Mp}, {Cp}] or "
            f"[..., {Mp * Cp}] for a {num_rows} x {num_cols} scale matrix"
        )
    nl = len(lead)
    s = s.reshape(*lead, Mp // 128, Cp // 4, 32, 4, 4)
    s = s.permute(*range(nl), nl + 0, nl + 3, nl + 2, nl + 1, nl + 4).contiguous()
    s = s.reshape(*lead, Mp, Cp)[..., :num_rows, :num_cols].contiguous()
    return s.view(dtype) if s.dtype != dtype else s
