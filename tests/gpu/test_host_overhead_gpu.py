"""The eager ep = 1 layer on the GPU, host side: no host sync in the forward (torch.cuda's sync debug
mode raises on any), for the torch and flashinfer dispatchers at a decode and a prefill shape (scaled
down: 16 experts, top-8; T = 512 gives 256 rows per expert, the triton backend's grouped_mm path),
results against the float64 reference, and the direct Triton launches (`epmoe.experts.triton.launch`) giving
the same bits as Triton's own launch path in every triton mode. Timing lives in
benchmarks/bench_host_overhead.py, never here."""

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.dispatch.base import DispatchedTokens
from epmoe.experts.base import ExpertsSpec
from epmoe.experts.triton.launch import launch_keys
from epmoe.experts.triton.triton_experts import TritonExperts
from epmoe.quant.plan import QuantPlan
from tests import experts_testing as ET
from tests.cpu.helpers import fresh_seed, max_rel_err, random_inputs, random_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = MoEConfig(num_experts=16, top_k=8, hidden_size=512, intermediate_size=256, dtype=torch.bfloat16)
CFG_DS = MoEConfig(num_experts=16, top_k=8, hidden_size=512, intermediate_size=256, dtype=torch.bfloat16,
                   routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _sync_free_call(layer, *args):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises RuntimeError
    try:
        return layer(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("cfg", [CFG, CFG_DS], ids=["softmax", "sigmoid_grouped"])
@pytest.mark.parametrize("T", [16, 512])
@pytest.mark.parametrize("dispatcher", ["torch", pytest.param("flashinfer", marks=pytest.mark.requires_flashinfer)])
def test_eager_forward_has_no_host_sync(dispatcher, T, cfg):
    seed = fresh_seed()
    layer = EPMoE(cfg, dispatcher=dispatcher, experts="triton", device="cuda", max_num_tokens_per_rank=512)
    w = random_weights(cfg, seed)
    layer.load_weights(w)
    x, logits = random_inputs(cfg, T, seed)
    xd, ld = x.cuda(), logits.cuda()
    try:
        for _ in range(2):  # compiles, allocator warm-up: outside the checked call
            layer(xd, ld)
        out = _sync_free_call(layer, xd, ld)
        ref = reference_moe(cfg, x, w, logits)
        assert max_rel_err(out, ref) < 2e-2, seed
        launcher = layer.experts.__dict__.get("_launcher")
        assert launcher is not None and launch_keys(launcher), "no Triton launch took the direct path"
        launcher.fast = False  # Triton's own launch path: the same bits
        assert torch.equal(layer(xd, ld), out), seed
    finally:
        layer.close()


# decode tiles in every mode, and bf16's grouped_mm path (N = 512); few shapes: each is a compile
@pytest.mark.parametrize("mode, N", [("bf16", 16), ("bf16", 512), ("fp8_block", 16), ("nvfp4_w4a16", 16),
                                     ("mxfp4_w4a16", 16)])
def test_direct_launch_same_bits_as_triton_path(mode, N):
    seed = fresh_seed()
    ex = TritonExperts(ExpertsSpec(CFG, 0, 1, torch.device("cuda"), plan=QuantPlan(expert_mode=mode)))
    ex.load_weights(ET.random_expert_weights(CFG, 16, device="cuda", seed=seed))
    ids, w = ET.random_local_routing(N, 8, 16, device="cuda", seed=seed, invalid_frac=0.1, empty_rows=2)
    x = torch.randn(N, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    tokens = DispatchedTokens(hidden=x, topk_ids=ids, topk_weights=w)
    first = ex(tokens)  # Triton's path (and the keys recorded)
    direct = _sync_free_call(ex, tokens)
    assert launch_keys(ex._launcher)
    ex._launcher.fast = False
    slow = ex(tokens)
    assert torch.equal(first, slow) and torch.equal(direct, slow), (mode, N, seed)
    if mode != "bf16":
        return
    # a misaligned input (address not a multiple of 16 bytes) takes its own key (its own compile):
    # Triton's path first, then the direct one, the same bits; the numbers those of the aligned input
    ex._launcher.fast = True
    keys = len(launch_keys(ex._launcher))
    buf = torch.empty(N * CFG.hidden_size + 1, device="cuda", dtype=torch.bfloat16)
    x_odd = buf[1:].view(N, CFG.hidden_size)
    x_odd.copy_(x)
    odd = ex(DispatchedTokens(hidden=x_odd, topk_ids=ids, topk_weights=w))
    odd2 = ex(DispatchedTokens(hidden=x_odd, topk_ids=ids, topk_weights=w))
    assert torch.equal(odd, odd2) and max_rel_err(odd, slow) < 1e-2, (mode, N, seed)
    assert len(launch_keys(ex._launcher)) > keys
