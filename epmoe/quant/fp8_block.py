"""FP8 E4M3 with float32 block scales, DeepSeek-V3 convention (pure torch).

Weights:      data float8_e4m3fn [..., N, K], scale_inv float32 [..., N/128, K/128] (128x128 blocks;
              the checkpoint tensor `weight_scale_inv`)
Activations:  data float8_e4m3fn [..., K],    scales    float32 [..., K/128]         (1x128 groups)

    scale = max(amax, eps) / 448     (eps = 1e-10, as SGLang's / FlashInfer's per_token_group_quant)
    data  = e4m3(clamp(x / scale, -448, 448))            round-to-nearest-even, subnormals kept
    x    ~= float(data) * scale

Special values: zero blocks get scale eps/448 and zero data (dequantize to 0); +-inf saturates (the
block max is clamped to FLT_MAX, the inf element becomes +-448); NaN poisons its block (NaN scale).
Dimensions must be multiples of the block (ValueError otherwise).
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from epmoe.quant._common import E4M3_MAX, FLOAT32_MAX, check_dequant_dtype, check_quantize_input

DATA_DTYPE = torch.float8_e4m3fn
WEIGHT_BLOCK = (128, 128)
ACT_GROUP = 128
DEFAULT_EPS = 1e-10


class FP8BlockTensor(NamedTuple):
    """data float8_e4m3fn; scales float32 (activation: [..., K/128]; weight: [..., N/128, K/128],
    DeepSeek's `weight_scale_inv`)."""

    data: torch.Tensor
    scales: torch.Tensor


def _scale_from_amax(amax: torch.Tensor, eps: float) -> torch.Tensor:
    # clamp keeps NaN (poison) and turns inf into FLT_MAX (saturation). Divide by a device tensor,
    # not a Python number: CUDA turns `t / scalar` into `t * (1 / scalar)`, which would make GPU
    # and CPU scales differ in the last bit.
    denom = torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device)
    return amax.clamp(min=eps, max=FLOAT32_MAX) / denom


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(DATA_DTYPE)


