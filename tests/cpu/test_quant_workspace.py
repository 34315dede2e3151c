"""Workspace sizing against hand-computed numbers (FlashInfer A2A formula reproduced exactly)."""

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.resolve import resolve_quant_plan
from epmoe.quant.workspace import (
    GEMM_WORKSPACE_ALLOWANCE,
    expert_weight_bytes,
    flashinfer_a2a_aux_bytes,
    flashinfer_a2a_workspace_bytes,
    memory_required,
    shared_workspace,
    workspace_breakdown,
)

FI = "0.7.2.post1"


def dsv3(**kw):
    base = dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, routing="sigmoid_grouped",
                n_group=8, topk_group=4, quant_method="fp8", num_layers=61)
    base.update(kw)
    return MoEConfig(**base)


def gpt_oss(**kw):
    base = dict(num_experts=128, top_k=4, hidden_size=3072, hidden_size_unpadded=2880, intermediate_size=2880,
                has_bias=True, swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0, quant_method="mxfp4",
                num_layers=36)
    base.update(kw)
    return MoEConfig(**base)


def small(**kw):
    base = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, num_layers=3)
    base.update(kw)
    return MoEConfig(**base)


@pytest.mark.parametrize(
    "ep,max_tokens,eplb,expected",
    [
        # flag + counter (8) + send/recv counters (2*ep*4) -> align, dispatch flags (ep*4) -> align,
        # combine flags (ep*4) -> align, 2 x max_tokens * 22 * 4 (each aligned), eplb ep*n*4 -> align
        (8, 256, 0, 45440),
        (2, 16, 0, 3200),
        (64, 1, 0, 1408),
        (64, 1, 256, 66944),
    ],
)
def test_flashinfer_aux_hand_computed(ep, max_tokens, eplb, expected):
    assert flashinfer_a2a_aux_bytes(ep, max_tokens, eplb) == expected


def test_flashinfer_workspace_hand_computed():
    # DeepSeek-V3 NVFP4 dispatch: 7168/2 + 7168/16 + 4 (global scale) + 8*4 + 8*4 = 4100 B per token
    plan = resolve_quant_plan(dsv3(quant_method=None), requested_mode="nvfp4_w4a4", dispatcher="flashinfer", dispatch_dtype="nvfp4",
                              arch="sm100", flashinfer_version=FI)
    ws = workspace_breakdown(plan, dsv3(quant_method=None), ep_size=8, max_tokens_per_rank=256)
    assert ws.dispatch_bytes_per_token == 4100 and ws.combine_bytes_per_token == 14336
    assert (ws.hidden_bytes_per_token, ws.scale_bytes_per_token, ws.global_scale_bytes_per_token) == (3584, 448, 4)
    assert ws.recv_rows == 2048 and ws.aux_bytes == 45440
    assert ws.dispatch_region_bytes == 2048 * 4100 and ws.combine_region_bytes == 2048 * 14336
    assert ws.a2a_bytes == 45440 + 8396800 + 29360128 == 37802368
    assert ws.a2a_bytes == flashinfer_a2a_workspace_bytes(8, 256, 4100, 14336)
    assert ws.exact and ws.send_staging_bytes == 0
    # 128-byte padding of each region: 3 ranks x 5 tokens x 7 B = 105 -> 128
    assert flashinfer_a2a_workspace_bytes(3, 5, 7, 2) == flashinfer_a2a_aux_bytes(3, 5) + 128 + 128


@pytest.mark.parametrize(
    "mode,dispatch,per_token",
    [
        # (fp8 dispatch over FlashInfer is rejected by the dispatcher: it has no FP8 payload layout)
        ("fp8_block", "bf16", 7168 * 2 + 64),
        ("nvfp4_w4a16", "bf16", 7168 * 2 + 64),
        ("nvfp4_w4a4", "nvfp4", 3584 + 448 + 4 + 64),
    ],
)
def test_dispatch_payload_per_dtype(mode, dispatch, per_token):
    c = dsv3(quant_method=None)
    arch = "sm90" if mode == "nvfp4_w4a16" else "sm100"
    plan = resolve_quant_plan(c, requested_mode=mode, dispatch_dtype=dispatch, dispatcher="flashinfer", arch=arch,
                              flashinfer_version=FI)
    ws = workspace_breakdown(plan, c, 8, 128)
    assert ws.dispatch_bytes_per_token == per_token
    assert ws.a2a_bytes == flashinfer_a2a_workspace_bytes(8, 128, per_token, 14336)


