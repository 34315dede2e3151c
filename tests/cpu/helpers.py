"""Shared test helpers: random configs/weights/inputs with explicit seeds, error metrics."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

import torch

from epmoe.config import MoEConfig
from epmoe.quant.weights import ExpertWeights


def fresh_seed() -> int:
    """A new seed per run (printed by the tests that use it, so a failure can be replayed)."""
    env = os.environ.get("EPMOE_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


def random_weights(config: MoEConfig, seed: int, dtype: Optional[torch.dtype] = None) -> ExpertWeights:
    """Global expert weights scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    dt = dtype or config.dtype

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    w1 = rnd(E, I, H, scale=H ** -0.5)
    w3 = rnd(E, I, H, scale=H ** -0.5) if config.is_gated else None
    w2 = rnd(E, H, I, scale=I ** -0.5)
    b13 = b2 = None
    if config.has_bias:
        b13 = rnd(E, config.w13_rows, scale=0.1)
        b2 = rnd(E, H, scale=0.1)
    return ExpertWeights(w1=w1, w2=w2, w3=w3, b13=b13, b2=b2)


def random_inputs(config: MoEConfig, num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, config.hidden_size, generator=g).to(config.dtype)
    logits = torch.randn(num_tokens, config.num_experts, generator=g) * 2
    return x, logits


def random_correction_bias(config: MoEConfig, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn(config.num_experts, generator=g) * 0.1


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 when both are empty)."""
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package; tests load them by path)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def load_aot_sm90():
    """benchmarks/aot_sm90.py as a module (the sm90 compile tool)."""
    return load_benchmark("aot_sm90")
