"""`FlashInferCutlassExperts`: the local experts on FlashInfer's CUTLASS fused MoE
(`flashinfer.fused_moe.cutlass_fused_moe`).

    experts = FlashInferCutlassExperts(spec)    # spec.plan.expert_mode (or option "mode") picks the mode
    experts.load_weights(local_weights)         # converted once to the kernel layout (quant/flashinfer_layout)
    out [N, H] = experts(tokens)                # flat layout, local ids; routing-weighted sum per row

Modes and the kernel variant they run (`epmoe.quant.flashinfer_layout.resolve_cutlass_variant`):

    mode          SM90 (Hopper)                           SM100/SM103/SM120 (Blackwell)
    bf16          bf16 x bf16                             bf16 x bf16
    fp8_block     DeepSeek 128x128 FP8 (use_deepseek_fp8_block_scale)   -
    mxfp4_w4a16   MXFP4 x BF16 (use_w4_group_scaling)     TRT-LLM-gen ('flashinfer_sm100' backend)
    mxfp4_w4a8    Humming MXFP4 x FP8 (use_wfp4afp8_humming, FlashInfer >= 0.6.18)
                                                           MXFP4 x MXFP8 (use_mxfp8_act_scaling)
    mxfp8         -                                       MXFP8 x MXFP8 on SM100/103/107
    nvfp4_w4a4    -                                       NVFP4 x NVFP4 (BF16 in, quantized in-kernel
                                                           with the checkpoint's static input scale)

Every variant consumes BF16 activations from the dispatcher (`payload_format` is the model dtype):
the kernel quantizes them itself (FP8 block, Humming FP8, NVFP4), or this backend quantizes them to
MXFP8 right before the call. An NVFP4 payload that reaches us is dequantized first.

Expert ids at the boundary: dispatchers hand us LOCAL ids (-1 = not on this rank). We call the kernel
with ep_size/ep_rank and GLOBAL ids, `id + first_local_expert` for id >= 0 and -1 otherwise; the
kernel skips every id outside [ep_rank * E_local, (ep_rank + 1) * E_local), so -1 rows contribute 0.
Per-expert tensors (Humming residuals, NVFP4 dequant factors, SwiGLU alpha/beta/limit) are indexed
by LOCAL expert, which is what FlashInfer's EP mapping expects.

FlashInfer is imported in `availability` / `__init__`, never at module import. Nothing here may
trigger a JIT build by accident: `availability` reports the fused-MoE module unavailable unless it
is prebuilt (AOT or JIT cache), the call passes `profile_ids` so the autotuner never runs, and the
GEMM workspace is allocated once. The argument assembly (`assemble_quant_scales`,
`build_cutlass_call`) is pure and tested on CPU with recording stand-ins.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

import torch

from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.core.errors import BackendUnavailableError
from epmoe.experts.base import Experts, ExpertsOptions, ExpertsSpec, rows_per_expert
from epmoe.quant.flashinfer_layout import (
    MODE_WEIGHT_FORMAT,
    CutlassGeometry,
    convert_for_cutlass,
    cutlass_geometry,
    resolve_cutlass_variant,
    truncate_nongated_w13,
)
from epmoe.quant.payload import PayloadFormat, QuantizedActivation
from epmoe.quant.weights import WEIGHT_FORMATS, ExpertWeights

INSTALL_HINT = "install FlashInfer: pip install 'flashinfer-python>=0.6.17' (Humming W4A8 needs >= 0.6.18)"
HUMMING_MIN_VERSION = "0.6.18"  # per-local-expert residual ABI (FlashInfer #4431); 0.6.17 reverted it

# quant_scales slot names per variant, in the order `cutlass_fused_moe` reads them.
QUANT_SCALE_SLOTS: Dict[str, tuple] = {
    "bf16": (),
    "fp8_block": ("fc1_scale", "fc2_scale"),
    "mxfp4_w4a16": ("fc1_scale:int32", "fc2_scale:int32"),
    # Humming (FlashInfer #4431): FC1 folded block scales, FC1 per-local-expert residual x64,
    # FC2 activation scale (reserved), FC2 folded block scales, FC2 residual x64.
    "mxfp4_w4a8_humming": (
        "fc1_scale:int32",
        "fc1_residual_scale",
        "fc2_act_scale",
        "fc2_scale:int32",
        "fc2_residual_scale",
    ),
    "mxfp8": ("fc1_scale:int32", "fc1_input_scale", "fc2_scale:int32", "fc2_input_scale"),
    "mxfp8_mxfp4": ("fc1_scale:int32", "fc1_input_scale", "fc2_scale:int32", "fc2_input_scale"),
    "nvfp4": (
        "fc1_act_global_scale",
        "fc1_scale:int32",
        "fc1_dequant_scale",
        "fc2_act_global_scale",
        "fc2_scale:int32",
        "fc2_dequant_scale",
    ),
}

# Boolean switches of cutlass_fused_moe per variant (all others left at their False default and
# not passed, so an older FlashInfer never sees a keyword it lacks).
VARIANT_FLAGS: Dict[str, Dict[str, bool]] = {
    "bf16": {},
    "fp8_block": {"use_deepseek_fp8_block_scale": True},
    "mxfp4_w4a16": {"use_w4_group_scaling": True},
    "mxfp4_w4a8_humming": {"use_w4_group_scaling": True, "use_wfp4afp8_humming": True},
    "mxfp8": {"use_mxfp8_act_scaling": True},
    "mxfp8_mxfp4": {"use_mxfp8_act_scaling": True},
    "nvfp4": {},
}
_EXCLUSIVE_FLAGS = ("use_deepseek_fp8_block_scale", "use_mxfp8_act_scaling", "use_wfp4afp8_humming")

# Weights travel as int64 views where the kernel selects the variant from that dtype.
_INT64_WEIGHT_VARIANTS = ("nvfp4", "mxfp8_mxfp4")
_ACTIVATION_NAMES = {"swiglu": "Swiglu", "relu2": "Relu2"}


# ----------------------------------------------------------------------------- versions
def parse_version(text: Optional[str]):
    """`packaging.version.Version` (so 0.6.18rc1 < 0.6.18), or None when unknown."""
    if text is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(text))
    except InvalidVersion:
        return None


def version_at_least(installed: Optional[str], minimum: str) -> bool:
    """True only for a parseable version >= minimum; prereleases of `minimum` are rejected."""
    from packaging.version import Version

    v = parse_version(installed)
    return v is not None and v >= Version(minimum)


@dataclass(frozen=True)
class FlashInferFeatures:
    """What the installed FlashInfer offers. version: its version string; cutlass_params: keyword
    names `cutlass_fused_moe` accepts; has_humming_preprocess: the Humming weight preprocessor."""

    version: Optional[str]
    cutlass_params: FrozenSet[str] = field(default_factory=frozenset)
    has_humming_preprocess: bool = False

    @property
    def supports_humming(self) -> bool:
        return (
            version_at_least(self.version, HUMMING_MIN_VERSION)
            and "use_wfp4afp8_humming" in self.cutlass_params
            and self.has_humming_preprocess
        )

    def accepts(self, name: str) -> bool:
        return name in self.cutlass_params


def probe_flashinfer_features(flashinfer_module: Any, fused_moe_module: Any) -> FlashInferFeatures:
    """Read the version and the real `cutlass_fused_moe` signature (no kernel is loaded)."""
    fn = getattr(fused_moe_module, "cutlass_fused_moe")
    try:
        params = frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = frozenset()
    return FlashInferFeatures(
        version=getattr(flashinfer_module, "__version__", None),
        cutlass_params=params,
        has_humming_preprocess=hasattr(fused_moe_module, "preprocess_moe_weights_for_sm90_mixed_gemm_humming"),
    )


# ----------------------------------------------------------------------------- call assembly
def assemble_quant_scales(variant: str, params: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
    """The `quant_scales` list of `variant` from named kernel tensors (see QUANT_SCALE_SLOTS).

    Raises ValueError naming every missing slot: a partial set would silently select the wrong
    kernel path (e.g. Humming without its residuals runs as plain W4A16)."""
    if variant not in QUANT_SCALE_SLOTS:
        raise ValueError(f"unknown CUTLASS variant {variant!r}; use one of {sorted(QUANT_SCALE_SLOTS)}")
    slots = QUANT_SCALE_SLOTS[variant]
    missing = [s.split(":")[0] for s in slots if params.get(s.split(":")[0]) is None]
    if missing:
        raise ValueError(
            f"CUTLASS {variant} needs quant scales {[s.split(':')[0] for s in slots]}; missing {missing}. "
            "Load the weights through FlashInferCutlassExperts.load_weights (convert_for_cutlass)"
        )
    out = []
    for slot in slots:
        name, _, view = slot.partition(":")
        t = params[name]
        out.append(t.view(torch.int32) if view == "int32" else t)
    return out


def check_flags(flags: Mapping[str, bool]) -> None:
    """Refuse mutually exclusive kernel switches (each selects a different GEMM)."""
    on = [f for f in _EXCLUSIVE_FLAGS if flags.get(f)]
    if len(on) > 1:
        raise ValueError(
            f"cutlass_fused_moe switches {on} are mutually exclusive (each selects a different "
            "kernel: DeepSeek FP8 block / MXFP8 activations / SM90 Humming); enable one"
        )
    if flags.get("use_wfp4afp8_humming") and not flags.get("use_w4_group_scaling"):
        raise ValueError("use_wfp4afp8_humming requires use_w4_group_scaling=True (MXFP4 weights)")


@dataclass(frozen=True)
class ActivationArgs:
    """activation_type: FlashInfer ActivationType (or its int); swiglu_*: [E_local] float32 or None."""

    activation_type: Any
    swiglu_alpha: Optional[torch.Tensor] = None
    swiglu_beta: Optional[torch.Tensor] = None
    swiglu_limit: Optional[torch.Tensor] = None


def activation_args(config, num_local_experts: int, device, activation_enum: Any) -> ActivationArgs:
    """Map MoEConfig's activation to FlashInfer's: swiglu -> Swiglu, relu2 -> Relu2 (non-gated);
    GPT-OSS alpha/beta/limit become per-local-expert float32 tensors (None elsewhere)."""
    kind = getattr(activation_enum, _ACTIVATION_NAMES[config.activation])
    if config.activation != "swiglu" or all(
        v is None for v in (config.swiglu_alpha, config.swiglu_beta, config.swiglu_limit)
    ):
        return ActivationArgs(kind)

    def full(v: Optional[float], default: float) -> torch.Tensor:
        return torch.full((num_local_experts,), default if v is None else float(v), dtype=torch.float32, device=device)

    # Defaults reproduce MoEConfig's formula when only some of the three are given.
    return ActivationArgs(
        kind,
        swiglu_alpha=full(config.swiglu_alpha, 1.0),
        swiglu_beta=full(config.swiglu_beta, 0.0),
        swiglu_limit=full(config.swiglu_limit, float("inf")),
    )


def local_to_global_ids(local_ids: torch.Tensor, first_local_expert: int) -> torch.Tensor:
    """LOCAL ids (-1: not here) -> GLOBAL int32 ids for cutlass_fused_moe(ep_size, ep_rank);
    -1 stays -1, which the kernel treats as an expert of no rank."""
    ids = local_ids.to(torch.int32)
    if first_local_expert == 0:
        return ids.contiguous()
    return torch.where(ids >= 0, ids + first_local_expert, ids).contiguous()


def build_cutlass_call(
    variant: str,
    params: Mapping[str, torch.Tensor],
    *,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    output: torch.Tensor,
    output_dtype: torch.dtype,
    ep_size: int,
    ep_rank: int,
    activation: ActivationArgs,
    features: FlashInferFeatures,
    input_sf: Optional[torch.Tensor] = None,
    swizzled_input_sf: bool = True,
    deterministic: bool = False,
    workspace: Optional[torch.Tensor] = None,
    tune_max_num_tokens: int = 8192,
    profile_ids: Optional[List[int]] = None,
) -> Dict[str, Any]:
    """Keyword arguments for one `cutlass_fused_moe` call (pure; no FlashInfer import).

    topk_ids are GLOBAL int32 ids (see `local_to_global_ids`). Optional keywords are passed only
    when set and only when the installed FlashInfer accepts them; a needed one it lacks raises."""
    flags = dict(VARIANT_FLAGS[variant])
    check_flags(flags)
    if flags.get("use_wfp4afp8_humming") and not features.supports_humming:
        raise ValueError(
            f"SM90 Humming MXFP4 W4A8 needs FlashInfer >= {HUMMING_MIN_VERSION} with "
            f"use_wfp4afp8_humming and the per-local-expert residual ABI; installed: "
            f"{features.version or 'unknown version'}. Upgrade FlashInfer or use mode 'mxfp4_w4a16'"
        )
    for name in flags:
        if not features.accepts(name):
            raise ValueError(
                f"the installed FlashInfer {features.version} cutlass_fused_moe lacks {name!r}, "
                f"needed by the {variant} kernel; upgrade flashinfer-python"
            )
    w1, w2 = params["fc1_weight"], params["fc2_weight"]
    if variant in _INT64_WEIGHT_VARIANTS:
        w1, w2 = w1.view(torch.int64), w2.view(torch.int64)
    kwargs: Dict[str, Any] = dict(
        input=x,
        token_selected_experts=topk_ids,
        token_final_scales=topk_weights,
        fc1_expert_weights=w1,
        fc2_expert_weights=w2,
        output_dtype=output_dtype,
        quant_scales=assemble_quant_scales(variant, params),
        output=output,
        ep_size=ep_size,
        ep_rank=ep_rank,
        activation_type=activation.activation_type,
        tune_max_num_tokens=tune_max_num_tokens,
        **flags,
    )
    optional = {
        "fc1_expert_biases": params.get("fc1_bias"),
        "fc2_expert_biases": params.get("fc2_bias"),
        "input_sf": input_sf,
        "swiglu_alpha": activation.swiglu_alpha,
        "swiglu_beta": activation.swiglu_beta,
        "swiglu_limit": activation.swiglu_limit,
        "workspace_buffer": workspace,
    }
    for name, value in optional.items():
        if value is None:
            continue
        if not features.accepts(name):
            if name == "workspace_buffer":
                continue  # older FlashInfer allocates its own; correct, only slower
            raise ValueError(f"the installed FlashInfer {features.version} cutlass_fused_moe lacks {name!r}")
        kwargs[name] = value
    if input_sf is not None and not swizzled_input_sf:
        kwargs["swizzled_input_sf"] = False
    # Always explicit tactics (default: -1, -1): without them the autotuner would profile on first use.
    if features.accepts("profile_ids"):
        kwargs["profile_ids"] = list(profile_ids) if profile_ids is not None else [-1, -1]
    elif profile_ids is not None and list(profile_ids) != [-1, -1]:
        raise ValueError(f"the installed FlashInfer {features.version} cutlass_fused_moe takes no profile_ids")
    # Fused finalize reduces the top-k with atomics (non-deterministic order).
    if deterministic:
        if not features.accepts("use_fused_finalize"):
            raise ValueError("deterministic=True needs cutlass_fused_moe(use_fused_finalize=False)")
        kwargs["use_fused_finalize"] = False
    return kwargs


# ----------------------------------------------------------------------------- tactics
def kernel_dtypes(variant: str, act_dtype: torch.dtype):
    """(activation dtype, weight dtype) the kernel runner of `variant` is keyed by: the dtypes of
    `input` and `fc1_expert_weights` in the call (`build_cutlass_call` views int64 where needed)."""
    weight = {
        "bf16": act_dtype,
        "fp8_block": torch.float8_e4m3fn,
        "mxfp4_w4a16": torch.uint8,
        "mxfp4_w4a8_humming": torch.uint8,
        "mxfp8": torch.float8_e4m3fn,
        "mxfp8_mxfp4": torch.int64,
        "nvfp4": torch.int64,
    }[variant]
    x = torch.float8_e4m3fn if variant in ("mxfp8", "mxfp8_mxfp4") else act_dtype
    return x, weight


@dataclass(frozen=True)
class CutlassTactics:
    """The GEMM tactics the loaded fused-MoE module offers for one kernel variant, as FlashInfer
    numbers them: one list, GEMM1's tactics first, then GEMM2's, so `profile_ids` = [id1, id2] takes
    id1 from `gemm1` and id2 from `gemm2` (absolute ids); -1 is the module's default (the first of
    each). A module built with FAST_BUILD offers fewer tactics than the full build: read, never assume.
    fixed: the variant ignores `profile_ids` (DeepSeek FP8 block scaling runs one built-in tile)."""

    gemm1: Tuple[int, ...]
    gemm2: Tuple[int, ...]
    fixed: bool = False

    def describe(self) -> str:
        def span(ids):
            return f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else (str(ids[0]) if ids else "none")

        extra = " (this variant runs one built-in tile; ids are accepted and ignored)" if self.fixed else ""
        return f"GEMM1 ids {span(self.gemm1)}, GEMM2 ids {span(self.gemm2)}{extra}"

    def check(self, profile_ids: Any) -> List[int]:
        """[id1, id2] when both are offered (or -1); ValueError naming the valid ids otherwise."""
        ok = (
            isinstance(profile_ids, (tuple, list))
            and len(profile_ids) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in profile_ids)
        )
        if ok:
            id1, id2 = profile_ids
            ok = (id1 == -1 or id1 in self.gemm1) and (id2 == -1 or id2 in self.gemm2)
        if not ok:
            raise ValueError(
                f"experts option tactics={profile_ids!r} is not offered by this FlashInfer fused-MoE "
                f"module: pass [gemm1_id, gemm2_id] with {self.describe()}, or -1 for the default"
            )
        return [int(profile_ids[0]), int(profile_ids[1])]


def read_cutlass_tactics(
    arch: int, variant: str, act_dtype: torch.dtype, activation_type: Any, use_fused_finalize: bool = True
) -> CutlassTactics:
    """Ask the loaded module which tactics it has for `variant` (builds FlashInfer's runner object
    for the variant's dtypes; runs no kernel)."""
    from flashinfer.fused_moe.core import get_cutlass_fused_moe_module

    flags = VARIANT_FLAGS[variant]
    x_dtype, weight_dtype = kernel_dtypes(variant, act_dtype)
    runner = get_cutlass_fused_moe_module(str(arch)).MoERunner(
        x_dtype=x_dtype,
        weight_dtype=weight_dtype,
        output_dtype=act_dtype,
        top_k=1,
        tp_size=1,
        tp_rank=0,
        ep_size=1,
        ep_rank=0,
        cluster_size=1,
        cluster_rank=0,
        enable_alltoall=False,
        use_deepseek_fp8_block_scale=flags.get("use_deepseek_fp8_block_scale", False),
        use_w4_group_scaling=flags.get("use_w4_group_scaling", False),
        use_mxfp8_act_scaling=flags.get("use_mxfp8_act_scaling", False),
        min_latency_mode=False,
        enable_pdl=False,
        activation_type=activation_type,
        use_packed_weights=False,
        use_fused_finalize=use_fused_finalize,
        use_wfp4afp8_humming=flags.get("use_wfp4afp8_humming", False),
    ).fused_moe_runner
    n1, n2 = int(runner.get_gemm1_tactic_count()), int(runner.get_gemm2_tactic_count())
    return CutlassTactics(tuple(range(n1)), tuple(range(n1, n1 + n2)), fixed=variant == "fp8_block")


# ----------------------------------------------------------------------------- module lookup
def fused_moe_module_name(arch: int) -> str:
    """FlashInfer's JIT/AOT name of the CUTLASS fused-MoE module for SM`arch`."""
    if arch == 90:
        try:  # H20 (78 SMs) builds a differently named variant
            from flashinfer.jit.fused_moe import _should_enable_sm90_moe_prebuilt_d_descriptor

            if _should_enable_sm90_moe_prebuilt_d_descriptor():
                return "fused_moe_90_h20_prebuilt_d"
        except ImportError:
            pass
        return "fused_moe_90"
    if arch in (120, 121):
        return "fused_moe_120"
    if arch == 103:
        return "fused_moe_103"
    if arch in (100, 107, 110):
        return "fused_moe_100"
    return f"fused_moe_{arch}"


def prebuilt_module_status(name: str) -> Optional[str]:
    """"aot" / "jit-cache" when FlashInfer module `name` is built on disk, None otherwise.
    Looks at paths only: never builds or loads anything."""
    from flashinfer.jit import env as jit_env

    try:
        if jit_env.get_aot_artifacts(name):
            return "aot"
    except Exception:  # noqa: BLE001 - a broken AOT provider is "not prebuilt", not a crash
        pass
    if (jit_env.FLASHINFER_JIT_DIR / name / f"{name}.so").exists():
        return "jit-cache"
    return None


def _device_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


# ----------------------------------------------------------------------------- the backend
# SM90 MXFP4 kernels take bf16 activations only: FlashInfer refuses fp16 for W4A16, and its SM90
# generator instantiates no fp16 x FP4 launcher for Humming (a call would end the process with
# "symbol lookup error").
_BF16_ONLY_VARIANTS = ("mxfp4_w4a16", "mxfp4_w4a8_humming")


def _bf16_only_reason(variant: str, dtype: Any) -> str:
    return f"FlashInfer's SM90 {variant} kernel takes bfloat16 activations only, the model dtype is {dtype}"


ARCH_NUMBER = {"sm80": 80, "sm90": 90, "sm100": 100, "sm120": 120}


def fused_moe_package(arch: str) -> str:
    """The `BackendRequest.packages` entry saying FlashInfer's CUTLASS fused-MoE module for `arch`
    (a plan arch family such as "sm90") is prebuilt (AOT or JIT cache)."""
    return f"flashinfer.fused_moe.{arch}"


@dataclass(frozen=True)
class FlashInferCutlassOptions(ExpertsOptions):
    """mode: the expert mode when spec.plan is None; allow_jit: build the fused-MoE module JIT when
    it is not prebuilt (about 45 min on 16 cores); quantize_online: quantize unquantized weights at
    load; tactics: the GEMM tactics [gemm1_id, gemm2_id] (`CutlassTactics`; None: the module's
    default, -1 / -1), checked against what the loaded module offers when the backend is built."""

    allow_jit: bool = False
    quantize_online: bool = True
    tactics: Optional[Tuple[int, int]] = None


class FlashInferCutlassExperts(Experts):
    """Local experts on `flashinfer.fused_moe.cutlass_fused_moe` (flat layout, local ids).

    Options: `FlashInferCutlassOptions`. Consumes BF16 tokens: the kernel quantizes them itself."""

    name = "flashinfer_cutlass"
    Options = FlashInferCutlassOptions

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        if not base:
            return base
        if request.arch not in ARCH_NUMBER or request.arch == "sm80":
            return Availability.no(f"FlashInfer's CUTLASS fused MoE runs on sm90/sm100/sm120 GPUs, not {request.arch}")
        try:
            variant = resolve_cutlass_variant(request.expert_mode, ARCH_NUMBER[request.arch])
        except ValueError as e:
            return Availability.no(str(e))
        if not request.has("flashinfer"):
            return Availability.no("flashinfer is not installed", INSTALL_HINT)
        if variant == "nvfp4" and request.checkpoint != "nvfp4":
            return Availability.no(
                "its NVFP4 W4A4 kernel quantizes activations with the checkpoint's static input scales "
                "(ModelOpt input_scale); weights quantized online have none",
                "load a ModelOpt NVFP4 checkpoint, or use quant 'nvfp4_w4a16'",
            )
        if variant == "bf16" and request.model_dtype not in ("bfloat16", "float16"):
            return Availability.no(f"bf16 CUTLASS experts need a bf16/fp16 model, not {request.model_dtype}")
        if variant in _BF16_ONLY_VARIANTS and request.model_dtype != "bfloat16":
            return Availability.no(_bf16_only_reason(variant, request.model_dtype), "use a bfloat16 model (MoEConfig dtype)")
        if variant == "mxfp4_w4a8_humming" and not version_at_least(request.flashinfer_version, HUMMING_MIN_VERSION):
            return Availability.no(
                f"Humming MXFP4 W4A8 needs FlashInfer >= {HUMMING_MIN_VERSION}, installed {request.flashinfer_version}",
                "pip install -U 'flashinfer-python>=0.6.18'",
            )
        if not request.has(fused_moe_package(request.arch)):
            return Availability.no(
                f"FlashInfer's {request.arch} fused-MoE module is not prebuilt (no AOT artifact, not in the JIT "
                "cache); building it JIT takes more than 40 minutes",
                "install a flashinfer-jit-cache wheel for your CUDA version, or pass experts option allow_jit=True",
            )
        return Availability.yes(variant)

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        if importlib.util.find_spec("flashinfer") is None:
            return Availability.no("flashinfer is not installed", INSTALL_HINT)
        device = torch.device(spec.device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return Availability.no(f"needs a CUDA GPU, got device {device}", "run on an NVIDIA GPU (SM90+)")
        arch = _device_arch(device)
        mode = spec.expert_mode
        try:
            variant = resolve_cutlass_variant(mode, arch)
        except ValueError as e:
            return Availability.no(str(e))
        if variant == "bf16" and spec.config.dtype not in (torch.bfloat16, torch.float16):
            return Availability.no(f"bf16 CUTLASS experts need a bf16/fp16 model, got {spec.config.dtype}")
        if variant in _BF16_ONLY_VARIANTS and spec.config.dtype != torch.bfloat16:
            return Availability.no(_bf16_only_reason(variant, spec.config.dtype), "use a bfloat16 model (MoEConfig dtype)")
        name = fused_moe_module_name(arch)
        status = prebuilt_module_status(name)
        if status is None and not spec.option("allow_jit", False):  # typed: FlashInferCutlassOptions
            return Availability.no(
                f"FlashInfer module {name!r} is not prebuilt (no AOT artifact, not in the JIT cache) and "
                "building it JIT takes more than 40 minutes",
                "install a flashinfer-jit-cache wheel for your CUDA version, or pass option allow_jit=True",
            )
        if variant == "mxfp4_w4a8_humming":
            import flashinfer
            import flashinfer.fused_moe as fm

            feats = probe_flashinfer_features(flashinfer, fm)
            if not feats.supports_humming:
                return Availability.no(
                    f"Humming MXFP4 W4A8 needs FlashInfer >= {HUMMING_MIN_VERSION}; installed "
                    f"{feats.version}",
                    "pip install -U 'flashinfer-python>=0.6.18', or use mode 'mxfp4_w4a16'",
                )
        return Availability.yes(f"{variant} on SM{arch} ({status or 'JIT allowed'})")

    def __init__(self, spec: ExpertsSpec):
        super().__init__(spec)
        avail = self.availability(spec)
        if not avail:
            raise BackendUnavailableError(self.name, avail.reason, avail.hint)
        import flashinfer
        import flashinfer.fused_moe as fm

        self._fm = fm
        self._flashinfer = flashinfer
        self.device = torch.device(spec.device)
        self.arch = _device_arch(self.device)
        self.mode = spec.expert_mode
        self.variant = resolve_cutlass_variant(self.mode, self.arch)
        self.features = probe_flashinfer_features(flashinfer, fm)
        self.geometry: CutlassGeometry = cutlass_geometry(self.config, self.variant)
        self.act_dtype = self.config.dtype
        self.activation = activation_args(self.config, spec.num_local_experts, self.device, fm.ActivationType)
        self._params: Dict[str, torch.Tensor] = {}
        self._workspace: Optional[torch.Tensor] = None
        self.tactics = read_cutlass_tactics(
            self.arch, self.variant, self.act_dtype, self.activation.activation_type, not spec.deterministic
        )
        given = spec.option("tactics", None)
        self.profile_ids = self.tactics.check(given) if given is not None else [-1, -1]

    @property
    def payload_format(self) -> PayloadFormat:
        return PayloadFormat.unquantized(self.config.dtype)

    def parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)

    def slot_tensors(self) -> Dict[str, torch.Tensor]:
        """Per-expert kernel tensors; NVFP4 W4A4 cannot move by slot: its activation scale is the max over
        the rank's experts, folded into every expert's dequantization factor."""
        if self.variant == "nvfp4":
            raise ValueError(
                "experts backend 'flashinfer_cutlass' (nvfp4_w4a4) folds one activation scale per rank (the max "
                "over its experts) into every expert's factors, so its experts cannot move between ranks as "
                "stored: load the weights under the new placement instead")
        params = {k: v for k, v in self.parameters().items() if k != "fc2_act_scale"}  # a constant 1 (Humming)
        return rows_per_expert(params, self.spec.num_local_experts, self.name)

    # ------------------------------------------------------------------ weights
    def prepare_weights(self, weights: ExpertWeights) -> Dict[str, torch.Tensor]:
        """Validate and convert to the kernel layout; touches no live tensor (phase 1 of a load)."""
        if not self.config.is_gated and weights.w1.shape[1] > self.config.intermediate_size:
            weights = _truncate_nongated(weights, self.config.intermediate_size)
        self.check_local_weights(weights)
        want = MODE_WEIGHT_FORMAT[self.mode]
        if want is None and weights.is_quantized:  # bf16 experts over a quantized checkpoint
            from epmoe.quant.weights import dequantize_expert_weights

            weights = dequantize_expert_weights(weights, self.act_dtype)
        if weights.format != want:
            if weights.format is not None or not self.spec.option("quantize_online", True):
                raise ValueError(
                    f"mode {self.mode!r} needs {want or 'unquantized'} expert weights, got "
                    f"{weights.format}"
                )
            weights = quantize_weights_online(weights, want)
        new = convert_for_cutlass(weights.to(self.device), self.config, self.variant, self.act_dtype)
        check_reload(self._params, new)
        return new

    def commit_weights(self, prepared: Dict[str, torch.Tensor]) -> None:
        """Install (first load) or copy in place (reload: every parameter keeps its storage, so
        captured CUDA graphs stay valid)."""
        if not self._params:
            self._params = prepared
            self._allocate_workspace()
            return
        check_reload(self._params, prepared)
        for k, v in prepared.items():
            self._params[k].copy_(v)

    def load_weights(self, weights: ExpertWeights) -> None:
        self.commit_weights(self.prepare_weights(weights))

    def _allocate_workspace(self) -> None:
        """One GEMM workspace for the most rows a forward receives (spec.max_tokens)."""
        max_rows = self.spec.max_tokens
        if max_rows is None or not self.features.accepts("workspace_buffer"):
            return
        size_fn = getattr(self._fm, "cutlass_fused_moe_workspace_size", None)
        if size_fn is None:
            return
        g = self.geometry
        x_dtype, weight_dtype = kernel_dtypes(self.variant, self.act_dtype)
        flags = {k: v for k, v in VARIANT_FLAGS[self.variant].items()}
        nbytes = size_fn(
            max_rows,
            g.hidden_kernel,
            g.intermediate_kernel,
            self.config.num_experts,
            self.config.top_k,
            x_dtype=x_dtype,
            weight_dtype=weight_dtype,
            output_dtype=self.act_dtype,
            activation_type=self.activation.activation_type,
            ep_size=self.spec.ep_size,
            ep_rank=self.spec.ep_rank,
            use_fused_finalize=not self.spec.deterministic,
            device=self.device,
            **flags,
        )
        self._workspace = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
        self.workspace_bytes = int(nbytes)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens) -> torch.Tensor:
        kwargs = self.call_kwargs(tokens)
        out = kwargs["output"]
        if out.shape[0]:  # FlashInfer asserts on an empty batch (input_activations); 0 rows -> 0 rows
            self._fm.cutlass_fused_moe(**kwargs)
        if self.geometry.pads_hidden:
            out = out[:, : self.geometry.hidden_size].contiguous()
        return out

    def call_kwargs(self, tokens) -> Dict[str, Any]:
        """The keyword arguments of this forward's `cutlass_fused_moe` call (its `output` is the
        [N, hidden_kernel] result). Benchmarks use it to call FlashInfer with its autotuner."""
        if tokens.layout != "flat":
            raise ValueError(f"experts backend {self.name!r} takes the flat layout, got {tokens.layout!r}")
        if not self._params:
            raise RuntimeError("FlashInferCutlassExperts.forward before load_weights")
        x = tokens.hidden
        if isinstance(x, QuantizedActivation):
            from epmoe.quant.codec import dequantize_activation

            x = dequantize_activation(x, self.act_dtype)
        if x.dtype != self.act_dtype:
            raise TypeError(f"hidden has dtype {x.dtype}; this backend takes {self.act_dtype}")
        g = self.geometry
        N = x.shape[0]
        if g.pads_hidden:
            x = torch.nn.functional.pad(x, (0, g.hidden_kernel - g.hidden_size))
        input_sf = None
        if self.variant in ("mxfp8", "mxfp8_mxfp4"):
            x, input_sf = self._flashinfer.mxfp8_quantize(x.contiguous(), is_sf_swizzled_layout=True, alignment=32)
        ids = local_to_global_ids(tokens.topk_ids, self.spec.first_local_expert)
        out = torch.empty(N, g.hidden_kernel, dtype=self.act_dtype, device=x.device)
        kwargs = build_cutlass_call(
            self.variant,
            self._params,
            x=x.contiguous(),
            topk_ids=ids,
            topk_weights=tokens.topk_weights.to(torch.float32).contiguous(),
            output=out,
            output_dtype=self.act_dtype,
            ep_size=self.spec.ep_size,
            ep_rank=self.spec.ep_rank,
            activation=self.activation,
            features=self.features,
            input_sf=input_sf,
            deterministic=self.spec.deterministic,
            workspace=self._workspace if (self._workspace is not None and N <= (self.spec.max_tokens or 0)) else None,
            tune_max_num_tokens=max(self.spec.max_tokens or 8192, N),
            profile_ids=self.profile_ids,
        )
        return kwargs


