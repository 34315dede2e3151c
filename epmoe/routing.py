"""Top-k routing: router logits [T, E] -> `Routing` (topk_ids [T, K] int32, topk_weights [T, K] f32).

The math is in `epmoe.config`'s docstring. Computed in float32 whatever the logits' dtype, so every
rank and the reference agree on the chosen experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from epmoe.config import MoEConfig


@dataclass(frozen=True)
class Routing:
    """topk_ids [T, K] int32 global expert ids (-1: none); topk_weights [T, K] float32."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def route(
    config: MoEConfig,
    router_logits: torch.Tensor,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> Routing:
    """Choose top-k experts per token. router_logits: [T, E], any float dtype."""
    logits = router_logits.float()
    K = config.top_k
    if config.routing == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, K, dim=-1)
        if config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:  # sigmoid_grouped (DeepSeek-V3 noaux_tc)
        scores = torch.sigmoid(logits)
        choice = scores
        if e_score_correction_bias is not None:
            choice = scores + e_score_correction_bias.float().to(scores.device)
        T, E = choice.shape
        n_group, topk_group = config.n_group, config.topk_group
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        masked = torch.where(group_mask.unsqueeze(-1), grouped, float("-inf")).view(T, E)
        ids = masked.topk(K, dim=-1).indices
        weights = scores.gather(1, ids)
        if config.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * config.routed_scaling_factor
    return Routing(topk_ids=ids.to(torch.int32), topk_weights=weights.to(torch.float32))
