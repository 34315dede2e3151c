"""Dense single-process reference of the whole layer, in float64: the oracle for `--check` and tests.

Written independently of the experts backends (one token-expert pair at a time, no batching tricks);
it shares only `epmoe.routing.route`, so both sides choose the same experts on near-ties.

With `plan=` it models the plan's lossy path the way the kernels run it: the wire (tokens quantized
per token before the all-to-all with `codec.quantize_for_wire`, dequantized on arrival to the model
dtype unless the experts consume that format), the expert weights quantized to the plan's weight
format, the experts' activation quantization (expert input and FC2 input, per token), and FC1's output
rounded to the model dtype where the plan's experts backend writes it to memory that way
(`Experts.fc1_output_rounded`: DeepGEMM's and torch's grouped GEMMs). Quantization uses the codec (the
formats' one definition); every GEMM and activation is float64.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from epmoe.config import MoEConfig
from epmoe.quant import codec
from epmoe.quant.weights import ExpertWeights, dequantize_expert_weights, quantize_expert_weights
from epmoe.routing import Routing, route


def _act(config: MoEConfig, g: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
    if config.activation == "relu2":
        return torch.clamp(g, min=0) ** 2
    if config.swiglu_alpha is None and config.swiglu_beta is None and config.swiglu_limit is None:
        return g / (1 + torch.exp(-g)) * u
    alpha = config.swiglu_alpha if config.swiglu_alpha is not None else 1.0
    beta = config.swiglu_beta if config.swiglu_beta is not None else 0.0
    if config.swiglu_limit is not None:
        g = torch.clamp(g, max=config.swiglu_limit)
        u = torch.clamp(u, -config.swiglu_limit, config.swiglu_limit)
    return g / (1 + torch.exp(-alpha * g)) * (u + beta)


def reference_moe(
    config: MoEConfig,
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    router_logits: Optional[torch.Tensor] = None,
    routing: Optional[Routing] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    plan=None,
) -> torch.Tensor:
    """hidden_states [T, H], global `weights` (all E experts) -> [T, H] float64.

    Pass `router_logits` [T, E] or an explicit `routing` (ids -1 are skipped). `plan` (a QuantPlan):
    model its wire and quantization (see the module docstring); None: exact unquantized math."""
    if routing is None:
        if router_logits is None:
            raise ValueError("pass router_logits or routing")
        routing = route(config, router_logits, e_score_correction_bias, impl="torch")
    if weights.num_experts != config.num_experts or weights.first_expert != 0:
        raise ValueError("reference_moe needs the global weights of all experts")
    act_q = lambda h: h  # noqa: E731 - the experts' activation quantization (identity without a plan)
    fc1_q = act_q  # FC1's output as the activation reads it (identity without a plan)
    if plan is not None:
        hidden_states, weights, act_q = _model_plan(config, plan, hidden_states.cpu(), weights)
        fc1_q = _fc1_rounding(config, plan)
    elif weights.is_quantized:
        weights = dequantize_expert_weights(weights, torch.float64)
    x = hidden_states.double().cpu()
    ids = routing.topk_ids.cpu()
    wts = routing.topk_weights.double().cpu()
    w1, w2 = weights.w1.double().cpu(), weights.w2.double().cpu()
    w3 = weights.w3.double().cpu() if weights.w3 is not None else None
    I = config.intermediate_size
    b1 = b3 = b2 = None
    if weights.b13 is not None:
        b13 = weights.b13.double().cpu()
        b1, b3 = (b13[:, :I], b13[:, I:]) if config.is_gated else (b13, None)
        b2 = weights.b2.double().cpu()
    out = torch.zeros(x.shape[0], config.hidden_size, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            g = fc1_q(w1[e] @ x[t]) + (b1[e] if b1 is not None else 0)
            u = fc1_q(w3[e] @ x[t]) + (b3[e] if b3 is not None else 0) if w3 is not None else None
            y = w2[e] @ act_q(_act(config, g, u)) + (b2[e] if b2 is not None else 0)
            out[t] += wts[t, k] * y
    return out


def _fc1_rounding(config: MoEConfig, plan) -> Callable[[torch.Tensor], torch.Tensor]:
    """FC1's output as the plan's experts backend hands it to the activation: rounded to the model
    dtype where the backend writes it to memory (`Experts.fc1_output_rounded`), else exact."""
    from epmoe.experts import EXPERTS  # the registry (the experts package imports no reference)

    try:
        rounded = EXPERTS.get(plan.experts_backend).fc1_output_rounded
    except ValueError:  # a plan naming no registered backend (hand-built): exact
        rounded = False
    if not rounded or config.dtype == torch.float64:
        return lambda v: v
    return lambda v: v.to(config.dtype).double()


def _wire_roundtrip(plan) -> Callable:
    """How the plan's dispatcher quantizes its wire (`Dispatcher.wire_roundtrip`): epmoe's codec, or
    the dispatcher's own cast (DeepEP low latency); the codec for a plan naming no registered one."""
    from epmoe.dispatch import DISPATCHERS  # the registry (dispatch imports no reference)

    try:
        return DISPATCHERS.get(plan.dispatcher).wire_roundtrip
    except (ValueError, TypeError):
        return codec.roundtrip_for_wire


