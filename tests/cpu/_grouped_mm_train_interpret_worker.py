"""The grouped_mm experts' fused training stage (`fused_grouped_mm_train_forward`: Triton gather,
activation and weighted combine with their own backward kernels) under the Triton interpreter, started by
test_grouped_mm_train_interpret.py with TRITON_INTERPRET=1. Per case: the output and the gradients of
the tokens, the routing weights, w13 and w2 against the torch composite (`grouped_mm_train_forward`, the
same float32 arithmetic) and against float64 autograd through a dense loop."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from epmoe.config import MoEConfig  # noqa: E402
from epmoe.experts.activation import apply_activation  # noqa: E402
from epmoe.experts.triton.grouped_mm import fused_grouped_mm_train_forward, grouped_mm_train_forward  # noqa: E402
from epmoe.experts.triton.launch import KernelLauncher  # noqa: E402
from tests.cpu.interpret import report_cases  # noqa: E402

SHAPE = dict(num_experts=4, top_k=3, hidden_size=80, intermediate_size=48)  # H, I not powers of 2: masks
ACTS = {
    "silu": {},
    # a limit inside the values' range, so both clamps cut (their gradient is 0 there)
    "swiglu_clamp": dict(swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=0.4),
    "swiglu_ab": dict(swiglu_alpha=1.702, swiglu_beta=1.0),
    "relu2": dict(activation="relu2"),
}


def dense_reference(cfg, x, ids, w, w13, w2):
    """float64 autograd reference: out[n] = sum_k w[n,k] * w2[e] act(w13[e] x[n]) over local ids."""
    I = cfg.intermediate_size
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[n, k])
            if e < 0:
                continue
            h = w13[e] @ x[n]
            a = apply_activation(cfg, h[:I], h[I:] if cfg.is_gated else None)
            out[n] = out[n] + w[n, k] * (w2[e] @ a)
    return out


def run(case, seed):
    act, _, variant = case.partition(":")
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    cfg = MoEConfig(dtype=dtype, **SHAPE, **ACTS[act])
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    N = 13
    ids = torch.stack([torch.randperm(E + 2, generator=g)[:K] for _ in range(N)]).to(torch.int32)
    ids[ids >= E] = -1  # entries whose expert is on another rank
    if variant == "none_local":
        ids.fill_(-1)
    ids[3] = -1  # a token with no local entry: gradient 0
    x = torch.randn(N, H, generator=g)
    w = torch.rand(N, K, generator=g)
    w13 = torch.randn(E, cfg.w13_rows, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    gout = torch.randn(N, H, generator=g)
    launch = KernelLauncher(torch.device("cpu"))

    def grads(fn, dt, *extra):
        leaf = lambda t: t.detach().to(dt).clone().requires_grad_()  # noqa: E731
        xx, ww = leaf(x), w.clone().requires_grad_()
        p = {"w13": leaf(w13), "w2": leaf(w2)}
        out = fn(xx, ids, ww, p, cfg, E, *extra)
        if not out.requires_grad:  # no local entry: nothing computed, the gradients are zero
            out = out + 0 * sum(t.sum() for t in (xx, ww, *p.values()))
        (out.to(torch.float64 if dt == torch.float64 else torch.float32) * gout.to(out.dtype)).sum().backward()
        zero = lambda t, ref: torch.zeros_like(ref) if t is None else t  # noqa: E731
        return [out.detach(), zero(xx.grad, xx), zero(ww.grad, ww), zero(p["w13"].grad, p["w13"]),
                zero(p["w2"].grad, p["w2"])]

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0

    names = ["out", "grad_x", "grad_w", "grad_w13", "grad_w2"]
    fused = grads(fused_grouped_mm_train_forward, dtype, launch)
    again = grads(fused_grouped_mm_train_forward, dtype, launch)
    ref64 = grads(lambda xx, i, ww, p, c, e: dense_reference(c, xx, i, ww, p["w13"], p["w2"]), torch.float64)
    res = dict(vs_float64={n: rel(a, b) for n, a, b in zip(names, fused, ref64)},
               repeat_equal=all(torch.equal(a, b) for a, b in zip(fused, again)),
               token3_grad_zero=bool((fused[1][3] == 0).all()) and bool((fused[2][3] == 0).all()))
    if dtype == torch.float32:
        comp = grads(grouped_mm_train_forward, dtype)
        res["vs_composite"] = {n: rel(a, b) for n, a, b in zip(names, fused, comp)}
    return res


if __name__ == "__main__":
    report_cases(sys.argv[1:], run)
