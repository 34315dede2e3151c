"""Workspace and memory sizing from a resolved `QuantPlan` (pure arithmetic, no allocation).

One definition of "max tokens": `max_tokens_per_rank` = the most tokens ONE rank sends in ONE
dispatch call (per source rank; the layer chunks larger batches; `DispatchSpec.max_tokens_per_rank`).
A rank can therefore receive up to `ep_size * max_tokens_per_rank` rows: every receive-side region
is sized from the EP group size times that.

Hidden size: sizes use `config.hidden_size`, the K the layer's tensors have. When a checkpoint's
hidden size was pre-rounded (GPT-OSS 2880 -> 3072, `config.hidden_size_unpadded` = 2880), the
padded K (3072) is what is dispatched and computed, so that is what is sized; tables say so.

    ws  = workspace_breakdown(plan, config, ep_size=8, max_tokens_per_rank=256)
    ws.total_bytes, print(ws.format_table())
    mem = memory_required(plan, config, ep_size=8, max_tokens_per_rank=256, num_moe_layers=58)

FlashInfer A2A (`dispatcher="flashinfer"`): `a2a_bytes` reproduces
`flashinfer.comm.trtllm_moe_alltoall.moe_a2a_get_workspace_size_per_rank` (0.7.2.post1) exactly:
    pad128(aux) + pad128(ep * max_tokens * dispatch_bytes_per_token)
                + pad128(ep * max_tokens * combine_bytes_per_token)
with aux = the C++ `calculateOffsets(...)[PAYLOAD_DATA_OFFSET_INDEX]` (flags, counters, per-token
routing scratch for kMaxTopK = 22), see `flashinfer_a2a_aux_bytes`.
Other dispatchers and the experts' GEMM scratch are documented estimates (see each function).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from epmoe.config import MoEConfig
from epmoe.quant.codec import GLOBAL_SCALE_BYTES, payload_format
from epmoe.quant.deepep_sizing import NORMAL_MODE_EP_SIZES, deepep_buffer_bytes
from epmoe.quant.plan import QuantPlan

CACHELINE = 128
FLASHINFER_A2A_MAX_TOP_K = 22  # tensorrt_llm::kernels::moe_alltoall::kMaxTopK (0.7.2.post1)
FLASHINFER_A2A_MAX_RANKS = 64  # kMaxRanks
INT32_BYTES = 4
FLOAT32_BYTES = 4
# Fixed allowance for the fused-MoE kernels' tactic-dependent GEMM / TMA / scheduler workspaces,
# which depend on the chosen CUTLASS tactic and cannot be computed without the compiled module.
GEMM_WORKSPACE_ALLOWANCE = 16 << 20


def pad_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _check_positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def flashinfer_a2a_aux_bytes(ep_size: int, max_tokens_per_rank: int, eplb_stats_num_experts: int = 0) -> int:
    """FlashInfer MoE A2A metadata bytes per rank (C++ `getMoeA2AAuxDataSize`): flag value and local
    token counter (int32 each), send/recv counters (ep int32 each), dispatch and combine completion
    flags (ep int32 each, cacheline-aligned), top-k target ranks and send indices
    (max_tokens * kMaxTopK int32 each, aligned), EPLB gathered stats (ep * eplb int32, aligned)."""
    off = 4 + 4 + ep_size * INT32_BYTES + ep_size * INT32_BYTES
    off = pad_up(off, CACHELINE) + ep_size * INT32_BYTES  # dispatch completion flags
    off = pad_up(off, CACHELINE) + ep_size * INT32_BYTES  # combine completion flags
    off = pad_up(off, CACHELINE) + max_tokens_per_rank * FLASHINFER_A2A_MAX_TOP_K * INT32_BYTES
    off = pad_up(off, CACHELINE) + max_tokens_per_rank * FLASHINFER_A2A_MAX_TOP_K * INT32_BYTES
    off = pad_up(off, CACHELINE) + ep_size * eplb_stats_num_experts * INT32_BYTES
    return pad_up(off, CACHELINE)


def flashinfer_a2a_workspace_bytes(
    ep_size: int,
    max_tokens_per_rank: int,
    dispatch_bytes_per_token: int,
    combine_bytes_per_token: int,
    eplb_stats_num_experts: int = 0,
) -> int:
    """Same value as FlashInfer's `moe_a2a_get_workspace_size_per_rank` for the same inputs."""
    return (
        pad_up(flashinfer_a2a_aux_bytes(ep_size, max_tokens_per_rank, eplb_stats_num_experts), CACHELINE)
        + pad_up(ep_size * max_tokens_per_rank * dispatch_bytes_per_token, CACHELINE)
        + pad_up(ep_size * max_tokens_per_rank * combine_bytes_per_token, CACHELINE)
    )


