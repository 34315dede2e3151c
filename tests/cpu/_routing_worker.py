"""Triton-interpreter worker (TRITON_INTERPRET=1): the fused routing kernels (`epmoe.routing`,
impl "triton") against the torch routing on CPU. Case "routing,E,K,T,extra" (extra: a tag, below);
one JSON line per case.

Expected ids come from the torch math with a STABLE descending sort in place of topk (ties: lowest
expert id first, the kernel's documented rule); weights are compared with `route_torch` (~1 ulp)."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from epmoe.config import MoEConfig  # noqa: E402
from epmoe.routing import Router, route, route_torch  # noqa: E402
from tests.cpu.interpret import report_cases  # noqa: E402


def _topk_stable(v, k):
    vals, idx = torch.sort(v, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def _choose(v, k):
    """The k largest of each row, ties by the lowest index (a stable sort) -> (ids, tied): tied marks
    the rows whose k-th and (k+1)-th largest values are equal (a tie at the k-th place)."""
    vals, idx = _topk_stable(v, k + 1)  # one past the k-th, where a row has one
    if k < v.shape[-1]:
        tied = vals[:, k - 1] == vals[:, k]
    else:
        tied = torch.zeros(v.shape[0], dtype=torch.bool)
    return idx[:, :k], tied


def route_stable(cfg, logits, bias):
    """route_torch's math with ties broken by the lowest index (stable sorts) -> (ids, tied): tied marks
    the rows with a tie at the k-th place (or between groups at the topk_group-th), where torch's own
    topk may choose another expert."""
    x = logits.float()
    K = cfg.top_k
    if cfg.routing == "softmax":
        return _choose(torch.softmax(x, dim=-1), K)
    s = torch.sigmoid(x)
    c = s + bias.float() if bias is not None else s
    T, E = c.shape
    g = c.view(T, cfg.n_group, E // cfg.n_group)
    gs = _topk_stable(g, 2)[0].sum(-1)
    gi, groups_tied = _choose(gs, cfg.topk_group)
    mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gi, True)
    masked = torch.where(mask.unsqueeze(-1), g, float("-inf")).view(T, E)
    ids, tied = _choose(masked, K)
    return ids, tied | groups_tied


def run_case(routing, E, K, T, extra, seed):
    g = torch.Generator().manual_seed(seed)
    kw = {}
    if routing == "sigmoid_grouped":
        n_group = 4 if E % 8 else 8
        kw = dict(n_group=n_group, topk_group=max(1, n_group // 2), routed_scaling_factor=2.5)
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=64, intermediate_size=32, dtype=torch.bfloat16,
                    routing=routing, renormalize=extra != "norenorm", **kw)
    logits = torch.randn(T, E, generator=g)
    if extra == "ties":  # few distinct values: many exact ties at the k-th place and between groups
        logits = torch.randint(0, 3, (T, E), generator=g).float()
    elif extra == "bf16":
        logits = (logits * 3).to(torch.bfloat16)
    elif extra == "strided":
        logits = torch.randn(T, 2 * E, generator=g)[:, ::2]
    bias = torch.randn(E, generator=g) * 0.1 if routing == "sigmoid_grouped" and extra != "nobias" else None
    got = route(cfg, logits, bias, impl="triton")
    ref = route_torch(cfg, logits, bias)
    exp_ids, tied = route_stable(cfg, logits, bias)
    exp_ids = exp_ids.to(torch.int32)
    res = dict(shape=list(got.topk_ids.shape) == [T, K] and list(got.topk_weights.shape) == [T, K],
               dtypes=got.topk_ids.dtype == torch.int32 and got.topk_weights.dtype == torch.float32,
               ids=bool(torch.equal(got.topk_ids, exp_ids)))
    if extra == "ties":  # the torch CPU topk breaks ties its own way: weights of the stable choice
        ref_w = None
    else:
        ref_w = ref.topk_weights
        # torch's CPU topk breaks a tie at the k-th place its own way (bf16 logits tie now and then):
        # the same sets on the rows without one (ids above holds every row to the stable rule)
        clear = ~tied
        res["same_sets_as_torch"] = bool(torch.equal(got.topk_ids[clear].sort(-1).values,
                                                     ref.topk_ids[clear].sort(-1).values))
    if ref_w is not None and T:
        err = ((got.topk_weights - ref_w).abs() / ref_w.abs().clamp(min=1e-30)).max().item()
        res["weights_rel_err"] = err
        res["weights"] = err < 2e-6
    # the layer's Router (impl auto on CPU under the interpreter: the fused kernel) gives the same
    r = Router(cfg, "cpu")
    res["router_is_fused"] = r.impl == "triton"
    again = r(logits, bias)
    res["router_same"] = bool(torch.equal(again.topk_ids, got.topk_ids) and torch.equal(again.topk_weights, got.topk_weights))
    res["all_equal"] = all(v for v in res.values() if isinstance(v, bool))
    return res


def nan_row(seed):
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=64, intermediate_size=32, dtype=torch.bfloat16)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
    logits[1] = float("nan")
    got = route(cfg, logits, impl="triton")
    ref = route_torch(cfg, logits)
    ok = (got.topk_ids[1] == -1).all().item() and (got.topk_weights[1] == 0).all().item()
    ok = ok and torch.equal(got.topk_ids[[0, 2]], ref.topk_ids[[0, 2]])
    return dict(all_equal=bool(ok))


def main() -> None:
    def run(case, seed):
        if case == "nan":
            return nan_row(seed)
        routing, E, K, T, extra = case.split(",")
        return run_case(routing, int(E), int(K), int(T), extra, seed)

    report_cases(sys.argv[1:], run)


if __name__ == "__main__":
    main()
