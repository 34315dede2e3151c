"""`ReferenceExperts`: plain torch, float32 arithmetic, any device. The oracle other backends are
checked against, and the CPU default. It runs every expert mode of the quant plan by emulation:

    weights      quantized checkpoints are dequantized at load; unquantized ones are quantized to the
                 plan's weight format and dequantized again (online quantization), so the reference
                 sees exactly the values a kernel would
    activations  for modes that quantize activations (nvfp4_w4a4, fp8_block, mxfp8, mxfp4_w4a8) the
                 expert input and the FC2 input are quantized and dequantized per row-batch in the
                 plan's activation format (a quantized dispatch payload is used as received)

Per local expert e, on the rows that chose it (fp32 throughout, cast to the model dtype at the end):
    h = x @ w13[e].T (+ b13[e]);  a = act(h);  y = a @ w2[e].T (+ b2[e]);  out[rows] += w * y
Experts are visited in ascending order and each adds to distinct rows, so the result is
deterministic on every device. A float64 model computes in float64 instead (the gradient checks).

Training: unquantized plans only; `train_forward` is this forward under autograd (torch saves, per
expert, its input rows, the FC1 output and the activation).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from epmoe.config import MoEConfig
from epmoe.core.availability import Availability
from epmoe.core.capability import BackendRequest
from epmoe.experts.base import Experts, ExpertsSpec
from epmoe.quant import codec
from epmoe.quant.payload import PayloadFormat, QuantizedActivation
from epmoe.quant.weights import ExpertWeights, dequantize_expert_weights, quantize_expert_weights


def apply_activation(config: MoEConfig, h: torch.Tensor) -> torch.Tensor:
    """h: [N, 2I] (gate half first) for swiglu, [N, I] for relu2 -> [N, I]. Any float dtype."""
    if config.activation == "relu2":
        return torch.relu(h).square()
    g, u = h.chunk(2, dim=-1)
    if config.swiglu_alpha is None and config.swiglu_beta is None and config.swiglu_limit is None:
        return torch.nn.functional.silu(g) * u
    alpha = 1.0 if config.swiglu_alpha is None else config.swiglu_alpha
    beta = 0.0 if config.swiglu_beta is None else config.swiglu_beta
    if config.swiglu_limit is not None:
        g = g.clamp(max=config.swiglu_limit)
        u = u.clamp(min=-config.swiglu_limit, max=config.swiglu_limit)
    return g * torch.sigmoid(alpha * g) * (u + beta)


class ReferenceExperts(Experts):
    """Every expert mode, any device (plain torch, float32), flat layout. The oracle and the CPU
    default; on GPUs the slow fallback when no kernel backend runs the plan."""

    name = "reference"

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        if not base:
            return base
        return Availability.yes("emulation in float32" + ("" if request.arch == "cpu" else "; slow on GPUs"))

    @classmethod
    def supports_training(cls, request: BackendRequest) -> Availability:
        if request.expert_mode != "bf16":
            return Availability.no(
                f"{request.expert_mode} experts are inference-only (quantized weights and activations have no "
                "gradient)", "train with an unquantized checkpoint (quant=None)")
        if request.layout != "flat":
            return Availability.no(f"experts 'reference' trains on the flat layout, not {request.layout}")
        return Availability.yes("plain torch under autograd")

    @classmethod
    def consumes(cls, request: BackendRequest) -> str:
        # a wire in this dtype is used as received (codec.ACT_FORMAT_WIRE)
        return codec.ACT_FORMAT_WIRE.get(request.act_format, "bf16")

    def __init__(self, spec: ExpertsSpec):
        super().__init__(spec)
        self._params: Dict[str, torch.Tensor] = {}
        plan = spec.plan
        self._weight_format = getattr(plan, "weight_format", "bf16") if plan is not None else "bf16"
        # the plan's activation rounding (codec.roundtrip_activation); the payload format the experts
        # take is quantized only where they consume a quantized wire as received
        self._act_format = getattr(plan, "act_format", "bf16") if plan is not None else "bf16"
        self._quantizes = codec.quantizes_activations(self._act_format)
        payload = codec.ACT_FORMAT_PAYLOAD.get(self._act_format)
        self._act: Optional[PayloadFormat] = codec.payload_format(payload, self.config.dtype) if payload else None
        # float32 arithmetic, float64 for a float64 model (unquantized: nothing rounds to float32 there)
        self._compute = torch.float64 if self.config.dtype == torch.float64 and not self._quantizes \
            and self._weight_format in ("bf16", None) else torch.float32

    @property
    def payload_format(self) -> PayloadFormat:
        return self._act if self._act is not None else PayloadFormat.unquantized(self.config.dtype)

    def parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)

    def train_forward(self, tokens, params: Dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(tokens.hidden, QuantizedActivation) or self._quantizes:
            raise TypeError("experts 'reference' trains unquantized plans only (quantized modes are inference-only)")
        return self._run(tokens, params)

    def _emulated(self, weights: ExpertWeights) -> ExpertWeights:
        """The values the plan's kernels would compute with, unquantized (float32 when quantized)."""
        if weights.is_quantized:
            return dequantize_expert_weights(weights, torch.float32)
        if self._weight_format in ("bf16", None):
            return weights
        return dequantize_expert_weights(quantize_expert_weights(weights, self._weight_format), torch.float32)

    def _quant_act(self, x: torch.Tensor) -> torch.Tensor:
        if not self._quantizes or x.shape[0] == 0:
            return x
        # the one quantizer the float64 reference models (reference_moe(plan=))
        return codec.roundtrip_activation(x, self._act_format, torch.float32)

    def prepare_weights(self, weights: ExpertWeights) -> Dict[str, torch.Tensor]:
        self.check_local_weights(weights)
        weights = self._emulated(weights)
        dev = self.spec.device
        dt = self.config.dtype if self._weight_format in ("bf16", None) else torch.float32
        new = {"w13": weights.w13(), "w2": weights.w2}
        if self.config.has_bias:
            new["b13"], new["b2"] = weights.b13, weights.b2
        return {k: v.to(device=dev, dtype=dt).contiguous() for k, v in new.items()}

    def commit_weights(self, prepared: Dict[str, torch.Tensor]) -> None:
        if not self._params:
            self._params = prepared
            return
        for k, v in prepared.items():  # reload: copy in place so storage (and captured graphs) survive
            self._params[k].copy_(v)

    def load_weights(self, weights: ExpertWeights) -> None:
        self.commit_weights(self.prepare_weights(weights))

    def forward(self, tokens) -> torch.Tensor:
        return self._run(tokens, self._params)

    def _run(self, tokens, params: Dict[str, torch.Tensor]) -> torch.Tensor:
        if tokens.layout != "flat":
            raise ValueError(f"experts backend {self.name!r} takes the flat layout, got {tokens.layout!r}")
        if not self._params:
            raise RuntimeError("ReferenceExperts.forward before load_weights")
        x = tokens.hidden
        if isinstance(x, QuantizedActivation):
            x = codec.dequantize_activation(x, torch.float32)  # already in the activation format
        else:
            x = self._quant_act(x.to(self._compute))
        out = torch.zeros(x.shape[0], self.config.hidden_size, dtype=self._compute, device=x.device)
        ids, w = tokens.topk_ids, tokens.topk_weights
        for e in range(self.spec.num_local_experts):
            if tokens.static:
                # no host sync, fixed shapes (CUDA-graph safe): the expert runs on every row and rows
                # that did not choose it get weight 0 (E_local x the FLOPs; fine for decode batches)
                we = torch.where(ids == e, w.to(self._compute), torch.zeros((), device=x.device)).sum(dim=1)
                out += we.unsqueeze(1) * self._expert(e, x, params)
                continue
            rows, ks = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, self._expert(e, x[rows], params) * w[rows, ks].to(self._compute).unsqueeze(1))
        return out.to(self.config.dtype)

    def _expert(self, e: int, x: torch.Tensor, p: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Local expert e on rows x [n, H] (fp32) -> [n, H] fp32 (FC2 input quantized per the plan)."""
        if self._quantizes:
            # the FC2 input is quantized: compute it in float64 so its rounding (a discontinuity)
            # matches the float64 oracle's (reference_moe(plan=)) instead of flipping on float32 noise
            h = x.double() @ p["w13"][e].double().t()
            if "b13" in p:
                h = h + p["b13"][e].double()
            a = self._quant_act(apply_activation(self.config, h).float())
        else:
            c = self._compute
            h = x @ p["w13"][e].to(c).t()
            if "b13" in p:
                h = h + p["b13"][e].to(c)
            a = apply_activation(self.config, h)
        c = self._compute
        y = a.to(c) @ p["w2"][e].to(c).t()
        if "b2" in p:
            y = y + p["b2"][e].to(c)
        return y
