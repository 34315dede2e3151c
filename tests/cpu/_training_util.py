"""Test helpers for training across gloo ranks: a global function every rank evaluates in lockstep.

`torch.autograd.gradcheck` perturbs every input element and runs the function once per perturbation; a
layer call is collective, so every rank must make the same calls. `global_layer_fn` makes the layer one
function of the GLOBAL inputs (every rank's tokens and logits, all experts' weights), the same on every
rank: each rank runs the layer on its slice, the outputs are gathered (`_Gather`: backward takes this
rank's rows) and the inputs' gradients summed over the ranks (`_SumGrads`: forward identity), so each
rank's analytical gradient is the global one that its numerical check perturbs.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, counts, y):
        ctx.rank = dist.get_rank()
        ctx.counts = counts
        m = max(max(counts), 1)
        pad = torch.zeros(m, *y.shape[1:], dtype=y.dtype)
        pad[: y.shape[0]] = y
        parts = [torch.empty_like(pad) for _ in counts]
        dist.all_gather(parts, pad)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, g):
        lo = sum(ctx.counts[: ctx.rank])
        return None, g[lo : lo + ctx.counts[ctx.rank]]


class _SumGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        out = []
        for g in gs:
            g = g.contiguous().clone()
            dist.all_reduce(g)
            out.append(g)
        return tuple(out)


def gather_rows(counts: Sequence[int], y: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(list(counts), y)


def sum_grads(*xs: torch.Tensor) -> List[torch.Tensor]:
    return list(_SumGrads.apply(*xs))


def param_names(cfg) -> List[str]:
    return ["w13", "w2"] + (["b13", "b2"] if cfg.has_bias else [])


def global_params(cfg, w) -> List[torch.Tensor]:
    """The global expert tensors in the layer's parameter layout (w13 = [w1; w3])."""
    w13 = torch.cat([w.w1, w.w3], dim=1) if w.w3 is not None else w.w1
    out = [w13, w.w2]
    if cfg.has_bias:
        out += [w.b13, w.b2]
    return [t.detach().clone().to(cfg.dtype) for t in out]


def global_layer_fn(layer, counts: Sequence[int], rank: int):
    """f(X_all, L_all, *global params) -> Y_all, the same on every rank (see the module docstring)."""
    lo = sum(counts[:rank])
    T = counts[rank]
    names = param_names(layer.config)
    e0, e1 = layer.first_local_expert, layer.first_local_expert + layer.num_local_experts

    def f(X, L, *P):
        X, L, *P = sum_grads(X, L, *P)
        params = {n: p[e0:e1] for n, p in zip(names, P)}
        x, l_ = X[lo : lo + T], L[lo : lo + T]
        y = torch.func.functional_call(layer, params, (x, l_))
        return gather_rows(counts, y)

    return f
