"""Every expert mode through the EP layer on CPU (reference experts emulate the kernels' numerics):
weight-only modes equal the dense reference on the dequantized weights; activation-quantizing modes
stay within their format's bound of the unquantized layer."""

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.quant.weights import dequantize_expert_weights, quantize_expert_weights
from tests.cpu.helpers import fresh_seed, max_rel_err, random_inputs, random_weights
from tests.cpu.mp import run_group

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.float32, has_bias=True)
WEIGHT_FORMAT = {"nvfp4_w4a16": "nvfp4", "mxfp4_w4a16": "mxfp4", "fp8_block": "fp8_block",
                 "nvfp4_w4a4": "nvfp4", "mxfp8": "mxfp8"}
# Relative (norm) error of the whole layer vs the unquantized layer. Over 40 seeds at this shape the
# worst cases were: nvfp4_w4a16 0.185, mxfp4_w4a16 0.210, fp8_block 0.073, nvfp4_w4a4 0.252,
# mxfp8 0.088 (means 0.16 / 0.20 / 0.062 / 0.23 / 0.075). The bounds leave 1.5x of that worst case:
# a wrong layout or scale gives errors of order 1.
BOUND = {"nvfp4_w4a16": 0.28, "mxfp4_w4a16": 0.32, "fp8_block": 0.11, "nvfp4_w4a4": 0.38, "mxfp8": 0.13}


def _worker(rank, world, seed, mode):
    layer = EPMoE(CFG, quant=mode)
    layer.load_weights(random_weights(CFG, seed))
    x, logits = random_inputs(CFG, 11 + 3 * rank, seed + rank)
    return x, logits, layer(x, logits), layer.plan.expert_mode, layer.dispatcher.spec.wire_format.name


@pytest.mark.parametrize("mode", sorted(WEIGHT_FORMAT))
def test_quant_modes_through_the_layer(mode):
    seed = fresh_seed()
    w = random_weights(CFG, seed)
    wq = dequantize_expert_weights(quantize_expert_weights(w, WEIGHT_FORMAT[mode]), torch.float32)
    for x, logits, y, got_mode, wire in run_group(_worker, 2, seed, mode):
        assert got_mode == mode
        exact = reference_moe(CFG, x, wq, logits)  # the weights the kernels see
        loose = reference_moe(CFG, x, w, logits)
        if mode.endswith("w4a16"):
            assert wire == "fp32" and max_rel_err(y, exact) < 1e-5, seed  # weight-only: exact on dequantized weights
        rel = float((y.double() - loose).norm() / loose.norm())
        assert rel < BOUND[mode], (mode, rel, seed)
        if mode == "nvfp4_w4a4":
            assert wire == "nvfp4"  # auto dispatch sends what the experts consume
        if mode == "fp8_block":
            assert wire == "fp8_block"
