"""Expert-parallel Hugging Face transformers MoE models (`pip install 'epmoe[hf]'`, transformers 5).

    from epmoe.integrations.transformers import load_model, update_weights
    model = load_model("path/to/checkpoint", group=ep_group)     # each rank reads only its experts
    out = model.generate(input_ids, max_new_tokens=16)            # every rank; own prompts, or None
    update_weights(model, trainer.state_dict())                   # HF names, local experts in place

Training (docs/training.md): `load_model(path, group=ep_group, training=True)` gives a model whose
`loss.backward()` reaches transformers' own parameters (router, attention, shared experts, ...) and
this rank's routed experts (nn.Parameters of each block's `ep_moe`); `sync_dense_gradients(model)`
sums the dense gradients over the group (each rank's loss covers its own batch), and
`expert_gradients(model)` gives the local experts' gradients under transformers' names and layouts.
Rollouts run the same model under torch.no_grad (generate does): the inference path.

What is replaced and what stays transformers' own: the model is transformers' own class, built and
loaded the way `from_pretrained` does it, except that the routed experts of every MoE block run
through one `EPMoE` layer per block. The router (gate), shared experts, attention, norms, the cache
and `generate` are transformers' code, unchanged. Each rank holds the experts
[r*E/ep, (r+1)*E/ep) of every MoE layer; the other experts are never read from disk nor allocated.

Extension points used, and the one place that needs transformers internals:
  * transformers 5 "experts implementation" (`ExpertsInterface.register`, `config._experts_implementation`):
    the experts module of every MoE block (classes decorated with `@use_experts_implementation`) calls
    the function registered as "epmoe" with (hidden_states, top_k_index, top_k_weights); that function
    hands the router's choice to `EPMoE.forward(topk_ids=..., topk_weights=...)`. No class or method of
    transformers is patched.
  * The decorator's own metadata (`has_gate`, `has_bias`, `is_transposed`, `is_concatenated`) says
    how each family lays out `gate_up_proj` / `down_proj`, so update_weights reads trainer tensors
    of any supported family without a per-family table.
  * Loading mirrors `PreTrainedModel.from_pretrained` step by step (meta-device construction with
    the class's own init contexts, `_load_pretrained_model`, `_finalize_model_loading`), with one
    difference: the expert parameters are removed from the meta model before the weights are read,
    so transformers sees the checkpoint's expert tensors as "not part of this model" and never
    materialises them. transformers has no public hook between "model built" and "weights loaded"
    that lets a module drop parameters (quantizers do it, but pretending to be a quantizer would
    mark the model quantized and collide with real quantized checkpoints), hence these private
    calls; they are pinned by the `hf` extra (transformers >= 5.17, < 6) and tested on 5.17.

Quantized checkpoints (QUANTIZED_CHECKPOINTS: GPT-OSS MXFP4, DeepSeek-V3 FP8 blocks, as shipped): the
routed experts are read as stored by `EPMoE.load_weights` and run through the layer's quant plan;
everything else goes through transformers' own quantizer for the checkpoint (`get_hf_quantizer`, then
`preprocess_model` / the loader's conversions / `postprocess_model`, as from_pretrained calls them),
with the experts modules added to its `modules_to_not_convert` so they stay the model's own.

Lockstep (why generate works with different prompts per rank): `EPMoE.forward` is collective, so every
rank must call every MoE layer the same number of times. Each forward of the model is one *step*:
a forward pre-hook on the model all-gathers "I am running a step" over the EP group. The returned
model's `generate` runs transformers' own generate on this rank's prompts (a rank may have none:
`input_ids=None` or 0 rows), and afterwards keeps *serving*: as long as any other rank still runs
steps, it runs every MoE layer once with 0 tokens per step; when every rank reports done, all
return together. Plain `model(...)` calls work on their own when every rank makes them in step.
Rules: call `generate` (or forward) on every rank of the group, `synced_gpus` must stay off (it
all-reduces over the whole world, this protocol over the EP group), and do not call forward of a
sub-module (e.g. `model.model`) on some ranks only.
"""

from __future__ import annotations

import glob
import json
import os
import re
import types
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from packaging.version import Version

try:
    import transformers
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "epmoe.integrations.transformers needs Hugging Face transformers 5: pip install 'epmoe[hf]'"
    ) from e
_TF_VERSION = Version(transformers.__version__)
if not (Version("5.17") <= _TF_VERSION < Version("6")):
    raise ImportError(
        f"epmoe.integrations.transformers needs transformers >= 5.17, < 6 (found {transformers.__version__}): "
        "pip install 'epmoe[hf]'"
    )
from transformers import AutoConfig, GenerationConfig  # noqa: E402
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

from epmoe.config import MoEConfig, parse_dtype
from epmoe.core import dist as edist
from epmoe.layer import DEFAULT_MAX_TOKENS_PER_RANK, EPMoE
from epmoe.checkpoint import load_expert_weights
from epmoe.quant.weights import ExpertWeights

IMPLEMENTATION = "epmoe"

