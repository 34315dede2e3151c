"""`ExpertWeights`: the canonical, checkpoint-independent form of a layer's expert tensors.

Canonical layout (what loaders produce and experts backends convert from):
    w1  [E, I, H]  gate_proj          w3  [E, I, H]  up_proj (None for relu2)
    w2  [E, H, I]  down_proj          b13 [E, 2I]    [b_gate; b_up] ([E, I] for relu2)
    b2  [E, H]
`first_expert` is the global id of row 0, so a local slice knows where it came from.

Quantized checkpoints (`format` set) keep the same three projections, stored quantized, plus their
scales (all per expert, leading dim E, so `slice_experts` covers them):

    format       w1/w3 [E, I, .] and w2 [E, H, .]      w*_scale (block scales)                 global
    "nvfp4"      uint8, 2 e2m1 per byte [E, I, H/2]    float8_e4m3fn [E, I, H/16]              w*_global_scale [E] f32
    "mxfp4"      uint8, 2 e2m1 per byte [E, I, H/2]    uint8 e8m0 [E, I, ceil(H/32)]           -
    "mxfp8"      float8_e4m3fn [E, I, H]               uint8 e8m0 [E, I, ceil(H/32)]           -
    "fp8_block"  float8_e4m3fn [E, I, H]               float32 [E, ceil(I/128), ceil(H/128)]   -

Scales are dequantization factors: w = q * block_scale (* global_scale). `w13_input_scale` [E] and
`w2_input_scale` [E] (float32) are the checkpoint's static activation dequantization scales
(ModelOpt NVFP4 `input_scale`), when it has them. Biases stay floating point in every format.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, Optional, Sequence, Tuple

import torch

from epmoe.config import MoEConfig


@dataclass(frozen=True)
class WeightFormat:
    """How one quantized weight format is stored: data dtype, logical values per stored element,
    block-scale dtype and the block shape (rows, cols) one scale covers."""

    name: str
    data_dtype: torch.dtype
    values_per_element: int
    scale_dtypes: Tuple[torch.dtype, ...]
    scale_block: Tuple[int, int]
    has_global_scale: bool = False

    def data_shape(self, experts: int, rows: int, cols: int) -> tuple:
        return (experts, rows, cols // self.values_per_element)

    def scale_shape(self, experts: int, rows: int, cols: int) -> tuple:
        br, bc = self.scale_block
        return (experts, -(-rows // br), -(-cols // bc))


WEIGHT_FORMATS: Dict[str, WeightFormat] = {
    "nvfp4": WeightFormat("nvfp4", torch.uint8, 2, (torch.float8_e4m3fn, torch.uint8), (1, 16), True),
    "mxfp4": WeightFormat("mxfp4", torch.uint8, 2, (torch.uint8,), (1, 32)),
    "mxfp8": WeightFormat("mxfp8", torch.float8_e4m3fn, 1, (torch.uint8,), (1, 32)),
    "fp8_block": WeightFormat("fp8_block", torch.float8_e4m3fn, 1, (torch.float32,), (128, 128)),
}

_PROJECTIONS = ("w1", "w3", "w2")
_QUANT_FIELDS = (
    "w1_scale",
    "w3_scale",
    "w2_scale",
    "w1_global_scale",
    "w3_global_scale",
    "w2_global_scale",
    "w13_input_scale",
    "w2_input_scale",
)


@dataclass(frozen=True)
class ExpertWeights:
    w1: torch.Tensor
    w2: torch.Tensor
    w3: Optional[torch.Tensor] = None
    b13: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    first_expert: int = 0
    # Quantized checkpoints (see the module docstring); all None / format None when unquantized.
    format: Optional[str] = None
    w1_scale: Optional[torch.Tensor] = None
    w3_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w1_global_scale: Optional[torch.Tensor] = None
    w3_global_scale: Optional[torch.Tensor] = None
    w2_global_scale: Optional[torch.Tensor] = None
    w13_input_scale: Optional[torch.Tensor] = None
    w2_input_scale: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in WEIGHT_FORMATS:
            raise ValueError(
                f"ExpertWeights.format={self.format!r}; use None (unquantized) or one of "
                f"{sorted(WEIGHT_FORMATS)}"
            )
        if self.format is None:
            stray = [n for n in _QUANT_FIELDS if getattr(self, n) is not None]
            if stray:
                raise ValueError(
                    f"ExpertWeights has quantization scales {stray} but format=None; "
                    f"set format to one of {sorted(WEIGHT_FORMATS)}"
                )

    @property
    def is_quantized(self) -> bool:
        return self.format is not None

    def w13_scale(self) -> Optional[torch.Tensor]:
        """[E, 2I(/block), .] = [w1_scale; w3_scale] (gate rows first), w1_scale for relu2."""
        if self.w1_scale is None:
            return None
        if self.w3_scale is None:
            return self.w1_scale
        return torch.cat([self.w1_scale, self.w3_scale], dim=1)

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def w13(self) -> torch.Tensor:
        """[E, 2I, H] = [w1; w3] (gate rows first), or w1 for relu2."""
        if self.w3 is None:
            return self.w1
        return torch.cat([self.w1, self.w3], dim=1)

    def tensors(self) -> dict:
        """Name -> tensor of every per-expert tensor that is present."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def slice_experts(self, start: int, end: int) -> "ExpertWeights":
        """Global experts [start, end) of this (global) container; indices are global ids."""
        lo, hi = start - self.first_expert, end - self.first_expert
        if not (0 <= lo <= hi <= self.num_experts):
            raise ValueError(
                f"experts [{start}, {end}) are outside this container's "
                f"[{self.first_expert}, {self.first_expert + self.num_experts})"
            )
        return replace(
            self,
            **{name: t[lo:hi] for name, t in self.tensors().items()},
            first_expert=start,
        )

    def take(self, rows: Sequence[int], first_expert: int) -> "ExpertWeights":
        """Rows `rows` (indices into this container, any order, repeats allowed) as a new container whose
        row 0 is labelled `first_expert` (a placement's slots hold experts in any order)."""
        index = torch.tensor(list(rows), dtype=torch.long)
        return replace(self, **{name: t.index_select(0, index.to(t.device)) for name, t in self.tensors().items()},
                       first_expert=first_expert)

    @staticmethod
    def concat(parts: Sequence["ExpertWeights"]) -> "ExpertWeights":
        """The experts of `parts` stacked in order (same format and tensors); first_expert of the first."""
        names = set(parts[0].tensors())
        for p in parts[1:]:
            if set(p.tensors()) != names or p.format != parts[0].format:
                raise ValueError("ExpertWeights to concatenate differ in format or tensors")
        if len(parts) == 1:
            return parts[0]
        return replace(parts[0], **{n: torch.cat([getattr(p, n) for p in parts]) for n in names})

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "ExpertWeights":
        """Move every tensor to `device`; `dtype` converts the unquantized floating-point tensors
        (weights of an unquantized container, biases always), never quantized data or scales."""
        convertible = {"b13", "b2"} if self.is_quantized else {"w1", "w2", "w3", "b13", "b2"}

        def conv(name: str, t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and name in convertible and t.is_floating_point():
                return t.to(device=device, dtype=dtype)
            return t.to(device=device)

        return replace(self, **{name: conv(name, t) for name, t in self.tensors().items()})

    def validate(self, config: MoEConfig, num_experts: Optional[int] = None) -> None:
        """Raise ValueError naming the tensor whose shape does not fit `config`."""
        if self.is_quantized:
            self._validate_quantized(config, num_experts)
            return
        E = self.num_experts if num_experts is None else num_experts
        H, I = config.hidden_size, config.intermediate_size
        expected = {"w1": (E, I, H), "w2": (E, H, I)}
        if config.is_gated:
            expected["w3"] = (E, I, H)
        if config.has_bias:
            expected["b13"] = (E, config.w13_rows)
            expected["b2"] = (E, H)
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is None:
                raise ValueError(
                    f"expert weights lack {name!r} (expected shape {list(shape)}) for "
                    f"activation={config.activation!r}, has_bias={config.has_bias}"
                )
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"expert weight {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                    f"(E={E}, H={H}, I={I})"
                )
            if not t.is_floating_point():
                raise TypeError(f"expert weight {name!r} has dtype {t.dtype}; expected a float dtype")
        if not config.is_gated and self.w3 is not None:
            raise ValueError("activation='relu2' is non-gated: expert weights must not have 'w3'")
        if not config.has_bias and (self.b13 is not None or self.b2 is not None):
            raise ValueError("expert weights carry biases but the config has has_bias=False")

    def _validate_quantized(self, config: MoEConfig, num_experts: Optional[int]) -> None:
        fmt = WEIGHT_FORMATS[self.format]
        E = self.num_experts if num_experts is None else num_experts
        H, I = config.hidden_size, config.intermediate_size
        logical = {"w1": (I, H), "w2": (H, I)}
        if config.is_gated:
            logical["w3"] = (I, H)
        for name, (rows, cols) in logical.items():
            if cols % fmt.values_per_element:
                raise ValueError(
                    f"{self.format} weight {name!r} needs an even number of columns, got {cols}"
                )
            data, scale = getattr(self, name), getattr(self, name + "_scale")
            for what, t, shape, dtypes in (
                (name, data, fmt.data_shape(E, rows, cols), (fmt.data_dtype,)),
                (name + "_scale", scale, fmt.scale_shape(E, rows, cols), fmt.scale_dtypes),
            ):
                if t is None:
                    raise ValueError(
                        f"{self.format} expert weights lack {what!r} (expected shape {list(shape)}, "
                        f"dtype {dtypes[0]}) for activation={config.activation!r}"
                    )
                if tuple(t.shape) != shape:
                    raise ValueError(
                        f"{self.format} expert tensor {what!r} has shape {list(t.shape)}, expected "
                        f"{list(shape)} (E={E}, H={H}, I={I})"
                    )
                if t.dtype not in dtypes:
                    raise TypeError(
                        f"{self.format} expert tensor {what!r} has dtype {t.dtype}; expected one of "
                        f"{list(dtypes)}"
                    )
            if fmt.has_global_scale:
                g = getattr(self, name + "_global_scale")
                if g is None or tuple(g.shape) != (E,) or g.dtype != torch.float32:
                    got = None if g is None else (tuple(g.shape), g.dtype)
                    raise ValueError(
                        f"{self.format} expert weights need {name}_global_scale of shape [{E}] "
                        f"float32, got {got}"
                    )
        for name in ("w13_input_scale", "w2_input_scale"):
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != (E,) or t.dtype != torch.float32):
                raise ValueError(
                    f"{name} must be [{E}] float32 (one static activation scale per expert), "
                    f"got shape {list(t.shape)} dtype {t.dtype}"
                )
        if not config.is_gated and (self.w3 is not None or self.w3_scale is not None):
            raise ValueError("activation='relu2' is non-gated: expert weights must not have 'w3'")
        if config.has_bias:
            for name, shape in (("b13", (E, config.w13_rows)), ("b2", (E, H))):
                t = getattr(self, name)
                if t is None or tuple(t.shape) != shape:
                    got = None if t is None else list(t.shape)
                    raise ValueError(f"expert bias {name!r} has shape {got}, expected {list(shape)}")
        elif self.b13 is not None or self.b2 is not None:
            raise ValueError("expert weights carry biases but the config has has_bias=False")


