"""FlashInferA2ADispatcher on real GPUs (FlashInfer's `mnnvl_moe_alltoall` module, prebuilt).

Checks, DeepSeek-V3 shape (H=7168, E=256, top-8):
  * BF16: dispatch -> row-wise stand-in experts -> combine equals a pure-torch reference of the
    dispatch/combine math bit for bit, and equals TorchA2ADispatcher bit for bit when it exists
    (ep <= 2: at most two partial sums per token, so the float32 sum order cannot matter).
  * NVFP4 wire: the bytes arrive unchanged (result equals the reference computed on the NVFP4 round
    trip of the input, bit for bit) and the round trip is within the NVFP4 error bound.
  * 1 GPU with ep=1 (no process group, and a gloo group of size 1), 2 GPUs with ep=2 (spawned).
Nothing else is JIT-compiled: the dispatcher only loads `mnnvl_moe_alltoall`.
"""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.requires_flashinfer,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
]

E, K, H = 256, 8, 7168


def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def make_inputs(seed, counts, device):
    """Every rank's (hidden bf16 [T, H], ids int32 [T, K] with some -1, weights f32): generated on
    the CPU from one seed, so every process knows every rank's batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in counts:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
        if T:
            ids[torch.rand(T, K, generator=g) < 0.1] = -1
            ids[0, 1:] = -1
        w = torch.rand(T, K, generator=g)
        out.append((x.to(device), ids.to(device), w.to(device)))
    return out


def _coef(w, gid):
    return w * (1.0 + gid.float() / E)


def fake_experts(tokens, first, dtype=torch.bfloat16):
    """Row-wise stand-in experts: y = sum_k w_k (1 + gid_k / E) x over local ids, float32."""
    x = tokens.hidden
    if not isinstance(x, torch.Tensor):
        from epmoe.quant.codec import dequantize_activation

        x = dequantize_activation(x, torch.float32)
    x = x.float()
    lid, w = tokens.topk_ids, tokens.topk_weights
    acc = torch.zeros_like(x)
    for k in range(lid.shape[1]):
        ok = lid[:, k] >= 0
        c = torch.where(ok, _coef(w[:, k], lid[:, k] + first), torch.zeros_like(w[:, k]))
        acc += c.unsqueeze(1) * x
    return acc.to(dtype)


def reference(x, ids, w, ep):
    """What combine must return for one rank's batch: per owner rank the float32 partial (k in
    order) cast to bf16, then the float32 sum of the partials, cast to bf16."""
    per = E // ep
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for r in range(ep):
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for k in range(ids.shape[1]):
            e = ids[:, k]
            mine = (e >= 0) & (e // per == r)
            c = torch.where(mine, _coef(w[:, k], e), torch.zeros_like(w[:, k]))
            acc += c.unsqueeze(1) * x.float()
        out += acc.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def nvfp4_roundtrip(x):
    """What a receiver dequantizes: the sender's codec quantization (dynamic per-rank global scale)."""
    from epmoe.quant.codec import NVFP4, dequantize_activation, quantize_activation

    return dequantize_activation(quantize_activation(x, NVFP4), torch.float32)


def _spec(rank, ep, max_t, payload=None, group=None, **opts):
    from epmoe.dispatch.base import DispatchSpec
    from epmoe.quant.payload import PayloadFormat

    return DispatchSpec(
        group=group, ep_rank=rank, ep_size=ep, num_experts=E, top_k=K, hidden_size=H,
        max_tokens_per_rank=max_t, payload=payload or PayloadFormat.unquantized(torch.bfloat16),
        combine_dtype=torch.bfloat16, device=torch.device("cuda", torch.cuda.current_device()),
        options=tuple(opts.items()),
    )


def _nvfp4_format():
    from epmoe.quant.codec import NVFP4

    return NVFP4


