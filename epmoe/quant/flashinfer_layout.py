"""Expert-weight layouts for FlashInfer's CUTLASS fused MoE (`flashinfer.fused_moe.cutlass_fused_moe`).

Pure functions, run once at load by `epmoe.experts.flashinfer_cutlass`. The few FlashInfer layout
kernels they need (SM90 mixed-GEMM interleave, Humming preprocessing, block-scale interleave) are
imported inside the function that uses them, so this module imports nothing optional; CPU tests
replace them with recording stand-ins.

What FlashInfer CUTLASS wants, and how we get there from the canonical `ExpertWeights`:

* fc1 rows are [up; gate] = [w3; w1] ("w31"); the checkpoint order is [w1; w3] ("w13") or, for
  GPT-OSS, interleaved rows [g0, u0, g1, u1, ...]. Weights, block scales and biases are reordered
  the same way (`split_w13`, `w31`); biases become the activation dtype (BF16).
* Non-gated MoE (relu2) has no up half: fc1 = w1, truncated to w2's intermediate size when a
  checkpoint stores more rows (`truncate_nongated_w13`).
* Hidden and intermediate sizes are padded to the kernel alignment (128 for every quantized mode).
  Padded weight values are zero, so the padded rows/columns contribute nothing. Padded *block
  scales* copy an existing scale of the same expert (`preserve_expert_range`): Humming derives a
  per-expert residual from the min/max E8M0 exponent, so a foreign filler (e.g. 2^0) would change
  the numbers of real weights. Only the checkpoint's real K (`MoEConfig.hidden_size_unpadded`, e.g.
  GPT-OSS 2880 stored in a 3072-wide tensor) is copied; the pre-rounded tail is padding too.
* Per mode, the kernel layout of the (padded, reordered) tensors:
    bf16          dense, as is
    fp8_block     e4m3 data + float32 128x128 block scales, as is (SM90 DeepSeek block scaling)
    mxfp4_w4a16   SM90 mixed-GEMM interleave of weights ("fp4") and folded scales
    mxfp4_w4a8    SM90 Humming: `preprocess_moe_weights_for_sm90_mixed_gemm_humming` (weights,
                  folded scales, per-LOCAL-expert residual; we store residual x 64, the fixed 2^6
                  FP4->FP8 compensation the kernel expects in quant_scales slots 1 and 4)
                  SM100/SM120: MXFP8 activations x MXFP4 weights, `block_scale_interleave`d scales
    mxfp8         `block_scale_interleave`d E8M0 scales (SM100)
    nvfp4_w4a4    `block_scale_interleave`d E4M3 scales + per-expert dequant factors (SM100+)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from epmoe.config import MoEConfig
from epmoe.quant.weights import WEIGHT_FORMATS, ExpertWeights

W13_LAYOUTS = ("fused", "interleaved")

# Expert mode -> the weight format its kernel consumes (None: unquantized model dtype).
MODE_WEIGHT_FORMAT: Dict[str, Optional[str]] = {
    "bf16": None,
    "fp8_block": "fp8_block",
    "nvfp4_w4a4": "nvfp4",
    "mxfp4_w4a16": "mxfp4",
    "mxfp4_w4a8": "mxfp4",
    "mxfp8": "mxfp8",
}

# Kernel variants of cutlass_fused_moe (one per quant_scales ABI) and the mode + archs behind them.
CUTLASS_VARIANTS = (
    "bf16",
    "fp8_block",
    "nvfp4",
    "mxfp4_w4a16",
    "mxfp4_w4a8_humming",
    "mxfp8",
    "mxfp8_mxfp4",
)
_BLACKWELL = (100, 103, 107, 110, 120, 121)
_VARIANT_BY_MODE_ARCH = {
    "bf16": {a: "bf16" for a in (89, 90) + _BLACKWELL},
    "fp8_block": {90: "fp8_block"},
    "nvfp4_w4a4": {a: "nvfp4" for a in _BLACKWELL},
    "mxfp4_w4a16": {90: "mxfp4_w4a16"},
    # FP8 activations on Blackwell are MXFP8 (Humming is a Hopper-only kernel); same weights.
    "mxfp4_w4a8": {90: "mxfp4_w4a8_humming", **{a: "mxfp8_mxfp4" for a in _BLACKWELL}},
    "mxfp8": {a: "mxfp8" for a in (100, 103, 107)},
}
# Variants whose scales pad by copying an existing scale of the same expert (see module docstring).
_PRESERVE_RANGE_VARIANTS = ("mxfp4_w4a16", "mxfp4_w4a8_humming", "mxfp8", "mxfp8_mxfp4", "nvfp4")
HUMMING_RESIDUAL_COMPENSATION = 64.0  # 2^6: FP4 -> FP8 exponent shift folded into the residual


def resolve_cutlass_variant(mode: str, arch: int) -> str:
    """The `cutlass_fused_moe` kernel variant for expert `mode` on SM`arch`; ValueError if none."""
    if mode not in _VARIANT_BY_MODE_ARCH:
        hint = ""
        if mode == "nvfp4_w4a16":
            hint = (
                " (NVFP4 W4A16 runs on FlashInfer's SM100 CuTe-DSL kernel, not CUTLASS: use the "
                "'flashinfer_sm100' experts backend)"
            )
        raise ValueError(
            f"expert mode {mode!r} has no FlashInfer CUTLASS kernel{hint}; CUTLASS modes: "
            f"{sorted(_VARIANT_BY_MODE_ARCH)}"
        )
    by_arch = _VARIANT_BY_MODE_ARCH[mode]
    if arch not in by_arch:
        raise ValueError(
            f"expert mode {mode!r} has no FlashInfer CUTLASS kernel on SM{arch}; it runs on "
            f"SM{sorted(by_arch)}"
        )
    return by_arch[arch]


def variant_alignment(variant: str) -> int:
    """Hidden/intermediate multiple the variant's kernel needs (1: no padding)."""
    return 1 if variant == "bf16" else 128


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ----------------------------------------------------------------------------- reordering
def split_w13(w13: torch.Tensor, layout: str = "fused") -> Tuple[torch.Tensor, torch.Tensor]:
    """Split fused first-projection rows (dim 1) into (gate, up) = (w1, w3).

    layout "fused":       [w1; w3] (HF gate_up_proj, gate rows first)
    layout "interleaved": [g0, u0, g1, u1, ...] (GPT-OSS)
    Works for weights [E, 2I, K], block scales [E, 2I, K/block] and biases [E, 2I] alike.
    """
    if layout not in W13_LAYOUTS:
        raise ValueError(f"w13 layout {layout!r}; use one of {W13_LAYOUTS}")
    if w13.dim() < 2 or w13.shape[1] % 2:
        raise ValueError(f"fused w13 needs an even row count in dim 1, got shape {list(w13.shape)}")
    if layout == "interleaved":
        return w13[:, 0::2], w13[:, 1::2]
    gate, up = w13.chunk(2, dim=1)
    return gate, up


