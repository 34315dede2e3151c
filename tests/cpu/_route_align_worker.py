"""Triton-interpreter worker (TRITON_INTERPRET=1): the routing launch that also aligns
(`Router.route_aligned`, `route_align_kernel`) against the two launches it replaces (the fused routing
kernel, then `align_blocks_triton`'s one-program alignment) and against the torch alignment
(`align_blocks(sort_by_expert(...))`), field by field, exactly; and the ep = 1 layer (torch dispatcher,
triton experts) with the fused launch against the same layer without it (bit for bit) and the float64
reference. One JSON line per case.

Cases: "route,routing,E,K,T,block_m,extra" (extra: none | nan (a row of NaN logits: ids -1) | nobias |
strided) and "layer,routing,T"."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from epmoe.config import MoEConfig  # noqa: E402
from epmoe.experts.triton import align as A  # noqa: E402
from epmoe.routing import Router  # noqa: E402
from tests.cpu.interpret import report_cases  # noqa: E402


def _cfg(routing, E, K, **kw):
    extra = {}
    if routing == "sigmoid_grouped":
        n_group = 4 if E % 8 else 8
        extra = dict(n_group=n_group, topk_group=max(1, n_group // 2), routed_scaling_factor=2.5)
    return MoEConfig(num_experts=E, top_k=K, hidden_size=kw.get("H", 64), intermediate_size=kw.get("I", 32),
                     dtype=torch.bfloat16, routing=routing, **extra)


def route_case(routing, E, K, T, bm, extra, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = _cfg(routing, E, K)
    logits = torch.randn(T, E, generator=g) * 2
    if extra == "nan" and T > 1:
        logits[T // 2] = float("nan")
    if extra == "strided":
        logits = torch.randn(T, 2 * E, generator=g)[:, ::2]
    bias = torch.randn(E, generator=g) * 0.1 if routing == "sigmoid_grouped" and extra != "nobias" else None
    router = Router(cfg, "cpu")
    assert router.impl == "triton"
    launches = []
    real = router._launch

    def counting(name, grid, args, kwargs):
        launches.append(name)
        real(name, grid, args, kwargs)

    router._launch = counting
    routing_got, blocks = router.route_aligned(logits, bias, E, bm)
    ref_routing = router(logits, bias)  # the routing kernel alone
    res = dict(launches=launches[0] == "route_align_kernel" and len(launches) == 2,  # (+ the reference's)
               ids=bool(torch.equal(routing_got.topk_ids, ref_routing.topk_ids)),
               weights=bool(torch.equal(routing_got.topk_weights, ref_routing.topk_weights)),
               shapes=list(routing_got.topk_ids.shape) == [T, K] and routing_got.topk_weights.dtype == torch.float32
               and routing_got.topk_ids.is_contiguous() and routing_got.topk_weights.is_contiguous())
    ref = A.align_blocks(A.sort_by_expert(ref_routing.topk_ids, E), bm)
    res["max_blocks"] = blocks.max_blocks == ref.max_blocks
    for f in ("sorted_ids", "block_expert", "block_rows"):
        res[f] = bool(torch.equal(getattr(blocks, f), getattr(ref, f)))
    if extra == "nan" and T > 1:
        res["nan_row_invalid"] = bool((routing_got.topk_ids[T // 2] == -1).all())
    res["all_equal"] = all(v for v in res.values() if isinstance(v, bool))
    return res


def not_applied(seed):
    """More entries than the one-program alignment takes, or no tokens: the routing alone, no alignment."""
    cfg = _cfg("softmax", 16, 8)
    router = Router(cfg, "cpu")
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(A.SINGLE_LAUNCH_MAX_ENTRIES // 8 + 1, 16, generator=g)
    r_big, b_big = router.route_aligned(big, None, 16, 16)
    r_none, b_none = router.route_aligned(big[:0], None, 16, 16)
    router.impl = "torch"
    r_torch, b_torch = router.route_aligned(big[:4], None, 16, 16)
    ok = b_big is None and b_none is None and b_torch is None
    ok = ok and torch.equal(r_big.topk_ids, Router(cfg, "cpu")(big).topk_ids) and r_none.topk_ids.shape == (0, 8)
    # under CUDA-graph capture only up to ROUTE_ALIGN_GPU_MAX_LOGITS logits (T x experts)
    import epmoe.routing as RT

    router.impl = "auto"
    capturing, RT.capturing = RT.capturing, lambda device: True
    try:
        limit_t = RT.ROUTE_ALIGN_GPU_MAX_LOGITS // 16
        _, b_small = router.route_aligned(big[:limit_t], None, 16, 16)
        r_over, b_over = router.route_aligned(big[:limit_t + 1], None, 16, 16)
    finally:
        RT.capturing = capturing
    ok = ok and b_small is not None and b_over is None
    ok = ok and torch.equal(r_over.topk_ids, Router(cfg, "cpu")(big[:limit_t + 1]).topk_ids)
    return dict(all_equal=bool(ok))


def layer_case(routing, T, seed):
    from epmoe import EPMoE, reference_moe
    from epmoe.resolve import detect_environment, resolve_plan
    from tests.cpu.helpers import max_rel_err, random_inputs, random_weights
    from tests.triton_interpret import match_gpu_rounding

    match_gpu_rounding()
    cfg = _cfg(routing, 16, 4, H=128, I=64)
    plan = resolve_plan(cfg, dispatcher="torch", experts="triton", environment=detect_environment(arch="sm90"))
    layer = EPMoE(cfg, dispatcher="torch", experts="triton", device="cpu", max_num_tokens_per_rank=64, plan=plan)
    w = random_weights(cfg, seed)
    layer.load_weights(w)
    x, logits = random_inputs(cfg, T, seed)
    names = []
    for owner in (layer.router, layer.experts):
        real = owner._launch
        owner._launch = (lambda real: lambda n, g, a, k: (names.append(n), real(n, g, a, k)))(real)
    fused = layer(x, logits, return_routing=True)
    fused_names, names[:] = list(names), []
    layer._fuse_alignment = False
    plain = layer(x, logits, return_routing=True)
    ref = reference_moe(cfg, x, w, logits)
    res = dict(
        fused_launch="route_align_kernel" in fused_names and "align_small_kernel" not in fused_names,
        plain_launches="route_align_kernel" not in names and "align_small_kernel" in names,
        one_launch_fewer=len(fused_names) == len(names) - 1,
        same_bits=bool(torch.equal(fused.hidden_states, plain.hidden_states)),
        same_routing=bool(torch.equal(fused.routing.topk_ids, plain.routing.topk_ids)
                          and torch.equal(fused.routing.topk_weights, plain.routing.topk_weights)),
        err=max_rel_err(fused.hidden_states, ref),
    )
    res["vs_reference"] = res["err"] < 2e-2
    res["all_equal"] = all(v for v in res.values() if isinstance(v, bool))
    return res


def main() -> None:
    def run(case, seed):
        kind, *rest = case.split(",")
        if kind == "not_applied":
            return not_applied(seed)
        if kind == "layer":
            return layer_case(rest[0], int(rest[1]), seed)
        routing, E, K, T, bm, extra = rest
        return route_case(routing, int(E), int(K), int(T), int(bm), extra, seed)

    report_cases(sys.argv[1:], run)


if __name__ == "__main__":
    main()
