"""Dispatch and combine as autograd Functions (training, docs/training.md).

    tokens, handle = differentiable_dispatch(dispatcher, hidden, topk_ids, topk_weights, agreement, watch)
    out            = differentiable_combine(dispatcher, expert_out, handle, watch)

Forward runs the dispatcher's own `dispatch` / `combine`: the same bytes and numbers as without
gradients. Backward calls `dispatcher.dispatch_backward` (a combine: the received rows' gradients go
back along the reverse route) and `dispatcher.combine_backward` (a dispatch), on the same group.

Lockstep: every rank of the group must run these backward passes, in the same order (autograd runs a
layer's nodes in reverse creation order, the same on every rank when every rank built the same layer
calls). What keeps a rank from skipping one:
  * dispatch takes an `anchor` that requires grad, so its node is part of the graph even on a rank whose
    inputs require no gradient (0 tokens, frozen inputs);
  * dispatch hands combine a 0-element `link` output: combine's backward always reaches dispatch's,
    also on a rank whose experts received no rows (their output then depends on nothing received);
  * each backward first agrees over the group that every rank's incoming gradient is well formed
    (shape, dtype, device; NaN/Inf pass through, as loss scalers expect): a bad gradient raises the same error on every rank instead of leaving
    the others in the all-to-all; a rank that never reaches the backward ends the others' wait at the
    layer's `timeout_s` with a fault report naming it.
Never imports `epmoe.experts`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from epmoe.core import dist as edist
from epmoe.dispatch.base import Agreement, DispatchedTokens, DispatchHandle, Dispatcher


class HandleBox:
    """Carries the handle out of the dispatch Function to the combine Function (autograd Functions
    return tensors only)."""

    handle: Optional[DispatchHandle] = None
    topk_ids: Optional[torch.Tensor] = None
    link: Optional[torch.Tensor] = None  # dispatch's 0-element output that combine takes (see above)


def _check_grad(what: str, grad: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype,
                device: torch.device) -> Optional[str]:
    """Why `grad` cannot be the gradient of a [shape] `dtype` tensor on `device` (None: it can)."""
    if grad is None:
        return None
    if tuple(grad.shape) != tuple(shape):
        return f"the gradient of {what} has shape {list(grad.shape)}; expected {list(shape)}"
    if grad.dtype != dtype:
        return f"the gradient of {what} has dtype {grad.dtype}; expected {dtype}"
    if grad.device.type != device.type:
        return f"the gradient of {what} is on {grad.device}; expected {device}"
    return None


def _agree_backward(dispatcher: Dispatcher, watch: Any, phase: str, problem: Optional[str]) -> None:
    """Every rank learns whether any rank's incoming gradient is bad; all raise the same error then."""
    spec = dispatcher.spec
    error = None if problem is None else ValueError(
        f"{phase}: {problem}; pass loss.backward() (or out.backward(grad)) a gradient of the layer output's "
        "shape and dtype on every rank")
    if not edist.is_distributed(spec.group):
        if error is not None:
            raise error
        return
    to = watch.collective_timeout if watch is not None else spec.timeout_s
    flags = edist.gather_ints([0 if error is None else 1], spec.group, to)
    failed = [r for r in range(flags.shape[0]) if flags[r, 0]]
    edist.raise_if_any_failed(error, failed, spec.group, to)


class _Phase:
    """watch.phase(name) when the layer passed its FaultWatch, else nothing."""

    def __init__(self, watch: Any, name: str):
        self.cm = watch.phase(name) if watch is not None else None

    def __enter__(self):
        if self.cm is not None:
            self.cm.__enter__()

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc) if self.cm is not None else False


