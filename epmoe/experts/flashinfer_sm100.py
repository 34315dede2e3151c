"""Blackwell (SM100/SM103) experts on FlashInfer's non-CUTLASS MoE kernels.

    "flashinfer_cutedsl"  CuTe-DSL `CuteDslMoEWrapper`: nvfp4_w4a4 and nvfp4_w4a16 (FlashInfer >= 0.6.18)
    "flashinfer_trtllm"   TRT-LLM-gen `trtllm_fp4_block_scale_routed_moe`: mxfp4_w4a16 (MXFP4 x BF16)

W4A16 passes the dispatched BF16 activations straight through (SGLang #35120, reference 001): no
activation quantization, `x_sf=None`, `fc2_input_scale=None` (CuTe-DSL) / `hidden_states_scale=None`
(TRT-LLM-gen). The dispatcher therefore moves BF16 (one workspace, BF16 geometry); an NVFP4 wire
payload is dequantized before the call. W4A4 (CuTe-DSL) quantizes BF16 activations to NVFP4 here
with FlashInfer's `fp4_quantize` (linear scales, unit global scale, matching the weight view that
`prepare_cute_dsl_weights` builds).

Weights are prepared once at load by FlashInfer's own helpers (`prepare_cute_dsl_weights`,
`prepare_trtllm_fp4_weights`) from BF16 [up; gate] weights: quantized checkpoints are dequantized
first (epmoe.quant codecs) and re-quantized by FlashInfer (see the report's open problems).

Expert ids: both kernels take GLOBAL ids with `local_expert_offset` / `local_num_experts`. Their
routing kernels count experts with histograms, so instead of -1 we pass an expert of ANOTHER rank for
"not here" (ep_size > 1; skipped by the kernel) or local expert 0 with weight 0 (ep_size == 1).

These kernels cannot run on our H200s; the call assembly (`cutedsl_run_kwargs`,
`trtllm_routed_kwargs`, `sanitized_global_ids`) is pure and tested on CPU with recording stand-ins.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any, Dict, Optional, Tuple

import torch

from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.core.errors import BackendUnavailableError
from epmoe.experts.base import Experts, ExpertsSpec
from epmoe.experts.flashinfer_cutlass import INSTALL_HINT, _device_arch, check_reload, version_at_least
from epmoe.quant.flashinfer_layout import w31
from epmoe.quant.payload import PayloadFormat, QuantizedActivation
from epmoe.quant.weights import ExpertWeights

CUTEDSL_W4A16_MIN_VERSION = "0.6.18"
CUTEDSL_ARCHS = (100, 103, 107)
TRTLLM_ARCHS = (100, 103)
CUTEDSL_MODES = {"nvfp4_w4a4": "w4a4", "nvfp4_w4a16": "w4a16"}
TRTLLM_MODES = ("mxfp4_w4a16",)


# ----------------------------------------------------------------------------- pure call assembly
def sanitized_global_ids(
    local_ids: torch.Tensor, local_weights: torch.Tensor, first_local_expert: int, num_local_experts: int, ep_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """LOCAL ids (-1: not here) -> GLOBAL int32 ids every routing kernel accepts, and weights.

    -1 becomes the first expert of the next rank (a real id the kernel skips as non-local) when
    ep_size > 1; with one rank it becomes local expert 0 with weight 0 (computed, contributes 0)."""
    ids = local_ids.to(torch.int32)
    w = local_weights.to(torch.float32)
    valid = ids >= 0
    if ep_size > 1:
        num_experts = num_local_experts * ep_size
        other = (first_local_expert + num_local_experts) % num_experts
        return torch.where(valid, ids + first_local_expert, other).contiguous(), w.contiguous()
    return torch.where(valid, ids, 0).contiguous(), torch.where(valid, w, 0.0).contiguous()


def cutedsl_run_kwargs(
    quant_mode: str,
    params: Dict[str, torch.Tensor],
    *,
    x: torch.Tensor,
    x_sf: Optional[torch.Tensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> Dict[str, Any]:
    """Keyword arguments of `CuteDslMoEWrapper.run` (W4A16: BF16 x, no activation scales)."""
    if quant_mode == "w4a16":
        if x.dtype not in (torch.bfloat16, torch.float16) or x_sf is not None:
            raise ValueError(
                "CuTe-DSL W4A16 takes the BF16 activations as they are (x_sf=None); got "
                f"x {x.dtype} with {'a' if x_sf is not None else 'no'} scale tensor"
            )
        fc2_input_scale = None
    elif quant_mode == "w4a4":
        if x.dtype != torch.uint8 or x_sf is None:
            raise ValueError(f"CuTe-DSL W4A4 takes packed NVFP4 x (uint8) and its E4M3 scales; got x {x.dtype}")
        fc2_input_scale = params["fc2_input_scale"]
    else:
        raise ValueError(f"CuTe-DSL quant_mode {quant_mode!r}; use 'w4a4' or 'w4a16'")
    return dict(
        x=x,
        x_sf=x_sf,
        token_selected_experts=topk_ids,
        token_final_scales=topk_weights,
        w1_weight=params["w1_weight"],
        w1_weight_sf=params["w1_weight_sf"],
        w1_alpha=params["w1_alpha"],
        fc2_input_scale=fc2_input_scale,
        w2_weight=params["w2_weight"],
        w2_weight_sf=params["w2_weight_sf"],
        w2_alpha=params["w2_alpha"],
    )


def cutedsl_wrapper_kwargs(
    quant_mode: str, config, *, num_local_experts: int, first_local_expert: int, deterministic: bool,
    activation_enum: Any, accepted: frozenset, version: Optional[str],
) -> Dict[str, Any]:
    """Constructor kwargs of `CuteDslMoEWrapper`; `quant_mode` only when not the default w4a4, and
    W4A16 only with FlashInfer >= 0.6.18 (0.6.18rc1 is refused)."""
    kw: Dict[str, Any] = dict(
        num_experts=config.num_experts,
        top_k=config.top_k,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_local_experts=num_local_experts,
        local_expert_offset=first_local_expert,
        activation_type=int(getattr(activation_enum, "Swiglu" if config.is_gated else "Relu2")),
        use_fused_finalize=not deterministic,
    )
    if config.swiglu_alpha is not None or config.swiglu_beta is not None or config.swiglu_limit is not None:
        kw.update(
            swiglu_alpha=1.0 if config.swiglu_alpha is None else float(config.swiglu_alpha),
            swiglu_beta=0.0 if config.swiglu_beta is None else float(config.swiglu_beta),
            swiglu_limit=float("inf") if config.swiglu_limit is None else float(config.swiglu_limit),
        )
    if quant_mode == "w4a16":
        if not (version_at_least(version, CUTEDSL_W4A16_MIN_VERSION) and "quant_mode" in accepted):
            raise ValueError(
                f"CuTe-DSL NVFP4 W4A16 needs FlashInfer >= {CUTEDSL_W4A16_MIN_VERSION} "
                f"(CuteDslMoEWrapper(quant_mode='w4a16')); installed {version}"
            )
        kw["quant_mode"] = "w4a16"
    return kw


def trtllm_routed_kwargs(
    params: Dict[str, torch.Tensor],
    config,
    *,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    first_local_expert: int,
    num_local_experts: int,
) -> Dict[str, Any]:
    """Keyword arguments of `trtllm_fp4_block_scale_routed_moe` for MXFP4 x BF16 (W4A16): BF16
    hidden states pass through with hidden_states_scale=None; routing is precomputed (ids, weights)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"TRT-LLM-gen MXFP4 W4A16 takes BF16 hidden states as they are, got {x.dtype}")
    kw: Dict[str, Any] = dict(
        topk_ids=(topk_ids, topk_weights),
        routing_bias=None,
        hidden_states=x,
        hidden_states_scale=None,
        gemm1_weights=params["gemm1_weights"],
        gemm1_weights_scale=params["gemm1_weights_scale"],
        gemm1_bias=params.get("gemm1_bias"),
        gemm1_alpha=params.get("gemm1_alpha"),
        gemm1_beta=params.get("gemm1_beta"),
        gemm1_clamp_limit=params.get("gemm1_clamp_limit"),
        gemm2_weights=params["gemm2_weights"],
        gemm2_weights_scale=params["gemm2_weights_scale"],
        gemm2_bias=params.get("gemm2_bias"),
        output1_scale_scalar=params.get("output1_scale_scalar"),
        output1_scale_gate_scalar=params.get("output1_scale_gate_scalar"),
        output2_scale_scalar=params.get("output2_scale_scalar"),
        num_experts=config.num_experts,
        top_k=config.top_k,
        n_group=None,
        topk_group=None,
        intermediate_size=config.intermediate_size,
        local_expert_offset=first_local_expert,
        local_num_experts=num_local_experts,
        routed_scaling_factor=None,
    )
    return kw