# ----------------------------------------------------------------------------- codecs
def quantize_expert_weights(weights: ExpertWeights, fmt: str, *, scale_rounding: str = "floor") -> ExpertWeights:
    """Quantize unquantized canonical weights to `fmt` at load (online quantization) with epmoe's
    reference formats: MXFP4 / MXFP8 per 32 along K, FP8 128x128 blocks (partial edge blocks padded,
    as checkpoints with H = 2880 have them), NVFP4 per 16 with one global scale per expert (stored as a
    dequantization factor, this module's convention). Biases stay.

    scale_rounding: the MXFP4 E8M0 scale rounding ("floor": OCP MX; "ceil": triton_kernels' and
    FlashInfer's, see epmoe.quant.mxfp4)."""
    import importlib

    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"cannot quantize expert weights to {fmt!r}; use one of {sorted(WEIGHT_FORMATS)}")
    if weights.is_quantized:
        raise ValueError(f"expert weights are already {weights.format}; dequantize them first")
    codec = importlib.import_module(f"epmoe.quant.{fmt}")
    out: Dict[str, object] = {"format": fmt}
    for name in _PROJECTIONS:
        w = getattr(weights, name)
        if w is None:
            continue
        if fmt == "nvfp4":
            gs = torch.stack([codec.compute_global_scale(w[e]) for e in range(w.shape[0])])  # 448*6/amax
            q = codec.quantize(w, gs[:, None].expand(w.shape[:-1]).contiguous())
            out[name + "_global_scale"] = (1.0 / gs).float().contiguous()
        elif fmt == "fp8_block":
            q = codec.quantize_weight(w, pad_edges=True)
        elif fmt == "mxfp4":
            q = codec.quantize(w, scale_rounding=scale_rounding)
        else:
            q = codec.quantize(w)
        out[name], out[name + "_scale"] = q[0], q[1]
    return replace(weights, **out)


