"""EPLB in the layer, on real gloo groups (2 and 4 ranks): outputs under any placement against the
float64 reference and bit for bit against R = 0 where the arithmetic is exact, load statistics,
rebalancing mid-run under changing skew (automatic and called), update_weights and checkpoint loading
under the placement in force, decode runners across a rebalance, faults injected during the move, and
every bad input (every rank raises, naming the field; nothing hangs).

Each group runs all its checks in one process per rank (`run_checks`), so the file costs three
process groups."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.cpu.helpers import fresh_seed
from tests.cpu.mp import assert_checks, run_checks, run_group

TOL = 1e-5
GIVEN = {2: (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3), 4: (0, 1, 2, 3, 4, 0, 5, 6, 0, 7, 1, 3)}  # 12 slots, hand-made
SHAPES = {
    "swiglu": dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16),
    "grouped_sigmoid_bias": dict(num_experts=16, top_k=4, hidden_size=32, intermediate_size=16, has_bias=True,
                                 routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "relu2": dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, activation="relu2"),
}


def _cfg(name):
    from epmoe import MoEConfig

    return MoEConfig(dtype=torch.float32, **SHAPES[name])


def _skewed_routing(T, cfg, hot, seed):
    """Replayed routing: K distinct experts per token, `hot` experts drawn far more often."""
    g = torch.Generator().manual_seed(seed)
    p = torch.full((cfg.num_experts,), 1.0)
    p[list(hot)] = 30.0
    ids = torch.multinomial(p.expand(T, -1), cfg.top_k, replacement=False, generator=g).to(torch.int32) \
        if T else torch.empty(0, cfg.top_k, dtype=torch.int32)
    w = torch.rand(T, cfg.top_k, generator=g)
    return ids, w / w.sum(dim=1, keepdim=True).clamp_min(1e-9)


# ----------------------------------------------------------------------------- 4 ranks: behaviour
def _behaviour_worker(rank, world, seed, ckpt_dir):
    from epmoe import EPLBConfig, EPMoE, Placement, reference_moe
    from epmoe.core import dist as edist
    from epmoe.routing import Routing
    from tests.cpu.helpers import max_rel_err, random_correction_bias, random_inputs, random_weights

    def vs_reference(layer, cfg, w, counts, s, corr=None, replay=None):
        x, logits = random_inputs(cfg, counts[rank], s + 101 * rank)
        if replay is None:
            out = layer(x, logits, return_routing=True, return_stats=True)
            ref = reference_moe(cfg, x, w, logits, e_score_correction_bias=corr)
        else:
            ids, wt = replay(counts[rank], s + 101 * rank)
            out = layer(x, topk_ids=ids, topk_weights=wt, return_routing=True, return_stats=True)
            ref = reference_moe(cfg, x, w, routing=Routing(ids, wt))
        err = max_rel_err(out.hidden_states, ref)
        assert err < TOL, f"counts {counts}: max rel err {err:.3g}"
        return out, err

    counts = {2: [21, 0], 4: [13, 0, 5, 21]}[world]  # uneven, one rank idle, 3 rounds of 8

    def placements_match_reference():
        notes = []
        for name, kw in [
            ("swiglu", dict(eplb=EPLBConfig(num_redundant_experts=4))),
            ("swiglu", dict(placement=[7, 6, 5, 4, 3, 2, 1, 0])),  # R = 0, rearranged
            ("swiglu", dict(placement=Placement(8, world, GIVEN[world]))),  # given, R = 4
            ("grouped_sigmoid_bias", dict(eplb=EPLBConfig(num_redundant_experts=4))),
        ]:
            cfg = _cfg(name)
            w = random_weights(cfg, seed)
            corr = random_correction_bias(cfg, seed) if cfg.routing == "sigmoid_grouped" else None
            layer = EPMoE(cfg, max_num_tokens_per_rank=8, **kw)  # rounds: T=21 runs in 3
            layer.load_weights(w, e_score_correction_bias=corr)
            out, err = vs_reference(layer, cfg, w, counts, seed + 1, corr)
            assert out.stats.rounds == 3 and bool((out.routing.topk_ids < cfg.num_experts).all())  # logical ids
            again = layer(*random_inputs(cfg, counts[rank], seed + 1 + 101 * rank)[:1],
                          topk_ids=out.routing.topk_ids, topk_weights=out.routing.topk_weights)
            assert torch.equal(again, out.hidden_states), "replaying the (logical) routing gives other bits"
            notes.append(f"{name} S={layer.placement.num_slots}: {err:.1e}")
        return "; ".join(notes)

    def bit_for_bit_where_exact():
        """relu2, dyadic weights, inputs and routing weights: every product and sum is exact in float32,
        so any placement (any order of the partial sums) gives the bits of R = 0 and of float64."""
        cfg = _cfg("relu2")
        g = torch.Generator().manual_seed(seed)
        dy = lambda *s, k: (torch.randint(-k, k + 1, s, generator=g) / 8.0).float()  # noqa: E731
        w = random_weights(cfg, seed)
        from dataclasses import replace

        w = replace(w, w1=dy(8, 16, 32, k=1), w2=dy(8, 32, 16, k=1))
        outs = []
        for kw in ({}, dict(eplb=EPLBConfig(num_redundant_experts=4)), dict(placement=[7, 6, 5, 4, 3, 2, 1, 0])):
            layer = EPMoE(cfg, max_num_tokens_per_rank=8, **kw)
            layer.load_weights(w)
            x = (torch.randint(-8, 9, (counts[rank], 32), generator=torch.Generator().manual_seed(rank)) / 8.0)
            ids, _ = _skewed_routing(counts[rank], cfg, (0,), seed + rank)
            wt = torch.tensor([[0.5, 0.25]]).expand(counts[rank], 2).contiguous()
            outs.append(layer(x, topk_ids=ids, topk_weights=wt))
            ref = reference_moe(cfg, x, w, routing=Routing(ids, wt)).float()
            assert torch.equal(outs[-1], ref), "not the float64 reference's bits"
        assert all(torch.equal(outs[0], o) for o in outs[1:]), "placements differ from R = 0"
        return "R=0, R=4 and a rearrangement: bitwise equal to each other and to float64"

    def load_statistics():
        cfg = _cfg("swiglu")
        layer = EPMoE(cfg, eplb=EPLBConfig(num_redundant_experts=4, window=2))
        layer.load_weights(random_weights(cfg, seed))
        sent, received = [], []
        for step in range(3):  # the window keeps the last 2
            ids, wt = _skewed_routing(counts[rank], cfg, (0, 5), seed + step * 17 + rank)
            out = layer(torch.randn(counts[rank], 32), topk_ids=ids, topk_weights=wt, return_stats=True)
            sent.append(ids)
            received.append(out.stats.tokens_per_local_expert)
        load = layer.expert_load()
        everyone = edist.all_gather_objects((sent[1:], received[1:]), None, 30)
        ids = torch.cat([i.reshape(-1) for s, _ in everyone for i in s])
        want = torch.bincount(ids[ids >= 0].long(), minlength=cfg.num_experts)
        assert torch.equal(load.per_expert, want), (load.per_expert, want)
        got_slots = torch.cat([sum(r) for _, r in everyone])  # what each slot received, rank-major
        assert torch.equal(load.per_slot, got_slots), (load.per_slot, got_slots)
        assert load.calls == 2 and torch.equal(load.per_rank, got_slots.reshape(world, -1).sum(1))
        assert layer.expert_load(reset=True).calls == 2 and layer.expert_load().calls == 0
        return load.format()

    state = {}

    def rebalance_under_changing_skew():
        cfg = _cfg("swiglu")
        w = random_weights(cfg, seed)
        layer = EPMoE(cfg, eplb=EPLBConfig(num_redundant_experts=4, rebalance_every=3, min_improvement=0.0))
        layer.load_weights(w)
        def hot_on_one_rank(rank_, avoid=()):
            """The two experts of `rank_` with the fewest replicas: a skew the placement does not balance."""
            p = layer.placement
            mine = [e for e in p.local_experts(rank_) if e not in avoid]
            return tuple(sorted(mine, key=lambda e: (len(p.replicas(e)), e))[:2])

        loads, reports = [], []
        for step in range(12):
            if step in (0, 6):  # the skew moves at step 6
                hot = hot_on_one_rank(0) if step == 0 else hot_on_one_rank(world - 1, avoid=hot)
                first_hot = hot if step == 0 else first_hot
            vs_reference(layer, cfg, w, [64 + 3 * r for r in range(world)], seed + 40 + step,
                         replay=lambda n, s, hot=hot: _skewed_routing(n, cfg, hot, s))
            if step in (2, 5, 8, 11):  # the window closes: measure it before the next call rebalances
                loads.append(layer.expert_load())
            if layer.last_rebalance is not None and (not reports or layer.last_rebalance is not reports[-1][1]):
                reports.append((step, layer.last_rebalance))
        assert layer.last_rebalance is not None and layer._balancer.num_rebalances >= 2
        # under the same skew, the placement planned from calls 0-2 balances calls 3-5 (and 9-11 after 6-8)
        ratios = [l.imbalance for l in loads]
        assert ratios[0] > 1.5 and ratios[1] < ratios[0], ratios  # the first skew starts unbalanced
        for before, after in ((ratios[0], ratios[1]), (ratios[2], ratios[3])):
            assert after < 1.5 and (after < before or before < 1.3), ratios
        # the new hot experts are spread: replicated, or (when the rebalance at call 6, planned from the old
        # skew, already moved one of them) on different ranks, where the plan at call 9 rightly keeps them
        p = layer.placement
        homes = [{p.rank_of_slot(s) for s in p.replicas(e)} for e in hot]
        assert min(len(p.replicas(e)) for e in hot) >= 2 or not set.intersection(*homes), \
            (hot, p.describe(), ratios, [(s, r.format()) for s, r in reports])
        # rebalances moved slots; one that finds nothing better skips with the reason, never applies a
        # worse plan (the rebalance at call 6, planned from the old skew, may already have given the new
        # hot experts their replicas: then the one at call 9 has nothing to do)
        moved = [r for _, r in reports if r.moved_slots > 0]
        assert moved and all(r.bytes_moved > 0 and r.seconds > 0 and not r.skipped for r in moved), reports
        assert all(r.skipped or r.moved_slots > 0 for _, r in reports), reports
        r = moved[-1]
        state["layer"], state["cfg"] = layer, cfg
        return (f"hot {first_hot}: imbalance {loads[0].imbalance:.2f} -> {loads[1].imbalance:.2f}, hot {hot}: "
                f"{loads[2].imbalance:.2f} -> {loads[3].imbalance:.2f}; last: {r.format()}")

    def update_weights_after_rebalance():
        if "layer" not in state:
            from tests.cpu.mp import SkipCheck

            raise SkipCheck("it continues on changing_skew's layer, and changing_skew failed")
        layer, cfg = state["layer"], state["cfg"]
        w2 = random_weights(cfg, seed + 5)
        ptrs = {k: v.data_ptr() for k, v in layer.experts.parameters().items()}
        layer.update_weights(w2)  # by logical expert: every replica in the placement in force
        assert {k: v.data_ptr() for k, v in layer.experts.parameters().items()} == ptrs
        _, err = vs_reference(layer, cfg, w2, counts, seed + 90,
                              replay=lambda n, s: _skewed_routing(n, cfg, (0, 7), s))
        layer.update_weights(ckpt_dir)  # a checkpoint by HF names, read under the placement
        _, err2 = vs_reference(layer, cfg, random_weights(cfg, seed + 6), counts, seed + 91)
        return f"every replica updated: {err:.1e}, from a checkpoint {err2:.1e}"

    def load_checkpoint_under_placement():
        cfg = _cfg("swiglu")
        layer = EPMoE(cfg, eplb=EPLBConfig(num_redundant_experts=4))
        layer.load_weights(ckpt_dir)
        _, err = vs_reference(layer, cfg, random_weights(cfg, seed + 6), counts, seed + 92)
        return f"{err:.1e}"

    def decode_runner_across_rebalance():
        cfg = _cfg("swiglu")
        w = random_weights(cfg, seed)
        layer = EPMoE(cfg, eplb=EPLBConfig(num_redundant_experts=4))
        layer.load_weights(w)
        runner = layer.decode_runner(8, cuda_graph=False)
        x, logits = random_inputs(cfg, 5, seed + rank)
        before = runner(x, logits).clone()
        report = layer.rebalance(load=[50, 1, 1, 1, 1, 1, 1, 40], force=True)
        assert report.moved_slots > 0, report
        after = runner(x, logits).clone()
        ref = reference_moe(cfg, x, w, logits)
        assert max(max_rel_err(before, ref), max_rel_err(after, ref)) < TOL
        assert runner.dispatcher is not None and layer.expert_load().calls == 1  # the runner's call counted
        runner.close()
        return f"runner correct before and after moving {report.moved_slots} slots"

    checks = [("placements", placements_match_reference), ("bitwise", bit_for_bit_where_exact),
              ("load_statistics", load_statistics), ("changing_skew", rebalance_under_changing_skew),
              ("update_weights", update_weights_after_rebalance), ("checkpoint", load_checkpoint_under_placement),
              ("decode_runner", decode_runner_across_rebalance)]
    return run_checks(f"eplb ep={world}", checks)


BEHAVIOUR = ["placements", "bitwise", "load_statistics", "changing_skew", "update_weights", "checkpoint",
             "decode_runner"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The swiglu experts (seed + 6 of this run) as a HF-named safetensors checkpoint."""
    from safetensors.torch import save_file

    from epmoe.checkpoint import hf_expert_tensors
    from tests.cpu.helpers import random_weights

    seed = fresh_seed()
    d = tmp_path_factory.mktemp("eplb_ckpt")
    save_file(hf_expert_tensors(_cfg("swiglu"), random_weights(_cfg("swiglu"), seed + 6), "model.layers.0.mlp.", "hf"),
              os.path.join(d, "model.safetensors"))
    return seed, str(d)


