"""Model presets as HF `config.json` dicts (parsed by MoEConfig.from_hf_config, like a real checkpoint's)."""

PRESETS = {
    # small enough for a laptop CPU: the default for `--check` runs and CI
    "tiny": {
        "model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 4, "hidden_size": 256,
        "moe_intermediate_size": 128, "norm_topk_prob": True, "num_hidden_layers": 2,
    },
    # Mixtral-8x7B
    "mixtral": {
        "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "torch_dtype": "bfloat16",
    },
    # Qwen3-30B-A3B
    "qwen3-moe": {
        "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 2048,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_hidden_layers": 48, "torch_dtype": "bfloat16",
    },
    # DeepSeek-V3 / R1 (58 MoE layers of 61)
    "dsv3": {
        "model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8, "hidden_size": 7168,
        "moe_intermediate_size": 2048, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_hidden_layers": 58,
        "torch_dtype": "bfloat16",
    },
    # gpt-oss-120b (hidden 2880: the layer runs at 2880; FlashInfer CUTLASS pads only its own weight geometry)
    "gpt-oss": {
        "model_type": "gpt_oss", "num_local_experts": 128, "experts_per_token": 4, "hidden_size": 2880,
        "intermediate_size": 2880, "swiglu_limit": 7.0, "num_hidden_layers": 36, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4"},
    },
}

# checkpoint naming style written for each preset's synthetic weights
CHECKPOINT_STYLE = {"mixtral": "mixtral", "gpt_oss": "gpt_oss"}
