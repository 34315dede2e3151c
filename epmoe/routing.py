"""Top-k routing: router logits [T, E] -> `Routing` (topk_ids [T, K] int32, topk_weights [T, K] f32).

The math is in `epmoe.config`'s docstring. Computed in float32 whatever the logits' dtype, so every
rank and the reference agree on the chosen experts.

Two implementations of the same math:
  "torch"   torch ops (~7 launches on a GPU); any device.
  "triton"  one fused Triton kernel (`epmoe.routing_kernels`), on CUDA tensors (CPU only under the
            Triton interpreter), for E <= FUSED_MAX_EXPERTS. Same experts per token as the torch ops
            on a GPU (torch.topk there keeps the lowest expert ids among values tied at the k-th place,
            as the kernel does); ids come out by descending score (the weight; sigmoid_grouped: the
            weight + correction bias), ties by ascending expert id (the order torch gives tied
            values is unspecified); weights agree to ~1 ulp (the sums run in another order); a row
            of all-NaN logits routes to -1 (no expert) with weight 0.
"auto" (the default of `route` and of `Router`) takes "triton" for CUDA logits where it applies.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

from epmoe.config import MoEConfig
from epmoe.core.streams import capturing
from epmoe.experts.triton.align import single_launch_alignment, single_launch_applies, single_launch_layout
from epmoe.experts.triton.launch import LaunchOptions

ROUTING_IMPLS = ("auto", "torch", "triton")
FUSED_MAX_EXPERTS = 1024  # one program holds whole rows of E logits in registers


# The one-program routing + alignment launch (`route_aligned`) routes the rows one after another: its
# GPU time grows with T x experts. H200 (2026-12-01, `benchmarks/bench_route_align.py`): 10.6 us
# against 12.3 us for the two launches at 16 x 128 logits, 30 / 59 us against 14 / 17 us at 64 / 128
# x 128. Eager calls take it at every size it applies to (it saves a launch of host time, which is
# longer than its GPU time there); under CUDA-graph capture, where only GPU time counts, it is taken up
# to this many logits.
ROUTE_ALIGN_GPU_MAX_LOGITS = 2048


@dataclass(frozen=True)
class Routing:
    """topk_ids [T, K] int32 global expert ids (-1: none); topk_weights [T, K] float32."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def route(
    config: MoEConfig,
    router_logits: torch.Tensor,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    *,
    impl: str = "auto",
) -> Routing:
    """Choose top-k experts per token. router_logits: [T, E], any float dtype. impl: "auto", "torch"
    or "triton" (module docstring)."""
    if impl != "torch":
        if impl not in ROUTING_IMPLS:
            raise ValueError(f"impl={impl!r}; use one of {ROUTING_IMPLS}")
        if impl == "triton" or fused_routing_available(config, router_logits.device) is None:
            return _device_router(config, router_logits.device)(router_logits, e_score_correction_bias)
    return route_torch(config, router_logits, e_score_correction_bias)


def route_torch(
    config: MoEConfig,
    router_logits: torch.Tensor,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> Routing:
    """`route` with torch ops (any device)."""
    logits = router_logits.float()
    K = config.top_k
    if config.routing == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, K, dim=-1)
        if config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:  # sigmoid_grouped (DeepSeek-V3 noaux_tc)
        scores = torch.sigmoid(logits)
        choice = scores
        if e_score_correction_bias is not None:
            choice = scores + e_score_correction_bias.float().to(scores.device)
        T, E = choice.shape
        n_group, topk_group = config.n_group, config.topk_group
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        masked = torch.where(group_mask.unsqueeze(-1), grouped, float("-inf")).view(T, E)
        ids = masked.topk(K, dim=-1).indices
        weights = scores.gather(1, ids)
        if config.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * config.routed_scaling_factor
    return Routing(topk_ids=ids.to(torch.int32), topk_weights=weights.to(torch.float32))