def _fresh(out: torch.Tensor, inputs: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A Function must not hand an input back as its output: a view of it instead (no copy)."""
    return out.view_as(out) if any(out is t for t in inputs) else out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher, agreement, box, watch, name, topk_ids, hidden, topk_weights, anchor):
        tokens, handle = dispatcher.dispatch(hidden, topk_ids, topk_weights, agreement=agreement)
        if not isinstance(tokens.hidden, torch.Tensor):
            raise TypeError(f"dispatcher {dispatcher.name!r} delivered {type(tokens.hidden).__name__} tokens; "
                            "training needs unquantized tokens")
        box.handle, box.topk_ids = handle, tokens.topk_ids
        ctx.dispatcher, ctx.handle, ctx.watch, ctx.name = dispatcher, handle, watch, name
        ctx.in_meta = (hidden.dtype, topk_weights.dtype)
        ctx.out_meta = (tuple(tokens.hidden.shape), tokens.hidden.dtype, tuple(tokens.topk_weights.shape),
                        tokens.topk_weights.dtype, tokens.hidden.device)
        link = torch.zeros(0, device=tokens.hidden.device)
        return _fresh(tokens.hidden, (hidden,)), _fresh(tokens.topk_weights, (topk_weights,)), link

    @staticmethod
    def backward(ctx, grad_hidden, grad_weights, _grad_link):
        h_shape, h_dtype, w_shape, w_dtype, device = ctx.out_meta
        phase = f"{ctx.name} backward of dispatch"
        problem = (_check_grad("the dispatched tokens", grad_hidden, h_shape, h_dtype, device)
                   or _check_grad("the dispatched weights", grad_weights, w_shape, w_dtype, device))
        with _Phase(ctx.watch, phase):
            _agree_backward(ctx.dispatcher, ctx.watch, phase, problem)
            gx, gw = ctx.dispatcher.dispatch_backward(grad_hidden.contiguous(), grad_weights, ctx.handle)
        x_dtype, w_in_dtype = ctx.in_meta
        return None, None, None, None, None, None, gx.to(x_dtype), gw.to(w_in_dtype), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher, handle, watch, name, expert_output, link):
        out = dispatcher.combine(expert_output, handle)
        ctx.dispatcher, ctx.handle, ctx.watch, ctx.name = dispatcher, handle, watch, name
        ctx.in_dtype = expert_output.dtype
        ctx.out_meta = (tuple(out.shape), out.dtype, out.device)
        return _fresh(out, (expert_output,))

    @staticmethod
    def backward(ctx, grad_out):
        shape, dtype, device = ctx.out_meta
        phase = f"{ctx.name} backward of combine"
        problem = _check_grad("the layer output", grad_out, shape, dtype, device)
        with _Phase(ctx.watch, phase):
            _agree_backward(ctx.dispatcher, ctx.watch, phase, problem)
            g = ctx.dispatcher.combine_backward(grad_out.contiguous(), ctx.handle)
        return None, None, None, None, g.to(ctx.in_dtype), torch.zeros(0, device=g.device)


def differentiable_dispatch(dispatcher: Dispatcher, hidden: torch.Tensor, topk_ids: torch.Tensor,
                            topk_weights: torch.Tensor, agreement: Optional[Agreement] = None, watch: Any = None,
                            name: str = "EPMoE") -> "tuple[DispatchedTokens, DispatchHandle]":
    """`dispatcher.dispatch` with a backward (dispatcher.dispatch_backward). Gradients reach `hidden`
    and `topk_weights`; the received tokens' hidden and weights carry the graph. Collective, and its
    backward too: every rank of the group calls both."""
    box = HandleBox()
    anchor = torch.empty(0, device=hidden.device, requires_grad=True)  # keeps this node in every rank's graph
    recv_hidden, recv_weights, link = _Dispatch.apply(dispatcher, agreement, box, watch, name, topk_ids, hidden,
                                                      topk_weights, anchor)
    tokens = DispatchedTokens(hidden=recv_hidden, topk_ids=box.topk_ids, topk_weights=recv_weights)
    return tokens, _Linked(box.handle, link)


class _Linked:
    """What differentiable_dispatch returns as the handle: the dispatcher's handle and the link tensor."""

    def __init__(self, handle: DispatchHandle, link: torch.Tensor):
        self.handle, self.link = handle, link

    @property
    def bytes_sent(self) -> int:
        return self.handle.bytes_sent


def differentiable_combine(dispatcher: Dispatcher, expert_output: torch.Tensor, handle: "_Linked",
                           watch: Any = None, name: str = "EPMoE") -> torch.Tensor:
    """`dispatcher.combine` with a backward (dispatcher.combine_backward); `handle` is what
    differentiable_dispatch returned. Collective, backward too."""
    return _Combine.apply(dispatcher, handle.handle, watch, name, expert_output, handle.link)


__all__: List[str] = ["differentiable_combine", "differentiable_dispatch"]