def bf16_w31_weights(weights: ExpertWeights, config) -> Tuple[torch.Tensor, torch.Tensor]:
    """[up; gate] BF16 fc1 [E, rows, H] and fc2 [E, H, I]; quantized checkpoints dequantized."""
    if weights.is_quantized:
        weights = dequantize_expert_weights(weights)
    fc1 = w31(weights.w1.to(torch.bfloat16), None if weights.w3 is None else weights.w3.to(torch.bfloat16))
    return fc1, weights.w2.to(torch.bfloat16).contiguous()


def dequantize_expert_weights(weights: ExpertWeights) -> ExpertWeights:
    """Quantized ExpertWeights -> float32 canonical ones (the one definition: epmoe.quant.weights)."""
    from epmoe.quant.weights import dequantize_expert_weights as dequantize

    return dequantize(weights, torch.float32)


def _activation_config(fm, config):
    if not config.is_gated:
        return fm.ReLU2()
    if config.swiglu_alpha is None and config.swiglu_beta is None and config.swiglu_limit is None:
        return fm.SwiGLU()
    return fm.SwiGLU(
        alpha=1.0 if config.swiglu_alpha is None else config.swiglu_alpha,
        beta=0.0 if config.swiglu_beta is None else config.swiglu_beta,
        limit=float("inf") if config.swiglu_limit is None else config.swiglu_limit,
    )


