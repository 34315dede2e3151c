"""The eager ep = 1 forward (router logits, torch dispatcher, triton experts) performs no host sync.

Run on META tensors: they carry shapes and no data, so anything that reads a device value on the host
(.item(), bool(tensor), .tolist(), .cpu(), nonzero, boolean-mask indexing, sizes taken from values)
raises. The Triton launches are recorded, not run (a stand-in: this proves the host code path only;
tests/gpu/test_host_overhead_gpu.py runs the same check on an H200 with torch.cuda.set_sync_debug_mode).
"""

import pytest
import torch

from tests.cpu.helpers import load_benchmark


def _cpu_availability(monkeypatch):
    """The triton backend constructs on CPU as under the interpreter, without setting TRITON_INTERPRET:
    a Triton first imported with it set stays in interpreter mode for the process (Gluon then fails
    to import, and the sm90 compile tests after these would lose the Gluon kernels)."""
    monkeypatch.setattr("epmoe.experts.triton.triton_experts.interpreter_enabled", lambda: True)


def _bench():
    return load_benchmark("bench_host_overhead")


# T = 16: decode tiles (6 launches); T = 512 with 16 experts: 256 rows per expert, the grouped_mm path
@pytest.mark.parametrize("T", [16, 512])
@pytest.mark.parametrize("routing", ["softmax", "sigmoid_grouped"])
def test_eager_forward_recorded_launches_has_no_host_sync(monkeypatch, T, routing):
    _cpu_availability(monkeypatch)  # nothing is launched
    layer, x, logits, counts = _bench().host_layer(T, "meta", num_experts=16, hidden=256, intermediate=128,
                                                   routing=routing, set_env=False)
    out = layer(x, logits)  # raises on the first host sync
    assert out.shape == (T, 256) and out.is_meta and out.dtype == torch.bfloat16
    assert counts["launches"] >= 4
    out = layer(x, logits, return_routing=True)  # the routing comes back as device tensors
    assert out.routing.topk_ids.is_meta


def test_meta_run_does_catch_a_sync(monkeypatch):
    """The check has teeth: the standalone dispatcher (no agreement from the layer) validates ids on the
    host, and that raises on meta tensors."""
    _cpu_availability(monkeypatch)
    layer, x, logits, _ = _bench().host_layer(16, "meta", num_experts=16, hidden=256, intermediate=128, set_env=False)
    ids = torch.zeros(16, 8, dtype=torch.int32, device="meta")
    w = torch.zeros(16, 8, dtype=torch.float32, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        layer.dispatcher.dispatch(x, ids, w)


@pytest.mark.parametrize("wire", ["bf16", "fp8", "nvfp4"])
def test_one_rank_torch_dispatch_matches_the_exchange(wire):
    """The torch dispatcher on one rank with the layer's agreement keeps the tokens in place; the
    result after reference experts and combine is that of the full exchange path (standalone call),
    with replayed ids holding -1 slots and rows of no expert."""
    from epmoe.config import MoEConfig
    from epmoe.dispatch.base import Agreement, DispatchSpec
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.reference import ReferenceExperts
    from epmoe.quant.codec import payload_format
    from epmoe.quant.payload import PayloadFormat
    from tests import experts_testing as ET

    E, K, H, T = 8, 3, 128, 24
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, dtype=torch.bfloat16)
    spec = DispatchSpec(group=None, ep_rank=0, ep_size=1, num_experts=E, top_k=K, hidden_size=H,
                        max_tokens_per_rank=T, payload=PayloadFormat.unquantized(torch.bfloat16),
                        wire=payload_format(wire, torch.bfloat16), combine_dtype=torch.bfloat16,
                        device=torch.device("cpu"))
    d = TorchA2ADispatcher(spec)
    experts = ReferenceExperts(ExpertsSpec(cfg, 0, 1, torch.device("cpu")))
    experts.load_weights(ET.random_expert_weights(cfg, E, seed=3))
    ids, w = ET.random_local_routing(T, K, E, seed=4, invalid_frac=0.3, empty_rows=3)
    x = torch.randn(T, H).to(torch.bfloat16)
    tokens, handle = d.dispatch(x, ids, w, agreement=Agreement((T,), inputs_checked=True, want_bytes=False))
    assert tokens.num_tokens == T and handle.send_token_idx is None  # in place: no exchange
    local = d.combine(experts(tokens), handle)
    tokens2, handle2 = d.dispatch(x, ids, w)  # standalone: validates and exchanges
    assert tokens2.num_tokens == T - 3
    exchanged = d.combine(experts(tokens2), handle2)
    assert torch.equal(local, exchanged)  # row by row the same arithmetic
    assert (local[T - 3:] == 0).all()
    assert d.stats.dispatch_calls == 2 and d.stats.dispatch_bytes_sent == 0
    # keeps_routing: the layer's fused alignment holds for the received ids only if they are the caller's
    ids32, w32 = ids.to(torch.int32), w.float()
    tokens, handle = d.dispatch(x, ids32, w32, agreement=Agreement((T,), inputs_checked=True, want_bytes=False))
    passed_through = tokens.topk_ids is ids32 and tokens.topk_weights is w32
    assert d.keeps_routing == (wire == "bf16") and passed_through == d.keeps_routing, wire
    d.combine(experts(tokens), handle)