def quantize_activation(
    x: torch.Tensor, group_size: int = ACT_GROUP, eps: float = DEFAULT_EPS, *, pad_edges: bool = False
) -> FP8BlockTensor:
    """x [..., K] -> data e4m3 [..., K], scales float32 [..., K/group_size] (1 x group_size blocks).

    pad_edges: K need not be a multiple of group_size; the last group is padded with zeros
    (scales [..., ceil(K/group_size)]), as kernel layouts with partial tiles do."""
    if pad_edges and isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] % group_size:
        K = x.shape[-1]
        xp = torch.zeros(*x.shape[:-1], -(-K // group_size) * group_size, dtype=torch.float32, device=x.device)
        xp[..., :K] = x.float()
        q = quantize_activation(xp, group_size, eps)
        return FP8BlockTensor(q.data[..., :K].contiguous(), q.scales)
    check_quantize_input(x, group_size, "fp8_block")
    xb = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scale = _scale_from_amax(xb.abs().amax(dim=-1), eps)
    data = _cast(xb, scale.unsqueeze(-1)).reshape(x.shape)
    return FP8BlockTensor(data, scale)


def dequantize_activation(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, group_size: int = ACT_GROUP
) -> torch.Tensor:
    """data e4m3 (or uint8 bytes) [..., K], scales float32 [..., K/group_size] -> [..., K] `dtype`."""
    check_dequant_dtype(dtype, "fp8_block")
    data = _as_e4m3(data)
    K = data.shape[-1]
    if K % group_size:
        raise ValueError(f"fp8_block rows hold {K} values, not a multiple of {group_size}")
    ng = K // group_size
    if scales.shape != (*data.shape[:-1], ng):
        raise ValueError(
            f"fp8_block scales have shape {list(scales.shape)}; expected {[*data.shape[:-1], ng]} "
            f"for data of shape {list(data.shape)}"
        )
    _check_scales(scales)
    vals = data.to(torch.float32).reshape(*data.shape[:-1], ng, group_size)
    return (vals * scales.unsqueeze(-1)).reshape(data.shape).to(dtype)


def quantize_weight(
    w: torch.Tensor, block: Tuple[int, int] = WEIGHT_BLOCK, eps: float = DEFAULT_EPS, *, pad_edges: bool = False
) -> FP8BlockTensor:
    """w [..., N, K] -> data e4m3 [..., N, K], scale_inv float32 [..., N/bn, K/bk].

    pad_edges: N and K need not be block multiples; partial edge blocks are padded with zeros
    (scales [..., ceil(N/bn), ceil(K/bk)]; `dequantize_weight` reads them back)."""
    bn, bk = block
    if pad_edges and isinstance(w, torch.Tensor) and w.dim() >= 2 and (w.shape[-2] % bn or w.shape[-1] % bk):
        N, K = w.shape[-2:]
        wp = torch.zeros(*w.shape[:-2], -(-N // bn) * bn, -(-K // bk) * bk, dtype=torch.float32, device=w.device)
        wp[..., :N, :K] = w.float()
        q = quantize_weight(wp, block, eps)
        return FP8BlockTensor(q.data[..., :N, :K].contiguous(), q.scales)
    check_quantize_input(w, bk, "fp8_block")
    if w.dim() < 2:
        raise ValueError(f"fp8_block weights must be at least 2D [N, K], got shape {list(w.shape)}")
    N, K = w.shape[-2:]
    if N % bn:
        raise ValueError(
            f"fp8_block: weight rows N={N} are not a multiple of the block size {bn}; "
            f"pad N to a multiple of {bn}"
        )
    lead = w.shape[:-2]
    wb = w.to(torch.float32).reshape(*lead, N // bn, bn, K // bk, bk)
    scale = _scale_from_amax(wb.abs().amax(dim=(-3, -1)), eps)  # [..., N/bn, K/bk]
    data = _cast(wb, scale.unsqueeze(-1).unsqueeze(-3)).reshape(w.shape)
    return FP8BlockTensor(data, scale)


def dequantize_weight(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: Tuple[int, int] = WEIGHT_BLOCK,
) -> torch.Tensor:
    """data e4m3 [..., N, K], scale_inv float32 [..., N/bn, K/bk] -> [..., N, K] `dtype`."""
    check_dequant_dtype(dtype, "fp8_block")
    data = _as_e4m3(data)
    bn, bk = block
    if data.dim() < 2:
        raise ValueError(f"fp8_block weights must be at least 2D [N, K], got shape {list(data.shape)}")
    N, K = data.shape[-2:]
    lead = data.shape[:-2]
    nb, kb = -(-N // bn), -(-K // bk)  # partial edge blocks (checkpoints such as H = 2880) are allowed
    if scale_inv.shape != (*lead, nb, kb):
        raise ValueError(
            f"fp8_block weight_scale_inv has shape {list(scale_inv.shape)}; expected "
            f"{[*lead, nb, kb]} for weight shape {list(data.shape)} and block {list(block)}"
        )
    _check_scales(scale_inv)
    if N % bn or K % bk:
        s = scale_inv.repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
        return (data.to(torch.float32) * s).to(dtype)
    vals = data.to(torch.float32).reshape(*lead, N // bn, bn, K // bk, bk)
    return (vals * scale_inv.unsqueeze(-1).unsqueeze(-3)).reshape(data.shape).to(dtype)


def _as_e4m3(data: torch.Tensor) -> torch.Tensor:
    if data.dtype == torch.uint8:
        return data.view(DATA_DTYPE)
    if data.dtype != DATA_DTYPE:
        raise TypeError(f"fp8_block data must be float8_e4m3fn (or its uint8 bytes), got {data.dtype}")
    return data


def _check_scales(scales: torch.Tensor) -> None:
    if scales.dtype != torch.float32:
        raise TypeError(f"fp8_block scales must be float32, got {scales.dtype}")