def _base_availability(spec: ExpertsSpec, modes, archs, what: str) -> Tuple[Availability, Optional[int]]:
    if importlib.util.find_spec("flashinfer") is None:
        return Availability.no("flashinfer is not installed", INSTALL_HINT), None
    device = torch.device(spec.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return Availability.no(f"{what} needs a Blackwell GPU, got device {device}"), None
    mode = spec.expert_mode
    if mode not in modes:
        return Availability.no(f"{what} runs {sorted(modes)}, not {mode!r}"), None
    arch = _device_arch(device)
    if arch not in archs:
        return Availability.no(f"{what} runs on SM{list(archs)}, this GPU is SM{arch}", "use 'flashinfer_cutlass' or 'triton'"), None
    return Availability.yes(), arch


# ----------------------------------------------------------------------------- CuTe-DSL
class _Sm100Experts(Experts):
    """What the two SM100 backends share: BF16 activations in, kernel-layout tensors in `_params`
    (prepared first, then stored in place on a reload)."""

    _params: Dict[str, torch.Tensor]

    @property
    def payload_format(self) -> PayloadFormat:
        return PayloadFormat.unquantized(torch.bfloat16)

    def parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)

    def load_weights(self, weights: ExpertWeights) -> None:
        self.commit_weights(self.prepare_weights(weights))

    def commit_weights(self, prepared: Dict[str, torch.Tensor]) -> None:
        _store_in_place(self._params, prepared)

    def slot_tensors(self) -> Dict[str, torch.Tensor]:
        raise ValueError(
            f"experts backend {self.name!r}: moving its prepared SM100 tensors between ranks is not supported "
            "(their per-expert layout is FlashInfer's); load the weights under the new placement instead")

    def _kernel_inputs(self, tokens):
        """(BF16 tokens, global ids with non-local slots sanitized, weights) for the kernels."""
        x = tokens.hidden
        if isinstance(x, QuantizedActivation):
            from epmoe.quant.codec import dequantize_activation

            x = dequantize_activation(x, torch.bfloat16)
        ids, w = sanitized_global_ids(
            tokens.topk_ids, tokens.topk_weights, self.spec.first_local_expert, self.spec.num_local_experts, self.spec.ep_size
        )
        return x, ids, w



