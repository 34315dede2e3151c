"""`MoEConfig`: the shape and math of one MoE layer (core type, imports nothing from epmoe).

The math (every backend and the reference compute exactly this):

    route:   topk_ids [T, K], topk_weights [T, K] = routing(router_logits [T, E])
    experts: for each selected expert e of token t, with x = hidden_states[t]
               g = x @ w1[e].T (+ b1[e])            # w1 = gate_proj, [I, H]
               u = x @ w3[e].T (+ b3[e])            # w3 = up_proj,   [I, H]   (gated only)
               a = silu(g) * u                       # "swiglu"
                 | g' * sigmoid(alpha * g') * (u' + beta)   # swiglu with alpha/beta/limit (GPT-OSS),
                                                     #   g' = min(g, limit), u' = clamp(u, -limit, limit)
                 | relu(g) ** 2                      # "relu2" (non-gated, no w3)
               y_e = a @ w2[e].T (+ b2[e])           # w2 = down_proj, [H, I]
    output:  out[t] = sum_k topk_weights[t, k] * y_{topk_ids[t, k]}

Routing:
    "softmax":          p = softmax(logits); top-k of p; if renormalize: divide by their sum.
    "sigmoid_grouped":  DeepSeek-V3 "noaux_tc": s = sigmoid(logits); choose topk_group of n_group
                        groups by the sum of each group's top-2 of (s + e_score_correction_bias);
                        top-k of (s + bias) inside them; weights are s (no bias) of the chosen,
                        renormalised if `renormalize`, then times routed_scaling_factor.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Optional, Union

import torch

ACTIVATIONS = ("swiglu", "relu2")
ROUTINGS = ("softmax", "sigmoid_grouped")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
}


def parse_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16 (ValueError names the bad value)."""
    if isinstance(value, torch.dtype):
        return value
    key = str(value).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and math of one MoE layer. Frozen; validated on construction.

    num_experts:        E, routed experts of the layer (global, over all ranks)
    top_k:              K, experts per token
    hidden_size:        H
    intermediate_size:  I, per expert (HF `moe_intermediate_size`)
    activation:         "swiglu" (gated, w1 = gate and w3 = up) or "relu2" (non-gated, w1 only)
    routing:            "softmax" or "sigmoid_grouped" (see module docstring)
    renormalize:        divide the chosen top-k weights by their sum
    n_group, topk_group, routed_scaling_factor: DeepSeek-V3 grouped routing
    has_bias:           experts carry b13 [E, 2I] (gate half first; [E, I] for relu2) and b2 [E, H]
    swiglu_alpha/beta/limit: GPT-OSS clamped SwiGLU (all None: plain silu(g) * u)
    dtype:              activation and (unquantized) weight dtype
    quant_method:       the checkpoint's quantization (HF `quantization_config.quant_method`), if any
    hidden_size_unpadded: the checkpoint's real hidden size when `hidden_size` was pre-rounded
    num_layers:         MoE layers of the model (launcher / sizing only)
    model_type:         informational (HF `model_type`)
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "swiglu"
    routing: str = "softmax"
    renormalize: bool = True
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    has_bias: bool = False
    swiglu_alpha: Optional[float] = None
    swiglu_beta: Optional[float] = None
    swiglu_limit: Optional[float] = None
    dtype: torch.dtype = torch.bfloat16
    quant_method: Optional[str] = None
    hidden_size_unpadded: Optional[int] = None
    num_layers: int = 1
    model_type: str = "custom"

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "num_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                "top_k must be <= num_experts"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation={self.activation!r}; use one of {ACTIVATIONS}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoEConfig.routing={self.routing!r}; use one of {ROUTINGS}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"MoEConfig.dtype={self.dtype}; use bfloat16, float16 or float32")
        if self.routing == "sigmoid_grouped":
            n_group = self.n_group or 1
            topk_group = self.topk_group or n_group
            if self.num_experts % n_group:
                raise ValueError(
                    f"MoEConfig.n_group={n_group} does not divide num_experts={self.num_experts}"
                )
            if not 1 <= topk_group <= n_group:
                raise ValueError(f"MoEConfig.topk_group={topk_group} must be in [1, n_group={n_group}]")
            if self.top_k > topk_group * (self.num_experts // n_group):
                raise ValueError(
                    f"MoEConfig.top_k={self.top_k} exceeds the experts in topk_group={topk_group} "
                    f"groups of {self.num_experts // n_group}"
                )
            if self.num_experts // n_group < 2:
                raise ValueError("sigmoid_grouped routing needs at least 2 experts per group")
            object.__setattr__(self, "n_group", n_group)
            object.__setattr__(self, "topk_group", topk_group)
        if self.activation == "relu2" and any(
            v is not None for v in (self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit)
        ):
            raise ValueError("swiglu_alpha/beta/limit apply to activation='swiglu' only")
        if self.hidden_size_unpadded is not None and not (
            0 < self.hidden_size_unpadded <= self.hidden_size
        ):
            raise ValueError(
                f"MoEConfig.hidden_size_unpadded={self.hidden_size_unpadded} must be in "
                f"(0, hidden_size={self.hidden_size}]"
            )

    # ------------------------------------------------------------------ derived
    @property
    def is_gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def w13_rows(self) -> int:
        """Rows of the fused first projection: 2I (gate then up) or I (relu2)."""
        return 2 * self.intermediate_size if self.is_gated else self.intermediate_size

    def expert_param_count(self) -> int:
        """Parameters of one expert (weights and biases)."""
        n = self.w13_rows * self.hidden_size + self.hidden_size * self.intermediate_size
        if self.has_bias:
            n += self.w13_rows + self.hidden_size
        return n

    def replace(self, **changes: Any) -> "MoEConfig":
        return replace(self, **changes)

    def fingerprint(self) -> dict:
        """Every field as a string: compared across ranks at construction."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = dtype_name(v) if isinstance(v, torch.dtype) else repr(v)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = dtype_name(self.dtype)
        return d

    # ------------------------------------------------------------------ HF configs
    @classmethod
    def from_hf_config(
        cls, config: Union[str, os.PathLike, Mapping[str, Any]], **overrides: Any
    ) -> "MoEConfig":
        """Read a HuggingFace `config.json` (path, directory or dict).

        Understands Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (and V2 with noaux routing), Kimi-K2,
        GLM-4-MoE, GPT-OSS and Nemotron-H (relu2) field names; the router is decided by `hf_routing`,
        the checkpoint quantization by `hf_quant_method` (also from a ModelOpt `hf_quant_config.json`
        beside config.json). `overrides` replace any field afterwards.
        """
        quant_file = None
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
            # ModelOpt writes its quantization to hf_quant_config.json beside config.json
            qpath = os.path.join(os.path.dirname(path), "hf_quant_config.json")
            if os.path.isfile(qpath):
                with open(qpath) as f:
                    quant_file = {"quant_method": "modelopt", **json.load(f)}
        cfg = dict(config)
        if isinstance(cfg.get("text_config"), Mapping):  # multimodal wrappers
            cfg = {**cfg, **cfg["text_config"]}
        model_type = str(cfg.get("model_type", "custom"))

        def first(*names: str, default: Any = None) -> Any:
            for n in names:
                if cfg.get(n) is not None:
                    return cfg[n]
            return default

        num_experts = first("n_routed_experts", "num_local_experts", "num_experts")
        top_k = first("num_experts_per_tok", "experts_per_token", "moe_topk")
        hidden = first("hidden_size", "d_model")
        inter = first("moe_intermediate_size", "intermediate_size")
        missing = [
            n
            for n, v in (
                ("num_experts (n_routed_experts / num_local_experts / num_experts)", num_experts),
                ("top_k (num_experts_per_tok / experts_per_token)", top_k),
                ("hidden_size", hidden),
                ("intermediate_size (moe_intermediate_size / intermediate_size)", inter),
            )
            if v is None
        ]
        if missing:
            raise ValueError(
                f"HF config (model_type={model_type!r}) is not an MoE config: missing {missing}"
            )
        kwargs: dict = dict(
            num_experts=int(num_experts),
            top_k=int(top_k),
            hidden_size=int(hidden),
            intermediate_size=int(inter),
            model_type=model_type,
            num_layers=int(first("num_hidden_layers", default=1)),
        )
        act = str(first("mlp_hidden_act", "hidden_act", default="silu")).lower()
        kwargs["activation"] = "relu2" if act in ("relu2", "relu_squared", "squared_relu") else "swiglu"
        decision = hf_routing(cfg)
        kwargs["routing"] = decision.routing
        if decision.routing == "sigmoid_grouped":
            kwargs["n_group"] = int(first("n_group", default=1))
            kwargs["topk_group"] = int(first("topk_group", default=kwargs["n_group"]))
            kwargs["routed_scaling_factor"] = float(first("routed_scaling_factor", default=1.0))
            kwargs["renormalize"] = bool(first("norm_topk_prob", default=True))
        else:
            if model_type == "mixtral" or model_type == "gpt_oss":
                kwargs["renormalize"] = True  # Mixtral renormalises; GPT-OSS softmaxes its top-k
            else:
                kwargs["renormalize"] = bool(first("norm_topk_prob", default=False))
        if model_type == "gpt_oss":
            kwargs["has_bias"] = True
            kwargs["swiglu_alpha"] = float(first("swiglu_alpha", default=1.702))
            kwargs["swiglu_beta"] = float(first("swiglu_beta", default=1.0))
            kwargs["swiglu_limit"] = float(first("swiglu_limit", default=7.0))
        torch_dtype = first("torch_dtype", "dtype")
        if torch_dtype is not None:
            try:
                kwargs["dtype"] = parse_dtype(torch_dtype)
            except ValueError:
                pass  # e.g. "auto"; keep the default
        qc = cfg.get("quantization_config")
        if not isinstance(qc, Mapping) and quant_file is not None:
            qc = quant_file
        if isinstance(qc, Mapping) and (qc.get("quant_method") or qc.get("quantization")):
            kwargs["quant_method"] = hf_quant_method(qc)
        kwargs.update(overrides)
        return cls(**kwargs)


# ---------------------------------------------------------------------- routing and quantization
# Families whose router is DeepSeek-V3's (sigmoid scores + e_score_correction_bias, grouped top-k),
# whose config.json (as transformers writes it) has no `scoring_func`.
DEEPSEEK_STYLE_ROUTERS = ("deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe", "glm4v_moe", "nemotron_h", "dots1")
# Families known to route with softmax top-k.
SOFTMAX_ROUTERS = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "gpt_oss", "olmoe",
                   "phimoe", "granitemoe", "dbrx", "jamba", "deepseek_v2", "custom")


@dataclass(frozen=True)
class RoutingDecision:
    """How `from_hf_config` chose the router: routing ("softmax" / "sigmoid_grouped") and why."""

    routing: str
    reason: str


def hf_routing(cfg: Mapping[str, Any]) -> RoutingDecision:
    """The router of a HF config: explicit `scoring_func` first, then `topk_method: noaux_tc`, then
    the model type (DEEPSEEK_STYLE_ROUTERS / SOFTMAX_ROUTERS). An unknown model type without
    `scoring_func` gets softmax, and says so (a checkpoint that then holds `e_score_correction_bias`
    is refused at load, naming the missing field)."""
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    model_type = str(cfg.get("model_type", "custom"))
    scoring = cfg.get("scoring_func")
    if str(cfg.get("topk_method", "")).lower() == "group_limited_greedy" and str(scoring or "softmax").lower() == "softmax":
        raise ValueError(
            "config.json topk_method='group_limited_greedy' (DeepSeek-V2 grouped softmax routing) is not "
            "supported: epmoe groups experts only for sigmoid routing (noaux_tc)"
        )
    if scoring is not None:
        key = str(scoring).lower()
        if key not in ("sigmoid", "softmax"):
            raise ValueError(f"config.json scoring_func={scoring!r} is not supported; epmoe routes 'softmax' or 'sigmoid'")
        return RoutingDecision("sigmoid_grouped" if key == "sigmoid" else "softmax", f"scoring_func={key!r} in config.json")
    if str(cfg.get("topk_method", "")).lower() == "noaux_tc":
        return RoutingDecision("sigmoid_grouped", "topk_method='noaux_tc' in config.json (DeepSeek-V3 router)")
    if model_type in DEEPSEEK_STYLE_ROUTERS:
        return RoutingDecision(
            "sigmoid_grouped", f"model_type {model_type!r} routes like DeepSeek-V3 (sigmoid + e_score_correction_bias)"
        )
    if model_type in SOFTMAX_ROUTERS:
        return RoutingDecision("softmax", f"model_type {model_type!r} routes with softmax top-k")
    return RoutingDecision(
        "softmax",
        f"model_type {model_type!r} is not a known MoE family and config.json has no 'scoring_func': softmax "
        "assumed (a checkpoint holding e_score_correction_bias is refused at load; add scoring_func to config.json)",
    )


def hf_quant_method(qc: Mapping[str, Any]) -> str:
    """`quantization_config` (or ModelOpt's hf_quant_config.json) -> MoEConfig.quant_method.

    fp8 with weight_block_size [128, 128] -> "fp8"; fp8 without blocks -> "fp8_per_tensor" (refused by
    the plan); ModelOpt NVFP4 -> "modelopt_fp4"; compressed-tensors NVFP4 -> "compressed_tensors_nvfp4";
    anything else -> the method name, lower case (the plan says whether it can run it)."""
    method = str(qc.get("quant_method") or "modelopt").lower().replace("-", "_")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            return "fp8_per_tensor"
        if [int(b) for b in block] != [128, 128]:
            raise ValueError(
                f"FP8 checkpoint with weight_block_size={list(block)} is not supported: the fp8_block experts "
                "use 128x128 weight blocks (weight_scale_inv [ceil(out/128), ceil(in/128)])"
            )
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme != "dynamic":
            raise ValueError(
                f"FP8 checkpoint with activation_scheme={scheme!r} is not supported: fp8_block experts quantize "
                "activations dynamically (1x128 groups); use a checkpoint with activation_scheme 'dynamic'"
            )
        return "fp8"
    if method == "modelopt":
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), Mapping) else qc
        algo = str(inner.get("quant_algo") or "").upper()
        if algo == "NVFP4":
            group = inner.get("group_size", 16)
            if group is not None and int(group) != 16:
                raise ValueError(f"ModelOpt NVFP4 with group_size={group} is not supported: NVFP4 uses 16-value groups")
            return "modelopt_fp4"
        return f"modelopt_{algo.lower() or 'unknown'}"
    if method == "compressed_tensors":
        fmts = {str(qc.get("format", "")).lower()}
        groups = qc.get("config_groups") or {}
        for g in groups.values() if isinstance(groups, Mapping) else ():
            fmts.add(str(g.get("format", "")).lower())
            w = g.get("weights") or {}
            if w.get("num_bits") == 4 and str(w.get("type")) == "float" and w.get("group_size") == 16:
                fmts.add("nvfp4-pack-quantized")
        if "nvfp4-pack-quantized" in fmts:
            return "compressed_tensors_nvfp4"
        return "compressed_tensors"
    return method
