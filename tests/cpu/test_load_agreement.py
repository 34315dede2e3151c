"""Loading and input checks that must hold on every rank (issue: what a new user hits first):
a corrupt file on one rank, NaN/Inf weights on one rank, duplicate expert ids, the opt-in NaN/Inf
check, float64 layers. Real gloo process groups of 2 ranks."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.checkpoint import hf_expert_tensors
from epmoe.core.errors import NonFiniteError, PeerInputError
from epmoe.reference import reference_moe_streamed
from tests.cpu.helpers import max_rel_err, random_inputs, random_weights
from tests.cpu.mp import run_group

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype=torch.float32)


def _save(path: str, weights) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in hf_expert_tensors(CFG, weights, "model.layers.0.mlp.", "hf").items()},
              path)


def _corrupt_file_on_rank1(rank, world, good_dir, bad_dir):
    layer = EPMoE(CFG, timeout_s=20)
    layer.load_weights(good_dir)
    try:
        layer.load_weights(bad_dir if rank == 1 else good_dir)
        outcome = "loaded"
    except PeerInputError as e:
        outcome = f"peer: {e}"
    except Exception as e:  # noqa: BLE001 - the bad rank's own error
        outcome = f"own {type(e).__name__}: {e}"
    x, logits = random_inputs(CFG, 5 + rank, seed=rank)
    out = layer(x, logits)  # the group is still usable, with the old weights
    return outcome, x, logits, out


def test_corrupt_safetensors_on_one_rank_fails_every_rank_naming_the_file(tmp_path):
    w = random_weights(CFG, seed=1)
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    _save(str(good / "model.safetensors"), w)
    data = (good / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated: SafetensorError
    res = run_group(_corrupt_file_on_rank1, 2, str(good), str(bad), timeout=90)
    bad_file = str(bad / "model.safetensors")
    assert res[1][0].startswith("own ") and bad_file in res[1][0], res[1][0]
    assert res[0][0].startswith("peer: ") and "rank 1" in res[0][0] and bad_file in res[0][0], res[0][0]
    for outcome, x, logits, out in res:  # old weights kept, forward after the failure still right
        assert max_rel_err(out, reference_moe(CFG, x, w, logits)) < 1e-5


def _nan_weights_on_one_rank(rank, world, w, bad_rank):
    layer = EPMoE(CFG, timeout_s=20)
    mine = w
    if rank == bad_rank:
        w1 = w.w1.clone()
        w1[CFG.num_experts - 1, 0, 0] = float("nan")  # an expert of rank 1 only
        mine = type(w)(w1=w1, w2=w.w2, w3=w.w3)
    try:
        layer.load_weights({"w1": mine.w1, "w3": mine.w3, "w2": mine.w2})
        return "loaded"
    except PeerInputError as e:
        return f"peer: {e}"
    except ValueError as e:
        return f"own: {e}"


def test_nan_weights_on_one_rank_raise_on_every_rank():
    w = random_weights(CFG, seed=2)
    res = run_group(_nan_weights_on_one_rank, 2, w, 1, timeout=90)
    assert res[1].startswith("own: ") and "'w1' of expert 7" in res[1] and "NaN/Inf" in res[1], res
    assert res[0].startswith("peer: ") and "rank 1" in res[0] and "NaN/Inf" in res[0], res


def _duplicate_ids(rank, world, w):
    layer = EPMoE(CFG, timeout_s=20)
    layer.load_weights(w)
    x, _ = random_inputs(CFG, 3, seed=rank)
    ids = torch.tensor([[0, 5], [1, 2], [6, -1]], dtype=torch.int32)
    if rank == 0:
        ids[1] = torch.tensor([4, 4], dtype=torch.int32)
    wts = torch.full((3, 2), 0.5)
    try:
        layer(x, topk_ids=ids, topk_weights=wts)
        return "ran"
    except PeerInputError as e:
        return f"peer: {e}"
    except ValueError as e:
        return f"own: {e}"


def test_duplicate_expert_ids_in_a_row_rejected_on_every_rank():
    res = run_group(_duplicate_ids, 2, random_weights(CFG, seed=3), timeout=90)
    assert res[0].startswith("own: ") and "row 1 lists expert 4 more than once" in res[0], res
    assert res[1].startswith("peer: ") and "rank 0" in res[1], res


def _finite_check(rank, world, w, check_finite, case):
    layer = EPMoE(CFG, timeout_s=20, check_finite=check_finite)
    layer.load_weights(w)
    x, logits = random_inputs(CFG, 6, seed=rank)
    if case == "input" and rank == 1:
        x[2, 3] = float("inf")
    try:
        out = layer(x, logits)
        return f"ran finite={bool(torch.isfinite(out).all())}"
    except NonFiniteError as e:
        return f"nonfinite: {e}"
    except PeerInputError as e:
        return f"peer: {e}"


@pytest.mark.parametrize("check_finite", [False, True])
def test_opt_in_finite_check_names_rank_and_tensor(check_finite):
    w = random_weights(CFG, seed=4)
    huge = w.w2.clone()
    huge[CFG.num_experts // 2:] = 3e38  # finite weights, overflowing outputs on rank 1's experts
    w_huge = type(w)(w1=w.w1, w2=huge, w3=w.w3)
    res = run_group(_finite_check, 2, w_huge, check_finite, "weights", timeout=90)
    if not check_finite:  # off by default: no sync, no error
        assert all(r.startswith("ran") for r in res), res
        return
    for r in res:
        assert r.startswith("nonfinite: ") and "expert output" in r and "ranks [1]" in r, res
    res = run_group(_finite_check, 2, w, True, "input", timeout=90)
    assert res[1].startswith("nonfinite: ") and "input hidden_states" in res[1] and "rank 1" in res[1], res
    assert res[0].startswith("peer: ") and "rank 1" in res[0], res


def test_float64_layer_says_it_computes_in_float32():
    cfg = CFG.replace(dtype=torch.float64)
    with pytest.warns(UserWarning, match="compute in float32"):
        EPMoE(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EPMoE(CFG)  # float32: nothing to say


def test_streamed_reference_equals_dense_reference():
    cfg = CFG.replace(has_bias=True, dtype=torch.float32)
    w = random_weights(cfg, seed=5)
    x, logits = random_inputs(cfg, 9, seed=5)
    dense = reference_moe(cfg, x, w, logits)
    streamed = reference_moe_streamed(cfg, x, lambda e: w.slice_experts(e, e + 1), logits)
    assert float((dense - streamed).abs().max()) < 1e-12


def test_plan_reference_rounds_fc1_output_where_the_backend_writes_it():
    """With a plan whose experts write FC1's output in the model dtype (deepgemm, grouped_mm:
    `Experts.fc1_output_rounded`), the plan-aware reference rounds it to bf16 before the activation,
    dense and streamed alike; with a fused epilogue (triton) it stays exact. Checked against a loop
    written here."""
    from epmoe.reference import _act
    from epmoe.resolve import resolve_quant_plan

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    w = random_weights(cfg, seed=7)
    x, logits = random_inputs(cfg, 6, seed=7)

    def plan(experts, mode):
        return resolve_quant_plan(cfg, requested_mode=mode, dispatcher="torch", experts_backend=experts, arch="sm90")

    def by_hand(rounded):
        from epmoe.routing import route

        r = route(cfg, logits, None, impl="torch")
        I = cfg.intermediate_size
        out = torch.zeros(x.shape[0], cfg.hidden_size, dtype=torch.float64)
        for t in range(x.shape[0]):
            for k in range(cfg.top_k):
                e = int(r.topk_ids[t, k])
                w1, w3, w2 = (m[e].double() for m in (w.w1, w.w3, w.w2))
                g, u = w1 @ x[t].double(), w3 @ x[t].double()
                if rounded:
                    g, u = g.bfloat16().double(), u.bfloat16().double()
                out[t] += r.topk_weights[t, k].double() * (w2 @ _act(cfg, g, u))
        return out

    for experts, rounded in (("deepgemm", True), ("grouped_mm", True), ("triton", False)):
        p = plan(experts, "bf16")
        dense = reference_moe(cfg, x, w, logits, plan=p)
        streamed = reference_moe_streamed(cfg, x, lambda e: w.slice_experts(e, e + 1), logits, plan=p)
        want = by_hand(rounded)
        assert float((dense - want).abs().max()) < 1e-12, experts
        assert float((streamed - want).abs().max()) < 1e-12, experts
    # the rounding matters: at this shape it moves the output by more than fp64 noise
    assert float((by_hand(True) - by_hand(False)).abs().max()) > 1e-6


def test_plan_reference_models_the_dispatchers_own_fp8_cast():
    """An FP8 wire is epmoe's codec for every dispatcher but DeepEP low latency, whose kernels cast the
    BF16 tokens themselves (x * fl32(448 / amax), where the codec divides by the scale): the
    plan-aware reference takes each dispatcher's cast (`Dispatcher.wire_roundtrip`). On BF16 inputs
    the two casts put some values on different sides of an e4m3 rounding tie, so the reference of a
    deepep_ll plan is the one of DeepEP-cast tokens, and not the codec's."""
    from epmoe.dispatch import DISPATCHERS
    from epmoe.dispatch import deepep as dd
    from epmoe.quant import codec
    from epmoe.resolve import resolve_quant_plan

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=2048, intermediate_size=128, dtype=torch.bfloat16)
    w = random_weights(cfg, seed=3)
    x, logits = random_inputs(cfg, 16, seed=3)
    wire = codec.payload_format("fp8", cfg.dtype)
    ours = codec.roundtrip_for_wire(x, wire, torch.float64)
    deepep = dd.fp8_block_dequantize(*dd.fp8_block_quantize(x), dtype=torch.float64)
    assert bool((ours != deepep).any()), "these inputs should hit a tie the two casts round apart"
    assert torch.equal(DISPATCHERS.get("deepep_ll").wire_roundtrip(x, wire, torch.float64), deepep)
    assert torch.equal(DISPATCHERS.get("deepep").wire_roundtrip(x, wire, torch.float64), ours)

    def plan(dispatcher):
        p = resolve_quant_plan(cfg, requested_mode="fp8_block", dispatcher=dispatcher, experts_backend="deepgemm",
                               arch="sm90", ep_size=2)
        assert p.dispatch_dtype == "fp8", p
        return p

    ll, normal = plan("deepep_ll"), plan("deepep")
    as_ll = reference_moe(cfg, x, w, logits, plan=ll)
    # tokens already through DeepEP's cast come through it unchanged, through the codec too
    assert torch.equal(reference_moe(cfg, deepep.float(), w, logits, plan=ll), as_ll)
    assert torch.equal(reference_moe(cfg, deepep.float(), w, logits, plan=normal), as_ll)
    assert not torch.equal(reference_moe(cfg, x, w, logits, plan=normal), as_ll)
