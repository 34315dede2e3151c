"""`EPLBConfig`: how a layer balances its experts over the ranks (`EPMoE(..., eplb=EPLBConfig(...))`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from epmoe.config import MoEConfig

DEFAULT_STAGING_BYTES = 64 * 2 ** 20


@dataclass(frozen=True)
class EPLBConfig:
    """num_redundant_experts: R extra slots (S = E + R, a multiple of the EP size) that hold copies of
                          hot experts; 0 rearranges the experts only (no extra memory)
    rebalance_every:      rebalance automatically every N calls of the layer (forward or decode
                          runner), between two calls; None: only when `layer.rebalance()` is called
    window:               the plan looks at the load of the last `window` calls; None: every call
                          since the last rebalance (or `expert_load(reset=True)`)
    num_nodes:            ranks are grouped into this many nodes (consecutive ranks per node): the
                          hierarchical plan keeps each expert's replicas within one node
    expert_groups:        with num_nodes > 1: experts [g E / G, (g + 1) E / G) go to a node together
                          (DeepSeek-V3's n_group for group-limited routing); None: single experts
    min_improvement:      a planned rebalance moves nothing unless it lowers the predicted largest
                          rank load by at least this fraction (moving weights costs time)
    staging_bytes:        the send and the receive staging buffer of a move each hold at most this
                          many bytes of expert weights per round (at least one expert's)
    """

    num_redundant_experts: int = 0
    rebalance_every: Optional[int] = None
    window: Optional[int] = None
    num_nodes: int = 1
    expert_groups: Optional[int] = None
    min_improvement: float = 0.05
    staging_bytes: int = DEFAULT_STAGING_BYTES

    def __post_init__(self) -> None:
        def whole(name: str, v, lo: int, none_ok: bool = False) -> None:
            if v is None and none_ok:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"EPLBConfig.{name}={v!r}; pass an int >= {lo}" + (" or None" if none_ok else ""))

        whole("num_redundant_experts", self.num_redundant_experts, 0)
        whole("rebalance_every", self.rebalance_every, 1, none_ok=True)
        whole("window", self.window, 1, none_ok=True)
        whole("num_nodes", self.num_nodes, 1)
        whole("expert_groups", self.expert_groups, 1, none_ok=True)
        whole("staging_bytes", self.staging_bytes, 1)
        m = self.min_improvement
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (math.isfinite(m) and 0 <= m < 1):
            raise ValueError(f"EPLBConfig.min_improvement={m!r}; pass a fraction in [0, 1)")

    def fingerprint(self) -> str:
        return repr(self)


def slot_config(config: MoEConfig, num_slots: int) -> MoEConfig:
    """What dispatchers and experts see under a placement of `num_slots` slots: one expert per slot. The
    routing happens before, on the logical experts, so the slot config routes plainly (a grouped
    router's n_group need not divide the slots)."""
    if num_slots == config.num_experts:
        return config
    return config.replace(num_experts=num_slots, routing="softmax", n_group=None, topk_group=None)
