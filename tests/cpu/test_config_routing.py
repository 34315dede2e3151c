"""MoEConfig validation and HF parsing; routing against straightforward per-token implementations."""

import json

import pytest
import torch

from epmoe import MoEConfig, route
from tests.cpu.helpers import fresh_seed

HF = {
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 4096,
                "intermediate_size": 14336, "hidden_act": "silu", "num_hidden_layers": 32, "torch_dtype": "bfloat16"},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4, "hidden_size": 2048,
                  "moe_intermediate_size": 1408, "intermediate_size": 5632, "norm_topk_prob": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 2048,
                  "moe_intermediate_size": 768, "intermediate_size": 6144, "norm_topk_prob": True},
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "hidden_size": 7168, "moe_intermediate_size": 2048, "intermediate_size": 18432,
                    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_hidden_layers": 61,
                    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
    "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 128, "experts_per_token": 4, "hidden_size": 2880,
                "intermediate_size": 2880, "swiglu_limit": 7.0, "num_hidden_layers": 36,
                "quantization_config": {"quant_method": "mxfp4"}},
    "nemotron_h": {"model_type": "nemotron_h", "n_routed_experts": 128, "num_experts_per_tok": 6,
                   "hidden_size": 2688, "moe_intermediate_size": 1856, "mlp_hidden_act": "relu2",
                   "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                   "scoring_func": "sigmoid"},
}


def test_from_hf_config_families(tmp_path):
    c = MoEConfig.from_hf_config(HF["mixtral"])
    assert (c.num_experts, c.top_k, c.intermediate_size, c.routing, c.renormalize) == (8, 2, 14336, "softmax", True)
    assert c.num_layers == 32 and c.dtype == torch.bfloat16
    c = MoEConfig.from_hf_config(HF["qwen2_moe"])
    assert (c.num_experts, c.intermediate_size, c.renormalize) == (60, 1408, False)
    c = MoEConfig.from_hf_config(HF["qwen3_moe"])
    assert (c.num_experts, c.top_k, c.intermediate_size, c.renormalize) == (128, 8, 768, True)
    c = MoEConfig.from_hf_config(HF["deepseek_v3"])
    assert (c.num_experts, c.routing, c.n_group, c.topk_group, c.routed_scaling_factor) == (256, "sigmoid_grouped", 8, 4, 2.5)
    assert c.intermediate_size == 2048 and c.quant_method == "fp8"
    c = MoEConfig.from_hf_config(HF["gpt_oss"])
    assert (c.num_experts, c.top_k, c.has_bias, c.swiglu_alpha, c.swiglu_beta, c.swiglu_limit) == (128, 4, True, 1.702, 1.0, 7.0)
    assert c.quant_method == "mxfp4"
    c = MoEConfig.from_hf_config(HF["nemotron_h"])
    assert (c.activation, c.routing, c.num_experts, c.top_k) == ("relu2", "sigmoid_grouped", 128, 6)
    # from a path and a directory, with overrides
    (tmp_path / "config.json").write_text(json.dumps(HF["qwen3_moe"]))
    assert MoEConfig.from_hf_config(tmp_path).num_experts == 128
    assert MoEConfig.from_hf_config(tmp_path / "config.json", dtype=torch.float32).dtype == torch.float32


def test_from_hf_config_rejects_dense():
    with pytest.raises(ValueError, match="not an MoE config: missing.*num_experts"):
        MoEConfig.from_hf_config({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008})


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(num_experts=0), "num_experts must be a positive int, got 0"),
        (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
        (dict(hidden_size=3.5), "hidden_size must be a positive int"),
        (dict(activation="gelu"), "activation='gelu'"),
        (dict(routing="random"), "routing='random'"),
        (dict(dtype="int8"), "unknown dtype 'int8'"),
        (dict(routing="sigmoid_grouped", n_group=3), "n_group=3 does not divide num_experts=8"),
        (dict(routing="sigmoid_grouped", n_group=2, topk_group=3), "topk_group=3 must be in"),
        (dict(routing="sigmoid_grouped", n_group=4, topk_group=1, top_k=3), "top_k=3 exceeds the experts in topk_group=1"),
        (dict(activation="relu2", swiglu_limit=7.0), "apply to activation='swiglu' only"),
        (dict(hidden_size_unpadded=40), "hidden_size_unpadded=40"),
    ],
)
def test_config_validation(kwargs, needle):
    base = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    base.update(kwargs)
    with pytest.raises((ValueError, TypeError)) as e:
        MoEConfig(**base)
    assert needle in str(e.value)


def _softmax_loop(cfg, logits):
    ids, ws = [], []
    for row in logits.double():
        p = torch.exp(row - row.max())
        p = p / p.sum()
        order = sorted(range(len(p)), key=lambda i: -float(p[i]))[: cfg.top_k]
        w = torch.stack([p[i] for i in order])
        if cfg.renormalize:
            w = w / w.sum()
        ids.append(order)
        ws.append(w)
    return torch.tensor(ids), torch.stack(ws)


def _grouped_loop(cfg, logits, bias):
    E, G, TG = cfg.num_experts, cfg.n_group, cfg.topk_group
    per = E // G
    ids, ws = [], []
    for row in logits.double():
        s = 1 / (1 + torch.exp(-row))
        c = s + bias.double()
        gscore = [float(sorted(c[g * per:(g + 1) * per].tolist(), reverse=True)[0]
                        + sorted(c[g * per:(g + 1) * per].tolist(), reverse=True)[1]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: -gscore[g])[:TG]
        cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
        chosen = sorted(cand, key=lambda e: -float(c[e]))[: cfg.top_k]
        w = torch.stack([s[e] for e in chosen])
        if cfg.renormalize:
            w = w / w.sum()
        ids.append(chosen)
        ws.append(w * cfg.routed_scaling_factor)
    return torch.tensor(ids), torch.stack(ws)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing(renormalize):
    seed = fresh_seed()
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=8, intermediate_size=8, renormalize=renormalize)
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(seed)) * 3
    r = route(cfg, logits)
    ids, ws = _softmax_loop(cfg, logits)
    assert r.topk_ids.dtype == torch.int32 and r.topk_weights.dtype == torch.float32
    assert torch.equal(r.topk_ids.long(), ids), seed
    torch.testing.assert_close(r.topk_weights.double(), ws, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_sigmoid_routing(renormalize):
    seed = fresh_seed()
    cfg = MoEConfig(num_experts=32, top_k=6, hidden_size=8, intermediate_size=8, routing="sigmoid_grouped",
                    n_group=8, topk_group=3, routed_scaling_factor=2.5, renormalize=renormalize)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 32, generator=g) * 2
    bias = torch.randn(32, generator=g) * 0.3
    r = route(cfg, logits, bias)
    ids, ws = _grouped_loop(cfg, logits, bias)
    assert torch.equal(r.topk_ids.long(), ids), seed
    torch.testing.assert_close(r.topk_weights.double(), ws, rtol=1e-6, atol=1e-7)
    # every chosen expert lies in one of topk_group groups
    groups = (r.topk_ids // 4).long()
    assert all(len(set(row.tolist())) <= 3 for row in groups)
