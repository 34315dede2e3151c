"""Training through EPMoE (docs/training.md) on real gloo groups: float64 gradcheck of the whole layer at
ep = 1, 2, 3 (uneven tokens, a rank with none, rounds), gradients against the float64 reference under
autograd, refusals (quantized plans, dispatchers and experts without a backward, decode runners, a
rebalance with pending gradients), bad gradients in backward, and the inference path left unchanged."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.core.errors import RemoteRankError
from epmoe.routing import Routing, route, routing_weights
from tests.cpu._training_util import global_layer_fn, global_params
from tests.cpu.helpers import fresh_seed, random_correction_bias, random_weights
from tests.cpu.mp import run_group

CONFIGS = {
    "softmax_swiglu": dict(num_experts=6, top_k=2, hidden_size=4, intermediate_size=3),
    "softmax_bias_norenorm": dict(num_experts=6, top_k=3, hidden_size=4, intermediate_size=3, has_bias=True,
                                  renormalize=False),
    "sigmoid_grouped_relu2": dict(num_experts=6, top_k=2, hidden_size=4, intermediate_size=3, activation="relu2",
                                  routing="sigmoid_grouped", n_group=3, topk_group=2, routed_scaling_factor=2.5),
    "gpt_oss_swiglu": dict(num_experts=6, top_k=2, hidden_size=4, intermediate_size=3, has_bias=True,
                           swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0),
}


def _config(name: str, dtype=torch.float64) -> MoEConfig:
    return MoEConfig(dtype=dtype, **CONFIGS[name])


def _spaced_logits(T: int, E: int, seed: int) -> torch.Tensor:
    """Router logits whose values in a row are >= 0.4 apart: no top-k choice flips under gradcheck's
    1e-6 perturbations (the choice has no gradient)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]) if T else torch.zeros(0, E, dtype=torch.long)
    return (perm.double() * 0.5 - 1.0 + torch.rand(T, E, generator=g, dtype=torch.float64) * 0.1)


def _global_inputs(cfg: MoEConfig, counts, seed: int):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(sum(counts), cfg.hidden_size, generator=g, dtype=torch.float64)
    L = _spaced_logits(sum(counts), cfg.num_experts, seed + 1)
    return X, L


def _gradcheck_worker(rank, world, cfg_name, counts, seed, max_tokens):
    warnings.simplefilter("ignore", UserWarning)  # float64 layer
    cfg = _config(cfg_name)
    layer = EPMoE(cfg, max_num_tokens_per_rank=max_tokens, training=True, timeout_s=60)
    w = random_weights(cfg, seed)
    corr = random_correction_bias(cfg, seed).double() * 0.01 if cfg.routing == "sigmoid_grouped" else None
    layer.load_weights(w, e_score_correction_bias=corr)
    X, L = _global_inputs(cfg, counts, seed)
    P = global_params(cfg, w)
    inputs = [t.requires_grad_() for t in [X, L, *P]]
    f = global_layer_fn(layer, counts, rank)
    # the forward equals the float64 reference (the whole global batch)
    Y = f(*inputs)
    ids = route(cfg, L.detach(), corr, impl="torch").topk_ids
    ref = reference_moe(cfg, X.detach(), w, routing=Routing(ids, routing_weights(cfg, L.detach(), ids)))
    torch.testing.assert_close(Y.detach(), ref, rtol=1e-10, atol=1e-12)
    ok = torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)
    return bool(ok)


@pytest.mark.parametrize("ep,counts,max_tokens", [
    (1, (5,), 4096),
    (2, (4, 0), 4096),       # a rank with no tokens
    (3, (3, 0, 2), 4096),    # uneven, one idle
    (2, (5, 2), 2),          # three rounds on rank 0
])
def test_gradcheck_layer_float64(ep, counts, max_tokens):
    seed = fresh_seed()
    res = run_group(_gradcheck_worker, ep, "softmax_swiglu", counts, seed, max_tokens, timeout=240)
    assert all(res), f"seed {seed}: {res}"


