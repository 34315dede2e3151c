"""DeepEP buffer sizing (`deepep_buffer_bytes` and the hint replicas) against hand computations of
DeepEP's C++ formulas (csrc/config.hpp, csrc/deep_ep.cpp at the pinned V1 commit)."""

from __future__ import annotations

import pytest

from epmoe.dispatch import deepep as dd


def test_nvl_hint_by_hand_ep2_h7168():
    # Config(num_sms=20, nvl recv chunk 256): 10 channels x 2 NVL ranks = 20 slots, 1 RDMA rank
    cfg = dd.DeepEPConfig(20, 24, 256, 6, 128)
    slots, recv, hb = 20, 256, 7168 * 2
    by_hand = (
        slots * (2 * 1 + 3) * 4  # 400: start/end offsets, head/tail
        + slots * recv * hb  # 73_400_320: data
        + slots * recv * 8  # 40_960: SourceMeta
        + slots * recv * 128 * 8  # 5_242_880: top-k ids (128 assumed)
        + slots * recv * 128 * 4  # 2_621_440: top-k weights
        + slots * recv * 128 * 4  # 2_621_440: FP8 scales (128 assumed)
    )
    assert by_hand == 83_927_440
    assert dd.nvl_buffer_size_hint(cfg, hb, 2) == 83_927_552  # rounded up to 128
    assert dd.nvl_buffer_size_hint(cfg, hb, 2) % 128 == 0


def test_nvl_hint_ep8_uses_8_nvl_ranks():
    cfg = dd.DeepEPConfig(24, 6, 256, 6, 128)  # 12 channels
    slots = 12 * 8
    n = slots * 5 * 4 + slots * 256 * (4096 + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    assert dd.nvl_buffer_size_hint(cfg, 4096, 8) == -(-n // 128) * 128
    with pytest.raises(ValueError, match="multiple of 8"):
        dd.nvl_buffer_size_hint(cfg, 4096, 12)


def test_exact_intranode_requirements_by_hand():
    cfg = dd.DeepEPConfig(20, 24, 256, 6, 128)
    # dispatch, ep=2, H=7168 FP8 (1 byte), top-8, 56 scales
    slots = 10 * 2
    d = 2 * 2 * 4 + slots * 4 * 4 + slots * 256 * (7168 + 4 + 8 * 8 + 8 * 4 + 56 * 4)
    assert dd.intranode_dispatch_bytes(cfg, 2, 7168, 8, 56) == d == 38_359_376
    # combine, BF16
    c = slots * 2 * 4 + slots * 256 * (14336 + 4 + 8 * 4)
    assert dd.intranode_combine_bytes(cfg, 2, 14336, 8) == c


def test_normal_buffer_is_the_largest_requirement_and_independent_of_batch():
    a = dd.deepep_buffer_bytes(low_latency=False, hidden_size=7168, ep_size=2, num_experts=256, top_k=8,
                               max_tokens_per_rank=128)
    b = dd.deepep_buffer_bytes(low_latency=False, hidden_size=7168, ep_size=2, num_experts=256, top_k=8,
                               max_tokens_per_rank=8192)
    assert a == b and a.num_rdma_bytes == 0
    d_cfg, c_cfg = dd.default_configs(2)
    assert a.num_nvl_bytes == max(dd.nvl_buffer_size_hint(d_cfg, 14336, 2), dd.nvl_buffer_size_hint(c_cfg, 14336, 2))
    assert a.num_nvl_bytes == 83_927_552
    # a hidden size past DeepEP's 128-scale assumption: the exact FP8 dispatch requirement wins
    big = dd.deepep_buffer_bytes(low_latency=False, hidden_size=32768, ep_size=2, num_experts=16, top_k=8,
                                 max_tokens_per_rank=1, wire=dd.fp8_block_format())
    exact = dd.intranode_dispatch_bytes(d_cfg, 2, 32768, 8, 256)
    assert big.num_nvl_bytes >= exact and big.num_nvl_bytes % 128 == 0


def test_low_latency_hint_by_hand_v3_shape():
    # M=128 tokens/rank, H=7168 (56 scales), 8 ranks, 256 experts
    M, H, E = 128, 7168, 256
    dispatch_msg = 16 + max(H * 2, H + 56 * 4)  # 14_352
    combine_msg = 56 * 4 + H * 2  # 14_560
    send = max(M * dispatch_msg, E * M * combine_msg)  # 477_102_080
    recv = max(E * M * dispatch_msg, E * M * combine_msg)  # 477_102_080
    total = 2 * send + 2 * recv + 2 * 1024  # signalling: 256 ints -> 1024 B (already 128-aligned)
    assert (dispatch_msg, combine_msg, send, recv, total) == (14_352, 14_560, 477_102_080, 477_102_080, 1_908_410_368)
    assert dd.low_latency_rdma_size_hint(M, H, 8, E) == 1_908_410_368 + 128  # DeepEP adds one unit
    sizes = dd.deepep_buffer_bytes(low_latency=True, hidden_size=H, ep_size=8, num_experts=E, top_k=8,
                                   max_tokens_per_rank=M)
    assert sizes == dd.DeepEPBufferSizes(num_nvl_bytes=0, num_rdma_bytes=1_908_410_496)


def test_low_latency_hint_small_and_scaling():
    # M=64, H=2048 (16 scales), 1 rank, 16 experts: dispatch_msg = 16 + 4096, combine_msg = 64 + 4096
    d_msg, c_msg = 4112, 4160
    send = max(64 * d_msg, 16 * 64 * c_msg)
    recv = max(16 * 64 * d_msg, 16 * 64 * c_msg)
    sig = 128  # 16 ints = 64 B -> 128
    total = 2 * send + 2 * recv + 2 * sig
    assert dd.low_latency_rdma_size_hint(64, 2048, 1, 16) == (total + 128) // 128 * 128
    # linear in M and in E (the receive side dominates)
    a = dd.low_latency_rdma_size_hint(64, 2048, 1, 16)
    b = dd.low_latency_rdma_size_hint(128, 2048, 1, 16)
    assert abs(b - 2 * a) <= 512


def test_low_latency_at_4096_tokens_is_tens_of_gigabytes():
    # why the benchmark runs low-latency at 128 tokens/rank only: ~61 GB per rank at 4096
    gb = dd.low_latency_rdma_size_hint(4096, 7168, 8, 256) / 1e9
    assert 60 < gb < 62