def _model_plan(config: MoEConfig, plan, x: torch.Tensor, weights: ExpertWeights):
    """(tokens as the experts see them, weights as the kernels use them, FC2-input quantizer)."""
    quantizes = codec.quantizes_activations(plan.act_format)

    def act_q(v: torch.Tensor) -> torch.Tensor:
        if not quantizes:
            return v
        one = v.dim() == 1
        q = codec.roundtrip_activation(v.reshape(1, -1).float() if one else v.float(), plan.act_format, torch.float64)
        return q.reshape(v.shape) if one else q

    if plan.dispatch_dtype != "bf16" and x.shape[0]:
        wire = codec.payload_format(plan.dispatch_dtype, config.dtype)
        roundtrip = _wire_roundtrip(plan)
        if codec.ACT_FORMAT_WIRE.get(plan.act_format) == plan.dispatch_dtype:
            x = roundtrip(x, wire, torch.float64)  # used as received
        else:  # dequantized on arrival to the model dtype, then quantized by the experts
            x = act_q(roundtrip(x, wire, config.dtype))
    elif x.shape[0]:
        x = act_q(x)
    if weights.is_quantized:
        weights = dequantize_expert_weights(weights, torch.float64)
    elif plan.weight_format not in ("bf16", None):
        weights = dequantize_expert_weights(quantize_expert_weights(weights, plan.weight_format), torch.float64)
    return x, weights, act_q


def reference_moe_streamed(
    config: MoEConfig,
    hidden_states: torch.Tensor,
    expert: Callable[[int], ExpertWeights],
    router_logits: Optional[torch.Tensor] = None,
    routing: Optional[Routing] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    plan=None,
) -> torch.Tensor:
    """`reference_moe` holding one expert at a time: `expert(e)` returns the ExpertWeights of expert e
    alone (e.g. read from a checkpoint), called once per expert that some token chose. Memory: one
    expert in float64 plus the activations, whatever the model size. `plan`: as in reference_moe
    (weights quantized per expert, which every weight format's scales are). -> [T, H] float64."""
    if routing is None:
        if router_logits is None:
            raise ValueError("pass router_logits or routing")
        routing = route(config, router_logits, e_score_correction_bias, impl="torch")
    ids = routing.topk_ids.cpu().long()
    chosen = sorted(int(v) for v in torch.unique(ids) if v >= 0)
    act_q = lambda h: h  # noqa: E731
    fc1_q = act_q
    x = hidden_states.cpu()
    if plan is not None and chosen:
        x, _, act_q = _model_plan(config, plan, x, expert(chosen[0]))
        fc1_q = _fc1_rounding(config, plan)
    x = x.double()
    wts = routing.topk_weights.double().cpu()
    I = config.intermediate_size
    out = torch.zeros(x.shape[0], config.hidden_size, dtype=torch.float64)
    for e in chosen:
        w = expert(e)
        if w.num_experts != 1:
            raise ValueError(f"expert({e}) returned {w.num_experts} experts; expected exactly one")
        if w.is_quantized:
            w = dequantize_expert_weights(w, torch.float64)
        elif plan is not None and plan.weight_format not in ("bf16", None):
            w = dequantize_expert_weights(quantize_expert_weights(w, plan.weight_format), torch.float64)
        rows, ks = (ids == e).nonzero(as_tuple=True)
        xe = x[rows]
        g = fc1_q(xe @ w.w1[0].double().t())
        u = fc1_q(xe @ w.w3[0].double().t()) if w.w3 is not None else None
        b2 = None
        if w.b13 is not None:
            b13 = w.b13[0].double()
            g = g + (b13[:I] if config.is_gated else b13)
            if u is not None:
                u = u + b13[I:]
            b2 = w.b2[0].double()
        y = act_q(_act(config, g, u)) @ w.w2[0].double().t()
        if b2 is not None:
            y = y + b2
        out.index_add_(0, rows, wts[rows, ks].unsqueeze(1) * y)
    return out
