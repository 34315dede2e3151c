"""The fused pre-GEMM kernels on the GPU against the torch ops they replace: the fused routing
(`epmoe.routing_kernels`) against `route_torch` (the same experts per token, also with bf16 logits
where values tie at the k-th place; weights to ~1 ulp; ids sorted by score), the one-program alignment
(`align_small_kernel`) and the three-kernel one against `align_blocks(sort_by_expert(...))` bit for bit,
the routing launch that also aligns (`route_align_kernel`) against the two launches it replaces, the
one-launch sort (`align_sort_kernel`) against `sort_by_expert`, and the layer with the fused routing
against the layer with the torch routing and with / without the aligning routing launch, without a
host sync (skipped without a GPU)."""

import pytest
import torch

from epmoe import EPMoE, MoEConfig
from epmoe.experts.triton import align as A
from epmoe.experts.triton.launch import KernelLauncher
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


def _call_without_host_sync(layer, x, logits, after_warmup=None):
    """Two warm-up calls (they compile), then one call under `set_sync_debug_mode("error")` (a host
    sync in it raises) -> that call's MoEOutput with its routing."""
    for _ in range(2):
        layer(x, logits)
    if after_warmup is not None:
        after_warmup()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return layer(x, logits, return_routing=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
        fused = _call_without_host_sync(layer, x, logits)
        layer.router.impl = "torch"
        plain = layer(x, logits, return_routing=True)
        assert torch.equal(fused.routing.topk_ids.sort(-1).values, plain.routing.topk_ids.sort(-1).values), seed
        assert max_rel_err(fused.hidden_states, plain.hidden_states) < 1e-2, seed
    finally:
        layer.close()


@pytest.mark.parametrize("routing, E, K", [("softmax", 128, 8), ("softmax", 60, 6), ("sigmoid_grouped", 256, 8),
                                           ("sigmoid_grouped", 72, 6)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_routing_launch_that_aligns_equals_the_two_launches(routing, E, K, block_m):
    """`Router.route_aligned` (`route_align_kernel`: the routing, then the one-program alignment, in one
    launch) against the routing kernel followed by `align_blocks_triton`, bit for bit, and against the
    torch alignment; Triton's launch path, then the direct one."""
    seed = fresh_seed()
    cfg = _cfg(routing, E, K)
    router = Router(cfg, "cuda")
    launch = KernelLauncher(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    bias = torch.randn(E, device="cuda", generator=g) * 0.1 if routing == "sigmoid_grouped" else None
    for T in (1, 7, 64, A.SINGLE_LAUNCH_MAX_ENTRIES // K):
        logits = torch.randn(T, E, device="cuda", generator=g) * 2
        for _ in range(2):
            got, blocks = router.route_aligned(logits, bias, E, block_m)
            ref = router(logits, bias)
            what = (routing, E, K, T, block_m, seed)
            assert blocks is not None, what
            assert torch.equal(got.topk_ids, ref.topk_ids) and torch.equal(got.topk_weights, ref.topk_weights), what
            two = A.align_blocks_triton(ref.topk_ids, E, block_m, launch)
            torch_ref = A.align_blocks(A.sort_by_expert(ref.topk_ids, E), block_m)
            for f in ("sorted_ids", "block_expert", "block_rows"):
                assert torch.equal(getattr(blocks, f), getattr(two, f)), (f, what)
                assert torch.equal(getattr(blocks, f), getattr(torch_ref, f)), (f, what)


@pytest.mark.parametrize("E, K, N", [(128, 8, 4096), (256, 8, 1000), (60, 4, 3000), (16, 8, 1)])
def test_one_launch_sort_equals_torch(E, K, N):
    """`sort_by_expert_triton` (`align_sort_kernel`, one launch: the grouped_mm path's sort) against
    `sort_by_expert` bit for bit, invalid ids included; Triton's launch path, then the direct one."""
    seed = fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(-1, E + 1, (N, K), device="cuda", generator=g, dtype=torch.int32)
    ref = A.sort_by_expert(ids, E)
    launch = KernelLauncher(torch.device("cuda"))
    for _ in range(2):
        got = A.sort_by_expert_triton(ids, E, launch)
        what = (E, K, N, seed)
        assert torch.equal(got.order.long(), ref.order), what
        assert torch.equal(got.sorted_expert, ref.sorted_expert), what
        assert torch.equal(got.expert_ends.long(), ref.expert_ends), what
        assert torch.equal(got.expert_counts.long(), ref.expert_counts), what
        assert torch.equal(got.inverse.long()[ref.order], torch.arange(N * K, device="cuda")), what


@pytest.mark.parametrize("routing", ["softmax", "sigmoid_grouped"])
@pytest.mark.parametrize("T", [1, 16, 128])
@pytest.mark.parametrize("dispatcher", ["torch", pytest.param("flashinfer", marks=pytest.mark.requires_flashinfer)])
def test_layer_routing_launch_aligns_same_bits_without_host_sync(routing, T, dispatcher):
    """The ep = 1 layer (torch / flashinfer dispatcher, triton experts) at decode sizes launches
    `route_align_kernel` instead of the routing and the alignment kernels: no host sync, the same bits as
    the layer without it, within bf16 error of the float64 reference."""
    from epmoe import reference_moe

    seed = fresh_seed()
    cfg = _cfg(routing, 64, 8)
    layer = EPMoE(cfg, dispatcher=dispatcher, experts="triton", device="cuda", max_num_tokens_per_rank=512)
    try:
        w = random_weights(cfg, seed)
        layer.load_weights(w)
        x, logits = random_inputs(cfg, T, seed)
        xd, ld = x.cuda(), logits.cuda()
        names = []
        for owner in (layer.router, layer.experts):
            real = owner._launch
            owner._launch = (lambda real: lambda n, g, a, k: (names.append(n), real(n, g, a, k)))(real)
        fused = _call_without_host_sync(layer, xd, ld, after_warmup=names.clear)
        assert "route_align_kernel" in names and "align_small_kernel" not in names, names
        layer._fuse_alignment = False
        plain = layer(xd, ld, return_routing=True)
        assert torch.equal(fused.hidden_states, plain.hidden_states), seed
        assert torch.equal(fused.routing.topk_ids, plain.routing.topk_ids), seed
        assert torch.equal(fused.routing.topk_weights, plain.routing.topk_weights), seed
        assert max_rel_err(fused.hidden_states, reference_moe(cfg, x, w, logits)) < 2e-2, seed
    finally:
        layer.close()

