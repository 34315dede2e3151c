"""Tiny random transformers MoE models of every supported family, written with save_pretrained (float32).

Used by tests/cpu/test_hf_integration.py and tests/gpu/test_hf_integration_gpu.py (which passes dtype)."""

from __future__ import annotations

import os
from typing import Dict

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
MORE_FAMILIES = ("olmoe", "phimoe", "glm4_moe", "dots1")  # same experts layout; checked on 2 ranks


def tiny_config(family: str, num_experts: int = 8, layers: int = 2, hidden: int = 32, inter: int = 16,
                init_std: float = 0.2):
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=init_std,
                  num_experts_per_tok=2, eos_token_id=3, pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=inter, num_local_experts=num_experts)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=2 * inter, moe_intermediate_size=inter,
                                 shared_expert_intermediate_size=2 * inter, num_experts=num_experts,
                                 decoder_sparse_step=1, norm_topk_prob=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=hidden // 4, intermediate_size=2 * inter,
                                 moe_intermediate_size=inter, num_experts=num_experts, decoder_sparse_step=1,
                                 norm_topk_prob=True)
    if family == "deepseek_v3":
        common = {**common, "num_key_value_heads": 4, "num_hidden_layers": layers + 1}
        return tf.DeepseekV3Config(**common, intermediate_size=2 * inter, moe_intermediate_size=inter,
                                   first_k_dense_replace=1, n_routed_experts=num_experts, n_shared_experts=1,
                                   n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, head_dim=hidden // 4, intermediate_size=inter,
                               num_local_experts=num_experts, sliding_window=8)
    if family == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=inter, num_experts=num_experts)
    if family == "phimoe":
        return tf.PhimoeConfig(**common, intermediate_size=inter, num_local_experts=num_experts)
    if family in ("glm4_moe", "dots1"):
        cls = tf.Glm4MoeConfig if family == "glm4_moe" else tf.Dots1Config
        return cls(**common, head_dim=hidden // 4, intermediate_size=2 * inter, moe_intermediate_size=inter,
                   n_routed_experts=num_experts, n_shared_experts=1, n_group=2, topk_group=1,
                   first_k_dense_replace=1, routed_scaling_factor=2.5)
    raise ValueError(family)


def write_tiny_model(family: str, directory: str, seed: int = 0, dtype=torch.float32, **shape) -> str:
    """save_pretrained a random tiny model of `family` into directory/family; returns that path."""
    from transformers import AutoModelForCausalLM

    path = os.path.join(directory, family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **shape), dtype=dtype)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init; make the grouped routing use it
                buf.copy_(torch.randn_like(buf) * 0.5)
        for name, p in model.named_parameters():
            if name.endswith("_bias") or name.endswith("router.bias"):  # GPT-OSS biases start at zero
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def write_all(directory: str, families=FAMILIES, **shape) -> Dict[str, str]:
    return {f: write_tiny_model(f, directory, **shape) for f in families}