# model_type -> what runs. Checked: CPU float32 generate == unsharded transformers (the first five on 2
# and 4 ranks, the rest on 2), tests/cpu/test_hf_integration.py.
SUPPORTED_FAMILIES: Dict[str, str] = {
    "mixtral": "Mixtral (MixtralSparseMoeBlock)",
    "qwen2_moe": "Qwen2-MoE (routed experts; shared expert and its gate stay transformers')",
    "qwen3_moe": "Qwen3-MoE",
    "deepseek_v3": "DeepSeek-V3 (routed experts; grouped sigmoid router and shared experts stay transformers')",
    "gpt_oss": "GPT-OSS (clamped SwiGLU with biases; bf16 or MXFP4 checkpoints)",
    "olmoe": "OLMoE",
    "phimoe": "PhiMoE (its sparsemixer router stays transformers')",
    "glm4_moe": "GLM-4.5 MoE (grouped sigmoid router and shared experts stay transformers')",
    "dots1": "dots.llm1 (grouped sigmoid router and shared experts stay transformers')",
}

# Quantized checkpoints accepted, as they ship: (model_type, MoEConfig.quant_method) -> what they are.
# Checked on CPU against transformers' own model of the same checkpoint (tests/cpu/test_hf_quantized.py).
QUANTIZED_CHECKPOINTS: Dict[tuple, str] = {
    ("gpt_oss", "mxfp4"): "GPT-OSS as released: routed experts MXFP4 (blocks + E8M0 scales), everything else bf16",
    ("deepseek_v3", "fp8"): "DeepSeek-V3 / R1 / Kimi-K2 FP8: every linear but lm_head float8_e4m3fn with 128x128 "
                            "weight_scale_inv blocks, dynamic activation scales",
}

_STATE_ATTR = "_epmoe_state"
_LAYER_ATTR = "ep_moe"  # the EPMoE of an experts module (a registered child module)


# ---------------------------------------------------------------------------------------------- hook
def _epmoe_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "epmoe" experts implementation: [T, H], [T, K] global expert ids, [T, K] weights -> [T, H]."""
    layer: EPMoE = getattr(self, _LAYER_ATTR)
    return layer(hidden_states, topk_ids=top_k_index.to(torch.int32), topk_weights=top_k_weights.float())


ExpertsInterface.register(IMPLEMENTATION, _epmoe_experts_forward)


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class ExpertsSite:
    """One MoE block's experts module: its name in the model (e.g. 'model.layers.3.mlp.experts'), the
    decoder layer index, and the layout flags transformers' decorator set on it."""

    name: str
    layer_idx: int
    is_transposed: bool
    is_concatenated: bool
    has_bias: bool


@dataclass(frozen=True)
class ExpertMemory:
    """Bytes of routed-expert tensors: held by this rank, and in the whole model (all experts)."""

    local_bytes: int
    model_bytes: int
    num_layers: int


class _Lockstep:
    """Keeps the ranks' model steps in step (see the module docstring)."""

    def __init__(self, group: Any, layers: List[EPMoE], timeout_s: Optional[float]):
        self.group, self.layers, self.timeout_s = group, layers, timeout_s
        self.distributed = edist.is_distributed(group) and edist.group_size(group) > 1
        self.in_step = False  # between the pre-hook and the end of a model forward

    def any_running(self, running: bool) -> bool:
        if not self.distributed:
            return running
        return bool(edist.gather_ints([int(running)], self.group, self.timeout_s).any())

    def before_forward(self, module, args):  # forward pre-hook
        self.any_running(True)
        self.in_step = True

    def after_forward(self, module, args, output):  # forward hook
        self.in_step = False

    def serve_until_all_done(self) -> int:
        """Run 0-token steps while another rank still runs steps; returns how many were served."""
        served = 0
        while self.any_running(False):
            for layer in self.layers:
                cfg = layer.config
                layer(
                    torch.empty(0, cfg.hidden_size, dtype=cfg.dtype, device=layer.device),
                    topk_ids=torch.empty(0, cfg.top_k, dtype=torch.int32, device=layer.device),
                    topk_weights=torch.empty(0, cfg.top_k, dtype=torch.float32, device=layer.device),
                )
            served += 1
        return served


@dataclass(frozen=True)
class QuantizedLoad:
    """How a quantized checkpoint was loaded (`describe` prints it).

    quant_method:  the checkpoint's (MoEConfig.quant_method: "fp8", "mxfp4")
    expert_format: how the routed experts are stored and held (ExpertWeights.format: "fp8_block", "mxfp4")
    quantizer:     transformers' quantizer class that loaded everything outside the routed experts
    dequantized:   whether that quantizer dequantized what it loads (its `dequantize`, decided for this
                   machine by transformers, or by the caller's quantization_config)
    dense_fp8:     the modules outside the routed experts stored quantized in the checkpoint (FP8 linears:
                   attention, shared experts, dense MLPs), with how transformers runs them"""

    quant_method: str
    expert_format: str
    quantizer: str
    dequantized: bool
    dense_fp8: Tuple[str, ...]
    dense_runs_as: str


@dataclass
class _State:
    sites: List[ExpertsSite]
    layers: List[EPMoE]
    lockstep: _Lockstep
    moe_config: MoEConfig
    checkpoint: str
    quantized: Optional[QuantizedLoad] = None


# ---------------------------------------------------------------------------------------------- checks
def _read_config(path: str):
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{path!r} is not a checkpoint directory with a config.json; pass the directory that "
            "save_pretrained wrote"
        )
    return AutoConfig.from_pretrained(path)


