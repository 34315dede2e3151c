"""What travels through the dispatcher: `PayloadFormat` (a typed descriptor) and `QuantizedActivation`.

The experts backend declares the `PayloadFormat` it consumes; the layer hands it to the dispatcher,
so `dispatch/` and `experts/` never import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from epmoe.config import dtype_name

SCALE_LAYOUTS = ("none", "linear", "swizzled_128x4")


@dataclass(frozen=True)
class PayloadFormat:
    """How token activations are encoded on the wire.

    name:               "bf16" / "fp16" / "fp32" (unquantized, `dtype` = model dtype), "nvfp4",
                        "fp8_block" (e4m3 + fp32 scale per 1x128), "mxfp8" (e4m3 + e8m0 per 32)
    dtype:              element dtype of the data tensor (packed fp4 travels as uint8)
    values_per_element: logical values per stored element (2 for packed fp4)
    block_size:         values sharing one scale (None: unquantized)
    scale_dtype:        dtype of the block scales (None: unquantized)
    scale_layout:       "none", "linear" ([T, H / block]) or "swizzled_128x4" (FlashInfer kernels)
    global_scale:       a float32 per-tensor scale travels with the payload (NVFP4)
    """

    name: str
    dtype: torch.dtype
    values_per_element: int = 1
    block_size: Optional[int] = None
    scale_dtype: Optional[torch.dtype] = None
    scale_layout: str = "none"
    global_scale: bool = False

    def __post_init__(self) -> None:
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"scale_layout={self.scale_layout!r}; use one of {SCALE_LAYOUTS}")
        if (self.block_size is None) != (self.scale_dtype is None):
            raise ValueError("block_size and scale_dtype are set together (quantized) or not at all")

    @classmethod
    def unquantized(cls, dtype: torch.dtype) -> "PayloadFormat":
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
        if dtype not in names:
            raise ValueError(f"no unquantized payload for dtype {dtype}")
        return cls(names[dtype], dtype)

    @property
    def is_quantized(self) -> bool:
        return self.block_size is not None

    def data_bytes_per_token(self, hidden_size: int) -> int:
        """Bytes of the data tensor for one token of `hidden_size` values."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (hidden_size // self.values_per_element) * elem

    def scale_bytes_per_token(self, hidden_size: int) -> int:
        """Bytes of the block scales for one token (linear layout, unpadded)."""
        if not self.is_quantized:
            return 0
        elem = torch.tensor([], dtype=self.scale_dtype).element_size()
        return -(-hidden_size // self.block_size) * elem

    def bytes_per_token(self, hidden_size: int) -> int:
        return self.data_bytes_per_token(hidden_size) + self.scale_bytes_per_token(hidden_size)

    def describe(self) -> str:
        if not self.is_quantized:
            return f"{self.name} ({dtype_name(self.dtype)})"
        g = " + fp32 global scale" if self.global_scale else ""
        return (
            f"{self.name} ({dtype_name(self.dtype)} x{self.values_per_element}, "
            f"{dtype_name(self.scale_dtype)} scale per {self.block_size}, {self.scale_layout}{g})"
        )


@dataclass(frozen=True)
class QuantizedActivation:
    """Quantized tokens: data [N, H / values_per_element], scales [N, H / block] (linear layout),
    global_scale: float32 scalar or per-token [N] tensor (one value per sending rank's tensor), or None.
    `hidden_size` is the logical H."""

    format: PayloadFormat
    data: torch.Tensor
    scales: torch.Tensor
    hidden_size: int
    global_scale: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> torch.Size:  # logical shape, like a dense tensor
        return torch.Size((self.data.shape[0], self.hidden_size))

    @property
    def device(self) -> torch.device:
        return self.data.device


Activations = Union[torch.Tensor, QuantizedActivation]
