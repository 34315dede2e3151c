"""Tiny random transformers MoE models of every supported family, written with save_pretrained (float32).

Used by tests/cpu/test_hf_integration.py, tests/gpu/test_hf_integration_gpu.py (which passes dtype) and
tests/cpu/test_hf_triton_interpret.py."""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Tuple

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


@contextlib.contextmanager
def routing(model: torch.nn.Module, log: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]], replay: bool):
    """Record (replay=False) or replay (replay=True) the routing every experts module of `model` receives.

    Experts modules are transformers' `@use_experts_implementation` ones (also under epmoe's load_model),
    called as experts(hidden_states, top_k_index, top_k_weights). Recording appends each call's
    (index, weights) to log[module name]; replaying feeds them back in the same order, weights cast to
    the model's own dtype. A comparison of two models' logits at different precisions replays the
    reference model's routing: a token whose k-th and (k+1)-th router scores lie within the lower
    precision's noise (a near-tie) otherwise picks another expert, a discontinuity that no bound on
    the experts' numerics holds across."""
    handles = []
    for name, m in model.named_modules():
        if not all(hasattr(m, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")):
            continue

        def hook(mod, args, name=name):
            hidden, index, weights = args[:3]
            if not replay:
                log.setdefault(name, []).append((index.detach().clone(), weights.detach().clone()))
                return None
            calls = log.get(name)
            if not calls:
                raise AssertionError(f"routing replay: no recorded call left for {name}")
            r_index, r_weights = calls.pop(0)
            if r_index.shape != index.shape:
                raise AssertionError(
                    f"routing replay: {name} got {list(index.shape)}, recorded {list(r_index.shape)}"
                )
            r_index, r_weights = r_index.to(index.device, index.dtype), r_weights.to(weights.device, weights.dtype)
            return (hidden, r_index, r_weights) + args[3:]

        handles.append(m.register_forward_pre_hook(hook))
    if not handles:
        raise AssertionError(f"{type(model).__name__} has no experts modules to record / replay")
    try:
        yield log
    finally:
        for h in handles:
            h.remove()


def bf16_logit_errors(path: str, device, experts: str = "auto", rank: int = 0, replay_routing: bool = True,
                      **options):
    """Logits of one padded batch (3 + rank prompts of 12 tokens, two left-padded): float32 transformers
    (the truth), bf16 transformers, bf16 epmoe (`load_model(..., experts=experts, **options)`).

    Returns (errors, ids, mask, hf, ep): errors = dict(ep=, hf=) max |logits - truth| over the valid
    positions, scale = max |truth|, experts_backend; hf / ep the bf16 models. With replay_routing both
    bf16 models run on the float32 model's routing (`routing`), so the errors measure numerics only."""
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.transformers import load_model

    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(4, 96, (3 + rank, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on one row
    mask[2, :7] = 0
    ids, mask = ids.to(device), mask.to(device)
    log: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}

    def run(model, record: bool = False):
        if not replay_routing:
            return model(ids, attention_mask=mask).logits.float()
        with routing(model, log if record else {k: list(v) for k, v in log.items()}, replay=not record):
            return model(ids, attention_mask=mask).logits.float()

    with torch.no_grad():
        truth = run(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device), record=True)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
        hf_logits = run(hf)
        ep = load_model(path, dtype=torch.bfloat16, device=device, experts=experts, **options)
        ep_logits = run(ep)
    valid = mask.bool()
    err = lambda a: float((a - truth)[valid].abs().max())  # noqa: E731
    errors = dict(ep=err(ep_logits), hf=err(hf_logits), scale=float(truth[valid].abs().max()),
                  experts_backend=ep.model.layers[-1].mlp.experts.ep_moe.experts.name)
    return errors, ids, mask, hf, ep


# ---------------------------------------------------------------------------------------------- quantized
# family -> the format its released checkpoints ship in (epmoe.quant.checkpoint_formats names)
QUANTIZED_FORMATS = {"gpt_oss": "mxfp4-gpt-oss", "deepseek_v3": "fp8"}


def write_quantized_model(family: str, directory: str, seed: int = 0, **shape) -> str:
    """A tiny random model of `family` (save_pretrained, float32), rewritten in the format its released
    checkpoints ship in, with config.json's `quantization_config` as they carry it; returns the path.

    gpt_oss      (openai/gpt-oss-*): the routed experts as MXFP4 `experts.{gate_up,down}_proj_{blocks,scales}`
                 (+ float biases); everything else unquantized.
    deepseek_v3  (DeepSeek-V3 / R1, Kimi-K2): every nn.Linear except lm_head (attention, dense MLPs, shared
                 and routed experts) as float8_e4m3fn `weight` + float32 `weight_scale_inv` per 128x128 block;
                 embeddings, norms, the router and lm_head unquantized.
    The expert tensors come from the launcher's synthetic-checkpoint writer (`epmoe.launch.synthetic`),
    the dense FP8 blocks from the same projection writer."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from epmoe.checkpoint import load_expert_weights
    from epmoe.config import MoEConfig
    from epmoe.launch.presets import CHECKPOINT_STYLE
    from epmoe.launch.synthetic import _expert_tensors, _quantized_projection
    from epmoe.quant.checkpoint_formats import QUANTIZATION_CONFIGS

    fmt = QUANTIZED_FORMATS[family]
    src = write_tiny_model(family, os.path.join(directory, "unquantized"), seed=seed, **shape)
    path = os.path.join(directory, family)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    cfg = MoEConfig.from_hf_config(raw, dtype=torch.float32)
    style = CHECKPOINT_STYLE.get(family, "hf")
    out = dict(tensors)
    for L in range(raw["num_hidden_layers"]):
        prefix = f"model.layers.{L}.mlp."
        if not any(k.startswith(prefix + "experts.") for k in tensors):
            continue  # a dense layer (DeepSeek's first_k_dense_replace)
        experts = load_expert_weights(tensors, cfg, layer_idx=L).experts
        for k in [k for k in out if k.startswith(prefix + "experts.")]:
            del out[k]
        rows: Dict[str, List[torch.Tensor]] = {}
        for e in range(cfg.num_experts):
            per, row = _expert_tensors(cfg, fmt, style, prefix, experts.slice_experts(e, e + 1), e)
            out.update(per)
            for k, t in row.items():
                rows.setdefault(k, []).append(t)
        out.update({k: torch.stack(v).contiguous() for k, v in rows.items()})
    if fmt == "fp8":
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
        linears = [n for n, m in meta.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]
        for n in linears:
            out.update({f"{n}.{s}": t.contiguous()
                        for s, t in _quantized_projection("fp8", tensors[f"{n}.weight"], "w1", 0).items()})
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    raw["quantization_config"] = QUANTIZATION_CONFIGS[fmt]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    return path
