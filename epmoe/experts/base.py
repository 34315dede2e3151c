"""The experts contract.

    experts = SomeExperts(spec)                 # spec: ExpertsSpec (config, local expert range, plan, device)
    experts.load_weights(local_weights)         # canonical ExpertWeights of the local experts; converted
                                                #   to the kernel layout; a reload copies in place
    out [N, H] = experts(tokens)                # tokens: DispatchedTokens in `experts.payload_format`

For the "flat" layout the output row n is sum_k topk_weights[n, k] * expert_{topk_ids[n, k]}(x_n) over
the k whose local id is >= 0 (rows with no local expert are 0). For "masked" it is the unweighted
per-slot expert output [E_local, M, H] (weights are applied by the dispatcher's combine).

Training (docs/training.md): a backend that trains answers `supports_training(request)` with yes and
implements `train_forward(tokens, params)`: its forward under autograd, computing with `params` (name ->
tensor shaped like `parameters()[name]`: the layer's nn.Parameters, which share the storage of
`parameters()`), differentiable in tokens.hidden, tokens.topk_weights and `params`.
Never imports `epmoe.dispatch`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch

from epmoe.config import MoEConfig
from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.quant.payload import PayloadFormat
from epmoe.quant.weights import ExpertWeights


@dataclass(frozen=True)
class ExpertsSpec:
    """config: the layer; ep_rank/ep_size: this rank's place; plan: the resolved QuantPlan (or None
    for plain unquantized); options: the backend's typed options (`cls.Options`; a tuple of
    (name, value) pairs is accepted and parsed by the backend)."""

    config: MoEConfig
    ep_rank: int
    ep_size: int
    device: torch.device
    plan: Any = None
    deterministic: bool = False
    max_tokens: Optional[int] = None  # most rows one forward receives (workspace sizing)
    options: Any = ()

    @property
    def expert_mode(self) -> str:
        """The plan's expert mode ("bf16" without a plan; option "mode" when a plan has none)."""
        mode = getattr(self.plan, "expert_mode", None) if self.plan is not None else None
        return str(mode) if mode else self.option("mode", "bf16")

    @property
    def num_local_experts(self) -> int:
        return self.config.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def option(self, name: str, default: Any = None) -> Any:
        if isinstance(self.options, BackendOptions):
            return getattr(self.options, name, default)
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class ExpertsOptions(BackendOptions):
    """Options every experts backend takes. mode: the expert mode when spec.plan is None (tests,
    benchmarks building a backend without a plan)."""

    mode: Optional[str] = None