@pytest.mark.parametrize("cfg_name", ["softmax_bias_norenorm", "sigmoid_grouped_relu2", "gpt_oss_swiglu"])
def test_gradcheck_layer_configs_ep2(cfg_name):
    seed = fresh_seed()
    res = run_group(_gradcheck_worker, 2, cfg_name, (3, 2), seed, 4096, timeout=240)
    assert all(res), f"{cfg_name} seed {seed}: {res}"


# ---------------------------------------------------------------------------------------------------------
def _reference_grads(cfg, w, X, L, corr, gY):
    """Gradients of sum(reference(X, L) * gY) by autograd through a float64 dense reference written
    here with the same routing choice (top-k ids from epmoe.routing.route)."""
    from epmoe.reference import _act

    X = X.detach().clone().requires_grad_()
    L = L.detach().clone().requires_grad_()
    ws = [t.detach().clone().double().requires_grad_() for t in global_params(cfg, w)]
    ids = route(cfg, L.detach(), corr, impl="torch").topk_ids.long()
    wts = routing_weights(cfg, L, ids)
    I = cfg.intermediate_size
    out = torch.zeros_like(X)
    for t in range(X.shape[0]):
        for k in range(cfg.top_k):
            e = int(ids[t, k])
            h = ws[0][e] @ X[t] + (ws[2][e] if cfg.has_bias else 0)
            g, u = (h[:I], h[I:]) if cfg.is_gated else (h, None)
            y = ws[1][e] @ _act(cfg, g, u) + (ws[3][e] if cfg.has_bias else 0)
            out[t] = out[t] + wts[t, k] * y
    (out * gY).sum().backward()
    return out.detach(), X.grad, L.grad, [p.grad for p in ws]


def _grads_worker(rank, world, cfg_name, counts, seed, recompute):
    warnings.simplefilter("ignore", UserWarning)
    from epmoe import TrainingConfig

    cfg = _config(cfg_name)
    layer = EPMoE(cfg, training=TrainingConfig(recompute_experts=recompute), timeout_s=60)
    w = random_weights(cfg, seed)
    corr = random_correction_bias(cfg, seed).double() * 0.01 if cfg.routing == "sigmoid_grouped" else None
    layer.load_weights(w, e_score_correction_bias=corr)
    X, L = _global_inputs(cfg, counts, seed)
    gY = torch.randn(X.shape, generator=torch.Generator().manual_seed(seed + 5), dtype=torch.float64)
    lo = sum(counts[:rank])
    x = X[lo: lo + counts[rank]].clone().requires_grad_()
    lg = L[lo: lo + counts[rank]].clone().requires_grad_()
    y = layer(x, lg)
    (y * gY[lo: lo + counts[rank]]).sum().backward()
    g = layer.expert_gradients()
    return dict(y=y.detach(), gx=x.grad, gl=lg.grad, w13=layer.w13.grad, w2=layer.w2.grad,
                b13=getattr(layer, "b13", None) is not None and layer.b13.grad, canon=g,
                first=layer.first_local_expert, E=layer.num_local_experts)


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
@pytest.mark.parametrize("recompute", [False, True])
def test_gradients_match_reference_autograd(cfg_name, recompute):
    """Every rank's input gradients and every expert's weight gradient (on the rank that owns it) equal
    autograd through a dense float64 reference of the whole batch."""
    seed = fresh_seed()
    counts = (4, 0, 3)
    cfg = _config(cfg_name)
    res = run_group(_grads_worker, 3, cfg_name, counts, seed, recompute)
    w = random_weights(cfg, seed)
    corr = random_correction_bias(cfg, seed).double() * 0.01 if cfg.routing == "sigmoid_grouped" else None
    X, L = _global_inputs(cfg, counts, seed)
    gY = torch.randn(X.shape, generator=torch.Generator().manual_seed(seed + 5), dtype=torch.float64)
    out, gX, gL, gP = _reference_grads(cfg, w, X, L, corr, gY)
    tol = dict(rtol=1e-9, atol=1e-11)
    lo = 0
    for rank, r in enumerate(res):
        n = counts[rank]
        torch.testing.assert_close(r["y"], out[lo: lo + n], **tol, msg=f"seed {seed} rank {rank} output")
        torch.testing.assert_close(r["gx"], gX[lo: lo + n], **tol, msg=f"seed {seed} rank {rank} grad hidden")
        torch.testing.assert_close(r["gl"], gL[lo: lo + n], **tol, msg=f"seed {seed} rank {rank} grad logits")
        e0, e1 = r["first"], r["first"] + r["E"]
        torch.testing.assert_close(r["w13"], gP[0][e0:e1], **tol, msg=f"seed {seed} rank {rank} grad w13")
        torch.testing.assert_close(r["w2"], gP[1][e0:e1], **tol, msg=f"seed {seed} rank {rank} grad w2")
        if cfg.has_bias:
            torch.testing.assert_close(r["b13"], gP[2][e0:e1], **tol)
        c = r["canon"]
        I = cfg.intermediate_size
        torch.testing.assert_close(c.w1, gP[0][e0:e1, :I] if cfg.is_gated else gP[0][e0:e1], **tol)
        lo += n


