"""epmoe's DeepEP dispatchers end to end on two real gloo ranks, with `tests/cpu/fake_deep_ep.py`
standing in for DeepEP (same Python API and semantics, plus its assertions). Checks the wrapper:
int32 <-> int64 ids, local ids, FP8 packing, handles, masked layout, stats, empty batches, input
agreement across ranks, shared buffers, and the EPMoE layer on top. The real kernels are checked
by tests/gpu/test_deepep.py."""

from __future__ import annotations


import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.dispatch.base import DispatchSpec
from epmoe.quant.payload import PayloadFormat
from epmoe.routing import Routing
from tests.cpu.helpers import fresh_seed, max_rel_err, random_weights
from tests.cpu.mp import assert_checks, run_group

BF16 = PayloadFormat.unquantized(torch.bfloat16)
E, K, H, M = 8, 3, 2048, 8


def _install_fake():
    from tests.cpu import fake_deep_ep

    return fake_deep_ep.install(), fake_deep_ep


def _spec(rank, world, payload=BF16, wire=None, **options):
    return DispatchSpec(
        group=None, ep_rank=rank, ep_size=world, num_experts=E, top_k=K, hidden_size=H, max_tokens_per_rank=M,
        payload=payload, wire=wire, combine_dtype=torch.bfloat16, device=torch.device("cpu"),
        options=tuple(sorted(options.items())),
    )


def _inputs(seed, T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32) if T else \
        torch.zeros(0, K, dtype=torch.int32)
    if T:
        ids[torch.rand(T, K, generator=g) < 0.2] = -1  # padding slots
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def _rowwise(tokens, first_expert):
    """A row-wise fake expert (deterministic per row, whatever the batch): sum_k w_k * x * c(e_k)."""
    x, ids, w = tokens.hidden.float(), tokens.topk_ids.long(), tokens.topk_weights.float()
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        c = torch.where(ids[:, k] >= 0, 1 + ((ids[:, k] + first_expert) % 5) * 0.25, torch.zeros(()))
        w_k = torch.where(ids[:, k] >= 0, w[:, k], torch.zeros(()))
        out += (w_k * c).unsqueeze(1) * x
    return out.to(torch.bfloat16)