def moe_config_for(hf_config: Any, ep_size: int, dtype: Optional[torch.dtype] = None,
                   redundant_experts: int = 0) -> MoEConfig:
    """The MoEConfig of a transformers config, after the checks that run before anything is loaded:
    the model is MoE, its family is supported, and `ep_size` divides its experts (plus
    `redundant_experts` EPLB slots) (ValueError naming the value and the fix otherwise)."""
    model_type = getattr(hf_config, "model_type", "?")
    raw = hf_config.to_dict()
    try:
        cfg = MoEConfig.from_hf_config(raw, **({"dtype": dtype} if dtype is not None else {}))
    except ValueError as e:
        raise ValueError(
            f"model_type={model_type!r} is not a Mixture-of-Experts model ({e}); epmoe shards the routed "
            "experts of MoE models only, load dense models with transformers directly"
        ) from None
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model_type={model_type!r} is not supported by epmoe.integrations.transformers; supported: "
            f"{sorted(SUPPORTED_FAMILIES)}"
        )
    if cfg.quant_method is not None and (model_type, cfg.quant_method) not in QUANTIZED_CHECKPOINTS:
        raise ValueError(
            f"the checkpoint is quantized (quant_method={cfg.quant_method!r}) and model_type={model_type!r}; "
            "this integration loads quantized checkpoints as they ship for "
            f"{sorted(f'{t} {m}' for t, m in QUANTIZED_CHECKPOINTS)} only: use an unquantized (bf16) checkpoint "
            "of this model, or EPMoE.load_weights for the experts alone"
        )
    act = str(raw.get("hidden_act", "silu")).lower()
    if model_type != "gpt_oss" and act != "silu":
        raise ValueError(f"hidden_act={act!r}: epmoe runs gated SiLU experts for {model_type!r}; only 'silu' is supported")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size <= 0:
        raise ValueError(f"ep_size={ep_size!r}; pass a positive int")
    slots = cfg.num_experts + redundant_experts
    if slots % ep_size:
        divisors = [d for d in range(1, slots + 1) if slots % d == 0]
        fit = redundant_experts + (-slots) % ep_size
        raise ValueError(
            f"the EP group has {ep_size} ranks, which does not divide the model's {cfg.num_experts} experts"
            + (f" + {redundant_experts} redundant" if redundant_experts else "")
            + f"; use an EP group size in {divisors}, or eplb=EPLBConfig(num_redundant_experts={fit})"
        )
    if model_type == "gpt_oss":  # GptOssExperts hard-codes alpha=1.702, limit=7.0 and (up + 1)
        cfg = cfg.replace(swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=float(raw.get("swiglu_limit") or 7.0))
    return cfg


def _checkpoint_files(path: str) -> List[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, f) for f in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}; save the model with save_pretrained (safetensors)")
    return files


