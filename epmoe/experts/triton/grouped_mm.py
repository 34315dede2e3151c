"""`GroupedMMExperts` ("grouped_mm"): the experts stage from PyTorch's grouped GEMM
(`torch._grouped_mm`, CUTLASS on sm90 / sm100, no host sync) plus one fused Triton pass per
memory-bound step. BF16 only.

    sort  = sort_by_expert(topk_ids)          entries by expert (offsets = cumulative counts, int32)
    xs    = gather_rows(x, inv)               [N*K, H] bf16 rows in expert order (token-major: x read once)
    h     = grouped_mm(xs, w13^T, offs)       [N*K, R] bf16
    a     = act(h + b13)                      [N*K, I] fp32 math, bf16 out (one pass)
    y     = grouped_mm(a, w2^T, offs)         [N*K, H] bf16
    out   = combine(y, w, b2)                 out[n] = sum_k w[n,k] * (y[inv[n*K+k]] + b2[e]) over
                                              valid k, in k order, fp32 -> bf16 (one pass, no atomics)

Bytes at the DeepSeek-V3 prefill shape (T = 4096, 32768 routed rows, H 7168, I 2048): gather 0.53 GB,
activation 0.40 GB, combine 0.53 GB (~0.35 ms at 4.3 TB/s) where the torch composite that preceded
it (kept as `grouped_mm_epilogue=torch`) made ~12 fp32 passes (~5 ms). `fused_grouped_mm_forward`
is also the bf16 prefill path of the `triton` backend (its own weights, gate/up interleaved).

Training (docs/training.md): `train_forward` runs `grouped_mm_train_forward`, the same stage in torch ops
under autograd (torch._grouped_mm has a backward: grouped GEMMs for the input and the weight
gradients). It sorts the routed entries by expert and keeps exactly the valid ones (one host sync for
their count), so no garbage row past offs[-1] reaches a gradient. Saved for backward: the sorted input
rows [n, H], the FC1 output [n, R] (fp32), the activation [n, I] and the FC2 output [n, H] (bf16; fp32
with biases), with n = routed (token, local expert) pairs; `TrainingConfig(recompute_experts=True)` saves only the
received tokens and recomputes these in backward.

`torch._grouped_mm(mat_a [M, K] bf16, mat_b [G, K, N] bf16 (column-major view), offs [G] int32
cumulative row ends)`: rows past offs[-1] are left unwritten (garbage); no later pass reads them.
Strides must be 16-byte aligned (H and I multiples of 8). FP8: PyTorch's `_scaled_grouped_mm` has
only row-wise (and MX) scaling on sm90, not DeepSeek's 128x128 blocks, so fp8_block runs on the
`triton` backend instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.core.errors import BackendUnavailableError
from epmoe.experts.activation import apply_activation, kernel_activation_args
from epmoe.experts.base import Experts, ExpertsOptions, ExpertsSpec
from epmoe.experts.triton.align import sort_by_expert, sort_by_expert_triton
from epmoe.quant.payload import QuantizedActivation
from epmoe.quant.weights import ExpertWeights


EPILOGUES = ("triton", "torch")


def fused_grouped_mm_forward(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    params: Dict[str, torch.Tensor],
    config,
    num_experts: int,
    gate_up_interleaved: bool,
    launch: Callable,
    align: str = "triton",
    act_args: Optional[tuple] = None,
) -> torch.Tensor:
    """bf16 experts forward: torch._grouped_mm GEMMs + the fused Triton gather / activation / combine
    (`epmoe.experts.triton.triton_kernels`). params: w13 [E, R, H] (rows gate-then-up, or gate j / up j
    interleaved), w2 [E, H, I], optional fp32 biases b13 [>=E, R] (gate then up), b2 [>=E, H], optional
    w13_t / w2_t (w13 / w2 .transpose(1, 2), made once by the caller). act_args: the kernels'
    activation arguments (`epmoe.experts.activation.kernel_activation_args(config)`, computed once by the caller).
    `launch(kernel_name, grid, args, kwargs)` runs one kernel. No host sync, fixed shapes."""
    state: Dict[str, torch.Tensor] = {}
    for _, step in grouped_mm_steps(hidden, topk_ids, topk_weights, params, config, num_experts,
                                    gate_up_interleaved, launch, state, align=align, act_args=act_args):  # fmt: skip
        step()
    return state["out"]


def grouped_mm_steps(hidden, topk_ids, topk_weights, params, config, num_experts, gate_up_interleaved, launch,
                     state: Dict[str, torch.Tensor], keep: bool = False, align: str = "triton",
                     act_args: Optional[tuple] = None) -> List[Tuple[str, Callable[[], None]]]:  # fmt: skip
    """The forward as named steps run in order (each reads and writes `state`); benchmarks time them
    one by one (keep=True: inputs stay in `state`; else each step drops what no later step reads, so
    at most two of the [N*K, .] intermediates are alive): align (one sort launch, or torch ops), gather,
    gemm1, act, gemm2, combine."""
    take = state.get if keep else state.pop
    if act_args is None:
        act_args = kernel_activation_args(config)

    N, H = hidden.shape
    K = topk_ids.shape[1]
    I, E = config.intermediate_size, num_experts
    R = params["w13"].shape[1]
    dev, dt = hidden.device, hidden.dtype
    ACT, HAS_LIMIT, alpha, beta, limit = act_args
    gated = config.is_gated and R == 2 * I
    BLOCK_I = min(1024, triton_next_pow2(I))
    BLOCK_H = 1024

    def align_step():
        ids32 = (topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)).contiguous()
        sort = sort_by_expert_triton(ids32, E, launch) if align == "triton" else sort_by_expert(ids32, E)
        inv = sort.inverse
        if inv is None:
            inv = torch.empty(N * K, dtype=torch.int32, device=dev)
            inv[sort.order] = torch.arange(N * K, dtype=torch.int32, device=dev)
        ends = sort.expert_ends
        state.update(ids32=ids32, inv=inv, sorted_expert=sort.sorted_expert,
                     offs=ends if ends.dtype == torch.int32 else ends.to(torch.int32))  # fmt: skip

    def gather():
        x = hidden.contiguous()
        xs = torch.empty(N * K, H, dtype=dt, device=dev)
        launch("gather_rows_kernel", (N,), (x, state["ids32"], state["inv"], xs, H, E, x.stride(0), xs.stride(0)),
               dict(TOP_K=K, BLOCK_H=2 * BLOCK_H, num_warps=4))  # fmt: skip
        state["xs"] = xs

    def check_rows(t):  # the epilogue kernels read rows with unit column stride
        if t.stride(-1) != 1:
            raise RuntimeError(f"torch._grouped_mm returned strides {t.stride()}; expected contiguous rows")
        return t

    w13_t = params.get("w13_t")
    w2_t = params.get("w2_t")

    def gemm1():
        w = w13_t if w13_t is not None else params["w13"].transpose(1, 2)
        state["h"] = check_rows(torch._grouped_mm(take("xs"), w, offs=state["offs"]))

    def act():
        h = take("h")
        a = torch.empty(N * K, I, dtype=dt, device=dev)
        b13 = params.get("b13", h)
        launch("grouped_act_kernel", (N * K, -(-I // BLOCK_I)), (
            h, b13, a, state["sorted_expert"], E, I, h.stride(0), b13.stride(0), a.stride(0), alpha, beta, limit,
        ), dict(ACT=ACT, HAS_LIMIT=HAS_LIMIT, HAS_BIAS="b13" in params, GATED=gated,
                GATE_UP_IL=gate_up_interleaved, BLOCK_I=BLOCK_I, num_warps=4))  # fmt: skip
        state["a"] = a

    def gemm2():
        w = w2_t if w2_t is not None else params["w2"].transpose(1, 2)
        state["y"] = check_rows(torch._grouped_mm(take("a"), w, offs=state["offs"]))

    def combine():
        y = take("y")
        out = torch.empty(N, H, dtype=dt, device=dev)
        w = topk_weights.to(torch.float32).contiguous()
        b2 = params.get("b2", w)
        launch("grouped_combine_kernel", (N, -(-H // BLOCK_H)), (
            y, state["inv"], state["ids32"], w, b2, out, H, E, y.stride(0), b2.stride(0), out.stride(0),
        ), dict(TOP_K=K, HAS_BIAS="b2" in params, BLOCK_H=BLOCK_H, num_warps=4))  # fmt: skip
        state["out"] = out

    return [("align", align_step), ("gather", gather), ("gemm1", gemm1), ("act", act), ("gemm2", gemm2),
            ("combine", combine)]  # fmt: skip


def _triton_can_run(device: torch.device) -> bool:
    import importlib.util

    from epmoe.experts.triton.launch import interpreter_enabled

    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or interpreter_enabled()


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def torch_grouped_mm_forward(hidden, topk_ids, topk_weights, params, config, num_experts) -> torch.Tensor:
    """The plain-torch composite around torch._grouped_mm (w13 gate-then-up, biases padded with a zero
    row E): ~12 fp32 passes over [N*K, R] / [N*K, H]. Kept selectable (`grouped_mm_epilogue=torch`)
    and as the path on machines without Triton."""
    cfg, p = config, params
    I, E = cfg.intermediate_size, num_experts
    N, K = topk_ids.shape
    sort = sort_by_expert(topk_ids, E)
    offs = sort.expert_ends.to(torch.int32)
    valid = sort.sorted_expert < E  # [N*K]; invalid entries sort last, past offs[-1]
    xs = hidden.index_select(0, sort.order // K)
    h = torch._grouped_mm(xs, p["w13"].transpose(1, 2), offs=offs)
    hf = h.float()
    if cfg.has_bias:
        hf = hf + p["b13"].index_select(0, sort.sorted_expert)
    a = apply_activation(cfg, hf[:, :I], hf[:, I:] if cfg.is_gated else None).to(torch.bfloat16)
    y = torch._grouped_mm(a, p["w2"].transpose(1, 2), offs=offs).float()
    if cfg.has_bias:
        y = y + p["b2"].index_select(0, sort.sorted_expert)
    w = topk_weights.reshape(-1).to(torch.float32).index_select(0, sort.order)
    # Rows past offs[-1] were never written (may hold NaN): select, do not multiply by zero.
    y = torch.where(valid[:, None], y * w[:, None], torch.zeros((), device=y.device)).to(torch.bfloat16)
    inverse = torch.empty_like(sort.order)
    inverse[sort.order] = torch.arange(sort.order.numel(), device=sort.order.device)
    y_by_entry = y.index_select(0, inverse).view(N, K, -1)
    return y_by_entry.sum(dim=1, dtype=torch.float32).to(torch.bfloat16)


def _routed_order(topk_ids: torch.Tensor, num_experts: int):
    """The training stages' sort of the [N, K] entries by local expert (stable; entries of no local
    expert last): (key [N*K] int64 = expert or num_experts, order [N*K], offs [E] int32 cumulative
    counts, n routed entries; one host sync for n)."""
    flat = topk_ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    return key, order, counts.cumsum(0).to(torch.int32), int(counts.sum())


def grouped_mm_train_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                             params: Dict[str, torch.Tensor], config, num_experts: int) -> torch.Tensor:
    """The experts stage under autograd: hidden [N, H], topk_ids [N, K] local ids (-1: elsewhere),
    topk_weights [N, K], params w13 [E, R, H] (gate then up), w2 [E, H, I], optional fp32 biases b13
    [>=E, R], b2 [>=E, H] -> [N, H] in hidden's dtype. Differentiable in hidden, topk_weights and params.
    Runs wherever torch._grouped_mm runs (bf16 on sm90 / sm100; float32 on CPU too). One host sync."""
    cfg, E = config, num_experts
    N, K = topk_ids.shape
    H, I = hidden.shape[1], cfg.intermediate_size
    key, order, offs, n = _routed_order(topk_ids, E)
    if n == 0:  # no routed entry here: nothing to compute (the layer gives the parameters zero gradients)
        return torch.zeros(N, H, dtype=hidden.dtype, device=hidden.device)
    order = order[:n]
    token = order // K
    expert = key.index_select(0, order)
    xs = hidden.index_select(0, token)
    h = torch._grouped_mm(xs, params["w13"].transpose(1, 2), offs=offs).float()
    if "b13" in params:
        h = h + params["b13"][:E].float().index_select(0, expert)
    a = apply_activation(cfg, h[:, :I], h[:, I:] if cfg.is_gated else None).to(hidden.dtype)
    y = torch._grouped_mm(a, params["w2"].transpose(1, 2), offs=offs)
    if "b2" in params:
        y = y.float() + params["b2"][:E].float().index_select(0, expert)
    # bf16 rows times fp32 weights: the product is fp32 (type promotion, no separate fp32 copy of y)
    y = y * topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(1)
    out = torch.zeros(N, H, dtype=torch.float32, device=hidden.device).index_add(0, token, y)
    return out.to(hidden.dtype)


class _TrainGather(torch.autograd.Function):
    """xs[inv[j]] = hidden[n] for each valid entry j = n*K + k (gather_rows_kernel); backward: each
    token's gradient is the fp32 sum of its entries' row gradients, rounded once (the combine kernel
    with unit weights; no atomics)."""

    @staticmethod
    def forward(ctx, hidden, ids32, inv, rows, num_experts, launch):
        N, H = hidden.shape
        K = ids32.shape[1]
        x = hidden.contiguous()
        xs = torch.empty(rows, H, dtype=hidden.dtype, device=hidden.device)
        launch("gather_rows_kernel", (N,), (x, ids32, inv, xs, H, num_experts, x.stride(0), xs.stride(0)),
               dict(TOP_K=K, BLOCK_H=2048, num_warps=4))
        ctx.save_for_backward(ids32, inv)
        ctx.meta = (N, H, K, num_experts, launch, hidden.dtype)
        return xs

    @staticmethod
    def backward(ctx, gxs):
        ids32, inv = ctx.saved_tensors
        N, H, K, E, launch, dt = ctx.meta
        gxs = gxs.contiguous()
        ones = torch.ones(N, K, dtype=torch.float32, device=gxs.device)
        gx = torch.empty(N, H, dtype=dt, device=gxs.device)
        launch("grouped_combine_kernel", (N, -(-H // 1024)),
               (gxs, inv, ids32, ones, ones, gx, H, E, gxs.stride(0), 0, gx.stride(0)),
               dict(TOP_K=K, HAS_BIAS=False, BLOCK_H=1024, num_warps=4))
        return gx, None, None, None, None, None


class _TrainAct(torch.autograd.Function):
    """The activation of gemm1's output in fp32, rounded once (grouped_act_kernel); backward: its
    derivative in fp32 from the saved bf16 h (grouped_act_bwd_kernel). Saves h only."""

    @staticmethod
    def forward(ctx, h, expert, I, num_experts, gated, act_args, launch):
        ACT, HAS_LIMIT, alpha, beta, limit = act_args
        n = h.shape[0]
        BLOCK_I = min(1024, triton_next_pow2(I))
        a = torch.empty(n, I, dtype=h.dtype, device=h.device)
        launch("grouped_act_kernel", (n, -(-I // BLOCK_I)), (
            h, h, a, expert, num_experts, I, h.stride(0), 0, a.stride(0), alpha, beta, limit,
        ), dict(ACT=ACT, HAS_LIMIT=HAS_LIMIT, HAS_BIAS=False, GATED=gated, GATE_UP_IL=False, BLOCK_I=BLOCK_I,
                num_warps=4))  # fmt: skip
        ctx.save_for_backward(h)
        ctx.meta = (I, gated, act_args, launch, BLOCK_I)
        return a

    @staticmethod
    def backward(ctx, ga):
        (h,) = ctx.saved_tensors
        I, gated, (ACT, HAS_LIMIT, alpha, beta, limit), launch, BLOCK_I = ctx.meta
        ga = ga.contiguous()
        gh = torch.empty_like(h)
        launch("grouped_act_bwd_kernel", (h.shape[0], -(-I // BLOCK_I)), (
            h, ga, gh, I, h.stride(0), ga.stride(0), gh.stride(0), alpha, beta, limit,
        ), dict(ACT=ACT, HAS_LIMIT=HAS_LIMIT, GATED=gated, BLOCK_I=BLOCK_I, num_warps=4))  # fmt: skip
        return gh, None, None, None, None, None, None


class _TrainCombine(torch.autograd.Function):
    """out[n] = sum_k w[n,k] * y[inv[n*K+k]] in fp32, rounded once (grouped_combine_kernel); backward
    (combine_bwd_kernel): y's rows get w * grad_out (rounded once), the weights <y, grad_out> in fp32.
    Saves y (bf16) and the weights."""

    @staticmethod
    def forward(ctx, y, topk_weights, ids32, inv, num_experts, out_dtype, launch):
        N, K = ids32.shape
        H = y.shape[1]
        w = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(N, H, dtype=out_dtype, device=y.device)
        launch("grouped_combine_kernel", (N, -(-H // 1024)),
               (y, inv, ids32, w, w, out, H, num_experts, y.stride(0), 0, out.stride(0)),
               dict(TOP_K=K, HAS_BIAS=False, BLOCK_H=1024, num_warps=4))
        ctx.save_for_backward(y, w, ids32, inv)
        ctx.meta = (num_experts, launch, topk_weights.dtype)
        return out

    @staticmethod
    def backward(ctx, gout):
        y, w, ids32, inv = ctx.saved_tensors
        E, launch, w_dtype = ctx.meta
        N, K = ids32.shape
        H = y.shape[1]
        gout = gout.contiguous()
        gy = torch.empty_like(y)
        gw = torch.empty(N, K, dtype=torch.float32, device=y.device)
        launch("combine_bwd_kernel", (N * K,), (gout, y, inv, ids32, w, gy, gw, H, E, gout.stride(0), y.stride(0),
                                              gy.stride(0)), dict(TOP_K=K, BLOCK_H=1024, num_warps=4))
        return gy, gw.to(w_dtype), None, None, None, None, None


def fused_grouped_mm_train_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                                   params: Dict[str, torch.Tensor], config, num_experts: int, launch: Callable,
                                   act_args: Optional[tuple] = None) -> torch.Tensor:
    """`grouped_mm_train_forward` with its memory-bound steps as Triton kernels with their own backward
    (gather, activation, weighted combine: fp32 arithmetic, one rounding per output, no atomics, each
    [rows, .] tensor read and written once per pass); the two torch._grouped_mm keep torch's autograd.
    No biases (`grouped_mm_train_forward` takes those). Saves xs, h, a, y (bf16), as the GEMMs and the
    activation need them. One host sync (the routed row count)."""
    if "b13" in params or "b2" in params:
        raise ValueError("fused_grouped_mm_train_forward takes no biases; use grouped_mm_train_forward")
    cfg, E = config, num_experts
    N, K = topk_ids.shape
    H, I = hidden.shape[1], cfg.intermediate_size
    ids32 = (topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)).contiguous()
    key, order, offs, n = _routed_order(ids32, E)
    if n == 0:
        return torch.zeros(N, H, dtype=hidden.dtype, device=hidden.device)
    inv = torch.empty(N * K, dtype=torch.int32, device=hidden.device)
    inv[order] = torch.arange(N * K, dtype=torch.int32, device=hidden.device)  # invalid entries: >= n, never read
    expert = key.index_select(0, order[:n])
    R = params["w13"].shape[1]
    xs = _TrainGather.apply(hidden, ids32, inv, n, E, launch)
    h = torch._grouped_mm(xs, params["w13"].transpose(1, 2), offs=offs)
    a = _TrainAct.apply(h, expert, I, E, cfg.is_gated and R == 2 * I,
                        act_args if act_args is not None else kernel_activation_args(cfg), launch)
    y = torch._grouped_mm(a, params["w2"].transpose(1, 2), offs=offs)
    return _TrainCombine.apply(y, topk_weights, ids32, inv, E, hidden.dtype, launch)


@dataclass(frozen=True)
class GroupedMMOptions(ExpertsOptions):
    """grouped_mm_epilogue: "triton" (fused gather / activation / combine; default where Triton runs)
    or "torch" (the plain torch composite); triton_align: "triton" (alignment kernels) or "torch"."""

    grouped_mm_epilogue: Optional[str] = None
    triton_align: Optional[str] = None


class GroupedMMExperts(Experts):
    """bf16 experts on torch._grouped_mm (its CUTLASS path: sm90 / sm100), flat layout."""

    name = "grouped_mm"
    accepted_layouts = ("flat",)
    Options = GroupedMMOptions
    fc1_output_rounded = True  # the grouped GEMM writes FC1's output in bf16

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        if not base:
            return base
        if request.expert_mode != "bf16":
            return Availability.no(f"it runs bf16 only, not {request.expert_mode!r}", "use experts 'triton'")
        if request.arch not in ("sm90", "sm100"):
            return Availability.no(f"torch._grouped_mm has its CUTLASS path on sm90/sm100 only, not {request.arch}")
        if request.model_dtype != "bfloat16":
            return Availability.no(f"it needs a bfloat16 model, not {request.model_dtype}")
        if request.hidden_size % 8 or request.intermediate_size % 8:
            return Availability.no("it needs hidden and intermediate sizes divisible by 8")
        if not hasattr(torch, "_grouped_mm"):
            return Availability.no(f"torch {torch.__version__} has no torch._grouped_mm", "install torch >= 2.8")
        return Availability.yes()

    @classmethod
    def supports_training(cls, request: BackendRequest) -> Availability:
        if request.expert_mode != "bf16":
            return Availability.no(f"{request.expert_mode} experts are inference-only (quantized weights have no "
                                   "gradient)", "train with an unquantized checkpoint (quant=None)")
        return Availability.yes("torch._grouped_mm under autograd (grouped GEMMs in backward)")

    def train_forward(self, tokens, params: Dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = tokens.hidden
        if isinstance(hidden, QuantizedActivation):
            raise TypeError("experts 'grouped_mm' trains on bf16 tokens; quantized wires are inference-only")
        if hidden.shape[0] == 0:
            return torch.zeros(0, self.config.hidden_size, dtype=hidden.dtype, device=hidden.device)
        if self.epilogue == "triton" and "b13" not in params and "b2" not in params:
            return fused_grouped_mm_train_forward(hidden, tokens.topk_ids, tokens.topk_weights, params, self.config,
                                                  self.num_experts, self._launch)
        return grouped_mm_train_forward(hidden, tokens.topk_ids, tokens.topk_weights, params, self.config,
                                        self.num_experts)

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        mode = spec.expert_mode
        if mode != "bf16":
            return Availability.no(
                f"expert mode {mode!r} is not supported by grouped_mm (bf16 only)",
                "use experts backend 'triton' for fp8_block / nvfp4_w4a16 / mxfp4_w4a16",
            )
        cfg = spec.config
        if cfg.dtype != torch.bfloat16:
            return Availability.no(f"grouped_mm needs bfloat16, the model dtype is {cfg.dtype}", "use dtype bf16")
        if cfg.hidden_size % 8 or cfg.intermediate_size % 8:
            return Availability.no(
                f"grouped_mm needs H and I divisible by 8 (16-byte strides), got H={cfg.hidden_size}, "
                f"I={cfg.intermediate_size}",
                "use experts backend 'triton'",
            )
        if not hasattr(torch, "_grouped_mm"):
            return Availability.no(f"torch {torch.__version__} has no torch._grouped_mm", "install torch >= 2.8")
        device = torch.device(spec.device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return Availability.no("grouped_mm needs a CUDA device", "run on an sm90 / sm100 GPU")
        cap = torch.cuda.get_device_capability(device)
        if cap not in ((9, 0), (10, 0)):
            # Elsewhere torch falls back to a per-group loop that syncs the host (not capturable).
            return Availability.no(
                f"torch._grouped_mm has its CUTLASS path on sm90 / sm100 only, this GPU is sm{cap[0]}{cap[1]}",
                "use experts backend 'triton'",
            )
        return Availability.yes(f"sm{cap[0]}{cap[1]}")

    def __init__(self, spec: ExpertsSpec):
        super().__init__(spec)
        avail = self.availability(spec)
        if not avail:
            raise BackendUnavailableError(self.name, avail.reason, avail.hint)
        self.device = torch.device(spec.device)
        self.num_experts = spec.num_local_experts
        self._params: Dict[str, torch.Tensor] = {}
        # The memory-bound steps: fused Triton kernels (default where Triton runs) or the torch
        # composite (option grouped_mm_epilogue=torch; also without Triton).
        default = "triton" if _triton_can_run(self.device) else "torch"
        self.epilogue = spec.option("grouped_mm_epilogue") or default
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"grouped_mm_epilogue={self.epilogue!r}; use one of {EPILOGUES}")
        self.align_impl = spec.option("triton_align") or "triton"
        if self.align_impl not in ("triton", "torch"):
            raise ValueError(f"triton_align={self.align_impl!r}; use 'triton' or 'torch'")
        if self.epilogue == "triton" and not _triton_can_run(self.device):
            raise ValueError(
                f"grouped_mm_epilogue=triton needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                f"device {self.device}: use grouped_mm_epilogue=torch"
            )

    def parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)

    def load_weights(self, weights: ExpertWeights) -> None:
        """w13 [E, R, H] / w2 [E, H, I] bf16 (K-contiguous rows, read transposed by grouped_mm);
        biases fp32 with one extra zero row (index E) for rows of no local expert. A quantized
        checkpoint is dequantized. A reload copies in place (captured CUDA graphs stay valid)."""
        self.commit_weights(self.prepare_weights(weights))

    def prepare_weights(self, weights: ExpertWeights) -> Dict[str, torch.Tensor]:
        self.check_local_weights(weights)
        if weights.is_quantized:
            from epmoe.experts.triton.kernel_formats import dequantize_expert_weights

            weights = dequantize_expert_weights(weights)
        dev, dt, E = self.device, torch.bfloat16, self.num_experts
        # Own copies (never aliases of the caller's tensors: a reload copies into them in place).
        w1 = weights.w1.to(dev, dt)
        w13 = torch.empty(E, self.config.w13_rows, self.config.hidden_size, dtype=dt, device=dev)
        if weights.w3 is None:
            w13.copy_(w1)
        else:
            torch.cat([w1, weights.w3.to(dev, dt)], dim=1, out=w13)
        new = {"w13": w13, "w2": torch.empty(weights.w2.shape, dtype=dt, device=dev).copy_(weights.w2)}
        if self.config.has_bias:
            for name, b in (("b13", weights.b13), ("b2", weights.b2)):
                padded = torch.zeros(E + 1, b.shape[1], dtype=torch.float32, device=dev)
                padded[:E] = b.to(dev, torch.float32)
                new[name] = padded
        return new

    def commit_weights(self, prepared: Dict[str, torch.Tensor]) -> None:
        if not self._params:
            self._params = prepared
            return
        for name, t in prepared.items():
            self._params[name].copy_(t)

    def forward(self, tokens) -> torch.Tensor:
        if getattr(tokens, "layout", "flat") != "flat":
            raise ValueError(f"experts backend 'grouped_mm' takes the flat layout, got {tokens.layout!r}")
        if not self._params:
            raise RuntimeError("GroupedMMExperts.forward before load_weights; load the local experts first")
        hidden, topk_ids, topk_weights = tokens.hidden, tokens.topk_ids, tokens.topk_weights
        if isinstance(hidden, QuantizedActivation):
            raise TypeError(f"experts backend 'grouped_mm' takes bf16 tokens, got {hidden.format.describe()}")
        cfg, p = self.config, self._params
        H, I, E = cfg.hidden_size, cfg.intermediate_size, self.num_experts
        N = hidden.shape[0]
        if tuple(hidden.shape) != (N, H) or hidden.dtype != torch.bfloat16:
            raise ValueError(f"hidden is {list(hidden.shape)} {hidden.dtype}; expected [num_tokens, {H}] bfloat16")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != N or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(
                f"topk_ids {list(topk_ids.shape)} / topk_weights {list(topk_weights.shape)} do not match "
                f"hidden [{N}, {H}]; expected [{N}, top_k] each"
            )
        K = topk_ids.shape[1]
        if N == 0:
            return torch.empty(0, H, dtype=torch.bfloat16, device=hidden.device)
        if self.epilogue == "torch":
            return torch_grouped_mm_forward(hidden, topk_ids, topk_weights, p, cfg, E)
        return fused_grouped_mm_forward(hidden, topk_ids, topk_weights, p, cfg, E, False, self._launch,
                                        align=self.align_impl)  # fmt: skip

    def _launch(self, kernel_name: str, grid: tuple, args: tuple, kwargs: dict) -> None:
        from epmoe.experts.triton.launch import launch

        launch(self, kernel_name, grid, args, kwargs)