def test_torch_dispatcher_estimate_hand_computed():
    c = small()
    plan = resolve_quant_plan(c, dispatcher="torch")
    ws = workspace_breakdown(plan, c, ep_size=4, max_tokens_per_rank=10)
    per_tok = 512 + 8 + 8
    assert ws.dispatch_bytes_per_token == per_tok
    assert ws.dispatch_region_bytes == 40 * per_tok  # ep * max rows
    assert ws.send_staging_bytes == 10 * 2 * per_tok  # max * min(top_k, ep) rows
    assert ws.combine_region_bytes == 40 * 512 + 10 * 2 * 512
    assert ws.aux_bytes == 4 * 4 * 8
    assert not ws.exact
    # reference experts scratch: n = top_k * rows routed rows
    n = 2 * 40
    assert ws.experts_scratch_bytes == n * 256 * 2 + n * 256 * 4 + n * 128 * 4 + n * 256 * 4
    assert ws.total_bytes == ws.a2a_bytes + ws.experts_scratch_bytes


def test_flashinfer_experts_scratch_includes_allowance():
    c = gpt_oss()
    plan = resolve_quant_plan(c, arch="sm90", humming=True, flashinfer_version=FI, dispatcher="flashinfer")
    ws = workspace_breakdown(plan, c, 8, 256)
    assert ws.experts_backend == "flashinfer_cutlass" and ws.experts_scratch_bytes > GEMM_WORKSPACE_ALLOWANCE


def test_gpt_oss_table_says_which_k():
    c = gpt_oss()
    plan = resolve_quant_plan(c, arch="sm90", dispatcher="flashinfer", flashinfer_version=FI)
    ws = workspace_breakdown(plan, c, 8, 256)
    assert ws.hidden_size == 3072 and ws.hidden_bytes_per_token == 6144
    t = ws.format_table()
    assert "K=3072" in t and "2880 pre-rounded to 3072; sizes use 3072" in t
    assert "max_tokens_per_rank=256 (per source rank)" in t and "[exact]" in t and "total per rank" in t


def test_deepep_sizes_are_deepeps_own():
    """The plan sizes DeepEP's buffers with the same formulas the dispatcher checks them against."""
    from epmoe.dispatch.deepep import deepep_buffer_bytes

    c = small(hidden_size=2048)
    # (nvfp4_w4a4 over deepep_ll on cpu was accepted before; no masked experts run it, so it is rejected)
    plan = resolve_quant_plan(c, requested_mode="fp8_block", dispatcher="deepep_ll", arch="sm90", ep_size=2)
    ws = workspace_breakdown(plan, c, 2, 16)
    assert ws.layout == "masked" and ws.experts_rows == 4 * 32 and ws.exact
    want = deepep_buffer_bytes(low_latency=True, hidden_size=2048, ep_size=2, num_experts=c.num_experts,
                               top_k=c.top_k, max_tokens_per_rank=16).num_rdma_bytes
    assert ws.a2a_bytes == want
    plan = resolve_quant_plan(c, dispatcher="deepep", arch="sm90", ep_size=4)
    ws = workspace_breakdown(plan, c, 4, 16)
    assert ws.exact and ws.a2a_bytes == deepep_buffer_bytes(
        low_latency=False, hidden_size=2048, ep_size=4, num_experts=c.num_experts, top_k=c.top_k,
        max_tokens_per_rank=16).num_nvl_bytes
    assert not workspace_breakdown(plan, c, 1, 16).exact  # one rank: DeepEP normal mode cannot run


def test_shared_workspace_max_over_layers():
    a, b = small(), small(hidden_size=512, intermediate_size=64)
    pa = resolve_quant_plan(a, requested_mode="nvfp4_w4a4", dispatcher="flashinfer", dispatch_dtype="nvfp4", arch="sm100", flashinfer_version=FI)
    pb = resolve_quant_plan(b, dispatcher="flashinfer", arch="sm100", flashinfer_version=FI)
    wa, wb = workspace_breakdown(pa, a, 4, 64), workspace_breakdown(pb, b, 4, 64)
    s = shared_workspace([wa, wb])
    assert s.a2a_bytes >= max(wa.a2a_bytes, wb.a2a_bytes)
    assert s.hidden_bytes_per_token == 1024 and s.scale_bytes_per_token == 16 and s.global_scale_bytes_per_token == 4
    assert s.a2a_bytes == flashinfer_a2a_workspace_bytes(4, 64, s.dispatch_bytes_per_token, 1024)
    assert shared_workspace([wa]).a2a_bytes == wa.a2a_bytes
    with pytest.raises(ValueError, match="disagree on ep_size"):
        shared_workspace([wa, workspace_breakdown(pb, b, 2, 64)])
    with pytest.raises(ValueError, match="at least one"):
        shared_workspace([])


