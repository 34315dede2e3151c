"""`FlashInferA2ADispatcher` ("flashinfer"): expert-parallel all-to-all on FlashInfer's one-sided
NVLink MoE all-to-all (TensorRT-LLM kernels over MNNVL symmetric memory).

    tokens, handle = dispatcher.dispatch(hidden [T, H], topk_ids [T, K] int32, topk_weights [T, K] f32)
    out [T, H] = dispatcher.combine(expert_out [N, H], handle)      # N = ep_size * runtime_max_tokens

How it works. One symmetric workspace per rank, mapped by every peer. Dispatch writes each token
straight into the receive buffers of every rank that owns one of its experts (once per rank, not per
expert); the receiver sees a rank-major block [ep_size, runtime_max_tokens_per_rank] of rows, in
arbitrary order within a source rank's block, padded rows marked by expert id -1. Combine pulls each
token's partial outputs back from the ranks that computed them and sums them in float32 (fixed order:
deterministic run to run).

Which FlashInfer API, and why. FlashInfer 0.7 offers the primitive
`flashinfer.comm.trtllm_moe_alltoall.MoeAlltoAll` and, on top of it,
`flashinfer.moe_ep.NVLinkOneSidedAlltoAll` (which 0.7.1 marks as the successor). We use the
primitive:
  * `import flashinfer.moe_ep` imports the whole MoE-EP package (CuTe-DSL and mega-kernel configs
    of every architecture); the primitive lives in `flashinfer.comm` with one JIT module
    (`mnnvl_moe_alltoall`), the one module prebuilt on our H200s.
  * We choose the payload list ourselves: BF16 rows, or NVFP4 packed values + E4M3 scales (+ the
    sender's global scale when it is dynamic), plus ids and weights. We size the one workspace from
    exactly those bytes with FlashInfer's `moe_a2a_get_workspace_size_per_rank` and record it.
  * `NVLinkOneSidedAlltoAll` keeps the in-flight round on `self` and hides the id sanitising; we keep
    per-call state in the handle and convert ids ourselves.
  * Its collective platform check (`mnnvl_mapping_and_config`) builds a pure-EP `Mapping` and a
    `MnnvlConfig` exactly as we do here.
`MoeAlltoAll` warns that it is deprecated; the warning is silenced here, where the choice is made.

Expert ids. The kernel derives a token's target ranks from `expert_id // (E / ep_size)`, which maps
-1 (and ids >= E) to real ranks. So the routing tensor we give it replaces every invalid id with the
token's first valid expert (no extra destination) or, for a token with none, this rank's first expert
(a local copy, no link traffic). The ids that travel as payload stay unchanged; after dispatch,
FlashInfer's `moe_a2a_sanitize_expert_ids` (run inside `MoeAlltoAll.dispatch`) sets padded rows to -1,
and we convert to LOCAL ids (-1 where the expert lives on another rank) for `DispatchedTokens`.

Several ranks on one GPU (`spec.shared_gpu`, docs/shared-gpu.md): every process maps the others'
workspaces on the same device, so there is no peer access to prove and `availability` skips that
check; the control group is gloo. Only with the explicit flag: without it, ranks that cannot prove
peer access are refused.

Per-call agreement. All ranks must pass the same `runtime_max_tokens_per_rank`. With
`spec.static_shapes` (CUDA-graph mode) it is always max_tokens_per_rank and nothing syncs with the
host; otherwise option `runtime_max_tokens`:
  "allreduce" (default)  one small all-reduce (MAX) over the EP group per dispatch agrees on it and,
                         in the same collective, on input errors (a rank with a bad input raises its
                         own error, the others a peer error: nobody hangs in the kernel). Not capturable
                         in CUDA graphs.
  "uniform"              every rank dispatches the same T (padded batches, CUDA graphs): no collective.
  "static"               always spec.max_tokens_per_rank: no collective, largest receive views.
`dispatch(..., runtime_max_tokens_per_rank=n)` overrides it per call. Without the collective, ids
outside [-1, E) are routed like -1 (dropped) instead of raising.

Bytes. `stats` counts bytes that crossed to other ranks: dispatch = remote (token, rank) sends x
dispatch bytes per token; combine = rows computed for other ranks x combine bytes per row. Counting
runs on the device (graph-safe, no sync); reading `stats` synchronises once.

Options (spec.options): runtime_max_tokens (above), low_precision_combine (FP8 combine payload,
BF16 out), nvfp4_global_scale (static float: no per-token scale payload), comm ("auto" / "torch" /
"mpi"; auto = MPI when launched by mpirun without torch.distributed), comm_backend (a FlashInfer
CommBackend object to use as is), handle_bytes (default True: exact `handle.bytes_sent`, one device
sync per dispatch unless runtime_max_tokens="allreduce" already syncs; False: -1, no sync),
one_rank_local (below).

One rank (ep_size 1) under EPMoE (inputs checked by the layer, no CUDA-graph static shapes, no
low-precision combine): nothing has to move, and FlashInfer's all-to-all would only copy every token
through its workspace and back. The tokens stay where they are (an NVFP4 wire still quantizes and
dequantizes them: the same numbers as through the workspace) and combine returns the experts'
output; the torch dispatcher does the same. Option one_rank_local=False runs FlashInfer's kernels
anyway.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from epmoe.core.availability import Availability
from epmoe.core.errors import BackendUnavailableError
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.core.streams import capturing
from epmoe.dispatch.base import Agreement, DispatchedTokens, DispatchHandle, Dispatcher, DispatcherStats, DispatchSpec
from epmoe.quant.payload import PayloadFormat, QuantizedActivation

try:  # added by the runtime core; older trees only have RemoteRankError
    from epmoe.core.errors import PeerInputError as _PeerError
except ImportError:  # pragma: no cover - depends on merge order
    from epmoe.core.errors import RemoteRankError as _PeerError

INSTALL_HINT = "install FlashInfer: pip install 'flashinfer-python>=0.6.17' (needs cuda-python and pynvml)"
RUNTIME_MAX_MODES = ("allreduce", "uniform", "static")
COMM_CHOICES = ("auto", "torch", "mpi")
MPI_ENV_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


# ----------------------------------------------------------------------------- pure helpers
@dataclass(frozen=True)
class PayloadSlot:
    """One per-token payload of the dispatch: name, dtype of the tensor handed to FlashInfer,
    elements per token (its dim 1)."""

    name: str
    dtype: torch.dtype
    elements: int

    @property
    def bytes_per_token(self) -> int:
        return self.elements * torch.tensor([], dtype=self.dtype).element_size()


def plan_payloads(wire: PayloadFormat, hidden_size: int, top_k: int, send_global_scale: bool) -> Tuple[PayloadSlot, ...]:
    """Payload order of one dispatch. FlashInfer packs payloads back to back per receive block and
    requires each to start at a multiple of its element size, so the 1-byte NVFP4 scales move
    behind the 4-byte ids/weights when they would misalign them. [packed, scales, ids, weights] is
    also the layout FlashInfer's phased NVFP4 dispatch kernel recognises (EP 4/8/16)."""
    if not wire.is_quantized:
        hidden = PayloadSlot("hidden", wire.dtype, hidden_size)
        return (hidden, PayloadSlot("topk_ids", torch.int32, top_k), PayloadSlot("topk_weights", torch.float32, top_k))
    if wire.name != "nvfp4":
        raise ValueError(
            f"FlashInfer dispatch carries bf16/fp16 or nvfp4 payloads, got {wire.describe()}; use "
            "dispatch dtype 'bf16' or 'nvfp4' with this dispatcher"
        )
    if hidden_size % 16:
        raise ValueError(f"NVFP4 dispatch needs hidden_size % 16 == 0, got {hidden_size}")
    packed = PayloadSlot("hidden", torch.uint8, hidden_size // 2)
    scales = PayloadSlot("scales", torch.uint8, hidden_size // 16)
    tail = [PayloadSlot("topk_ids", torch.int32, top_k), PayloadSlot("topk_weights", torch.float32, top_k)]
    if send_global_scale:
        tail.append(PayloadSlot("global_scale", torch.float32, 1))
    if (packed.bytes_per_token + scales.bytes_per_token) % 4 == 0:
        return (packed, scales, *tail)
    return (packed, *tail, scales)


def route_expert_ids(topk_ids: torch.Tensor, num_experts: int, fallback_expert: int) -> torch.Tensor:
    """The routing tensor FlashInfer sees: every id outside [0, E) becomes the token's first valid
    id (adds no destination) or, when it has none, `fallback_expert` (this rank: no link traffic).
    [T, K] int32, contiguous."""
    ids = topk_ids.to(torch.int32)
    valid = (ids >= 0) & (ids < num_experts)
    first = valid.to(torch.int32).argmax(dim=1, keepdim=True)  # first True (argmax returns the first max)
    first_valid = ids.gather(1, first)
    fallback = torch.where(valid.any(dim=1, keepdim=True), first_valid, torch.full_like(first_valid, fallback_expert))
    return torch.where(valid, ids, fallback).contiguous()


def to_local_ids(global_ids: torch.Tensor, first_local_expert: int, num_local_experts: int) -> torch.Tensor:
    """Received global ids (-1 padding) -> LOCAL ids, -1 where the expert is not on this rank."""
    local = global_ids.to(torch.int32) - first_local_expert
    ok = (global_ids >= 0) & (local >= 0) & (local < num_local_experts)
    return torch.where(ok, local, torch.full_like(local, -1)).contiguous()


def remote_destinations(route: torch.Tensor, experts_per_rank: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    """0-dim int64: (token, rank) pairs with rank != ep_rank among the tokens' distinct target
    ranks. `route` holds only valid ids (route_expert_ids)."""
    if route.numel() == 0 or ep_size == 1:
        return torch.zeros((), dtype=torch.int64, device=route.device)
    ranks = (route // experts_per_rank).to(torch.int64)
    hit = torch.zeros(route.shape[0], ep_size, dtype=torch.bool, device=route.device)
    hit.scatter_(1, ranks, True)
    hit[:, ep_rank] = False
    return hit.sum()


def remote_rows(local_ids: torch.Tensor, ep_size: int, rows_per_rank: int, ep_rank: int) -> torch.Tensor:
    """0-dim int64: received rows from other ranks that have an expert here (their outputs go back
    over the link in combine)."""
    if ep_size == 1:
        return torch.zeros((), dtype=torch.int64, device=local_ids.device)
    has = (local_ids >= 0).any(dim=1).view(ep_size, rows_per_rank)
    return has.sum() - has[ep_rank].sum()


def _running_under_mpirun() -> bool:
    return any(v in os.environ for v in MPI_ENV_VARS)


# ----------------------------------------------------------------------------- handle
@dataclass(frozen=True)
class FlashInferDispatchHandle(DispatchHandle):
    """num_tokens: T of this rank; runtime_max_tokens_per_rank: the agreed receive block rows;
    round: which dispatch this handle belongs to; remote_sends / remote_rows: device counts of this
    call. bytes_sent: exact dispatch bytes to other ranks, or -1 when not read back to the host
    (option handle_bytes=False, or inside CUDA-graph capture; `stats` always counts them)."""

    runtime_max_tokens_per_rank: int = 0
    round: int = 0
    remote_sends: Optional[torch.Tensor] = None
    remote_rows: Optional[torch.Tensor] = None
    local: bool = False  # one rank: the tokens never entered the workspace (combine returns the experts' output)


# ----------------------------------------------------------------------------- dispatcher
@dataclass(frozen=True)
class FlashInferA2AOptions(BackendOptions):
    """Options of the FlashInfer dispatcher (see the module docstring for each)."""

    runtime_max_tokens: str = "allreduce"
    low_precision_combine: bool = False
    nvfp4_global_scale: Optional[float] = None
    comm: str = "auto"
    comm_backend: Any = None
    handle_bytes: bool = True
    check_availability: bool = True
    release_workspace_on_close: bool = False
    one_rank_local: bool = True

    def __post_init__(self):
        if self.runtime_max_tokens not in RUNTIME_MAX_MODES:
            raise ValueError(f"option runtime_max_tokens={self.runtime_max_tokens!r}; use one of {RUNTIME_MAX_MODES}")
        if self.comm not in COMM_CHOICES:
            raise ValueError(f"option comm={self.comm!r}; use one of {COMM_CHOICES}")


class FlashInferA2ADispatcher(Dispatcher):
    """Moves BF16/FP16 or NVFP4 payloads (no FP8 payload layout) between CUDA GPUs of one NVLink
    domain; needs flashinfer, cuda-python and pynvml; flat layout."""

    name = "flashinfer"
    no_training_reason = "FlashInfer's one-sided MoE all-to-all is an inference kernel without a backward"
    layout = "flat"
    wires = ("bf16", "nvfp4")
    Options = FlashInferA2AOptions
    waits_on_device = True  # MoeAlltoAll's kernels spin until every peer's tokens arrived

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        if not request.on_gpu:
            return Availability.no("FlashInfer's MoE all-to-all needs CUDA GPUs", "use dispatcher 'torch' on CPU")
        if not request.has("flashinfer"):
            return Availability.no("flashinfer is not installed", INSTALL_HINT)
        for mod, pkg in (("cuda", "cuda-python"), ("pynvml", "nvidia-ml-py")):
            if not request.has(mod):
                return Availability.no(f"FlashInfer's MNNVL memory needs {pkg}", f"pip install {pkg}")
        if request.wire not in cls.wires:
            return Availability.no(
                f"FlashInfer dispatch carries bf16 or nvfp4 payloads, not {request.wire}",
                "use dispatch dtype 'auto', 'bf16' or 'nvfp4', or dispatcher 'torch' / 'deepep' for fp8",
            )
        return Availability.yes()

    @classmethod
    def availability(cls, device: torch.device, ep_size: int = 1, shared_gpu: bool = False) -> Availability:
        if importlib.util.find_spec("flashinfer") is None:
            return Availability.no("flashinfer is not installed", INSTALL_HINT)
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return Availability.no(
                f"FlashInfer's MoE all-to-all needs CUDA GPUs, got device {device}",
                "use dispatcher 'torch' on CPU",
            )
        for mod, pkg in (("cuda", "cuda-python"), ("pynvml", "nvidia-ml-py")):
            if importlib.util.find_spec(mod) is None:
                return Availability.no(f"FlashInfer's MNNVL memory needs {pkg}", f"pip install {pkg}")
        if ep_size > 1 and not shared_gpu:
            ok, why = _peer_access(device)
            if not ok:
                return Availability.no(
                    f"ep_size={ep_size} needs peer (NVLink/P2P) access between the GPUs: {why}",
                    "run EP ranks on GPUs of one NVLink domain, or use dispatcher 'torch' (NCCL); for "
                    "several ranks on one GPU opt in with shared_gpu=True (launcher: --ranks-per-gpu N)",
                )
        # shared_gpu: every rank maps the others' workspaces on the same device (no link is crossed,
        # so there is no peer access to check); measured on one H200 with 2 and 4 ranks.
        return Availability.yes()

    def __init__(self, spec: DispatchSpec):
        super().__init__(spec)
        self.wire: PayloadFormat = getattr(spec, "wire_format", spec.payload)
        mode = self.options.runtime_max_tokens
        if mode not in RUNTIME_MAX_MODES:
            raise ValueError(f"option runtime_max_tokens={mode!r}; use one of {RUNTIME_MAX_MODES}")
        self.static_shapes = bool(getattr(spec, "static_shapes", False))
        if self.static_shapes:  # CUDA-graph mode: fixed receive block, no collective, no host sync
            mode = "static"
        self.runtime_max_mode = mode
        self.low_precision_combine = bool(self.options.low_precision_combine)
        static_gs = self.options.nvfp4_global_scale
        self._static_global_scale = None if static_gs is None else float(static_gs)
        self._static_gs_tensor = (
            None if static_gs is None
            else torch.tensor(self._static_global_scale, dtype=torch.float32, device=torch.device(spec.device))
        )
        if self.low_precision_combine and spec.combine_dtype != torch.bfloat16:
            raise ValueError("low_precision_combine produces bf16 outputs; it needs combine_dtype bfloat16")
        self.slots = plan_payloads(
            self.wire, spec.hidden_size, spec.top_k, send_global_scale=self.wire.is_quantized and static_gs is None
        )
        self.dispatch_bytes_per_token = sum(s.bytes_per_token for s in self.slots)
        elem = torch.tensor([], dtype=spec.combine_dtype).element_size()
        # Workspace holds the combine payload at full width; low precision sends 1 byte per value.
        self.combine_bytes_per_token = spec.hidden_size * elem
        self.combine_wire_bytes_per_token = spec.hidden_size * (1 if self.low_precision_combine else elem)
        if self.wire.is_quantized:
            _check_codec(self.wire)
        self.handle_bytes = bool(self.options.handle_bytes) and not self.static_shapes

        avail = (self.availability(spec.device, spec.ep_size, spec.shared_gpu) if self.options.check_availability
                 else Availability.yes())
        if not avail:
            raise BackendUnavailableError(self.name, avail.reason, avail.hint)

        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlConfig
        from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll, moe_a2a_get_workspace_size_per_rank

        self._comm, self._comm_kind = self._make_comm(spec)
        if self._comm.Get_size() != spec.ep_size or self._comm.Get_rank() != spec.ep_rank:
            raise ValueError(
                f"the communicator has rank {self._comm.Get_rank()} of {self._comm.Get_size()} but the spec "
                f"says ep_rank={spec.ep_rank} of ep_size={spec.ep_size}; pass the EP group as spec.group"
            )
        size = int(
            moe_a2a_get_workspace_size_per_rank(
                spec.ep_size, spec.max_tokens_per_rank, self.dispatch_bytes_per_token, self.combine_bytes_per_token
            )
        )
        self.workspace_bytes_required = size
        if spec.workspace_bytes is not None:
            if spec.workspace_bytes < size:
                raise ValueError(
                    f"spec.workspace_bytes={spec.workspace_bytes} is smaller than the {size} bytes per rank "
                    f"FlashInfer needs for {self.wire.describe()} x {spec.max_tokens_per_rank} tokens "
                    f"(ep_size={spec.ep_size}); size the plan's workspace with epmoe.quant.workspace"
                )
            size = int(spec.workspace_bytes)
        self.workspace_bytes_per_rank = size
        ep = spec.ep_size
        mapping = Mapping(world_size=ep, rank=spec.ep_rank, gpus_per_node=ep, tp_size=ep, moe_ep_size=ep)
        dev = torch.device(spec.device)
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)  # MNNVL memory is created on the current device
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "MoeAlltoAll is deprecated", DeprecationWarning)
            self._a2a = MoeAlltoAll(
                mapping,
                max_num_tokens=spec.max_tokens_per_rank,
                top_k=spec.top_k,
                num_experts=spec.num_experts,
                workspace_size_per_rank=size,
                mnnvl_config=MnnvlConfig(comm_backend=self._comm),
            )
        self._ids_index = [sl.name for sl in self.slots].index("topk_ids")
        self._round = 0
        self._pending: Optional[int] = None
        # [remote (token, rank) sends, rows computed for other ranks]; folded into stats on read.
        self._counters = torch.zeros(2, dtype=torch.int64, device=dev)
        self._zero = torch.zeros((), dtype=torch.int64, device=dev)  # one rank's remote counts, every call
        self._combine_ptr: dict = {}  # runtime max tokens -> address of the combine payload in the workspace

    # ------------------------------------------------------------------ communicator
    def _make_comm(self, spec: DispatchSpec):
        given = self.options.comm_backend
        if given is not None:
            return given, "custom"
        choice = self.options.comm
        if choice not in COMM_CHOICES:
            raise ValueError(f"option comm={choice!r}; use one of {COMM_CHOICES}")
        import torch.distributed as dist

        dist_ready = dist.is_available() and dist.is_initialized()
        if choice == "mpi" or (choice == "auto" and not dist_ready and _running_under_mpirun()):
            if importlib.util.find_spec("mpi4py") is None:
                raise BackendUnavailableError(self.name, "comm='mpi' needs mpi4py", "pip install mpi4py")
            from flashinfer.comm.comm_backend import MPIBackend

            return MPIBackend(), "mpi"
        if spec.ep_size == 1 and (not dist_ready or spec.group is None):
            return _SingleProcessComm(), "single"  # nothing to exchange; never wait on other ranks
        if not dist_ready:
            raise ValueError(
                f"ep_size={spec.ep_size} needs torch.distributed initialised (or mpirun with mpi4py) to "
                "exchange the workspace handles; call torch.distributed.init_process_group first"
            )
        return _ep_group_comm(spec.group), "torch"

    def _agree_max(self, values: List[int]) -> List[int]:
        """Element-wise MAX of a few ints over the EP group (one collective)."""
        if self.spec.ep_size == 1:
            return list(values)
        if self._comm_kind == "torch":
            import torch.distributed as dist

            backend = dist.get_backend(self.spec.group)
            dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            t = torch.tensor(values, dtype=torch.int64, device=dev)
            from epmoe.core.fault import run_collective

            # through run_collective: on gloo a lost peer or the layer's timeout becomes a
            # CollectiveFailure (the layer turns it into a FaultReport) instead of a bare RuntimeError
            run_collective(
                lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.spec.group, async_op=True),
                self.spec.timeout_s if backend == "gloo" else None, "all_reduce of runtime max tokens",
            )
            return [int(v) for v in t.tolist()]
        gathered = self._comm.allgather(list(values))
        return [max(g[i] for g in gathered) for i in range(len(values))]

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> DispatcherStats:
        counters = getattr(self, "_counters", None)
        if counters is not None:
            sends, rows = (int(v) for v in counters.tolist())
            if sends or rows:
                counters.zero_()
                st = self._stats
                st.tokens_sent += sends
                st.dispatch_bytes_sent += sends * self.dispatch_bytes_per_token
                st.combine_bytes_sent += rows * self.combine_wire_bytes_per_token
                if sends:  # same shape as the torch dispatcher's: {format: {payload, routing}}
                    fmt = st.by_format.setdefault(self.wire.name, {"payload": 0, "routing": 0})
                    routing = sum(sl.bytes_per_token for sl in self.slots if sl.name in ("topk_ids", "topk_weights"))
                    fmt["payload"] += sends * (self.dispatch_bytes_per_token - routing)
                    fmt["routing"] += sends * routing
        return self._stats

    @stats.setter
    def stats(self, value: DispatcherStats) -> None:
        self._stats = value

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        runtime_max_tokens_per_rank: Optional[int] = None,
        agreement: Optional[Agreement] = None,
    ) -> Tuple[DispatchedTokens, FlashInferDispatchHandle]:
        """`agreement` (from EPMoE): inputs already checked and the tokens of every rank known, so the
        receive block is their max and no collective runs (unless static shapes fix it anyway)."""
        s = self.spec
        if self._pending is not None:
            raise RuntimeError(
                "dispatch called while the previous dispatch was not combined; FlashInfer's all-to-all "
                "has one round in flight: call combine(expert_out, handle) first"
            )
        if (agreement is not None and agreement.inputs_checked and s.ep_size == 1 and not self.static_shapes
                and not self.low_precision_combine and self.options.one_rank_local):
            return self._dispatch_local(hidden, topk_ids, topk_weights)
        local_error: Optional[BaseException] = None
        if agreement is None or not agreement.inputs_checked:
            try:
                self.check_inputs(hidden, topk_ids, topk_weights)
                if hidden.dtype != s.combine_dtype:
                    raise TypeError(f"hidden has dtype {hidden.dtype}; this dispatcher was built for {s.combine_dtype}")
                if hidden.device != torch.device(s.device) and torch.device(s.device).index is not None:
                    raise ValueError(f"hidden is on {hidden.device}, the dispatcher on {s.device}")
            except (ValueError, TypeError) as e:
                local_error = e
        if agreement is not None and runtime_max_tokens_per_rank is None and not self.static_shapes \
                and local_error is None and self.runtime_max_mode == "allreduce":
            runtime_max_tokens_per_rank = max(1, agreement.max_tokens)
        T = hidden.shape[0] if local_error is None else 0
        route = sends = None
        single = s.ep_size == 1
        if local_error is None:  # before the collective: its sync then makes the counts free
            ids = topk_ids.to(torch.int32).contiguous()
            if single:  # every id (valid or not) leads to the one rank: one op, and nothing crosses a link
                route, sends = ids.clamp(0, s.num_experts - 1), self._zero
            else:
                route = route_expert_ids(ids, s.num_experts, s.first_local_expert)
                sends = remote_destinations(route, s.num_experts // s.ep_size, s.ep_size, s.ep_rank)
        rt = self._runtime_max(T, topk_ids, local_error, runtime_max_tokens_per_rank)
        payloads: List[torch.Tensor] = []
        quantized = None
        if self.wire.is_quantized:
            quantized = self._quantize_nvfp4(hidden)
        for slot in self.slots:
            if slot.name == "hidden":
                t = hidden if quantized is None else quantized[0].view(torch.uint8)
            elif slot.name == "scales":
                t = quantized[1].view(torch.uint8)
            elif slot.name == "global_scale":
                t = quantized[2].to(torch.float32).reshape(-1, 1).expand(T, 1)
            elif slot.name == "topk_ids":
                t = ids
            else:
                t = topk_weights.to(torch.float32)
            payloads.append(t.reshape(T, slot.elements).contiguous())
        recv = self._a2a.dispatch(
            route, payloads, rt, invalid_token_expert_id=-1, expert_id_payload_index=self._ids_index
        )
        recv = {slot.name: r.flatten(0, 1) for slot, r in zip(self.slots, recv)}
        if single and agreement is not None and agreement.inputs_checked:
            local_ids = recv["topk_ids"]  # ids in [-1, E) (checked), padding -1 (sanitized): local already
            rows = self._zero
        else:
            local_ids = to_local_ids(recv["topk_ids"], s.first_local_expert, s.num_local_experts)
            rows = remote_rows(local_ids, s.ep_size, rt, s.ep_rank)
        if not single:  # one rank sends and receives nothing over a link: the counters stay 0
            self._counters[0] += sends
            self._counters[1] += rows
        self._stats.dispatch_calls += 1

        x = recv["hidden"]
        if quantized is not None:
            gscale = (
                quantized[2].to(torch.float32).reshape(())
                if self._static_global_scale is not None
                else recv["global_scale"].reshape(-1)
            )
            x = self._received_activation(x, recv["scales"], gscale)
        self._round += 1
        self._pending = self._round
        bytes_sent = -1
        if single and self.handle_bytes:
            bytes_sent = 0
        elif self.handle_bytes and not capturing(hidden.device) and (agreement is None or agreement.want_bytes):
            bytes_sent = int(sends) * self.dispatch_bytes_per_token
        handle = FlashInferDispatchHandle(
            num_tokens=T,
            bytes_sent=bytes_sent,
            runtime_max_tokens_per_rank=rt,
            round=self._round,
            remote_sends=sends,
            remote_rows=rows,
        )
        extra = {"static": True} if self.static_shapes else {}
        tokens = DispatchedTokens(hidden=x, topk_ids=local_ids, topk_weights=recv["topk_weights"], layout="flat", **extra)
        return tokens, handle

    def _received_activation(self, data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor):
        """The experts' input from NVFP4 wire rows: the quantized activation, or (the experts take
        another format) its dequantized values."""
        x = QuantizedActivation(
            format=self.wire,
            data=data,
            scales=scales.view(torch.float8_e4m3fn),
            hidden_size=self.spec.hidden_size,
            global_scale=global_scale,
        )
        if self.spec.payload != self.wire:
            from epmoe.quant.codec import dequantize_activation

            return dequantize_activation(x, self.spec.combine_dtype)
        return x

    @property
    def keeps_routing(self) -> bool:
        """One rank with the local path (`_dispatch_local`): the int32 / float32 routing passes through."""
        return (self.spec.ep_size == 1 and not self.static_shapes and not self.low_precision_combine
                and self.options.one_rank_local)

    def _dispatch_local(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """One rank, inputs checked by the layer: the tokens stay in place with their own ids (all
        local; -1 stays -1) and weights. No workspace copy, no FlashInfer kernel; an NVFP4 wire
        quantizes (and, for experts of another format, dequantizes) as the wire would."""
        T = hidden.shape[0]
        ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        w = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        x = hidden
        if self.wire.is_quantized:
            data, scales, gs = self._quantize_nvfp4(hidden)
            gscale = gs.to(torch.float32).reshape(() if self._static_global_scale is not None else -1)
            x = self._received_activation(data.view(torch.uint8), scales.view(torch.uint8), gscale)
        self._stats.dispatch_calls += 1
        self._round += 1
        self._pending = self._round
        handle = FlashInferDispatchHandle(
            num_tokens=T, bytes_sent=0 if self.handle_bytes else -1, runtime_max_tokens_per_rank=max(1, T),
            round=self._round, remote_sends=self._zero, remote_rows=self._zero, local=True,
        )
        return DispatchedTokens(hidden=x, topk_ids=ids, topk_weights=w, layout="flat"), handle

    def _quantize_nvfp4(self, hidden: torch.Tensor):
        """(packed uint8 [T, H/2], e4m3 scales [T, H/16], float32 global scale) of this rank's rows."""
        H = self.spec.hidden_size
        if self._static_global_scale is not None:
            gs = self._static_gs_tensor  # made once: a per-call host->device copy would sync the stream
        elif hidden.shape[0] == 0:
            gs = torch.ones((), dtype=torch.float32, device=hidden.device)
        else:
            gs = None
        if hidden.shape[0] == 0:  # nothing to quantize; keep the tensor geometry
            return (
                torch.empty(0, H // 2, dtype=torch.uint8, device=hidden.device),
                torch.empty(0, H // 16, dtype=torch.float8_e4m3fn, device=hidden.device),
                gs,
            )
        from epmoe.quant.codec import quantize_activation, quantize_for_wire

        # the torch dispatcher's quantizer: one global scale per token unless a static one is set
        q = quantize_for_wire(hidden, self.wire) if gs is None else quantize_activation(hidden, self.wire, global_scale=gs)
        return q.data, q.scales, q.global_scale

    def _runtime_max(
        self, T: int, topk_ids: torch.Tensor, local_error: Optional[BaseException], override: Optional[int]
    ) -> int:
        s = self.spec
        if override is not None:
            if local_error is not None:
                raise local_error
            if not T <= override <= s.max_tokens_per_rank or override < 1:
                raise ValueError(
                    f"runtime_max_tokens_per_rank={override} must be in [max(1, T={T}), "
                    f"max_tokens_per_rank={s.max_tokens_per_rank}] and equal on every rank"
                )
            return override
        if self.runtime_max_mode == "static":
            if local_error is not None:
                raise local_error
            return s.max_tokens_per_rank
        if self.runtime_max_mode == "uniform":
            if local_error is not None:
                raise local_error
            return max(1, T)
        bad_value = None
        if local_error is None and topk_ids.numel():
            bad = (topk_ids < -1) | (topk_ids >= s.num_experts)
            if s.ep_size == 1:
                if bool(bad.any()):
                    bad_value = int(topk_ids[bad][0])
            else:
                flag = int(bad.any())  # one sync, shared with the collective below
                if flag:
                    bad_value = int(topk_ids[bad][0])
        if bad_value is not None:
            local_error = ValueError(
                f"topk_ids contains {bad_value}; expert ids must be in [0, {s.num_experts}) or -1 (no expert)"
            )
        max_t, failed = self._agree_max([T, int(local_error is not None)])
        if local_error is not None:
            raise local_error
        if failed:
            raise _PeerError(
                "another rank of the EP group passed invalid input to FlashInferA2ADispatcher.dispatch, "
                "so this rank stops too (see that rank's error)"
            )
        return max(1, max_t)

    # ------------------------------------------------------------------ combine
    def combine_input_buffer(self, handle: FlashInferDispatchHandle) -> torch.Tensor:
        """[N, H] combine-dtype view of this rank's workspace: experts may write their output here
        and `combine` skips the staging copy (a one-rank local handle: a new tensor, which combine
        returns as the output)."""
        self._check_handle(handle)
        if handle.local:
            return torch.empty(handle.num_tokens, self.spec.hidden_size, dtype=self.spec.combine_dtype,
                               device=torch.device(self.spec.device))
        return self._a2a.get_combine_payload_tensor_in_workspace(
            handle.runtime_max_tokens_per_rank, self.spec.hidden_size, self.spec.combine_dtype
        ).flatten(0, 1)

    def _check_handle(self, handle: DispatchHandle) -> None:
        if not isinstance(handle, FlashInferDispatchHandle):
            raise TypeError(f"combine needs the handle FlashInferA2ADispatcher.dispatch returned, got {type(handle).__name__}")
        if self._pending is None or handle.round != self._pending:
            raise RuntimeError(
                f"handle of dispatch round {handle.round} is not the one in flight "
                f"({self._pending}); combine each dispatch exactly once, before the next dispatch"
            )

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        self._check_handle(handle)
        s, rt = self.spec, handle.runtime_max_tokens_per_rank
        rows = handle.num_tokens if handle.local else s.ep_size * rt
        if expert_output.shape != (rows, s.hidden_size):
            raise ValueError(
                f"expert_output has shape {list(expert_output.shape)}; expected [{rows}, {s.hidden_size}] "
                "(one row per received row of the dispatch)"
            )
        if expert_output.dtype != s.combine_dtype:
            raise TypeError(f"expert_output has dtype {expert_output.dtype}; expected {s.combine_dtype}")
        if handle.local:  # one rank: the rows are the tokens, in order
            self._pending = None
            return expert_output
        payload = expert_output.contiguous().view(s.ep_size, rt, s.hidden_size)
        ptr = self._combine_ptr.get(rt)
        if ptr is None:  # the workspace is fixed for the dispatcher's life: asked once per rt
            ptr = self._combine_ptr[rt] = self.combine_input_buffer(handle).data_ptr()
        in_workspace = payload.data_ptr() == ptr
        kwargs = {"payload_in_workspace": in_workspace}
        if self.low_precision_combine:
            kwargs["use_low_precision"] = True
        out = self._a2a.combine(payload, rt, **kwargs)
        self._pending = None
        return out

    def close(self) -> None:
        """Stop using the workspace. FlashInfer keeps one MNNVL workspace per geometry for the whole
        process and reuses it for the next dispatcher of that geometry; freeing it (its testing-only
        `_reset_workspace`) and mapping a new one crashed the H200 process now and then (segfault
        in the next dispatcher's first round), so it is released only with the option
        `release_workspace_on_close=True`."""
        a2a = getattr(self, "_a2a", None)
        if a2a is None:
            return
        self._a2a = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._comm.barrier()  # no peer may still read or write this rank's workspace
        reset = getattr(a2a, "_reset_workspace", None)
        if reset is not None and self.options.release_workspace_on_close:
            reset()


# ----------------------------------------------------------------------------- helpers
def _check_codec(wire: PayloadFormat) -> None:
    try:
        from epmoe.quant.codec import QUANTIZED_FORMATS
    except ImportError as e:
        raise ValueError(f"NVFP4 dispatch needs epmoe.quant.codec ({e}); use dispatch dtype 'bf16'") from e
    if QUANTIZED_FORMATS.get(wire.name) != wire:
        raise ValueError(
            f"wire format {wire.describe()} is not epmoe.quant.codec's {wire.name}; build it with "
            "epmoe.quant.codec.payload_format"
        )


def _peer_access(device: torch.device) -> Tuple[bool, str]:
    n = torch.cuda.device_count()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if n > 1:
        blocked = [j for j in range(n) if j != idx and not torch.cuda.can_device_access_peer(idx, j)]
        if blocked:
            return False, f"GPU {idx} cannot access peers {blocked}"
        return True, ""
    try:  # one GPU visible per process: ask NVML whether its NVLinks are P2P-capable and up
        from flashinfer.comm.mnnvl import MnnvlMemory

        if MnnvlMemory.supports_mnnvl():
            return True, ""
        return False, f"GPU {idx} has no P2P-capable NVLink, or not all of its links are up"
    except Exception as e:  # noqa: BLE001 - NVML errors mean we cannot prove peer access
        return False, f"NVML query failed: {e}"


class _SingleProcessComm:
    """FlashInfer CommBackend of one rank (ep_size=1 without torch.distributed)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def allgather(self, data):
        return (data,)

    def bcast(self, data, root: int):
        return data

    def barrier(self) -> None:
        return None

    def Split(self, color: int, key: int):
        return self


def _ep_group_comm(group):
    """TorchDistBackend over the EP group whose Split returns the group itself when the split
    keeps it whole (pure EP). FlashInfer's Split makes new groups with `new_subgroups_by_enumeration`,
    a collective over the WORLD: with an EP group smaller than the world it would wait forever."""
    from flashinfer.comm.comm_backend import TorchDistBackend

    class _EpGroupComm(TorchDistBackend):
        def Split(self, color: int, key: int):
            info = self.allgather((color, key, self.Get_rank()))
            same_color = len({c for c, _, _ in info}) == 1
            order = [r for _, _, r in sorted(info, key=lambda i: (i[1], i[2]))]
            if same_color and order == list(range(len(info))):
                return self
            return super().Split(color, key)

    return _EpGroupComm(group=group)
