"""Expert-parallel load balancing (EPLB): redundant experts, placement from measured load, live rebalancing.

    layer = EPMoE(config, eplb=EPLBConfig(num_redundant_experts=8, rebalance_every=1000))
    layer.expert_load()            # ExpertLoad: per slot / logical expert / rank, summed over the ranks
    layer.rebalance()              # plan from the recorded load, move the changed slots, switch (collective)
    plan_placement(load, ep_size=8, num_slots=72)   # the planner alone: a pure function

Modules (imports go one way: layer -> eplb -> core):
    config     EPLBConfig
    planner    plan_placement, initial_placement (pure: load -> Placement)
    replicas   ReplicaTable: (token, logical expert) -> one physical slot, on the device, no host sync
    load       LoadRecorder, ExpertLoad (per-slot counts over a window, summed over the ranks)
    transfer   moving changed slots between ranks as stored, in bounded rounds
    balancer   ExpertBalancer (a layer's placement state, rebalance), RebalanceReport
The `Placement` record itself is a core type (`epmoe.core.placement`). docs/eplb.md explains it all.
"""

from epmoe.core.errors import RebalanceError
from epmoe.core.placement import Placement
from epmoe.eplb.balancer import ExpertBalancer, RebalanceReport
from epmoe.eplb.config import EPLBConfig
from epmoe.eplb.load import ExpertLoad
from epmoe.eplb.planner import initial_placement, plan_placement

__all__ = [
    "EPLBConfig",
    "ExpertBalancer",
    "ExpertLoad",
    "Placement",
    "RebalanceError",
    "RebalanceReport",
    "initial_placement",
    "plan_placement",
]