class Experts(abc.ABC):
    """Base class. A subclass is the one place that knows what its kernels run:

    supports(request) -> Availability   static capability (mode, layout, wire, arch, versions,
                                        packages); the resolver asks it, nothing else keeps a table
    consumes(request) -> str            the wire dtype its kernel takes natively ("bf16", "nvfp4",
                                        "fp8"); the resolver moves tokens in it when the dispatcher can
    accepts_wire(request, wire) -> Availability  may tokens arrive in `wire` (dequantized on arrival
                                        when it differs from what the kernel consumes)?
    availability(spec) -> Availability  the live check at construction (device, prebuilt modules)
    supports_training(request) -> Availability  can gradients flow through it (default: no)
    Options                             frozen dataclass of its options (unknown keys: TypeError)
    """

    name: ClassVar[str] = "?"
    accepted_layouts: ClassVar[Tuple[str, ...]] = ("flat",)
    Options: ClassVar[type] = ExpertsOptions
    # True: FC1's output is written to memory in the model dtype and the activation reads it back
    # (DeepGEMM's and torch's grouped GEMMs write bf16); the plan-aware reference (epmoe.reference)
    # rounds it the same way. False: the activation reads FC1's fp32 accumulators (fused epilogues).
    fc1_output_rounded: ClassVar[bool] = False

    def __init__(self, spec: ExpertsSpec):
        self.options = type(self).Options.parse(spec.options, f"experts backend {self.name!r}")
        self.spec = spec
        self.config = spec.config

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        """Can this backend run `request` (static facts only, no device probing)?"""
        if request.layout not in cls.accepted_layouts:
            return Availability.no(f"it takes the {'/'.join(cls.accepted_layouts)} layout, not {request.layout}")
        return Availability.yes()

    @classmethod
    def supports_training(cls, request: BackendRequest) -> Availability:
        """Can this backend compute gradients for `request` (static facts)? Default: no."""
        return Availability.no(f"experts backend {cls.name!r} has no backward (inference kernels only)",
                               "use experts 'reference' (any device) or 'grouped_mm' (sm90 / sm100, bf16)")

    def train_forward(self, tokens, params: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The forward with autograd, computing with `params` (name -> tensor shaped like `parameters()`):
        differentiable in tokens.hidden, tokens.topk_weights and `params`; the same math as `forward`
        (backends that train override it)."""
        raise NotImplementedError(f"experts backend {self.name!r} does not train")

    @classmethod
    def consumes(cls, request: BackendRequest) -> str:
        """The dispatch dtype its kernel consumes natively for `request` (default: unquantized)."""
        return "bf16"

    @classmethod
    def accepts_wire(cls, request: BackendRequest, wire: str) -> Availability:
        """May tokens arrive in `wire`? Unquantized and the consumed format always; bf16 experts take any
        quantized wire (dequantized on arrival: lossy transport asked for explicitly); a quantized
        mode takes its own activation format even when its kernel quantizes BF16 itself (dequantized
        on arrival, quantized again: a round trip the resolver notes and never picks on "auto")."""
        consumed = cls.consumes(request)
        natural = {"fp8_block": "fp8", "nvfp4_w4a4": "nvfp4"}.get(request.expert_mode)
        if wire in ("bf16", consumed, natural) or request.expert_mode == "bf16":
            return Availability.yes()
        return Availability.no(
            f"its {request.expert_mode} kernel consumes {consumed} activations; {wire} tokens would be "
            "quantized for nothing",
            f"use dispatch dtype 'auto' or '{consumed}'",
        )

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        """Can this backend run `spec` here? (bool, reason) like vLLM's is_supported_config."""
        return Availability.yes()

    @property
    def payload_format(self) -> PayloadFormat:
        """The activation encoding this backend prefers to receive (default: unquantized model dtype).
        Dispatchers deliver a QuantizedActivation only when the tokens travelled in exactly this
        format; otherwise they deliver unquantized model-dtype tokens, which every backend must accept
        (and quantize itself if its kernels need to)."""
        return PayloadFormat.unquantized(self.config.dtype)

    @abc.abstractmethod
    def load_weights(self, weights: ExpertWeights) -> None:
        """Take the local experts' canonical weights (first_expert = spec.first_local_expert).

        A reload must copy into the existing tensors (same storage) and must not change anything
        when it raises: validate and convert everything first, then copy."""

    def prepare_weights(self, weights: ExpertWeights) -> Any:
        """Phase 1 of an all-or-nothing (re)load: validate and convert, touching no live tensor.
        The layer agrees on the outcome across ranks before any rank commits."""
        self.check_local_weights(weights)
        return weights

    def commit_weights(self, prepared: Any) -> None:
        """Phase 2: install what prepare_weights returned (in place on a reload)."""
        self.load_weights(prepared)

    @abc.abstractmethod
    def forward(self, tokens) -> torch.Tensor:
        ...

    def __call__(self, tokens, *, alignment=None) -> torch.Tensor:
        """alignment: the `epmoe.experts.triton.align.BlockAlignment` of tokens.topk_ids that the caller computed
        (fused into the routing launch) because `fused_alignment` asked for it; None: none."""
        if alignment is None:
            return self.forward(tokens)
        return self.forward(tokens, alignment=alignment)

    def fused_alignment(self, num_entries: int) -> Optional[int]:
        """block_m of the block alignment (`epmoe.experts.triton.align.align_blocks`) a forward over
        `num_entries` routed (row, slot) entries would compute first, when this backend takes it
        computed by the routing launch instead (forward(tokens, alignment=...)); None (default): it
        takes none for that size."""
        return None

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Kernel-layout tensors this backend holds (name -> tensor); storage is stable across reloads."""
        return {}

    # ------------------------------------------------------------------ moving experts between ranks (EPLB)
    def slot_tensors(self) -> Dict[str, torch.Tensor]:
        """The stored tensors, each as a view [E_local, ...] whose row i is everything local slot i holds
        (quantized data and its scales as stored), for moving experts between ranks as they are. Rows
        past E_local (a padding row) are left out. Raises ValueError naming the tensor when the stored
        form has state shared by the rank's experts (it cannot move by slot)."""
        return rows_per_expert(self.parameters(), self.spec.num_local_experts, self.name)

    def check_moved_slots(self, rows: Dict[int, Dict[str, torch.Tensor]]) -> None:
        """Called before moved rows (local slot -> name -> row, as `slot_tensors`) are installed; raise
        ValueError when this backend cannot run them as they are (default: nothing to check)."""

    def stored_layout(self) -> str:
        """How this rank stores its experts' bytes where that can differ between ranks of one layer (rows
        move between ranks as bytes only when every rank says the same); default: the same everywhere."""
        return ""

    def check_local_weights(self, weights: ExpertWeights) -> None:
        s = self.spec
        if weights.num_experts != s.num_local_experts or weights.first_expert != s.first_local_expert:
            raise ValueError(
                f"experts backend {self.name!r} on ep_rank {s.ep_rank} owns experts "
                f"[{s.first_local_expert}, {s.first_local_expert + s.num_local_experts}) but got "
                f"[{weights.first_expert}, {weights.first_expert + weights.num_experts})"
            )
        weights.validate(self.config, s.num_local_experts)


def rows_per_expert(params: Dict[str, torch.Tensor], num_local_experts: int, backend: str) -> Dict[str, torch.Tensor]:
    """name -> t[:E_local] for tensors with one row per local expert (E_local, or E_local + 1 with a padding
    row); ValueError naming any other tensor (`Experts.slot_tensors`)."""
    E = num_local_experts
    out = {}
    for name, t in params.items():
        if t.dim() == 0 or t.shape[0] not in (E, E + 1):
            raise ValueError(
                f"experts backend {backend!r} stores {name!r} with shape {list(t.shape)}, not one row per local "
                f"expert ({E}); its experts cannot move between ranks as stored: load the weights under the new "
                "placement instead")
        out[name] = t[:E]
    return out
