"""The Placement record and the EPLB planner (pure, one process): every bad input, brute force on small
cases, determinism, keeping experts in their slots, the hierarchical variant."""

from __future__ import annotations

import random

import pytest
import torch

from epmoe.core.placement import Placement
from epmoe.eplb import EPLBConfig, initial_placement, plan_placement
from epmoe.eplb.planner import replicate
from epmoe.eplb.replicas import ReplicaTable
from epmoe.eplb.transfer import schedule_moves, schedule_rounds


# ----------------------------------------------------------------------------- the record
def test_contiguous_is_todays_layout():
    p = Placement.contiguous(8, 4)
    assert p.is_contiguous and p.num_slots == 8 and p.num_redundant == 0 and p.slots_per_rank == 2
    assert [p.local_experts(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert p.replicas(5) == (5,) and p.rank_of_slot(5) == 2
    assert Placement.from_dict(p.to_dict()) == p and p.digest() == Placement.contiguous(8, 4).digest()
    q = Placement(8, 4, (1, 0, 2, 3, 4, 5, 6, 7))
    assert not q.is_contiguous and q.digest() != p.digest() and p.changed_slots(q) == (0, 1)


def test_rank_load_splits_over_replicas():
    p = Placement(4, 2, (0, 1, 2, 0, 3, 1))  # rank 0: 0, 1, 2; rank 1: 0, 3, 1: experts 0 and 1 split in two
    assert p.replica_counts() == (2, 2, 1, 1) and p.replicas(1) == (1, 5)
    assert p.rank_load([10, 6, 4, 2]) == [5 + 3 + 4, 5 + 2 + 3]
    assert p.imbalance([10, 6, 4, 2]) == pytest.approx(12 / 11)
    assert p.imbalance([0, 0, 0, 0]) == 0.0


@pytest.mark.parametrize("args, match", [
    ((8, 4, (0, 1, 2, 3, 4, 5, 6)), r"slot_to_expert has 7 slots for 8 experts"),
    ((8, 4, tuple(range(8)) + (0, 1)), r"10 slots, not divisible by ep_size=4"),
    ((8, 4, (0, 1, 2, 3, 4, 5, 6, 8)), r"slot_to_expert\[7\]=8 is outside \[0, 8\)"),
    ((8, 4, (0, 1, 2, 3, 4, 5, 6, 6)), r"misses experts \[7\]"),
    ((8, 4, (0, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3)), r"puts expert 0 twice on rank 0 \(slots \[0, 1\]\)"),
    ((8, 0, tuple(range(8))), r"Placement.ep_size=0"),
    ((0, 4, ()), r"Placement.num_experts=0"),
    ((4, 2, (0, 1, 2.5, 3)), r"pass a sequence of expert ids"),
    ((4, 2, "0123"), r"pass a sequence of expert ids"),
])
def test_bad_placements_name_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        Placement(*args)


def test_contiguous_needs_divisible_experts():
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        Placement.contiguous(6, 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_redundant_experts=-1), "num_redundant_experts=-1"),
    (dict(rebalance_every=0), "rebalance_every=0"),
    (dict(window=0), "window=0"),
    (dict(num_nodes=0), "num_nodes=0"),
    (dict(min_improvement=1.0), "min_improvement=1.0"),
    (dict(staging_bytes=0), "staging_bytes=0"),
    (dict(num_redundant_experts=True), "num_redundant_experts=True"),
])
def test_bad_eplb_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EPLBConfig(**kwargs)


# ----------------------------------------------------------------------------- planner: bad input
@pytest.mark.parametrize("call, match", [
    (lambda: plan_placement([1, 2, -1, 3], 2), r"expert_load\[2\]=-1.0; loads must be finite and >= 0"),
    (lambda: plan_placement([1, float("nan")], 2), r"expert_load\[1\]=nan"),
    (lambda: plan_placement([], 2), "expert_load is empty"),
    (lambda: plan_placement(torch.ones(2, 2), 2), r"expert_load has shape \[2, 2\]"),
    (lambda: plan_placement([1, 2, 3, 4], 2, 5), "num_slots=5 for 4 experts on 2 ranks"),
    (lambda: plan_placement([1, 2, 3, 4], 2, 10), "num_slots=10 for 4 experts on 2 ranks"),
    (lambda: plan_placement([1, 2, 3, 4], 0), "ep_size=0"),
    (lambda: plan_placement([1, 2, 3, 4], 2, previous=Placement.contiguous(4, 4)), "previous placement has"),
    (lambda: plan_placement([1] * 8, 4, 8, num_nodes=3), "num_nodes=3 does not divide ep_size=4"),
    (lambda: plan_placement([1] * 8, 4, 8, num_nodes=2, expert_groups=3), "expert_groups=3 does not divide"),
    (lambda: plan_placement([1] * 6, 4, 8, num_nodes=4), "6 expert groups do not split evenly"),
    (lambda: plan_placement([1] * 4, 2, tolerance=-1), "tolerance=-1"),
])
def test_planner_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- brute force
def _count_vectors(E, S, cap):
    def rec(i, left):
        if i == E - 1:
            if 1 <= left <= cap:
                yield (left,)
            return
        for c in range(1, min(cap, left - (E - 1 - i)) + 1):
            for rest in rec(i + 1, left - c):
                yield (c,) + rest
    yield from rec(0, S)


