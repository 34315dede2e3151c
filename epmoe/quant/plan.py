"""`QuantPlan`: the one resolved decision per model (expert mode, wire, backends), shared by dispatcher,
experts, workspace sizing and checks. Immutable.

This module holds what is a fact about FORMATS and checkpoints: the expert modes, which modes a
checkpoint family can run as, the default mode per (family, arch), the MXFP4 W4A8 activation options
(`resolve_mode`). Which backend runs which mode is NOT here: each backend class answers that itself
(`supports(request)`), and `epmoe.resolve.resolve_plan` asks them and builds the QuantPlan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch

from epmoe.config import MoEConfig

EXPERT_MODES = (
    "bf16",
    "fp8_block",
    "nvfp4_w4a4",
    "nvfp4_w4a16",
    "mxfp4_w4a16",
    "mxfp4_w4a8",
    "mxfp8",
)
DISPATCH_DTYPES = ("auto", "bf16", "nvfp4", "fp8")
COMBINE_DTYPES = ("bf16",)
ARCHES = ("cpu", "sm80", "sm90", "sm100", "sm120")
HUMMING_MIN_FLASHINFER = "0.6.18"

# Checkpoint `quantization_config.quant_method` -> checkpoint family.
CHECKPOINT_METHODS: Dict[Optional[str], str] = {
    None: "none",
    "none": "none",
    "fp8": "fp8",
    "mxfp4": "mxfp4",
    "modelopt_fp4": "nvfp4",
    "nvfp4": "nvfp4",
    "compressed_tensors_nvfp4": "nvfp4",
    "mxfp8": "mxfp8",
}
# Checkpoint quant methods recognised (config.hf_quant_method) but not runnable, with the reason.
UNSUPPORTED_CHECKPOINT_METHODS: Dict[str, str] = {
    "fp8_per_tensor": "per-tensor / per-channel FP8 (no weight_block_size): no epmoe experts backend runs it; "
                      "fp8_block needs 128x128 weight_scale_inv blocks",
    "modelopt_fp8": "ModelOpt per-tensor FP8: no epmoe experts backend runs it; fp8_block needs 128x128 blocks",
    "compressed_tensors": "compressed-tensors schemes other than NVFP4 (nvfp4-pack-quantized) are not supported",
}
# Modes a checkpoint family can run as ("bf16" = dequantize at load; unquantized checkpoints can be
# quantized online to any mode).
COMPATIBLE_MODES: Dict[str, Tuple[str, ...]] = {
    "none": EXPERT_MODES,
    "fp8": ("fp8_block", "bf16"),
    "mxfp4": ("mxfp4_w4a16", "mxfp4_w4a8", "bf16"),
    "nvfp4": ("nvfp4_w4a4", "nvfp4_w4a16", "bf16"),
    "mxfp8": ("mxfp8", "bf16"),
}
# (checkpoint family, arch) -> default expert mode; arch "*" matches any arch.
DEFAULT_MODES: Dict[Tuple[str, str], Tuple[str, str]] = {
    ("none", "*"): ("bf16", "unquantized checkpoint"),
    ("fp8", "*"): ("fp8_block", "FP8 checkpoint, 128x128 weight blocks assumed (DeepSeek-V3 weight_scale_inv)"),
    ("mxfp4", "*"): ("mxfp4_w4a16", "MXFP4 checkpoint runs W4A16 (BF16 activations) unless an option asks for W4A8"),
    ("nvfp4", "sm100"): ("nvfp4_w4a4", "NVFP4 checkpoint on SM100 runs W4A4 (FP4 tensor cores)"),
    ("nvfp4", "sm120"): ("nvfp4_w4a4", "NVFP4 checkpoint on SM120 runs W4A4 (FP4 tensor cores)"),
    ("nvfp4", "cpu"): ("nvfp4_w4a4", "NVFP4 checkpoint on CPU emulates W4A4 (the checkpoint's intended numerics)"),
    ("nvfp4", "sm90"): ("nvfp4_w4a16", "NVFP4 checkpoint on SM90 runs W4A16: Hopper has no FP4 MMA, FlashInfer has no SM90 NVFP4 W4A4 MoE kernel"),
    ("nvfp4", "sm80"): ("nvfp4_w4a16", "NVFP4 checkpoint on SM80 runs W4A16 (no FP4 MMA)"),
    ("mxfp8", "*"): ("mxfp8", "MXFP8 checkpoint"),
}
# What the experts' GEMMs consume as activations, per mode (mxfp4_w4a8 depends on the option).
_ACT_FORMAT = {
    "bf16": "bf16",
    "fp8_block": "fp8_block",
    "nvfp4_w4a4": "nvfp4",
    "nvfp4_w4a16": "bf16",
    "mxfp4_w4a16": "bf16",
    "mxfp8": "mxfp8",
}
_WEIGHT_FORMAT = {
    "bf16": "bf16",
    "fp8_block": "fp8_block",
    "nvfp4_w4a4": "nvfp4",
    "nvfp4_w4a16": "nvfp4",
    "mxfp4_w4a16": "mxfp4",
    "mxfp4_w4a8": "mxfp4",
    "mxfp8": "mxfp8",
}


@dataclass(frozen=True)
class QuantPlan:
    """expert_mode:      how expert weights/activations are quantized ("bf16" = unquantized model dtype)
    dispatch_dtype:   how tokens travel ("bf16" = unquantized model dtype, "nvfp4", "fp8" = 1x128 blocks)
    combine_dtype:    how expert outputs travel back ("bf16" = model dtype)
    experts_backend:  the experts kernel family (a name in epmoe.experts.EXPERTS)
    dispatcher:       the dispatcher backend (a name in epmoe.dispatch.DISPATCHERS)
    arch:             "cpu", "sm80", "sm90", "sm100", "sm120"
    act_format:       what the experts' GEMMs consume: "bf16", "fp8_block", "nvfp4", "fp8"
                      (per-tensor, Humming), "mxfp8"
    checkpoint_quant: checkpoint family: "none", "fp8", "mxfp4", "nvfp4", "mxfp8"
    humming:          MXFP4 x FP8 Humming path active (FlashInfer `use_wfp4afp8_humming`)
    mxfp8_act_scaling: MXFP4 x MXFP8 activation path active (FlashInfer `use_mxfp8_act_scaling`)
    flashinfer_version: the FlashInfer version the plan was resolved against (None: not installed)
    notes:            human-readable decisions (defaults taken, inert options)
    layout:           "flat" or "masked": what the dispatcher delivers (its class says)
    skipped:          "backend: why" for every candidate the resolver skipped, in priority order
    training:         resolved for training: its dispatcher and experts have a backward (docs/training.md)"""

    expert_mode: str = "bf16"
    dispatch_dtype: str = "bf16"
    combine_dtype: str = "bf16"
    experts_backend: str = "reference"
    dispatcher: str = "torch"
    arch: str = "cpu"
    act_format: str = "bf16"
    checkpoint_quant: str = "none"
    humming: bool = False
    mxfp8_act_scaling: bool = False
    flashinfer_version: Optional[str] = None
    notes: Tuple[str, ...] = field(default_factory=tuple)
    layout: str = "flat"
    skipped: Tuple[str, ...] = field(default_factory=tuple)
    training: bool = False

    @property
    def weight_format(self) -> str:
        """"bf16", "fp8_block", "nvfp4", "mxfp4" or "mxfp8"."""
        return _WEIGHT_FORMAT[self.expert_mode]

    @property
    def is_w4a16(self) -> bool:
        return self.expert_mode in ("nvfp4_w4a16", "mxfp4_w4a16")

    @property
    def dispatch_quantized(self) -> bool:
        return self.dispatch_dtype != "bf16"

    def dispatch_format(self, model_dtype: torch.dtype):
        """The `PayloadFormat` tokens travel in (the model dtype when dispatch is "bf16")."""
        from epmoe.quant.codec import payload_format

        return payload_format(self.dispatch_dtype, model_dtype)

    def describe(self) -> str:
        fi = self.flashinfer_version or "not installed"
        opts = [n for n, on in (("humming", self.humming), ("mxfp8_act_scaling", self.mxfp8_act_scaling)) if on]
        lines = [
            f"quant plan: experts={self.expert_mode} (weights {self.weight_format}, activations "
            f"{self.act_format}) via {self.experts_backend}, dispatch={self.dispatch_dtype} over "
            f"{self.dispatcher} ({self.layout}), combine={self.combine_dtype}, arch={self.arch}, "
            f"checkpoint={self.checkpoint_quant}, flashinfer={fi}"
            + (f", options={'+'.join(opts)}" if opts else "")
        ]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)

    def fingerprint(self) -> dict:
        """Every decision as a string (notes excluded): compared across ranks at construction."""
        return {
            "plan.expert_mode": self.expert_mode,
            "plan.dispatch_dtype": self.dispatch_dtype,
            "plan.combine_dtype": self.combine_dtype,
            "plan.experts_backend": self.experts_backend,
            "plan.dispatcher": self.dispatcher,
            "plan.arch": self.arch,
            "plan.act_format": self.act_format,
            "plan.checkpoint_quant": self.checkpoint_quant,
            "plan.humming": repr(self.humming),
            "plan.mxfp8_act_scaling": repr(self.mxfp8_act_scaling),
            "plan.training": repr(self.training),
            "plan.flashinfer_version": repr(self.flashinfer_version),
            "plan.layout": self.layout,
        }


# ------------------------------------------------------------------ helpers
def detect_arch(device) -> str:
    """"cpu" for a CPU device; "sm80"/"sm90"/"sm100"/"sm120" from a CUDA device's capability."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"cannot derive a quant-plan arch for device {device}; pass arch= explicitly")
    major, minor = torch.cuda.get_device_capability(device)
    by_major = {8: "sm80", 9: "sm90", 10: "sm100", 12: "sm120"}
    if major not in by_major:
        raise ValueError(
            f"GPU compute capability {major}.{minor} has no quant-plan arch; supported majors "
            f"{sorted(by_major)}; pass arch='cpu' to run the reference experts"
        )
    return by_major[major]


