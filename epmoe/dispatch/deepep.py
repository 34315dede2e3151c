"""DeepEP dispatchers, on DeepEP V1's `deep_ep.Buffer` (see docs/deepep.md for the version, the build
and what runs on one GPU).

    "deepep"     `DeepEPDispatcher`: DeepEP's normal (high-throughput) intranode kernels over NVLink
                 IPC buffers. Flat layout; tokens travel as BF16 or FP8 (e4m3 + fp32 scale per 1x128);
                 combine in BF16. ep_size 2, 4 or 8 inside one node: DeepEP compiles these kernels for
                 2/4/8 ranks only, so ONE rank is not supported (`normal_mode_ep_support`).
    "deepep_ll"  `DeepEPLowLatencyDispatcher`: DeepEP's low-latency kernels over NVSHMEM (NVLink P2P
                 inside a node, IBGDA RDMA across nodes; with one rank everything is a local copy).
                 Masked layout: hidden [E_local, ep_size * max_tokens_per_rank, H] with
                 expert_counts [E_local]; the routing weights are applied inside combine. BF16 input,
                 BF16 or FP8 on the wire, any ep_size (1 included).

Pure functions (testable without DeepEP or a GPU): `deepep_buffer_bytes` (DeepEP's own size hints,
replicated), `deepep_wire_support`, `normal_mode_ep_support`, `low_latency_shape_problems`,
`fp8_block_quantize` (DeepEP's low-latency FP8 cast) / `fp8_block_dequantize` (the FP8 1x128 format).

`deep_ep` is imported only in `availability()` and the constructors. A `DeepEPBuffer` is sized once
and may be shared by the dispatchers of several layers (dispatcher option "deepep_buffer").
Dispatcher options: "deepep_buffer" (a DeepEPBuffer), "num_sms" (even, default 20; normal mode),
"check_inputs" (default True: shape/dtype/id-range checks agreed across the group before any
DeepEP kernel runs), "count_bytes" (default True: byte counters, one small host sync per call in
low-latency mode). With both checks off the low-latency path makes no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional, Tuple

import torch

from epmoe.core import dist as edist
from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.core.errors import BackendUnavailableError
from epmoe.dispatch.base import Agreement, DispatchedTokens, DispatchHandle, Dispatcher, DispatchSpec
from epmoe.quant import codec
from epmoe.quant.payload import PayloadFormat, QuantizedActivation

from epmoe.dispatch.deepep_install import INSTALL_HINT, V1_BUFFER_METHODS

# DeepEP's sizing facts live in epmoe.quant.deepep_sizing (the plan's workspace sizing uses them too)
from epmoe.quant.deepep_sizing import (  # noqa: F401 - re-exported
    NUM_MAX_NVL_PEERS,
    BUFFER_ALIGNMENT_BYTES,
    SOURCE_META_BYTES,
    TOPK_IDX_BYTES,
    NORMAL_MODE_EP_SIZES,
    LL_HIDDEN_SIZES,
    LL_MAX_TOP_K,
    LL_DEFAULT_QP_DEPTH,
    FP8_BLOCK,
    FP8_E4M3_MAX,
    FP8_AMAX_FLOOR,
    fp8_block_format,
    _align,
    DeepEPConfig,
    default_configs,
    nvl_buffer_size_hint,
    intranode_dispatch_bytes,
    intranode_combine_bytes,
    low_latency_rdma_size_hint,
    DeepEPBufferSizes,
    deepep_buffer_bytes,
    normal_mode_ep_support,
)

def deepep_wire_support(
    wire: PayloadFormat, payload: PayloadFormat, combine_dtype: torch.dtype, *, low_latency: bool
) -> Availability:
    """Can DeepEP move tokens in `wire` and hand the experts `payload`, combining in `combine_dtype`?

    DeepEP V1 moves BF16 rows, or FP8 e4m3 rows with one float32 scale per 128 values (its low-latency
    kernels quantize BF16 input to that format themselves); it combines BF16 only."""
    fix = "use dispatch dtype bf16 or fp8 (fp8_block), or a dispatcher that moves this format ('torch')"
    if combine_dtype != torch.bfloat16:
        return Availability.no(
            f"DeepEP combines BF16 only; this layer's combine dtype is {combine_dtype}",
            "build the layer with dtype=torch.bfloat16 or use the 'torch' dispatcher",
        )
    bf16 = PayloadFormat.unquantized(torch.bfloat16)
    fp8 = fp8_block_format()
    if wire not in (bf16, fp8):
        return Availability.no(
            f"DeepEP cannot move {wire.describe()} tokens: it moves BF16 or FP8 e4m3 with a float32 scale "
            "per 128 values only (NVFP4 / MXFP8 tokens are not supported by DeepEP V1)", fix,
        )
    if payload != wire and not (wire == fp8 and payload == bf16):
        return Availability.no(
            f"DeepEP delivers {wire.describe()} tokens; the experts take {payload.describe()}", fix,
        )
    return Availability.yes()


def low_latency_shape_problems(
    *, hidden_size: int, top_k: int, num_experts: int, ep_size: int, max_tokens_per_rank: int, fp8: bool
) -> List[str]:
    """What DeepEP's low-latency kernels would assert on, as messages (empty: fine)."""
    out = []
    if hidden_size not in LL_HIDDEN_SIZES:
        out.append(f"hidden_size={hidden_size} is not one DeepEP's low-latency kernels are compiled for {LL_HIDDEN_SIZES}")
    if fp8 and hidden_size % 512:
        out.append(f"FP8 low-latency dispatch needs hidden_size % 512 == 0 (got {hidden_size})")
    if top_k > LL_MAX_TOP_K:
        out.append(f"top_k={top_k} exceeds DeepEP's low-latency limit of {LL_MAX_TOP_K}")
    if num_experts % ep_size:
        out.append(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    if (ep_size * max_tokens_per_rank) % 4:
        out.append(
            f"ep_size * max_tokens_per_rank = {ep_size * max_tokens_per_rank} must be a multiple of 4 (TMA); "
            "round max_tokens_per_rank up"
        )
    return out


def required_qp_depth(max_tokens_per_rank: int) -> int:
    """DeepEP asserts NVSHMEM_QP_DEPTH >= 2 * (max_tokens + 1); rounded up to a power of two."""
    need = 2 * (max_tokens_per_rank + 1)
    return max(LL_DEFAULT_QP_DEPTH, 1 << (need - 1).bit_length())


# ---------------------------------------------------------------------------------- FP8 format
def fp8_block_quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[T, H] float -> (data [T, H] float8_e4m3fn, scales [T, H/128] float32): the cast DeepEP's
    low-latency kernels apply to BF16 input (`calculate_fp8_scales` without round_scale), replicated
    for checks of what `deepep_ll` delivers: per 1x128 block a = max(amax, 1e-4),
    scale = a * fl32(1/448), data = e4m3(x * fl32(448 / a)). Both divisions are by tensors: CUDA
    computes `t / 448.0` (a Python number) as `t * fl32(1/448)` and Python's `448.0 / t` is
    `t.reciprocal() * 448`, either of which would make CPU and GPU, or ours and DeepEP's, differ in
    the last bit.

    The normal mode (`deepep`) does not use it: there DeepEP moves the bytes it is given, and the
    dispatcher quantizes with `epmoe.quant.codec.quantize_for_wire`, as every other dispatcher and
    the float64 reference do."""
    T, H = x.shape
    if H % FP8_BLOCK:
        raise ValueError(f"FP8 block quantization needs hidden_size % {FP8_BLOCK} == 0 (got {H})")
    blocks = x.float().view(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=FP8_AMAX_FLOOR)
    e4m3_max = torch.tensor(FP8_E4M3_MAX, dtype=torch.float32, device=amax.device)
    data = (blocks * (e4m3_max / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
    return data, amax * (torch.ones_like(e4m3_max) / e4m3_max)


def fp8_block_dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data [..., H] float8_e4m3fn, scales [..., H/128] (any strides) -> [..., H] `dtype` (the format's
    one dequantization, epmoe.quant.fp8_block; DeepEP's quantization recipe differs, its layout not)."""
    from epmoe.quant import fp8_block

    return fp8_block.dequantize_activation(data, scales.float(), dtype, FP8_BLOCK)


# ---------------------------------------------------------------------------------- import, buffer
def _import_deep_ep():
    """Import DeepEP, or raise BackendUnavailableError saying why and how to fix it (also when it has
    no V1 `Buffer` with the methods this module calls)."""
    try:
        mod = importlib.import_module("deep_ep")
    except ModuleNotFoundError as e:
        if e.name in ("deep_ep", None):
            raise BackendUnavailableError("deepep", "deep_ep is not installed", INSTALL_HINT) from e
        raise BackendUnavailableError(
            "deepep", f"deep_ep is installed but failed to import ({type(e).__name__}: {e})", INSTALL_HINT
        ) from e
    except Exception as e:  # its import runs native code: any failure means "unusable here"
        raise BackendUnavailableError(
            "deepep", f"deep_ep is installed but failed to import ({type(e).__name__}: {e})", INSTALL_HINT
        ) from e
    missing = [m for m in V1_BUFFER_METHODS if not hasattr(getattr(mod, "Buffer", None), m)]
    if missing:
        raise BackendUnavailableError(
            "deepep", f"deep_ep at {getattr(mod, '__file__', '?')} has no V1 API (deep_ep.Buffer lacks {missing})",
            INSTALL_HINT)
    return mod


def _device_problem(device: torch.device) -> Optional[Availability]:
    if torch.device(device).type != "cuda":
        return Availability.no(f"DeepEP runs on CUDA GPUs; the device is {device}", "build the layer on a CUDA device")
    if not torch.cuda.is_available():
        return Availability.no("DeepEP needs a CUDA GPU and none is visible", "run on a GPU machine")
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    if major < 9:
        return Availability.no(
            f"DeepEP (built with SM90 features) needs a Hopper or newer GPU; this one is sm_{major}x",
            "use the 'torch' dispatcher on this GPU",
        )
    return None


def _availability(device: torch.device, ep_size: int, low_latency: bool) -> Availability:
    # Device first: importing deep_ep initialises its runtime, which a CPU machine (and the
    # launcher's --doctor there) must never do.
    problem = _device_problem(device)
    if problem is not None:
        import importlib.util

        if importlib.util.find_spec("deep_ep") is None:
            return Availability.no("deep_ep is not installed", INSTALL_HINT)
        return problem
    try:
        _import_deep_ep()
    except BackendUnavailableError as e:
        return Availability.no(e.reason, e.hint)
    if not low_latency:
        return normal_mode_ep_support(ep_size)
    return Availability.yes()


def _on_device(device: torch.device):
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _resolve_group(group: Any, ep_size: int, ep_rank: int) -> Any:
    """DeepEP needs a real ProcessGroup (it all-gathers IPC / NVSHMEM handles), even for one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DeepEP needs an initialised torch.distributed process group, even for one rank; call "
            "torch.distributed.init_process_group(...) before building the dispatcher"
        )
    if group is None:
        group = dist.group.WORLD
    if group.size() != ep_size or group.rank() != ep_rank:
        raise ValueError(
            f"the process group has rank {group.rank()} of {group.size()} but the spec says ep_rank={ep_rank} "
            f"of ep_size={ep_size}; pass the EP group itself"
        )
    return group


class DeepEPBuffer:
    """One DeepEP communication buffer, sized once: NVLink IPC bytes (normal mode) or NVSHMEM bytes
    (low latency). Several layers' dispatchers may share it (dispatcher option "deepep_buffer");
    construction and `close()` are collective over `group`.

    `raw` is the `deep_ep.Buffer`. A low-latency buffer also remembers the (max_tokens, hidden,
    num_experts) layout it serves: DeepEP re-derives its buffer layout from them on every call, so
    every sharer must use the same three."""

    def __init__(self, group: Any, *, low_latency: bool, sizes: DeepEPBufferSizes, device: torch.device,
                 num_qps_per_rank: int = 1, ll_layout: Optional[Tuple[int, int, int]] = None):
        deep_ep = _import_deep_ep()
        if low_latency and ll_layout is not None:
            depth = required_qp_depth(ll_layout[0])
            current = os.environ.get("NVSHMEM_QP_DEPTH")
            if current is None:
                # read by NVSHMEM at its initialisation (the first low-latency buffer of the process)
                os.environ["NVSHMEM_QP_DEPTH"] = str(depth)
            elif int(current) < 2 * (ll_layout[0] + 1):
                raise ValueError(
                    f"NVSHMEM_QP_DEPTH={current} is below what DeepEP needs for max_tokens_per_rank="
                    f"{ll_layout[0]} ({2 * (ll_layout[0] + 1)}); set NVSHMEM_QP_DEPTH={depth} before the first "
                    "DeepEP buffer is created, or lower max_tokens_per_rank"
                )
        self.group = group
        self.ep_size = group.size()
        self.low_latency = low_latency
        self.sizes = sizes
        self.ll_layout = ll_layout
        self.device = torch.device(device)
        self.raw = deep_ep.Buffer(
            group, sizes.num_nvl_bytes, sizes.num_rdma_bytes, low_latency_mode=low_latency,
            num_qps_per_rank=max(1, num_qps_per_rank), allow_nvlink_for_low_latency_mode=True,
            explicitly_destroy=True,  # no collective teardown inside a destructor (DeepEP's advice)
        )
        self.closed = False

    def check_fits(self, *, low_latency: bool, sizes: DeepEPBufferSizes, ep_size: int,
                   ll_layout: Optional[Tuple[int, int, int]]) -> None:
        mode = "low-latency" if self.low_latency else "normal"
        if self.closed:
            raise ValueError("the shared DeepEPBuffer was closed; build a new one")
        if low_latency != self.low_latency:
            raise ValueError(f"the shared DeepEPBuffer is a {mode} buffer; this dispatcher needs the other mode")
        if ep_size != self.ep_size:
            raise ValueError(f"the shared DeepEPBuffer spans {self.ep_size} ranks; this dispatcher has ep_size={ep_size}")
        if sizes.num_nvl_bytes > self.sizes.num_nvl_bytes or sizes.num_rdma_bytes > self.sizes.num_rdma_bytes:
            raise ValueError(
                f"the shared DeepEPBuffer ({self.sizes}) is smaller than this dispatcher needs ({sizes}); "
                "build the buffer from the largest layer"
            )
        if low_latency and ll_layout != self.ll_layout:
            raise ValueError(
                f"the shared low-latency DeepEPBuffer serves (max_tokens, hidden, num_experts)={self.ll_layout}; "
                f"this dispatcher has {ll_layout}; low-latency sharers must agree on all three"
            )

    def close(self) -> None:
        """Collective: every rank of the group must call it."""
        if not self.closed:
            self.closed = True
            self.raw.destroy()

    def __repr__(self) -> str:  # identical on every rank (dispatcher options may be fingerprinted)
        return (
            f"DeepEPBuffer(low_latency={self.low_latency}, ep_size={self.ep_size}, "
            f"nvl_bytes={self.sizes.num_nvl_bytes}, rdma_bytes={self.sizes.num_rdma_bytes})"
        )


# ---------------------------------------------------------------------------------- handles
@dataclass(frozen=True, eq=False)
class DeepEPHandle(DispatchHandle):
    """raw: DeepEP's own handle (opaque here; only DeepEP's combine reads it); num_recv_tokens: rows
    this rank received; recv_tokens_per_expert: rows per local expert; combine_bytes: payload bytes
    combine sends to other ranks; padded: the call had no tokens and sent one all-(-1) dummy row."""

    raw: Any = None
    num_recv_tokens: int = 0
    recv_tokens_per_expert: Tuple[int, ...] = ()
    combine_bytes: int = 0
    padded: bool = False
    recv_topk_ids: Optional[torch.Tensor] = None  # [N, K] received local ids (-1 elsewhere): masks the weights' gradient


@dataclass(frozen=True, eq=False)
class DeepEPLowLatencyHandle(DispatchHandle):
    """raw: DeepEP's low-latency handle; topk_idx [T, K] int64 / topk_weights [T, K] float32: the
    sender's routing, which DeepEP's combine uses to weight and sum; combine_bytes: bytes combine
    sends to other ranks (-1 when not counted)."""

    raw: Any = None
    topk_idx: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    combine_bytes: int = 0
    padded: bool = False


# ---------------------------------------------------------------------------------- dispatchers
@dataclass(frozen=True)
class DeepEPOptions(BackendOptions):
    """check_inputs: validate and agree on inputs when used standalone (EPMoE passes its agreement);
    count_bytes: exact byte counters (one sync); deepep_buffer: a DeepEPBuffer shared with other
    layers; num_sms: SMs for normal-mode kernels."""

    check_inputs: bool = True
    count_bytes: bool = True
    deepep_buffer: Any = None
    num_sms: int = 20


class _DeepEPBase(Dispatcher):
    low_latency: ClassVar[bool] = False
    wires = ("bf16", "fp8")
    Options = DeepEPOptions
    # DeepEP's kernels spin on the GPU for peers' tokens too; their own in-kernel timeout (a device
    # trap after ~100 s, fixed at build time) leaves no FaultReport and ignores timeout_s
    waits_on_device = True

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        if request.arch in ("cpu", "sm80"):
            return Availability.no(
                f"DeepEP needs Hopper or newer CUDA GPUs, the plan's arch is {request.arch}",
                "use dispatcher 'torch' here",
            )
        if not request.has("deep_ep"):
            return Availability.no("deep_ep is not installed", INSTALL_HINT)
        if request.model_dtype != "bfloat16":
            return Availability.no(f"DeepEP moves and combines BF16 only; the model dtype is {request.model_dtype}")
        if request.wire not in cls.wires:
            return Availability.no(
                f"DeepEP moves bf16 or fp8 (1x128 e4m3) tokens, not {request.wire} (no NVFP4 in DeepEP V1)",
                "use dispatch dtype 'auto', 'bf16' or 'fp8', or dispatcher 'torch' / 'flashinfer' for nvfp4",
            )
        if not cls.low_latency:
            return normal_mode_ep_support(request.ep_size)
        problems = low_latency_shape_problems(
            hidden_size=request.hidden_size, top_k=request.top_k, num_experts=request.num_experts,
            ep_size=request.ep_size, max_tokens_per_rank=4, fp8=request.wire == "fp8",
        )
        if problems:
            return Availability.no("DeepEP's low-latency kernels cannot run this layer: " + "; ".join(problems),
                                   "use dispatcher 'deepep' (normal mode) or 'torch'")
        return Availability.yes()

    @classmethod
    def availability(cls, device: torch.device, ep_size: int = 1, shared_gpu: bool = False) -> Availability:
        return _availability(device, ep_size, cls.low_latency)

    def __init__(self, spec: DispatchSpec):
        super().__init__(spec)
        avail = type(self).availability(spec.device, spec.ep_size, spec.shared_gpu)
        if not avail:
            raise BackendUnavailableError(self.name, avail.reason, avail.hint)
        ok = deepep_wire_support(spec.wire_format, spec.payload, spec.combine_dtype, low_latency=self.low_latency)
        if not ok:
            raise ValueError(f"dispatcher {self.name!r}: {ok.reason}; {ok.hint}")
        self._deep_ep = _import_deep_ep()
        self._group = _resolve_group(spec.group, spec.ep_size, spec.ep_rank)
        self._wire = spec.wire_format
        self._fp8 = self._wire.is_quantized
        self._check = bool(self.options.check_inputs)
        self._count = bool(self.options.count_bytes)
        self._device = torch.device(spec.device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._buffer: Optional[DeepEPBuffer] = None
        self._owns_buffer = False

    def _attach_buffer(self, sizes: DeepEPBufferSizes, num_qps: int, ll_layout=None) -> None:
        s = self.spec
        if s.workspace_bytes is not None:
            need = sizes.num_rdma_bytes if self.low_latency else sizes.num_nvl_bytes
            if s.workspace_bytes < need:
                raise ValueError(
                    f"workspace_bytes={s.workspace_bytes} is below what DeepEP needs for this layer ({need}); "
                    "size the plan's workspace with epmoe.dispatch.deepep.deepep_buffer_bytes"
                )
            given = _align(s.workspace_bytes, BUFFER_ALIGNMENT_BYTES)
            sizes = DeepEPBufferSizes(num_rdma_bytes=given) if self.low_latency else DeepEPBufferSizes(num_nvl_bytes=given)
        shared = self.options.deepep_buffer
        if shared is not None:
            if not isinstance(shared, DeepEPBuffer):
                raise TypeError(f"option deepep_buffer is a {type(shared).__name__}; pass a DeepEPBuffer")
            shared.check_fits(low_latency=self.low_latency, sizes=sizes, ep_size=s.ep_size, ll_layout=ll_layout)
            self._buffer = shared
            return
        with _on_device(self._device):  # DeepEP allocates on the current device
            self._buffer = DeepEPBuffer(
                self._group, low_latency=self.low_latency, sizes=sizes, device=self._device,
                num_qps_per_rank=num_qps, ll_layout=ll_layout,
            )
        self._owns_buffer = True

    @property
    def buffer(self) -> DeepEPBuffer:
        """The DeepEP buffer in use (share it with other layers through option "deepep_buffer")."""
        return self._buffer

    def close(self) -> None:
        """Collective when this dispatcher owns its buffer (destroys it on every rank)."""
        if self._owns_buffer and self._buffer is not None:
            self._buffer.close()
        self._buffer = None

    # --------------------------------------------------------------- checks (agreed across ranks)
    def _validate(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        error: Optional[BaseException] = None
        try:
            if not isinstance(hidden, torch.Tensor):
                raise TypeError(f"hidden is a {type(hidden).__name__}; DeepEP dispatchers take the model-dtype tensor")
            self.check_inputs(hidden, topk_ids, topk_weights)
            if hidden.dtype != torch.bfloat16:
                raise TypeError(f"hidden has dtype {hidden.dtype}; DeepEP dispatchers take torch.bfloat16 tokens")
            if hidden.device != self._device:
                raise ValueError(f"hidden is on {hidden.device}; this dispatcher's DeepEP buffer is on {self._device}")
            if self._device.type == "cuda" and torch.cuda.current_device() != self._device.index:
                raise ValueError(
                    f"the current CUDA device is {torch.cuda.current_device()} but the DeepEP buffer is on "
                    f"{self._device} (DeepEP allocates its outputs on the current device); call "
                    f"torch.cuda.set_device({self._device.index}) first"
                )
            E = self.spec.num_experts
            if topk_ids.numel() and bool(((topk_ids < -1) | (topk_ids >= E)).any()):
                bad = topk_ids[(topk_ids < -1) | (topk_ids >= E)]
                raise ValueError(
                    f"topk_ids holds expert id {int(bad[0])} outside [0, {E}) (-1 marks 'no expert'); "
                    "fix the router output or num_experts"
                )
        except (ValueError, TypeError) as e:
            error = e
        flags = edist.gather_ints([0 if error is None else 1], self._group)
        failed = [r for r in range(flags.shape[0]) if flags[r, 0]]
        edist.raise_if_any_failed(error, failed, self._group)

    def _prepare(self, hidden, topk_ids, topk_weights, agreement=None):
        """-> (x, topk_idx int64, weights f32, padded). An empty call sends one dummy row routed
        nowhere (-1 everywhere), so DeepEP never launches on zero tokens. With the layer's
        `agreement` the inputs were checked and agreed already: no second collective."""
        if self._check and (agreement is None or not agreement.inputs_checked):
            self._validate(hidden, topk_ids, topk_weights)
        padded = hidden.shape[0] == 0
        if padded:
            K = self.spec.top_k
            hidden = torch.zeros(1, self.spec.hidden_size, dtype=hidden.dtype, device=hidden.device)
            topk_ids = torch.full((1, K), -1, dtype=torch.int64, device=hidden.device)
            topk_weights = torch.zeros(1, K, dtype=torch.float32, device=hidden.device)
        idx = topk_ids.to(self._deep_ep.topk_idx_t).contiguous()  # int32 at our boundary, int64 in DeepEP
        return hidden.contiguous(), idx, topk_weights.to(torch.float32).contiguous(), padded

    def _deliver(self, hidden) -> Any:
        """Hand the experts their payload: dequantize FP8 on arrival if they take BF16."""
        if isinstance(hidden, QuantizedActivation) and not self.spec.payload.is_quantized:
            return fp8_block_dequantize(hidden.data, hidden.scales, self.spec.payload.dtype)
        return hidden

    def _count_format(self, rows: int, payload_bytes: int, routing_bytes: int) -> None:
        fmt = self.stats.by_format.setdefault(self._wire.name, {"payload": 0, "routing": 0})
        fmt["payload"] += rows * payload_bytes
        fmt["routing"] += rows * routing_bytes


class DeepEPDispatcher(_DeepEPBase):
    """DeepEP normal mode (intranode, ep_size 2/4/8): get_dispatch_layout -> dispatch -> combine,
    DeepEP's handle reused by combine. The received top-k ids are local (-1 elsewhere), weights 0
    where the id is -1 (DeepEP's convention)."""

    name = "deepep"
    layout = "flat"
    low_latency = False

    @classmethod
    def supports_training(cls, request: BackendRequest) -> Availability:
        """DeepEP's own backward contract (as Megatron-Core's MoE training uses it): a dispatch's
        backward is a combine with the same handle (the received rows' gradients summed per source
        token, the weights' gradients with them); a combine's backward is a cached dispatch."""
        if request.model_dtype != "bfloat16":
            return Availability.no(
                f"dispatcher 'deepep' trains bf16 models only (DeepEP moves and sums BF16), the model dtype is "
                f"{request.model_dtype}", "train in bfloat16, or use dispatcher 'torch' for float32 / float64")
        if request.wire != "bf16":
            return Availability.no(
                f"dispatcher 'deepep' trains with bf16 tokens only, not a {request.wire} wire (quantized wires "
                "are inference-only)", "use dispatch dtype 'auto' or 'bf16' for training")
        ep_ok = normal_mode_ep_support(request.ep_size)
        if not ep_ok:
            return ep_ok
        return Availability.yes("DeepEP's normal kernels: dispatch backward = combine, combine backward = cached dispatch")

    def __init__(self, spec: DispatchSpec):
        super().__init__(spec)
        num_sms = int(self.options.num_sms)
        self._configs = default_configs(spec.ep_size, num_sms)
        if self._fp8 and spec.hidden_size % FP8_BLOCK:
            raise ValueError(f"FP8 dispatch needs hidden_size % {FP8_BLOCK} == 0 (got {spec.hidden_size})")
        if (spec.hidden_size * 2) % 16:
            raise ValueError(f"DeepEP needs hidden_size * 2 bytes to be a multiple of 16 (hidden_size={spec.hidden_size})")
        sizes = deepep_buffer_bytes(
            low_latency=False, hidden_size=spec.hidden_size, ep_size=spec.ep_size,
            num_experts=spec.num_experts, top_k=spec.top_k, max_tokens_per_rank=spec.max_tokens_per_rank,
            wire=self._wire, configs=self._configs,
        )
        self._attach_buffer(sizes, num_qps=1)
        self._dispatch_config = self._configs[0].to_deep_ep(self._deep_ep)
        self._combine_config = self._configs[1].to_deep_ep(self._deep_ep)

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 *, agreement: Optional[Agreement] = None):
        s = self.spec
        T = hidden.shape[0]
        x, idx, w, padded = self._prepare(hidden, topk_ids, topk_weights, agreement)
        buf = self._buffer.raw
        n_per_rank, _, n_per_expert, in_rank, _ = buf.get_dispatch_layout(idx, s.num_experts)
        if self._fp8:
            # the one quantizer of the torch / FlashInfer dispatchers and the float64 reference, so the
            # FP8 rows DeepEP delivers are those bytes; DeepEP moves data and scales as given
            q = codec.quantize_for_wire(x, self._wire)
            x_in: Any = (q.data, q.scales)
        else:
            x_in = x
        recv_x, recv_idx, recv_w, per_expert, raw, _ = buf.dispatch(
            x_in, num_tokens_per_rank=n_per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_per_expert,
            topk_idx=idx, topk_weights=w, config=self._dispatch_config,
        )
        if self._fp8:
            recv_hidden: Any = QuantizedActivation(
                format=self._wire, data=recv_x[0], scales=recv_x[1], hidden_size=s.hidden_size
            )
            num_recv = recv_x[0].shape[0]
        else:
            recv_hidden, num_recv = recv_x, recv_x.shape[0]
        sent, combine_bytes = 0, 0
        payload_bytes = self._wire.bytes_per_token(s.hidden_size)
        if self._count:
            per_rank = n_per_rank.tolist()  # DeepEP already synchronised the host for its counts
            me = s.ep_rank
            sent = sum(per_rank) - per_rank[me]
            combine_bytes = (num_recv - per_rank[me]) * s.hidden_size * 2
            routing_bytes = s.top_k * (TOPK_IDX_BYTES + 4) + 4  # ids, weights, source index
            self.stats.dispatch_bytes_sent += sent * (payload_bytes + routing_bytes)
            self.stats.tokens_sent += sent
            self._count_format(sent, payload_bytes, routing_bytes)
        self.stats.dispatch_calls += 1
        handle = DeepEPHandle(
            num_tokens=T, bytes_sent=sent * payload_bytes, raw=raw, num_recv_tokens=num_recv,
            recv_tokens_per_expert=tuple(per_expert), combine_bytes=combine_bytes, padded=padded,
            recv_topk_ids=recv_idx,
        )
        tokens = DispatchedTokens(
            hidden=self._deliver(recv_hidden), topk_ids=recv_idx.to(torch.int32), topk_weights=recv_w, layout="flat"
        )
        return tokens, handle

    def combine(self, expert_output: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        s = self.spec
        if not isinstance(handle, DeepEPHandle):
            raise TypeError(f"handle is a {type(handle).__name__}; pass the DeepEPHandle that dispatch returned")
        if tuple(expert_output.shape) != (handle.num_recv_tokens, s.hidden_size):
            raise ValueError(
                f"expert_output has shape {list(expert_output.shape)}; expected "
                f"[{handle.num_recv_tokens}, {s.hidden_size}] (one row per received token)"
            )
        y = expert_output.to(torch.bfloat16).contiguous()
        out, _, _ = self._buffer.raw.combine(y, handle.raw, config=self._combine_config)
        self.stats.combine_bytes_sent += handle.combine_bytes
        return out[:0] if handle.padded else out

    # ------------------------------------------------------------------ backward (training)
    def _backward_handle(self, handle) -> DeepEPHandle:
        if not isinstance(handle, DeepEPHandle):
            raise TypeError(f"handle is a {type(handle).__name__}; pass the DeepEPHandle that dispatch returned")
        if self._fp8:
            raise RuntimeError("dispatcher 'deepep' with an fp8 wire has no backward (quantized wires are "
                               "inference-only); build the layer with dispatch dtype 'bf16' for training")
        return handle

    def dispatch_backward(self, grad_hidden: torch.Tensor, grad_weights: Optional[torch.Tensor],
                          handle: DeepEPHandle) -> Tuple[torch.Tensor, torch.Tensor]:
        """DeepEP's combine with dispatch's handle: each received row's gradient goes back to its source
        token and the copies on the ranks it went to are summed (fp32, rounded to BF16 once); the
        weights' gradients travel along (DeepEP sums them per slot; only the rank holding a slot's
        expert sends a non-zero one)."""
        h = self._backward_handle(handle)
        s = self.spec
        N, K = grad_hidden.shape[0], s.top_k
        if grad_weights is None:
            grad_weights = torch.zeros(N, K, dtype=torch.float32, device=grad_hidden.device)
        # a slot whose expert is elsewhere carries no gradient from here
        gw = grad_weights.to(torch.float32).masked_fill(h.recv_topk_ids < 0, 0.0)
        gx, gw_back, _ = self._buffer.raw.combine(grad_hidden.to(torch.bfloat16).contiguous(), h.raw,
                                                  topk_weights=gw.contiguous(), config=self._combine_config)
        self.stats.combine_bytes_sent += h.combine_bytes
        if h.padded:
            return gx[:0], gw_back[:0]
        return gx, gw_back

    def combine_backward(self, grad_out: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        """DeepEP's cached dispatch (dispatch's handle, no layout pass): each token's output gradient
        goes to every rank its row went to, in the received rows' order."""
        h = self._backward_handle(handle)
        g = grad_out.to(torch.bfloat16)
        if h.padded:  # the forward sent one dummy row routed nowhere: so does its backward
            g = torch.zeros(1, self.spec.hidden_size, dtype=torch.bfloat16, device=grad_out.device)
        recv, _, _, _, _, _ = self._buffer.raw.dispatch(g.contiguous(), handle=h.raw, config=self._dispatch_config)
        self.stats.dispatch_bytes_sent += h.bytes_sent
        return recv


class DeepEPLowLatencyDispatcher(_DeepEPBase):
    """DeepEP low-latency mode: low_latency_dispatch -> masked [E_local, ep * M, H] tokens with
    per-expert counts -> low_latency_combine (weights applied there). M = max_tokens_per_rank."""

    name = "deepep_ll"
    no_training_reason = "DeepEP's low-latency kernels are decode (inference) kernels without a backward"
    layout = "masked"
    low_latency = True

    @classmethod
    def wire_roundtrip(cls, x: torch.Tensor, wire, dtype: torch.dtype) -> torch.Tensor:
        """DeepEP's low-latency kernels cast BF16 tokens to FP8 themselves (`fp8_block_quantize`
        replicates it: a multiplication by fl32(448 / amax), where epmoe's codec divides by the scale),
        so an FP8 wire here is that cast; a value on an e4m3 rounding tie can land on the other side."""
        if wire.is_quantized and x.shape[0]:
            return fp8_block_dequantize(*fp8_block_quantize(x), dtype=dtype)
        return super().wire_roundtrip(x, wire, dtype)

    def __init__(self, spec: DispatchSpec):
        super().__init__(spec)
        problems = low_latency_shape_problems(
            hidden_size=spec.hidden_size, top_k=spec.top_k, num_experts=spec.num_experts,
            ep_size=spec.ep_size, max_tokens_per_rank=spec.max_tokens_per_rank, fp8=self._fp8,
        )
        if problems:
            raise ValueError("DeepEP low-latency kernels cannot run this layer: " + "; ".join(problems))
        M = spec.max_tokens_per_rank
        sizes = deepep_buffer_bytes(
            low_latency=True, hidden_size=spec.hidden_size, ep_size=spec.ep_size, num_experts=spec.num_experts,
            top_k=spec.top_k, max_tokens_per_rank=M,
        )
        # DeepEP: the low-latency mode wants one QP per local expert
        self._attach_buffer(sizes, num_qps=spec.num_local_experts, ll_layout=(M, spec.hidden_size, spec.num_experts))

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 *, agreement: Optional[Agreement] = None):
        s = self.spec
        T = hidden.shape[0]
        x, idx, w, padded = self._prepare(hidden, topk_ids, topk_weights, agreement)
        recv_x, recv_count, raw, _, _ = self._buffer.raw.low_latency_dispatch(
            x, idx, s.max_tokens_per_rank, s.num_experts, use_fp8=self._fp8,
            async_finish=False, return_recv_hook=False,
        )
        if self._fp8:
            # scales keep DeepEP's strides ([E_local, M', H/128] viewed from a column-major buffer)
            recv_hidden: Any = QuantizedActivation(
                format=self._wire, data=recv_x[0], scales=recv_x[1], hidden_size=s.hidden_size
            )
        else:
            recv_hidden = recv_x
        sent, combine_bytes = 0, -1
        msg_bytes = self._wire.bytes_per_token(s.hidden_size)
        if self._count:
            valid = idx >= 0
            remote = valid & (torch.div(idx, s.num_local_experts, rounding_mode="floor") != s.ep_rank)
            counts = torch.stack([remote.sum(), (valid & ~remote).sum(), recv_count.sum().to(torch.int64)]).tolist()
            sent = counts[0]  # one message per (token, remote expert): DeepEP sends per expert
            combine_bytes = (counts[2] - counts[1]) * s.hidden_size * 2
            self.stats.dispatch_bytes_sent += sent * msg_bytes
            self.stats.tokens_sent += sent
            self._count_format(sent, msg_bytes, 0)
        self.stats.dispatch_calls += 1
        handle = DeepEPLowLatencyHandle(
            num_tokens=T, bytes_sent=sent * msg_bytes, raw=raw, topk_idx=idx, topk_weights=w,
            combine_bytes=combine_bytes, padded=padded,
        )
        tokens = DispatchedTokens(
            hidden=self._deliver(recv_hidden), topk_ids=None, topk_weights=None, layout="masked",
            expert_counts=recv_count,
        )
        return tokens, handle

    def combine(self, expert_output: torch.Tensor, handle: DeepEPLowLatencyHandle) -> torch.Tensor:
        s = self.spec
        if not isinstance(handle, DeepEPLowLatencyHandle):
            raise TypeError(f"handle is a {type(handle).__name__}; pass the DeepEPLowLatencyHandle that dispatch returned")
        shape = (s.num_local_experts, s.ep_size * s.max_tokens_per_rank, s.hidden_size)
        if tuple(expert_output.shape) != shape:
            raise ValueError(
                f"expert_output has shape {list(expert_output.shape)}; expected {list(shape)} "
                "([E_local, ep_size * max_tokens_per_rank, H], the masked layout)"
            )
        y = expert_output.to(torch.bfloat16).contiguous()
        out, _, _ = self._buffer.raw.low_latency_combine(
            y, handle.topk_idx, handle.topk_weights, handle.raw, async_finish=False, return_recv_hook=False,
        )
        if handle.combine_bytes > 0:
            self.stats.combine_bytes_sent += handle.combine_bytes
        return out[:0] if handle.padded else out


__all__ = [
    "DeepEPBuffer",
    "DeepEPBufferSizes",
    "DeepEPConfig",
    "DeepEPDispatcher",
    "DeepEPHandle",
    "DeepEPLowLatencyDispatcher",
    "DeepEPLowLatencyHandle",
    "deepep_buffer_bytes",
    "deepep_wire_support",
    "default_configs",
    "fp8_block_dequantize",
    "fp8_block_format",
    "fp8_block_quantize",
    "intranode_combine_bytes",
    "intranode_dispatch_bytes",
    "low_latency_rdma_size_hint",
    "low_latency_shape_problems",
    "normal_mode_ep_support",
    "nvl_buffer_size_hint",
    "required_qp_depth",
]