def routing_weights(config: MoEConfig, router_logits: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The top-k weights of the experts `topk_ids` [T, K] (chosen by `route`) as a differentiable function
    of `router_logits` [T, E] (training: the choice itself has no gradient, as in every MoE). The same
    ops as `route_torch` after its top-k, so float32 logits give its weights bit for bit; computed in
    float32, float64 for float64 logits. Slots of id -1 get weight 0."""
    dt = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    logits = router_logits.to(dt)
    ids = topk_ids.long()
    valid = ids >= 0
    safe = ids.clamp(min=0)
    if config.routing == "softmax":
        weights = torch.softmax(logits, dim=-1).gather(1, safe)
        weights = torch.where(valid, weights, torch.zeros((), dtype=dt, device=weights.device))
        if config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights
    weights = torch.sigmoid(logits).gather(1, safe)
    weights = torch.where(valid, weights, torch.zeros((), dtype=dt, device=weights.device))
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_routing_available(config: MoEConfig, device) -> Optional[str]:
    """None if the fused Triton routing runs for `config` on `device`, else why not."""
    if config.num_experts > FUSED_MAX_EXPERTS:
        return f"num_experts {config.num_experts} > {FUSED_MAX_EXPERTS} (one program holds a row)"
    device = torch.device(device)
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        return f"device {device} (the kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1)"
    if not _triton_installed():
        return "triton is not installed"
    return None


_TRITON: list = []


def _triton_installed() -> bool:
    if not _TRITON:  # looked up once: find_spec walks sys.path
        _TRITON.append(importlib.util.find_spec("triton") is not None)
    return _TRITON[0]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Router:
    """The routing of one layer on one device: `route` with the implementation chosen once (impl
    "auto": "triton" where `fused_routing_available`, else "torch") and, for the fused kernel, its
    launch constants computed once. `router(logits, bias)` -> Routing."""

    def __init__(self, config: MoEConfig, device, impl: str = "auto"):
        if impl not in ROUTING_IMPLS:
            raise ValueError(f"routing impl={impl!r}; use one of {ROUTING_IMPLS}")
        self.config = config
        self.device = torch.device(device)
        if impl == "auto":
            impl = "triton" if fused_routing_available(config, self.device) is None else "torch"
        elif impl == "triton":
            why = fused_routing_available(config, self.device)
            if why is not None:
                raise ValueError(f"the fused Triton routing cannot run here: {why}; use impl='torch' or 'auto'")
        self.impl = impl
        E, K = config.num_experts, config.top_k
        e_pad = _next_pow2(E)
        self._block_t = max(1, min(16, 2048 // e_pad))  # rows per program: ~2K logits in registers
        self._kwargs = dict(K=K, K_PAD=_next_pow2(K), E_PAD=e_pad, BLOCK_T=self._block_t,
                            RENORM=bool(config.renormalize), num_warps=4 if e_pad <= 256 else 8)
        if config.routing == "softmax":
            self._kernel = "route_softmax_kernel"
        else:
            self._kernel = "route_sigmoid_grouped_kernel"
            self._kwargs.update(N_GROUP=config.n_group, G_PAD=_next_pow2(config.n_group),
                                TOPK_GROUP=config.topk_group, GROUP_SIZE=E // config.n_group)
        # libdevice's expf, as torch's kernels; the interpreter has no libdevice
        self._kwargs["PRECISE"] = not _interpreting()
        self._kwargs_bias = {False: LaunchOptions(self._kwargs, HAS_BIAS=False),
                             True: LaunchOptions(self._kwargs, HAS_BIAS=True)}
        self._kwargs = LaunchOptions(self._kwargs)
        self._scale = float(config.routed_scaling_factor)
        self._launcher = None
        self._fused_align_kwargs: dict = {}  # route_aligned's launch keywords by (T, block_m, bias)

    def __call__(self, router_logits: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor] = None) -> Routing:
        if self.impl == "torch" or router_logits.device.type != self.device.type:  # (logits elsewhere: torch)
            return route_torch(self.config, router_logits, e_score_correction_bias)
        return self._fused(router_logits, e_score_correction_bias)

    def _fused(self, logits: torch.Tensor, bias: Optional[torch.Tensor]) -> Routing:
        T, E = logits.shape
        if E != self.config.num_experts:
            raise ValueError(f"router_logits has {E} experts; the config has {self.config.num_experts}")
        dev = logits.device
        K = self.config.top_k
        ids = torch.empty(T, K, dtype=torch.int32, device=dev)
        w = torch.empty(T, K, dtype=torch.float32, device=dev)
        if T == 0:
            return Routing(topk_ids=ids, topk_weights=w)
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        grid = (-(-T // self._block_t),)
        if self._kernel == "route_softmax_kernel":
            self._launch(self._kernel, grid, (logits, ids, w, T, E, logits.stride(0)), self._kwargs)
        else:
            if bias is not None and (bias.dtype != torch.float32 or bias.device != dev):
                bias = bias.to(device=dev, dtype=torch.float32)
            self._launch(self._kernel, grid, (logits, logits if bias is None else bias, ids, w, T, E,
                                              logits.stride(0), self._scale), self._kwargs_bias[bias is not None])
        return Routing(topk_ids=ids, topk_weights=w)

    def route_aligned(self, router_logits: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor],
                      num_experts: int, block_m: int):
        """(Routing, BlockAlignment or None): `self(router_logits, bias)` and, in the SAME launch
        (`route_align_kernel`, one program), `align_blocks_triton(topk_ids, num_experts, block_m)` of the
        ids it chose, read as local expert ids (one rank holding every expert: num_experts is the
        config's). Where that launch does not apply (torch routing, logits on another device, no
        tokens, more entries than the one-program alignment takes) the routing alone, alignment None.
        The same outputs as the two launches, bit for bit. ids, weights and the alignment are views of
        one allocation."""
        T = router_logits.shape[0]
        K = self.config.top_k
        if (self.impl == "torch" or router_logits.device.type != self.device.type or num_experts != self.config.num_experts
                or router_logits.shape[1] != num_experts or not single_launch_applies(T * K, num_experts)
                or (T * num_experts > ROUTE_ALIGN_GPU_MAX_LOGITS and capturing(router_logits.device))):  # fmt: skip
            return self(router_logits, e_score_correction_bias), None
        logits, bias = router_logits, e_score_correction_bias
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        sigmoid = self._kernel != "route_softmax_kernel"
        with_bias = sigmoid and bias is not None
        if with_bias and (bias.dtype != torch.float32 or bias.device != logits.device):
            bias = bias.to(device=logits.device, dtype=torch.float32)
        key = (T, block_m, with_bias)
        kw = self._fused_align_kwargs.get(key)
        if kw is None:
            _, _, _, consts = single_launch_layout(T * K, num_experts, block_m, (T * K, T * K))
            if len(self._fused_align_kwargs) >= 1024:
                self._fused_align_kwargs.clear()
            # softmax: the grouping constants unused, passed all the same; num_warps: the routing's (4 up
            # to 256 experts; 8 for 1024 entries would spill, sm90 compile)
            kw = dict(N_GROUP=1, G_PAD=1, TOPK_GROUP=1, GROUP_SIZE=1, HAS_BIAS=False)
            kw.update(self._kwargs_bias[with_bias] if sigmoid else self._kwargs)
            kw.update(SIGMOID=sigmoid, BLOCK_M=block_m, A_E_PAD=consts["E_PAD"], N_PAD=consts["N_PAD"],
                      LOG_N=consts["LOG_N"], RB=consts["RB"], TB=consts["TB"])
            kw = self._fused_align_kwargs[key] = LaunchOptions(kw)
        blocks, scratch, _, (ids, w) = single_launch_alignment(T * K, num_experts, block_m, logits.device,
                                                                extra=(T * K, T * K))
        ids = ids.view(T, K)
        w = w.view(torch.float32).view(T, K)
        self._launch("route_align_kernel", (1,), (
            logits, bias if with_bias else logits, ids, w, T, num_experts, logits.stride(0), self._scale,
            blocks.sorted_ids, blocks.block_expert, blocks.block_rows, scratch, blocks.max_blocks), kw)  # fmt: skip
        return Routing(topk_ids=ids, topk_weights=w), blocks

    def _launch(self, kernel_name: str, grid: tuple, args: tuple, kwargs: dict) -> None:
        """Every kernel launch goes through here (tools replace it to record the launches)."""
        if self._launcher is None:
            from epmoe.experts.triton.launch import KernelLauncher

            self._launcher = KernelLauncher(self.device, kernels=_kernel_module)
        self._launcher(kernel_name, grid, args, kwargs)


def _kernel_module():
    from epmoe import routing_kernels

    return routing_kernels


_ROUTERS: dict = {}


def _device_router(config: MoEConfig, device: torch.device) -> Router:
    """`route`'s fused path: one Router per (config, device), made on first use."""
    key = (config, device)
    r = _ROUTERS.get(key)
    if r is None:
        r = _ROUTERS[key] = Router(config, device, "triton")
    return r
