"""`ExpertWeights`: the canonical, checkpoint-independent form of a layer's expert tensors.

Canonical layout (what loaders produce and experts backends convert from):
    w1  [E, I, H]  gate_proj          w3  [E, I, H]  up_proj (None for relu2)
    w2  [E, H, I]  down_proj          b13 [E, 2I]    [b_gate; b_up] ([E, I] for relu2)
    b2  [E, H]
`first_expert` is the global id of row 0, so a local slice knows where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from epmoe.config import MoEConfig


@dataclass(frozen=True)
class ExpertWeights:
    w1: torch.Tensor
    w2: torch.Tensor
    w3: Optional[torch.Tensor] = None
    b13: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    first_expert: int = 0

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def w13(self) -> torch.Tensor:
        """[E, 2I, H] = [w1; w3] (gate rows first), or w1 for relu2."""
        if self.w3 is None:
            return self.w1
        return torch.cat([self.w1, self.w3], dim=1)

    def tensors(self) -> dict:
        """Name -> tensor of every per-expert tensor that is present."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def slice_experts(self, start: int, end: int) -> "ExpertWeights":
        """Global experts [start, end) of this (global) container; indices are global ids."""
        lo, hi = start - self.first_expert, end - self.first_expert
        if not (0 <= lo <= hi <= self.num_experts):
            raise ValueError(
                f"experts [{start}, {end}) are outside this container's "
                f"[{self.first_expert}, {self.first_expert + self.num_experts})"
            )
        return replace(
            self,
            **{name: t[lo:hi] for name, t in self.tensors().items()},
            first_expert=start,
        )

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "ExpertWeights":
        def conv(t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and t.is_floating_point():
                return t.to(device=device, dtype=dtype)
            return t.to(device=device)

        return replace(self, **{name: conv(t) for name, t in self.tensors().items()})

    def validate(self, config: MoEConfig, num_experts: Optional[int] = None) -> None:
        """Raise ValueError naming the tensor whose shape does not fit `config`."""
        E = self.num_experts if num_experts is None else num_experts
        H, I = config.hidden_size, config.intermediate_size
        expected = {"w1": (E, I, H), "w2": (E, H, I)}
        if config.is_gated:
            expected["w3"] = (E, I, H)
        if config.has_bias:
            expected["b13"] = (E, config.w13_rows)
            expected["b2"] = (E, H)
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is None:
                raise ValueError(
                    f"expert weights lack {name!r} (expected shape {list(shape)}) for "
                    f"activation={config.activation!r}, has_bias={config.has_bias}"
                )
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"expert weight {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                    f"(E={E}, H={H}, I={I})"
                )
            if not t.is_floating_point():
                raise TypeError(f"expert weight {name!r} has dtype {t.dtype}; expected a float dtype")
        if not config.is_gated and self.w3 is not None:
            raise ValueError("activation='relu2' is non-gated: expert weights must not have 'w3'")
        if not config.has_bias and (self.b13 is not None or self.b2 is not None):
            raise ValueError("expert weights carry biases but the config has has_bias=False")
