"""Training through EPMoE on a GPU in bf16 (docs/training.md), against the float64 reference under autograd.

  * ep = 2 ranks sharing ONE GPU (gloo group, shared_gpu=True: the torch dispatcher stages CUDA tensors
    through host memory; its backward too), uneven tokens including a rank with 0, experts 'grouped_mm'
    (torch._grouped_mm under autograd) and 'reference': the output, the gradients of hidden_states and
    router_logits on every rank and each expert's weight gradients on the rank that owns it, within bf16
    error of autograd through a dense float64 reference of the whole batch; recompute_experts gives the
    same gradients (up to the order of atomic adds).
  * the same through DeepEP's normal kernels (dispatcher 'deepep') at ep = 2 and 4 sharing GPU 0.
  * one rank, grouped_mm: the training forward agrees with the inference forward (Triton epilogue) to bf16
    error, and the training stage's gradients equal the reference experts' under autograd to bf16 error.

    python -m pytest tests/gpu/test_training_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.cpu.mp import assert_checks, run_checks, run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16_TOL = 3e-2  # max |got - ref| / max |ref|, per tensor


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _cfg():
    from epmoe import MoEConfig

    return MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)


def _global_batch(cfg, counts, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(sum(counts), cfg.hidden_size, generator=g).to(torch.bfloat16)
    L = torch.randn(sum(counts), cfg.num_experts, generator=g) * 2
    gY = torch.randn(sum(counts), cfg.hidden_size, generator=g)
    return X, L, gY


def _shared_gpu_worker(rank, world, seed, counts, device="cuda", experts_list=("grouped_mm", "reference"),
                       dispatcher="torch"):
    """dispatcher 'deepep': DeepEP's normal kernels (their backward: combine / cached dispatch); on CPU
    ranks the stand-in deep_ep (tests/cpu/fake_deep_ep.py) runs instead, which checks the wiring only."""
    from epmoe import EPMoE, TrainingConfig
    from tests.cpu.helpers import random_weights
    from tests.cpu.test_training import _reference_grads

    if device == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    else:  # the same checks on CPU ranks (reference experts): the test's own logic, run in tests/cpu
        dev = torch.device(device)
    cfg = _cfg()
    plan = None
    if dispatcher == "deepep" and dev.type == "cpu":  # stand-in: plan as on an sm90 host with DeepEP
        from epmoe.resolve import resolve_quant_plan
        from tests.cpu import fake_deep_ep

        fake_deep_ep.install()
        plans = {e: resolve_quant_plan(cfg, dispatcher="deepep", experts_backend=e, arch="sm90", ep_size=world)
                 for e in experts_list}
    w = random_weights(cfg, seed)
    X, L, gY = _global_batch(cfg, counts, seed + 1)
    lo, T = sum(counts[:rank]), counts[rank]
    ref_out, ref_gx, ref_gl, ref_gp = _reference_grads(cfg, w, X.double(), L.double(), None, gY.double())

    def run(experts, recompute):
        kw = dict(plan=plans[experts]) if dispatcher == "deepep" and dev.type == "cpu" else dict(experts=experts)
        layer = EPMoE(cfg, device=dev, dispatcher=dispatcher, shared_gpu=dev.type == "cuda", timeout_s=120,
                      training=TrainingConfig(recompute_experts=recompute), **kw)
        try:
            layer.load_weights(w)
            x = X[lo:lo + T].to(dev).requires_grad_()
            lg = L[lo:lo + T].to(dev).requires_grad_()
            y = layer(x, lg)
            (y.float() * gY[lo:lo + T].to(dev)).sum().backward()
            e0, e1 = layer.first_local_expert, layer.first_local_expert + layer.num_local_experts
            return dict(y=y, gx=x.grad, gl=lg.grad, w13=layer.w13.grad[:e1 - e0], w2=layer.w2.grad[:e1 - e0],
                        e=(e0, e1))
        finally:
            layer.close()  # collective (a DeepEP buffer)

    def check(experts):
        def fn():
            got = run(experts, False)
            e0, e1 = got["e"]
            errs = dict(out=_rel(got["y"], ref_out[lo:lo + T]), gx=_rel(got["gx"], ref_gx[lo:lo + T]),
                        gl=_rel(got["gl"], ref_gl[lo:lo + T]), w13=_rel(got["w13"], ref_gp[0][e0:e1]),
                        w2=_rel(got["w2"], ref_gp[1][e0:e1]))
            bad = {k: v for k, v in errs.items() if not v <= BF16_TOL}
            assert not bad, (experts, counts, errs)
            again = run(experts, True)  # recompute_experts: the same arithmetic, recomputed in backward
            for k in ("y", "gx", "gl", "w13", "w2"):  # (up to the order of CUDA's atomic adds)
                assert _rel(again[k], got[k]) < 1e-2, (experts, "recompute", k, _rel(again[k], got[k]))
            return f"{dispatcher}/{experts} T={counts}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        return fn

    return run_checks(f"rank {rank}", [(e, check(e)) for e in experts_list])


@pytest.mark.parametrize("counts", [(96, 0), (40, 71)])
def test_bf16_gradients_ranks_sharing_gpu(counts):
    from tests.cpu.helpers import fresh_seed

    seed = fresh_seed()
    per_rank = run_group(_shared_gpu_worker, 2, seed, counts, timeout=400, pg_timeout=200)
    assert_checks(per_rank, ["grouped_mm", "reference"], seed)


@pytest.mark.requires_deepep
@pytest.mark.parametrize("counts", [(96, 0), (40, 71, 0, 13)], ids=["ep2", "ep4"])
def test_bf16_gradients_through_deepep_ranks_sharing_gpu(counts):
    """Training through DeepEP's normal kernels: dispatch's backward is DeepEP's combine (the weights'
    gradients summed along), combine's backward its cached dispatch; 2 and 4 ranks sharing GPU 0, a
    rank with 0 tokens, against the float64 reference under autograd."""
    from tests.cpu.helpers import fresh_seed

    seed = fresh_seed()
    per_rank = run_group(_shared_gpu_worker, len(counts), seed, counts, "cuda", ("grouped_mm", "reference"),
                         "deepep", timeout=400, pg_timeout=200)
    assert_checks(per_rank, ["grouped_mm", "reference"], seed)


def test_grouped_mm_training_stage_matches_reference_and_inference():
    from epmoe import EPMoE
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.reference import ReferenceExperts
    from epmoe.experts.triton.grouped_mm import fused_grouped_mm_train_forward, grouped_mm_train_forward
    from tests.cpu.helpers import fresh_seed, random_weights

    seed = fresh_seed()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = _cfg()
    w = random_weights(cfg, seed)
    # the training forward of the layer vs its inference forward (Triton epilogue)
    layer = EPMoE(cfg, device=dev, experts="grouped_mm", training=True)
    layer.load_weights(w)
    X, L, gY = _global_batch(cfg, (300,), seed + 1)
    x, lg = X.to(dev), L.to(dev)
    with torch.no_grad():
        inf = layer(x, lg)
    train = layer(x, lg)
    assert _rel(train, inf) < 1e-2, _rel(train, inf)
    # the stage's gradients vs the reference experts (float64 parameters) under autograd
    ref_cfg = cfg.replace(dtype=torch.float64)
    ref = ReferenceExperts(ExpertsSpec(config=ref_cfg, ep_rank=0, ep_size=1, device=dev))
    ref.load_weights(w)
    N, K, E = 200, cfg.top_k, cfg.num_experts
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int32)
    ids[::5, 1] = -1
    wts = torch.rand(N, K, generator=g)
    xs = torch.randn(N, cfg.hidden_size, generator=g).to(torch.bfloat16)
    gy = torch.randn(N, cfg.hidden_size, generator=g)

    def grads(fn, dtype, params):
        xx = xs.to(dev, dtype).requires_grad_()
        ww = wts.to(dev).requires_grad_()
        ps = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        out = fn(xx, ww, ps)
        (out.double() * gy.to(dev).double()).sum().backward()
        return [out, xx.grad, ww.grad, ps["w13"].grad, ps["w2"].grad]

    ids_d = ids.to(dev)
    want = grads(lambda a, b, p: ref.train_forward(DispatchedTokens(a, ids_d, b.double()), p), torch.float64,
                 ref.parameters())
    got = grads(lambda a, b, p: grouped_mm_train_forward(a, ids_d, b, p, cfg, E), torch.bfloat16,
                {k: v for k, v in layer.experts.parameters().items() if k in ("w13", "w2")})
    errs = {n: _rel(a, b) for n, a, b in zip(["out", "x", "weights", "w13", "w2"], got, want)}
    assert all(v <= BF16_TOL for v in errs.values()), (seed, errs)
    # the fused stage (Triton gather / activation / combine and their backward kernels): what the layer runs
    fused = grads(lambda a, b, p: fused_grouped_mm_train_forward(a, ids_d, b, p, cfg, E, layer.experts._launch),
                  torch.bfloat16, {k: v for k, v in layer.experts.parameters().items() if k in ("w13", "w2")})
    errs = {n: _rel(a, b) for n, a, b in zip(["out", "x", "weights", "w13", "w2"], fused, want)}
    assert all(v <= BF16_TOL for v in errs.values()), (seed, "fused", errs)
    again = grads(lambda a, b, p: fused_grouped_mm_train_forward(a, ids_d, b, p, cfg, E, layer.experts._launch),
                  torch.bfloat16, {k: v for k, v in layer.experts.parameters().items() if k in ("w13", "w2")})
    assert all(torch.equal(a, b) for a, b in zip(fused[:3], again[:3])), "fused stage: not deterministic"