def check_reload(current: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    """A reload must produce the same tensors (names, shapes, dtypes) as the first load."""
    if not current:
        return
    if set(new) != set(current):
        raise ValueError(
            f"reloaded weights produce kernel tensors {sorted(new)}, the layer holds "
            f"{sorted(current)}; rebuild the layer to change the weight set"
        )
    for k, v in new.items():
        old = current[k]
        if old.shape != v.shape or old.dtype != v.dtype:
            raise ValueError(
                f"reloading {k!r} would change it from {list(old.shape)} {old.dtype} to "
                f"{list(v.shape)} {v.dtype}; rebuild the layer instead"
            )


def _truncate_nongated(weights: ExpertWeights, intermediate: int) -> ExpertWeights:
    from dataclasses import replace

    rows_per_block = 1
    if weights.format is not None:
        rows_per_block = WEIGHT_FORMATS[weights.format].scale_block[0]
    w1, w1_scale = truncate_nongated_w13(weights.w1, intermediate, weights.w1_scale, rows_per_block)
    b13 = weights.b13[:, :intermediate] if weights.b13 is not None else None
    return replace(weights, w1=w1, w1_scale=w1_scale, b13=b13)


def quantize_weights_online(weights: ExpertWeights, fmt: str) -> ExpertWeights:
    """Online quantization at load (epmoe.quant.weights.quantize_expert_weights)."""
    from epmoe.quant.weights import quantize_expert_weights

    return quantize_expert_weights(weights, fmt)
