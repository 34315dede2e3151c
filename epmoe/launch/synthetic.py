"""Synthetic checkpoints in real formats: config.json + safetensors with HF tensor names, written by
one process per node and read back by every rank through the real loader (`EPMoE.load_weights`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from epmoe.checkpoint import hf_expert_tensors
from epmoe.config import MoEConfig, dtype_name
from epmoe.launch.presets import CHECKPOINT_STYLE
from epmoe.quant.weights import ExpertWeights


@dataclass(frozen=True)
class SyntheticLayer:
    """Global tensors of one layer as written (kept by the checking rank for the reference)."""

    experts: ExpertWeights
    gate: torch.Tensor  # [E, H] router weight
    e_score_correction_bias: Optional[torch.Tensor]


def layer_prefix(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.mlp."


def make_layer(config: MoEConfig, seed: int, layer_idx: int) -> SyntheticLayer:
    """Random weights scaled so activations stay O(1) through a stack of layers."""
    g = torch.Generator().manual_seed(seed * 1000 + layer_idx)
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(config.dtype)

    experts = ExpertWeights(
        w1=rnd(E, I, H, scale=H ** -0.5),
        w3=rnd(E, I, H, scale=H ** -0.5) if config.is_gated else None,
        w2=rnd(E, H, I, scale=I ** -0.5),
        b13=rnd(E, config.w13_rows, scale=0.05) if config.has_bias else None,
        b2=rnd(E, H, scale=0.05) if config.has_bias else None,
    )
    gate = rnd(E, H, scale=H ** -0.5)
    corr = None
    if config.routing == "sigmoid_grouped":
        corr = torch.randn(E, generator=g) * 0.05
    return SyntheticLayer(experts=experts, gate=gate, e_score_correction_bias=corr)


def write_checkpoint(directory: str, config: MoEConfig, hf_config: dict, num_layers: int, seed: int) -> Dict[int, SyntheticLayer]:
    """Write config.json and model.safetensors (HF names) for `num_layers` layers; returns the layers."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    style = CHECKPOINT_STYLE.get(config.model_type, "hf")
    tensors: Dict[str, torch.Tensor] = {}
    layers = {}
    for L in range(num_layers):
        layer = make_layer(config, seed, L)
        layers[L] = layer
        p = layer_prefix(L)
        tensors.update(hf_expert_tensors(config, layer.experts, p, style, layer.e_score_correction_bias))
        tensors[f"{p}gate.weight"] = layer.gate.contiguous()
    tmp = os.path.join(directory, f".model.safetensors.{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": "pt", "epmoe_synthetic_seed": str(seed)})
    os.replace(tmp, os.path.join(directory, "model.safetensors"))  # readers never see a partial file
    cfg = dict(hf_config)
    cfg.update(num_hidden_layers=num_layers, torch_dtype=dtype_name(config.dtype))
    cfg.pop("quantization_config", None)  # the synthetic weights are unquantized
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return layers


def read_gate(directory: str, layer_idx: int) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as h:
        return h.get_tensor(f"{layer_prefix(layer_idx)}gate.weight")