_ARCH_FAMILY = {
    "sm80": "sm80", "sm86": "sm80", "sm87": "sm80", "sm89": "sm80",
    "sm90": "sm90", "sm90a": "sm90",
    "sm100": "sm100", "sm100a": "sm100", "sm103": "sm100", "sm103a": "sm100",
    "sm120": "sm120", "sm120a": "sm120", "sm121": "sm120", "sm121a": "sm120",
}


def normalize_arch(arch: str) -> str:
    """"cpu" or an "smXY" string (e.g. f"sm{major}{minor}") -> the plan's arch family
    (sm103 -> sm100, sm121 -> sm120, sm86/sm89 -> sm80); ValueError for unknown ones."""
    if arch in ARCHES:
        return arch
    key = str(arch).lower()
    if key in _ARCH_FAMILY:
        return _ARCH_FAMILY[key]
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHES} (or an smXY string such as 'sm103')")


def installed_flashinfer_version() -> Optional[str]:
    """FlashInfer's version string if the package is installed (metadata only, no import), else None."""
    from importlib import metadata

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _parse_version(v: str, what: str):
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(v))
    except InvalidVersion:
        raise ValueError(f"{what}={v!r} is not a valid version string (e.g. '0.6.18')") from None


def flashinfer_at_least(version: Optional[str], minimum: str) -> bool:
    """PEP 440 comparison (packaging.version): '0.6.18rc1' < '0.6.18' <= '0.6.18.post1'."""
    if version is None:
        return False
    return _parse_version(version, "flashinfer_version") >= _parse_version(minimum, "minimum")


