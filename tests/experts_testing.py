"""Float64 math of the experts stage and random problem generators, for tests and benchmarks of
experts backends (plain torch; no optional packages).

    weights = random_expert_weights(config, num_experts, device, seed)
    ids, w = random_local_routing(num_tokens, top_k, num_experts, device, seed, invalid_frac=0.25)
    ref [N, H] float64 = experts_reference(config, weights, hidden, ids, w)
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from epmoe.config import MoEConfig
from epmoe.experts.activation import apply_activation
from epmoe.quant.weights import ExpertWeights


def _generator(device, seed: int) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def random_expert_weights(
    config: MoEConfig,
    num_experts: int,
    device="cpu",
    seed: int = 0,
    dtype: Optional[torch.dtype] = None,
    first_expert: int = 0,
) -> ExpertWeights:
    """Canonical weights with ~unit-variance outputs (scale 1/sqrt(fan_in)); biases O(0.1)."""
    dt = dtype or config.dtype
    g = _generator(device, seed)
    E, H, I = num_experts, config.hidden_size, config.intermediate_size

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dt)

    w1 = rnd(E, I, H, scale=1 / math.sqrt(H))
    w3 = rnd(E, I, H, scale=1 / math.sqrt(H)) if config.is_gated else None
    w2 = rnd(E, H, I, scale=1 / math.sqrt(I))
    b13 = b2 = None
    if config.has_bias:
        b13 = rnd(E, config.w13_rows, scale=0.1)
        b2 = rnd(E, H, scale=0.1)
    return ExpertWeights(w1=w1, w2=w2, w3=w3, b13=b13, b2=b2, first_expert=first_expert)


def random_local_routing(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    device="cpu",
    seed: int = 0,
    invalid_frac: float = 0.0,
    empty_rows: int = 0,
):
    """(topk_ids [T, K] int32 local ids, distinct per row, -1 with prob `invalid_frac`;
    topk_weights [T, K] float32 in (0.05, 1)). The last `empty_rows` rows are all -1."""
    g = _generator(device, seed)
    T, K, E = num_tokens, top_k, num_experts
    if K <= E:
        ids = torch.rand(T, E, generator=g, device=device).argsort(dim=1)[:, :K].to(torch.int32)
    else:
        ids = torch.randint(0, E, (T, K), generator=g, device=device, dtype=torch.int32)
    return _drop_and_weigh(ids, g, invalid_frac, empty_rows)


def _drop_and_weigh(ids: torch.Tensor, g: torch.Generator, invalid_frac: float, empty_rows: int = 0):
    """(ids with each slot -1 with prob invalid_frac and the last empty_rows rows all -1, topk_weights
    float32 in (0.05, 1)), drawn from g after the ids."""
    T, K = ids.shape
    if invalid_frac > 0:
        drop = torch.rand(T, K, generator=g, device=ids.device) < invalid_frac
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    if empty_rows:
        ids[T - empty_rows :] = -1
    w = torch.rand(T, K, generator=g, device=ids.device, dtype=torch.float32) * 0.95 + 0.05
    return ids, w


def skewed_local_routing(num_tokens: int, top_k: int, num_experts: int, device="cpu", seed: int = 0,
                         invalid_frac: float = 0.0, power: float = 4.0):
    """`random_local_routing` with very unequal experts: each row draws top_k distinct experts with
    probabilities proportional to u_e ** power + 0.01 (u uniform per expert, same for every row), so
    the counts range from a few rows to most of the tokens (a prefill batch's routing is rarely even)."""
    g = _generator(device, seed)
    T, K, E = num_tokens, top_k, num_experts
    if K > E:
        raise ValueError(f"top_k ({K}) must not exceed num_experts ({E}) for distinct experts per row")
    p = torch.rand(E, generator=g, device=device) ** power + 0.01
    ids = torch.multinomial(p.expand(T, E), K, replacement=False, generator=g).to(torch.int32)
    return _drop_and_weigh(ids, g, invalid_frac)


def activation_reference(config: MoEConfig, g: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
    """The activation of `epmoe.config` in the dtype of g."""
    return apply_activation(config, g, u)


def experts_reference(
    config: MoEConfig,
    weights: ExpertWeights,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: Optional[torch.Tensor] = None,
    w2: Optional[torch.Tensor] = None,
    act_roundtrip=None,
) -> torch.Tensor:
    """Flat-layout expert output in float64: out[n] = sum_k w[n,k] * expert_{ids[n,k]}(x_n) over
    local ids >= 0. `w13` [E, R, H] / `w2` override the weights (e.g. dequantized ones);
    `act_roundtrip(a)` models an intermediate quantization of the activation (float64 in/out)."""
    E = weights.num_experts
    I = config.intermediate_size
    w13 = (weights.w13() if w13 is None else w13)
    w2 = weights.w2 if w2 is None else w2
    x = hidden.double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(E):
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows] @ w13[e].double().T
        if config.has_bias:
            h = h + weights.b13[e].double()
        a = activation_reference(config, h[:, :I], h[:, I:] if config.is_gated else None)
        if act_roundtrip is not None:
            a = act_roundtrip(a)
        y = a @ w2[e].double().T
        if config.has_bias:
            y = y + weights.b2[e].double()
        out.index_add_(0, rows, y * topk_weights[rows, slots].double()[:, None])
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere -> inf)."""
    o = out.double()
    if not torch.isfinite(o).all():
        return math.inf
    return float((o - ref).norm() / ref.norm().clamp_min(1e-30))


def fp8_roundtrip(a: torch.Tensor) -> torch.Tensor:
    """a through the 1x128 e4m3 activation codec and back, float64."""
    from epmoe.quant import fp8_block

    q, s = fp8_block.quantize_activation(a.float())
    return fp8_block.dequantize_activation(q, s, torch.float32).double()


def grouped_gemm_expert_reference(config: MoEConfig, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                  fp8: bool) -> torch.Tensor:
    """One expert on rows x [n, H], float64, with the roundings of an expert stage made of two grouped
    GEMMs writing bf16 (DeepGEMM's) and an activation pass between them: fp8 1x128 inputs (fp8), gemm1's
    output in bf16, the activation in fp8 1x128 or bf16, y in bf16. w13 [R, H] / w2 [H, I] as used
    (dequantized for fp8)."""
    I = config.intermediate_size
    xr = fp8_roundtrip(x) if fp8 else x.double()
    h = (xr @ w13.double().T).bfloat16().double()
    a = activation_reference(config, h[:, :I], h[:, I:] if config.is_gated else None)
    a = fp8_roundtrip(a) if fp8 else a.bfloat16().double()
    return (a @ w2.double().T).bfloat16().double()


def grouped_gemm_reference(config: MoEConfig, x, topk_ids, topk_weights, w13, w2, fp8: bool) -> torch.Tensor:
    """Flat layout: out[n] = sum_k w[n,k] * expert(x_n) (`grouped_gemm_expert_reference`), float64."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if rows.numel():
            y = grouped_gemm_expert_reference(config, x[rows], w13[e], w2[e], fp8)
            out.index_add_(0, rows, y * topk_weights[rows, slots].double()[:, None])
    return out


def fresh_seed() -> int:
    """A fresh seed per test, printed with every figure; EPMOE_TEST_SEED=N replays one."""
    if os.environ.get("EPMOE_TEST_SEED"):
        return int(os.environ["EPMOE_TEST_SEED"])
    return int.from_bytes(os.urandom(4), "little") % (2**31)


def poison_cuda_allocator(nbytes: int = 3 << 30) -> None:
    """Fill free cached CUDA memory with 0xFF (NaN in bf16/fp32/fp8) so reused blocks start poisoned."""
    torch.cuda.synchronize()
    try:
        junk = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        return
    junk.fill_(0xFF)
    del junk
    torch.cuda.synchronize()