# ---------------------------------------------------------------------------------------------------------
def _inference_unchanged_worker(rank, world, seed):
    """A training layer under no_grad / inference_mode gives the bits of an inference layer, with no
    autograd graph; with gradients enabled the training forward gives the same bits (float32)."""
    cfg = _config("softmax_swiglu", torch.float32).replace(num_experts=8, hidden_size=16, intermediate_size=8)
    w = random_weights(cfg, seed)
    inf = EPMoE(cfg)
    tr = EPMoE(cfg, training=True)
    inf.load_weights(w)
    tr.load_weights(w)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(7 + rank, cfg.hidden_size, generator=g)
    lg = torch.randn(7 + rank, cfg.num_experts, generator=g)
    a = inf(x, lg)
    with torch.no_grad():
        b = tr(x, lg)
    with torch.inference_mode():
        c = tr(x, lg)
    d = tr(x, lg)  # grad enabled: the differentiable path
    assert b.grad_fn is None and d.grad_fn is not None
    return [torch.equal(a, b), torch.equal(a, c), torch.equal(a, d.detach())]


def test_training_layer_inference_bits_unchanged():
    seed = fresh_seed()
    for r in run_group(_inference_unchanged_worker, 2, seed):
        assert all(r), f"seed {seed}: {r}"


# ---------------------------------------------------------------------------------------------------------
def test_refusals_at_construction():
    cfg = _config("softmax_swiglu", torch.float32)
    with pytest.raises(ValueError, match="inference-only"):
        EPMoE(cfg, training=True, quant="fp8_block")
    with pytest.raises(ValueError, match="quantized wires are inference-only"):
        EPMoE(cfg, training=True, dispatch_dtype="fp8")
    from epmoe import QuantPlan

    # a hand-built plan is asked too (the layer consults the classes' supports_training)
    with pytest.raises(ValueError, match="cannot train with this plan: experts backend 'triton' has no backward"):
        EPMoE(cfg, training=True, plan=QuantPlan(experts_backend="triton", dispatcher="torch"))
    with pytest.raises(TypeError, match="training="):
        EPMoE(cfg, training="yes")
    from epmoe.eplb import EPLBConfig

    with pytest.raises(ValueError, match="redundant expert slots"):
        EPMoE(cfg.replace(num_experts=6), training=True, eplb=EPLBConfig(num_redundant_experts=2))


