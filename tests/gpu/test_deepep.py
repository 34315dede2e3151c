"""DeepEP dispatchers on real GPUs (DeepEP V1, docs/deepep.md).

One GPU (what runs today): DeepEP's normal kernels cannot run with one rank, so the one-GPU tests
drive the LOW-LATENCY path with ep_size = 1 (NVSHMEM with one PE; every message is a local copy):
dispatch exactness, masked reference experts + combine against float64, FP8 within its bound, an
empty batch, and the EPMoE layer on top. All checks run in ONE worker process (one NVSHMEM
initialisation; a crash there cannot take pytest down) and are reported per test.

Two GPUs (`multigpu(2)`): normal mode BF16 dispatch + combine equal to the torch dispatcher bit for
bit, normal-mode FP8 bytes exactly what was sent, low latency over two ranks against float64.

Opt-in experiment, one GPU: EPMOE_DEEPEP_SHARED_GPU=1 runs the two-rank NORMAL-mode check with both
ranks on GPU 0 (DeepEP's IPC buffers between two processes of one GPU; the GPU time-slices them, so
it is slow but exercises the real kernels). Run it under `timeout`: if time-slicing cannot make
progress, DeepEP's own timeout (~100 s) ends it.

Every check prints its seed on failure (EPMOE_TEST_SEED replays it).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.cpu.helpers import fresh_seed, max_rel_err, random_weights
from tests.cpu.mp import assert_checks, run_checks, run_group

pytestmark = [pytest.mark.gpu, pytest.mark.requires_deepep]

SHARED_GPU = os.environ.get("EPMOE_DEEPEP_SHARED_GPU") == "1"
# one-rank low-latency shape: H must be one DeepEP compiles (2048), M a multiple of 4
LL1 = dict(num_experts=16, top_k=4, hidden_size=2048, intermediate_size=128)
LL1_M, LL1_T = 64, 50


def _device(rank: int) -> torch.device:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _routing(seed: int, T: int, E: int, K: int, device, drop: float = 0.15):
    """Distinct experts per token (top-k of random scores, as DeepEP's tests do), some slots -1,
    and one token routed nowhere at all (it must come back as zeros)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32)
    if T:
        ids[torch.rand(T, K, generator=g) < drop] = -1
        ids[T // 2] = -1
    w = torch.rand(T, K, generator=g)
    return ids.to(device), w.to(device)


def _spec(rank, world, cfg_kw, M, device, payload, wire=None, **options):
    from epmoe.dispatch.base import DispatchSpec

    return DispatchSpec(
        group=None, ep_rank=rank, ep_size=world, num_experts=cfg_kw["num_experts"], top_k=cfg_kw["top_k"],
        hidden_size=cfg_kw["hidden_size"], max_tokens_per_rank=M, payload=payload, wire=wire,
        combine_dtype=torch.bfloat16, device=device, options=tuple(sorted(options.items())),
    )


# ------------------------------------------------------------------ one GPU: low latency, one rank
def _ll_one_rank_worker(rank, world, seed):
    from epmoe import EPMoE, MoEConfig, reference_moe
    from epmoe.core.errors import BackendUnavailableError
    from epmoe.dispatch import deepep as dd
    from epmoe.experts import ExpertsSpec
    from epmoe.experts.masked import MaskedReferenceExperts
    from epmoe.quant.payload import PayloadFormat
    from epmoe.quant.plan import QuantPlan
    from epmoe.routing import Routing

    dev = _device(rank)
    cfg = MoEConfig(dtype=torch.bfloat16, **LL1)
    E, K, H = cfg.num_experts, cfg.top_k, cfg.hidden_size
    w_all = random_weights(cfg, seed)
    bf16 = PayloadFormat.unquantized(torch.bfloat16)
    fp8 = dd.fp8_block_format()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(LL1_T, H, generator=g).to(torch.bfloat16).to(dev)
    ids, wts = _routing(seed + 2, LL1_T, E, K, dev)
    state = {}

    def experts(mode):
        ex = MaskedReferenceExperts(ExpertsSpec(config=cfg, ep_rank=0, ep_size=1, device=dev,
                                                plan=QuantPlan(expert_mode=mode, experts_backend="masked_reference")))
        ex.load_weights(w_all.to(device=dev))
        return ex

    def normal_mode_unavailable():
        a = dd.DeepEPDispatcher.availability(dev, 1)
        assert not a and "one rank" in a.reason, a.describe()
        try:
            dd.DeepEPDispatcher(_spec(0, 1, LL1, LL1_M, dev, bf16))
        except BackendUnavailableError as e:
            return f"refused as expected: {str(e)[:80]}..."
        raise AssertionError("DeepEPDispatcher(ep_size=1) did not refuse")

    def ll_bf16():
        d = dd.DeepEPLowLatencyDispatcher(_spec(0, 1, LL1, LL1_M, dev, bf16))
        state["buffer"], state["d_bf16"] = d.buffer, d
        tok, h = d.dispatch(x, ids, wts)
        counts = tok.expert_counts.cpu().long()
        want = torch.bincount(ids[ids >= 0].long().cpu(), minlength=E)
        assert torch.equal(counts, want), f"expert_counts {counts.tolist()} != {want.tolist()}"
        src_info = h.raw[0].cpu()  # DeepEP: source token of each received slot
        recv = tok.hidden.cpu()
        for e in range(E):
            n = int(counts[e])
            src = src_info[e, :n].long()
            assert torch.equal(recv[e, :n], x.cpu()[src]), f"expert {e}: received rows are not the sent rows"
            assert set(src.tolist()) == set((ids.cpu() == e).any(dim=1).nonzero().flatten().tolist())
        y = experts("bf16")(tok)
        out = d.combine(y, h)
        ref = reference_moe(cfg, x.cpu(), w_all, routing=Routing(topk_ids=ids.cpu(), topk_weights=wts.cpu()))
        err = max_rel_err(out, ref)
        assert err < 1e-2, f"combine vs float64: max rel err {err:.3g}"
        assert (out[LL1_T // 2] == 0).all(), "a token routed nowhere did not come back as zeros"
        assert d.stats.tokens_sent == 0 and h.bytes_sent == 0  # one rank: nothing leaves the GPU
        return f"max rel err {err:.2e}, buffer {d.buffer.sizes.num_rdma_bytes / 2**20:.1f} MiB"

    def ll_fp8():
        d = dd.DeepEPLowLatencyDispatcher(
            _spec(0, 1, LL1, LL1_M, dev, fp8, wire=fp8, deepep_buffer=state["buffer"]))
        tok, h = d.dispatch(x, ids, wts)
        q = tok.hidden
        assert q.data.dtype == torch.float8_e4m3fn and q.scales.dtype == torch.float32
        counts = tok.expert_counts.cpu()
        src_info = h.raw[0].cpu()
        deq = dd.fp8_block_dequantize(q.data, q.scales).cpu()
        scales = q.scales.float().cpu()
        xf = x.float().cpu()
        same = total = 0
        ours_d, _ = dd.fp8_block_quantize(x)
        for e in range(E):
            n = int(counts[e])
            src = src_info[e, :n].long()
            want = xf[src]
            bound = want.abs() * 2.0**-4 + scales[e, :n].repeat_interleave(128, dim=1) * 2.0**-9
            assert ((deq[e, :n] - want).abs() <= bound * 1.001 + 1e-12).all(), f"expert {e}: FP8 error above bound"
            same += int((q.data[e, :n].view(torch.uint8).cpu() == ours_d.cpu()[src].view(torch.uint8)).sum())
            total += n * H
        y = experts("fp8_block")(tok)
        out = d.combine(y, h)
        x_q = dd.fp8_block_dequantize(*dd.fp8_block_quantize(x.cpu()))
        ref = reference_moe(cfg, x_q, w_all, routing=Routing(topk_ids=ids.cpu(), topk_weights=wts.cpu()))
        err = max_rel_err(out, ref)
        assert err < 3e-2, f"FP8 combine vs float64 (of FP8-rounded input): max rel err {err:.3g}"
        d.close()  # not the owner: the shared buffer stays
        return f"max rel err {err:.2e}; DeepEP's FP8 bytes equal ours for {same / max(total, 1):.4%}"

    def empty_batch():
        d = state["d_bf16"]
        tok, h = d.dispatch(x[:0], ids[:0], wts[:0])
        out = d.combine(experts("bf16")(tok), h)
        assert out.shape == (0, H) and int(tok.expert_counts.sum()) == 0
        return "T=0 ok"

    def layer():
        # masked_reference is not in the quant plan's backend table yet: pass the plan explicitly
        plan = QuantPlan(expert_mode="bf16", dispatch_dtype="bf16", experts_backend="masked_reference",
                         dispatcher="deepep_ll", arch="sm90")
        layer = EPMoE(cfg, dispatcher="deepep_ll", device=dev, plan=plan, max_num_tokens_per_rank=LL1_M,
                      dispatcher_options={"deepep_buffer": state["buffer"]})
        layer.load_weights(w_all)
        g2 = torch.Generator().manual_seed(seed + 3)
        xs = torch.randn(2 * LL1_M + 5, H, generator=g2).to(torch.bfloat16).to(dev)
        logits = torch.randn(xs.shape[0], E, generator=g2).to(dev)
        res = layer(xs, logits, return_stats=True, return_routing=True)
        # the layer's own routing (GPU softmax) so that near-ties cannot pick other experts
        routing = Routing(topk_ids=res.routing.topk_ids.cpu(), topk_weights=res.routing.topk_weights.cpu())
        err = max_rel_err(res.hidden_states, reference_moe(cfg, xs.cpu(), w_all, routing=routing))
        assert res.stats.rounds == 3 and err < 1e-2, f"layer: rounds {res.stats.rounds}, max rel err {err:.3g}"
        return f"3 rounds, max rel err {err:.2e}"

    def timing():
        T = LL1_M
        xt = torch.randn(T, H, device=dev).to(torch.bfloat16)
        it, iw = _routing(seed + 4, T, E, K, dev, drop=0.0)
        d2 = dd.DeepEPLowLatencyDispatcher(_spec(0, 1, LL1, LL1_M, dev, bf16, deepep_buffer=state["buffer"],
                                                 check_inputs=False, count_bytes=False))
        tok, h = d2.dispatch(xt, it, iw)
        y = torch.zeros_like(tok.hidden)
        times = []
        for _ in range(20):
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record()
            tok, h = d2.dispatch(xt, it, iw)
            b.record()
            d2.combine(y, h)
            c.record()
            torch.cuda.synchronize()
            times.append((a.elapsed_time(b) * 1e3, b.elapsed_time(c) * 1e3))
        times.sort()
        disp, comb = times[len(times) // 2]
        return f"T={T} H={H} K={K} E={E}: dispatch {disp:.1f} us, combine {comb:.1f} us (median of 20)"

    results = run_checks("deepep-gpu", [
        ("normal_mode_unavailable", normal_mode_unavailable),
        ("ll_bf16", ll_bf16),
        ("ll_fp8", ll_fp8),
        ("empty_batch", empty_batch),
        ("layer", layer),
        ("timing", timing),
    ])
    if "buffer" in state:
        state["buffer"].close()
    return results


@pytest.fixture(scope="module")
def ll_one_rank():
    seed = fresh_seed()
    return seed, run_group(_ll_one_rank_worker, 1, seed, timeout=300, pg_timeout=300)[0]


def _check(ll_one_rank, name):
    seed, results = ll_one_rank
    ok, msg = results[name]
    assert ok, f"seed {seed}: {msg}"
    print(f"{name}: {msg}")


@pytest.mark.timeout(400)
def test_normal_mode_refuses_one_rank(ll_one_rank):
    _check(ll_one_rank, "normal_mode_unavailable")


@pytest.mark.timeout(400)
def test_ll_one_rank_bf16_rows_exact_and_combine_vs_float64(ll_one_rank):
    _check(ll_one_rank, "ll_bf16")


@pytest.mark.timeout(400)
def test_ll_one_rank_fp8_within_bound(ll_one_rank):
    _check(ll_one_rank, "ll_fp8")


@pytest.mark.timeout(400)
def test_ll_one_rank_empty_batch(ll_one_rank):
    _check(ll_one_rank, "empty_batch")


@pytest.mark.timeout(400)
def test_ll_one_rank_epmoe_layer_vs_float64(ll_one_rank):
    _check(ll_one_rank, "layer")


@pytest.mark.timeout(400)
def test_ll_one_rank_timing(ll_one_rank):
    _check(ll_one_rank, "timing")


# ------------------------------------------------------------------ two ranks: normal mode
NM = dict(num_experts=16, top_k=4, hidden_size=7168)
NM_M = 256


def _rowwise(tokens, first_expert):
    """Row-wise fake expert, fp32 and separate elementwise ops: bit-identical on CPU and GPU and
    independent of the batch, so the two dispatchers can be compared bit for bit."""
    x, ids, w = tokens.hidden.float(), tokens.topk_ids.long(), tokens.topk_weights.float()
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        c = torch.where(ids[:, k] >= 0, 1 + ((ids[:, k] + first_expert) % 5) * 0.25, torch.zeros((), device=x.device))
        w_k = torch.where(ids[:, k] >= 0, w[:, k], torch.zeros((), device=x.device))
        out += (w_k * c).unsqueeze(1) * x
    return out.to(torch.bfloat16)


def _source_order(raw, rank, world) -> torch.Tensor:
    """Permutation putting DeepEP's received rows in (source rank, source token) order, from its
    handle: rank_prefix_matrix [R, R] (raw[0]; [i][j] = rows ranks 0..i sent to j) and
    recv_src_idx [N] (raw[3])."""
    prefix = raw[0].cpu().long()[:, rank].tolist()
    src_idx = raw[3].cpu().long()
    bounds = [0] + prefix
    src_rank = torch.cat([torch.full((bounds[s + 1] - bounds[s],), s, dtype=torch.long) for s in range(world)])
    return torch.argsort(src_rank * (1 << 32) + src_idx)


def _normal_two_rank_worker(rank, world, seed):
    from epmoe.dispatch import deepep as dd
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher
    from epmoe.quant.payload import PayloadFormat

    dev = _device(rank)
    bf16 = PayloadFormat.unquantized(torch.bfloat16)
    fp8 = dd.fp8_block_format()
    T = 200 + 17 * rank
    g = torch.Generator().manual_seed(seed + rank)
    x_cpu = torch.randn(T, NM["hidden_size"], generator=g).to(torch.bfloat16)
    ids, wts = _routing(seed + 10 + rank, T, NM["num_experts"], NM["top_k"], dev)
    x = x_cpu.to(dev)
    first = rank * NM["num_experts"] // world

    def bf16_vs_torch():
        deep = dd.DeepEPDispatcher(_spec(rank, world, NM, NM_M, dev, bf16))
        state["buffer"] = deep.buffer
        ref = TorchA2ADispatcher(_spec(rank, world, NM, NM_M, torch.device("cpu"), bf16))
        tok_d, h_d = deep.dispatch(x, ids, wts)
        tok_r, h_r = ref.dispatch(x_cpu, ids.cpu(), wts.cpu())
        order = _source_order(h_d.raw, rank, world)  # DeepEP rows -> (source rank, token) order
        in_order = torch.equal(order, torch.arange(order.numel()))
        assert torch.equal(tok_d.hidden.cpu()[order], tok_r.hidden), "received rows differ from the torch dispatcher"
        assert torch.equal(tok_d.topk_ids.cpu()[order], tok_r.topk_ids), "local top-k ids differ"
        assert torch.equal(tok_d.topk_weights.cpu()[order], tok_r.topk_weights), "top-k weights differ"
        out_d = deep.combine(_rowwise(tok_d, first), h_d).cpu()
        out_r = ref.combine(_rowwise(tok_r, first), h_r)
        assert torch.equal(out_d, out_r), f"combine differs: {int((out_d != out_r).sum())} elements"
        assert deep.stats.tokens_sent == ref.stats.tokens_sent
        assert deep.stats.combine_bytes_sent == ref.stats.combine_bytes_sent
        return (f"{tok_d.hidden.shape[0]} rows received, bit-identical to the torch dispatcher "
                f"(DeepEP row order {'is' if in_order else 'is NOT'} source-rank-major, token-ascending)")

    def fp8_exact_bytes():
        d = dd.DeepEPDispatcher(_spec(rank, world, NM, NM_M, dev, fp8, wire=fp8, deepep_buffer=state["buffer"]))
        ref = TorchA2ADispatcher(_spec(rank, world, NM, NM_M, torch.device("cpu"), bf16))
        tok, h = d.dispatch(x, ids, wts)
        tok_r, _ = ref.dispatch(x_cpu, ids.cpu(), wts.cpu())  # which rows arrive
        order = _source_order(h.raw, rank, world)
        want_d, want_s = dd.fp8_block_quantize(tok_r.hidden)
        got_d, got_s = tok.hidden.data.cpu()[order], tok.hidden.scales.cpu()[order]
        assert torch.equal(got_d.view(torch.uint8), want_d.view(torch.uint8)), "FP8 data bytes differ"
        assert torch.equal(got_s, want_s), "FP8 scales differ"
        deq = dd.fp8_block_dequantize(got_d, got_s)
        xf = tok_r.hidden.float()
        bound = xf.abs() * 2.0**-4 + want_s.repeat_interleave(128, dim=1) * 2.0**-9
        assert ((deq - xf).abs() <= bound * 1.001 + 1e-12).all(), "FP8 error above the e4m3 bound"
        out = d.combine(torch.zeros(h.num_recv_tokens, NM["hidden_size"], dtype=torch.bfloat16, device=dev), h)
        assert out.shape == (T, NM["hidden_size"]) and not out.any()
        d.close()
        return "FP8 bytes exactly as sent, within the e4m3 bound"

    state = {}
    results = run_checks("deepep-gpu", [("bf16_vs_torch", bf16_vs_torch), ("fp8_exact_bytes", fp8_exact_bytes)])
    if "buffer" in state:
        state["buffer"].close()
    return results


@pytest.mark.multigpu(2)
@pytest.mark.timeout(300)
def test_normal_two_ranks_bf16_bit_exact_and_fp8():
    seed = fresh_seed()
    res = run_group(_normal_two_rank_worker, 2, seed, timeout=240, pg_timeout=240)
    assert_checks(res, ["bf16_vs_torch", "fp8_exact_bytes"], seed)


@pytest.mark.skipif(not SHARED_GPU, reason="opt-in experiment: set EPMOE_DEEPEP_SHARED_GPU=1 (two ranks on one GPU)")
@pytest.mark.timeout(200)
def test_normal_two_ranks_sharing_one_gpu():
    seed = fresh_seed()
    res = run_group(_normal_two_rank_worker, 2, seed, timeout=150, pg_timeout=150)
    assert_checks(res, ["bf16_vs_torch", "fp8_exact_bytes"], seed)


# ------------------------------------------------------------------ two ranks: low latency
def _ll_two_rank_worker(rank, world, seed):
    from epmoe import MoEConfig, reference_moe
    from epmoe.dispatch import deepep as dd
    from epmoe.experts import ExpertsSpec
    from epmoe.experts.masked import MaskedReferenceExperts
    from epmoe.quant.plan import QuantPlan
    from epmoe.routing import Routing

    dev = _device(rank)
    cfg = MoEConfig(dtype=torch.bfloat16, **LL1)
    w_all = random_weights(cfg, seed)
    lo = rank * cfg.num_experts // world
    T = 40 + 7 * rank
    g = torch.Generator().manual_seed(seed + 5 + rank)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16).to(dev)
    ids, wts = _routing(seed + 6 + rank, T, cfg.num_experts, cfg.top_k, dev)
    state = {}

    def run(mode):
        ex = MaskedReferenceExperts(ExpertsSpec(config=cfg, ep_rank=rank, ep_size=world, device=dev,
                                                plan=QuantPlan(expert_mode=mode, experts_backend="masked_reference")))
        ex.load_weights(w_all.slice_experts(lo, lo + cfg.num_experts // world).to(device=dev))
        wire = dd.fp8_block_format() if mode == "fp8_block" else None
        opts = {"deepep_buffer": state["buffer"]} if "buffer" in state else {}
        d = dd.DeepEPLowLatencyDispatcher(_spec(rank, world, LL1, LL1_M, dev, ex.payload_format, wire=wire, **opts))
        state.setdefault("buffer", d.buffer)
        tok, h = d.dispatch(x, ids, wts)
        out = d.combine(ex(tok), h)
        x_ref = x.cpu()
        if wire is not None:
            x_ref = dd.fp8_block_dequantize(*dd.fp8_block_quantize(x_ref))
        ref = reference_moe(cfg, x_ref, w_all, routing=Routing(topk_ids=ids.cpu(), topk_weights=wts.cpu()))
        err = max_rel_err(out, ref)
        assert err < (3e-2 if wire is not None else 1e-2), f"{mode}: max rel err {err:.3g}"
        remote = int(((ids >= 0) & (ids.long() // (cfg.num_experts // world) != rank)).sum())
        assert d.stats.tokens_sent == remote
        return f"max rel err {err:.2e}, {remote} messages to the other rank"

    results = run_checks("deepep-gpu", [("ll_bf16", lambda: run("bf16")), ("ll_fp8", lambda: run("fp8_block"))])
    if "buffer" in state:
        state["buffer"].close()
    return results


@pytest.mark.skipif(not SHARED_GPU, reason="opt-in experiment: set EPMOE_DEEPEP_SHARED_GPU=1 (two ranks on one GPU)")
@pytest.mark.timeout(200)
def test_ll_two_ranks_sharing_one_gpu():
    """Low latency with both ranks on GPU 0 (two NVSHMEM PEs on one device)."""
    seed = fresh_seed()
    res = run_group(_ll_two_rank_worker, 2, seed, timeout=150, pg_timeout=150)
    assert_checks(res, ["ll_bf16", "ll_fp8"], seed)


@pytest.mark.multigpu(2)
@pytest.mark.timeout(300)
def test_ll_two_ranks_vs_float64():
    seed = fresh_seed()
    res = run_group(_ll_two_rank_worker, 2, seed, timeout=240, pg_timeout=240)
    assert_checks(res, ["ll_bf16", "ll_fp8"], seed)
