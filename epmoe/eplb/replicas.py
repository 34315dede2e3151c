"""Routing to replicas: each (token, logical expert) choice goes to exactly one physical slot.

    table = ReplicaTable(placement, ep_rank, device)
    slot_ids [T, K] int32 = table.map(topk_ids [T, K])   # logical ids (-1: none) -> global slot ids (-1)

The choice is deterministic and needs no host sync (CUDA-graph capturable): a replica on this rank
(the token's own) when there is one, else the replica picked by a multiplicative hash of (rank, row,
column) of the choice, which spreads a hot expert's tokens evenly over its replicas (also when the
routing has a regular pattern). With tokens spread evenly over the source ranks this gives every
replica load / replicas, the load the planner plans with. The combine is unchanged: a token's output does not depend on which replica computed it.

The tables are fixed-shape device tensors updated in place when the placement changes, so a captured
CUDA graph that maps ids keeps working after a rebalance.
"""

from __future__ import annotations

import torch

from epmoe.core.placement import Placement


class ReplicaTable:
    """Device tables of one rank: slots [E + 1, W] int64 (the replicas of each expert, this rank's
    own first and alone; row E = "no expert" -> -1), count [E + 1] int64; W = min(R + 1, ep)."""

    def __init__(self, placement: Placement, ep_rank: int, device: torch.device):
        self.ep_rank = ep_rank
        self.num_experts = placement.num_experts
        self.width = min(placement.num_redundant + 1, placement.ep_size)
        self.slots = torch.full((self.num_experts + 1, self.width), -1, dtype=torch.int64, device=device)
        self.count = torch.ones(self.num_experts + 1, dtype=torch.int64, device=device)
        self.update(placement)

    def update(self, placement: Placement) -> None:
        """Switch to `placement` (same E and S), in place."""
        if placement.num_experts != self.num_experts:
            raise ValueError(f"placement has E={placement.num_experts}; this table serves E={self.num_experts}")
        slots = torch.full(tuple(self.slots.shape), -1, dtype=torch.int64)
        count = torch.ones(self.num_experts + 1, dtype=torch.int64)
        mine = placement.rank_slots(self.ep_rank)
        for e in range(self.num_experts):
            replicas = placement.replicas(e)
            local = [s for s in replicas if s in mine]
            chosen = local[:1] if local else list(replicas)
            if len(chosen) > self.width:
                raise ValueError(f"expert {e} has {len(chosen)} replicas; this table holds at most {self.width}")
            slots[e, : len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
            count[e] = len(chosen)
        self.slots.copy_(slots)
        self.count.copy_(count)

    def map(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] logical expert ids (-1: none) -> [T, K] int32 global slot ids (-1: none)."""
        e = topk_ids.long()
        e = torch.where(e < 0, torch.full_like(e, self.num_experts), e)
        # a multiplicative hash of (rank, row, column): regular routing patterns (an expert on every
        # other row) still spread over all replicas
        pair = torch.arange(e.numel(), device=e.device).reshape(e.shape) + self.ep_rank * 0x10001
        j = torch.remainder(((pair * 0x9E3779B1) & 0xFFFFFFFF) >> 16, self.count[e])
        return self.slots[e, j].to(torch.int32)
