"""`ExpertBalancer`: the placement state of one layer and its live rebalancing.

The layer owns one when it is built with `eplb=` or `placement=`; without them it has none and its
forward is unchanged. Per call:

    slot_ids = balancer.route(topk_ids)   # logical -> slot ids (ReplicaTable), load recorded
    ... dispatch / experts / combine on slot ids ...
    balancer.end_call()

`rebalance` (collective, between two calls), all or nothing:
  1. load: the recorded window summed over the ranks (or the caller's load, or the caller's placement)
  2. plan: `plan_placement(load, previous=placement in force)` on every rank
  3. agree: every rank's error flag, plan digest and stored weight layout, in one small all-gather;
     a failure or a difference raises the same RebalanceError on every rank, nothing changed
  4. move: only changed slots, as stored, in rounds through a bounded staging buffer (`transfer`),
     into new buffers; a rank's failure there is seen by every rank in the same round
  5. agree again, then switch: copy the staged rows into the live weights in place, update the replica
     table in place (captured CUDA graphs keep working), reset the load window
A lost peer during a collective raises the layer's CollectiveFailure with its fault report; the
placement in force was not touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from epmoe.core import dist as edist
from epmoe.core.errors import RebalanceError
from epmoe.core.placement import Placement, text_digest
from epmoe.eplb.config import EPLBConfig
from epmoe.eplb.load import ExpertLoad, LoadRecorder
from epmoe.eplb.planner import plan_placement
from epmoe.eplb.replicas import ReplicaTable
from epmoe.eplb import transfer


@dataclass(frozen=True)
class RebalanceReport:
    """What one rebalance did. moved_slots / bytes_moved: over all ranks (bytes sent between ranks,
    local copies not counted); seconds: this rank's wall time (plan, agreement, move, switch);
    rank_load_before / after: per rank, predicted from `expert_load` (None for a given placement);
    skipped: why nothing moved ("" when it switched)."""

    old: Placement
    new: Placement
    moved_slots: int
    bytes_moved: int
    seconds: float
    rounds: int
    expert_load: Optional[Tuple[float, ...]]
    rank_load_before: Optional[Tuple[float, ...]]
    rank_load_after: Optional[Tuple[float, ...]]
    skipped: str = ""

    @staticmethod
    def _ratio(loads: Optional[Sequence[float]]) -> Optional[float]:
        if not loads or sum(loads) <= 0:
            return None
        return max(loads) * len(loads) / sum(loads)

    @property
    def imbalance_before(self) -> Optional[float]:
        """max / mean rank load under the old placement (from expert_load)."""
        return self._ratio(self.rank_load_before)

    @property
    def imbalance_after(self) -> Optional[float]:
        """max / mean rank load planned for the new placement."""
        return self._ratio(self.rank_load_after)

    def format(self) -> str:
        before, after = self.imbalance_before, self.imbalance_after
        load = f"rank load max/mean {before:.2f} -> {after:.2f} (planned)" if before and after else "given placement"
        if self.skipped:
            return f"kept the placement: {self.skipped}" + (f"; {load}" if before and after else "")
        return (f"{load}; moved {self.moved_slots} slot(s), {self.bytes_moved / 2 ** 20:.2f} MiB between ranks in "
                f"{self.rounds} round(s), {self.seconds * 1e3:.1f} ms")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class ExpertBalancer:
    """The placement in force, its replica table and (with an EPLBConfig) the load recorder."""

    def __init__(self, placement: Placement, config: Optional[EPLBConfig], ep_rank: int, device: torch.device):
        self.placement = placement
        self.config = config
        self.ep_rank = ep_rank
        self.table = ReplicaTable(placement, ep_rank, device)
        self.recorder = LoadRecorder(placement.num_slots, config.window, device) if config is not None else None
        self.calls_since_rebalance = 0
        self.last_report: Optional[RebalanceReport] = None
        self.num_rebalances = 0

    # ------------------------------------------------------------------ per call
    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] logical ids -> [T, K] int32 slot ids; the call's load is recorded (no host sync)."""
        slots = self.table.map(topk_ids)
        if self.recorder is not None:
            self.recorder.record(slots)
        return slots

    def end_call(self) -> None:
        if self.recorder is not None:
            self.recorder.end_call()
        self.calls_since_rebalance += 1

    @property
    def due(self) -> bool:
        """True when the automatic rebalance is due (before the next call)."""
        every = self.config.rebalance_every if self.config is not None else None
        return every is not None and self.calls_since_rebalance >= every

    # ------------------------------------------------------------------ load
    def expert_load(self, group: Any, timeout_s: Optional[float], reset: bool = False) -> ExpertLoad:
        if self.recorder is None:
            raise ValueError("this layer records no load: build it with eplb=EPLBConfig(...) (a given placement "
                             "alone is static)")
        load = self.recorder.collect(self.placement, group, timeout_s)
        if reset:
            self.recorder.reset()
        return load

    # ------------------------------------------------------------------ rebalance
    def rebalance(self, experts: Any, group: Any, watch: Any, name: str, *, load: Any = None,
                  placement: Any = None, force: bool = False) -> RebalanceReport:
        """See the module docstring. `experts`: the layer's experts backend (slot_tensors,
        check_moved_slots, stored_layout); `watch`: the layer's FaultWatch."""
        t0 = time.perf_counter()
        old = self.placement
        cfg = self.config or EPLBConfig(num_redundant_experts=old.num_redundant)
        to = watch.collective_timeout
        measured: Optional[ExpertLoad] = None
        if self.recorder is not None:  # on every rank whatever its arguments: the collectives stay in step
            with watch.phase("rebalance: load"):
                measured = self.recorder.collect(old, group, to)
        error: Optional[BaseException] = None
        new: Optional[Placement] = None
        expert_load: Optional[Tuple[float, ...]] = None
        tensors: Dict[str, torch.Tensor] = {}
        layout = ""
        try:
            if load is not None and placement is not None:
                raise ValueError("pass load= (to plan from) or placement= (to switch to), not both")
            if placement is not None:
                new = _check_given(placement, old)
            else:
                if load is None and measured is None:
                    raise ValueError("this layer records no load (a given placement alone is static): pass load= "
                                     "or placement=, or build it with eplb=EPLBConfig(...)")
                expert_load = tuple(float(v) for v in (measured.per_expert if load is None else
                                                       _check_load(load, old.num_experts)))
                new = plan_placement(expert_load, old.ep_size, old.num_slots, num_nodes=cfg.num_nodes,
                                     expert_groups=cfg.expert_groups, previous=old)
            layout = experts.stored_layout()
            if new != old:
                tensors = experts.slot_tensors()
        except Exception as e:  # noqa: BLE001 - any failure on one rank becomes an error on every rank
            error = e
        with watch.phase("rebalance: agree"):
            flags = edist.gather_ints([0 if error is None else 1, new.digest() if new is not None else 0,
                                       text_digest(layout)], group, to)
            self._raise_if_failed(error, flags[:, 0].tolist(), group, to, name)
        if len(set(flags[:, 1].tolist())) > 1:
            raise RebalanceError(f"{name}: rebalance refused: the placement differs between ranks "
                                 f"({_by_value(flags[:, 1].tolist(), group)}); pass the same load= or placement= on "
                                 "every rank. The placement in force stays valid, no weights changed")
        if len(set(flags[:, 2].tolist())) > 1:
            raise RebalanceError(f"{name}: rebalance refused: the ranks store their expert weights in different "
                                 f"layouts ({_by_value(flags[:, 2].tolist(), group)}), so they cannot move as stored; "
                                 "reload the weights under the new placement instead (load_weights). The placement "
                                 "in force stays valid, no weights changed")
        before = tuple(old.rank_load(expert_load)) if expert_load is not None else None
        after = tuple(new.rank_load(expert_load)) if expert_load is not None else None

        def report(skipped: str = "", moved: int = 0, nbytes: int = 0, rounds: int = 0) -> RebalanceReport:
            r = RebalanceReport(old, new if not skipped else old, moved, nbytes, time.perf_counter() - t0, rounds,
                                expert_load, before, after if not skipped else before, skipped)
            self.last_report = r
            if self.recorder is not None:
                self.recorder.reset()
            self.calls_since_rebalance = 0
            return r

        if new == old:
            return report("the plan equals the placement in force")
        if placement is None and not force and max(before) > 0:
            gain = 1 - max(after) / max(before)
            if gain < cfg.min_improvement:
                return report(f"the plan would lower the busiest rank's load by {100 * gain:.1f} % "
                              f"(< min_improvement {100 * cfg.min_improvement:.0f} %)")
        moves = transfer.schedule_moves(old, new)
        row = transfer.slot_bytes(tensors)
        rounds = transfer.schedule_rounds(moves, old.slots_per_rank, old.ep_size, row, cfg.staging_bytes)
        error = None
        with watch.phase("rebalance: move"):
            staged, error = transfer.fetch_slots(tensors, moves, rounds, old, self.ep_rank, group, to)
            if error is None:
                try:
                    experts.check_moved_slots(staged.rows)
                except Exception as e:  # noqa: BLE001 - agreed below
                    error = e
            flags = edist.gather_ints([0 if error is None else 1], group, to)
            self._raise_if_failed(error, flags[:, 0].tolist(), group, to, name)
        transfer.commit_slots(tensors, staged)
        self.table.update(new)
        self.placement = new
        self.num_rebalances += 1
        nbytes = sum(t[0].numel() * t.element_size() for t in tensors.values())
        return report(moved=len(moves), nbytes=transfer.moved_bytes(moves, old.slots_per_rank, nbytes),
                      rounds=len(rounds))

    @staticmethod
    def _raise_if_failed(error: Optional[BaseException], flags: Sequence[int], group: Any, to, name: str) -> None:
        """Every rank raises the same one-line RebalanceError when any rank failed (collective)."""
        if not any(flags):
            return
        messages = edist.all_gather_objects(None if error is None else _one_line(error), group, to)
        detail = "; ".join(f"rank {edist.global_rank(group, r)}: {m}" for r, m in enumerate(messages) if flags[r])
        raise RebalanceError(f"{name}: rebalance failed ({detail}); the placement in force stays valid, no weights "
                             "changed") from error


