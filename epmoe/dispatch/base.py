"""The dispatcher contract every backend implements.

    tokens, handle = dispatcher.dispatch(hidden [T, H], topk_ids [T, K] int32, topk_weights [T, K] f32)
    expert_out [N, H]  = experts(tokens)     # weighted sum over the local experts of each received token
    out [T, H]         = dispatcher.combine(expert_out, handle)

`topk_ids` are global expert ids, int32, with -1 meaning "no expert" (padding). A dispatcher sends each
token once to every rank that owns at least one of its experts; the receiver sees the token's top-k
with *local* ids (-1 where the expert lives elsewhere) and the matching weights. `combine` sums the
partial outputs of a token over ranks, in rank order (deterministic where the backend allows it).

Every call returns its own handle: a dispatcher keeps no per-call state.

Training (docs/training.md): a dispatcher that trains (`supports_training` says yes) also implements

    grad_hidden [T, H], grad_weights [T, K] = dispatcher.dispatch_backward(grad_recv_hidden [N, H],
                                                                           grad_recv_weights [N, K], handle)
    grad_expert_out [N, H]                  = dispatcher.combine_backward(grad_out [T, H], handle)

dispatch's backward is a combine (rows travel back along the reverse route and are summed per source
token), combine's backward is a dispatch (each token's gradient goes to every rank it was sent to), on
the same group. `epmoe.dispatch.autograd` wraps both as autograd Functions.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest, NoOptions
from epmoe.quant.payload import Activations, PayloadFormat

LAYOUTS = ("flat", "masked")


@dataclass(frozen=True)
class DispatchSpec:
    """Everything a dispatcher needs at construction; identical on every rank of the group.

    max_tokens_per_rank: the most tokens one rank sends in one dispatch call (per source rank);
                         the layer chunks larger batches. Workspaces are sized from it.
    payload:             what the experts backend consumes (`PayloadFormat`)
    wire:                how tokens travel, if different from `payload` (e.g. NVFP4 on the wire,
                         dequantized on arrival for an experts backend that takes BF16)
    combine_dtype:       dtype of expert outputs on the way back (the model dtype)
    workspace_bytes:     optional pre-computed workspace size (quant plan); backends may ignore it
    timeout_s:           wait at most this long for a collective (host-blocking backends such as gloo;
                         None: block). Raise epmoe.core.fault.CollectiveTimeoutError past it.
    static_shapes:       CUDA-graph mode: every call has exactly max_tokens_per_rank rows (padding rows
                         have all ids -1), buffers keep their shapes and nothing syncs with the host
    shared_gpu:          several ranks of the group run on ONE GPU (explicit opt-in, docs/shared-gpu.md):
                         the group is gloo (NCCL refuses duplicate devices), backends that check for a
                         link between GPUs skip that check, and nothing measured in this mode says
                         anything about a link
    options:             the backend's typed options (`cls.Options`; a tuple of pairs is parsed)
    """

    group: Any  # torch.distributed ProcessGroup or None for a single process
    ep_rank: int
    ep_size: int
    num_experts: int
    top_k: int
    hidden_size: int
    max_tokens_per_rank: int
    payload: PayloadFormat
    combine_dtype: torch.dtype
    device: torch.device
    deterministic: bool = False
    workspace_bytes: Optional[int] = None
    wire: Optional[PayloadFormat] = None
    timeout_s: Optional[float] = None
    static_shapes: bool = False
    shared_gpu: bool = False
    options: Any = ()

    @property
    def wire_format(self) -> PayloadFormat:
        return self.payload if self.wire is None else self.wire

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def option(self, name: str, default: Any = None) -> Any:
        if isinstance(self.options, BackendOptions):
            return getattr(self.options, name, default)
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class Agreement:
    """What the layer agreed on for one dispatch round, handed to the dispatcher so it does not
    agree a second time: tokens_per_rank[r] = rows rank r dispatches in this round; inputs_checked:
    shapes, dtypes and expert-id ranges were validated and agreed (no rank has a bad input);
    want_bytes: the caller reads `handle.bytes_sent` (False lets a backend skip a device sync for it)."""

    tokens_per_rank: tuple
    inputs_checked: bool = True
    want_bytes: bool = True

    @property
    def max_tokens(self) -> int:
        return max(self.tokens_per_rank) if self.tokens_per_rank else 0


@dataclass(frozen=True)
class DispatchedTokens:
    """What a rank receives.

    layout "flat":    hidden [N, H] (tensor or QuantizedActivation), topk_ids [N, K] int32 local ids
                      (-1: not on this rank), topk_weights [N, K] float32.
    layout "masked":  hidden [E_local, M, H] per-expert slots, expert_counts [E_local] int32 valid rows
                      per expert; topk_ids / topk_weights are None (weights applied in combine).
    """

    hidden: Activations
    topk_ids: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    layout: str = "flat"
    expert_counts: Optional[torch.Tensor] = None
    static: bool = False  # fixed row count with padding rows (ids -1): experts must not sync with the host

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]


@dataclass(frozen=True)
class DispatchHandle:
    """Per-call state that `combine` consumes. Backends subclass it (frozen dataclasses).

    num_tokens: T of the dispatching rank; bytes_sent: payload bytes this rank sent to *other*
    ranks in dispatch (combine adds its own in `combine_bytes_sent` of the stats)."""

    num_tokens: int
    bytes_sent: int = 0


@dataclass
class DispatcherStats:
    """Cumulative counters (not per-call state): bytes this rank sent to other ranks."""

    dispatch_calls: int = 0
    dispatch_bytes_sent: int = 0
    combine_bytes_sent: int = 0
    tokens_sent: int = 0
    by_format: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.dispatch_calls = self.dispatch_bytes_sent = self.combine_bytes_sent = 0
        self.tokens_sent = 0
        self.by_format = {}


class Dispatcher(abc.ABC):
    """Base class. Subclasses set `name`, implement `dispatch`/`combine`, and may override
    `availability` (checked before construction: optional packages are imported there or in
    `__init__`, never at module import)."""

    name: ClassVar[str] = "?"
    layout: ClassVar[str] = "flat"
    wires: ClassVar[tuple] = ("bf16",)  # dispatch dtypes it can move
    Options: ClassVar[type] = NoOptions
    # True: its kernels wait on the GPU for peers' tokens (one-sided all-to-all), where no host timeout
    # reaches; EPMoE then arms the watchdog (epmoe/core/watchdog.py) around dispatch..combine
    waits_on_device: ClassVar[bool] = False
    # why this dispatcher refuses training (`supports_training`); a dispatcher that trains overrides
    # `supports_training` and implements dispatch_backward / combine_backward
    no_training_reason: ClassVar[str] = "its all-to-all has no backward in epmoe (inference only)"

    @property
    def keeps_routing(self) -> bool:
        """True: with the layer's agreement (`Agreement.inputs_checked`), dispatch hands the experts the
        caller's own topk_ids tensor (one rank, no copy), so what the layer computed from those ids
        (an expert alignment fused into the routing launch) holds for the received ones."""
        return False

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        """Can this dispatcher move `request.wire` tokens on `request.arch` (static facts only)?"""
        if request.wire not in cls.wires:
            return Availability.no(
                f"it moves {'/'.join(cls.wires)} tokens, not {request.wire}",
                f"use dispatch dtype 'auto' or one of {cls.wires}, or another dispatcher",
            )
        return Availability.yes()

    @classmethod
    def wire_roundtrip(cls, x: torch.Tensor, wire: PayloadFormat, dtype: torch.dtype) -> torch.Tensor:
        """Tokens x [N, H] as the receiving experts see them after this dispatcher's `wire` quantization,
        in `dtype` (the float reference models the wire with it). Default: epmoe's own codec, which
        every dispatcher that quantizes before sending uses; one whose kernels cast the tokens
        themselves (DeepEP low latency) overrides it with that cast."""
        from epmoe.quant import codec

        return codec.roundtrip_for_wire(x, wire, dtype)

    @classmethod
    def supports_training(cls, request: BackendRequest) -> Availability:
        """Can gradients flow back through this dispatcher for `request` (static facts only)? The layer
        asks before any rank computes (docs/training.md); default: no, with `no_training_reason`."""
        return Availability.no(f"dispatcher {cls.name!r} does not train: {cls.no_training_reason}",
                               "use dispatcher 'torch' (gloo or NCCL) for training")

    def __init__(self, spec: DispatchSpec):
        self.options = type(self).Options.parse(spec.options, f"dispatcher {self.name!r}")
        if spec.num_experts % spec.ep_size:
            raise ValueError(
                f"num_experts={spec.num_experts} is not divisible by ep_size={spec.ep_size}; "
                "choose an EP size that divides the expert count"
            )
        self.spec = spec
        self.stats = DispatcherStats()

    @classmethod
    def availability(cls, device: torch.device, ep_size: int = 1, shared_gpu: bool = False) -> Availability:
        """Can this backend run `ep_size` ranks on `device`? `shared_gpu`: the ranks share one GPU."""
        return Availability.yes()

    @abc.abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        *, agreement: Optional[Agreement] = None,
    ) -> "tuple[DispatchedTokens, DispatchHandle]":
        """`agreement`: what the caller (the layer) already agreed on for this call; when given the
        dispatcher neither validates nor agrees again. None: standalone use, it does both itself."""
        ...

    @abc.abstractmethod
    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        ...

    def dispatch_backward(self, grad_hidden: torch.Tensor, grad_weights: Optional[torch.Tensor],
                          handle: DispatchHandle) -> "tuple[torch.Tensor, torch.Tensor]":
        """The gradient of `dispatch` (collective): grad_hidden [N, H] of the received rows (model dtype)
        and grad_weights [N, K] of their weights (None: zero) -> (grad of hidden [T, H] in the model
        dtype, grad of topk_weights [T, K] float32 (float64 for a float64 model))."""
        raise NotImplementedError(f"dispatcher {self.name!r} has no backward: {self.no_training_reason}")

    def combine_backward(self, grad_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """The gradient of `combine` (collective): grad_out [T, H] -> grad of expert_output [N, H]."""
        raise NotImplementedError(f"dispatcher {self.name!r} has no backward: {self.no_training_reason}")

    def close(self) -> None:
        """Release workspaces (collective for backends with symmetric memory)."""

    # ----------------------------------------------------------- shared checks
    def check_inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Shape/dtype checks that need no device sync. Raises ValueError/TypeError naming the value."""
        s = self.spec
        if hidden.dim() != 2 or hidden.shape[1] != s.hidden_size:
            raise ValueError(
                f"hidden has shape {list(hidden.shape)}; expected [num_tokens, {s.hidden_size}]"
            )
        T = hidden.shape[0]
        if T > s.max_tokens_per_rank:
            raise ValueError(
                f"dispatch of {T} tokens exceeds max_tokens_per_rank={s.max_tokens_per_rank}; "
                "chunk the batch (EPMoE does) or build the dispatcher with a larger limit"
            )
        if topk_ids.shape != (T, s.top_k):
            raise ValueError(f"topk_ids has shape {list(topk_ids.shape)}; expected [{T}, {s.top_k}]")
        if topk_weights.shape != (T, s.top_k):
            raise ValueError(
                f"topk_weights has shape {list(topk_weights.shape)}; expected [{T}, {s.top_k}]"
            )
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected torch.int32")
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; expected torch.float32")
