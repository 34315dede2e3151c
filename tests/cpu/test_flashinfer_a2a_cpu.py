"""FlashInferA2ADispatcher on CPU: its glue around FlashInfer's MoeAlltoAll, run against a threaded
fake of the one-sided all-to-all (tests/cpu/flashinfer_fakes.py), plus its pure helpers.

The fake writes tokens into receive slots in a non-identity order and leaves stale bytes in padded
rows, like the real kernel, so these tests catch any dependence on row order or on padding content.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from tests.cpu import flashinfer_fakes as ff
from epmoe.dispatch.base import DispatchSpec
from epmoe.quant.payload import PayloadFormat, QuantizedActivation

from epmoe.quant.codec import NVFP4, quantize_for_wire  # noqa: E402
BF16 = PayloadFormat.unquantized(torch.bfloat16)


@pytest.fixture
def fake_fi(monkeypatch):
    return ff.install(monkeypatch)


def _spec(rank, ep, E, K, H, max_t, payload=BF16, **opts):
    opts.setdefault("check_availability", False)
    return DispatchSpec(
        group=None, ep_rank=rank, ep_size=ep, num_experts=E, top_k=K, hidden_size=H,
        max_tokens_per_rank=max_t, payload=payload, combine_dtype=torch.bfloat16,
        device=torch.device("cpu"), options=tuple(opts.items()),
    )


def _inputs(seed, ep, counts, E, K, H):
    """Per-rank (hidden bf16, topk_ids int32 with some -1, weights f32): same on every 'rank'."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(ep):
        T = counts[r]
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32) if T else torch.empty(0, K, dtype=torch.int32)
        if T:
            ids[torch.rand(T, K, generator=g) < 0.2] = -1
            ids[0] = -1  # a token with no expert at all
        w = torch.rand(T, K, generator=g, dtype=torch.float32)
        out.append((x, ids, w))
    return out


def _coef(w, gid, E):
    return w * (1.0 + gid.float() / E)


def fake_experts(tokens, first, E):
    """Row-wise stand-in for an experts backend: y = sum_k w_k (1 + id_k/E) x over local ids, fp32."""
    x, lid, w = tokens.hidden.float(), tokens.topk_ids, tokens.topk_weights
    acc = torch.zeros_like(x)
    for k in range(lid.shape[1]):
        ok = lid[:, k] >= 0
        c = torch.where(ok, _coef(w[:, k], lid[:, k] + first, E), torch.zeros_like(w[:, k]))
        acc += c.unsqueeze(1) * x
    return acc.to(torch.bfloat16)