def dequantize_expert_weights(weights: ExpertWeights, dtype: torch.dtype = torch.float32) -> ExpertWeights:
    """Quantized canonical weights -> unquantized `dtype` (identity cast for unquantized weights)."""
    if not weights.is_quantized:
        return weights.to(dtype=dtype)
    import importlib

    codec = importlib.import_module(f"epmoe.quant.{weights.format}")
    out: Dict[str, object] = {n: None for n in _QUANT_FIELDS}
    out["format"] = None
    for name in _PROJECTIONS:
        q = getattr(weights, name)
        if q is None:
            continue
        s = getattr(weights, name + "_scale")
        if weights.format == "nvfp4":
            g = getattr(weights, name + "_global_scale")
            # stored as a dequantization factor; nvfp4.dequantize takes FlashInfer's 448*6/amax form
            gs = (1.0 / g.float()).reshape(-1, *([1] * (q.dim() - 2))).expand(q.shape[:-1])
            w = codec.dequantize(q, s, gs.contiguous(), torch.float32)
        elif weights.format == "fp8_block":
            w = codec.dequantize_weight(q, s, torch.float32)
        else:
            w = codec.dequantize(q, s, torch.float32)
        out[name] = w.to(dtype)
    for name in ("b13", "b2"):
        t = getattr(weights, name)
        out[name] = t.to(dtype) if t is not None else None
    return replace(weights, **out)
