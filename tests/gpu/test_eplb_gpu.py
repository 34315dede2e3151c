"""EPLB on a GPU: 4 ranks sharing one GPU (shared-GPU mode, gloo group, docs/shared-gpu.md), triton experts
in bf16 and fp8_block, torch and FlashInfer dispatchers. Nothing here measures a link.

Per dispatcher, one group of 4 processes runs, for each mode:
  * reference: a layer with 4 redundant slots (E=16 on 4 ranks, 5 slots each), uneven T per rank
    (0 included, rounds), against the float64 reference that models the plan, and against the same
    layer without EPLB
  * changing skew: replayed skewed routing whose hot experts move mid-run, `rebalance_every=3`; every
    step against the reference; the measured max/mean rank load drops after each rebalance
  * update_weights after the rebalances: every replica takes the new weights (in place)
  * fault: an out-of-memory injected on rank 2 while it receives moved weights -> the same
    RebalanceError on every rank, the placement and the weights unchanged, the next step correct
  * CUDA graph (FlashInfer only; the torch dispatcher stages through the host over gloo and cannot be
    captured): a decode runner captured before a rebalance replays, after it, bit for bit what the
    eager runner computes and matches the reference (replica tables and weights updated in place)
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.cpu.mp import assert_checks, run_checks, run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
HAS_FI = importlib.util.find_spec("flashinfer") is not None
MODES = ("bf16", "fp8_block")
TOL = {"bf16": 2e-2, "fp8_block": 6e-2}  # as tests/gpu/test_combinations_gpu.py
WORLD = 4


def _worker(rank, world, seed, dispatcher):
    from epmoe import EPLBConfig, EPMoE, MoEConfig, reference_moe
    from epmoe.core.errors import RebalanceError
    from epmoe.core import dist as edist
    from epmoe.eplb import transfer
    from epmoe.routing import Routing
    from tests.cpu.helpers import max_rel_err, random_inputs, random_weights

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    w0, w1 = random_weights(cfg, seed), random_weights(cfg, seed + 1)

    def skewed(T, hot, s):
        g = torch.Generator().manual_seed(s)
        p = torch.ones(cfg.num_experts)
        p[list(hot)] = 25.0
        ids = torch.multinomial(p.expand(T, -1), cfg.top_k, generator=g).to(torch.int32) if T else \
            torch.empty(0, cfg.top_k, dtype=torch.int32)
        wt = torch.rand(T, cfg.top_k, generator=g)
        return ids, wt / wt.sum(dim=1, keepdim=True).clamp_min(1e-9)

    def build(mode, **kw):
        layer = EPMoE(cfg, dispatcher=dispatcher, experts="triton", quant=mode, device=dev, shared_gpu=True,
                      max_num_tokens_per_rank=32, timeout_s=60, **kw)
        layer.load_weights(w0)
        return layer

    def step(layer, mode, w, counts, s, hot=None):
        x, logits = random_inputs(cfg, counts[rank], s + 101 * rank)
        if hot is None:
            y = layer(x.to(dev), logits.to(dev))
            ref = reference_moe(cfg, x, w, logits, plan=layer.plan)
        else:
            ids, wt = skewed(counts[rank], hot, s + 101 * rank)
            y = layer(x.to(dev), topk_ids=ids.to(dev), topk_weights=wt.to(dev))
            ref = reference_moe(cfg, x, w, routing=Routing(ids, wt), plan=layer.plan)
        err = max_rel_err(y, ref)
        assert err < TOL[mode], f"{mode} T={counts}: max rel err {err:.3g}"
        return y, err

    checks = []
    for mode in MODES:
        state = {}

        def reference(mode=mode):
            layer = build(mode, eplb=EPLBConfig(num_redundant_experts=4))
            plain = build(mode)
            counts = [70, 0, 33, 5]  # rounds of 32 on rank 0
            y, err = step(layer, mode, w0, counts, seed)
            y0, _ = step(plain, mode, w0, counts, seed)
            d = max_rel_err(y, y0)
            assert d < TOL[mode], f"EPLB vs no EPLB: {d:.3g}"
            plain.close()
            layer.close()
            return f"vs float64 {err:.2e}, vs no EPLB {d:.2e}"

        def changing_skew(mode=mode):
            layer = build(mode, eplb=EPLBConfig(num_redundant_experts=4, rebalance_every=3, min_improvement=0.0))
            state["layer"] = layer
            counts = [48, 40, 56, 32]
            ratios, worst = [], 0.0
            for s in range(12):
                p = layer.placement
                if s in (0, 6):  # hot: the two experts of one rank with the fewest replicas
                    r = 0 if s == 0 else world - 1
                    hot = tuple(sorted(p.local_experts(r), key=lambda e: (len(p.replicas(e)), e))[:2])
                worst = max(worst, step(layer, mode, w0, counts, seed + 10 + s, hot)[1])
                if s in (2, 5, 8, 11):
                    ratios.append(layer.expert_load().imbalance)
            assert ratios[1] < ratios[0] and ratios[3] < max(ratios[2], 1.3), ratios
            r = layer.last_rebalance
            assert r is not None and r.bytes_moved > 0, r
            return f"max/mean {ratios}; max rel err {worst:.2e}; last: {r.format()}"

        def update_after(mode=mode):
            layer = state["layer"]
            ptrs = {k: v.data_ptr() for k, v in layer.experts.parameters().items()}
            layer.update_weights(w1)
            assert {k: v.data_ptr() for k, v in layer.experts.parameters().items()} == ptrs
            _, err = step(layer, mode, w1, [20, 9, 0, 3], seed + 40)
            return f"{err:.2e}"

        def fault(mode=mode):
            layer = state["layer"]
            before = layer.placement
            params = {k: v.clone() for k, v in layer.experts.parameters().items()}
            real = transfer._unpack_row

            def oom(*a, **k):
                if rank == 2:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                return real(*a, **k)
            transfer._unpack_row = oom
            per = before.slots_per_rank
            s = before.slot_to_expert
            try:
                layer.rebalance(placement=list(s[per:] + s[:per]))  # every rank sends and receives
            except RebalanceError as e:
                msg = str(e)
            else:
                raise AssertionError("no RebalanceError")
            finally:
                transfer._unpack_row = real
            assert len(set(edist.all_gather_objects(msg, None, 60))) == 1 and "rank 2: OutOfMemoryError" in msg, msg
            assert layer.placement == before
            assert all(torch.equal(v, params[k]) for k, v in layer.experts.parameters().items())
            _, err = step(layer, mode, w1, [20, 9, 0, 3], seed + 41)
            return f"same error on every rank, nothing changed, next step {err:.2e}"

        def cuda_graph(mode=mode):
            layer = build(mode, eplb=EPLBConfig(num_redundant_experts=4))
            graph, eager = layer.decode_runner(16, cuda_graph=True), layer.decode_runner(16, cuda_graph=False)

            def compare(s):
                x, logits = random_inputs(cfg, [16, 5, 0, 11][rank], s + rank)
                g = graph(x.to(dev), logits.to(dev)).clone()
                e = eager(x.to(dev), logits.to(dev)).clone()
                assert torch.equal(g, e), "graph replay differs from eager"
                if x.shape[0]:
                    assert max_rel_err(g, reference_moe(cfg, x, w0, logits, plan=layer.plan)) < TOL[mode]

            compare(seed + 50)
            report = layer.rebalance(load=[1] * 14 + [90, 100], force=True)  # experts 14, 15 start unreplicated
            assert report.moved_slots > 0, report
            compare(seed + 51)  # the captured graph reads the updated tables and weights
            layer.close()
            return f"replay == eager bitwise before and after moving {report.moved_slots} slots"

        checks += [(f"{mode}:reference", reference), (f"{mode}:changing_skew", changing_skew),
                   (f"{mode}:update_weights", update_after), (f"{mode}:fault", fault)]
        if dispatcher == "flashinfer":
            checks.append((f"{mode}:cuda_graph", cuda_graph))
    results = run_checks(f"eplb gpu {dispatcher} rank {rank}", checks)
    torch.distributed.barrier()
    return results


@pytest.fixture(scope="module", params=["torch", "flashinfer"])
def results(request):
    from tests.cpu.helpers import fresh_seed

    if request.param == "flashinfer" and not HAS_FI:
        pytest.skip("needs flashinfer-python")
    seed = fresh_seed()
    return request.param, seed, run_group(_worker, WORLD, seed, request.param, timeout=420, pg_timeout=120)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("check", ["reference", "changing_skew", "update_weights", "fault", "cuda_graph"])
def test_eplb_shared_gpu(results, mode, check):
    dispatcher, seed, res = results
    if check == "cuda_graph" and dispatcher != "flashinfer":
        pytest.skip("the torch dispatcher over gloo stages through the host: no CUDA graph")
    assert_checks(res, [f"{mode}:{check}"], seed)