def test_capabilities_answer_training():
    """Each dispatcher and experts class says whether it trains (the resolver and the layer ask)."""
    from epmoe.core.capability import BackendRequest
    from epmoe.dispatch import DISPATCHERS
    from epmoe.experts import EXPERTS
    from epmoe.resolve import resolve_plan

    req = BackendRequest(training=True, arch="sm90", model_dtype="bfloat16", ep_size=2)
    trains = {n: bool(DISPATCHERS.get(n).supports_training(req)) for n in DISPATCHERS.names()}
    assert trains == {"torch": True, "flashinfer": False, "deepep": True, "deepep_ll": False}, trains
    why = DISPATCHERS.get("deepep_ll").supports_training(req).reason
    assert "without a backward" in why, why
    # DeepEP normal mode trains bf16 tokens of a bf16 model at ep 2/4/8 only, each refusal naming why
    deepep = DISPATCHERS.get("deepep")
    for bad, match in ((req.with_(wire="fp8"), "bf16 tokens only, not a fp8 wire"),
                       (req.with_(model_dtype="float32"), "bf16 models only"),
                       (req.with_(ep_size=3), "ep_size 2, 4 or 8")):
        why = deepep.supports_training(bad)
        assert not why and match in why.reason, (bad, why.reason)
    e_trains = {n: bool(EXPERTS.get(n).supports_training(req)) for n in EXPERTS.names()}
    assert {n for n, ok in e_trains.items() if ok} == {"reference", "grouped_mm"}, e_trains
    assert not EXPERTS.get("reference").supports_training(req.with_(expert_mode="fp8_block"))
    from epmoe.resolve import Environment

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    plan = resolve_plan(cfg, environment=Environment.hypothetical("sm90"), training=True)
    assert plan.experts_backend == "grouped_mm" and plan.training, plan.describe()
    assert any(s.startswith("triton:") and "no backward" in s for s in plan.skipped), plan.skipped
    plan = resolve_plan(cfg, dispatcher="deepep", environment=Environment.hypothetical("sm90"), ep_size=2,
                        training=True)
    assert plan.dispatcher == "deepep" and plan.dispatch_dtype == "bf16" and plan.training, plan.describe()
    with pytest.raises(ValueError, match="dispatcher 'deepep_ll' does not train"):
        resolve_plan(cfg.replace(hidden_size=2048), dispatcher="deepep_ll", environment=Environment.hypothetical("sm90"),
                     ep_size=2, training=True)
    with pytest.raises(ValueError, match=r"training through dispatcher 'deepep' \(dispatch fp8\): .*bf16 tokens only"):
        resolve_plan(cfg.replace(hidden_size=256), dispatcher="deepep", dispatch_dtype="fp8",
                     environment=Environment.hypothetical("sm90"), ep_size=2, training=True)
    with pytest.raises(ValueError, match="inference-only"):
        resolve_plan(cfg, quant="fp8_block", environment=Environment.hypothetical("sm90"), training=True)


def test_inference_layer_refuses_backward():
    """A layer built without training, given inputs that require grad: the forward runs (inference),
    a backward through it raises naming why (never a silently missing gradient)."""
    cfg = _config("softmax_swiglu", torch.float32)
    layer = EPMoE(cfg)
    layer.load_weights(random_weights(cfg, 1))
    x = torch.randn(3, cfg.hidden_size, requires_grad=True)
    y = layer(x, torch.randn(3, cfg.num_experts))
    with pytest.raises(RuntimeError, match="inference only.*training=True"):
        y.sum().backward()
    with torch.no_grad():
        assert layer(x, torch.randn(3, cfg.num_experts)).grad_fn is None


def test_decode_runner_refuses_training():
    cfg = _config("softmax_swiglu", torch.float32)
    layer = EPMoE(cfg, training=True)
    layer.load_weights(random_weights(cfg, 1))
    runner = layer.decode_runner(4, cuda_graph=False)
    x, lg = torch.randn(2, cfg.hidden_size), torch.randn(2, cfg.num_experts)
    with pytest.raises(RuntimeError, match="decode runners do not train"):
        runner(x, lg)
    with torch.no_grad():
        ref = layer(x, lg)
        torch.testing.assert_close(runner(x, lg), ref)


def _rebalance_worker(rank, world, seed):
    warnings.simplefilter("ignore", UserWarning)
    from epmoe.eplb import EPLBConfig

    cfg = _config("softmax_swiglu", torch.float32).replace(num_experts=4)
    layer = EPMoE(cfg, training=True, eplb=EPLBConfig(num_redundant_experts=0), timeout_s=30)
    layer.load_weights(random_weights(cfg, seed))
    x = torch.randn(4, cfg.hidden_size)
    lg = torch.randn(4, cfg.num_experts)
    layer(x, lg).sum().backward()
    if rank == 1:
        layer.zero_grad(set_to_none=True)  # rank 0 still holds gradients
    errors = []
    try:
        layer.rebalance(force=True)
    except RuntimeError as e:
        errors.append(str(e))
    layer.zero_grad(set_to_none=True)
    report = layer.rebalance(force=True)  # no gradients: allowed
    return errors, report is not None


