"""The expert activation of `epmoe.config` in plain torch (any float dtype; no rounding of its own)."""

from __future__ import annotations

from typing import Optional

import torch

from epmoe.config import MoEConfig


def apply_activation(config: MoEConfig, g: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(g) * u | GPT-OSS clamped swiglu g' * sigmoid(alpha g') * (u' + beta) | relu(g)^2."""
    if config.activation == "relu2":
        return torch.relu(g) ** 2
    a, b, lim = config.swiglu_alpha, config.swiglu_beta, config.swiglu_limit
    if a is None and b is None and lim is None:
        return torch.nn.functional.silu(g) * u
    a = 1.0 if a is None else a
    b = 0.0 if b is None else b
    if lim is not None:
        g = g.clamp(max=lim)
        u = u.clamp(-lim, lim)
    return g * torch.sigmoid(a * g) * (u + b)