def _find_sites(model: torch.nn.Module) -> List[ExpertsSite]:
    sites = []
    for name, m in model.named_modules():
        if not all(hasattr(m, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")):
            continue  # not an experts module of transformers' `@use_experts_implementation`
        if not isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter):
            continue
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if match is None:
            raise ValueError(f"experts module {name!r} is not under a decoder layer 'layers.N.'; unsupported layout")
        sites.append(ExpertsSite(name, int(match.group(1)), bool(m.is_transposed), bool(m.is_concatenated),
                                 bool(m.has_bias)))
    return sites


def _check_site_shapes(model: torch.nn.Module, site: ExpertsSite, cfg: MoEConfig) -> None:
    m = model.get_submodule(site.name)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    want_gu = (E, H, 2 * I) if site.is_transposed else (E, 2 * I, H)
    want_d = (E, I, H) if site.is_transposed else (E, H, I)
    got_gu, got_d = tuple(m.gate_up_proj.shape), tuple(m.down_proj.shape)
    if (got_gu, got_d) != (want_gu, want_d) or site.has_bias != cfg.has_bias or not m.has_gate:
        raise ValueError(
            f"{site.name}: gate_up_proj {list(got_gu)} / down_proj {list(got_d)} (bias={site.has_bias}) do not match "
            f"the config's E={E}, H={H}, I={I} (bias={cfg.has_bias}); this model layout is not supported"
        )


def _default_device(group: Any) -> torch.device:
    """The current CUDA device for an NCCL group (or no group on a GPU machine), else the CPU."""
    if edist.is_distributed(group):
        use_cuda = edist.collective_device(group).type == "cuda"
    else:
        use_cuda = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


# ---------------------------------------------------------------------------------------------- quantized
def _hf_quantizer(hf_config: Any, moe_cfg: MoEConfig, quantization_config: Any, device_map: dict,
                  dtype: torch.dtype):
    """transformers' quantizer for the checkpoint, built and validated as `from_pretrained` does it
    (`get_hf_quantizer`: merges `quantization_config`, then `validate_environment`, which decides
    for this machine whether it dequantizes). ValueError / ImportError with the fix when transformers
    cannot load the non-expert part here."""
    from transformers.quantizers.auto import get_hf_quantizer
    from transformers.utils import is_kernels_available

    method = moe_cfg.quant_method
    if method == "mxfp4":
        if quantization_config is not None:
            raise ValueError(
                "quantization_config= is not used for a GPT-OSS MXFP4 checkpoint: only its routed experts are "
                "quantized, and epmoe runs them (quant= chooses how); leave quantization_config unset"
            )
        from transformers import Mxfp4Config

        # The MXFP4 quantizer converts the routed experts only (the rest of the checkpoint is unquantized).
        # dequantize=True is transformers' own option; it keeps its quantizer from swapping the experts /
        # MLP forward for its hub kernels, which epmoe replaces anyway.
        quantization_config = Mxfp4Config(dequantize=True)
    try:
        hf_quantizer, _, _ = get_hf_quantizer(hf_config, quantization_config, device_map, True, {})
    except ImportError as e:
        raise ImportError(
            f"transformers cannot load this {method} checkpoint on this machine: {e} (transformers' quantizer "
            "loads everything outside the routed experts)"
        ) from e
    qc = hf_quantizer.quantization_config
    if method == "fp8" and not getattr(qc, "dequantize", False) and not is_kernels_available():
        raise ValueError(
            "transformers runs this FP8 checkpoint's non-expert linears (attention, shared experts, dense MLPs) "
            "on this GPU as FP8Linear with the finegrained-fp8 Triton kernel of the `kernels` package, which is "
            "not installed: pip install kernels (it fetches kernels-community/finegrained-fp8), or pass "
            f"quantization_config=FineGrainedFP8Config(dequantize=True) to dequantize them to {dtype} at load, "
            "as transformers does on a machine without a GPU"
        )
    return hf_quantizer


def _keep_experts_unconverted(model: torch.nn.Module, hf_quantizer: Any, sites: List[ExpertsSite]) -> None:
    """Add the routed experts modules to the quantizer's modules_to_not_convert (keeping transformers'
    default skips, e.g. lm_head, which apply when the checkpoint lists none)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    qc = hf_quantizer.quantization_config
    if not hasattr(qc, "modules_to_not_convert"):
        return
    keep = list(qc.modules_to_not_convert) if qc.modules_to_not_convert is not None else get_keys_to_not_convert(model)
    qc.modules_to_not_convert = keep + [s.name for s in sites if s.name not in keep]


def _quantized_load(model: torch.nn.Module, hf_quantizer: Any, moe_cfg: MoEConfig, expert_prefixes,
                    files: List[str]) -> QuantizedLoad:
    from epmoe.quant.plan import checkpoint_family

    qc = hf_quantizer.quantization_config
    dequantized = bool(getattr(qc, "dequantize", False))
    dense: List[str] = []
    runs_as = "none: only the routed experts are quantized in this checkpoint"
    if moe_cfg.quant_method == "fp8":
        from transformers.integrations.finegrained_fp8 import FP8Linear

        stored = {k.rsplit(".", 1)[0] for k in _checkpoint_keys(files) if k.endswith(".weight_scale_inv")}
        dense = sorted(n for n in stored if not n.startswith(expert_prefixes))
        fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
        runs_as = (f"dequantized to {model.dtype} at load by transformers" if dequantized or not fp8 else
                   "transformers' FP8Linear (finegrained-fp8 kernel, dynamic 1x128 activation scales)")
    family = checkpoint_family(moe_cfg.quant_method)
    expert_format = {"fp8": "fp8_block", "mxfp4": "mxfp4"}[family]
    return QuantizedLoad(quant_method=moe_cfg.quant_method, expert_format=expert_format,
                         quantizer=type(hf_quantizer).__name__, dequantized=dequantized, dense_fp8=tuple(dense),
                         dense_runs_as=runs_as)


def _checkpoint_keys(files: List[str]) -> List[str]:
    """Tensor names of the checkpoint (safetensors headers only)."""
    from safetensors import safe_open

    keys: List[str] = []
    for f in files:
        with safe_open(f, framework="pt") as h:
            keys += list(h.keys())
    return keys


# ---------------------------------------------------------------------------------------------- loading
def load_model(
    path: Union[str, os.PathLike],
    group: Any = None,
    *,
    dtype: Union[str, torch.dtype, None] = None,
    device: Union[str, torch.device, None] = None,
    dispatcher: str = "torch",
    max_num_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
    timeout_s: Optional[float] = None,
    quantization_config: Any = None,
    **epmoe_options: Any,
):
    """Load a transformers MoE checkpoint directory (written by `save_pretrained`, safetensors) as a
    causal LM whose routed experts are sharded over `group` (default: the world). Collective: every rank
    of the group calls it with the same arguments.

    dtype:   activation / weight dtype (default: the checkpoint's `dtype`)
    device:  default cuda (current device) when the group is NCCL, else cpu
    dispatcher, max_num_tokens_per_rank, timeout_s, **epmoe_options: passed to every `EPMoE`
             (e.g. experts="reference", deterministic=True, eplb=EPLBConfig(...), training=True: the
             model trains, docs/training.md); all MoE layers share
             one dispatcher. With eplb each layer balances its own experts (rebalancing between steps,
             which every rank runs in lockstep, so generate keeps working).

    quantization_config: transformers' loading options for a quantized checkpoint's non-expert part, as
             `from_pretrained` takes them (e.g. `FineGrainedFP8Config(dequantize=True)`); FP8 only.

    Quantized checkpoints (QUANTIZED_CHECKPOINTS): the routed experts are read as stored (only this
    rank's) and run in the checkpoint's format through the plan the resolver picks for the machine
    (`quant=` as for EPMoE, e.g. quant="bf16" dequantizes them at load); everything else is loaded by
    transformers' own quantizer for that checkpoint, which decides per machine whether it dequantizes.
    `describe(model)` says what runs where.

    Checks that raise ValueError on every rank before anything is read: not an MoE model, an
    unsupported family, an EP size that does not divide the experts, a quantized checkpoint this
    integration does not load, or one whose non-expert part transformers cannot run here."""
    path = os.fspath(path)
    hf_config = _read_config(path)
    ep_size = edist.group_size(group)
    dtype = parse_dtype(dtype) if dtype is not None else parse_dtype(getattr(hf_config, "dtype", None) or "float32")
    placement = epmoe_options.get("placement")
    eplb = epmoe_options.get("eplb")
    redundant = getattr(placement, "num_redundant", 0) if placement is not None else \
        getattr(eplb, "num_redundant_experts", 0)
    moe_cfg = moe_config_for(hf_config, ep_size, dtype, redundant)
    device = torch.device(device) if device is not None else _default_device(group)
    files = _checkpoint_files(path)

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils.generic import ContextManagers

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    hf_config._experts_implementation = IMPLEMENTATION
    device_map = {"": str(device)}
    hf_quantizer = None
    if moe_cfg.quant_method is not None:
        hf_quantizer = _hf_quantizer(hf_config, moe_cfg, quantization_config, device_map, dtype)
        dtype = hf_quantizer.update_dtype(dtype)
    elif quantization_config is not None:
        raise ValueError("quantization_config= is for quantized checkpoints; this checkpoint has no quantization_config")
    hf_config.dtype = dtype
    # 1. Build on the meta device exactly as from_pretrained does (nothing allocated).
    with ContextManagers(model_cls.get_init_context(dtype, hf_quantizer is not None, False, None)):
        model = model_cls(hf_config)
        try:
            from transformers.monkey_patching import patch_output_recorders

            patch_output_recorders(model)
        except ImportError:  # older 5.x: nothing to patch
            pass
        sites = _find_sites(model)
        if hf_quantizer is not None:
            # transformers' quantizer converts what it loads; the routed experts are epmoe's, so they
            # stay the model's own experts modules (which dispatch to the "epmoe" implementation).
            _keep_experts_unconverted(model, hf_quantizer, sites)
            hf_quantizer.preprocess_model(model=model, dtype=dtype, device_map=device_map, checkpoint_files=files,
                                          use_kernels=False)
    if not sites:
        raise ValueError(f"{model_cls.__name__} has no transformers experts modules; this model is not supported")
    for site in sites:
        _check_site_shapes(model, site, moe_cfg)
    # 2. Drop the expert parameters (still on meta): the loader below then treats the checkpoint's
    #    expert tensors as foreign and never reads them.
    for site in sites:
        m = model.get_submodule(site.name)
        for pname in [n for n, _ in m.named_parameters(recurse=False)]:
            delattr(m, pname)
        m._is_hf_initialized = True  # transformers' flag: skip `_init_weights` (which would touch them)
    # 3. Everything else: transformers' own loading (renames, dtype plan, tied weights, buffers, and for
    #    a quantized checkpoint its quantizer's conversions).
    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=path, device_map=device_map, dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype), weight_mapping=get_model_conversion_mapping(model, None, hf_quantizer),
        hf_quantizer=hf_quantizer,
    )
    info, _ = model_cls._load_pretrained_model(model, None, files, load_config)
    prefixes = tuple(s.name + "." for s in sites)
    info.unexpected_keys = {k for k in info.unexpected_keys if not k.startswith(prefixes)}
    model_cls._finalize_model_loading(model, load_config, info)
    model.eval()
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    quantized = None
    if hf_quantizer is not None:
        quantized = _quantized_load(model, hf_quantizer, moe_cfg, prefixes, files)
        model.hf_quantizer = hf_quantizer
        hf_quantizer.postprocess_model(model)  # as from_pretrained (drops the config when dequantized)
    # 4. The routed experts: one EPMoE per MoE block, reading only this rank's experts.
    layers: List[EPMoE] = []
    for site in sites:
        layer = EPMoE(
            moe_cfg, group, dispatcher=layers[0].dispatcher if layers else dispatcher, device=device,
            max_num_tokens_per_rank=max_num_tokens_per_rank, timeout_s=timeout_s, name=f"EPMoE[{site.name}]",
            **epmoe_options,
        )
        layer.load_weights(path, layer_idx=site.layer_idx)
        model.get_submodule(site.name).add_module(_LAYER_ATTR, layer)
        layers.append(layer)
    # 5. Lockstep across the EP group (module docstring).
    lockstep = _Lockstep(group, layers, timeout_s)
    if lockstep.distributed:
        model.register_forward_pre_hook(lockstep.before_forward)
        model.register_forward_hook(lockstep.after_forward)
    setattr(model, _STATE_ATTR, _State(sites, layers, lockstep, moe_cfg, path, quantized))
    # The instance's generate keeps the ranks in step; transformers' own is type(model).generate.
    model.generate = types.MethodType(generate, model)
    return model


def _state(model: Any) -> _State:
    st = getattr(model, _STATE_ATTR, None)
    if st is None:
        raise ValueError("this model was not loaded by epmoe.integrations.transformers.load_model")
    return st


def ep_layers(model: Any) -> List[EPMoE]:
    """The EPMoE layers of a model from load_model, in call order."""
    return list(_state(model).layers)


def describe(model: Any) -> str:
    """What runs where, in the words of `--plan`: the checkpoint, the routed experts (how they are stored,
    how many this rank holds, the layers' quant plan) and who loaded the rest of the model (transformers'
    quantizer and whether it dequantized). The same on every rank but for nothing (ranks agree on the plan)."""
    st = _state(model)
    cfg, layer, q = st.moe_config, st.layers[0], st.quantized
    what = f"quantized {q.quant_method}: {QUANTIZED_CHECKPOINTS[(cfg.model_type, q.quant_method)]}" if q else "unquantized"
    lines = [
        f"checkpoint: {st.checkpoint} ({cfg.model_type}, {what})",
        f"routed experts: {len(st.layers)} MoE layers x {cfg.num_experts} experts through EPMoE on {layer.device}, "
        f"{layer.num_local_experts} per rank on {layer.ep_size} rank(s); each rank reads only its experts' tensors"
        + (f", kept as stored ({q.expert_format})" if q else ""),
        "  " + layer.plan.describe().replace("\n", "\n  "),
    ]
    if q is None:
        lines.append(f"rest of the model: transformers' own modules as stored, in {cfg.dtype}")
    else:
        dense = (f"{len(q.dense_fp8)} FP8 block linears (attention, shared experts, dense MLPs): {q.dense_runs_as}; "
                 if q.dense_fp8 else f"{q.dense_runs_as}; ")
        lines.append(f"rest of the model: transformers' {q.quantizer} (dequantize={q.dequantized}): {dense}"
                     f"embeddings, norms, routers and lm_head as stored, in {cfg.dtype}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- generate
def generate(model: Any, inputs: Optional[torch.Tensor] = None, **kwargs: Any):
    """transformers' `generate` on this rank's prompts, kept in lockstep with the other ranks of the EP
    group. Every rank calls it; a rank without prompts passes `None` (or 0 rows) and gets a [0, 0]
    tensor (its input back when it passed 0 rows). Other arguments are transformers' own."""
    st = _state(model)
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    has_rows = inputs is not None and inputs.shape[0] > 0
    st.lockstep.in_step = False
    try:
        if kwargs.get("synced_gpus"):
            raise ValueError(
                "synced_gpus=True all-reduces over the whole world each step; epmoe keeps the EP group in "
                "step itself: leave synced_gpus unset"
            )
        if has_rows:
            out = type(model).generate(model, inputs, **kwargs)
        elif inputs is not None:
            out = inputs
        else:
            out = torch.empty(0, 0, dtype=torch.long, device=st.layers[0].device)
    except BaseException:
        # Failed between steps (e.g. bad arguments before the first one): the other ranks still
        # need this rank's experts, so serve them, then re-raise. Failed inside a step: the other
        # ranks are inside that step's collectives (EPMoE raises on every rank for bad layer input;
        # anything else ends at the collective timeout), so serving would only mismatch collectives.
        if not st.lockstep.in_step:
            st.lockstep.serve_until_all_done()
        raise
    st.lockstep.serve_until_all_done()
    return out


# ---------------------------------------------------------------------------------------------- weights
def _local_from_fused(site: ExpertsSite, tensors: Mapping[str, torch.Tensor], cfg: MoEConfig,
                      lo: int, hi: int, copy: bool = True) -> ExpertWeights:
    """transformers 5 in-memory expert tensors (the trainer's `state_dict()`) -> ExpertWeights of experts
    [lo, hi) (copy=False: strided views; a layer under an EPLB placement takes its slots' rows)."""
    missing = [n for n in ("gate_up_proj", "down_proj") if n not in tensors]
    if site.has_bias:
        missing += [n for n in ("gate_up_proj_bias", "down_proj_bias") if n not in tensors]
    if missing:
        raise ValueError(f"update_weights: {site.name} lacks {[site.name + '.' + n for n in missing]}")
    E, I = cfg.num_experts, cfg.intermediate_size
    gu, down = tensors["gate_up_proj"], tensors["down_proj"]
    for n, t in (("gate_up_proj", gu), ("down_proj", down)):
        if t.dim() != 3 or t.shape[0] != E:
            raise ValueError(f"update_weights: {site.name}.{n} has shape {list(t.shape)}; expected [{E}, ., .]")
    rows = slice(lo, hi)
    gu = gu[rows]
    if site.is_transposed:
        gu = gu.transpose(1, 2)  # [e, 2I, H]
    if site.is_concatenated:
        w1, w3 = gu[:, :I], gu[:, I:]
    else:
        w1, w3 = gu[:, 0::2], gu[:, 1::2]
    w2 = down[rows].transpose(1, 2) if site.is_transposed else down[rows]
    b13 = b2 = None
    if site.has_bias:
        gb = tensors["gate_up_proj_bias"][rows]
        b13 = gb if site.is_concatenated else torch.cat([gb[:, 0::2], gb[:, 1::2]], dim=1)
        b2 = tensors["down_proj_bias"][rows]
    c = lambda t: t if t is None or not copy else t.contiguous()  # noqa: E731
    return ExpertWeights(w1=c(w1), w2=c(w2), w3=c(w3), b13=c(b13), b2=c(b2), first_expert=lo)


_FUSED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
_LEGACY_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\..*experts\.\d+\.")


def update_weights(model: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Push a trainer's weights (HF names) into a model from load_model, in place. Collective.

    Expert tensors: transformers 5 names (`...mlp.experts.gate_up_proj` / `down_proj` [+ `_bias`], all
    experts; this rank keeps its slice) or per-expert checkpoint names (`...experts.{e}.w1.weight`,
    `gate_proj` / `up_proj` / `down_proj`). Every MoE layer must be present; each is updated through
    `EPMoE.update_weights` (in place, all-or-nothing across the group, dtypes and shapes fixed).
    Other tensors: copied in place into the parameters / buffers of the same name; a name the model
    does not have is a ValueError, raised on every rank before anything changes.

    A model of a quantized checkpoint takes the trainer's unquantized tensors and quantizes them on the
    way in with the checkpoint's recipe (`_quantize_like_checkpoint`; transformers' FP8Linear weights
    into weight + weight_scale_inv), in place: the experts keep the checkpoint's format and storage."""
    st = _state(model)
    own = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    prefixes = [s.name + "." for s in st.sites]
    error: Optional[BaseException] = None
    dense: Dict[str, torch.Tensor] = {}
    try:
        unknown = []
        for k, v in state_dict.items():
            if any(k.startswith(p) for p in prefixes) or _LEGACY_EXPERT.search(k):
                continue
            if k not in own:
                unknown.append(k)
            elif tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"update_weights: {k} has shape {list(v.shape)}; the model's is {list(own[k].shape)}")
            elif own[k].dtype == torch.float8_e4m3fn and v.dtype != torch.float8_e4m3fn:
                dense.update(_quantize_fp8_linear(model, k, v, own))
            else:
                dense[k] = v
        if unknown:
            raise ValueError(
                f"update_weights: the model has no tensors named {sorted(unknown)[:6]}"
                f"{' ...' if len(unknown) > 6 else ''}; pass the trainer's model.state_dict() (transformers 5 names)"
            )
    except ValueError as e:
        error = e
    flags = edist.gather_ints([0 if error is None else 1], st.layers[0].group)
    edist.raise_if_any_failed(error, [r for r in range(flags.shape[0]) if flags[r, 0]], st.layers[0].group)
    for site, layer in zip(st.sites, st.layers):
        p = site.name + "."
        fused = {k[len(p):]: v for k, v in state_dict.items() if k.startswith(p) and k[len(p):] in _FUSED_NAMES}
        trainer_float = st.quantized is not None and not fused and not _stored_quantized(state_dict, site)
        if not fused and not trainer_float:  # per-expert names in the layer's own format: the loader reads them
            layer.update_weights(state_dict, layer_idx=site.layer_idx)
            continue
        corr = None
        try:
            if fused and layer.placement.is_contiguous:
                lo = layer.first_local_expert
                weights: Any = _local_from_fused(site, fused, st.moe_config, lo, lo + layer.num_local_experts)
            elif fused:  # all experts as views: the layer copies the rows of its slots (every replica)
                weights = _local_from_fused(site, fused, st.moe_config, 0, st.moe_config.num_experts, copy=False)
            else:  # a trainer's per-expert names, unquantized, into a quantized model
                lo, hi = (layer.first_local_expert, layer.first_local_expert + layer.num_local_experts) \
                    if layer.placement.is_contiguous else (0, st.moe_config.num_experts)
                loaded = load_expert_weights(state_dict, st.moe_config.replace(quant_method=None), experts=(lo, hi),
                                             layer_idx=site.layer_idx)
                weights, corr = loaded.experts, loaded.e_score_correction_bias
            if st.quantized is not None:
                weights = _quantize_like_checkpoint(weights, st.quantized, layer)
        except ValueError as e:
            weights, err = None, e
        else:
            err = None
        flags = edist.gather_ints([0 if err is None else 1], layer.group)
        edist.raise_if_any_failed(err, [r for r in range(flags.shape[0]) if flags[r, 0]], layer.group)
        layer.update_weights(weights, e_score_correction_bias=corr)
    with torch.no_grad():
        for k, v in dense.items():
            own[k].copy_(v)


# ---------------------------------------------------------------------------------------------- training
def _expert_param_names(model: Any) -> set:
    st = _state(model)
    names = set()
    for site in st.sites:
        for pname, _ in model.get_submodule(site.name).named_parameters():
            names.add(f"{site.name}.{pname}")
    return names


def sync_dense_gradients(model: Any, average: bool = False) -> None:
    """Sum (average=True: average) the gradients of every parameter that is not a routed expert over the
    EP group, so that each rank holds the gradient of the sum of all ranks' losses, as the routed
    experts already do (their tokens came from every rank). Collective; a missing gradient counts as 0.
    With average=True divide the loss by the group size instead of averaging expert gradients."""
    st = _state(model)
    group = st.layers[0].group
    if not edist.is_distributed(group):
        return
    import torch.distributed as dist

    experts = _expert_param_names(model)
    dense = [p for n, p in model.named_parameters() if n not in experts and p.requires_grad]
    if not dense:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in dense])
    dist.all_reduce(flat, group=group)
    if average:
        flat /= edist.group_size(group)
    at = 0
    for p in dense:
        n = p.numel()
        g = flat[at:at + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        at += n


def expert_gradients(model: Any) -> Dict[str, torch.Tensor]:
    """The gradients of this rank's routed experts under transformers' names and layouts:
    '{experts module}.gate_up_proj' / 'down_proj' (+ '_bias') -> [E_local, ...], rows = the experts
    [layer.first_local_expert, + layer.num_local_experts) of that block's EPMoE (ep_layers). Only blocks
    that received a gradient are listed. Needs load_model(..., training=True)."""
    st = _state(model)
    out: Dict[str, torch.Tensor] = {}
    I = st.moe_config.intermediate_size
    for site, layer in zip(st.sites, st.layers):
        g = layer.expert_gradients()
        if g is None:
            continue
        if site.is_concatenated:
            gu = torch.cat([g.w1, g.w3], dim=1)  # [e, 2I, H]
        else:
            gu = torch.stack([g.w1, g.w3], dim=2).reshape(g.w1.shape[0], 2 * I, -1)  # gate j, up j interleaved
        out[f"{site.name}.gate_up_proj"] = gu.transpose(1, 2) if site.is_transposed else gu
        out[f"{site.name}.down_proj"] = g.w2.transpose(1, 2) if site.is_transposed else g.w2
        if site.has_bias:
            b = g.b13 if site.is_concatenated else torch.stack([g.b13[:, :I], g.b13[:, I:]], dim=2).reshape(g.b13.shape[0], 2 * I)
            out[f"{site.name}.gate_up_proj_bias"] = b
            out[f"{site.name}.down_proj_bias"] = g.b2
    return out


def _stored_quantized(state_dict: Mapping[str, torch.Tensor], site: ExpertsSite) -> bool:
    """Whether the per-expert tensors given for this layer are already in a quantized checkpoint format."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", site.name)
    layer = f"layers.{m.group(1)}." if m else site.name
    return any(layer in k and ".experts." in k and k.endswith(("weight_scale_inv", "_blocks", "_scales"))
               for k in state_dict)


def _quantize_like_checkpoint(weights: ExpertWeights, q: QuantizedLoad, layer: EPMoE) -> ExpertWeights:
    """A trainer's unquantized experts -> the checkpoint's format with its recipe: FP8 128x128 blocks with
    scale amax / 448 (DeepSeek-V3's weight_scale_inv), MXFP4 with E8M0 scales rounded up (transformers'
    MXFP4 quantizer: triton_kernels downcast_to_mxfp, ROUND_UP). Biases keep the dtype the layer holds."""
    from epmoe.quant.weights import quantize_expert_weights

    if weights.is_quantized:
        if weights.format != q.expert_format:
            raise ValueError(
                f"update_weights: expert tensors in format {weights.format} for a model whose checkpoint stores "
                f"{q.expert_format}; pass the trainer's unquantized tensors"
            )
        return weights
    w = replace(weights, **{n: t.contiguous() for n, t in weights.tensors().items()})
    out = quantize_expert_weights(w, q.expert_format, scale_rounding="ceil")
    held = getattr(layer, "_loaded_dtypes", {})
    casts = {n: getattr(out, n).to(held[n]) for n in ("b13", "b2")
             if getattr(out, n) is not None and n in held and getattr(out, n).dtype != held[n]}
    return replace(out, **casts) if casts else out


def _quantize_fp8_linear(model: Any, key: str, value: torch.Tensor, own: Mapping[str, torch.Tensor]
                         ) -> Dict[str, torch.Tensor]:
    """A trainer's unquantized weight of one of transformers' FP8Linear modules -> {weight: e4m3,
    weight_scale_inv: float32} in the module's block size (the checkpoint's recipe, scale amax / 448)."""
    from epmoe.quant import fp8_block

    module_name, _, pname = key.rpartition(".")
    scale_key = f"{module_name}.weight_scale_inv"
    block = getattr(model.get_submodule(module_name), "block_size", None) if module_name else None
    if pname != "weight" or scale_key not in own or block is None:
        raise ValueError(
            f"update_weights: {key} is float8_e4m3fn in the model but has no 128x128 weight_scale_inv beside it; "
            "only FP8 block linears are quantized on the way in"
        )
    q = fp8_block.quantize_weight(value.float(), tuple(block), pad_edges=True)
    return {key: q.data, scale_key: q.scales}


def expert_memory(model: Any) -> ExpertMemory:
    """Routed-expert bytes this rank holds (the tensors of its EPMoE layers' experts backends) and what
    the whole model's experts take in the model dtype."""
    st = _state(model)
    local = sum(t.numel() * t.element_size() for layer in st.layers for t in layer.experts.parameters().values())
    cfg = st.moe_config
    model_bytes = cfg.num_experts * cfg.expert_param_count() * torch.empty(0, dtype=cfg.dtype).element_size()
    return ExpertMemory(local_bytes=local, model_bytes=model_bytes * len(st.layers), num_layers=len(st.layers))