def test_rebalance_refused_while_gradients_pending():
    res = run_group(_rebalance_worker, 2, fresh_seed())
    for errors, ok in res:
        assert len(errors) == 1 and "gradients are pending on ranks [0]" in errors[0], errors
        assert ok


def _grad_mode_mismatch_worker(rank, world):
    cfg = _config("softmax_swiglu", torch.float32)
    layer = EPMoE(cfg, training=True, timeout_s=30)
    layer.load_weights(random_weights(cfg, 3))
    x, lg = torch.randn(2, cfg.hidden_size), torch.randn(2, cfg.num_experts)
    try:
        if rank == 1:
            with torch.no_grad():
                layer(x, lg)
        else:
            layer(x, lg)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_grad_mode_must_agree_across_ranks():
    for msg in run_group(_grad_mode_mismatch_worker, 2):
        assert "ranks [0] run with gradients enabled, ranks [1] without" in msg, msg


def _bad_grad_worker(rank, world, case):
    """One rank's hook on the layer output returns a gradient of the wrong dtype / shape: torch rejects it
    on that rank before any backward node runs there; the other rank, waiting in the layer's backward,
    raises a fault report naming the phase within the timeout instead of hanging."""
    cfg = _config("softmax_swiglu", torch.float32)
    layer = EPMoE(cfg, training=True, timeout_s=5)
    layer.load_weights(random_weights(cfg, 3))
    x = torch.randn(3, cfg.hidden_size, requires_grad=True)
    y = layer(x, torch.randn(3, cfg.num_experts))
    if rank == 1:
        if case == "dtype":
            y.register_hook(lambda g: g.double())
        else:
            y.register_hook(lambda g: g[:, :-1])
    try:
        y.sum().backward()
    except (RuntimeError, ValueError, RemoteRankError) as e:
        if rank == 1:
            time.sleep(8)  # stays alive past rank 0's timeout
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("case", ["dtype", "shape"])
def test_bad_gradient_raises_on_every_rank(case):
    msgs = run_group(_bad_grad_worker, 2, case, timeout=90)
    assert "hook" in msgs[1] and ("type" in msgs[1] or "size" in msgs[1]), msgs
    assert msgs[0].startswith("CollectiveTimeoutError") and "backward of combine" in msgs[0], msgs