def checkpoint_family(quant_method: Optional[str]) -> str:
    key = None if quant_method is None else str(quant_method).lower()
    if key in UNSUPPORTED_CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint quant_method={quant_method!r} is not supported: {UNSUPPORTED_CHECKPOINT_METHODS[key]}")
    if key not in CHECKPOINT_METHODS:
        known = sorted(k for k in CHECKPOINT_METHODS if k)
        raise ValueError(
            f"checkpoint quant_method={quant_method!r} is not supported; supported: {known} (or none). "
            "Override MoEConfig.quant_method if the checkpoint is one of these under another name"
        )
    return CHECKPOINT_METHODS[key]


def default_mode(family: str, arch: str) -> Tuple[str, str]:
    """(mode, reason) for a checkpoint family on an arch."""
    return DEFAULT_MODES.get((family, arch)) or DEFAULT_MODES[(family, "*")]


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {tuple(choices)}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


# ------------------------------------------------------------------ expert mode (formats only)
@dataclass(frozen=True)
class ModeDecision:
    """The format part of a plan: expert mode and its activation path, from the checkpoint and options.

    arch: the normalized arch family; family: checkpoint family; act_format: what the GEMMs consume;
    notes: defaults taken and inert options."""

    arch: str
    family: str
    mode: str
    requested_mode: Optional[str]
    act_format: str
    humming: bool
    mxfp8_act_scaling: bool
    notes: Tuple[str, ...]


