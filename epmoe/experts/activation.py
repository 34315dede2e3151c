"""The expert activation of `epmoe.config` in plain torch (any float dtype; no rounding of its own), and
the same activation as the arguments the Triton kernels take."""

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


def kernel_activation_args(config: MoEConfig) -> tuple:
    """The same activation as the Triton kernels' arguments: (ACT, HAS_LIMIT, alpha, beta, limit), ACT
    as `epmoe.experts.triton.triton_kernels`' ACT_SILU / ACT_SWIGLU_CLAMP / ACT_RELU2."""
    if config.activation == "relu2":
        return 2, False, 1.0, 0.0, 0.0
    a, b, lim = config.swiglu_alpha, config.swiglu_beta, config.swiglu_limit
    if a is None and b is None and lim is None:
        return 0, False, 1.0, 0.0, 0.0
    return (
        1,
        lim is not None,
        1.0 if a is None else float(a),
        0.0 if b is None else float(b),
        0.0 if lim is None else float(lim),
    )
