"""Runs TritonExperts under the Triton interpreter (started by test_triton_experts_interpret.py in a
subprocess with TRITON_INTERPRET=1 set before triton is imported). Prints one JSON line per case."""

import os
import sys
from dataclasses import replace

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.cpu.interpret import report_cases  # noqa: E402
from epmoe.config import MoEConfig  # noqa: E402
from epmoe.dispatch.base import DispatchedTokens  # noqa: E402
from epmoe.experts.triton import kernel_formats as kf  # noqa: E402
from tests import experts_testing as T  # noqa: E402
from epmoe.experts.base import ExpertsSpec  # noqa: E402
from epmoe.core.availability import Availability  # noqa: E402
from epmoe.experts.triton.grouped_mm import GroupedMMExperts  # noqa: E402
from epmoe.experts.triton.triton_experts import GemmConfig, TritonConfig, TritonExperts  # noqa: E402
from tests.triton_interpret import match_gpu_rounding  # noqa: E402
from epmoe.quant.plan import QuantPlan  # noqa: E402

match_gpu_rounding()

SHAPES = {
    # E local, K, H, I: H and I not multiples of the tiles (masks), I % 64 == 0 for fp4
    "swiglu": dict(num_experts=4, top_k=3, hidden_size=192, intermediate_size=64),
    "oai": dict(
        num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, has_bias=True,
        swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
    ),  # fmt: skip
    "relu2": dict(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, activation="relu2"),
    "ragged": dict(num_experts=3, top_k=2, hidden_size=80, intermediate_size=48),  # K tails, N masks
    # several 128-groups along H and I (and a partial one): fp8 scale indexing per K step and column
    "groups": dict(num_experts=3, top_k=2, hidden_size=320, intermediate_size=192),
}


def tiny_config(mode: str, split: bool = False) -> TritonConfig:
    """16-row tiles (mma shapes the interpreter runs quickly); split: 32-row tiles whose expert tails
    of <= 16 rows run the half-height path."""
    bk = 128 if mode == "fp8_block" else 64
    bn1 = 128 if mode == "fp8_block" else 32
    return TritonConfig("tiny", 32 if split else 16, GemmConfig(bn1, bk, 4, 1, 2), GemmConfig(32, bk, 4, 1, 2), split)


