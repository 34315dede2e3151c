"""The question every backend class answers, and the typed options it takes.

    BackendRequest   frozen record: "could you run this?" (expert mode, layout, wire dtype, arch,
                     FlashInfer version, EP size, installed packages / prebuilt modules)
    BackendOptions   base of each backend's frozen options dataclass: unknown keys are a TypeError
                     naming the valid ones; `fingerprint()` goes into the cross-rank agreement

Dispatcher and experts classes answer `supports(request) -> Availability` (static facts only, no
device probing) and experts classes also `consumes(request) -> wire dtype` (what their kernel takes
natively). `epmoe.resolve` walks the registries asking them; nothing else keeps a table of who runs
what.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, FrozenSet, Mapping, Optional

# Names a request's `packages` may hold. Module names for Python packages; "flashinfer.fused_moe.smXY"
# for a prebuilt (AOT or JIT-cached) FlashInfer fused-MoE module of that arch.
PACKAGE_NAMES = ("flashinfer", "cuda", "pynvml", "deep_ep", "deep_gemm", "triton", "cutlass", "mpi4py")


@dataclass(frozen=True)
class BackendRequest:
    """expert_mode:  one of epmoe.quant.plan.EXPERT_MODES
    layout:          "flat" or "masked" (what the dispatcher delivers)
    wire:            dispatch dtype on the wire: "bf16" (the unquantized model dtype), "nvfp4", "fp8"
    arch:            "cpu", "sm80", "sm90", "sm100", "sm120"
    flashinfer_version: installed FlashInfer version string (None: not installed)
    ep_size:         ranks in the EP group
    packages:        installed optional packages / prebuilt modules (see PACKAGE_NAMES)
    model_dtype:     "bfloat16", "float16", "float32"
    act_format:      what the experts' GEMMs consume ("bf16", "fp8_block", "nvfp4", "fp8", "mxfp8")
    humming / mxfp8_act_scaling: the MXFP4 W4A8 activation path chosen by the plan
    hidden_size / intermediate_size / num_experts / top_k: the layer's shape (kernels with shape
                     limits check it)
    checkpoint:      the checkpoint family ("none" = unquantized, quantized online at load; "fp8",
                     "nvfp4", "mxfp4", "mxfp8"): some kernels need what only a checkpoint carries
    has_bias:        the experts carry biases (b13, b2)
    training:        gradients must flow through the layer (`supports_training` answers; docs/training.md)"""

    expert_mode: str = "bf16"
    layout: str = "flat"
    wire: str = "bf16"
    arch: str = "cpu"
    flashinfer_version: Optional[str] = None
    ep_size: int = 1
    packages: FrozenSet[str] = frozenset()
    model_dtype: str = "bfloat16"
    act_format: str = "bf16"
    humming: bool = False
    mxfp8_act_scaling: bool = False
    hidden_size: int = 7168
    intermediate_size: int = 2048
    num_experts: int = 256
    top_k: int = 8
    checkpoint: str = "none"
    has_bias: bool = False
    training: bool = False

    def has(self, package: str) -> bool:
        return package in self.packages

    @property
    def on_gpu(self) -> bool:
        return self.arch != "cpu"

    def with_(self, **changes) -> "BackendRequest":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BackendOptions:
    """Base of a backend's typed options. Subclasses are frozen dataclasses with defaults.

    `parse(None | mapping | instance)` -> an instance; unknown keys raise TypeError naming the
    valid ones (a typo never falls back silently)."""

    @classmethod
    def parse(cls, given: Any, owner: str = "") -> "BackendOptions":
        if given is None:
            return cls()
        if isinstance(given, cls):
            return given
        if isinstance(given, BackendOptions):
            raise TypeError(f"{owner or cls.__name__} options: got {type(given).__name__}; pass {cls.__name__} or a dict")
        if isinstance(given, tuple):  # legacy: tuple of (name, value) pairs
            given = dict(given)
        if not isinstance(given, Mapping):
            raise TypeError(f"{owner or cls.__name__} options must be a dict or {cls.__name__}, got {type(given).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in given if k not in valid)
        if unknown:
            raise TypeError(
                f"unknown {owner + ' ' if owner else ''}option(s) {unknown}; valid options: {valid or 'none'}"
            )
        return cls(**dict(given))

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)

    def fingerprint(self, prefix: str) -> dict:
        """Every option as a string (objects by type name), compared across ranks at construction."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f"{prefix}.{f.name}"] = repr(v) if isinstance(v, (type(None), bool, int, float, str)) else type(v).__name__
        return out


@dataclass(frozen=True)
class NoOptions(BackendOptions):
    """A backend without options."""
