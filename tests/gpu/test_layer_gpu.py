"""The layer on one GPU: eager vs reference, CUDA-graph decode replay vs eager, in-place weight updates
seen by a captured graph, bitwise determinism (run on the device; skipped without a GPU)."""

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from tests.cpu.helpers import fresh_seed, max_rel_err, random_correction_bias, random_inputs, random_weights

pytestmark = pytest.mark.gpu

CFG = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16,
                routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5, has_bias=True)


def _layer(seed, experts="reference"):
    layer = EPMoE(CFG, device="cuda", experts=experts, deterministic=True)
    layer.load_weights(random_weights(CFG, seed), e_score_correction_bias=random_correction_bias(CFG, seed))
    return layer


def test_eager_matches_reference_bf16():
    seed = fresh_seed()
    layer = _layer(seed)
    x, logits = random_inputs(CFG, 200, seed)
    y = layer(x.cuda(), logits.cuda())
    ref = reference_moe(CFG, x, random_weights(CFG, seed), logits, e_score_correction_bias=random_correction_bias(CFG, seed))
    assert max_rel_err(y, ref) < 2e-2, seed


def test_cuda_graph_replay_equals_eager_and_sees_in_place_updates():
    seed = fresh_seed()
    layer = _layer(seed)
    graph = layer.decode_runner(32, cuda_graph=True)
    eager = layer.decode_runner(32, cuda_graph=False)
    ptrs = {k: v.data_ptr() for k, v in layer.experts.parameters().items()}
    for step, T in enumerate([32, 7, 1, 0]):
        x, logits = random_inputs(CFG, T, seed + step)
        x, logits = x.cuda(), logits.cuda()
        g = graph(x, logits).clone()
        e = eager(x, logits).clone()
        assert torch.isfinite(g).all()
        assert torch.equal(g, e), f"graph replay differs from eager at T={T} (seed {seed})"
    # push new weights in place: the captured graph must compute with them without recapture
    layer.update_weights(random_weights(CFG, seed + 1), e_score_correction_bias=random_correction_bias(CFG, seed + 1))
    assert {k: v.data_ptr() for k, v in layer.experts.parameters().items()} == ptrs
    x, logits = random_inputs(CFG, 16, seed + 99)
    g = graph(x.cuda(), logits.cuda()).clone()
    ref = reference_moe(CFG, x, random_weights(CFG, seed + 1), logits, e_score_correction_bias=random_correction_bias(CFG, seed + 1))
    assert max_rel_err(g, ref) < 2e-2
    assert torch.equal(g, eager(x.cuda(), logits.cuda()))


def test_deterministic_bits_across_runs_and_reloads():
    seed = fresh_seed()
    layer = _layer(seed)
    x, logits = random_inputs(CFG, 300, seed)
    x, logits = x.cuda(), logits.cuda()
    runs = [layer(x, logits) for _ in range(3)]
    for _ in range(2):
        layer.update_weights(random_weights(CFG, seed), e_score_correction_bias=random_correction_bias(CFG, seed))
        runs.append(layer(x, logits))
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("experts", ["reference", "triton"])
def test_routing_capture_and_replay_under_cuda_graphs(experts):
    """Capture the routing in a graph replay, then replay it (ids/weights path, its own graph):
    bitwise the same output; captured ids equal the router's own top-k."""
    from epmoe import route

    seed = fresh_seed()
    cfg = CFG if experts == "reference" else MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128,
                                                       dtype=torch.bfloat16)
    layer = EPMoE(cfg, device="cuda", experts=experts)
    corr = random_correction_bias(cfg, seed) if cfg.routing == "sigmoid_grouped" else None
    layer.load_weights(random_weights(cfg, seed), e_score_correction_bias=corr)
    runner = layer.decode_runner(16, cuda_graph=True)
    for T in (16, 5):
        x, logits = random_inputs(cfg, T, seed + T)
        x, logits = x.cuda(), logits.cuda()
        got = runner(x, logits, return_routing=True)
        y = got.hidden_states.clone()
        ids, w = got.routing.topk_ids.clone(), got.routing.topk_weights.clone()
        want = route(cfg, logits, layer.e_score_correction_bias)
        assert torch.equal(ids, want.topk_ids) and torch.equal(w, want.topk_weights)
        again = runner(x, topk_ids=ids, topk_weights=w).clone()
        assert torch.equal(y, again), f"replayed routing changed the output ({experts}, T={T}, seed {seed})"


def test_flashinfer_dispatcher_layer_uses_the_plan_workspace():
    """EPMoE hands the plan's exact A2A size to the FlashInfer dispatcher (equal to FlashInfer's own)."""
    pytest.importorskip("flashinfer")
    seed = fresh_seed()
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    for dd in ("bf16", "nvfp4"):
        layer = EPMoE(cfg, device="cuda", dispatcher="flashinfer", experts="triton", dispatch_dtype=dd,
                      max_num_tokens_per_rank=64)
        layer.load_weights(random_weights(cfg, seed))
        assert layer.dispatcher.spec.workspace_bytes is not None
        x, logits = random_inputs(cfg, 40, seed)
        y = layer(x.cuda(), logits.cuda())
        ref = reference_moe(cfg, x, random_weights(cfg, seed), logits)
        assert max_rel_err(y, ref) < (2e-2 if dd == "bf16" else 0.3), (dd, seed)
        layer.dispatcher.close()