def _agreed_check_worker(rank, world):
    """What reaches the layer's backward is agreed over the group first: a gradient that is not the
    output's (a device mismatch here, called directly) raises on every rank, none waits."""
    from epmoe.dispatch.autograd import _Combine

    cfg = _config("softmax_swiglu", torch.float32)
    layer = EPMoE(cfg, training=True, timeout_s=20)
    layer.load_weights(random_weights(cfg, 3))
    x = torch.randn(3, cfg.hidden_size, requires_grad=True)
    y = layer(x, torch.randn(3, cfg.num_experts))
    node = y.grad_fn
    assert type(node).__name__ == "_CombineBackward"
    g = torch.ones(3, cfg.hidden_size, dtype=torch.float64 if rank == 1 else torch.float32)
    try:
        _Combine.backward(node, g)
    except (ValueError, RemoteRankError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_bad_gradient_in_layer_backward_raises_on_every_rank():
    msgs = run_group(_agreed_check_worker, 2, timeout=90)
    assert msgs[1].startswith("ValueError") and "has dtype torch.float64; expected torch.float32" in msgs[1], msgs
    assert msgs[0].startswith("PeerInputError") and "rank 1" in msgs[0], msgs


def _backward_skipped_worker(rank, world):
    """A rank that never runs the backward: the others end their wait at the layer's timeout with a
    fault report, instead of hanging."""
    cfg = _config("softmax_swiglu", torch.float32)
    layer = EPMoE(cfg, training=True, timeout_s=3)
    layer.load_weights(random_weights(cfg, 3))
    y = layer(torch.randn(3, cfg.hidden_size), torch.randn(3, cfg.num_experts))
    if rank == 1:
        try:
            y.backward(torch.ones(3, cfg.hidden_size + 1))  # torch refuses before any backward node runs
        except RuntimeError as e:
            time.sleep(8)  # stays alive: rank 0 times out (exiting would end its wait as a lost peer)
            return f"RuntimeError: {e}"
        return "no error"
    try:
        y.sum().backward()
    except RemoteRankError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_rank_without_backward_times_out_with_report():
    msgs = run_group(_backward_skipped_worker, 2, timeout=90)
    assert "Mismatch in shape" in msgs[1], msgs
    assert msgs[0].startswith("CollectiveTimeoutError") and "backward of combine" in msgs[0], msgs


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name", ["softmax_swiglu", "gpt_oss_swiglu", "sigmoid_grouped_relu2"])
def test_grouped_mm_train_forward_matches_reference_experts(cfg_name):
    """The grouped_mm backend's training stage (torch._grouped_mm under autograd; its float32 CPU path
    here, bf16 on the GPU in tests/gpu/test_training_gpu.py): output and every gradient equal the
    reference experts' under autograd, entries of no local expert (-1) included."""
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.reference import ReferenceExperts
    from epmoe.experts.triton.grouped_mm import grouped_mm_train_forward
    from epmoe.quant.weights import ExpertWeights

    seed = fresh_seed()
    cfg = _config(cfg_name, torch.float32).replace(hidden_size=16, intermediate_size=8)  # 16-byte strides
    g = torch.Generator().manual_seed(seed)
    w = random_weights(cfg, seed)
    ref = ReferenceExperts(ExpertsSpec(config=cfg, ep_rank=0, ep_size=1, device=torch.device("cpu")))
    ref.load_weights(w)
    N, K = 9, cfg.top_k
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:K] for _ in range(N)]).to(torch.int32)
    ids[::3, 0] = -1  # entries whose expert lives elsewhere
    ids[4] = -1       # a row with no local expert
    wts = torch.rand(N, K, generator=g)
    x = torch.randn(N, cfg.hidden_size, generator=g)

    def grads(fn):
        xx = x.clone().requires_grad_()
        ww = wts.clone().requires_grad_()
        params = {k: v.detach().clone().requires_grad_() for k, v in ref.parameters().items()}
        out = fn(xx, ww, params)
        gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
        (out * gy).sum().backward()
        return [out.detach(), xx.grad, ww.grad] + [params[k].grad for k in sorted(params)]

    want = grads(lambda xx, ww, p: ref.train_forward(DispatchedTokens(xx, ids, ww), p))
    got = grads(lambda xx, ww, p: grouped_mm_train_forward(xx, ids, ww, p, cfg, cfg.num_experts))
    for name, a, b in zip(["out", "x", "weights"] + sorted(ref.parameters()), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"seed {seed} {name}")
    assert torch.all(want[0][4] == 0) and torch.all(got[1][4] == 0)
    none_here = torch.full_like(ids, -1)  # every entry's expert elsewhere: zeros, no GEMM of 0 rows
    assert torch.equal(grouped_mm_train_forward(x, none_here, wts, ref.parameters(), cfg, cfg.num_experts),
                       torch.zeros_like(x))


def test_bf16_gradients_cpu_ranks():
    """The GPU test's bf16 check (tests/gpu/test_training_gpu.py) on 2 CPU ranks, reference experts:
    bf16 output and gradients within bf16 error of the float64 reference under autograd."""
    from tests.cpu.mp import assert_checks
    from tests.gpu.test_training_gpu import _shared_gpu_worker

    seed = fresh_seed()
    per_rank = run_group(_shared_gpu_worker, 2, seed, (40, 0), "cpu", ("reference",), timeout=240)
    assert_checks(per_rank, ["reference"], seed)


