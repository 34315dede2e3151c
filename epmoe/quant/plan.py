"""`QuantPlan`: the one resolved quantization decision per model, shared by dispatcher, experts
and checks. Resolved once at start-up by `resolve_quant_plan`; immutable afterwards.

(Skeleton from the runtime core: unquantized only. The quant-plan issue fills in every mode.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

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


@dataclass(frozen=True)
class QuantPlan:
    """expert_mode:     how expert weights/activations are quantized ("bf16" = unquantized model dtype)
    dispatch_dtype:  how tokens travel ("bf16" = unquantized model dtype, "nvfp4", "fp8")
    combine_dtype:   how expert outputs travel back
    experts_backend: the experts kernel family (a name in epmoe.experts.EXPERTS)
    dispatcher:      the dispatcher backend (a name in epmoe.dispatch.DISPATCHERS)
    arch:            "cpu", "sm90", "sm100", "sm120", ...
    notes:           human-readable decisions (defaults taken, inert flags)"""

    expert_mode: str = "bf16"
    dispatch_dtype: str = "bf16"
    combine_dtype: str = "bf16"
    experts_backend: str = "reference"
    dispatcher: str = "torch"
    arch: str = "cpu"
    notes: Tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        lines = [
            f"quant plan: experts={self.expert_mode} via {self.experts_backend}, "
            f"dispatch={self.dispatch_dtype} over {self.dispatcher}, combine={self.combine_dtype}, "
            f"arch={self.arch}"
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def fingerprint(self) -> dict:
        return {
            "plan.expert_mode": self.expert_mode,
            "plan.dispatch_dtype": self.dispatch_dtype,
            "plan.combine_dtype": self.combine_dtype,
            "plan.experts_backend": self.experts_backend,
            "plan.dispatcher": self.dispatcher,
        }


def resolve_quant_plan(
    config: MoEConfig,
    *,
    requested_mode: Optional[str] = None,
    dispatch_dtype: str = "auto",
    dispatcher: str = "torch",
    experts_backend: str = "auto",
    arch: str = "cpu",
) -> QuantPlan:
    mode = requested_mode or "bf16"
    if mode not in EXPERT_MODES:
        raise ValueError(f"unknown quant mode {mode!r}; choose one of {EXPERT_MODES}")
    if dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"unknown dispatch dtype {dispatch_dtype!r}; choose one of {DISPATCH_DTYPES}")
    if mode != "bf16" or dispatch_dtype not in ("auto", "bf16"):
        raise ValueError(f"quant mode {mode!r} / dispatch {dispatch_dtype!r} is not implemented yet")
    notes = ()
    if dispatch_dtype == "auto":
        notes += ("dispatch dtype auto -> bf16 (unquantized model dtype)",)
    if experts_backend == "auto":
        experts_backend = "reference"
        notes += ("experts backend auto -> reference",)
    return QuantPlan(
        expert_mode=mode,
        dispatch_dtype="bf16",
        combine_dtype="bf16",
        experts_backend=experts_backend,
        dispatcher=dispatcher,
        arch=arch,
        notes=notes,
    )
