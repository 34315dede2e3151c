"""Expert checkpoints as they ship: the tensors each format stores per expert projection, their
shapes and dtypes, and how they map onto canonical `ExpertWeights` (the stored bytes are kept).

Per-expert formats (prefix `...experts.{e}.{gate_proj|up_proj|down_proj}.` or `...experts.{e}.{w1|w3|w2}.`;
a projection is [out, in]: gate/up [I, H], down [H, I]):

    format            tensor                 dtype            shape                           ExpertWeights
    bf16              weight                 float            [out, in]                       w*  (format None)
    fp8               weight                 float8_e4m3fn    [out, in]                       w*  (format fp8_block)
    (DeepSeek-V3,     weight_scale_inv       float32 / bf16   [ceil(out/128), ceil(in/128)]   w*_scale (float32)
     Qwen3-FP8)
    nvfp4-modelopt    weight                 uint8            [out, in/2]                     w*  (format nvfp4)
                      weight_scale           float8_e4m3fn    [out, in/16]                    w*_scale
                      weight_scale_2         float32          [] or [1]                       w*_global_scale
                      input_scale            float32          [] or [1]   (optional)          w13/w2_input_scale
    nvfp4-compressed  weight_packed          uint8            [out, in/2]                     w*
    (llm-compressor)  weight_scale           float8_e4m3fn    [out, in/16]                    w*_scale
                      weight_global_scale    float32          [] or [1]                       1 / it -> w*_global_scale
                      input_global_scale     float32          [] or [1]   (optional)          1 / it -> input scale

Stacked GPT-OSS MXFP4 (one tensor per layer, `...experts.<name>`, gate/up interleaved on the row axis:
row 2j is gate j, row 2j+1 is up j):

    gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   -> w1 = rows 0::2, w3 = rows 1::2 ([E, I, H/2])
    gate_up_proj_scales  uint8 [E, 2I, H/32] E8M0  -> w1_scale / w3_scale
    down_proj_blocks     uint8 [E, H, I/32, 16]    -> w2 [E, H, I/2]
    down_proj_scales     uint8 [E, H, I/32]        -> w2_scale
    gate_up_proj_bias    float [E, 2I]             -> b13 = [gate; up]
    down_proj_bias       float [E, H]              -> b2

Conventions: ExpertWeights keeps dequantization factors. ModelOpt's `weight_scale_2` / `input_scale`
are such factors (amax / (448 * 6)) and are kept as stored. compressed-tensors stores the reciprocal
(`weight_global_scale` = 448 * 6 / amax, the quantization multiplier), so the loader keeps
`1 / weight_global_scale` (as vLLM's compressed-tensors MoE loader does). The gate and up
projections of one expert read the same activation: the expert's `w13_input_scale` is the larger of
their two input scales (equal in every checkpoint we know of). Gate and up keep their own
`weight_scale_2`; kernels that fuse them into one GEMM with one scale use `shared_gate_up_global_scale`.

Per-tensor / per-channel FP8 (`weight_scale`, `input_scale` next to float8 weights) is recognised and
refused: no epmoe experts backend runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Tuple

import torch

from epmoe.quant.weights import ExpertWeights

FP8_WEIGHT_BLOCK = 128
NVFP4_GROUP = 16
MXFP4_BLOCK = 32

# Names the launcher's --checkpoint-format takes, and the MoEConfig.quant_method each implies.
CHECKPOINT_FORMATS = ("bf16", "fp8", "nvfp4-modelopt", "nvfp4-compressed", "mxfp4-gpt-oss")
QUANT_METHOD_OF_FORMAT: Dict[str, Optional[str]] = {
    "bf16": None,
    "fp8": "fp8",
    "nvfp4-modelopt": "modelopt_fp4",
    "nvfp4-compressed": "compressed_tensors_nvfp4",
    "mxfp4-gpt-oss": "mxfp4",
}
WEIGHT_FORMAT_OF_FORMAT: Dict[str, Optional[str]] = {
    "bf16": None,
    "fp8": "fp8_block",
    "nvfp4-modelopt": "nvfp4",
    "nvfp4-compressed": "nvfp4",
    "mxfp4-gpt-oss": "mxfp4",
}
# `quantization_config` each synthetic checkpoint's config.json carries (as the producers write it).
QUANTIZATION_CONFIGS: Dict[str, Optional[dict]] = {
    "bf16": None,
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "nvfp4-modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                       "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
    "nvfp4-compressed": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "nvfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                  "group_size": 16, "symmetric": True, "dynamic": "local"},
        }},
    },
    "mxfp4-gpt-oss": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                           "model.layers.*.mlp.router",
                                                                           "model.embed_tokens", "lm_head"]},
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor of a projection: name suffix, accepted dtypes, shape from (out, in)
    (None: a scalar stored as [] or [1]), and whether a checkpoint may leave it out."""

    suffix: str
    dtypes: Tuple[torch.dtype, ...]
    shape: Optional[Callable[[int, int], Tuple[int, ...]]]
    optional: bool = False

    def describe(self, out_features: int, in_features: int) -> str:
        shape = "[] or [1]" if self.shape is None else str(list(self.shape(out_features, in_features)))
        return f"{shape} {' / '.join(str(d).replace('torch.', '') for d in self.dtypes)}"

    def check(self, t: torch.Tensor, key: str, out_features: int, in_features: int, fmt: str) -> None:
        want = self.describe(out_features, in_features)
        ok_shape = t.numel() == 1 and t.dim() <= 1 if self.shape is None else \
            tuple(t.shape) == self.shape(out_features, in_features)
        if not ok_shape or t.dtype not in self.dtypes:
            raise ValueError(
                f"{fmt} checkpoint tensor {key!r} is {list(t.shape)} {str(t.dtype).replace('torch.', '')}; "
                f"expected {want} for a [{out_features}, {in_features}] projection"
                + (f" ({FP8_WEIGHT_BLOCK}x{FP8_WEIGHT_BLOCK} weight blocks: weight_block_size must be "
                   f"[{FP8_WEIGHT_BLOCK}, {FP8_WEIGHT_BLOCK}])" if self.suffix == "weight_scale_inv" else "")
            )


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
PER_EXPERT_FORMATS: Dict[str, Tuple[TensorSpec, ...]] = {
    "bf16": (TensorSpec("weight", _FLOATS, lambda o, i: (o, i)),),
    "fp8": (
        TensorSpec("weight", (torch.float8_e4m3fn,), lambda o, i: (o, i)),
        TensorSpec("weight_scale_inv", (torch.float32, torch.bfloat16),
                   lambda o, i: (_cdiv(o, FP8_WEIGHT_BLOCK), _cdiv(i, FP8_WEIGHT_BLOCK))),
    ),
    "nvfp4-modelopt": (
        TensorSpec("weight", (torch.uint8,), lambda o, i: (o, i // 2)),
        TensorSpec("weight_scale", (torch.float8_e4m3fn,), lambda o, i: (o, i // NVFP4_GROUP)),
        TensorSpec("weight_scale_2", (torch.float32,), None),
        TensorSpec("input_scale", (torch.float32,), None, optional=True),
    ),
    "nvfp4-compressed": (
        TensorSpec("weight_packed", (torch.uint8,), lambda o, i: (o, i // 2)),
        TensorSpec("weight_scale", (torch.float8_e4m3fn,), lambda o, i: (o, i // NVFP4_GROUP)),
        TensorSpec("weight_global_scale", (torch.float32,), None),
        TensorSpec("input_global_scale", (torch.float32,), None, optional=True),
    ),
}
# Suffixes a per-expert checkpoint may carry (the loader's name pattern).
PER_EXPERT_SUFFIXES = (
    "weight", "bias", "weight_scale_inv", "weight_scale_2", "weight_scale", "input_scale", "weight_packed",
    "weight_global_scale", "input_global_scale", "weight_shape",
)

GPT_OSS_MXFP4 = {
    # name: (dtype, shape from (E, H, I))
    "gate_up_proj_blocks": ((torch.uint8,), lambda E, H, I: (E, 2 * I, H // MXFP4_BLOCK, 16)),
    "gate_up_proj_scales": ((torch.uint8,), lambda E, H, I: (E, 2 * I, H // MXFP4_BLOCK)),
    "down_proj_blocks": ((torch.uint8,), lambda E, H, I: (E, H, I // MXFP4_BLOCK, 16)),
    "down_proj_scales": ((torch.uint8,), lambda E, H, I: (E, H, I // MXFP4_BLOCK)),
    "gate_up_proj_bias": (_FLOATS, lambda E, H, I: (E, 2 * I)),
    "down_proj_bias": (_FLOATS, lambda E, H, I: (E, H)),
}
# Per-tensor / per-channel FP8 is told apart from the block format by its scale names.
_UNSUPPORTED_FP8 = (
    "per-tensor / per-channel FP8 experts (weight_scale / input_scale next to float8 weights) are not "
    "supported: no epmoe experts backend runs them (fp8_block needs 128x128 weight_scale_inv blocks); "
    "convert the checkpoint to 128x128 block FP8 or load a BF16 checkpoint"
)


def classify_projection(suffixes) -> str:
    """Format of one stored projection from the suffixes present for it (names only, nothing read)."""
    s = set(suffixes)
    if "weight_packed" in s:
        return "nvfp4-compressed"
    if "weight_scale_inv" in s:
        return "fp8"
    if "weight_scale_2" in s:
        return "nvfp4-modelopt"
    if "weight_scale" in s or "input_scale" in s:
        return "fp8-per-tensor"
    return "bf16"


def check_supported(fmt: str) -> None:
    if fmt == "fp8-per-tensor":
        raise ValueError(_UNSUPPORTED_FP8)


def family_of_format(fmt: str) -> str:
    """Checkpoint family (quant.plan's `checkpoint_family` names) of a stored format."""
    return {"bf16": "none", "fp8": "fp8", "nvfp4-modelopt": "nvfp4", "nvfp4-compressed": "nvfp4",
            "mxfp4-gpt-oss": "mxfp4", "fp8-per-tensor": "fp8"}[fmt]


def projection_to_canonical(fmt: str, parts: Dict[str, torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
    """Stored tensors of one projection of one expert -> canonical pieces
    {data, scale, global_scale, input_scale} (bytes as stored; reciprocals for compressed-tensors)."""
    if fmt == "bf16":
        return {"data": parts["weight"], "scale": None, "global_scale": None, "input_scale": None}
    if fmt == "fp8":
        return {"data": parts["weight"], "scale": parts["weight_scale_inv"].to(torch.float32),
                "global_scale": None, "input_scale": None}
    if fmt == "nvfp4-modelopt":
        inp = parts.get("input_scale")
        return {"data": parts["weight"], "scale": parts["weight_scale"],
                "global_scale": parts["weight_scale_2"].reshape(()),
                "input_scale": None if inp is None else inp.reshape(())}
    if fmt == "nvfp4-compressed":
        inp = parts.get("input_global_scale")
        return {"data": parts["weight_packed"], "scale": parts["weight_scale"],
                "global_scale": 1.0 / parts["weight_global_scale"].reshape(()),
                "input_scale": None if inp is None else 1.0 / inp.reshape(())}
    raise ValueError(f"unknown per-expert checkpoint format {fmt!r}")


def canonical_to_projection(fmt: str, data: torch.Tensor, scale: Optional[torch.Tensor],
                            global_scale: Optional[torch.Tensor], input_scale: Optional[torch.Tensor]
                            ) -> Dict[str, torch.Tensor]:
    """Inverse of `projection_to_canonical` (writing checkpoints): suffix -> tensor for one expert."""
    if fmt == "bf16":
        return {"weight": data}
    if fmt == "fp8":
        return {"weight": data, "weight_scale_inv": scale}
    if fmt == "nvfp4-modelopt":
        out = {"weight": data, "weight_scale": scale, "weight_scale_2": global_scale.reshape(()).float()}
        if input_scale is not None:
            out["input_scale"] = input_scale.reshape(()).float()
        return out
    if fmt == "nvfp4-compressed":
        out = {"weight_packed": data, "weight_scale": scale,
               "weight_global_scale": (1.0 / global_scale.float()).reshape(1)}
        if input_scale is not None:
            out["input_global_scale"] = (1.0 / input_scale.float()).reshape(1)
        return out
    raise ValueError(f"unknown per-expert checkpoint format {fmt!r}")


def check_fits_plan(weight_format: Optional[str], plan) -> None:
    """ValueError when quantized checkpoint weights cannot feed the plan's experts: they run either
    the stored format itself or bf16 (dequantized at load). Unquantized weights fit every plan."""
    if weight_format is None or plan is None:
        return
    if plan.expert_mode == "bf16" or plan.weight_format == weight_format:
        return
    raise ValueError(
        f"the checkpoint's expert weights are stored as {weight_format}, but the quant plan runs "
        f"{plan.expert_mode} (weights {plan.weight_format}); set MoEConfig.quant_method to the checkpoint's "
        f"quantization (config.json quantization_config) so the plan picks a mode that reads "
        f"{weight_format}, or run quant mode 'bf16' to dequantize at load"
    )


def shared_gate_up_global_scale(weights: ExpertWeights) -> ExpertWeights:
    """NVFP4 gate and up with one global scale per expert, for kernels that fuse them into one GEMM
    with one dequantization factor (FlashInfer CUTLASS / CuTe-DSL), as vLLM and SGLang do:

        g = max(w1_global_scale, w3_global_scale)            (per expert)
        w1_scale' = e4m3(float(w1_scale) * w1_global_scale / g), same for w3

    Exact (returns `weights` unchanged) when the two already agree; otherwise the smaller side's block
    scales are re-rounded to E4M3 (a relative change <= 2^-4 per block, subnormals coarser)."""
    if weights.format != "nvfp4" or weights.w3_global_scale is None:
        return weights
    g1, g3 = weights.w1_global_scale.float(), weights.w3_global_scale.float()
    if torch.equal(g1, g3):
        return weights
    g = torch.maximum(g1, g3)

    def rescale(scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
        s = scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale
        factor = (gs / g).reshape(-1, *([1] * (s.dim() - 1)))
        return (s.float() * factor).clamp(max=448.0).to(torch.float8_e4m3fn)

    return replace(weights, w1_scale=rescale(weights.w1_scale, g1), w3_scale=rescale(weights.w3_scale, g3),
                   w1_global_scale=g.clone(), w3_global_scale=g.clone())