def _best_packing(loads, counts, ep, per):
    """The smallest largest rank load over every assignment of the replicas (distinct ranks per expert)."""
    items = sorted(((loads[e] / counts[e], e) for e in range(len(loads)) for _ in range(counts[e])), reverse=True)
    best = [float("inf")]
    load, fill, have = [0.0] * ep, [0] * ep, [set() for _ in range(ep)]

    def rec(i):
        if i == len(items):
            best[0] = min(best[0], max(load))
            return
        w, e = items[i]
        seen = set()
        for r in range(ep):
            key = (load[r], fill[r], frozenset(have[r]))
            if fill[r] < per and e not in have[r] and key not in seen and load[r] + w < best[0]:
                seen.add(key)
                load[r] += w
                fill[r] += 1
                have[r].add(e)
                rec(i + 1)
                load[r] -= w
                fill[r] -= 1
                have[r].discard(e)
    rec(0)
    return best[0]


def _cases(seed, n):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        E, ep = rng.randint(2, 6), rng.choice([2, 3])
        slots = [S for S in range(E, E * ep + 1) if S % ep == 0 and S <= 8]
        if slots:
            out.append(([rng.randint(0, 20) for _ in range(E)], ep, rng.choice(slots)))
    return out


def test_replication_is_optimal_per_replica():
    """Greedy replication minimises the largest load per replica (exhaustive over count vectors)."""
    for loads, ep, S in _cases(3, 60):
        got = max(l / c for l, c in zip(loads, replicate(loads, S, ep)))
        best = min(max(l / c for l, c in zip(loads, cv)) for cv in _count_vectors(len(loads), S, ep))
        assert got == pytest.approx(best), (loads, ep, S)