def resolve_mode(
    config: MoEConfig,
    *,
    requested_mode: Optional[str] = None,
    arch: str = "cpu",
    flashinfer_version: Optional[str] = None,
    humming: bool = False,
    mxfp8_act_scaling: bool = False,
) -> ModeDecision:
    """Rules 1-4 of the plan: validate, checkpoint family, expert mode, MXFP4 activation options.
    Raises ValueError / TypeError naming the conflicting settings and the fix."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    mode_req = None if requested_mode in (None, "auto") else requested_mode
    if mode_req is not None:
        _check_choice("quant mode", mode_req, EXPERT_MODES)
    arch_in = arch
    arch = normalize_arch(arch)
    _check_bool("humming", humming)
    _check_bool("mxfp8_act_scaling", mxfp8_act_scaling)
    if flashinfer_version is not None:
        _parse_version(flashinfer_version, "flashinfer_version")
    notes = []
    if arch != arch_in:
        notes.append(f"arch {arch_in} -> {arch} family")

    family = checkpoint_family(config.quant_method)
    if mode_req is None:
        mode, why = default_mode(family, arch)
        notes.append(f"quant mode auto -> {mode} ({why})")
    else:
        mode = mode_req
        if mode not in COMPATIBLE_MODES[family]:
            raise ValueError(
                f"quant mode {mode!r} cannot run a {family} checkpoint (quant_method="
                f"{config.quant_method!r}); choose one of {COMPATIBLE_MODES[family]} or leave the mode "
                "unset for the default"
            )
        if family == "none" and mode != "bf16":
            notes.append(f"unquantized checkpoint quantized online to {mode} at load")
        elif family != "none" and mode == "bf16":
            notes.append(f"{family} checkpoint dequantized to the model dtype at load")

    if humming and mxfp8_act_scaling:
        raise ValueError(
            "humming=True (SM90 MXFP4 x FP8) and mxfp8_act_scaling=True (Blackwell MXFP4 x MXFP8) are "
            "mutually exclusive; enable at most one"
        )
    mxfp4_family = mode in ("mxfp4_w4a16", "mxfp4_w4a8")
    use_humming = False
    use_mxfp8 = False
    act_format = _ACT_FORMAT.get(mode)
    if humming:
        if not mxfp4_family:
            raise ValueError(
                f"humming=True applies to MXFP4 experts (mxfp4_w4a16 / mxfp4_w4a8), but the expert mode is "
                f"{mode!r}; drop humming or use an MXFP4 checkpoint/mode"
            )
        if arch in ("sm100", "sm120"):
            notes.append(
                f"humming=True is inert on {arch}: Humming W4A8 is an SM90 path; {mode} keeps the "
                f"{arch} MXFP4 path (config stays portable)"
            )
        elif arch != "sm90":
            raise ValueError(
                f"humming=True needs an SM90 GPU with FlashInfer >= {HUMMING_MIN_FLASHINFER} "
                f"(use_wfp4afp8_humming); arch={arch!r}. Drop humming on this machine"
            )
        else:
            _require_humming_flashinfer(flashinfer_version)
            if mode_req == "mxfp4_w4a16":
                raise ValueError(
                    "humming=True selects MXFP4 x FP8 (W4A8) but the requested mode is 'mxfp4_w4a16'; "
                    "request 'mxfp4_w4a8' (or leave the mode unset), or drop humming"
                )
            if mode != "mxfp4_w4a8":
                notes.append("humming=True on sm90: mxfp4_w4a16 -> mxfp4_w4a8 (MXFP4 x FP8, FlashInfer Humming)")
            mode, use_humming, act_format = "mxfp4_w4a8", True, "fp8"
    if mxfp8_act_scaling:
        if mode == "mxfp8":
            notes.append("mxfp8_act_scaling=True: mxfp8 experts already take MXFP8 activations")
        elif not mxfp4_family:
            raise ValueError(
                f"mxfp8_act_scaling=True applies to MXFP4 experts (MXFP4 x MXFP8), but the expert mode is "
                f"{mode!r}; drop the option or use an MXFP4 checkpoint/mode"
            )
        elif arch in ("sm90", "sm80"):
            raise ValueError(
                f"mxfp8_act_scaling=True (MXFP4 x MXFP8) needs Blackwell (sm100/sm120), arch={arch!r}; "
                "on sm90 use humming=True (MXFP4 x FP8) or drop the option"
            )
        else:
            if mode_req == "mxfp4_w4a16":
                raise ValueError(
                    "mxfp8_act_scaling=True selects MXFP4 x MXFP8 (W4A8) but the requested mode is "
                    "'mxfp4_w4a16'; request 'mxfp4_w4a8' (or leave the mode unset), or drop the option"
                )
            if mode != "mxfp4_w4a8":
                notes.append(f"mxfp8_act_scaling=True: mxfp4_w4a16 -> mxfp4_w4a8 (MXFP4 x MXFP8) on {arch}")
            mode, use_mxfp8, act_format = "mxfp4_w4a8", True, "mxfp8"
    if mode == "mxfp4_w4a8" and not (use_humming or use_mxfp8):
        # Explicit W4A8 without an option: the arch decides which 8-bit activation path it is.
        if arch == "sm90":
            _require_humming_flashinfer(flashinfer_version)
            use_humming, act_format = True, "fp8"
            notes.append("mxfp4_w4a8 on sm90 is the Humming path: humming -> True")
        else:
            use_mxfp8, act_format = True, "mxfp8"
            notes.append(f"mxfp4_w4a8 on {arch} uses MXFP8 activations: mxfp8_act_scaling -> True")
    return ModeDecision(
        arch=arch, family=family, mode=mode, requested_mode=mode_req, act_format=act_format or "bf16",
        humming=use_humming, mxfp8_act_scaling=use_mxfp8, notes=tuple(notes),
    )


def _require_humming_flashinfer(flashinfer_version: Optional[str]) -> None:
    if flashinfer_version is None:
        raise ValueError(
            f"humming (MXFP4 x FP8 on sm90) needs FlashInfer >= {HUMMING_MIN_FLASHINFER} "
            "(use_wfp4afp8_humming), but FlashInfer is not installed; pip install "
            f"'flashinfer-python>={HUMMING_MIN_FLASHINFER}' or drop humming"
        )
    if not flashinfer_at_least(flashinfer_version, HUMMING_MIN_FLASHINFER):
        raise ValueError(
            f"humming (MXFP4 x FP8 on sm90) needs FlashInfer >= {HUMMING_MIN_FLASHINFER}, found "
            f"{flashinfer_version} (pre-releases such as 0.6.18rc1 are older than 0.6.18); upgrade "
            f"flashinfer-python or drop humming"
        )