@pytest.mark.parametrize("counts", [(40, 0), (9, 23, 0, 5)], ids=["ep2", "ep4"])
def test_deepep_training_wiring_standin(counts):
    """The GPU test of training through DeepEP (tests/gpu/test_training_gpu.py) on CPU ranks with the
    stand-in deep_ep: proves the wiring of the backward (combine with the weights' gradients, cached
    dispatch, the padded row of a rank with 0 tokens) against the float64 reference, nothing about
    DeepEP's kernels."""
    from tests.cpu.mp import assert_checks
    from tests.gpu.test_training_gpu import _shared_gpu_worker

    seed = fresh_seed()
    per_rank = run_group(_shared_gpu_worker, len(counts), seed, counts, "cpu", ("reference",), "deepep", timeout=300)
    assert_checks(per_rank, ["reference"], seed)


def test_bench_training_runs_on_cpu(tmp_path):
    """benchmarks/bench_training.py end to end at a tiny float32 shape on CPU (the GPU run is the same
    code at the DeepSeek-V3 shape): the four rows, their gradients equal (float32, the same math); the
    fused row's Triton kernels under the interpreter when Triton is installed."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "bench_training.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_training.py"), "--device", "cpu",
                        "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32", "--tokens", "16",
                        "--iters", "2", "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True, cwd=root, timeout=120,
                       env={**os.environ, "PYTHONPATH": root, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert set(rep["results"]) == {"epmoe", "epmoe_torch", "epmoe_recompute", "peer_torch_bf16",
                                   "ratio_epmoe_over_peer"}
    for row in ("epmoe", "epmoe_torch", "epmoe_recompute", "peer_torch_bf16"):
        assert rep["results"][row]["forward_backward_ms"] > 0
        assert max(rep["results"][row]["grad_max_rel_diff_vs_epmoe"].values()) < 1e-5, rep["results"][row]


def _fp32_accumulation_worker(rank, world, seed):
    """bf16 experts with fp32 gradient accumulation over 3 micro-batches: main_grad (fp32) holds the sum,
    .grad stays None, within bf16 error of the float64 reference's summed gradients; zero_main_grad
    clears it; a rebalance is refused while main_grad holds a gradient."""
    from epmoe import TrainingConfig
    from epmoe.eplb import EPLBConfig

    cfg = _config("softmax_swiglu", torch.bfloat16).replace(hidden_size=16, intermediate_size=8)
    w = random_weights(cfg, seed)
    layer = EPMoE(cfg, training=TrainingConfig(fp32_grad_accumulation=True), eplb=EPLBConfig(), timeout_s=30)
    layer.load_weights(w)
    assert layer.w13.main_grad.dtype == torch.float32
    e0, e1 = layer.first_local_expert, layer.first_local_expert + layer.num_local_experts
    total = [torch.zeros(6, *t.shape[1:], dtype=torch.float64) for t in global_params(cfg.replace(dtype=torch.float64), w)[:2]]
    for mb in range(3):
        counts = (5, 3)
        X, L = _global_inputs(cfg, counts, seed + mb)
        gY = torch.randn(X.shape, generator=torch.Generator().manual_seed(seed + 50 + mb), dtype=torch.float64)
        lo = sum(counts[:rank])
        x = X[lo: lo + counts[rank]].to(torch.bfloat16)
        lg = L[lo: lo + counts[rank]].float()
        (layer(x, lg).double() * gY[lo: lo + counts[rank]]).sum().backward()
        _, _, _, gP = _reference_grads(cfg, w, X.to(torch.bfloat16).double(), L.float().double(), None, gY)
        total = [a + b for a, b in zip(total, gP[:2])]
    ok_none = layer.w13.grad is None and layer.w2.grad is None
    err = max(float((layer.w13.main_grad - total[0][e0:e1]).abs().max() / total[0][e0:e1].abs().max()),
              float((layer.w2.main_grad - total[1][e0:e1]).abs().max() / total[1][e0:e1].abs().max()))
    try:
        layer.rebalance(force=True)
        refused = False
    except RuntimeError as e:
        refused = "gradients are pending" in str(e)
    layer.zero_main_grad()
    cleared = not bool(layer.w13.main_grad.any())
    return ok_none, err, refused, cleared


def test_fp32_gradient_accumulation():
    seed = fresh_seed()
    for ok_none, err, refused, cleared in run_group(_fp32_accumulation_worker, 2, seed):
        assert ok_none and refused and cleared
        assert err < 3e-2, f"seed {seed}: {err}"
