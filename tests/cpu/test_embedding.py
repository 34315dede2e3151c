"""Embedding into trainers / RL rollouts: subgroups, several layers, in-place weight updates,
determinism, routing capture and replay, fault reports (real gloo groups)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from epmoe import EPMoE, MoEConfig, reference_moe, route
from epmoe.core.errors import PeerInputError
from epmoe.core.fault import CollectiveFailure
from tests.cpu.helpers import fresh_seed, max_rel_err, random_correction_bias, random_inputs, random_weights
from tests.cpu.mp import run_group

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype=torch.float32, has_bias=True)
CFG_DS = MoEConfig(num_experts=8, top_k=3, hidden_size=24, intermediate_size=8, dtype=torch.float32,
                   routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.0)


def _subgroup_worker(rank, world, seed):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    gid = rank // 2
    group = groups[gid]
    # two layers of different shapes on the same subgroup, built in the same order everywhere
    layer_a = EPMoE(CFG, group=group)
    layer_b = EPMoE(CFG_DS, group=group)
    wa, wb = random_weights(CFG, seed + gid), random_weights(CFG_DS, seed + 10 + gid)
    corr = random_correction_bias(CFG_DS, seed + gid)
    layer_a.load_weights(wa)
    layer_b.load_weights(wb, e_score_correction_bias=corr)
    # a third layer shares layer_a's dispatcher (a model's layers share one workspace)
    layer_c = EPMoE(CFG, group=group, dispatcher=layer_a.dispatcher)
    layer_c.load_weights(random_weights(CFG, seed + 20 + gid))
    assert layer_c.dispatcher is layer_a.dispatcher
    assert (layer_a.ep_rank, layer_a.ep_size) == (rank % 2, 2)
    xa, la = random_inputs(CFG, 5 + rank, seed + rank)
    xb, lb = random_inputs(CFG_DS, 3 * rank, seed + 100 + rank)
    return gid, xa, la, layer_a(xa, la), layer_c(xa, la), xb, lb, layer_b(xb, lb)


def test_subgroups_and_several_layers_per_process():
    seed = fresh_seed()
    for gid, xa, la, ya, yc, xb, lb, yb in run_group(_subgroup_worker, 4, seed):
        assert max_rel_err(ya, reference_moe(CFG, xa, random_weights(CFG, seed + gid), la)) < 1e-5
        assert max_rel_err(yc, reference_moe(CFG, xa, random_weights(CFG, seed + 20 + gid), la)) < 1e-5
        ref_b = reference_moe(CFG_DS, xb, random_weights(CFG_DS, seed + 10 + gid), lb,
                              e_score_correction_bias=random_correction_bias(CFG_DS, seed + gid))
        assert max_rel_err(yb, ref_b) < 1e-5


def test_shared_dispatcher_must_fit():
    layer = EPMoE(CFG)
    other = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="hidden_size 32 != 64"):
        EPMoE(other, dispatcher=layer.dispatcher)
    with pytest.raises(ValueError, match="max_tokens_per_rank 4096 < 8192"):
        EPMoE(CFG, dispatcher=layer.dispatcher, max_num_tokens_per_rank=8192)


def _update_worker(rank, world, seed):
    layer = EPMoE(CFG, deterministic=True)
    w_old, w_new = random_weights(CFG, seed), random_weights(CFG, seed + 1)
    layer.load_weights(w_old)
    ptrs = {k: v.data_ptr() for k, v in layer.experts.parameters().items()}
    x, logits = random_inputs(CFG, 9 + rank, seed + rank)
    y_old = layer(x, logits)
    errors = []
    bad_cases = {
        "shape": {"w1": w_new.w1, "w3": w_new.w3, "w2": w_new.w2[:, :, :8], "b13": w_new.b13, "b2": w_new.b2},
        "missing": {k: v for k, v in {"w1": w_new.w1, "w3": w_new.w3, "b13": w_new.b13, "b2": w_new.b2}.items()},
        "dtype": {"w1": w_new.w1.double(), "w3": w_new.w3.double(), "w2": w_new.w2.double(),
                  "b13": w_new.b13.double(), "b2": w_new.b2.double()},
    }
    for case, bad in bad_cases.items():
        # only rank 1 gets the bad update: every rank must refuse, and nobody's weights change
        try:
            layer.update_weights(bad if rank == 1 else w_new)
        except (ValueError, TypeError) as e:
            errors.append((case, type(e).__name__, isinstance(e, PeerInputError), str(e)))
        assert torch.equal(layer(x, logits), y_old), f"bad update ({case}) changed the weights"
    layer.update_weights(w_new)
    assert {k: v.data_ptr() for k, v in layer.experts.parameters().items()} == ptrs, "update was not in place"
    fresh = EPMoE(CFG, deterministic=True)
    fresh.load_weights(w_new)
    y_new, y_fresh = layer(x, logits), fresh(x, logits)
    # determinism: 3 runs and 2 reloads of the same weights give identical bits
    runs = [layer(x, logits) for _ in range(3)]
    layer.update_weights(w_new)
    runs.append(layer(x, logits))
    layer.load_weights(w_new)
    runs.append(layer(x, logits))
    return errors, x, logits, y_new, y_fresh, runs


def test_update_weights_in_place_atomic_and_deterministic():
    seed = fresh_seed()
    results = run_group(_update_worker, 2, seed)
    w_new = random_weights(CFG, seed + 1)
    for rank, (errors, x, logits, y_new, y_fresh, runs) in enumerate(results):
        assert [e[0] for e in errors] == ["shape", "missing", "dtype"], errors
        for case, kind, is_peer, msg in errors:
            if rank == 1:
                assert not is_peer, (case, msg)
                needle = {"shape": "'w2' has shape", "missing": "lack 'w2'", "dtype": "other dtypes"}[case]
                assert needle in msg and ("rebuild" in msg or "build a new EPMoE" in msg or "lack" in msg), msg
            else:
                assert is_peer and "rank 1" in msg, msg
        assert torch.equal(y_new, y_fresh), "updated layer differs from a fresh layer with the same weights"
        assert max_rel_err(y_new, reference_moe(CFG, x, w_new, logits)) < 1e-5
        assert all(torch.equal(runs[0], r) for r in runs[1:]), "outputs are not bitwise reproducible"


def _replay_worker(rank, world, seed):
    layer = EPMoE(CFG_DS)
    layer.load_weights(random_weights(CFG_DS, seed), e_score_correction_bias=random_correction_bias(CFG_DS, seed))
    x, logits = random_inputs(CFG_DS, 7 + 5 * rank, seed + rank)
    captured = layer(x, logits, return_routing=True)
    expect = route(CFG_DS, logits, random_correction_bias(CFG_DS, seed))
    assert torch.equal(captured.routing.topk_ids, expect.topk_ids)
    assert torch.equal(captured.routing.topk_weights, expect.topk_weights)
    replayed = layer(x, topk_ids=captured.routing.topk_ids, topk_weights=captured.routing.topk_weights)
    assert torch.equal(replayed, captured.hidden_states), "replaying the captured routing changed the output"
    return True


def test_routing_capture_and_replay_bitwise():
    assert all(run_group(_replay_worker, 2, fresh_seed()))


def _fault_worker(rank, world, mode):
    layer = EPMoE(CFG, timeout_s=2.0)
    layer.load_weights(random_weights(CFG, 0))
    x, logits = random_inputs(CFG, 6, rank)
    layer(x, logits)  # call 1 is fine everywhere
    if rank == 1:
        if mode == "raise":
            def broken(tokens):
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            layer.experts.forward = broken
        else:  # "hang": rank 1 never comes back to the layer
            time.sleep(8)
            return "slept"
    t0 = time.monotonic()
    try:
        layer(x, logits)
    except CollectiveFailure as e:
        return (type(e).__name__, time.monotonic() - t0, e.report.waiting_on, str(e))
    except RuntimeError as e:
        return ("raised", time.monotonic() - t0, None, str(e))
    return ("no error", time.monotonic() - t0, None, "")


def test_failing_rank_ends_job_with_one_report_within_timeout():
    r0, r1 = run_group(_fault_worker, 2, "raise", timeout=60)
    assert r1[0] == "raised" and "injected" in r1[3]
    kind, elapsed, waiting_on, text = r0
    # the peer's exit closes its connections: rank 0 learns at once (or at the latest at the timeout)
    assert kind in ("PeerLostError", "CollectiveTimeoutError") and elapsed < 2.0 + 6.0, r0
    assert waiting_on == [1], text
    assert "call 2" in text and "rank 1: failed in call 2, phase 'experts'" in text and "injected" in text, text


def test_missing_rank_is_reported_as_no_report():
    r0, r1 = run_group(_fault_worker, 2, "hang", timeout=60)
    assert r1 == "slept"
    kind, elapsed, waiting_on, text = r0
    assert kind == "CollectiveTimeoutError" and 2.0 <= elapsed < 9, r0
    assert "rank 1: no report" in text and "rank 0: timed out in call 2, phase 'agree'" in text, text


def _stopped_worker(rank, world, _):
    """Rank 1 stays away from call 2; rank 0 blocks in its agreement while another thread of it asks
    for the report a SIGTERM would print (the launcher's watcher thread does the same)."""
    import threading

    from epmoe.core.fault import stopped_report

    layer = EPMoE(CFG, timeout_s=8.0)
    layer.load_weights(random_weights(CFG, 0))
    x, logits = random_inputs(CFG, 6, rank)
    layer(x, logits)
    outside = stopped_report()  # between calls: in no phase
    if rank == 1:
        time.sleep(5)
        return outside
    seen = []
    t = threading.Thread(target=lambda: (time.sleep(1.5), seen.append(stopped_report())))
    t.start()
    try:
        layer(x, logits)
    except CollectiveFailure:
        pass
    t.join()
    return outside, seen[0], stopped_report()


def test_stopped_report_names_the_phase_a_blocked_rank_is_in():
    """`fault.stopped_report` from another thread while the main thread blocks in a collective (what the
    launcher prints when torchrun SIGTERMs a rank that waits on a stuck peer)."""
    r0, r1 = run_group(_stopped_worker, 2, None, timeout=60)
    assert r1 is None
    outside, during, after = r0
    assert outside is None and after is None, r0  # no phase outside a call, none left behind after one
    first = during.splitlines()[0]
    assert first.startswith("epmoe fault report:") and "call 2, phase 'agree'" in first, during
    assert "rank 0 was stopped by SIGTERM" in first and "waiting on ranks [1]" in first, during
    assert "rank 0: stopped by SIGTERM in call 2, phase 'agree'" in during and "rank 1: no report" in during, during


def test_phases_nest_and_unwind():
    """The phase `stopped_report` names is the innermost one entered and not yet left, also when a phase
    is left by an exception."""
    from epmoe.core.fault import FaultWatch, stopped_report

    watch = FaultWatch("unit", None, None)
    watch.next_call()
    with watch.phase("outer"):
        with watch.phase("inner"):
            assert "phase 'inner'" in stopped_report()
        assert "phase 'outer'" in stopped_report()
        with pytest.raises(KeyError):
            with watch.phase("failing"):
                raise KeyError("x")
        assert "phase 'outer'" in stopped_report()
    assert stopped_report() is None


def _decode_worker(rank, world, seed):
    layer = EPMoE(CFG_DS)
    w = random_weights(CFG_DS, seed)
    corr = random_correction_bias(CFG_DS, seed)
    layer.load_weights(w, e_score_correction_bias=corr)
    runner = layer.decode_runner(8, cuda_graph=False)  # the fixed-shape code a CUDA graph captures
    outs = []
    for step, T in enumerate([5, 8, 0, 3]):
        x, logits = random_inputs(CFG_DS, T, seed + 10 * step + rank)
        got = runner(x, logits, return_routing=True)
        replay = runner(x, topk_ids=got.routing.topk_ids.clone(), topk_weights=got.routing.topk_weights.clone())
        outs.append((x, logits, got.hidden_states.clone(), replay.clone(), layer(x, logits)))
    with pytest.raises(ValueError, match="exceed this decode runner's max_tokens=8"):
        runner(*random_inputs(CFG_DS, 9, seed))
    return outs


def test_decode_runner_fixed_shapes_match_reference():
    seed = fresh_seed()
    w = random_weights(CFG_DS, seed)
    corr = random_correction_bias(CFG_DS, seed)
    for outs in run_group(_decode_worker, 2, seed):
        for x, logits, y, replay, eager in outs:
            ref = reference_moe(CFG_DS, x, w, logits, e_score_correction_bias=corr)
            assert max_rel_err(y, ref) < 1e-5 and torch.equal(y, replay)
            assert max_rel_err(eager, ref) < 1e-5
