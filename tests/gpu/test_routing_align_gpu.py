"""The fused pre-GEMM kernels on the GPU against the torch ops they replace: the fused routing
(`epmoe.routing_kernels`) against `route_torch` (the same experts per token, also with bf16 logits
where values tie at the k-th place; weights to ~1 ulp; ids sorted by score), the one-program alignment
(`align_small_kernel`) and the three-kernel one against `align_blocks(sort_by_expert(...))` bit for bit,
and the layer with the fused routing against the layer with the torch routing, without a host sync
(skipped without a GPU)."""

import pytest
import torch

from epmoe import EPMoE, MoEConfig
from epmoe.experts import align as A
from epmoe.experts.launch import KernelLauncher
from epmoe.routing import Router, route_torch
from tests.cpu.helpers import fresh_seed, max_rel_err, random_inputs, random_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cfg(routing, E, K):
    extra = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5) if routing == "sigmoid_grouped" else {}
    return MoEConfig(num_experts=E, top_k=K, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16,
                     routing=routing, **extra)


@pytest.mark.parametrize("routing, E, K", [("softmax", 128, 8), ("softmax", 60, 4), ("softmax", 512, 10),
                                           ("softmax", 8, 1), ("sigmoid_grouped", 256, 8),
                                           ("sigmoid_grouped", 72, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_equals_torch_routing(routing, E, K, dtype):
    seed = fresh_seed()
    cfg = _cfg(routing, E, K)
    router = Router(cfg, "cuda")
    assert router.impl == "triton"
    g = torch.Generator(device="cuda").manual_seed(seed)
    bias = torch.randn(E, device="cuda", generator=g) * 0.1 if routing == "sigmoid_grouped" else None
    for T in (0, 1, 7, 128, 4096):
        logits = (torch.randn(T, E, device="cuda", generator=g) * 2).to(dtype)
        _check_same_routing(router(logits, bias), route_torch(cfg, logits, bias), (routing, E, K, dtype, T, seed),
                            by_weight=bias is None)


def _check_same_routing(got, ref, what, by_weight=True):
    assert got.topk_ids.dtype == torch.int32 and got.topk_weights.dtype == torch.float32, what
    ids_g, order_g = got.topk_ids.sort(-1)
    ids_r, order_r = ref.topk_ids.sort(-1)
    assert torch.equal(ids_g, ids_r), what
    if got.topk_ids.shape[0]:
        w = got.topk_weights
        if by_weight:  # sorted by weight, as torch.topk (with a correction bias: by weight + bias)
            assert (w[:, :-1] >= w[:, 1:]).all(), what
        wg, wr = w.gather(1, order_g), ref.topk_weights.gather(1, order_r)  # by expert id
        rel = ((wg - wr).abs() / wr.abs().clamp(min=1e-30)).max().item()
        assert rel < 2e-6, (what, rel)


@pytest.mark.parametrize("E, K, N, block_m", [(128, 8, 1, 16), (128, 8, 128, 16), (256, 8, 100, 16),
                                              (60, 4, 200, 32), (1000, 2, 16, 16), (16, 8, 700, 128)])
def test_alignment_kernels_equal_torch_bit_for_bit(E, K, N, block_m):
    seed = fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(-1, E + 1, (N, K), device="cuda", generator=g, dtype=torch.int32)
    ids = torch.where(torch.rand(N, K, device="cuda", generator=g) < 0.3, torch.zeros_like(ids), ids)
    ref = A.align_blocks(A.sort_by_expert(ids, E), block_m)
    launch = KernelLauncher(torch.device("cuda"))
    old = A.SINGLE_LAUNCH_MAX_ENTRIES
    try:
        for limit in (0, 1 << 30):  # three kernels; one program
            A.SINGLE_LAUNCH_MAX_ENTRIES = limit
            for _ in range(2):  # Triton's launch path, then the direct one
                got = A.align_blocks_triton(ids, E, block_m, launch)
                assert got.max_blocks == ref.max_blocks
                for f in ("sorted_ids", "block_expert", "block_rows"):
                    assert torch.equal(getattr(got, f), getattr(ref, f)), (f, limit, E, K, N, block_m, seed)
    finally:
        A.SINGLE_LAUNCH_MAX_ENTRIES = old


@pytest.mark.parametrize("routing", ["softmax", "sigmoid_grouped"])
@pytest.mark.parametrize("T", [16, 128, 512])
def test_layer_fused_routing_matches_torch_routing_without_host_sync(routing, T):
    seed = fresh_seed()
    cfg = _cfg(routing, 64, 8)
    layer = EPMoE(cfg, dispatcher="torch", experts="triton", device="cuda", max_num_tokens_per_rank=512)
    try:
        layer.load_weights(random_weights(cfg, seed))
        x, logits = random_inputs(cfg, T, seed)
        x, logits = x.cuda(), logits.cuda()
        assert layer.router.impl == "triton"
        for _ in range(2):
            layer(x, logits)  # compiles outside the checked call
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused = layer(x, logits, return_routing=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        layer.router.impl = "torch"
        plain = layer(x, logits, return_routing=True)
        assert torch.equal(fused.routing.topk_ids.sort(-1).values, plain.routing.topk_ids.sort(-1).values), seed
        assert max_rel_err(fused.hidden_states, plain.hidden_states) < 1e-2, seed
    finally:
        layer.close()