def _normal_worker(rank, world, seed):
    dd, fake = _install_fake()
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher

    x, ids, w = _inputs(seed + rank, 6 + 2 * rank)
    deep, ref = dd.DeepEPDispatcher(_spec(rank, world)), TorchA2ADispatcher(_spec(rank, world))
    tok_d, h_d = deep.dispatch(x, ids, w)
    tok_r, h_r = ref.dispatch(x, ids, w)
    assert tok_d.layout == "flat" and tok_d.topk_ids.dtype == torch.int32
    assert torch.equal(tok_d.hidden, tok_r.hidden), "received rows differ from the torch dispatcher"
    assert torch.equal(tok_d.topk_ids, tok_r.topk_ids), "local ids differ"
    assert torch.equal(tok_d.topk_weights, tok_r.topk_weights)
    first = rank * (E // world)
    out_d = deep.combine(_rowwise(tok_d, first), h_d)
    out_r = ref.combine(_rowwise(tok_r, first), h_r)
    assert out_d.dtype == torch.bfloat16 and torch.equal(out_d, out_r), "combine differs from the torch dispatcher"
    assert deep.stats.tokens_sent == ref.stats.tokens_sent
    assert deep.stats.combine_bytes_sent == ref.stats.combine_bytes_sent
    assert h_d.bytes_sent == deep.stats.tokens_sent * H * 2
    assert h_d.recv_tokens_per_expert == tuple(int((tok_d.topk_ids == e).sum()) for e in range(E // world))
    calls = deep.buffer.raw.calls
    assert [c[0] for c in calls] == ["get_dispatch_layout", "dispatch", "combine"]
    assert calls[0][1] == torch.int64 and calls[1][3] == torch.int64  # int64 at DeepEP's boundary
    assert calls[1][4].args == (20, 24, 256, 6, 128) and calls[2][2].args == (20, 10, 256, 6, 128)
    assert deep.buffer.sizes.num_nvl_bytes == dd.deepep_buffer_bytes(
        low_latency=False, hidden_size=H, ep_size=world, num_experts=E, top_k=K, max_tokens_per_rank=M
    ).num_nvl_bytes
    deep.close()
    assert deep.buffer is None and calls is fake.Buffer.instances[-1].calls and fake.Buffer.instances[-1].destroyed
    return True


def test_normal_mode_matches_the_torch_dispatcher_bit_for_bit():
    seed = fresh_seed()
    assert run_group(_normal_worker, 2, seed, timeout=120) == [True, True], f"seed {seed}"


def _fp8_worker(rank, world, seed):
    dd, _ = _install_fake()
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher

    x, ids, w = _inputs(seed + rank, 7)
    fp8 = dd.fp8_block_format()
    out = {}
    for payload in (fp8, BF16):  # experts take FP8, or BF16 dequantized on arrival
        d = dd.DeepEPDispatcher(_spec(rank, world, payload=payload, wire=fp8))
        ref = TorchA2ADispatcher(_spec(rank, world, payload=payload, wire=fp8))
        tok, h = d.dispatch(x, ids, w)
        tok_r, _ = ref.dispatch(x, ids, w)
        if payload == fp8:  # the FP8 rows the torch dispatcher delivers, byte for byte
            assert torch.equal(tok.hidden.data.view(torch.uint8), tok_r.hidden.data.view(torch.uint8))
            assert torch.equal(tok.hidden.scales, tok_r.hidden.scales), "FP8 scales differ from the torch dispatcher's"
        else:
            assert torch.equal(tok.hidden, tok_r.hidden), "dequantized rows differ from the torch dispatcher's"
        out[payload.name] = tok.hidden
        y = torch.zeros(h.num_recv_tokens, H, dtype=torch.bfloat16)
        assert d.combine(y, h).shape == (7, H)
        assert d.buffer.raw.calls[1][1:3] == (torch.float8_e4m3fn, torch.float32)
        assert h.bytes_sent == d.stats.tokens_sent * (H + H // 128 * 4)
        d.close()
    q = out["fp8_block"]
    deq = dd.fp8_block_dequantize(q.data, q.scales, torch.bfloat16)
    assert q.data.dtype == torch.float8_e4m3fn and q.scales.shape == (q.data.shape[0], H // 128)
    assert torch.equal(deq, out["bf16"]), "dequantize-on-arrival differs from the FP8 payload"
    return q.data.view(torch.uint8), q.scales, x, ids


def test_normal_mode_fp8_sends_the_codec_bytes_like_the_torch_dispatcher():
    """Stand-in for DeepEP (argument assembly and row bookkeeping; the kernels: tests/gpu/test_deepep.py):
    the FP8 normal mode hands DeepEP `codec.quantize_for_wire`'s bytes, so a rank receives exactly what
    the torch dispatcher's FP8 wire delivers, and BF16 experts get the same dequantized rows."""
    from epmoe.quant import codec

    seed = fresh_seed()
    res = run_group(_fp8_worker, 2, seed, timeout=120)
    # rank r receives the FP8 rows of every token (source-rank-major) that has an expert on r
    for r, (data, scales, _, _) in enumerate(res):
        want = []
        for s in range(2):
            x, ids = res[s][2], res[s][3]
            on_r = ((ids >= 0) & (ids.long() // (E // 2) == r)).any(dim=1)
            want.append(x[on_r])
        q = codec.quantize_for_wire(torch.cat(want), codec.FP8_BLOCK)
        assert torch.equal(data, q.data.view(torch.uint8)) and torch.equal(scales, q.scales), f"seed {seed} rank {r}"


def _ll_worker(rank, world, seed, tokens_per_rank, fp8):
    dd, fake = _install_fake()
    from epmoe.experts import ExpertsSpec
    from epmoe.experts.masked import MaskedReferenceExperts
    from epmoe.quant.plan import QuantPlan

    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, dtype=torch.bfloat16)
    plan = QuantPlan(expert_mode="fp8_block" if fp8 else "bf16", dispatch_dtype="fp8" if fp8 else "bf16")
    experts = MaskedReferenceExperts(ExpertsSpec(config=cfg, ep_rank=rank, ep_size=world,
                                                 device=torch.device("cpu"), plan=plan))
    w_all = random_weights(cfg, seed)
    lo = rank * (E // world)
    experts.load_weights(w_all.slice_experts(lo, lo + E // world))
    wire = dd.fp8_block_format() if fp8 else None
    d = dd.DeepEPLowLatencyDispatcher(_spec(rank, world, payload=experts.payload_format, wire=wire))
    T = tokens_per_rank[rank]
    x, ids, w = _inputs(seed + 17 * rank, T)
    tok, h = d.dispatch(x, ids, w)
    assert tok.layout == "masked" and tok.topk_ids is None and tok.topk_weights is None
    data = tok.hidden.data if fp8 else tok.hidden
    assert tuple(data.shape) == (E // world, world * M, H)
    assert tok.expert_counts.dtype == torch.int32
    y = experts(tok)
    out = d.combine(y, h)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    pairs_remote = int(((ids >= 0) & (ids.long() // (E // world) != rank)).sum())
    assert d.stats.tokens_sent == pairs_remote and h.bytes_sent == pairs_remote * (
        H + H // 128 * 4 if fp8 else 2 * H)
    calls = d.buffer.raw.calls
    assert calls[0][:5] == ("low_latency_dispatch", torch.int64, M, E, fp8) and calls[1][2] == torch.int64
    assert d.buffer.raw.num_qps_per_rank == E // world
    d.close()
    return x, ids, w, out, tok.expert_counts


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_with_masked_experts_matches_float64_reference(fp8):
    import epmoe.dispatch.deepep as dd

    seed = fresh_seed()
    tokens = [5, 0] if fp8 else [8, 3]  # an empty rank too
    res = run_group(_ll_worker, 2, seed, tokens, fp8, timeout=180)
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, dtype=torch.bfloat16)
    w_all = random_weights(cfg, seed)
    counts = torch.zeros(E, dtype=torch.int64)
    for x, ids, w, out, got_counts in res:
        counts += torch.bincount(ids[ids >= 0].long(), minlength=E)
        x_ref = dd.fp8_block_dequantize(*dd.fp8_block_quantize(x)) if fp8 and x.shape[0] else x
        ref = reference_moe(cfg, x_ref, w_all, routing=Routing(topk_ids=ids, topk_weights=w))
        err = max_rel_err(out, ref)
        assert err < 1e-2, f"seed {seed} fp8={fp8}: max rel err {err:.3g}"
    assert torch.equal(torch.cat([r[4] for r in res]).long(), counts), f"seed {seed}: per-expert counts"


def _bad_input_worker(rank, world, seed):
    dd, _ = _install_fake()
    d = dd.DeepEPLowLatencyDispatcher(_spec(rank, world))
    x, ids, w = _inputs(seed + rank, 4)
    if rank == 0:
        ids[1, 0] = E  # out of range on one rank only
    try:
        d.dispatch(x, ids, w)
    finally:
        d.close()


def test_bad_input_on_one_rank_raises_on_every_rank():
    errs = run_group(_bad_input_worker, 2, fresh_seed(), timeout=120, expect_errors=True)
    assert errs[0].startswith("ValueError") and f"expert id {E} outside [0, {E})" in errs[0]
    assert errs[1].startswith("PeerInputError") and "rank 0" in errs[1]


def _shared_buffer_worker(rank, world):
    dd, fake = _install_fake()
    a = dd.DeepEPLowLatencyDispatcher(_spec(rank, world))
    n = len(fake.Buffer.instances)
    b = dd.DeepEPLowLatencyDispatcher(_spec(rank, world, deepep_buffer=a.buffer, check_inputs=False))
    assert len(fake.Buffer.instances) == n and b.buffer is a.buffer
    assert repr(a.buffer).startswith("DeepEPBuffer(low_latency=True, ep_size=2")
    x, ids, w = _inputs(rank, 4)
    tok, h = b.dispatch(x, ids, w)
    b.close()  # not the owner: the buffer stays
    assert not a.buffer.closed
    errors = []
    for bad in (dict(deepep_buffer="nope"),):
        try:
            dd.DeepEPLowLatencyDispatcher(_spec(rank, world, **bad))
        except TypeError as e:
            errors.append(str(e))
    spec = DispatchSpec(group=None, ep_rank=rank, ep_size=world, num_experts=E, top_k=K, hidden_size=H,
                        max_tokens_per_rank=2 * M, payload=BF16, combine_dtype=torch.bfloat16,
                        device=torch.device("cpu"), options=(("deepep_buffer", a.buffer),))
    try:
        dd.DeepEPLowLatencyDispatcher(spec)
    except ValueError as e:
        errors.append(str(e))
    small = DispatchSpec(group=None, ep_rank=rank, ep_size=world, num_experts=E, top_k=K, hidden_size=H,
                         max_tokens_per_rank=M, payload=BF16, combine_dtype=torch.bfloat16,
                         device=torch.device("cpu"), workspace_bytes=1024)
    try:
        dd.DeepEPLowLatencyDispatcher(small)
    except ValueError as e:
        errors.append(str(e))
    a.close()
    assert a.buffer is None
    return errors


def test_shared_buffer_and_sizing_errors():
    errs = run_group(_shared_buffer_worker, 2, timeout=120)[0]
    assert "pass a DeepEPBuffer" in errs[0]
    assert "smaller than this dispatcher needs" in errs[1] or "must agree" in errs[1]
    assert "workspace_bytes=1024 is below" in errs[2]


def _layer_worker(rank, world, seed, dispatcher, experts, tokens_per_rank, eplb=False):
    _install_fake()
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, dtype=torch.bfloat16)
    from epmoe import EPLBConfig
    from epmoe.resolve import resolve_quant_plan

    # stand-in test: plan as on an sm90 host with DeepEP (the fake runs on CPU)
    plan = resolve_quant_plan(cfg, dispatcher=dispatcher, experts_backend=experts, arch="sm90", ep_size=world)
    layer = EPMoE(cfg, dispatcher=dispatcher, device="cpu", max_num_tokens_per_rank=M, plan=plan,
                  eplb=EPLBConfig(num_redundant_experts=2) if eplb else None)
    layer.load_weights(random_weights(cfg, seed))
    g = torch.Generator().manual_seed(seed + 100 + rank)
    x = torch.randn(tokens_per_rank[rank], H, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens_per_rank[rank], E, generator=g)
    out = layer(x, logits, return_stats=True)
    outs = [out.hidden_states]
    if eplb:  # EPLB: the fake DeepEP gets slot ids of 10 slots; rebalanced, the next call too
        assert layer.rebalance(load=[1] * (E - 2) + [80, 90], force=True).moved_slots > 0
        outs.append(layer(x, logits))
    layer.dispatcher.close()
    return x, logits, outs, out.stats.rounds


@pytest.mark.parametrize("dispatcher,experts,eplb", [("deepep", "reference", False),
                                                     ("deepep_ll", "masked_reference", False),
                                                     ("deepep", "reference", True),
                                                     ("deepep_ll", "masked_reference", True)])
def test_epmoe_layer_over_deepep_matches_reference(dispatcher, experts, eplb):
    """eplb=True: the layer's slot ids through the DeepEP wrapper (stand-in: argument assembly, not
    DeepEP's kernels), with redundant experts, before and after a rebalance."""
    seed = fresh_seed()
    tokens = [2 * M + 3, 5]  # three rounds on rank 0
    res = run_group(_layer_worker, 2, seed, dispatcher, experts, tokens, eplb, timeout=240)
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, dtype=torch.bfloat16)
    w = random_weights(cfg, seed)
    for rank, (x, logits, ys, rounds) in enumerate(res):
        assert rounds == 3 and len(ys) == (2 if eplb else 1)
        for y in ys:
            err = max_rel_err(y, reference_moe(cfg, x, w, logits))
            assert err < 1e-2, f"{dispatcher} seed {seed} rank {rank}: max rel err {err:.3g}"


@pytest.mark.parametrize("worker", ["normal", "low_latency"])
def test_gpu_shared_workers_run_on_the_stand_in(worker):
    """tests/gpu/test_deepep.py's ep = 4 workers (uneven tokens, a rank at 0), run here with the stand-in
    deep_ep on CPU: this checks the GPU test's own plumbing and references (the stand-in proves nothing
    about DeepEP's kernels)."""
    from tests.gpu import test_deepep as gpu

    seed = fresh_seed()
    if worker == "normal":
        res = run_group(gpu._normal_worker, 4, seed, gpu.NM_COUNTS[4], False, True, timeout=240)
        skipped = assert_checks(res, gpu.NORMAL_CHECKS, seed)
    else:
        res = run_group(gpu._ll_worker, 4, seed, gpu.LL_COUNTS[4], False, True, timeout=240)
        skipped = assert_checks(res, gpu.LL_CHECKS, seed)
    # the checks with GPU experts (triton, deepgemm) cannot run here: skipped, named, never passed
    assert skipped and all("needs the GPU" in s for s in skipped), skipped


def test_fp8_diag_script_runs_on_the_stand_in():
    """tests/gpu/deepep_fp8_diag.py with the stand-in deep_ep: its plumbing (gathering the senders' rows,
    ordering them through DeepEP's handle, the reports) works; on the GPU it reports on the real kernels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "tests/gpu/deepep_fp8_diag.py", "--fake", "--ranks", "2"], cwd=repo,
                       capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("A (arrived vs sent): bit for bit") == 6 and r.stdout.count("verdict: DeepEP moved") == 2
    assert "scales float32 [200, 56] stride (1, 200)" in r.stdout  # the column-major case went in as such
