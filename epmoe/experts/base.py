"""The experts contract.

    experts = SomeExperts(spec)                 # spec: ExpertsSpec (config, local expert range, plan, device)
    experts.load_weights(local_weights)         # canonical ExpertWeights of the local experts; converted
                                                #   to the kernel layout; a reload copies in place
    out [N, H] = experts(tokens)                # tokens: DispatchedTokens in `experts.payload_format`

For the "flat" layout the output row n is sum_k topk_weights[n, k] * expert_{topk_ids[n, k]}(x_n) over
the k whose local id is >= 0 (rows with no local expert are 0). For "masked" it is the unweighted
per-slot expert output [E_local, M, H] (weights are applied by the dispatcher's combine).
Never imports `epmoe.dispatch`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch

from epmoe.config import MoEConfig
from epmoe.core.availability import Availability
from epmoe.quant.payload import PayloadFormat
from epmoe.quant.weights import ExpertWeights


@dataclass(frozen=True)
class ExpertsSpec:
    """config: the layer; ep_rank/ep_size: this rank's place; plan: the resolved QuantPlan (or None
    for plain unquantized); options: backend knobs as a tuple of (name, value) pairs."""

    config: MoEConfig
    ep_rank: int
    ep_size: int
    device: torch.device
    plan: Any = None
    deterministic: bool = False
    max_tokens: Optional[int] = None  # most rows one forward receives (workspace sizing)
    options: tuple = ()

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
        return dict(self.options).get(name, default)


class Experts(abc.ABC):
    name: ClassVar[str] = "?"
    accepted_layouts: ClassVar[Tuple[str, ...]] = ("flat",)

    def __init__(self, spec: ExpertsSpec):
        self.spec = spec
        self.config = spec.config

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

    def __call__(self, tokens) -> torch.Tensor:
        return self.forward(tokens)

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Kernel-layout tensors this backend holds (name -> tensor); storage is stable across reloads."""
        return {}

    def check_local_weights(self, weights: ExpertWeights) -> None:
        s = self.spec
        if weights.num_experts != s.num_local_experts or weights.first_expert != s.first_local_expert:
            raise ValueError(
                f"experts backend {self.name!r} on ep_rank {s.ep_rank} owns experts "
                f"[{s.first_local_expert}, {s.first_local_expert + s.num_local_experts}) but got "
                f"[{weights.first_expert}, {weights.first_expert + weights.num_experts})"
            )
        weights.validate(self.config, s.num_local_experts)
