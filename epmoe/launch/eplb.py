"""The launcher's expert-parallel load balancing: `--redundant-experts R --rebalance-every N`.

    add_flags(parser)                 the flags
    flag_error(args)                  a usage problem of these flags, or None
    eplb_config(args, num_nodes)      EPLBConfig for EPMoE(eplb=...), None without EPLB
    num_slots(cfg, args)              E + R
    slot_config(cfg, args)            the config the backends see (one expert per slot)
    routing_bias(args, E, layer, step)  --routing skewed: the per-expert logit bias of a step (or None)
    plan_lines(cfg, args, ep)         what --plan prints about the placement
    move_memory_line(...)             what --plan prints about a rebalance's memory
    LoadTracker                       per-rank load before the first rebalance and after the last; the
                                      rebalance lines and summary rows rank 0 prints
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Tuple

import torch

from epmoe.config import MoEConfig
from epmoe.eplb import EPLBConfig, initial_placement
from epmoe.eplb.config import slot_config as eplb_slot_config


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                   help="EPLB: R extra expert slots holding copies of hot experts (E + R must be a multiple of the EP "
                        "size); 0 with --rebalance-every rearranges the experts only")
    p.add_argument("--rebalance-every", type=int, default=None, metavar="N",
                   help="EPLB: every N steps, plan a placement from the load of the last N steps and move the experts "
                        "that change place (between two steps, all ranks at once); default: never")
    p.add_argument("--routing", default="gate", choices=("gate", "skewed"),
                   help="gate: the router's own logits (a synthetic router spreads tokens about evenly); skewed: "
                        "plus a per-expert logit bias (a Zipf skew over a random order of the experts, which "
                        "changes once, at the middle step), so a few experts take most tokens and EPLB has work "
                        "to do; --check compares the biased routing too")


def enabled(args: argparse.Namespace) -> bool:
    return bool(args.redundant_experts) or args.rebalance_every is not None


def flag_error(args: argparse.Namespace) -> Optional[str]:
    if args.redundant_experts < 0:
        return f"--redundant-experts {args.redundant_experts}: must be >= 0"
    if args.rebalance_every is not None and args.rebalance_every < 1:
        return f"--rebalance-every {args.rebalance_every}: must be >= 1 (steps)"
    return None


SKEW = 1.5  # --routing skewed: logit bias -SKEW * ln(1 + r) for the expert of rank r in the heat order


def routing_bias(args: argparse.Namespace, num_experts: int, layer_idx: int, step: int) -> Optional[torch.Tensor]:
    """--routing skewed: float32 [E] added to the router logits of `layer_idx` at `step` (the same on every
    rank): -1.5 * ln(1 + r) for the expert of rank r in a random order of the experts (seeded by --seed and
    the layer), so with top-k routing the first few experts take most tokens; the order is drawn again
    from the middle step on (total steps // 2), so a rebalance planned from the first half meets a new
    skew. None for --routing gate."""
    if args.routing != "skewed":
        return None
    half = int(step >= (args.warmup + args.steps) // 2)
    g = torch.Generator().manual_seed(args.seed * 1009 + layer_idx * 31 + half * 7 + 1)
    order = torch.randperm(num_experts, generator=g)
    bias = torch.empty(num_experts)
    bias[order] = -SKEW * torch.log1p(torch.arange(num_experts, dtype=torch.float32))
    return bias


def num_slots(cfg: MoEConfig, args: argparse.Namespace) -> int:
    return cfg.num_experts + args.redundant_experts


def slot_config(cfg: MoEConfig, args: argparse.Namespace) -> MoEConfig:
    """The config the backends see (one expert per slot)."""
    return eplb_slot_config(cfg, num_slots(cfg, args)) if enabled(args) else cfg


def slot_error(cfg: MoEConfig, ep: int, args: argparse.Namespace) -> Optional[str]:
    """With EPLB the slots, not the experts, must split evenly over the ranks."""
    S, E, R = num_slots(cfg, args), cfg.num_experts, args.redundant_experts
    if S % ep:
        fits = [r for r in range(R, R + 2 * ep) if (E + r) % ep == 0][:2]
        return (f"--redundant-experts {R}: {E} experts + {R} = {S} slots do not split over {ep} ranks; pass "
                f"--redundant-experts {' or '.join(map(str, fits))}")
    if S > E * ep:
        return f"--redundant-experts {R}: more than one copy of an expert per rank; pass at most {E * ep - E}"
    return None


def nodes_for(cfg: MoEConfig, ep: int, node_of_rank: List[Any], args: argparse.Namespace) -> int:
    """Nodes for the hierarchical plan: the distinct nodes when every node holds consecutive ranks and the
    experts and slots split over them; else 1 (the flat plan, which also works across nodes)."""
    order = []
    for n in node_of_rank:
        if not order or order[-1] != n:
            order.append(n)
    nodes = len(order)
    if nodes <= 1 or len(set(order)) != nodes or ep % nodes or cfg.num_experts % nodes or \
            num_slots(cfg, args) % nodes:
        return 1
    return nodes


def eplb_config(args: argparse.Namespace, num_nodes: int = 1) -> Optional[EPLBConfig]:
    if not enabled(args):
        return None
    return EPLBConfig(num_redundant_experts=args.redundant_experts, rebalance_every=args.rebalance_every,
                      num_nodes=num_nodes)


def plan_lines(cfg: MoEConfig, args: argparse.Namespace, ep: int) -> List[str]:
    """The placement --plan prints: contiguous ranges, or the EPLB slots before any load is measured."""
    if not enabled(args):
        per = cfg.num_experts // ep
        return [f"placement: ep={ep}, {per} experts per rank (contiguous)"] + \
            [f"  rank {r}: experts [{r * per}, {(r + 1) * per})" for r in range(ep)]
    S = num_slots(cfg, args)
    p = initial_placement(cfg.num_experts, ep, S)
    when = f"every {args.rebalance_every} steps" if args.rebalance_every else "never (static)"
    lines = [f"placement: ep={ep}, EPLB with {args.redundant_experts} redundant experts: {S} slots, {S // ep} per rank "
             f"(* = replicated); rebalanced {when}; before any load is measured:"]
    return lines + ["  " + line for line in p.describe().splitlines()]


def move_memory_line(args: argparse.Namespace, expert_weight_bytes: int, num_local_slots: int) -> Optional[str]:
    """What a rebalance holds on top of the weights, per rank, at most (None without rebalancing)."""
    if args.rebalance_every is None:
        return None
    from epmoe.eplb.config import DEFAULT_STAGING_BYTES

    staging = 2 * max(DEFAULT_STAGING_BYTES, expert_weight_bytes)
    layer = expert_weight_bytes * num_local_slots
    return (f"  a rebalance    : at most {(staging + layer) / 2 ** 20:.1f} MiB more while it runs (send and "
            f"receive staging {staging / 2 ** 20:.1f} MiB + the new rows of one layer's changed slots, at most "
            f"{layer / 2 ** 20:.1f} MiB)")


class LoadTracker:
    """Rank load (routed pairs this rank's experts computed, all layers) per step, the steps at which a
    layer's placement changed, and the rebalance lines rank 0 prints."""

    def __init__(self, num_layers: int):
        self.load: List[int] = []
        self.switches: List[int] = []  # steps at whose start a rebalance moved experts
        self._seen = [None] * num_layers
        self._this_step = 0

    def record(self, step: int, layer_idx: int, layer, stats) -> Optional[str]:
        """After layer `layer_idx`'s call at `step`: its load; a line to print when it rebalanced."""
        if len(self.load) <= step:
            self.load.append(0)
        self.load[step] += int(stats.tokens_per_local_expert.sum())
        report = layer.last_rebalance
        if report is None or report is self._seen[layer_idx]:
            return None
        self._seen[layer_idx] = report
        if not report.skipped and (not self.switches or self.switches[-1] != step):
            self.switches.append(step)
        return f"eplb: layer {layer_idx} before step {step}: {report.format()}"

    def summary(self, per_rank_load: List[List[int]], routing: str = "gate"
                ) -> Tuple[List[Tuple[str, str]], Dict[str, Any]]:
        """Rows for the summary table and the JSON section, from every rank's per-step load."""
        steps = min(len(x) for x in per_rank_load) if per_rank_load else 0

        def ratio(lo: int, hi: int) -> Optional[float]:
            loads = [sum(x[lo:hi]) for x in per_rank_load]
            return max(loads) * len(loads) / sum(loads) if sum(loads) > 0 else None

        first = self.switches[0] if self.switches else steps
        last = self.switches[-1] if self.switches else 0
        before, after = ratio(0, first), ratio(last, steps) if self.switches else None
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        if self.switches:
            text = (f"max/mean {fmt(before)} before the first rebalance (steps 0-{first - 1}), {fmt(after)} after "
                    f"the last (steps {last}-{steps - 1}); {len(self.switches)} rebalance(s) moved experts")
        else:
            text = f"max/mean {fmt(before)} over steps 0-{steps - 1}; no rebalance moved experts"
            if routing == "gate":
                text += " (the router spreads tokens about evenly; --routing skewed gives EPLB work)"
        return [("rank load", text)], {"rank_load_before": before, "rank_load_after": after,
                                       "rebalance_steps": list(self.switches)}