def w31(gate: torch.Tensor, up: Optional[torch.Tensor]) -> torch.Tensor:
    """FlashInfer CUTLASS fc1 order: [up; gate] along dim 1 (just `gate` for non-gated MoE)."""
    if up is None:
        return gate.contiguous()
    if gate.shape != up.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} halves differ in shape")
    return torch.cat([up, gate], dim=1).contiguous()


def swap_w13_to_w31(w13: torch.Tensor, layout: str = "fused") -> torch.Tensor:
    """[w1; w3] (or GPT-OSS interleaved) -> [w3; w1] for weights, scales and biases."""
    gate, up = split_w13(w13, layout)
    return w31(gate, up)


def bias13_to_w31(b13: torch.Tensor, gated: bool, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """b13 [E, 2I] = [b_gate; b_up] -> [b_up; b_gate] in `dtype` (the kernel's activation dtype)."""
    if not gated:
        return b13.to(dtype).contiguous()
    gate, up = split_w13(b13, "fused")
    return w31(gate, up).to(dtype)


def truncate_nongated_w13(
    w13: torch.Tensor, intermediate_size: int, w13_scale: Optional[torch.Tensor] = None, scale_rows_per_block: int = 1
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Non-gated MoE: keep the first `intermediate_size` fc1 rows (w2's K). Checkpoints of
    non-gated models sometimes store w13 with 2I rows; the second half is never used."""
    if w13.shape[1] < intermediate_size:
        raise ValueError(
            f"non-gated w13 has {w13.shape[1]} rows, fewer than w2's intermediate size "
            f"{intermediate_size}"
        )
    w13 = w13[:, :intermediate_size].contiguous()
    if w13_scale is not None:
        w13_scale = w13_scale[:, : -(-intermediate_size // scale_rows_per_block)].contiguous()
    return w13, w13_scale


# ----------------------------------------------------------------------------- padding
def pad_expert_tensor(
    t: torch.Tensor,
    rows: int,
    cols: int,
    *,
    copy_rows: Optional[int] = None,
    copy_cols: Optional[int] = None,
    preserve_expert_range: bool = False,
) -> torch.Tensor:
    """[E, r, c] -> [E, rows, cols]; copies t[:, :copy_rows, :copy_cols] (default: all of t).

    Padding is zero, or with `preserve_expert_range` the expert's own t[e, 0, 0] (a real block
    scale), so each expert's min/max is unchanged by padding. Elements of t beyond
    copy_rows/copy_cols (a pre-rounded tail) are treated as padding too.
    """
    if t.dim() != 3:
        raise ValueError(f"expected a [experts, rows, cols] tensor, got shape {list(t.shape)}")
    E, r, c = t.shape
    if rows < r or cols < c:
        raise ValueError(f"cannot pad [{E}, {r}, {c}] down to [{E}, {rows}, {cols}]")
    copy_rows = r if copy_rows is None else min(copy_rows, r)
    copy_cols = c if copy_cols is None else min(copy_cols, c)
    if (rows, cols, copy_rows, copy_cols) == (r, c, r, c):
        return t.contiguous()
    # 1-byte formats (fp8, packed fp4, e8m0) are moved as bytes: a zero byte is 0.0 in each.
    src = t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
    out = src.new_zeros((E, rows, cols))
    if preserve_expert_range:
        out.copy_(src[:, :1, :1].expand(E, rows, cols))
    out[:, :copy_rows, :copy_cols] = src[:, :copy_rows, :copy_cols]
    return out.view(t.dtype) if src is not t else out


@dataclass(frozen=True)
class CutlassGeometry:
    """Sizes on both sides of the padding.

    hidden_size:        H of the layer's activations (MoEConfig.hidden_size)
    hidden_real:        the checkpoint's real K (MoEConfig.hidden_size_unpadded or H)
    hidden_kernel:      H the kernel runs at (activations are zero-padded to it when larger than H)
    intermediate_size:  I; intermediate_kernel: I padded to the alignment
    """

    variant: str
    gated: bool
    hidden_size: int
    hidden_real: int
    hidden_kernel: int
    intermediate_size: int
    intermediate_kernel: int

    @property
    def fc1_rows(self) -> int:
        return self.intermediate_kernel * (2 if self.gated else 1)

    @property
    def pads_hidden(self) -> bool:
        return self.hidden_kernel != self.hidden_size


def cutlass_geometry(config: MoEConfig, variant: str) -> CutlassGeometry:
    if variant not in CUTLASS_VARIANTS:
        raise ValueError(f"unknown CUTLASS variant {variant!r}; use one of {CUTLASS_VARIANTS}")
    a = variant_alignment(variant)
    return CutlassGeometry(
        variant=variant,
        gated=config.is_gated,
        hidden_size=config.hidden_size,
        hidden_real=config.hidden_size_unpadded or config.hidden_size,
        hidden_kernel=round_up(config.hidden_size, a),
        intermediate_size=config.intermediate_size,
        intermediate_kernel=round_up(config.intermediate_size, a),
    )


def _pad_projection(
    data: torch.Tensor,
    scale: Optional[torch.Tensor],
    fmt_name: Optional[str],
    *,
    rows: int,
    cols: int,
    real_rows: int,
    real_cols: int,
    preserve_range: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pad one projection [E, rows_logical, cols_logical] (stored per its format) to [rows, cols]."""
    vpe = 1 if fmt_name is None else WEIGHT_FORMATS[fmt_name].values_per_element
    data = pad_expert_tensor(
        data, rows, cols // vpe, copy_rows=real_rows, copy_cols=-(-real_cols // vpe)
    )
    if scale is not None:
        br, bc = WEIGHT_FORMATS[fmt_name].scale_block
        scale = pad_expert_tensor(
            scale,
            -(-rows // br),
            -(-cols // bc),
            copy_rows=-(-real_rows // br),
            copy_cols=-(-real_cols // bc),
            preserve_expert_range=preserve_range,
        )
    return data, scale


def canonical_cutlass_tensors(weights: ExpertWeights, geo: CutlassGeometry, act_dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Reorder to [w3; w1] and pad; no FlashInfer layout kernels yet.

    Returns fc1_weight [E, fc1_rows, Hk(/2)], fc2_weight [E, Hk, Ik(/2)], their block scales
    (fc1_scale / fc2_scale, logical row-major layout) when quantized, fc1_bias [E, fc1_rows] /
    fc2_bias [E, Hk] in `act_dtype` when present.
    """
    fmt = weights.format
    preserve = geo.variant in _PRESERVE_RANGE_VARIANTS
    pad = dict(preserve_range=preserve)
    Ik, Hk, I, Hr = geo.intermediate_kernel, geo.hidden_kernel, geo.intermediate_size, geo.hidden_real
    gate, gate_s = _pad_projection(
        weights.w1, weights.w1_scale, fmt, rows=Ik, cols=Hk, real_rows=I, real_cols=Hr, **pad
    )
    up = up_s = None
    if geo.gated:
        up, up_s = _pad_projection(
            weights.w3, weights.w3_scale, fmt, rows=Ik, cols=Hk, real_rows=I, real_cols=Hr, **pad
        )
    down, down_s = _pad_projection(
        weights.w2, weights.w2_scale, fmt, rows=Hk, cols=Ik, real_rows=Hr, real_cols=I, **pad
    )
    out = {"fc1_weight": w31(gate, up), "fc2_weight": down.contiguous()}
    if gate_s is not None:
        out["fc1_scale"] = w31(gate_s, up_s)
        out["fc2_scale"] = down_s.contiguous()
    if weights.b13 is not None:
        if geo.gated:
            b_gate, b_up = split_w13(weights.b13, "fused")
            b_gate = pad_expert_tensor(b_gate.unsqueeze(-1), Ik, 1).squeeze(-1)
            b_up = pad_expert_tensor(b_up.unsqueeze(-1), Ik, 1).squeeze(-1)
            out["fc1_bias"] = w31(b_gate, b_up).to(act_dtype)
        else:
            out["fc1_bias"] = pad_expert_tensor(weights.b13.unsqueeze(-1), Ik, 1).squeeze(-1).to(act_dtype)
    if weights.b2 is not None:
        out["fc2_bias"] = (
            pad_expert_tensor(weights.b2.unsqueeze(-1), Hk, 1, copy_rows=Hr).squeeze(-1).to(act_dtype).contiguous()
        )
    return out


def _block_scale_interleave_experts(scale: torch.Tensor) -> torch.Tensor:
    """FlashInfer's 128x4 swizzle of per-expert block scales, keeping [E, rows, cols] bytes."""
    from flashinfer import block_scale_interleave

    shape = scale.shape
    return block_scale_interleave(scale.view(torch.uint8).contiguous()).reshape(shape).contiguous()


def convert_for_cutlass(
    weights: ExpertWeights, config: MoEConfig, variant: str, act_dtype: torch.dtype = torch.bfloat16
) -> Dict[str, torch.Tensor]:
    """Local canonical expert weights -> the tensors `cutlass_fused_moe` consumes for `variant`.

    `weights` must already be in the variant's weight format (MODE_WEIGHT_FORMAT). Returns a dict of
    kernel tensors (names used by `epmoe.experts.flashinfer_cutlass.assemble_quant_scales`):
      fc1_weight, fc2_weight, [fc1_bias, fc2_bias], and per variant
      fp8_block:           fc1_scale, fc2_scale (float32 128x128 blocks)
      mxfp4_w4a16:         fc1_scale, fc2_scale (SM90 folded uint8)
      mxfp4_w4a8_humming:  fc1_scale, fc2_scale (folded), fc1_residual_scale, fc2_residual_scale
                           ([E_local] float32, x64), fc2_act_scale (0-dim float32, reserved = 1)
      mxfp8, mxfp8_mxfp4:  fc1_scale, fc2_scale (128x4-interleaved uint8), fc1_input_scale,
                           fc2_input_scale ([E_local] float32 ones)
      nvfp4:               fc1_scale, fc2_scale (interleaved e4m3 bytes), fc1_act_global_scale,
                           fc2_act_global_scale (0-dim), fc1_dequant_scale, fc2_dequant_scale ([E])
    """
    want = {
        "bf16": None,
        "fp8_block": "fp8_block",
        "nvfp4": "nvfp4",
        "mxfp4_w4a16": "mxfp4",
        "mxfp4_w4a8_humming": "mxfp4",
        "mxfp8": "mxfp8",
        "mxfp8_mxfp4": "mxfp4",
    }[variant]
    if weights.format != want:
        raise ValueError(
            f"CUTLASS variant {variant!r} takes {want or 'unquantized'} expert weights, got "
            f"{weights.format or 'unquantized'}; quantize the checkpoint (or pick the matching mode)"
        )
    if variant == "nvfp4":
        # one fused gate/up GEMM has one dequantization factor per expert: shared max, rescaled blocks
        from epmoe.quant.checkpoint_formats import shared_gate_up_global_scale

        weights = shared_gate_up_global_scale(weights)
    geo = cutlass_geometry(config, variant)
    out = canonical_cutlass_tensors(weights, geo, act_dtype)
    E = weights.num_experts
    dev = out["fc1_weight"].device
    if variant == "bf16":
        out["fc1_weight"] = out["fc1_weight"].to(act_dtype)
        out["fc2_weight"] = out["fc2_weight"].to(act_dtype)
    elif variant == "mxfp4_w4a16":
        from flashinfer.fused_moe import (
            interleave_moe_scales_for_sm90_mixed_gemm,
            interleave_moe_weights_for_sm90_mixed_gemm,
        )

        for fc in ("fc1", "fc2"):
            out[f"{fc}_weight"] = interleave_moe_weights_for_sm90_mixed_gemm(out[f"{fc}_weight"], "fp4")
            out[f"{fc}_scale"] = interleave_moe_scales_for_sm90_mixed_gemm(out[f"{fc}_scale"])
    elif variant == "mxfp4_w4a8_humming":
        from flashinfer.fused_moe import preprocess_moe_weights_for_sm90_mixed_gemm_humming

        for fc in ("fc1", "fc2"):
            w, s, residual = preprocess_moe_weights_for_sm90_mixed_gemm_humming(
                out[f"{fc}_weight"], out[f"{fc}_scale"]
            )
            if tuple(residual.shape) != (E,):
                raise RuntimeError(
                    f"Humming preprocessing returned a {fc} residual of shape {list(residual.shape)}; "
                    f"expected one per local expert [{E}] (FlashInfer >= 0.6.18 per-local-expert ABI)"
                )
            out[f"{fc}_weight"], out[f"{fc}_scale"] = w, s
            out[f"{fc}_residual_scale"] = (residual.float() * HUMMING_RESIDUAL_COMPENSATION).contiguous()
        out["fc2_act_scale"] = torch.ones((), dtype=torch.float32, device=dev)
    elif variant in ("mxfp8", "mxfp8_mxfp4"):
        for fc in ("fc1", "fc2"):
            out[f"{fc}_scale"] = _block_scale_interleave_experts(out[f"{fc}_scale"])
        out["fc1_input_scale"] = torch.ones(E, dtype=torch.float32, device=dev)
        out["fc2_input_scale"] = torch.ones(E, dtype=torch.float32, device=dev)
    elif variant == "nvfp4":
        out.update(_nvfp4_global_scales(weights))
        for fc in ("fc1", "fc2"):
            out[f"{fc}_scale"] = _block_scale_interleave_experts(out[f"{fc}_scale"])
    return out


def _nvfp4_global_scales(weights: ExpertWeights) -> Dict[str, torch.Tensor]:
    """CUTLASS NVFP4 epilogue factors from ModelOpt-style scales (all dequantization factors).

    The kernel quantizes BF16 activations with one static multiplier per GEMM (1 / input_scale,
    the max over local experts) and rescales each expert's output by input_scale x weight_global.
    """
    missing = [n for n in ("w13_input_scale", "w2_input_scale") if getattr(weights, n) is None]
    if missing:
        raise ValueError(
            f"NVFP4 W4A4 needs the checkpoint's static activation scales {missing} "
            "(ModelOpt input_scale); without them use mode 'nvfp4_w4a16'"
        )
    g1 = weights.w1_global_scale
    if weights.w3_global_scale is not None and not torch.equal(weights.w3_global_scale, g1):
        bad = (weights.w3_global_scale != g1).nonzero().flatten()[:4].tolist()
        raise ValueError(
            f"NVFP4 gate and up weights of local experts {bad} have different global scales; "
            "pass them through quant.checkpoint_formats.shared_gate_up_global_scale first"
        )
    s1 = weights.w13_input_scale.float().max()
    s2 = weights.w2_input_scale.float().max()
    return {
        "fc1_act_global_scale": (1.0 / s1).reshape(()).contiguous(),
        "fc1_dequant_scale": (s1 * g1.float()).contiguous(),
        "fc2_act_global_scale": (1.0 / s2).reshape(()).contiguous(),
        "fc2_dequant_scale": (s2 * weights.w2_global_scale.float()).contiguous(),
    }
