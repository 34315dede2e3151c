"""`MaskedReferenceExperts` ("masked_reference"): the experts for the masked layout that DeepEP's
low-latency dispatcher produces. Plain torch, float32 arithmetic, CPU and GPU.

    tokens.hidden        [E_local, M, H] (tensor, or QuantizedActivation fp8_block: dequantized here)
    tokens.expert_counts [E_local] int32: rows [0, count) of expert e are valid, the rest is garbage
    output               [E_local, M, H] in the model dtype: per expert, the UNWEIGHTED expert output of
                         its valid rows, zeros elsewhere (the dispatcher's combine applies the weights)

Per valid row x of local expert e (fp32 throughout, cast to the model dtype at the end):
    h = x @ w13[e].T (+ b13[e]);  a = act(h);  y = a @ w2[e].T (+ b2[e])

`masked_expert_mode_support` is the plan rule for the masked layout (see docs/deepep.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.experts.base import Experts, ExpertsOptions, ExpertsSpec
from epmoe.experts.reference import apply_activation
from epmoe.quant.payload import PayloadFormat, QuantizedActivation
from epmoe.quant.weights import ExpertWeights

# Expert modes a masked-layout (grouped, per-expert padded) kernel can run. NVFP4 experts run there as
# W4A4 only: masked grouped GEMMs (FlashInfer's / DeepGEMM-style) quantize the activations themselves
# and have no W4A16 variant; MXFP4 (W4A16 / W4A8) and MXFP8 have no masked kernel in our stack.
MASKED_EXPERT_MODES = ("bf16", "fp8_block", "nvfp4_w4a4")
# What this reference implements: unquantized weights (the canonical ones), BF16 or FP8 activations.
REFERENCE_EXPERT_MODES = ("bf16", "fp8_block")


def masked_expert_mode_support(expert_mode: str) -> Availability:
    """Can experts in `expert_mode` consume the masked layout at all?"""
    if expert_mode in MASKED_EXPERT_MODES:
        return Availability.yes()
    if expert_mode == "nvfp4_w4a16":
        return Availability.no(
            "the masked layout runs NVFP4 experts as W4A4 only (masked grouped GEMMs quantize the "
            "activations to NVFP4; there is no W4A16 masked kernel)",
            "use quant 'nvfp4_w4a4', or a flat-layout dispatcher ('torch', 'deepep', 'flashinfer') for W4A16",
        )
    return Availability.no(
        f"no masked-layout experts kernel runs expert mode {expert_mode!r} "
        f"(masked layout supports {MASKED_EXPERT_MODES})",
        "use a flat-layout dispatcher ('torch', 'deepep', 'flashinfer') for this mode",
    )


def _fp8_block_payload() -> PayloadFormat:
    return PayloadFormat(
        name="fp8_block", dtype=torch.float8_e4m3fn, block_size=128, scale_dtype=torch.float32,
        scale_layout="linear",
    )


def _dequantize(x: QuantizedActivation) -> torch.Tensor:
    """fp8_block [..., H] data + [..., H/128] scales (any strides) -> float32 [..., H]."""
    f = x.format
    if f.name != "fp8_block" or f.block_size is None:
        raise ValueError(f"masked reference experts dequantize fp8_block activations only, got {f.describe()}")
    from epmoe.quant import fp8_block

    return fp8_block.dequantize_activation(x.data, x.scales.float(), torch.float32, f.block_size)


@dataclass(frozen=True)
class MaskedReferenceOptions(ExpertsOptions):
    """payload: a PayloadFormat to consume instead of the mode's default (tests)."""

    payload: Any = None


