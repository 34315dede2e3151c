"""Load statistics: tokens routed to each physical slot, over a window of calls, summed over the ranks.

    recorder.record(slot_ids)      # [T, K] global slot ids (-1: none), on the device, no host sync
    recorder.end_call()            # host bookkeeping of the window (two small device ops with a window)
    load = recorder.collect(placement, group)   # ExpertLoad, all ranks' counts summed (collective)

Each rank counts what it sends (every routed (token, expert) pair once, at its source), so the sum
over the ranks is what every slot received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from epmoe.core import dist as edist
from epmoe.core.placement import Placement


@dataclass(frozen=True)
class ExpertLoad:
    """The measured load of one layer over `calls` calls, all ranks: per_slot [S] int64 (CPU) routed
    (token, expert) pairs each physical slot received under `placement`."""

    placement: Placement
    per_slot: torch.Tensor
    calls: int

    @property
    def per_expert(self) -> torch.Tensor:
        """[E] int64: pairs routed to each logical expert (summed over its replicas): the planner's input."""
        out = torch.zeros(self.placement.num_experts, dtype=torch.int64)
        out.index_add_(0, torch.tensor(self.placement.slot_to_expert, dtype=torch.int64), self.per_slot)
        return out

    @property
    def per_rank(self) -> torch.Tensor:
        """[ep] int64: pairs each rank's experts computed."""
        return self.per_slot.reshape(self.placement.ep_size, -1).sum(dim=1)

    @property
    def imbalance(self) -> float:
        """max / mean of the rank loads (1.0: balanced; 0.0: no tokens). The slowest rank sets the pace."""
        r = self.per_rank.double()
        return float(r.max() / r.mean()) if float(r.sum()) > 0 else 0.0

    def format(self) -> str:
        return (f"rank load max/mean {self.imbalance:.2f} over {self.calls} calls "
                f"({int(self.per_slot.sum())} routed pairs; per rank {self.per_rank.tolist()})")


class LoadRecorder:
    """Counts per slot on the device. window None: since the last reset; else the last `window`
    calls (a ring of per-call rows, a row written per call)."""

    def __init__(self, num_slots: int, window: Optional[int], device: torch.device):
        self.num_slots = num_slots
        self.window = window
        self.current = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)  # index S: "no expert"
        self.ring = torch.zeros(window, num_slots, dtype=torch.int64, device=device) if window else None
        self.calls = 0  # calls in the window (at most `window`)
        self._pos = 0

    def record(self, slot_ids: torch.Tensor) -> None:
        """Add one call's [T, K] global slot ids (-1: none). Fixed shapes, no sync: capturable."""
        ids = slot_ids.reshape(-1).long()
        ids = torch.where(ids < 0, torch.full_like(ids, self.num_slots), ids)
        self.current.index_add_(0, ids, torch.ones_like(ids))

    def end_call(self) -> None:
        if self.ring is not None:
            self.ring[self._pos].copy_(self.current[: self.num_slots])
            self.current.zero_()
            self._pos = (self._pos + 1) % self.window
        self.calls = min(self.calls + 1, self.window or self.calls + 1)

    def local_counts(self) -> torch.Tensor:
        """[S] int64 on the device: this rank's counts over the window."""
        if self.ring is None:
            return self.current[: self.num_slots]
        return self.ring.sum(dim=0)

    def reset(self) -> None:
        self.current.zero_()
        if self.ring is not None:
            self.ring.zero_()
        self.calls = 0
        self._pos = 0

    def collect(self, placement: Placement, group: Any, timeout_s: Optional[float]) -> ExpertLoad:
        """Every rank's counts summed (collective; exact integers, so every rank holds the same)."""
        local = self.local_counts().cpu()
        summed = edist.gather_ints(local.tolist(), group, timeout_s).sum(dim=0)
        return ExpertLoad(placement=placement, per_slot=summed, calls=self.calls)