@pytest.mark.parametrize(
    "method,mode,arch,kw,per_expert",
    [
        (None, "bf16", "cpu", {}, 98304 * 2),
        (None, "fp8_block", "cpu", {}, (65536 + 16) + (32768 + 8)),
        (None, "nvfp4_w4a4", "cpu", {}, (32768 + 256 * 16) + (16384 + 256 * 8) + 16),
        (None, "mxfp4_w4a16", "cpu", {}, (32768 + 2048) + (16384 + 1024)),
        ("mxfp4", None, "sm90", dict(humming=True, flashinfer_version=FI), (32768 + 2048) + (16384 + 1024) + 8),
        (None, "mxfp8", "cpu", {}, (65536 + 2048) + (32768 + 1024)),
    ],
)
def test_expert_weight_bytes_hand_computed(method, mode, arch, kw, per_expert):
    c = small(quant_method=method)
    plan = resolve_quant_plan(c, requested_mode=mode, arch=arch, **kw)
    assert expert_weight_bytes(plan, c) == per_expert
    cb = small(quant_method=method, has_bias=True)
    assert expert_weight_bytes(resolve_quant_plan(cb, requested_mode=mode, arch=arch, **kw), cb) == per_expert + 512 * 2


def test_memory_required():
    c = small()
    plan = resolve_quant_plan(c)
    m = memory_required(plan, c, ep_size=2, max_tokens_per_rank=32)
    assert m.num_local_experts == 4 and m.num_moe_layers == 3
    assert m.weights_bytes == 196608 * 4 * 3
    assert m.total_bytes == m.weights_bytes + m.workspace.total_bytes
    assert memory_required(plan, c, 2, 32, num_moe_layers=1).weights_bytes == 196608 * 4
    assert "expert weights" in m.format_table()
    d = dsv3()
    pd = resolve_quant_plan(d, arch="sm90", dispatcher="flashinfer", flashinfer_version=FI)
    md = memory_required(pd, d, 8, 256, num_moe_layers=58)
    # fp8_block: 1 B/weight + fp32 per 128x128 block, 3 * 7168 * 2048 weights per expert
    assert md.expert_weight_bytes == 3 * 7168 * 2048 + (32 * 56 + 56 * 16) * 4


def test_workspace_errors():
    c = small()
    plan = resolve_quant_plan(c)
    with pytest.raises(ValueError, match="not divisible by ep_size=3"):
        workspace_breakdown(plan, c, 3, 8)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int"):
        workspace_breakdown(plan, c, 2, 0)
    big_k = small(num_experts=32, top_k=23)
    pk = resolve_quant_plan(big_k, dispatcher="flashinfer", arch="sm90", flashinfer_version=FI)
    with pytest.raises(ValueError, match="top_k <= 22"):
        workspace_breakdown(pk, big_k, 2, 8)
    with pytest.raises(ValueError, match="ep_size <= 64"):
        workspace_breakdown(resolve_quant_plan(small(num_experts=128), dispatcher="flashinfer", arch="sm90", flashinfer_version=FI), small(num_experts=128), 128, 8)
    odd = small(hidden_size=2880, quant_method="fp8")
    with pytest.raises(ValueError, match="hidden_size=2880 is not a multiple of the fp8_block block size 128"):
        workspace_breakdown(resolve_quant_plan(odd), odd, 2, 8)
    with pytest.raises(TypeError, match="QuantPlan"):
        workspace_breakdown({}, c, 2, 8)


def test_plan_report_for_launcher():
    c = gpt_oss()
    plan = resolve_quant_plan(c, arch="sm90", dispatcher="flashinfer", flashinfer_version=FI)
    r = __import__("epmoe.quant.workspace", fromlist=["format_plan_report"]).format_plan_report(plan, c, 8, 256)
    assert r.startswith("quant plan:") and "sizes use 3072" in r and "x BF16" in r and "memory per rank" in r
    d = dsv3(quant_method="modelopt_fp4")
    pd = resolve_quant_plan(d, arch="sm100", dispatcher="flashinfer", dispatch_dtype="nvfp4", flashinfer_version=FI)
    from epmoe.quant.workspace import format_plan_report

    assert "hidden payload 4036 = 0.282x BF16" in format_plan_report(pd, d, 8, 256, num_moe_layers=58)