def reference(inputs, rank, ep, E):
    """Expected combine output of `rank`: partial sums per owning rank (fp32 -> bf16), then summed
    in fp32 over ranks in top-k order of first appearance, cast to bf16."""
    x, ids, w = inputs[rank]
    per = E // ep
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        seen = []
        for e in ids[t].tolist():
            if e >= 0 and e // per not in seen:
                seen.append(e // per)
        for r in seen:
            acc = torch.zeros(x.shape[1], dtype=torch.float32)
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                c = _coef(w[t, k], torch.tensor(e), E) if (e >= 0 and e // per == r) else torch.tensor(0.0)
                acc += c * x[t].float()
            out[t] += acc.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def _run_round(ep, E, K, H, counts, seed, mode="allreduce", payload=BF16, rounds=2, **opts):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    inputs = _inputs(seed, ep, counts, E, K, H)

    def rank_fn(r, fabric):
        spec = _spec(r, ep, E, K, H, max(counts) + 3, payload, runtime_max_tokens=mode,
                     comm_backend=ff.FakeComm(fabric, r), **opts)
        d = FlashInferA2ADispatcher(spec)
        outs = []
        for _ in range(rounds):  # a second round reuses the workspace and checks the handle cycle
            x, ids, w = inputs[r]
            tokens, handle = d.dispatch(x, ids, w)
            y = fake_experts(tokens, spec.first_local_expert, E)
            outs.append(d.combine(y, handle))
        return d, tokens, handle, outs

    results, errors = ff.run_ranks(ep, rank_fn)
    for e in errors:
        if e is not None:
            raise e
    return inputs, results


@pytest.mark.parametrize("ep,counts,mode", [(1, [7], "allreduce"), (2, [9, 0], "allreduce"), (4, [5, 8, 1, 6], "static"), (2, [6, 6], "uniform")])
def test_dispatch_combine_matches_reference(fake_fi, ep, counts, mode):
    seed = 1000 + ep * 10 + sum(counts)
    E, K, H = 8 * ep, 3, 32
    inputs, results = _run_round(ep, E, K, H, counts, seed, mode)
    for r in range(ep):
        d, tokens, handle, outs = results[r]
        ref = reference(inputs, r, ep, E)
        for out in outs:
            assert out.shape == (counts[r], H), f"seed={seed} rank={r}"
            assert torch.equal(out, ref), f"seed={seed} rank={r}: combine differs from the reference"
        # DispatchedTokens: flat, LOCAL ids, one row per (source rank, slot)
        rt = handle.runtime_max_tokens_per_rank
        expect_rt = {"allreduce": max(1, max(counts)), "uniform": max(1, counts[r]), "static": max(counts) + 3}[mode]
        assert rt == expect_rt
        assert tokens.layout == "flat" and tokens.hidden.shape == (ep * rt, H)
        assert tokens.topk_ids.dtype == torch.int32 and tokens.topk_weights.dtype == torch.float32
        lid = tokens.topk_ids
        assert ((lid == -1) | ((lid >= 0) & (lid < E // ep))).all(), f"seed={seed}: ids must be local or -1"
        # every token owning an expert here arrives exactly once, with its local ids
        per = E // ep
        expected = sorted(
            (s, tuple(int(e) - r * per if e >= 0 and e // per == r else -1 for e in ids.tolist()))
            for s in range(ep) for ids in inputs[s][1] if any(e >= 0 and e // per == r for e in ids.tolist())
        )
        got = sorted(
            (row // rt, tuple(lid[row].tolist())) for row in range(ep * rt) if (lid[row] >= 0).any()
        )
        assert got == expected, f"seed={seed} rank={r}: received (source, local ids) differ"


def test_route_sends_no_extra_destinations_for_padding(fake_fi):
    """-1 ids must not add rank 0 as a destination (the kernel maps -1 // (E/ep) to rank 0)."""
    ep, E, K, H = 2, 8, 2, 16
    from epmoe.dispatch.flashinfer_a2a import route_expert_ids

    ids = torch.tensor([[5, -1], [-1, -1], [7, 4]], dtype=torch.int32)
    route = route_expert_ids(ids, E, fallback_expert=4)  # rank 1 calls it with its first expert
    assert route.tolist() == [[5, 5], [4, 4], [7, 4]]
    inputs = [(torch.randn(3, H).bfloat16(), ids, torch.rand(3, K)), (torch.randn(1, H).bfloat16(), torch.tensor([[1, 6]], dtype=torch.int32), torch.rand(1, K))]

    def rank_fn(r, fabric):
        from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

        d = FlashInferA2ADispatcher(_spec(r, ep, E, K, H, 4, comm_backend=ff.FakeComm(fabric, r), runtime_max_tokens="static"))
        x, i, w = inputs[1 - r]  # rank 1 holds the padded batch
        tokens, h = d.dispatch(x, i, w)
        d.combine(fake_experts(tokens, d.spec.first_local_expert, E), h)
        return d

    results, errors = ff.run_ranks(ep, rank_fn)
    assert not any(errors), errors
    d1 = results[1]
    a2a = [a for a in ff.FakeMoeAlltoAll.instances if a.ep_rank == 1][0]
    sent_route = a2a.dispatch_calls[0]["route"]
    assert sent_route.tolist() == [[5, 5], [4, 4], [7, 4]], "padding must route to an existing destination"
    # payload ids keep -1 (the receiver must not see a fake expert)
    payload_ids = a2a.dispatch_calls[0]["payloads"][a2a.dispatch_calls[0]["ids_index"]]
    assert payload_ids.tolist() == ids.tolist()
    # rank 1's tokens all live on rank 1 (experts 4..7): nothing crossed the link
    st = d1.stats
    assert st.dispatch_bytes_sent == 0 and st.tokens_sent == 0 and st.dispatch_calls == 1
    # rank 0 sent its one token to rank 1 (experts 1 -> rank 0, 6 -> rank 1): one remote send
    st0 = results[0].stats
    assert st0.tokens_sent == 1 and st0.dispatch_bytes_sent == d1.dispatch_bytes_per_token
    # rank 1 computed for that one remote token -> one row back in combine; rank 0 computed none
    assert st.combine_bytes_sent == H * 2 and st0.combine_bytes_sent == 0


def test_bytes_count_matches_remote_destinations(fake_fi):
    ep, E, K, H, counts, seed = 4, 16, 4, 32, [6, 3, 0, 5], 77
    inputs, results = _run_round(ep, E, K, H, counts, seed, "allreduce", rounds=1)
    per = E // ep
    for r in range(ep):
        d = results[r][0]
        ids = inputs[r][1]
        sends = sum(len({e // per for e in row.tolist() if e >= 0} - {r}) for row in ids)
        rows = sum(
            1 for s in range(ep) if s != r for row in inputs[s][1] if any(e >= 0 and e // per == r for e in row.tolist())
        )
        assert results[r][2].bytes_sent == sends * d.dispatch_bytes_per_token, "handle.bytes_sent"
        st = d.stats
        assert st.tokens_sent == sends, f"seed={seed} rank={r}"
        assert st.dispatch_bytes_sent == sends * (H * 2 + K * 4 + K * 4)
        assert st.combine_bytes_sent == rows * H * 2
        assert st.by_format == ({"bf16": {"payload": sends * H * 2, "routing": sends * 8 * K}} if sends else {})
        st.reset()
        assert d.stats.dispatch_bytes_sent == 0


def test_workspace_sized_by_flashinfer_and_recorded(fake_fi):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    d = FlashInferA2ADispatcher(_spec(0, 1, 8, 2, 64, 32))
    assert d.dispatch_bytes_per_token == 64 * 2 + 2 * 4 + 2 * 4
    expect = ff.moe_a2a_get_workspace_size_per_rank(1, 32, d.dispatch_bytes_per_token, 64 * 2)
    assert d.workspace_bytes_required == expect == d.workspace_bytes_per_rank
    assert ff.FakeMoeAlltoAll.instances[-1].workspace_size_per_rank == expect
    # a plan workspace that is too small is refused, a larger one is used
    with pytest.raises(ValueError, match="smaller than"):
        FlashInferA2ADispatcher(
            DispatchSpec(None, 0, 1, 8, 2, 64, 32, BF16, torch.bfloat16, torch.device("cpu"), workspace_bytes=expect - 1,
                         options=(("check_availability", False),))
        )
    big = FlashInferA2ADispatcher(
        DispatchSpec(None, 0, 1, 8, 2, 64, 32, BF16, torch.bfloat16, torch.device("cpu"), workspace_bytes=expect + 4096,
                     options=(("check_availability", False),))
    )
    assert big.workspace_bytes_per_rank == expect + 4096 and big.workspace_bytes_required == expect


def test_nvfp4_payload_plumbing(fake_fi):
    """NVFP4 rows, E4M3 scales and each sender's dynamic global scale (epmoe.quant.codec, the torch
    dispatcher's quantizer) arrive byte for byte; dequantized they match the sender's round trip."""
    from epmoe.quant.codec import dequantize_activation, quantize_activation

    ep, E, K, H, counts, seed = 2, 8, 2, 64, [5, 4], 31
    inputs = _inputs(seed, ep, counts, E, K, H)

    def rank_fn(r, fabric):
        from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

        d = FlashInferA2ADispatcher(_spec(r, ep, E, K, H, 8, NVFP4, comm_backend=ff.FakeComm(fabric, r)))
        x, ids, w = inputs[r]
        tokens, h = d.dispatch(x, ids, w)
        out = d.combine(torch.zeros(tokens.num_tokens, H, dtype=torch.bfloat16), h)
        return d, tokens, h, out

    results, errors = ff.run_ranks(ep, rank_fn)
    assert not any(errors), errors
    for r in range(ep):
        d, tokens, h, out = results[r]
        assert [s.name for s in d.slots] == ["hidden", "scales", "topk_ids", "topk_weights", "global_scale"]
        assert d.dispatch_bytes_per_token == H // 2 + H // 16 + 8 * K + 4
        q = tokens.hidden
        assert isinstance(q, QuantizedActivation) and q.format == NVFP4 and q.hidden_size == H
        assert q.data.dtype == torch.uint8 and q.scales.dtype == torch.float8_e4m3fn
        rt = h.runtime_max_tokens_per_rank
        assert q.global_scale.shape == (ep * rt,)
        deq = dequantize_activation(q, torch.float32)
        matched = 0
        for row in range(ep * rt):
            if not (tokens.topk_ids[row] >= 0).any():
                continue
            src = row // rt
            qs = quantize_for_wire(inputs[src][0], NVFP4)  # one global scale per token
            t = [i for i in range(qs.data.shape[0]) if torch.equal(qs.data[i], q.data[row])]
            assert t, f"seed={seed}: row {row} of rank {r} is not a token of rank {src}"
            t = t[0]
            assert torch.equal(qs.scales[t].view(torch.uint8), q.scales[row].view(torch.uint8))
            assert float(q.global_scale[row]) == float(qs.global_scale[t])
            assert torch.equal(deq[row], dequantize_activation(qs, torch.float32)[t])
            matched += 1
        assert matched > 0 and out.shape == (counts[r], H) and (out == 0).all()


def test_static_global_scale_sends_no_scale_payload(fake_fi):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    d = FlashInferA2ADispatcher(_spec(0, 1, 4, 2, 64, 4, NVFP4, nvfp4_global_scale=448.0 * 6 / 4.0))
    assert [s.name for s in d.slots] == ["hidden", "scales", "topk_ids", "topk_weights"]
    x = torch.randn(3, 64).bfloat16()
    tokens, h = d.dispatch(x, torch.tensor([[0, 1]] * 3, dtype=torch.int32), torch.rand(3, 2))
    assert tokens.hidden.global_scale.dim() == 0 and float(tokens.hidden.global_scale) == 672.0
    d.combine(torch.zeros(tokens.num_tokens, 64, dtype=torch.bfloat16), h)
    with pytest.raises(ValueError, match="not epmoe.quant.codec"):
        FlashInferA2ADispatcher(_spec(0, 1, 4, 2, 64, 4, PayloadFormat("nvfp4", torch.uint8, 2, 32, torch.uint8, "linear", True)))


def test_payload_order_keeps_alignment():
    from epmoe.dispatch.flashinfer_a2a import plan_payloads

    # H=64: 32 + 4 bytes -> aligned, FlashInfer's phased NVFP4 order
    assert [s.name for s in plan_payloads(NVFP4, 64, 8, False)] == ["hidden", "scales", "topk_ids", "topk_weights"]
    # H=16: 8 + 1 bytes would misalign the int32 ids -> scales go last
    order = plan_payloads(NVFP4, 16, 8, True)
    assert [s.name for s in order] == ["hidden", "topk_ids", "topk_weights", "global_scale", "scales"]
    offset = 0
    for s in order:
        assert offset % torch.tensor([], dtype=s.dtype).element_size() == 0, s
        offset += s.bytes_per_token
    bf16 = plan_payloads(BF16, 7168, 8, False)
    assert sum(s.bytes_per_token for s in bf16) == 7168 * 2 + 64
    with pytest.raises(ValueError, match="hidden_size % 16"):
        plan_payloads(NVFP4, 40, 2, False)
    fp8 = PayloadFormat("fp8_block", torch.float8_e4m3fn, 1, 128, torch.float32, "linear")
    with pytest.raises(ValueError, match="bf16/fp16 or nvfp4"):
        plan_payloads(fp8, 256, 2, False)


def test_bad_ids_raise_on_every_rank(fake_fi):
    """An out-of-range id on one rank: that rank raises ValueError naming it, the other a peer
    error, and nobody enters the all-to-all (which would wait forever)."""
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    ep, E, K, H = 2, 8, 2, 16

    def rank_fn(r, fabric):
        d = FlashInferA2ADispatcher(_spec(r, ep, E, K, H, 4, comm_backend=ff.FakeComm(fabric, r)))
        ids = torch.tensor([[0, 9 if r == 1 else 1]], dtype=torch.int32)
        try:
            d.dispatch(torch.randn(1, H).bfloat16(), ids, torch.rand(1, K))
        except Exception as e:  # noqa: BLE001
            return e
        return None

    results, errors = ff.run_ranks(ep, rank_fn)
    assert not any(errors), errors
    assert isinstance(results[1], ValueError) and "9" in str(results[1]) and "[0, 8)" in str(results[1])
    assert isinstance(results[0], RuntimeError) or "another rank" in str(results[0])
    assert all(not a.dispatch_calls for a in ff.FakeMoeAlltoAll.instances)


def test_bad_shapes_agreed_too(fake_fi):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    def rank_fn(r, fabric):
        d = FlashInferA2ADispatcher(_spec(r, 2, 8, 2, 16, 4, comm_backend=ff.FakeComm(fabric, r)))
        H = 15 if r == 0 else 16
        try:
            d.dispatch(torch.randn(2, H).bfloat16(), torch.zeros(2, 2, dtype=torch.int32), torch.rand(2, 2))
        except Exception as e:  # noqa: BLE001
            return e

    results, errors = ff.run_ranks(2, rank_fn)
    assert not any(errors), errors
    assert isinstance(results[0], ValueError) and "hidden has shape [2, 15]" in str(results[0])
    assert "another rank" in str(results[1])


def test_single_rank_errors_and_handle_cycle(fake_fi):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    d = FlashInferA2ADispatcher(_spec(0, 1, 4, 2, 16, 4))
    x, ids, w = torch.randn(2, 16).bfloat16(), torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), torch.rand(2, 2)
    with pytest.raises(ValueError, match=r"contains -2"):
        d.dispatch(x, torch.tensor([[0, -2], [1, 1]], dtype=torch.int32), w)
    with pytest.raises(ValueError, match="exceeds max_tokens_per_rank=4"):
        d.dispatch(torch.randn(5, 16).bfloat16(), torch.zeros(5, 2, dtype=torch.int32), torch.rand(5, 2))
    with pytest.raises(TypeError, match="float32"):
        d.dispatch(x.float(), ids, w)
    tokens, h = d.dispatch(x, ids, w)
    with pytest.raises(RuntimeError, match="not combined"):
        d.dispatch(x, ids, w)
    with pytest.raises(ValueError, match=r"expected \[2, 16\]"):
        d.combine(torch.zeros(3, 16, dtype=torch.bfloat16), h)
    with pytest.raises(TypeError, match="bfloat16"):
        d.combine(torch.zeros(2, 16), h)
    out = d.combine(fake_experts(tokens, 0, 4), h)
    assert out.shape == (2, 16)
    with pytest.raises(RuntimeError, match="not the one in flight"):
        d.combine(fake_experts(tokens, 0, 4), h)
    with pytest.raises(ValueError, match="runtime_max_tokens_per_rank=1"):
        d.dispatch(x, ids, w, runtime_max_tokens_per_rank=1)
    tokens, h = d.dispatch(x, ids, w, runtime_max_tokens_per_rank=3)
    assert h.runtime_max_tokens_per_rank == 3 and tokens.num_tokens == 3
    # zero-copy combine: experts write into the workspace view
    buf = d.combine_input_buffer(h)
    buf.copy_(fake_experts(tokens, 0, 4))
    d.combine(buf, h)
    assert ff.FakeMoeAlltoAll.instances[-1].combine_calls[-1]["payload_in_workspace"] is True
    d.close()  # keeps FlashInfer's per-process workspace (reused by the next dispatcher of this geometry)
    assert not ff.FakeMoeAlltoAll.instances[-1].reset_called
    d2 = FlashInferA2ADispatcher(_spec(0, 1, 4, 2, 16, 4, release_workspace_on_close=True))
    d2.close()
    assert ff.FakeMoeAlltoAll.instances[-1].reset_called


def test_low_precision_combine_option(fake_fi):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    d = FlashInferA2ADispatcher(_spec(0, 1, 4, 1, 16, 4, low_precision_combine=True))
    tokens, h = d.dispatch(torch.randn(2, 16).bfloat16(), torch.tensor([[0], [3]], dtype=torch.int32), torch.ones(2, 1))
    d.combine(fake_experts(tokens, 0, 4), h)
    assert ff.FakeMoeAlltoAll.instances[-1].combine_calls[-1]["use_low_precision"] is True
    assert d.combine_wire_bytes_per_token == 16 and d.combine_bytes_per_token == 32


def test_options_validated(fake_fi):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    with pytest.raises(ValueError, match="runtime_max_tokens='sometimes'"):
        FlashInferA2ADispatcher(_spec(0, 1, 4, 1, 16, 4, runtime_max_tokens="sometimes"))
    with pytest.raises(ValueError, match="comm='nccl'"):
        FlashInferA2ADispatcher(_spec(0, 1, 4, 1, 16, 4, comm="nccl"))
    with pytest.raises(ValueError, match="init_process_group"):
        FlashInferA2ADispatcher(_spec(0, 2, 4, 1, 16, 4))
    with pytest.raises(ValueError, match="not divisible"):
        FlashInferA2ADispatcher(_spec(0, 3, 4, 1, 16, 4))


def test_to_local_ids():
    from epmoe.dispatch.flashinfer_a2a import to_local_ids

    g = torch.tensor([[8, 11, -1, 3], [12, 7, 9, -1]], dtype=torch.int32)
    assert to_local_ids(g, 8, 4).tolist() == [[0, 3, -1, -1], [-1, -1, 1, -1]]


def test_availability_without_flashinfer_or_gpu(monkeypatch):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a))
    a = FlashInferA2ADispatcher.availability(torch.device("cuda"), 2)
    assert not a and "not installed" in a.reason and "pip install" in a.hint
    monkeypatch.setattr(importlib.util, "find_spec", real)


def test_availability_on_cpu(fake_fi):
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    a = FlashInferA2ADispatcher.availability(torch.device("cpu"), 1)
    assert not a and "CUDA" in a.reason and "torch" in a.hint


def test_importing_epmoe_does_not_import_flashinfer():
    code = (
        "import sys, epmoe, epmoe.dispatch, epmoe.experts, epmoe.dispatch.flashinfer_a2a, "
        "epmoe.experts.flashinfer_cutlass, epmoe.quant.flashinfer_layout\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported at module import'\n"
    )
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_static_shapes_mode(fake_fi):
    """CUDA-graph mode: fixed receive block, no per-call collective, no host read-back."""
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    ep, E, K, H = 2, 8, 2, 16
    calls = []

    class CountingComm(ff.FakeComm):
        def allgather(self, data):
            calls.append(data)
            return super().allgather(data)

    def rank_fn(r, fabric):
        spec = DispatchSpec(group=None, ep_rank=r, ep_size=ep, num_experts=E, top_k=K, hidden_size=H,
                            max_tokens_per_rank=6, payload=BF16, combine_dtype=torch.bfloat16,
                            device=torch.device("cpu"), static_shapes=True,
                            options=(("check_availability", False), ("comm_backend", CountingComm(fabric, r))))
        d = FlashInferA2ADispatcher(spec)
        n0 = len(calls)
        x = torch.randn(6, H).bfloat16()
        ids = torch.tensor([[r * 4, -1]] * 6, dtype=torch.int32)
        tokens, h = d.dispatch(x, ids, torch.ones(6, K))
        n1 = len(calls)
        d.combine(torch.zeros(tokens.num_tokens, H, dtype=torch.bfloat16), h)
        return tokens, h, n1 - n0

    results, errors = ff.run_ranks(ep, rank_fn)
    assert not any(errors), errors
    for tokens, h, n in results:
        assert n == 0, "static mode must not run a collective per dispatch"
        assert h.runtime_max_tokens_per_rank == 6 and tokens.num_tokens == 12 and tokens.static
        assert h.bytes_sent == -1


def test_single_rank_with_agreement_skips_conversions_same_result(fake_fi):
    """ep = 1 with the layer's agreement (ids checked): routing tensor by one clamp, received ids used
    as local ids, no counter updates; the result equals the standalone (validating) call's and the
    reference, and nothing counts as sent over a link."""
    from epmoe.dispatch.base import Agreement
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    E, K, H, T = 8, 3, 32, 6
    d = FlashInferA2ADispatcher(_spec(0, 1, E, K, H, 8))
    inputs = _inputs(11, 1, [T], E, K, H)
    x, ids, w = inputs[0]
    tokens, h = d.dispatch(x, ids, w, agreement=Agreement((T,), inputs_checked=True, want_bytes=True))
    assert h.bytes_sent == 0 and h.runtime_max_tokens_per_rank == T
    fast = d.combine(fake_experts(tokens, 0, E), h)
    tokens2, h2 = d.dispatch(x, ids, w)
    slow = d.combine(fake_experts(tokens2, 0, E), h2)
    assert torch.equal(fast, slow)
    torch.testing.assert_close(fast.float(), reference(inputs, 0, 1, E).float(), rtol=2e-2, atol=2e-2)
    st = d.stats
    assert st.dispatch_calls == 2 and st.dispatch_bytes_sent == 0 and st.combine_bytes_sent == 0


@pytest.mark.parametrize("payload,static_gs", [(BF16, None), (NVFP4, None), (NVFP4, 672.0)])
def test_one_rank_local_path_equals_workspace_path(fake_fi, payload, static_gs):
    """ep = 1 under the layer's agreement: the tokens stay in place (no MoeAlltoAll dispatch or
    combine runs: the stand-in records none), and every output equals the workspace path's
    (one_rank_local=False, the FlashInfer stand-in) bit for bit; an NVFP4 wire still quantizes (the
    experts get the same QuantizedActivation). Handle rules stay: combine once per dispatch, right
    shape; combine_input_buffer of a local handle is a new tensor."""
    from epmoe.dispatch.base import Agreement
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

    E, K, H = 8, 3, 64
    opts = {} if static_gs is None else {"nvfp4_global_scale": static_gs}
    local = FlashInferA2ADispatcher(_spec(0, 1, E, K, H, 8, payload, **opts))
    ws = FlashInferA2ADispatcher(_spec(0, 1, E, K, H, 8, payload, one_rank_local=False, **opts))
    for T in (6, 1, 0):
        x, ids, w = _inputs(40 + T, 1, [T], E, K, H)[0]
        agree = Agreement((T,), inputs_checked=True, want_bytes=True)
        outs = []
        for d in (local, ws):
            tokens, h = d.dispatch(x, ids, w, agreement=agree)
            rows = tokens.num_tokens
            hid = tokens.hidden
            if isinstance(hid, QuantizedActivation):
                y = torch.zeros(rows, H, dtype=torch.bfloat16)
                valid = (tokens.topk_ids >= 0).any(dim=1)
                ref_rows = sorted((tuple(hid.data[i].tolist()), tuple(hid.scales[i].view(torch.uint8).tolist()),
                                   float(hid.global_scale if hid.global_scale.dim() == 0 else hid.global_scale[i]))
                                  for i in range(rows) if valid[i])
            else:
                y = fake_experts(tokens, 0, E)
                ref_rows = None
            outs.append((d.combine(y, h), h, ref_rows, tokens))
        (out_l, h_l, rows_l, tok_l), (out_w, h_w, rows_w, tok_w) = outs
        assert h_l.local and not h_w.local and h_l.bytes_sent == h_w.bytes_sent == 0
        assert torch.equal(out_l, out_w), f"T={T}: the local path's output differs"
        if rows_l is not None:  # the same quantized rows reach the experts (the workspace path: any order, padding)
            assert rows_l == rows_w and (T <= 1 or rows_l), f"T={T}: the experts get other NVFP4 rows"  # T = 1: its token has no expert
        else:
            assert tok_l.hidden is x and tok_l.num_tokens == T  # in place, no copy
    assert len(local._a2a.dispatch_calls) == 0 and len(local._a2a.combine_calls) == 0
    assert len(ws._a2a.dispatch_calls) == 3
    assert local.stats.dispatch_calls == 3 and local.stats.dispatch_bytes_sent == 0
    # handle rules and the combine buffer
    x, ids, w = _inputs(7, 1, [4], E, K, H)[0]
    agree = Agreement((4,), inputs_checked=True)
    tokens, h = local.dispatch(x, ids, w, agreement=agree)
    buf = local.combine_input_buffer(h)
    assert buf.shape == (4, H) and buf.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"expected \[4, 64\]"):
        local.combine(torch.zeros(5, H, dtype=torch.bfloat16), h)
    assert local.combine(buf, h) is buf
    with pytest.raises(RuntimeError, match="not the one in flight"):
        local.combine(buf, h)
    # without the layer's agreement (inputs unchecked) the dispatcher validates and uses the workspace
    tokens, h = local.dispatch(x, ids, w)
    assert not h.local and len(local._a2a.dispatch_calls) == 1
    local.combine(torch.zeros(tokens.num_tokens, H, dtype=torch.bfloat16), h)
    # keeps_routing (the layer's fused alignment holds for the received ids): the local path hands the
    # caller's int32 ids and float32 weights through, the workspace path does not
    assert local.keeps_routing and not ws.keeps_routing
    x, ids, w = _inputs(5, 1, [4], E, K, H)[0]
    ids32, w32 = ids.to(torch.int32), w.float()
    tokens, h = local.dispatch(x, ids32, w32, agreement=Agreement((4,), inputs_checked=True))
    assert tokens.topk_ids is ids32 and tokens.topk_weights is w32
    local.combine(local.combine_input_buffer(h), h)
