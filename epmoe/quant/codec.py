"""Activation payload codec used by dispatchers: quantize tokens before the all-to-all, send them as
bytes, rebuild and dequantize them after.

    fmt  = payload_format("nvfp4", torch.bfloat16)          # a PayloadFormat constant
    q    = quantize_activation(x, fmt)                       # QuantizedActivation, x: [T, H]
    rows = pack_rows(q)                                      # uint8 [T, wire_bytes_per_token(fmt, H)]
    ... all_to_all_single(recv_rows, rows[order], splits) ...   # plain bytes: gloo/NCCL agnostic
    q2   = unpack_rows(recv_rows, fmt, H)                    # QuantizedActivation, per-row global scale
    y    = dequantize_activation(q2, torch.bfloat16)         # [N, H]

Wire row = [data bytes | block-scale bytes | float32 global scale (NVFP4 only)]. Carrying the
sender's global scale in every row lets rows from different senders (different global scales) be
mixed freely after the exchange. gloo's all_to_all_single rejects float8 tensors; `as_bytes` /
`from_bytes` are the zero-copy views for sending a single tensor.

Formats:
    NVFP4      data uint8 [T, H/2] (2 x e2m1), scales float8_e4m3fn [T, H/16] linear, global scale
    FP8_BLOCK  data float8_e4m3fn [T, H], scales float32 [T, H/128] (1x128, DeepSeek-V3)
    MXFP8      data float8_e4m3fn [T, H], scales uint8 E8M0 [T, H/32]

Kernels: CUDA tensors go through the Triton kernels of `epmoe.quant.triton_codec` (bit-identical to
the torch reference, one or two launches instead of dozens) when triton is importable; everything
else uses the pure-torch reference. `use_triton=False` (or EPMOE_TRITON_CODEC=0 in the environment)
forces the reference, `use_triton=True` forces the kernels (CPU tensors then need TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from epmoe.quant import fp8_block, mxfp8, nvfp4
from epmoe.quant.payload import PayloadFormat, QuantizedActivation

NVFP4 = PayloadFormat(
    "nvfp4",
    torch.uint8,
    values_per_element=2,
    block_size=nvfp4.BLOCK_SIZE,
    scale_dtype=torch.float8_e4m3fn,
    scale_layout="linear",
    global_scale=True,
)
FP8_BLOCK = PayloadFormat(
    "fp8_block",
    torch.float8_e4m3fn,
    block_size=fp8_block.ACT_GROUP,
    scale_dtype=torch.float32,
    scale_layout="linear",
)
MXFP8 = PayloadFormat(
    "mxfp8",
    torch.float8_e4m3fn,
    block_size=mxfp8.BLOCK_SIZE,
    scale_dtype=torch.uint8,
    scale_layout="linear",
)
QUANTIZED_FORMATS = {f.name: f for f in (NVFP4, FP8_BLOCK, MXFP8)}
# Names the quant plan uses for its dispatch dtype, mapped to payload format names.
_ALIASES = {"fp8": "fp8_block"}
_UNQUANTIZED = {"bf16": None, "model": None, "none": None, "fp16": torch.float16, "fp32": torch.float32}
GLOBAL_SCALE_BYTES = 4
TRITON_CODEC_ENV = "EPMOE_TRITON_CODEC"  # "0" -> the torch reference even for CUDA tensors
_triton_module = None
_triton_error: Optional[str] = None


def _load_triton_codec():
    """`epmoe.quant.triton_codec`, or None (with the reason kept in `_triton_error`) when triton
    cannot be imported. Imported on first use only: importing epmoe never imports triton."""
    global _triton_module, _triton_error
    if _triton_module is None and _triton_error is None:
        try:
            from epmoe.quant import triton_codec

            _triton_module = triton_codec
        except ImportError as e:  # no triton, or a broken install: the torch reference still works
            _triton_error = f"{type(e).__name__}: {e}"
    return _triton_module


def triton_codec_for(device: Union[torch.device, str], use_triton: Optional[bool] = None):
    """The Triton codec module to use for tensors on `device`, or None for the torch reference.

    use_triton None (default): the kernels for CUDA devices when triton imports and
    EPMOE_TRITON_CODEC is not "0"; False: never; True: always (ImportError naming the cause when
    triton is missing)."""
    if use_triton is False:
        return None
    if use_triton is None:
        if torch.device(device).type != "cuda" or os.environ.get(TRITON_CODEC_ENV, "1").strip() == "0":
            return None
        return _load_triton_codec()
    mod = _load_triton_codec()
    if mod is None:
        raise ImportError(f"use_triton=True but epmoe.quant.triton_codec cannot be imported ({_triton_error}); pip install triton")
    return mod


def payload_format(name: str, model_dtype: torch.dtype) -> PayloadFormat:
    """The PayloadFormat for a dispatch dtype name.

    "bf16" (the plan's name for "unquantized") -> the model dtype unquantized; "fp16" / "fp32" ->
    that dtype unquantized; "nvfp4" -> NVFP4; "fp8" / "fp8_block" -> FP8_BLOCK; "mxfp8" -> MXFP8.
    """
    key = str(name).lower()
    key = _ALIASES.get(key, key)
    if key in QUANTIZED_FORMATS:
        return QUANTIZED_FORMATS[key]
    if key in _UNQUANTIZED:
        return PayloadFormat.unquantized(_UNQUANTIZED[key] or model_dtype)
    raise ValueError(
        f"unknown payload format {name!r}; use one of "
        f"{sorted(set(QUANTIZED_FORMATS) | set(_ALIASES) | set(_UNQUANTIZED))}"
    )


def _check_format(fmt: PayloadFormat) -> None:
    if not isinstance(fmt, PayloadFormat):
        raise TypeError(f"fmt must be a PayloadFormat, got {type(fmt).__name__}")
    if not fmt.is_quantized:
        raise ValueError(
            f"payload format {fmt.name!r} is not quantized; send the tensor as is "
            "(use encode_activation to handle both cases)"
        )
    if fmt.name not in QUANTIZED_FORMATS or QUANTIZED_FORMATS[fmt.name] != fmt:
        raise ValueError(
            f"payload format {fmt.describe()} is not one the codec implements; use one of "
            f"{[f.describe() for f in QUANTIZED_FORMATS.values()]}"
        )


def quantize_activation(
    x: torch.Tensor,
    fmt: PayloadFormat,
    global_scale: Optional[Union[torch.Tensor, float]] = None,
    *,
    use_triton: Optional[bool] = None,
) -> QuantizedActivation:
    """x [T, H] (bf16/fp16/fp32) -> QuantizedActivation in `fmt` (scales in linear layout).

    global_scale (NVFP4 only): None -> 448*6/amax(x) computed here on x's device, without a host
    sync (one float32 0-dim per call); a float / 0-dim tensor; or per-token [T]. Passing one for
    another format is a ValueError.
    use_triton: None -> the Triton kernels for CUDA tensors (see `triton_codec_for`), False -> the
    torch reference, True -> the kernels. Both give the same bytes.
    """
    _check_format(fmt)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize_activation expects x of shape [num_tokens, hidden_size], got {shape}")
    H = x.shape[1]
    tc = triton_codec_for(x.device, use_triton)
    if tc is not None and not tc.supports_input(x):  # float64 (or a CPU tensor without the interpreter)
        tc = None
    if fmt is NVFP4 or fmt == NVFP4:
        q = tc.quantize_nvfp4(x, global_scale) if tc is not None else nvfp4.quantize(x, global_scale)
        return QuantizedActivation(fmt, q.packed, q.scales, H, q.global_scale)
    if global_scale is not None:
        raise ValueError(f"payload format {fmt.name!r} has no global scale; pass global_scale=None")
    if fmt == FP8_BLOCK:
        if tc is not None and fmt.block_size == fp8_block.ACT_GROUP:
            q = tc.quantize_fp8_block(x)
        else:
            q = fp8_block.quantize_activation(x, fmt.block_size)
        return QuantizedActivation(fmt, q.data, q.scales, H)
    q = tc.quantize_mxfp8(x) if tc is not None else mxfp8.quantize(x)
    return QuantizedActivation(fmt, q.data, q.scales, H)


def quantize_for_wire(x: torch.Tensor, fmt: PayloadFormat, *, use_triton: Optional[bool] = None) -> QuantizedActivation:
    """x [T, H] -> QuantizedActivation for the dispatch wire, each token quantized on its own (NVFP4:
    one global scale per token, `nvfp4.compute_row_global_scale`), so a token's bytes do not depend
    on which tokens travel with it. Dispatchers, emulating experts and the float64 reference
    (`epmoe.reference.reference_moe(plan=...)`) all use this one function."""
    if fmt == NVFP4 and x.dim() == 2:
        return quantize_activation(x, fmt, nvfp4.compute_row_global_scale(x), use_triton=use_triton)
    return quantize_activation(x, fmt, use_triton=use_triton)


# QuantPlan.act_format -> the payload format whose groups the experts' kernels quantize to; "fp8" (FlashInfer's
# SM90 Humming W4A8) is e4m3 with ONE fp32 scale per token (the kernel's act_fp8_token_scale), no payload format.
ACT_FORMAT_PAYLOAD = {"nvfp4": "nvfp4", "fp8_block": "fp8_block", "mxfp8": "mxfp8"}
PER_TOKEN_FP8 = "fp8"
# QuantPlan.act_format -> the wire dtype its kernels consume as received (any other wire is dequantized on
# arrival and quantized again as the kernel does)
ACT_FORMAT_WIRE = {"nvfp4": "nvfp4", "fp8_block": "fp8"}


def quantizes_activations(act_format: str) -> bool:
    """Whether the plan's kernels round their inputs (`roundtrip_activation` changes them)."""
    return act_format in ACT_FORMAT_PAYLOAD or act_format == PER_TOKEN_FP8


def roundtrip_activation(x: torch.Tensor, act_format: str, dtype: torch.dtype) -> torch.Tensor:
    """An expert's input rows [N, K] as the plan's kernels round them (`QuantPlan.act_format`), in
    `dtype`: "bf16" unchanged, a payload format per its groups, "fp8" per token (one scale per row)."""
    if act_format == PER_TOKEN_FP8:
        if x.shape[0] == 0:
            return x.to(dtype)
        q = fp8_block.quantize_activation(x, group_size=x.shape[-1])
        return fp8_block.dequantize_activation(q.data, q.scales, dtype, group_size=x.shape[-1])
    name = ACT_FORMAT_PAYLOAD.get(act_format)
    if name is None:
        return x.to(dtype)
    return roundtrip_for_wire(x, payload_format(name, x.dtype), dtype)


def roundtrip_for_wire(x: torch.Tensor, fmt: PayloadFormat, dtype: torch.dtype) -> torch.Tensor:
    """What a token looks like after a quantized wire: quantize_for_wire then dequantize to `dtype`."""
    if not fmt.is_quantized or x.shape[0] == 0:
        return x.to(dtype)
    return dequantize_activation(quantize_for_wire(x, fmt), dtype)


def dequantize_activation(
    q: QuantizedActivation, dtype: torch.dtype, *, use_triton: Optional[bool] = None
) -> torch.Tensor:
    """QuantizedActivation -> [N, H] `dtype` (use_triton as in `quantize_activation`)."""
    if not isinstance(q, QuantizedActivation):
        raise TypeError(f"expected a QuantizedActivation, got {type(q).__name__}")
    fmt = q.format
    _check_format(fmt)
    tc = triton_codec_for(q.data.device, use_triton)
    if tc is not None and dtype not in tc.OUTPUT_DTYPES:  # float64 output: the reference
        tc = None
    if fmt == NVFP4:
        if q.global_scale is None:
            raise ValueError("an NVFP4 QuantizedActivation needs its global_scale to be dequantized")
        deq = tc.dequantize_nvfp4 if tc is not None else nvfp4.dequantize
        out = deq(q.data, q.scales, q.global_scale, dtype)
    elif fmt == FP8_BLOCK:
        if tc is not None and fmt.block_size == fp8_block.ACT_GROUP:
            out = tc.dequantize_fp8_block(q.data, q.scales, dtype)
        else:
            out = fp8_block.dequantize_activation(q.data, q.scales, dtype, fmt.block_size)
    else:
        out = (tc.dequantize_mxfp8 if tc is not None else mxfp8.dequantize)(q.data, q.scales, dtype)
    if out.shape[-1] != q.hidden_size:
        raise ValueError(f"dequantized rows have {out.shape[-1]} values; QuantizedActivation says {q.hidden_size}")
    return out


def encode_activation(x: torch.Tensor, fmt: PayloadFormat, global_scale=None):
    """Tensor in an unquantized format (cast to fmt.dtype) or a QuantizedActivation."""
    if not fmt.is_quantized:
        return x.to(fmt.dtype)
    return quantize_activation(x, fmt, global_scale)


def decode_activation(a, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `encode_activation`: a tensor is cast, a QuantizedActivation dequantized."""
    if isinstance(a, QuantizedActivation):
        return dequantize_activation(a, dtype)
    return a.to(dtype)


# ------------------------------------------------------------------ wire (bytes) helpers
def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Zero-copy uint8 view of a contiguous tensor: [..., n] of k-byte elements -> [..., n * k]."""
    if t.dtype == torch.uint8:
        return t
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `as_bytes` (the last dim must hold whole elements; copies if not aligned)."""
    if b.dtype != torch.uint8:
        raise TypeError(f"from_bytes expects uint8 bytes, got {b.dtype}")
    if dtype == torch.uint8:
        return b
    elem = torch.empty((), dtype=dtype).element_size()
    if b.shape[-1] % elem:
        raise ValueError(f"{b.shape[-1]} bytes per row do not hold whole {dtype} elements ({elem} bytes each)")
    if not b.is_contiguous() or b.storage_offset() % elem:
        b = b.contiguous()
    return b.view(dtype)


def wire_bytes_per_token(fmt: PayloadFormat, hidden_size: int) -> int:
    """Bytes of one packed row: data + scales (+ 4 for NVFP4's float32 global scale)."""
    extra = GLOBAL_SCALE_BYTES if fmt.global_scale else 0
    return fmt.bytes_per_token(hidden_size) + extra


def pack_rows(q: QuantizedActivation) -> torch.Tensor:
    """QuantizedActivation [N rows] -> uint8 [N, wire_bytes_per_token] (one contiguous row per token)."""
    fmt = q.format
    _check_format(fmt)
    N, H = q.num_tokens, q.hidden_size
    parts = [
        as_bytes(q.data).reshape(N, fmt.data_bytes_per_token(H)),
        as_bytes(q.scales).reshape(N, fmt.scale_bytes_per_token(H)),
    ]
    if fmt.global_scale:
        if q.global_scale is None:
            raise ValueError(f"payload format {fmt.name!r} needs a global scale to pack rows")
        gs = q.global_scale.to(device=q.data.device, dtype=torch.float32)
        # repeat, not expand: an expanded empty tensor keeps stride 0 and cannot be viewed as bytes (T = 0)
        gs = gs.reshape(1).repeat(N) if gs.numel() == 1 else gs.reshape(N)
        parts.append(as_bytes(gs.contiguous().reshape(N, 1)).reshape(N, GLOBAL_SCALE_BYTES))
    rows = torch.cat(parts, dim=1)
    expected = wire_bytes_per_token(fmt, q.hidden_size)
    if rows.shape[1] != expected:
        raise ValueError(f"packed rows have {rows.shape[1]} bytes; expected {expected} for {fmt.describe()}")
    return rows


def unpack_rows(rows: torch.Tensor, fmt: PayloadFormat, hidden_size: int) -> QuantizedActivation:
    """uint8 [N, wire_bytes_per_token] -> QuantizedActivation (NVFP4: global_scale float32 [N])."""
    _check_format(fmt)
    expected = wire_bytes_per_token(fmt, hidden_size)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != expected:
        raise ValueError(
            f"rows must be uint8 [N, {expected}] for {fmt.describe()} with hidden_size={hidden_size}; "
            f"got {rows.dtype} {list(rows.shape)}"
        )
    N = rows.shape[0]
    nd = fmt.data_bytes_per_token(hidden_size)
    ns = fmt.scale_bytes_per_token(hidden_size)
    data = from_bytes(rows[:, :nd].contiguous(), fmt.dtype)
    scales = from_bytes(rows[:, nd : nd + ns].contiguous(), fmt.scale_dtype)
    gs = None
    if fmt.global_scale:
        gs = from_bytes(rows[:, nd + ns :].contiguous(), torch.float32).reshape(N)
    return QuantizedActivation(fmt, data, scales, hidden_size, gs)


def select_rows(q: QuantizedActivation, index: torch.Tensor) -> QuantizedActivation:
    """Rows `index` (int64/int32 [M]) of q, with a scalar global scale expanded to per-row."""
    gs = q.global_scale
    if gs is not None:
        gs = gs.reshape(()).expand(q.num_tokens) if gs.numel() == 1 else gs
        gs = gs[index]
    return QuantizedActivation(q.format, q.data[index], q.scales[index], q.hidden_size, gs)