def _pow2_blocks(shape, block_rows, block_cols, lo, hi, g) -> torch.Tensor:
    """[..., R, C] factors 2^k, k uniform in [lo, hi], constant on block_rows x block_cols blocks:
    exact in bf16, and makes the 1x128 / 128x128 quantization groups' amax differ by up to 2^(hi-lo),
    so reading a neighbouring group's scale is a large error, not a 1-2% one."""
    *lead, R, C = shape
    nr, nc = -(-R // block_rows), -(-C // block_cols)
    k = torch.randint(lo, hi + 1, (*lead, nr, nc), generator=g).float()
    f = torch.exp2(k).repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return f[..., :R, :C]


def _nonuniform(w, x, g):
    scale = lambda t: None if t is None else (t.float() * _pow2_blocks(t.shape, 128, 128, -3, 3, g)).to(t.dtype)  # noqa: E731
    w = replace(w, w1=scale(w.w1), w3=scale(w.w3), w2=scale(w.w2))
    x = (x.float() * _pow2_blocks(x.shape, 1, 128, -4, 4, g)).to(x.dtype)
    return w, x


def _fp8_stage_check(ex, cfg, x, ids, w) -> dict:
    """The in-kernel input quantizer against the torch codec (bit for bit), and gemm1's fp8 output
    (bytes and 1x128 scales) against float64 math on the same quantized operands."""
    from epmoe.experts.triton.align import align_blocks, sort_by_expert

    N, K = ids.shape
    E, I = ex.num_experts, ex.intermediate_size
    xq, xs = ex._input_activations(x)
    tq, ts = kf.quantize_fp8_tokens(x)
    res = dict(
        xq_mismatch=float((xq.view(torch.uint8) != tq.view(torch.uint8)).float().mean()),
        xs_equal=bool(torch.equal(xs, ts)),
    )
    ids32 = ids.to(torch.int32).contiguous()
    blocks = align_blocks(sort_by_expert(ids32, E), cfg.block_m)
    act, act_s = ex._gemm1(xq, xs, blocks, N * K, K, cfg)
    d = kf.dequantize_expert_weights(kf.quantize_expert_weights(w, "fp8_block"))
    w13 = d.w13().double()
    xd = kf.dequantize_fp8_tokens(tq, ts).double()
    pos = torch.nonzero(blocks.sorted_ids < N * K).flatten()
    ent = blocks.sorted_ids[pos].long()
    exp = blocks.block_expert[pos // cfg.block_m].long()
    h = torch.einsum("rh,rnh->rn", xd[ent // K], w13[exp])
    a = T.activation_reference(ex.config, h[:, :I], h[:, I:] if ex.gated else None)
    aq, a_s = kf.quantize_fp8_tokens(a.float())
    res["act_mismatch"] = float((act[pos].view(torch.uint8) != aq.view(torch.uint8)).float().mean())
    res["act_scale_rel"] = float(((act_s[pos] - a_s).abs() / a_s).max())
    return res


def _grouped_reference(cfg, w, x, ids, tw):
    """float64 math with the grouped_mm path's two bf16 roundings: gemm1's output and the activation
    (each expert output y is bf16 too; the combine sums in fp32)."""
    E, I = w.num_experts, cfg.intermediate_size
    xd = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        h = (xd[rows] @ w.w13()[e].double().T).bfloat16().double()
        if cfg.has_bias:
            h = h + w.b13[e].double()
        a = T.activation_reference(cfg, h[:, :I], h[:, I:] if cfg.is_gated else None).bfloat16().double()
        y = (a @ w.w2[e].double().T).bfloat16().double()
        if cfg.has_bias:
            y = y + w.b2[e].double()
        out.index_add_(0, rows, y * tw[rows, slots].double()[:, None])
    return out


def run_case(mode: str, shape: str, opts: tuple, seed: int) -> dict:
    cfg = MoEConfig(**SHAPES[shape])
    E = cfg.num_experts
    options = (("triton_gate_up", "blocked"),) if "blocked" in opts else ()
    if "gmm" in opts:  # the bf16 torch._grouped_mm path of the triton backend (fused epilogues)
        options += (("triton_grouped_mm", "on"),)
    if "talign" in opts:  # the torch routing alignment instead of the alignment kernels
        options += (("triton_align", "torch"),)
    backend = mode
    if mode == "grouped_mm":  # GroupedMMExperts with its fused Triton epilogues
        GroupedMMExperts.availability = classmethod(lambda c, s: Availability.yes("interpreter test"))
        mode = "bf16"
    spec = ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode=mode), options=options)
    tcfg = tiny_config(mode, split="split" in opts)
    if backend == "grouped_mm":
        ex = GroupedMMExperts(spec)
        assert ex.epilogue == "triton", ex.epilogue
    else:
        ex = TritonExperts(spec)
        if "gmm" not in opts:
            ex.config_override = tcfg
    w = T.random_expert_weights(cfg, E, seed=seed)
    N = 40 if "split" in opts else 9
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(N, cfg.hidden_size, generator=g).to(cfg.dtype)
    if "nonuniform" in opts:
        w, x = _nonuniform(w, x, g)
    ex.load_weights(w)
    ids, tw = T.random_local_routing(N, cfg.top_k, E, seed=seed + 2, invalid_frac=0.3, empty_rows=2)
    if "split" in opts:
        # expert 0 in slot 0 of every non-empty row: 38 rows = one full 32-row tile + a 6-row tail
        ids = torch.where(ids == 0, torch.full_like(ids, -1), ids)
        ids[: N - 2, 0] = 0
    if "gmm" in opts:
        assert ex.uses_grouped_mm(N * cfg.top_k)
    out = ex(DispatchedTokens(x, ids, tw))
    grouped = backend == "grouped_mm" or "gmm" in opts

    def bf16_roundtrip(a):  # gemm1 writes a bf16 activation
        return a.to(torch.bfloat16).double()

    def fp8_roundtrip(a):  # ... or an fp8 one with 1x128 scales
        aq, a_s = kf.quantize_fp8_tokens(a.float())
        return kf.dequantize_fp8_tokens(aq, a_s).double()

    rt = fp8_roundtrip if mode == "fp8_block" else bf16_roundtrip
    w13 = w2 = None
    xr = x
    if mode != "bf16":
        d = kf.dequantize_expert_weights(kf.quantize_expert_weights(w, mode))
        w13, w2 = d.w13(), d.w2
        if mode == "fp8_block":
            xq, xs = kf.quantize_fp8_tokens(x)
            xr = kf.dequantize_fp8_tokens(xq, xs)

    if grouped:
        # gemm1's output is rounded to bf16 before the activation (torch._grouped_mm writes bf16)
        w13 = w.w13()
        ref = _grouped_reference(cfg, w, x, ids, tw)
    else:
        ref = T.experts_reference(cfg, w, xr, ids, tw, w13=w13, w2=w2, act_roundtrip=rt)
    err = T.relative_error(out, ref)
    empty_zero = bool((out[-2:] == 0).all())
    finite = bool(torch.isfinite(out).all())
    res = dict(err=err, empty_rows_zero=empty_zero, finite=finite, shape=list(out.shape), dtype=str(out.dtype))
    if "split" in opts:
        from epmoe.experts.triton.align import align_blocks, sort_by_expert

        rows = align_blocks(sort_by_expert(ids.to(torch.int32), E), tcfg.block_m).block_rows
        res["tiles_full"] = int((rows > tcfg.block_m // 2).sum())
        res["tiles_half"] = int(((rows > 0) & (rows <= tcfg.block_m // 2)).sum())
    if mode == "fp8_block" and "stages" in opts:
        res.update(_fp8_stage_check(ex, tcfg, x, ids, w))
    return res


def _run(case: str, seed: int) -> dict:
    mode, shape, *rest = case.split(":")
    return run_case(mode, shape, tuple(rest[0].split("+")) if rest else (), seed)


def main() -> None:
    report_cases(sys.argv[1:], _run)


if __name__ == "__main__":
    main()