class MaskedReferenceExperts(Experts):
    """Masked layout (DeepEP low-latency), bf16 and fp8_block experts, plain torch on any device."""

    name = "masked_reference"
    accepted_layouts = ("masked",)
    Options = MaskedReferenceOptions

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        if not base:
            return base
        ok = masked_expert_mode_support(request.expert_mode)
        if not ok:
            return ok
        if request.expert_mode not in REFERENCE_EXPERT_MODES:
            return Availability.no(
                f"the masked reference implements {REFERENCE_EXPERT_MODES}, not {request.expert_mode!r}; "
                "no masked-layout kernel for it is wired up",
                "use a flat-layout dispatcher ('torch', 'deepep', 'flashinfer') for this mode",
            )
        return Availability.yes()

    @classmethod
    def consumes(cls, request: BackendRequest) -> str:
        return "fp8" if request.expert_mode == "fp8_block" else "bf16"

    def __init__(self, spec: ExpertsSpec):
        super().__init__(spec)
        avail = type(self).availability(spec)
        if not avail:
            raise ValueError(f"experts backend {self.name!r}: {avail.reason}; {avail.hint}")
        self._params: Dict[str, torch.Tensor] = {}

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        mode = spec.expert_mode
        ok = masked_expert_mode_support(mode)
        if not ok:
            return ok
        if mode not in REFERENCE_EXPERT_MODES:
            return Availability.no(
                f"the masked reference implements expert modes {REFERENCE_EXPERT_MODES}, not {mode!r}",
                "use a masked kernel backend for this mode",
            )
        return Availability.yes()

    @property
    def payload_format(self) -> PayloadFormat:
        """FP8 (e4m3 + fp32 per 128) for fp8_block experts, else the unquantized model dtype. An
        explicit experts option "payload" (a PayloadFormat) wins."""
        given = self.spec.option("payload")
        if given is not None:
            return given
        if self.spec.expert_mode == "fp8_block":
            return _fp8_block_payload()
        return PayloadFormat.unquantized(self.config.dtype)

    def parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)

    def load_weights(self, weights: ExpertWeights) -> None:
        self.check_local_weights(weights)
        if weights.is_quantized:  # a quantized checkpoint: its own values, dequantized
            from epmoe.quant.weights import dequantize_expert_weights

            weights = dequantize_expert_weights(weights, torch.float32)
        dev, dt = self.spec.device, self.config.dtype
        new = {"w13": weights.w13(), "w2": weights.w2}
        if self.config.has_bias:
            new["b13"], new["b2"] = weights.b13, weights.b2
        if not self._params:
            self._params = {k: v.to(device=dev, dtype=dt).contiguous() for k, v in new.items()}
            return
        for k, v in new.items():  # reload in place: storage (and captured graphs) survive
            self._params[k].copy_(v)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e on rows x [n, H] (any float dtype) -> [n, H] float32, unweighted."""
        p = self._params
        h = x.float() @ p["w13"][e].float().t()
        if "b13" in p:
            h = h + p["b13"][e].float()
        y = apply_activation(self.config, h) @ p["w2"][e].float().t()
        if "b2" in p:
            y = y + p["b2"][e].float()
        return y

    def forward(self, tokens) -> torch.Tensor:
        if tokens.layout != "masked":
            raise ValueError(
                f"experts backend {self.name!r} takes the masked layout, got {tokens.layout!r}; "
                "pair it with a masked dispatcher ('deepep_ll')"
            )
        if not self._params:
            raise RuntimeError("MaskedReferenceExperts.forward before load_weights")
        x = tokens.hidden
        E, H = self.spec.num_local_experts, self.config.hidden_size
        data = x.data if isinstance(x, QuantizedActivation) else x
        if data.dim() != 3 or data.shape[0] != E or data.shape[2] != H:
            raise ValueError(f"masked hidden has shape {list(data.shape)}; expected [{E}, max_rows, {H}]")
        M = data.shape[1]
        counts = tokens.expert_counts
        if counts is None or tuple(counts.shape) != (E,):
            got = None if counts is None else list(counts.shape)
            raise ValueError(f"expert_counts has shape {got}; expected [{E}] (valid rows per local expert)")
        n_rows = [int(c) for c in counts.tolist()]
        bad = [(e, n) for e, n in enumerate(n_rows) if not 0 <= n <= M]
        if bad:
            raise ValueError(f"expert_counts {bad[:4]} (expert, count) are outside [0, {M}] rows of the masked layout")
        if isinstance(x, QuantizedActivation):
            x = _dequantize(x)
        out = torch.zeros(E, M, H, dtype=self.config.dtype, device=data.device)
        for e, n in enumerate(n_rows):
            if n:
                out[e, :n] = self.expert(e, x[e, :n]).to(self.config.dtype)
        return out