@pytest.mark.parametrize("world", [2, 4])
def test_eplb_layer(world, checkpoint):
    seed, d = checkpoint
    assert_checks(run_group(_behaviour_worker, world, seed, d, timeout=240), BEHAVIOUR, seed)


# ----------------------------------------------------------------------------- 2 ranks: faults, bad input
class _Leave(BaseException):
    """Rank 1 leaves the group in the middle of a move (the worker returns, closing its connections)."""


def _fault_worker(rank, world, seed):
    from epmoe import EPLBConfig, EPMoE, reference_moe
    from epmoe.core.errors import ConfigMismatchError, PeerInputError, RebalanceError
    from epmoe.eplb import transfer
    from tests.cpu.helpers import max_rel_err, random_inputs, random_weights

    cfg = _cfg("swiglu")
    w = random_weights(cfg, seed)
    skew = [1, 1, 1, 1, 1, 1, 60, 50]  # experts 6 and 7 are hot: they need replicas on both ranks

    def swapped(layer):
        """The placement in force with the two ranks' slots exchanged: every slot changes, in rounds."""
        s, per = layer.placement.slot_to_expert, layer.placement.slots_per_rank
        return list(s[per:] + s[:per])

    def build(**kw):
        layer = EPMoE(cfg, eplb=EPLBConfig(num_redundant_experts=2, **kw), timeout_s=20)
        layer.load_weights(w)
        return layer

    def still_works(layer):
        x, logits = random_inputs(cfg, 7 + rank, seed + rank)
        assert max_rel_err(layer(x, logits), reference_moe(cfg, x, w, logits)) < TOL

    def same_error_everywhere(fn, *must):
        from epmoe.core import dist as edist

        try:
            fn()
        except RebalanceError as e:
            msg = str(e)
        else:
            raise AssertionError("no RebalanceError")
        everyone = edist.all_gather_objects(msg, None, 30)
        assert len(set(everyone)) == 1, everyone
        assert "\n" not in msg and all(m in msg for m in must), msg
        return msg

    def injected(target, name, when):
        """Replace transfer.<name> on this rank with one that raises `when(call_number)` (an exception)."""
        real, calls = getattr(target, name), [0]

        def fake(*a, **k):
            calls[0] += 1
            exc = when(calls[0])
            if exc is not None:
                raise exc
            return real(*a, **k)
        setattr(target, name, fake)
        return lambda: setattr(target, name, real)

    def oom_while_receiving():
        layer = build()
        before = layer.placement
        params = {k: v.clone() for k, v in layer.experts.parameters().items()}
        restore = injected(transfer, "_unpack_row", lambda n: torch.OutOfMemoryError("CUDA out of memory. Tried "
                                                                                     "to allocate 2 GiB\nmore") if rank == 1 else None)
        try:
            msg = same_error_everywhere(lambda: layer.rebalance(load=skew, force=True),
                                        "rank 1: OutOfMemoryError: CUDA out of memory", "stays valid")
        finally:
            restore()
        assert layer.placement == before
        assert all(torch.equal(v, params[k]) for k, v in layer.experts.parameters().items())
        still_works(layer)
        assert layer.rebalance(load=skew, force=True).moved_slots > 0  # and works once the fault is gone
        still_works(layer)
        return msg

    def fault_while_packing_second_round():
        layer = build()
        row = transfer.slot_bytes(layer.experts.slot_tensors())
        layer._balancer.config = EPLBConfig(num_redundant_experts=2, staging_bytes=row)
        rounds = []
        real_rounds = transfer.schedule_rounds
        transfer.schedule_rounds = lambda *a: rounds.append(real_rounds(*a)) or rounds[-1]
        packed = [0]

        def when(n):
            packed[0] = n
            return RuntimeError("disk on fire") if rank == 0 and n == 3 else None  # round 2: one slot, 2 tensors a round
        restore = injected(transfer, "_pack_row", when)
        try:
            msg = same_error_everywhere(lambda: layer.rebalance(placement=swapped(layer)),
                                        "rank 0: RuntimeError: disk on fire")
        finally:
            restore()
            transfer.schedule_rounds = real_rounds
        assert len(rounds[0]) >= 2, rounds
        still_works(layer)
        return f"{len(rounds[0])} rounds planned; {msg}"

    def plans_differ():
        layer = build()
        load = skew if rank == 0 else list(reversed(skew))
        msg = same_error_everywhere(lambda: layer.rebalance(load=load, force=True), "placement differs between ranks")
        # different kinds of arguments: the recorded load on rank 0, a given load on rank 1 (nothing hangs)
        same_error_everywhere(lambda: layer.rebalance(force=True) if rank == 0 else layer.rebalance(load=skew),
                              "placement differs between ranks")
        same_error_everywhere(lambda: layer.rebalance(load=skew, placement=swapped(layer) if rank == 1 else None),
                              "rank 1: ValueError: pass load= (to plan from) or placement= (to switch to), not both")
        still_works(layer)
        return msg

    def bad_load_on_one_rank():
        layer = build()
        load = skew if rank == 0 else skew[:3] + [float("nan")] + skew[4:]
        msg = same_error_everywhere(lambda: layer.rebalance(load=load), "rank 1: ValueError: expert_load[3]=nan")
        msg2 = same_error_everywhere(lambda: layer.rebalance(load=skew[:5]), "load has shape [5]")
        return f"{msg} | {msg2}"

    def bad_placements():
        layer = build()
        msgs = [same_error_everywhere(lambda: layer.rebalance(placement=[0, 1, 2, 3, 4, 5, 6, 6, 0, 1]),
                                      "Placement.slot_to_expert misses experts [7]"),
                same_error_everywhere(lambda: layer.rebalance(placement=list(range(8))),
                                      "num_slots=8", "this layer has E=8, ep_size=2, num_slots=10"),
                same_error_everywhere(lambda: layer.rebalance(placement=[0, 0, 1, 2, 3, 4, 5, 6, 7, 1]),
                                      "puts expert 0 twice on rank 0")]
        still_works(layer)
        return " | ".join(msgs)

    def staging_too_small():
        layer = build(staging_bytes=64)
        try:
            layer.rebalance(load=skew, force=True)
        except ValueError as e:
            assert "raise EPLBConfig.staging_bytes to at least" in str(e), e
        else:
            raise AssertionError("a staging buffer smaller than one expert was accepted")
        still_works(layer)
        return "refused before anything moved"

    def construction_errors():
        out = []
        cases = [
            (dict(placement=list(range(8)) if rank == 0 else [1, 0] + list(range(2, 8))), ConfigMismatchError,
             "placement differs"),
            (dict(placement=list(range(8)) if rank == 0 else [0] * 8), ConfigMismatchError,
             "Placement.slot_to_expert misses experts"),
            (dict(eplb=EPLBConfig(num_redundant_experts=1)), ValueError,
             "9 slots is not divisible by the EP size 2; choose num_redundant_experts so that E + R is a multiple of 2 (e.g. 2)"),
            (dict(eplb=EPLBConfig(num_redundant_experts=4), placement=list(range(8))), ValueError,
             "placement.num_slots=8 but eplb.num_redundant_experts=4 asks for 12 slots"),
            (dict(placement=tuple(range(8)) + (8, 9)), ValueError, "slot_to_expert[8]=8 is outside [0, 8)"),
            (dict(eplb=EPLBConfig(num_redundant_experts=10)), ValueError, "more than one replica per rank"),
            (dict(eplb={"num_redundant_experts": 2}), TypeError, "pass an epmoe.eplb.EPLBConfig"),
        ]
        for kw, exc, text in cases:
            try:
                EPMoE(cfg, **kw)
            except exc as e:
                assert text in str(e), (kw, str(e))
                out.append(type(e).__name__)
            else:
                raise AssertionError(f"{kw}: no error")
        layer = EPMoE(cfg)
        for call in (layer.rebalance, layer.expert_load):
            try:
                call()
            except ValueError as e:
                assert "eplb=EPLBConfig" in str(e), e
        return ", ".join(out)

    def lost_peer_during_move():
        layer = build()
        row = transfer.slot_bytes(layer.experts.slot_tensors())
        layer._balancer.config = EPLBConfig(num_redundant_experts=2, staging_bytes=row)  # several rounds
        before = layer.placement
        params = {k: v.clone() for k, v in layer.experts.parameters().items()}
        restore = injected(transfer, "run_collective", lambda n: _Leave() if rank == 1 and n == 2 else None)
        t0 = time.monotonic()
        try:
            layer.rebalance(placement=swapped(layer))
        except _Leave:
            return "left"
        except Exception as e:  # noqa: BLE001 - the survivor's error
            from epmoe.core.fault import CollectiveFailure

            assert isinstance(e, CollectiveFailure) and e.report is not None, repr(e)
            assert "rebalance: move" in e.report.format(), e.report.format()
            assert layer.placement == before
            assert all(torch.equal(v, params[k]) for k, v in layer.experts.parameters().items())
            return f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e.report.format().splitlines()[0]}"
        finally:
            restore()
        raise AssertionError("the move finished without its peer")

    checks = [("oom", oom_while_receiving), ("pack_fault", fault_while_packing_second_round),
              ("plans_differ", plans_differ), ("bad_load", bad_load_on_one_rank), ("bad_placements", bad_placements),
              ("staging", staging_too_small), ("construction", construction_errors),
              ("lost_peer", lost_peer_during_move)]
    return run_checks(f"eplb faults rank {rank}", checks)


FAULTS = ["oom", "pack_fault", "plans_differ", "bad_load", "bad_placements", "staging", "construction", "lost_peer"]


def test_eplb_faults_and_bad_input_2_ranks():
    seed = fresh_seed()
    res = run_group(_fault_worker, 2, seed, timeout=180, pg_timeout=60)
    assert_checks(res, FAULTS, seed)
    assert res[1]["lost_peer"][1].startswith("left")
    assert "PeerLostError" in res[0]["lost_peer"][1] or "CollectiveTimeoutError" in res[0]["lost_peer"][1]