def _sm100_supports(request: BackendRequest, modes, what: str) -> Availability:
    if request.arch != "sm100":
        return Availability.no(f"{what} runs on SM100/SM103 (sm100 family), not {request.arch}", "use 'flashinfer_cutlass' or 'triton'")
    if request.expert_mode not in modes:
        return Availability.no(f"{what} runs {sorted(modes)}, not {request.expert_mode!r}")
    if not request.has("flashinfer"):
        return Availability.no("flashinfer is not installed", INSTALL_HINT)
    return Availability.yes()


class FlashInferCuteDslExperts(_Sm100Experts):
    """NVFP4 experts on FlashInfer's CuTe-DSL kernels (SM100/SM103/SM107), flat layout. Consumes BF16
    tokens (W4A4 quantizes them here with FlashInfer's fp4_quantize)."""

    name = "flashinfer_cutedsl"

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        if not base:
            return base
        ok = _sm100_supports(request, CUTEDSL_MODES, "CuTe-DSL MoE")
        if not ok:
            return ok
        if request.expert_mode == "nvfp4_w4a16" and not version_at_least(request.flashinfer_version, CUTEDSL_W4A16_MIN_VERSION):
            return Availability.no(
                f"CuTe-DSL NVFP4 W4A16 needs FlashInfer >= {CUTEDSL_W4A16_MIN_VERSION}, installed {request.flashinfer_version}")
        if not request.has("cutlass"):
            return Availability.no("FlashInfer's CuTe-DSL MoE needs the CUTLASS DSL", "pip install nvidia-cutlass-dsl")
        return Availability.yes()

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        avail, _ = _base_availability(spec, CUTEDSL_MODES, CUTEDSL_ARCHS, "CuTe-DSL MoE")
        if avail and importlib.util.find_spec("cutlass") is None:
            return Availability.no("FlashInfer's CuTe-DSL MoE needs the CUTLASS DSL", "pip install nvidia-cutlass-dsl")
        return avail

    def __init__(self, spec: ExpertsSpec):
        super().__init__(spec)
        avail = self.availability(spec)
        if not avail:
            raise BackendUnavailableError(self.name, avail.reason, avail.hint)
        import flashinfer
        import flashinfer.fused_moe as fm

        self._fm, self._flashinfer = fm, flashinfer
        self.quant_mode = CUTEDSL_MODES[spec.expert_mode]
        accepted = frozenset(inspect.signature(fm.CuteDslMoEWrapper.__init__).parameters)
        kw = cutedsl_wrapper_kwargs(
            self.quant_mode, self.config, num_local_experts=spec.num_local_experts,
            first_local_expert=spec.first_local_expert, deterministic=spec.deterministic,
            activation_enum=fm.ActivationType, accepted=accepted, version=getattr(flashinfer, "__version__", None),
        )
        self._wrapper = fm.CuteDslMoEWrapper(device=str(torch.device(spec.device)), **kw)
        self._params: Dict[str, torch.Tensor] = {}

    def prepare_weights(self, weights: ExpertWeights) -> Dict[str, torch.Tensor]:
        self.check_local_weights(weights)
        from flashinfer.fused_moe.prepare import prepare_cute_dsl_weights

        fc1, fc2 = bf16_w31_weights(weights.to(self.spec.device), self.config)
        act = self._fm.QuantFormat.BF16 if self.quant_mode == "w4a16" else self._fm.QuantFormat.NVFP4
        new = prepare_cute_dsl_weights(
            fc1, fc2, quant=self._fm.QuantConfig(weight=self._fm.QuantFormat.NVFP4, activation=act),
            num_local_experts=self.spec.num_local_experts, hidden_size=self.config.hidden_size,
            intermediate_size=self.config.intermediate_size, activation=_activation_config(self._fm, self.config),
        )
        new = {k: v for k, v in new.items() if isinstance(v, torch.Tensor)}
        check_reload(self._params, new)
        return new

    def forward(self, tokens) -> torch.Tensor:
        x, ids, w = self._kernel_inputs(tokens)
        x_sf = None
        if self.quant_mode == "w4a4":
            N, H = x.shape
            gs = torch.ones(1, dtype=torch.float32, device=x.device)  # the weight view's unit scale
            xq, sf = self._flashinfer.fp4_quantize(x.contiguous(), gs, sf_vec_size=16, is_sf_swizzled_layout=False)
            x, x_sf = xq.reshape(N, H // 2), sf.view(torch.float8_e4m3fn).reshape(N, H // 16)
        return self._wrapper.run(**cutedsl_run_kwargs(self.quant_mode, self._params, x=x, x_sf=x_sf, topk_ids=ids, topk_weights=w))


# ----------------------------------------------------------------------------- TRT-LLM-gen
class FlashInferTrtllmExperts(_Sm100Experts):
    """MXFP4 x BF16 experts on FlashInfer's TRT-LLM-gen kernels (SM100/SM103), flat layout."""

    name = "flashinfer_trtllm"

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        return _sm100_supports(request, TRTLLM_MODES, "TRT-LLM-gen MoE") if base else base

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        avail, _ = _base_availability(spec, TRTLLM_MODES, TRTLLM_ARCHS, "TRT-LLM-gen MoE")
        return avail

    def __init__(self, spec: ExpertsSpec):
        super().__init__(spec)
        avail = self.availability(spec)
        if not avail:
            raise BackendUnavailableError(self.name, avail.reason, avail.hint)
        import flashinfer.fused_moe as fm

        self._fm = fm
        self._params: Dict[str, torch.Tensor] = {}

    def prepare_weights(self, weights: ExpertWeights) -> Dict[str, torch.Tensor]:
        self.check_local_weights(weights)
        from flashinfer.fused_moe.prepare import prepare_trtllm_fp4_weights

        fc1, fc2 = bf16_w31_weights(weights.to(self.spec.device), self.config)
        fm = self._fm
        new = prepare_trtllm_fp4_weights(
            fc1, fc2, quant=fm.QuantConfig(weight=fm.QuantFormat.MXFP4),
            num_local_experts=self.spec.num_local_experts, hidden_size=self.config.hidden_size,
            intermediate_size=self.config.intermediate_size, activation=_activation_config(fm, self.config),
        )
        if self.config.has_bias:  # float32 biases in [up; gate] order
            from epmoe.quant.flashinfer_layout import bias13_to_w31

            new["gemm1_bias"] = bias13_to_w31(weights.b13.to(self.spec.device), self.config.is_gated, torch.float32)
            new["gemm2_bias"] = weights.b2.to(self.spec.device, torch.float32).contiguous()
        E = self.spec.num_local_experts
        for key, v in (("gemm1_alpha", self.config.swiglu_alpha), ("gemm1_beta", self.config.swiglu_beta),
                       ("gemm1_clamp_limit", self.config.swiglu_limit)):
            if v is not None:
                new[key] = torch.full((E,), float(v), dtype=torch.float32, device=self.spec.device)
        new = {k: v for k, v in new.items() if isinstance(v, torch.Tensor)}
        check_reload(self._params, new)
        return new

    def forward(self, tokens) -> torch.Tensor:
        x, ids, w = self._kernel_inputs(tokens)
        kw = trtllm_routed_kwargs(
            self._params, self.config, x=x.contiguous(), topk_ids=ids, topk_weights=w,
            first_local_expert=self.spec.first_local_expert, num_local_experts=self.spec.num_local_experts,
        )
        out = self._fm.trtllm_fp4_block_scale_routed_moe(**kw)
        return out[0] if isinstance(out, (list, tuple)) else out


def _store_in_place(params: Dict[str, torch.Tensor], new: Dict[str, torch.Tensor]) -> None:
    """First load keeps `new`; a reload (checked whole before any copy) copies into the same
    storage, so captured CUDA graphs stay valid."""
    if not params:
        params.update(new)
        return
    check_reload(params, new)
    for k, v in new.items():
        params[k].copy_(v)