def test_one_rank_stats_count_the_routed_pairs():
    """return_stats on one rank: (token, expert) pairs per local expert from the replayed ids (-1 slots
    not counted), every token a received row (they stay in place), nothing sent."""
    from epmoe import EPMoE, MoEConfig
    from tests import experts_testing as ET
    from tests.cpu.helpers import random_weights

    E, K, T = 8, 3, 20
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=32, intermediate_size=16, dtype=torch.float32)
    layer = EPMoE(cfg, experts="reference")
    layer.load_weights(random_weights(cfg, 5))
    ids, w = ET.random_local_routing(T, K, E, seed=6, invalid_frac=0.3, empty_rows=2)
    out = layer(torch.randn(T, 32), topk_ids=ids, topk_weights=w, return_stats=True)
    want = torch.bincount(ids[ids >= 0].long(), minlength=E)
    assert torch.equal(out.stats.tokens_per_local_expert, want)
    assert out.stats.received_rows == T and out.stats.bytes_sent == 0 and out.stats.rounds == 1


@pytest.mark.parametrize("mode", ["bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("N", [16, 512])
def test_triton_experts_host_code_has_no_host_sync(monkeypatch, mode, N):
    """TritonExperts.forward in every mode on meta tensors (launches recorded, not run)."""
    from epmoe.config import MoEConfig
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.triton.triton_experts import TritonExperts
    from epmoe.quant.plan import QuantPlan

    _cpu_availability(monkeypatch)  # nothing is launched
    E, K, H, I = 16, 8, 512, 256
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=torch.bfloat16)
    ex = TritonExperts(ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode=mode)))
    ex._grouped_mm_ok = mode == "bf16"  # the grouped_mm path where a GPU would take it
    meta = torch.device("meta")
    ex.device = meta
    ex._params = {name: torch.empty(shape, dtype=torch.float32 if "scale" in name or name.startswith("b")
                                    else torch.bfloat16, device=meta)
                  for name, shape in ex._expected_shapes().items()}
    launches = []
    ex._launch = lambda name, grid, args, kwargs: launches.append(name)
    tokens = DispatchedTokens(hidden=torch.empty(N, H, dtype=torch.bfloat16, device=meta),
                              topk_ids=torch.empty(N, K, dtype=torch.int32, device=meta),
                              topk_weights=torch.empty(N, K, dtype=torch.float32, device=meta))
    out = ex(tokens)
    assert out.shape == (N, H) and out.is_meta and len(launches) >= 4