def test_planner_against_brute_force():
    """With its replication, the packing is optimal in 98 % of small cases (never 5 % worse); against the
    best replication and packing together the planner is within 1.5x (the decoupled replication, as in
    DeepSeek's balancer, can leave a cold expert unsplit on a full rank in tiny lumpy cases)."""
    packed_exact, overall_exact, worst = 0, 0, 1.0
    cases = _cases(1, 80)
    for loads, ep, S in cases:
        p = plan_placement(loads, ep, S)
        got = max(p.rank_load(loads))
        with_counts = _best_packing(loads, list(p.replica_counts()), ep, S // ep)
        best = min(_best_packing(loads, cv, ep, S // ep) for cv in _count_vectors(len(loads), S, ep))
        assert got <= with_counts * 1.05 + 1e-9, (loads, ep, S, got, with_counts)
        assert got <= best * 1.5 + 1e-9, (loads, ep, S, got, best)
        packed_exact += got <= with_counts + 1e-9
        overall_exact += got <= best + 1e-9
        worst = max(worst, got / best if best else 1.0)
    print(f"packing optimal in {packed_exact}/{len(cases)}, overall optimal in {overall_exact}/{len(cases)}, "
          f"worst {worst:.3f}x")
    assert packed_exact >= 0.95 * len(cases)


def test_realistic_sizes_reach_the_mean():
    """Skewed load (u^4, the experts benchmark's router) on 256 experts: within 1 % of the mean rank
    load, with redundant slots or by rearranging alone; never two replicas on one rank."""
    rng = random.Random(0)
    loads = [rng.random() ** 4 * 1000 + 10 for _ in range(256)]
    mean = sum(loads) / 32
    for S in (256, 288, 320):
        p = plan_placement(loads, 32, S)
        assert max(p.rank_load(loads)) <= 1.01 * mean, (S, p.imbalance(loads))
        for r in range(32):
            assert len(set(p.local_experts(r))) == p.slots_per_rank
    assert Placement.contiguous(256, 32).imbalance(loads) > 1.5


def test_same_load_same_placement():
    rng = random.Random(5)
    loads = [rng.random() * 100 for _ in range(64)]
    a = plan_placement(loads, 8, 72)
    assert plan_placement(list(loads), 8, 72) == a
    assert plan_placement(torch.tensor(loads, dtype=torch.float64), 8, 72) == a
    assert plan_placement(loads, 8, 72, previous=a) == a  # nothing to gain: nothing moves


def test_keeps_experts_in_their_slots():
    rng = random.Random(7)
    loads = [rng.random() ** 4 * 1000 for _ in range(128)]
    first = plan_placement(loads, 16, 144)
    nudged = [v * (1.2 if e % 9 == 0 else 1.0) for e, v in enumerate(loads)]
    kept = plan_placement(nudged, 16, 144, previous=first)
    fresh = plan_placement(nudged, 16, 144)
    assert len(first.changed_slots(kept)) < len(first.changed_slots(fresh)) / 2
    assert max(kept.rank_load(nudged)) <= 1.01 * max(fresh.rank_load(nudged)) + 1e-9


def test_rearranging_alone_balances():
    """R = 0: a permutation of the experts, from today's layout."""
    loads = [100, 90, 80, 70] + [1] * 12
    p = plan_placement(loads, 4, 16, previous=Placement.contiguous(16, 4))
    assert p.num_redundant == 0 and sorted(p.slot_to_expert) == list(range(16))
    assert max(Placement.contiguous(16, 4).rank_load(loads)) == 340
    assert max(p.rank_load(loads)) == 103  # the best there is: the hottest expert with three cold ones


def test_hierarchical_keeps_replicas_and_groups_on_one_node():
    rng = random.Random(11)
    loads = [rng.random() ** 3 * 100 for _ in range(32)]
    p = plan_placement(loads, 8, 40, num_nodes=2, expert_groups=4)  # 4 ranks per node, groups of 8 experts
    node = lambda s: s // 20  # noqa: E731 - 20 slots per node
    for e in range(32):
        assert len({node(s) for s in p.replicas(e)}) == 1, f"expert {e} spans nodes"
    for g in range(4):
        assert len({node(p.replicas(e)[0]) for e in range(8 * g, 8 * g + 8)}) == 1, f"group {g} spans nodes"
    q = plan_placement(loads, 8, 40, num_nodes=2, expert_groups=4, previous=p)
    assert q == p


def test_initial_placement():
    assert initial_placement(8, 4, 8) == Placement.contiguous(8, 4)
    p = initial_placement(6, 4, 8)  # E not divisible by ep: redundant slots make it fit
    assert p.num_slots == 8 and sorted(set(p.slot_to_expert)) == list(range(6))


# ----------------------------------------------------------------------------- replicas and moves
def test_replica_choice_prefers_own_rank_then_spreads():
    p = Placement(4, 4, (0, 1, 0, 2, 0, 3, 1, 3))  # expert 0: slots 0, 2, 4 (ranks 0-2); expert 1: slots 1, 6
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3000)]).to(torch.int32)
    ids[::7, 1] = -1
    on_rank3 = ReplicaTable(p, 3, torch.device("cpu")).map(ids)
    slots0 = on_rank3[ids == 0]  # rank 3 holds no expert 0: its tokens spread over slots 0, 2, 4
    share = torch.bincount(slots0.long(), minlength=6)[[0, 2, 4]].double() / slots0.numel()
    assert set(slots0.tolist()) == {0, 2, 4} and bool(((share - 1 / 3).abs() < 0.05).all()), share
    assert set(on_rank3[ids == 1].tolist()) == {6}  # its own replica of expert 1
    assert set(on_rank3[ids == -1].tolist()) == {-1}
    on_rank1 = ReplicaTable(p, 1, torch.device("cpu")).map(ids)
    assert set(on_rank1[ids == 0].tolist()) == {2} and set(on_rank1[ids == 1].tolist()) == {1, 6}
    assert torch.equal(on_rank1, ReplicaTable(p, 1, torch.device("cpu")).map(ids))  # deterministic
    regular = torch.tensor([[1, 2], [0, 3]] * 500, dtype=torch.int32)  # expert 1 on every other row
    half = (ReplicaTable(p, 1, torch.device("cpu")).map(regular)[regular == 1] == 1).double().mean()
    assert 0.45 < float(half) < 0.55, half


def test_moves_and_rounds():
    old = Placement(4, 2, (0, 1, 2, 3))
    new = Placement(4, 2, (0, 2, 1, 3))  # 1 and 2 swap ranks
    moves = schedule_moves(old, new)
    assert [(m.slot, m.expert, m.source) for m in moves] == [(1, 2, 2), (2, 1, 1)]
    assert [len(r) for r in schedule_rounds(moves, 2, 2, 100, 100)] == [2]  # each rank sends one, receives one
    with pytest.raises(ValueError, match="raise EPLBConfig.staging_bytes to at least 100"):
        schedule_rounds(moves, 2, 2, 100, 99)
    old = Placement(4, 2, (0, 1, 2, 3, 0, 1))
    swapped = schedule_moves(old, Placement(4, 2, (1, 0, 2, 3, 0, 1)))  # within rank 0: local copies only
    assert [(m.slot, m.expert, m.source) for m in swapped] == [(0, 1, 1), (1, 0, 0)]
    assert schedule_rounds(swapped, 3, 2, 100, 100) == []
    spread = schedule_moves(Placement(4, 2, (0, 1, 2, 3, 1, 0)), Placement(4, 2, (3, 1, 2, 0, 1, 3)))
    assert [(m.slot, m.source) for m in spread] == [(0, 3), (3, 5), (5, 3)]