def round_trip(dispatcher, x, ids, w, **kw):
    tokens, handle = dispatcher.dispatch(x, ids, w, **kw)
    y = fake_experts(tokens, dispatcher.spec.first_local_expert)
    out = dispatcher.combine(y, handle)
    torch.cuda.synchronize()
    return out, tokens, handle


def _check_arrivals(tokens, handle, ids_all, rank, ep):
    """Each token owning an expert on `rank` arrives once, from its source block, with local ids."""
    per = E // ep
    rt = handle.runtime_max_tokens_per_rank
    lid = tokens.topk_ids.cpu()
    got = sorted((row // rt, tuple(lid[row].tolist())) for row in range(ep * rt) if (lid[row] >= 0).any())
    want = sorted(
        (s, tuple(int(e) - rank * per if e >= 0 and e // per == rank else -1 for e in row.tolist()))
        for s, ids in enumerate(ids_all) for row in ids.cpu() if any(e >= 0 and e // per == rank for e in row.tolist())
    )
    assert got == want


def _check_plan_workspace(d, ep, max_t):
    """The quant plan's workspace formula must equal FlashInfer's own sizing."""
    try:
        from epmoe.quant.workspace import flashinfer_a2a_workspace_bytes
    except ImportError:
        return
    want = flashinfer_a2a_workspace_bytes(ep, max_t, d.dispatch_bytes_per_token, d.combine_bytes_per_token)
    assert d.workspace_bytes_required == want, (
        f"FlashInfer sizes {d.workspace_bytes_required} B/rank, epmoe.quant.workspace says {want}"
    )


def _torch_reference_dispatcher(spec):
    try:
        from epmoe.dispatch.torch_a2a import TorchA2ADispatcher
    except ImportError:
        return None
    return TorchA2ADispatcher(spec)


# ----------------------------------------------------------------------------- 1 GPU, ep = 1
@pytest.mark.parametrize("T", [128, 1, 0])
def test_bf16_single_gpu_bit_exact(T):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    seed = 4242 + T
    dev = torch.device("cuda", torch.cuda.current_device())
    (x, ids, w), = make_inputs(seed, [T], dev)
    d = FlashInferA2ADispatcher(_spec(0, 1, 128))
    try:
        out, tokens, handle = round_trip(d, x, ids, w)
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        assert torch.equal(out, reference(x, ids, w, 1)), f"seed={seed}"
        _check_arrivals(tokens, handle, [ids], 0, 1)
        assert handle.runtime_max_tokens_per_rank == max(1, T)
        st = d.stats
        assert st.dispatch_bytes_sent == 0 and st.combine_bytes_sent == 0  # ep=1: nothing leaves the GPU
        _check_plan_workspace(d, 1, 128)
        ref_d = _torch_reference_dispatcher(_spec(0, 1, 128)) if T else None
        if ref_d is not None:
            t2, h2 = ref_d.dispatch(x, ids, w)
            out2 = ref_d.combine(fake_experts(t2, 0), h2)
            assert torch.equal(out, out2), f"seed={seed}: FlashInfer and torch dispatchers differ"
        print(f"[flashinfer-a2a] ep=1 T={T} bf16 bit-exact vs reference"
              f"{' and TorchA2ADispatcher' if ref_d is not None else ''}; workspace {d.workspace_bytes_per_rank} B/rank")
    finally:
        d.close()


def test_bf16_single_gpu_gloo_group_of_one():
    """The MNNVL handles exchanged through torch.distributed (a gloo group of world size 1)."""
    import torch.distributed as dist

    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    created = False
    if not dist.is_initialized():
        port = _free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        created = True
    try:
        seed = 99
        dev = torch.device("cuda", torch.cuda.current_device())
        (x, ids, w), = make_inputs(seed, [64], dev)
        d = FlashInferA2ADispatcher(_spec(0, 1, 96, group=dist.group.WORLD))
        assert d._comm_kind == "torch"
        try:
            out, _, _ = round_trip(d, x, ids, w)
            assert torch.equal(out, reference(x, ids, w, 1)), f"seed={seed}"
            out, _, h = round_trip(d, x, ids, w, runtime_max_tokens_per_rank=96)  # a second round
            assert h.runtime_max_tokens_per_rank == 96 and torch.equal(out, reference(x, ids, w, 1))
        finally:
            d.close()
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.skipif(not _has("epmoe.quant.codec"), reason="needs epmoe.quant.codec")
def test_nvfp4_single_gpu():
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    seed = 7
    dev = torch.device("cuda", torch.cuda.current_device())
    (x, ids, w), = make_inputs(seed, [128], dev)
    nv = _nvfp4_format()
    d = FlashInferA2ADispatcher(_spec(0, 1, 128, payload=nv))
    try:
        out, tokens, _ = round_trip(d, x, ids, w)
        assert tokens.hidden.format.name == "nvfp4"
        xq = nvfp4_roundtrip(x)
        assert torch.equal(out, reference(xq, ids, w, 1)), f"seed={seed}: NVFP4 bytes changed in transit"
        blk = x.float().view(-1, H // 16, 16).abs().amax(-1, keepdim=True)
        err = (xq.view(-1, H // 16, 16) - x.float().view(-1, H // 16, 16)).abs()
        assert (err <= 0.2 * blk + 1e-6).all(), f"seed={seed}: NVFP4 error beyond its bound"
        _check_plan_workspace(d, 1, 128)
        print(f"[flashinfer-a2a] ep=1 nvfp4 bytes exact; {d.dispatch_bytes_per_token} B/token on the wire "
              f"(bf16: {H * 2 + 8 * K})")
    finally:
        d.close()


# ----------------------------------------------------------------------------- 2 GPUs, ep = 2
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_gpu_worker(rank, port, with_nvfp4):
    import torch.distributed as dist

    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        dev = torch.device("cuda", rank)
        counts = [128, 77]
        seed = 2024
        inputs = make_inputs(seed, counts, dev)
        x, ids, w = inputs[rank]
        d = FlashInferA2ADispatcher(_spec(rank, 2, 128, group=dist.group.WORLD))
        try:
            out, tokens, handle = round_trip(d, x, ids, w)
            assert torch.equal(out, reference(x, ids, w, 2)), f"seed={seed} rank={rank}"
            _check_arrivals(tokens, handle, [i for _, i, _ in inputs], rank, 2)
            per = E // 2
            sends = sum(len({int(e) // per for e in row if e >= 0} - {rank}) for row in ids.cpu().tolist())
            assert d.stats.tokens_sent == sends
            assert d.stats.dispatch_bytes_sent == sends * d.dispatch_bytes_per_token
            ref_d = _torch_reference_dispatcher(_spec(rank, 2, 128, group=dist.group.WORLD))
            if ref_d is not None:
                t2, h2 = ref_d.dispatch(x, ids, w)
                out2 = ref_d.combine(fake_experts(t2, d.spec.first_local_expert), h2)
                assert torch.equal(out, out2), f"seed={seed} rank={rank}: FlashInfer != torch dispatcher"
            # uniform mode (no per-call collective) with equal T on both ranks
            out, _, h = round_trip(d, x[:64].contiguous(), ids[:64].contiguous(), w[:64].contiguous(), runtime_max_tokens_per_rank=64)
            assert torch.equal(out, reference(x[:64], ids[:64], w[:64], 2))
        finally:
            d.close()
        if with_nvfp4:
            d = FlashInferA2ADispatcher(_spec(rank, 2, 128, payload=_nvfp4_format(), group=dist.group.WORLD))
            try:
                out, _, _ = round_trip(d, x, ids, w)
                # each rank quantizes with its own dynamic global scale; the reference knows both
                xq = nvfp4_roundtrip(x)
                assert torch.equal(out, reference(xq, ids, w, 2)), f"seed={seed} rank={rank}: NVFP4 differs"
            finally:
                d.close()
        if rank == 0:
            print(f"[flashinfer-a2a] ep=2 bf16 bit-exact{' + nvfp4' if with_nvfp4 else ''} on 2 GPUs")
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu(2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_bit_exact():
    import torch.multiprocessing as mp

    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    avail = FlashInferA2ADispatcher.availability(torch.device("cuda", 0), 2)
    if not avail:
        pytest.skip(avail.describe())
    with_nvfp4 = _has("epmoe.quant.codec")
    mp.spawn(_two_gpu_worker, args=(_free_port(), with_nvfp4), nprocs=2, join=True)


# ----------------------------------------------------------------------------- in the layer
def test_layer_with_flashinfer_dispatcher_and_cuda_graph():
    """EPMoE(dispatcher="flashinfer") on one GPU: eager matches the float64 reference layer, and the
    decode runner (static shapes, CUDA-graph capture of dispatch/experts/combine) replays bit for
    bit what it computes eagerly."""
    from epmoe import EPMoE, MoEConfig, reference_moe
    from tests.cpu.helpers import fresh_seed, max_rel_err, random_inputs, random_weights

    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    seed = fresh_seed()
    layer = EPMoE(cfg, device="cuda", dispatcher="flashinfer", experts="reference", max_num_tokens_per_rank=64)
    layer.load_weights(random_weights(cfg, seed))
    x, logits = random_inputs(cfg, 50, seed)
    y = layer(x.cuda(), logits.cuda())
    ref = reference_moe(cfg, x, random_weights(cfg, seed), logits)
    assert max_rel_err(y, ref) < 2e-2, f"seed={seed}"
    graph = layer.decode_runner(16, cuda_graph=True)
    eager = layer.decode_runner(16, cuda_graph=False)
    for step, T in enumerate([16, 5, 0]):
        xs, ls = random_inputs(cfg, T, seed + step)
        g = graph(xs.cuda(), ls.cuda()).clone()
        e = eager(xs.cuda(), ls.cuda()).clone()
        assert torch.equal(g, e), f"seed={seed} T={T}: graph replay differs from eager"
    print(f"[flashinfer-a2a] EPMoE(dispatcher='flashinfer'): eager vs reference ok, CUDA-graph decode replay bit-exact")


def test_layer_one_rank_local_equals_flashinfer_kernels():
    """EPMoE(dispatcher="flashinfer") at ep = 1 keeps the tokens in place (option one_rank_local,
    default): its output equals the one through FlashInfer's all-to-all kernels (one_rank_local=False)
    bit for bit, with bf16 and nvfp4 wires, and no FlashInfer dispatch runs on the local path."""
    from epmoe import EPMoE, MoEConfig
    from tests.cpu.helpers import fresh_seed, random_inputs, random_weights

    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    seed = fresh_seed()
    w = random_weights(cfg, seed)
    for dd in ("bf16", "nvfp4"):
        outs = []
        for local in (True, False):
            layer = EPMoE(cfg, device="cuda", dispatcher="flashinfer", experts="reference", dispatch_dtype=dd,
                          max_num_tokens_per_rank=64, dispatcher_options={"one_rank_local": local})
            layer.load_weights(w)
            calls = []
            a2a = layer.dispatcher._a2a
            orig = a2a.dispatch
            a2a.dispatch = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
            ys = []
            for T in (50, 1, 0):
                x, logits = random_inputs(cfg, T, seed + T)
                ys.append(layer(x.cuda(), logits.cuda()).clone())
            assert (len(calls) == 0) == local, (dd, local, len(calls))
            layer.close()
            outs.append(ys)
        for T, a, b in zip((50, 1, 0), *outs):
            assert torch.equal(a, b), f"seed={seed} {dd} T={T}: the local path differs from FlashInfer's kernels"
    print("[flashinfer-a2a] one rank: local path == FlashInfer all-to-all, bit for bit (bf16, nvfp4)")