@dataclass(frozen=True)
class WorkspaceBreakdown:
    """Bytes per rank for one (plan, config, ep_size, max_tokens_per_rank).

    Per token: hidden/scale/global-scale bytes in the dispatch dtype, top-k ids (int32) and weights
    (float32); combine bytes (combine dtype). Regions (bytes per rank): dispatch receive region,
    send staging (dispatchers that copy into a send buffer), combine region, auxiliary metadata, and
    the experts' GEMM scratch. `total_bytes` = a2a_bytes + experts_scratch_bytes."""

    dispatcher: str
    layout: str
    ep_size: int
    max_tokens_per_rank: int
    hidden_size: int
    hidden_size_unpadded: Optional[int]
    intermediate_size: int
    top_k: int
    num_local_experts: int
    dispatch_dtype: str
    combine_dtype: str
    experts_backend: str
    hidden_bytes_per_token: int
    scale_bytes_per_token: int
    global_scale_bytes_per_token: int
    topk_ids_bytes_per_token: int
    topk_weights_bytes_per_token: int
    combine_bytes_per_token: int
    recv_rows: int
    dispatch_region_bytes: int
    send_staging_bytes: int
    combine_region_bytes: int
    aux_bytes: int
    experts_rows: int
    experts_scratch_bytes: int
    exact: bool
    note: str = ""

    @property
    def dispatch_bytes_per_token(self) -> int:
        return (
            self.hidden_bytes_per_token
            + self.scale_bytes_per_token
            + self.global_scale_bytes_per_token
            + self.topk_ids_bytes_per_token
            + self.topk_weights_bytes_per_token
        )

    @property
    def a2a_bytes(self) -> int:
        """The dispatcher's workspace per rank (for "flashinfer": FlashInfer's own formula)."""
        return self.aux_bytes + self.dispatch_region_bytes + self.send_staging_bytes + self.combine_region_bytes

    @property
    def total_bytes(self) -> int:
        return self.a2a_bytes + self.experts_scratch_bytes

    def format_table(self) -> str:
        """Aligned text for the launcher's `--plan`."""
        k = f"K={self.hidden_size}"
        if self.hidden_size_unpadded and self.hidden_size_unpadded != self.hidden_size:
            k += f" (checkpoint hidden {self.hidden_size_unpadded} pre-rounded to {self.hidden_size}; sizes use {self.hidden_size})"
        head = (
            f"workspace per rank: dispatcher={self.dispatcher} ({self.layout}) ep_size={self.ep_size} "
            f"max_tokens_per_rank={self.max_tokens_per_rank} (per source rank) {k} top_k={self.top_k} "
            f"local_experts={self.num_local_experts}"
        )
        per_tok = (
            f"hidden {self.hidden_bytes_per_token} ({self.dispatch_dtype}) + scales {self.scale_bytes_per_token}"
            f" + global scale {self.global_scale_bytes_per_token} + topk ids {self.topk_ids_bytes_per_token}"
            f" + topk weights {self.topk_weights_bytes_per_token} = {self.dispatch_bytes_per_token} B"
        )
        rows = [
            ("dispatch payload / token", per_tok),
            ("combine payload / token", f"{self.combine_bytes_per_token} B ({self.combine_dtype})"),
            ("dispatch region", f"{_fmt(self.dispatch_region_bytes)}  ({self.recv_rows} rows = ep_size x max_tokens)"),
            ("send staging", _fmt(self.send_staging_bytes)),
            ("combine region", _fmt(self.combine_region_bytes)),
            ("aux (flags/counters)", _fmt(self.aux_bytes)),
            ("a2a workspace", _fmt(self.a2a_bytes) + ("  [exact]" if self.exact else "  [estimate]")),
            (f"experts scratch ({self.experts_backend})", f"{_fmt(self.experts_scratch_bytes)}  ({self.experts_rows} rows)  [estimate]"),
            ("total per rank", _fmt(self.total_bytes)),
        ]
        w = max(len(r[0]) for r in rows)
        lines = [head] + [f"  {a.ljust(w)} : {b}" for a, b in rows]
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def _fmt(n: int) -> str:
    if n >= 1 << 30:
        return f"{n} B ({n / (1 << 30):.2f} GiB)"
    if n >= 1 << 20:
        return f"{n} B ({n / (1 << 20):.2f} MiB)"
    if n >= 1 << 10:
        return f"{n} B ({n / (1 << 10):.1f} KiB)"
    return f"{n} B"


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def experts_scratch_bytes(plan: QuantPlan, config: MoEConfig, rows: int, num_local_experts: int) -> int:
    """Estimated GEMM scratch of the experts for `rows` received tokens (documented estimate).

    FlashInfer kernels (flashinfer_*): the large buffers of the CUTLASS MoE runner
    (`getWorkspaceDeviceBufferSizes`, 0.7.2.post1) with n = top_k * rows routed rows:
    max(permuted input, fc1 result, fc2 output) + max(GLU intermediate, fc2 output, fc1 result)
    + routing indices + activation block scales + GEMM_WORKSPACE_ALLOWANCE (16 MiB) for the
    tactic-dependent GEMM / TMA / scheduler workspaces. Prefer FlashInfer's
    `cutlass_fused_moe_workspace_size` where its module is built.
    triton: per routed row (padded to 128 per local expert) the gathered input, GEMM1 output,
    activation and GEMM2 output in the model dtype, plus sort indices.
    reference: gathered inputs (model dtype) + float32 GEMM1 output, activation and GEMM2 output
    per routed row.
    """
    H, I, K = config.hidden_size, config.intermediate_size, config.top_k
    n = K * rows
    model_b = _elem_bytes(config.dtype)
    if plan.experts_backend.startswith("flashinfer"):
        act_b = {"nvfp4": 0.5, "fp8_block": 1, "fp8": 2, "mxfp8": 1}.get(plan.act_format, model_b)
        out_b = 2
        permuted = int(n * H * act_b)
        fc1_result = int(n * I * act_b)
        fc2_result = n * H * out_b
        glu_inter = (2 if config.is_gated else 1) * n * I * out_b
        inputs = max(permuted, fc2_result, fc1_result)
        outputs = max(glu_inter, fc2_result, fc1_result)
        indices = 2 * n * INT32_BYTES + num_local_experts * rows * INT32_BYTES + (num_local_experts + 1) * 8
        indices += n * FLOAT32_BYTES  # permuted token final scales (fused finalize)
        sf_block = {"nvfp4": 16, "mxfp8": 32, "fp8": 32}.get(plan.act_format)
        act_sf = 0
        if sf_block:
            sf_rows = min(n, rows * num_local_experts) + 128 * num_local_experts
            act_sf = sf_rows * pad_up(max(H, I) // sf_block, 4)
        return inputs + outputs + indices + act_sf + GEMM_WORKSPACE_ALLOWANCE
    if plan.experts_backend == "triton":
        # sorted/padded routed rows (block-aligned per expert), GEMM1 and activation outputs and the
        # per-(token, k) GEMM2 output in the model dtype, plus sort indices
        padded = n + num_local_experts * 128
        return padded * (H * model_b + config.w13_rows * model_b + I * model_b + H * model_b) + 3 * padded * INT32_BYTES
    gathered = n * H * model_b
    gemm1 = n * config.w13_rows * FLOAT32_BYTES
    act = n * I * FLOAT32_BYTES
    gemm2 = n * H * FLOAT32_BYTES
    return gathered + gemm1 + act + gemm2


def workspace_breakdown(
    plan: QuantPlan,
    config: MoEConfig,
    ep_size: int,
    max_tokens_per_rank: int,
    *,
    eplb_stats_num_experts: int = 0,
) -> WorkspaceBreakdown:
    """Size every workspace of one MoE layer per rank; see the module docstring."""
    if not isinstance(plan, QuantPlan):
        raise TypeError(f"plan must be a QuantPlan, got {type(plan).__name__}")
    _check_positive(ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank)
    if config.num_experts % ep_size:
        raise ValueError(
            f"num_experts={config.num_experts} is not divisible by ep_size={ep_size}; "
            "choose an EP size that divides the expert count"
        )
    H, K = config.hidden_size, config.top_k
    fmt = payload_format(plan.dispatch_dtype, config.dtype)
    if fmt.is_quantized and H % fmt.block_size:
        raise ValueError(
            f"hidden_size={H} is not a multiple of the {fmt.name} block size {fmt.block_size}; "
            f"pad the hidden size or dispatch bf16"
        )
    hidden_b = fmt.data_bytes_per_token(H)
    scale_b = fmt.scale_bytes_per_token(H)
    gs_b = GLOBAL_SCALE_BYTES if fmt.global_scale else 0
    ids_b = K * INT32_BYTES
    w_b = K * FLOAT32_BYTES
    per_tok = hidden_b + scale_b + gs_b + ids_b + w_b
    comb_fmt = payload_format(plan.combine_dtype, config.dtype)
    comb_b = comb_fmt.data_bytes_per_token(H)
    L = config.num_experts // ep_size
    recv_rows = ep_size * max_tokens_per_rank
    layout = plan.layout
    exact = False
    note = ""
    if plan.dispatcher == "flashinfer":
        if K > FLASHINFER_A2A_MAX_TOP_K:
            raise ValueError(f"FlashInfer MoE A2A supports top_k <= {FLASHINFER_A2A_MAX_TOP_K}, got top_k={K}")
        if ep_size > FLASHINFER_A2A_MAX_RANKS:
            raise ValueError(f"FlashInfer MoE A2A supports ep_size <= {FLASHINFER_A2A_MAX_RANKS}, got {ep_size}")
        aux = flashinfer_a2a_aux_bytes(ep_size, max_tokens_per_rank, eplb_stats_num_experts)
        dispatch_region = pad_up(recv_rows * per_tok, CACHELINE)
        combine_region = pad_up(recv_rows * comb_b, CACHELINE)
        send = 0
        exact = True
        note = "payloads are written into peers' regions (one-sided); equals moe_a2a_get_workspace_size_per_rank"
        experts_rows = recv_rows
    elif plan.dispatcher == "deepep_ll" or (plan.dispatcher == "deepep" and ep_size in NORMAL_MODE_EP_SIZES):
        # DeepEP's own size formulas (epmoe.quant.deepep_sizing), the ones its dispatcher checks:
        # low latency: one NVSHMEM buffer, double-buffered send/receive/signalling regions with
        # per-expert receive slots of max_tokens from every rank; normal: one NVLink IPC buffer of
        # per-channel rings, independent of the batch size.
        low_latency = plan.dispatcher == "deepep_ll"
        sizes = deepep_buffer_bytes(
            low_latency=low_latency, hidden_size=H, ep_size=ep_size, num_experts=config.num_experts, top_k=K,
            max_tokens_per_rank=max_tokens_per_rank, wire=fmt,
        )
        dispatch_region = sizes.num_rdma_bytes if low_latency else sizes.num_nvl_bytes
        send, combine_region, aux = 0, 0, 0
        exact = True
        note = ("one NVSHMEM buffer; equals DeepEP's get_low_latency_rdma_size_hint" if low_latency
                else "one NVLink IPC buffer (per-channel rings); equals what DeepEP's intranode kernels need")
        note += " (regions not split out)"
        experts_rows = (L if low_latency else 1) * recv_rows
    else:
        # torch / reference / deepep: one row per (token, destination rank). A token reaches at
        # most min(top_k, ep_size) ranks, so the send side holds max_tokens * min(top_k, ep) rows
        # and the receive side ep_size * max_tokens rows; combine mirrors it.
        fanout = min(K, ep_size)
        dispatch_region = recv_rows * per_tok
        send = max_tokens_per_rank * fanout * per_tok
        combine_region = recv_rows * comb_b + max_tokens_per_rank * fanout * comb_b
        aux = 4 * ep_size * 8  # int64 send/recv split counts, dispatch and combine
        note = "estimate: one row per (token, destination rank)"
        experts_rows = recv_rows
    scratch = experts_scratch_bytes(plan, config, experts_rows, L)
    return WorkspaceBreakdown(
        dispatcher=plan.dispatcher,
        layout=layout,
        ep_size=ep_size,
        max_tokens_per_rank=max_tokens_per_rank,
        hidden_size=H,
        hidden_size_unpadded=config.hidden_size_unpadded,
        intermediate_size=config.intermediate_size,
        top_k=K,
        num_local_experts=L,
        dispatch_dtype=plan.dispatch_dtype,
        combine_dtype=plan.combine_dtype,
        experts_backend=plan.experts_backend,
        hidden_bytes_per_token=hidden_b,
        scale_bytes_per_token=scale_b,
        global_scale_bytes_per_token=gs_b,
        topk_ids_bytes_per_token=ids_b,
        topk_weights_bytes_per_token=w_b,
        combine_bytes_per_token=comb_b,
        recv_rows=recv_rows,
        dispatch_region_bytes=dispatch_region,
        send_staging_bytes=send,
        combine_region_bytes=combine_region,
        aux_bytes=aux,
        experts_rows=experts_rows,
        experts_scratch_bytes=scratch,
        exact=exact,
        note=note,
    )


def shared_workspace(breakdowns: Sequence[WorkspaceBreakdown]) -> WorkspaceBreakdown:
    """One workspace serving several layers run one after another (same dispatcher, EP size and
    max tokens): every per-token payload and region is the max over the layers, so the result
    fits each of them. For FlashInfer the max payloads go through the same exact formula."""
    if not breakdowns:
        raise ValueError("shared_workspace needs at least one layer's WorkspaceBreakdown")
    first = breakdowns[0]
    for b in breakdowns[1:]:
        for name in ("dispatcher", "ep_size", "max_tokens_per_rank"):
            if getattr(b, name) != getattr(first, name):
                raise ValueError(
                    f"layers disagree on {name} ({getattr(first, name)!r} vs {getattr(b, name)!r}); "
                    "a shared workspace needs one dispatcher, EP size and max_tokens_per_rank"
                )
    m = {
        name: max(getattr(b, name) for b in breakdowns)
        for name in (
            "hidden_size",
            "intermediate_size",
            "top_k",
            "hidden_bytes_per_token",
            "scale_bytes_per_token",
            "global_scale_bytes_per_token",
            "topk_ids_bytes_per_token",
            "topk_weights_bytes_per_token",
            "combine_bytes_per_token",
            "dispatch_region_bytes",
            "send_staging_bytes",
            "combine_region_bytes",
            "aux_bytes",
            "experts_rows",
            "experts_scratch_bytes",
            "num_local_experts",
        )
    }
    out = replace(first, **m, exact=all(b.exact for b in breakdowns), note=f"shared by {len(breakdowns)} layers (max per field)")
    if first.dispatcher == "flashinfer":
        per_tok = out.dispatch_bytes_per_token
        rows = first.ep_size * first.max_tokens_per_rank
        out = replace(
            out,
            dispatch_region_bytes=pad_up(rows * per_tok, CACHELINE),
            combine_region_bytes=pad_up(rows * out.combine_bytes_per_token, CACHELINE),
        )
    return out


# ------------------------------------------------------------------ whole-model memory budget
def expert_weight_bytes(plan: QuantPlan, config: MoEConfig) -> int:
    """Bytes of ONE expert's weights (+ scales, biases) in the plan's weight format.

    bf16:      every parameter in the model dtype
    fp8_block: 1 B / weight + float32 per 128x128 block
    nvfp4:     0.5 B / weight + 1 B (E4M3) per 16 in the 128x4 swizzled layout (rows padded to 128,
               scale columns to 4) + 4 float32 (weight_scale_2 and input_scale of w13 and w2)
    mxfp4:     0.5 B / weight + 1 B (E8M0) per 32 (+ 2 float32 Humming residual scales)
    mxfp8:     1 B / weight + 1 B (E8M0) per 32
    Biases stay in the model dtype."""
    H, I = config.hidden_size, config.intermediate_size
    R = config.w13_rows
    model_b = _elem_bytes(config.dtype)
    fmt = plan.weight_format
    mats = ((R, H), (H, I))  # (rows, K) of w13 and w2
    if fmt == "bf16":
        b = sum(r * k for r, k in mats) * model_b
    elif fmt == "fp8_block":
        b = sum(r * k + -(-r // 128) * -(-k // 128) * FLOAT32_BYTES for r, k in mats)
    elif fmt == "nvfp4":
        b = sum(r * k // 2 + pad_up(r, 128) * pad_up(-(-k // 16), 4) for r, k in mats) + 4 * FLOAT32_BYTES
    elif fmt == "mxfp4":
        b = sum(r * k // 2 + r * -(-k // 32) for r, k in mats)
        if plan.humming:
            b += 2 * FLOAT32_BYTES
    elif fmt == "mxfp8":
        b = sum(r * k + r * -(-k // 32) for r, k in mats)
    else:  # pragma: no cover - the plan validates its modes
        raise ValueError(f"unknown weight format {fmt!r}")
    if config.has_bias:
        b += (R + H) * model_b
    return b


@dataclass(frozen=True)
class MemoryBudget:
    """What a serving engine reserves per rank before allocating: expert weights of the local
    experts of every MoE layer, plus one workspace shared by the layers."""

    expert_weight_bytes: int
    num_local_experts: int
    num_moe_layers: int
    weights_bytes: int
    workspace: WorkspaceBreakdown

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.workspace.total_bytes

    def format_table(self) -> str:
        return "\n".join(
            [
                f"memory per rank: {self.num_moe_layers} MoE layers x {self.num_local_experts} local experts "
                f"x {_fmt(self.expert_weight_bytes)} per expert",
                f"  expert weights : {_fmt(self.weights_bytes)}",
                f"  workspace      : {_fmt(self.workspace.total_bytes)} (shared by all layers)",
                f"  total          : {_fmt(self.total_bytes)}",
            ]
        )


def memory_required(
    plan: QuantPlan,
    config: MoEConfig,
    ep_size: int,
    max_tokens_per_rank: int,
    *,
    num_moe_layers: Optional[int] = None,
    eplb_stats_num_experts: int = 0,
) -> MemoryBudget:
    """Per-rank bytes for expert weights (all MoE layers) + the shared workspace.

    num_moe_layers: MoE layers of the model (default `config.num_layers`; DeepSeek-V3's first 3
    layers are dense, so pass 58 there)."""
    layers = config.num_layers if num_moe_layers is None else num_moe_layers
    _check_positive(num_moe_layers=layers)
    ws = workspace_breakdown(plan, config, ep_size, max_tokens_per_rank, eplb_stats_num_experts=eplb_stats_num_experts)
    per_expert = expert_weight_bytes(plan, config)
    L = config.num_experts // ep_size
    return MemoryBudget(
        expert_weight_bytes=per_expert,
        num_local_experts=L,
        num_moe_layers=layers,
        weights_bytes=per_expert * L * layers,
        workspace=ws,
    )


def format_plan_report(
    plan: QuantPlan,
    config: MoEConfig,
    ep_size: int,
    max_tokens_per_rank: int,
    *,
    num_moe_layers: Optional[int] = None,
) -> str:
    """What the launcher's `--plan` prints: the plan, the workspace table and the memory budget,
    plus the dispatch bytes per token relative to BF16."""
    mem = memory_required(plan, config, ep_size, max_tokens_per_rank, num_moe_layers=num_moe_layers)
    ws = mem.workspace
    bf16_tok = config.hidden_size * 2 + ws.topk_ids_bytes_per_token + ws.topk_weights_bytes_per_token
    ratio = (
        f"dispatch bytes/token {ws.dispatch_bytes_per_token} = {ws.dispatch_bytes_per_token / bf16_tok:.3f}x BF16 "
        f"({bf16_tok}); hidden payload {ws.hidden_bytes_per_token + ws.scale_bytes_per_token + ws.global_scale_bytes_per_token}"
        f" = {(ws.hidden_bytes_per_token + ws.scale_bytes_per_token + ws.global_scale_bytes_per_token) / (config.hidden_size * 2):.3f}x BF16"
    )
    return "\n".join([plan.describe(), ws.format_table(), "  " + ratio, mem.format_table()])