def _by_value(values: Sequence[int], group: Any) -> str:
    by: Dict[int, list] = {}
    for r, v in enumerate(values):
        by.setdefault(v, []).append(edist.global_rank(group, r))
    return "; ".join(f"ranks {rs}: digest {v:016x}" for v, rs in by.items())


def _check_given(placement: Any, old: Placement) -> Placement:
    if not isinstance(placement, Placement):
        if isinstance(placement, (str, bytes)) or not isinstance(placement, Sequence):
            raise TypeError(f"placement is a {type(placement).__name__}; pass an epmoe.Placement or its slot_to_expert "
                            "list")
        placement = Placement(old.num_experts, old.ep_size, tuple(placement))
    if (placement.num_experts, placement.ep_size, placement.num_slots) != (old.num_experts, old.ep_size,
                                                                          old.num_slots):
        raise ValueError(
            f"placement has E={placement.num_experts}, ep_size={placement.ep_size}, num_slots={placement.num_slots}; "
            f"this layer has E={old.num_experts}, ep_size={old.ep_size}, num_slots={old.num_slots} (the slot count "
            "is fixed when the layer is built)")
    return placement


def _check_load(load: Any, num_experts: int) -> list:
    if isinstance(load, ExpertLoad):
        return load.per_expert.tolist()
    if isinstance(load, torch.Tensor):
        load = load.detach().cpu().double().reshape(-1).tolist() if load.dim() == 1 else load
    if isinstance(load, torch.Tensor) or len(load) != num_experts:
        shape = list(load.shape) if isinstance(load, torch.Tensor) else [len(load)]
        raise ValueError(f"load has shape {shape}; pass one load per logical expert [{num_experts}]")
    return list(load)
