"""`EPMoE`: one expert-parallel MoE layer. Its forward is visibly

    route -> dispatch -> experts -> combine

over the ranks of an EP process group. Each rank may pass a different number of tokens (0 too);
a batch above `max_num_tokens_per_rank` runs in rounds that all ranks agree on.

Built with `training=True` (or a `TrainingConfig`), a forward with gradients enabled is differentiable:
dispatch and combine become autograd Functions whose backward is the reverse all-to-all, the experts
run their `train_forward`, and the routing weights are recomputed from the logits with autograd
(docs/training.md). Under torch.no_grad / inference_mode nothing changes: the same path, bits and cost.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from epmoe.checkpoint import Source, load_expert_weights
from epmoe.config import MoEConfig, dtype_name
from epmoe.core import dist as edist
from epmoe.core.errors import BackendUnavailableError, NonFiniteError
from epmoe.core.fault import FaultWatch
from epmoe.core.placement import Placement
from epmoe.core import watchdog as _watchdog
from epmoe.dispatch import DISPATCHERS, Agreement, Dispatcher, DispatchSpec
from epmoe.eplb.balancer import ExpertBalancer, RebalanceReport
from epmoe.eplb.config import EPLBConfig, slot_config as eplb_slot_config
from epmoe.eplb.load import ExpertLoad
from epmoe.eplb.planner import initial_placement
from epmoe.experts import EXPERTS, Experts, ExpertsSpec
from epmoe.quant.payload import PayloadFormat
from epmoe.quant.checkpoint_formats import check_fits_plan
from epmoe.quant.plan import QuantPlan
from epmoe.resolve import detect_environment, resolve_plan
from epmoe.quant.weights import ExpertWeights
from epmoe.routing import Router, Routing, routing_weights
from epmoe.core.availability import Availability
from epmoe.core.capability import BackendRequest

DEFAULT_MAX_TOKENS_PER_RANK = 4096
_LAYER_IDS = itertools.count()  # names layers for fault reports; all ranks build layers in one order


@dataclass(frozen=True)
class TrainingConfig:
    """How an EPMoE trains (docs/training.md).

    recompute_experts: save only the received tokens (hidden, ids, weights) for backward and recompute
                       the local experts' activations there (torch.utils.checkpoint around the experts
                       stage; no collective is recomputed). False: the experts backend saves what its
                       backward reads (reference: per expert its input rows, FC1 output and activation;
                       grouped_mm: the sorted rows, FC1 output and activation).
    fp32_grad_accumulation: expert parameters held in bf16 / fp16 accumulate their gradients in fp32:
                       each backward's gradient is added to `param.main_grad` (float32, same shape)
                       and `param.grad` is left None (Megatron's convention); the trainer steps from
                       `main_grad` and clears it with `EPMoE.zero_main_grad()`. Parameters in float32
                       / float64 keep `.grad` as usual."""

    recompute_experts: bool = False
    fp32_grad_accumulation: bool = False


def _parse_training(training: Union[bool, TrainingConfig, None]) -> Optional[TrainingConfig]:
    if training is None or training is False:
        return None
    if training is True:
        return TrainingConfig()
    if isinstance(training, TrainingConfig):
        return training
    raise TypeError(f"training={training!r}; pass True, False or an epmoe.TrainingConfig")


def training_support(plan: QuantPlan, config: MoEConfig, ep_size: int) -> Availability:
    """Can a layer of `plan` train: its dispatcher and experts classes answer `supports_training`."""
    request = BackendRequest(expert_mode=plan.expert_mode, layout=plan.layout, wire=plan.dispatch_dtype, arch=plan.arch,
                   ep_size=ep_size, model_dtype=dtype_name(config.dtype), act_format=plan.act_format,
                   hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_experts=config.num_experts, top_k=config.top_k, checkpoint=plan.checkpoint_quant,
                   training=True)
    for kind, cls in (("dispatcher", DISPATCHERS.get(plan.dispatcher)), ("experts", EXPERTS.get(plan.experts_backend))):
        fn = getattr(cls, "supports_training", None)
        ok = fn(request) if fn is not None else Availability.no(f"{kind} {cls.__name__} declares no training support")
        if not ok:
            return ok
    return Availability.yes()


class _ZeroGrads(torch.autograd.Function):
    """out -> out, and a zero gradient for each of `params` in backward: the experts of a rank that
    received no routed row still get a gradient (0), as the unsharded model's expert tensors do, so an
    optimizer with momentum or weight decay steps them the same way (a None gradient is skipped)."""

    @staticmethod
    def forward(ctx, out, *params):
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes)


def _accumulate_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate-grad hook: this backward's gradient into the fp32 `main_grad`, `.grad` cleared."""
    p.main_grad.add_(p.grad)
    p.grad = None


class _RefuseBackward(torch.autograd.Function):
    """Put after the output of a layer that does not train, when its inputs require grad: a backward
    through it raises (on every rank that reaches it: the layer's setting is agreed) instead of
    handing the inputs a wrong (missing) gradient."""

    @staticmethod
    def forward(ctx, message, out, *inputs):
        ctx.message = message
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


@dataclass(frozen=True)
class StepStats:
    """Per-call statistics (returned with `return_stats=True`; local to this rank, no extra collective).

    tokens_per_rank:       T of every rank of the group in this call
    rounds:                dispatch/combine rounds (> 1 when some rank exceeded max_num_tokens_per_rank)
    received_rows:         rows this rank's experts processed (summed over rounds; one rank without a
                           group: every token, as the tokens stay in place; masked layout: the
                           valid rows of all local experts, i.e. (token, expert) pairs)
    tokens_per_local_expert: [E_local] int64, (token, expert) pairs each local expert processed (each local
                           slot, under an EPLB placement)
    bytes_sent:            dispatch bytes this rank sent to other ranks
    """

    tokens_per_rank: tuple
    rounds: int
    received_rows: int
    tokens_per_local_expert: torch.Tensor
    bytes_sent: int

    @property
    def expert_imbalance(self) -> float:
        """max / mean of tokens per local expert (1.0 = perfectly balanced; 0 if no tokens)."""
        c = self.tokens_per_local_expert.double()
        return float(c.max() / c.mean()) if c.numel() and c.sum() > 0 else 0.0


@dataclass(frozen=True)
class MoEOutput:
    """hidden_states [T, H]; routing as computed (global ids) when asked for; stats when asked for."""

    hidden_states: torch.Tensor
    routing: Optional[Routing] = None
    stats: Optional[StepStats] = None


def _default_device(group: Any) -> torch.device:
    if edist.collective_device(group).type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_shared_gpu(device: torch.device, group: Any, ep_size: int) -> None:
    """shared_gpu=True needs a GPU device and, with several ranks, a gloo group."""
    if device.type != "cuda":
        raise ValueError(
            f"shared_gpu=True puts several ranks on one GPU, but device is {device}; pass device='cuda:N' "
            "or drop shared_gpu (CPU ranks need no opt-in)"
        )
    if ep_size > 1:
        import torch.distributed as dist

        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(
                f"shared_gpu=True needs a gloo process group (NCCL refuses two ranks on one GPU), got backend "
                f"{backend!r}; init_process_group('gloo', ...) or launch with --ranks-per-gpu N"
            )


class EPMoE(torch.nn.Module):
    """One MoE layer over the ranks of `group` (default: the world; None without torch.distributed).

    config:        MoEConfig (shape and math)
    dispatcher:    a name in epmoe.dispatch.DISPATCHERS ("torch", "flashinfer", "deepep", "deepep_ll")
    experts:       a name in epmoe.experts.EXPERTS, or "auto" (the quant plan picks by arch)
    quant:         expert quant mode (None: from the checkpoint's quant_method, else unquantized)
    dispatch_dtype: "auto", "bf16" (unquantized model dtype), "nvfp4", "fp8"
    humming / mxfp8_act_scaling: MXFP4 activation options of the quant plan (docs/quant-plan.md)
    max_num_tokens_per_rank: tokens per rank per dispatch round; workspaces are sized from it
    strict:        raise instead of chunking when a rank passes more tokens than that
    deterministic: bitwise-reproducible reductions (fixed order, no atomics)
    plan:          a QuantPlan resolved by the caller (overrides quant / dispatch_dtype / experts)
    timeout_s:     wait at most this long in any collective of this layer (gloo; on NCCL the process
                   group's timeout applies); past it every rank raises CollectiveTimeoutError with a
                   FaultReport (layer, call number, phase, which rank waits on which)
    shared_gpu:    the ranks of `group` share one GPU (explicit opt-in, docs/shared-gpu.md): `group` must be
                   gloo (NCCL refuses two ranks on one device) and `device` a GPU (default: the current
                   one); dispatchers that check for a link between GPUs skip that check. Correct
                   results, but timings measure local cost only, never a link.
    watchdog:      with `timeout_s` set and a dispatcher whose kernels wait on the GPU for peers
                   (flashinfer, deepep, deepep_ll), end this process with a FaultReport on stderr and
                   exit code 4 when a call's kernels have not finished `timeout_s` after launch (a peer
                   died inside the all-to-all: the kernel cannot be cancelled). Costs one CUDA event per
                   call, no host sync. False: no watchdog (the process hangs in that case).
                   docs/shared-gpu.md and epmoe/core/watchdog.py
    check_finite:  check inputs and outputs for NaN/Inf on every call (off by default: it costs a host
                   sync and one small collective per call); any hit raises NonFiniteError on every rank
                   naming the ranks and the tensor
    eplb:          expert-parallel load balancing (`epmoe.eplb.EPLBConfig`): redundant slots for hot
                   experts, load recorded per call, `rebalance()` (and every N calls automatically)
                   moves experts between ranks; docs/eplb.md. None (default): the fixed contiguous
                   placement, nothing added to the forward
    placement:     a `Placement` to start from (or its slot_to_expert list); alone, a static placement
                   (loaded and routed to as given, no load recorded)
    training:      True or a `TrainingConfig`: the layer trains (docs/training.md). The plan must train
                   (`supports_training` of its dispatcher and experts: unquantized experts, 'torch'
                   dispatcher, 'reference' or 'grouped_mm' experts); refused at construction otherwise.
                   The local experts' tensors become nn.Parameters of this module at the first
                   load_weights (w13 [E_local, 2I, H] gate then up, w2 [E_local, H, I], b13, b2), and a
                   forward with gradients enabled is differentiable. None / False: inference only (a
                   backward through the layer raises, naming why)

    Arithmetic: experts compute in float32 (or the plan's quantized format) whatever the model dtype;
    a float64 layer takes and returns float64 but is accurate to float32 (a UserWarning says so), except
    with gradients (training=True): the reference experts, the routing weights and the torch
    dispatcher's combine then run in float64 (gradient checks).

    `dispatcher` may also be a Dispatcher built for another layer: several layers (a model) then
    share one dispatcher and its workspace (it must match this layer's group and shape).
    """

    def __init__(
        self,
        config: MoEConfig,
        group: Any = None,
        dispatcher: Union[str, Dispatcher] = "torch",
        device: Union[str, torch.device, None] = None,
        max_num_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
        *,
        experts: str = "auto",
        quant: Optional[str] = None,
        dispatch_dtype: str = "auto",
        humming: bool = False,
        mxfp8_act_scaling: bool = False,
        strict: bool = False,
        deterministic: bool = False,
        plan: Optional[QuantPlan] = None,
        dispatcher_options: Optional[Mapping[str, Any]] = None,
        experts_options: Optional[Mapping[str, Any]] = None,
        timeout_s: Optional[float] = None,
        check_finite: bool = False,
        shared_gpu: bool = False,
        watchdog: bool = True,
        eplb: Optional[EPLBConfig] = None,
        placement: Union[Placement, Sequence[int], None] = None,
        training: Union[bool, TrainingConfig, None] = None,
        name: str = "EPMoE",
    ):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config is a {type(config).__name__}; pass an epmoe.MoEConfig")
        self.config = config
        self.group = group
        self.name = name
        self.ep_rank = edist.group_rank(group)
        self.ep_size = edist.group_size(group)
        self._distributed = edist.is_distributed(group)  # False: one rank, the agreement is local
        if not isinstance(shared_gpu, bool):
            raise TypeError(f"shared_gpu={shared_gpu!r}; pass True or False")
        self.shared_gpu = shared_gpu
        if device is not None:
            self.device = torch.device(device)
        elif shared_gpu and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = _default_device(group)
        self.strict = strict
        self.deterministic = deterministic
        self.timeout_s = timeout_s
        self.check_finite = bool(check_finite)
        self.watchdog = watchdog
        shared_dispatcher = dispatcher if isinstance(dispatcher, Dispatcher) else None
        dispatcher_name = shared_dispatcher.name if shared_dispatcher is not None else dispatcher

        # Everything that can fail locally is resolved first and the result is agreed on across
        # the group, so a rank with a bad setting never leaves the others waiting.
        error: Optional[BaseException] = None
        d_options = e_options = None
        train_cfg: Optional[TrainingConfig] = None
        start: Optional[Placement] = None  # None: the contiguous placement without EPLB
        slot_config = config  # what dispatchers and experts see: one "expert" per physical slot
        try:
            if isinstance(max_num_tokens_per_rank, bool) or not isinstance(max_num_tokens_per_rank, int) or max_num_tokens_per_rank <= 0:
                raise ValueError(f"max_num_tokens_per_rank={max_num_tokens_per_rank!r}; pass a positive int")
            train_cfg = _parse_training(training)
            redundant = getattr(eplb, "num_redundant_experts", 0) if isinstance(eplb, EPLBConfig) else 0
            start = None if train_cfg is not None and redundant else \
                _resolve_placement(config, self.ep_size, eplb, placement)
            if train_cfg is not None and (redundant or (start is not None and start.num_slots != config.num_experts)):
                raise ValueError(
                    f"training with {redundant or start.num_slots - config.num_experts} redundant expert slots: replicas of one "
                    "expert on several ranks would get different gradients and drift apart; train with "
                    "eplb=None or EPLBConfig(num_redundant_experts=0)")
            if start is None and config.num_experts % self.ep_size:
                raise ValueError(
                    f"num_experts={config.num_experts} is not divisible by the EP size {self.ep_size}; "
                    f"use an EP group whose size divides {config.num_experts}, or redundant experts "
                    f"(eplb=EPLBConfig(num_redundant_experts=R) with (E + R) % ep == 0)"
                )
            if start is not None:
                slot_config = eplb_slot_config(config, start.num_slots)
            if timeout_s is not None and not timeout_s > 0:
                raise ValueError(f"timeout_s={timeout_s!r}; pass a positive number of seconds or None")
            if not isinstance(watchdog, bool):
                raise TypeError(f"watchdog={watchdog!r}; pass True or False")
            if shared_gpu:
                _check_shared_gpu(self.device, group, self.ep_size)
            if dispatcher_name not in DISPATCHERS:
                raise ValueError(f"unknown dispatcher {dispatcher_name!r}; choose one of {DISPATCHERS.names()}")
            if experts != "auto" and experts not in EXPERTS:
                raise ValueError(f"unknown experts backend {experts!r}; choose 'auto' or one of {EXPERTS.names()}")
            if plan is None:
                plan = resolve_plan(
                    slot_config, dispatcher=dispatcher_name, experts=experts, quant=quant, dispatch_dtype=dispatch_dtype,
                    humming=humming, mxfp8_act_scaling=mxfp8_act_scaling,
                    environment=detect_environment(self.device), ep_size=self.ep_size,
                    max_tokens_per_rank=max_num_tokens_per_rank, training=train_cfg is not None,
                )
            d_cls = DISPATCHERS.get(plan.dispatcher)
            if plan.layout != getattr(d_cls, "layout", "flat"):  # a hand-built plan: the class says
                plan = replace(plan, layout=d_cls.layout)
            d_options = d_cls.Options.parse(dispatcher_options, f"dispatcher {plan.dispatcher!r}")
            e_options = EXPERTS.get(plan.experts_backend).Options.parse(
                experts_options, f"experts backend {plan.experts_backend!r}")
            trains = training_support(plan, slot_config, self.ep_size)
            if train_cfg is not None and not trains:
                raise ValueError(f"{name} cannot train with this plan: {trains.reason}"
                                 + (f"; {trains.hint}" if trains.hint else ""))
        except (ValueError, TypeError) as e:
            error = e
        self.max_num_tokens_per_rank = max_num_tokens_per_rank
        self.plan = plan
        fingerprint = dict(config.fingerprint())
        fingerprint.update(
            dispatcher=dispatcher_name, experts=experts, timeout_s=repr(timeout_s), max_num_tokens_per_rank=repr(max_num_tokens_per_rank),
            deterministic=repr(deterministic), ep_size=repr(self.ep_size), shared_gpu=repr(shared_gpu),
            check_finite=repr(self.check_finite), watchdog=repr(watchdog), eplb=repr(eplb), training=repr(train_cfg),
            placement="contiguous" if start is None else f"{start.num_slots} slots, digest {start.digest():016x}",
        )
        if plan is not None:
            fingerprint.update(plan.fingerprint())
        if d_options is not None and shared_dispatcher is None:
            fingerprint.update(d_options.fingerprint("dispatcher_options"))
        if e_options is not None:
            fingerprint.update(e_options.fingerprint("experts_options"))
        fingerprint["construction_error"] = "none" if error is None else f"{type(error).__name__}: {error}"
        self._watch = FaultWatch(f"{name}#{next(_LAYER_IDS)}", group, timeout_s)
        edist.agree_fingerprint(fingerprint, group, what=name, timeout_s=self._watch.collective_timeout)
        if error is not None:
            raise error
        if config.dtype == torch.float64:
            warnings.warn(
                f"{name}: dtype float64: the routing weights are float32 (without gradients) and experts other than "
                "'reference' compute in float32, so outputs (float64) are accurate to float32 (~1e-7 relative), not "
                "float64; use epmoe.reference_moe for a float64 result (training=True computes in float64 throughout)",
                UserWarning, stacklevel=2)

        self.slot_config = slot_config
        self.training_config: Optional[TrainingConfig] = train_cfg
        self._trains: Availability = trains
        # local slots (= local experts without EPLB) and the global id of the first
        self.num_local_experts = slot_config.num_experts // self.ep_size
        self.first_local_expert = self.ep_rank * self.num_local_experts
        self._balancer: Optional[ExpertBalancer] = None if start is None else \
            ExpertBalancer(start, eplb, self.ep_rank, self.device)
        self.experts: Experts = self._build_experts(plan, e_options)
        self._owns_dispatcher = shared_dispatcher is None
        self._runners: List["DecodeRunner"] = []
        if shared_dispatcher is not None:
            self._check_shared_dispatcher(shared_dispatcher)
            self.dispatcher: Dispatcher = shared_dispatcher
        else:
            self.dispatcher = self._build_dispatcher(plan, d_options)
        # the watchdog covers kernels that wait on the GPU for peers, which no host timeout reaches; the
        # torch dispatcher needs none (gloo: host timeouts; NCCL: the process group's own watchdog)
        self._watchdog_active = bool(watchdog and timeout_s is not None and self.ep_size > 1
                                     and self.dispatcher.waits_on_device)
        if self.dispatcher.layout not in self.experts.accepted_layouts:
            raise ValueError(
                f"dispatcher {self.dispatcher.name!r} delivers the {self.dispatcher.layout!r} layout but experts "
                f"backend {self.experts.name!r} takes {self.experts.accepted_layouts}; use experts='auto' or a "
                "backend for that layout (e.g. 'masked_reference' for 'deepep_ll')"
            )
        self.register_buffer(
            "e_score_correction_bias",
            torch.zeros(config.num_experts, dtype=torch.float32, device=self.device)
            if config.routing == "sigmoid_grouped" else None,
        )
        # route(): one fused Triton kernel on CUDA where it applies, else torch ops (epmoe.routing)
        self.router = Router(config, self.device)
        # One rank whose dispatcher hands the routing through: at decode sizes the routing launch also
        # computes the experts' block alignment (`Router.route_aligned`, one launch instead of two),
        # where the experts backend asks for it (`Experts.fused_alignment`)
        self._fuse_alignment = (not self._distributed and self.ep_size == 1 and self.dispatcher.keeps_routing
                                and self._balancer is None
                                and type(self.experts).fused_alignment is not Experts.fused_alignment)
        self._weights_loaded = False
        self._loaded_dtypes: Dict[str, torch.dtype] = {}

    # ------------------------------------------------------------------ construction
    def _build_experts(self, plan: QuantPlan, options) -> Experts:
        cls = EXPERTS.get(plan.experts_backend)
        spec = ExpertsSpec(
            config=self.slot_config, ep_rank=self.ep_rank, ep_size=self.ep_size, device=self.device,
            plan=plan, deterministic=self.deterministic,
            max_tokens=self.max_num_tokens_per_rank * self.ep_size, options=options,
        )
        avail = cls.availability(spec)
        if not avail:
            raise BackendUnavailableError(plan.experts_backend, avail.reason, avail.hint)
        return cls(spec)

    def _wire_format(self, plan: QuantPlan) -> PayloadFormat:
        """How tokens travel: the plan's dispatch dtype ("bf16" = the unquantized model dtype). The
        dispatcher hands the experts a quantized payload only when it is the one they consume;
        otherwise it delivers unquantized tokens (dequantized on arrival if they travelled quantized)."""
        from epmoe.quant.codec import payload_format

        return payload_format(plan.dispatch_dtype, self.config.dtype)

    def _build_dispatcher(self, plan: QuantPlan, options) -> Dispatcher:
        cls = DISPATCHERS.get(plan.dispatcher)
        avail = cls.availability(self.device, self.ep_size, self.shared_gpu)
        if not avail:
            raise BackendUnavailableError(plan.dispatcher, avail.reason, avail.hint)
        from epmoe.quant.workspace import workspace_breakdown

        # the plan's workspace sizing is the one definition of the A2A buffer size (exact for the
        # FlashInfer and DeepEP buffers; the dispatcher checks it against its own requirement)
        ws = workspace_breakdown(plan, self.slot_config, self.ep_size, self.max_num_tokens_per_rank)
        spec = DispatchSpec(
            group=self.group, ep_rank=self.ep_rank, ep_size=self.ep_size,
            workspace_bytes=ws.a2a_bytes if ws.exact else None,
            num_experts=self.slot_config.num_experts, top_k=self.config.top_k,
            hidden_size=self.config.hidden_size, max_tokens_per_rank=self.max_num_tokens_per_rank,
            payload=self.experts.payload_format, wire=self._wire_format(plan),
            combine_dtype=self.config.dtype, device=self.device, deterministic=self.deterministic,
            timeout_s=self._watch.collective_timeout, shared_gpu=self.shared_gpu, options=options,
        )
        return cls(spec)

    def _check_shared_dispatcher(self, d: Dispatcher) -> None:
        s, c = d.spec, self.slot_config
        problems = []
        if s.group is not self.group:
            problems.append("it serves another process group")
        if s.shared_gpu != self.shared_gpu:
            problems.append(f"shared_gpu {s.shared_gpu} != {self.shared_gpu}")
        for field, mine in (("num_experts", c.num_experts), ("top_k", c.top_k), ("hidden_size", c.hidden_size),
                            ("combine_dtype", c.dtype)):
            if getattr(s, field) != mine:
                problems.append(f"{field} {getattr(s, field)} != {mine}")
        if s.payload != self.experts.payload_format:
            problems.append(f"payload {s.payload.name} != this layer's experts' {self.experts.payload_format.name}")
        if s.max_tokens_per_rank < self.max_num_tokens_per_rank:
            problems.append(f"max_tokens_per_rank {s.max_tokens_per_rank} < {self.max_num_tokens_per_rank}")
        if problems:
            raise ValueError(
                "the shared dispatcher does not fit this layer: " + "; ".join(problems)
                + ". Share one only between layers of the same shape and group, sized for the largest."
            )

    # ------------------------------------------------------------------ weights
    def load_weights(
        self,
        weights: Union[Source, ExpertWeights],
        *,
        prefix: Optional[str] = None,
        layer_idx: Optional[int] = None,
        e_score_correction_bias: Optional[torch.Tensor] = None,
    ) -> None:
        """Load the GLOBAL expert tensors (HF-named dict, safetensors file/dir, canonical stacked dict,
        or an ExpertWeights) and keep this rank's slice. Collective: every rank of the group calls it.

        All or nothing across the group: each rank reads, validates and converts first; only if every
        rank succeeded does any rank install the weights (a reload copies in place, so storage and any
        captured CUDA graph stay valid). Otherwise every rank raises and the old weights stay."""
        self._install(weights, prefix, layer_idx, e_score_correction_bias, update=False)

    def update_weights(
        self,
        weights: Union[Source, ExpertWeights],
        *,
        prefix: Optional[str] = None,
        layer_idx: Optional[int] = None,
        e_score_correction_bias: Optional[torch.Tensor] = None,
    ) -> None:
        """Push new weights (a trainer's in-memory global tensors or safetensors files) into a loaded
        layer without rebuilding: converted to the kernel layout and copied IN PLACE (every parameter
        keeps its storage). Shapes and dtypes must match the first load; a change is a clear error
        asking to rebuild. Collective and all-or-nothing like load_weights."""
        if not self._weights_loaded:
            raise RuntimeError("update_weights before load_weights: load the layer's weights first")
        self._install(weights, prefix, layer_idx, e_score_correction_bias, update=True)

    def _prepare(self, weights, prefix, layer_idx, e_score_correction_bias, update: bool):
        lo, hi = self.first_local_expert, self.first_local_expert + self.num_local_experts
        if self._balancer is not None and not self._balancer.placement.is_contiguous:
            # this rank's slots: the logical experts of the placement in force
            local, corr = self._read_slots(weights, prefix, layer_idx)
            corr = e_score_correction_bias if e_score_correction_bias is not None else corr
        elif isinstance(weights, ExpertWeights):
            if weights.num_experts not in (self.num_local_experts, self.config.num_experts):
                raise ValueError(
                    f"ExpertWeights hold {weights.num_experts} experts; pass all {self.config.num_experts} (global) "
                    f"or this rank's {self.num_local_experts} starting at expert {lo}")
            local = weights if (weights.num_experts, weights.first_expert) == (self.num_local_experts, lo) \
                else weights.slice_experts(lo, hi)
            corr = e_score_correction_bias
        else:
            loaded = load_expert_weights(weights, self.config, experts=(lo, hi), prefix=prefix, layer_idx=layer_idx)
            local = loaded.experts
            corr = e_score_correction_bias if e_score_correction_bias is not None else loaded.e_score_correction_bias
        if corr is not None:
            if self.e_score_correction_bias is None:
                raise ValueError("e_score_correction_bias given but the config's routing is not 'sigmoid_grouped'")
            if tuple(corr.shape) != (self.config.num_experts,):
                raise ValueError(
                    f"e_score_correction_bias has shape {list(corr.shape)}; expected [{self.config.num_experts}]")
        local.validate(self.config, self.num_local_experts)
        _check_finite_weights(local, corr, self.local_experts)
        check_fits_plan(local.format, self.plan)
        dtypes = {name: t.dtype for name, t in local.tensors().items()}
        if update:
            changed = {n: (self._loaded_dtypes.get(n), d) for n, d in dtypes.items() if self._loaded_dtypes.get(n) != d}
            if changed:
                detail = ", ".join(f"{n}: {a} -> {b}" for n, (a, b) in changed.items())
                raise TypeError(
                    f"update_weights got tensors of other dtypes than the layer was loaded with ({detail}); "
                    "cast them to the loaded dtypes, or build a new EPMoE for the new dtype"
                )
        return self.experts.prepare_weights(local), corr, dtypes

    def _read_slots(self, weights, prefix, layer_idx):
        """(ExpertWeights of this rank's slots, the checkpoint's correction bias or None): every slot's
        logical expert, replicas included, read once each."""
        ids = self.local_experts
        if isinstance(weights, ExpertWeights):
            E = self.config.num_experts
            if weights.num_experts != E or weights.first_expert != 0:
                raise ValueError(
                    f"ExpertWeights hold experts [{weights.first_expert}, {weights.first_expert + weights.num_experts}); "
                    f"under an EPLB placement pass all {E} (global) experts: each rank keeps its slots' experts")
            return weights.take(ids, first_expert=self.first_local_expert), None
        loaded = load_expert_weights(weights, self.config, expert_ids=ids, prefix=prefix, layer_idx=layer_idx)
        return replace(loaded.experts, first_expert=self.first_local_expert), loaded.e_score_correction_bias

    def _install(self, weights, prefix, layer_idx, e_score_correction_bias, update: bool) -> None:
        error: Optional[BaseException] = None
        prepared = corr = dtypes = None
        try:
            prepared, corr, dtypes = self._prepare(weights, prefix, layer_idx, e_score_correction_bias, update)
        except Exception as e:  # noqa: BLE001 - any failure on one rank (SafetensorError, MemoryError, ...)
            # must become an error on every rank, or the others would wait in the agreement below
            error = e
            if update and isinstance(e, ValueError) and "has shape" in str(e):
                error = ValueError(f"{e}; update_weights keeps shapes fixed: build a new EPMoE for new shapes")
        to = self._watch.collective_timeout
        flags = edist.gather_ints([0 if error is None else 1], self.group, to)
        edist.raise_if_any_failed(error, [r for r in range(flags.shape[0]) if flags[r, 0]], self.group, to)
        with torch.no_grad():  # a reload copies into the parameters of a training layer in place
            self.experts.commit_weights(prepared)
            if corr is not None:
                self.e_score_correction_bias.copy_(corr.float())
        if not self._weights_loaded:
            self._loaded_dtypes = dtypes
            if self.training_config is not None:
                self._register_expert_parameters()
        self._weights_loaded = True

    # ------------------------------------------------------------------ training
    def _register_expert_parameters(self) -> None:
        """The local experts' tensors as nn.Parameters of this module, over the backend's storage: an
        optimizer step updates what inference reads, a reload copies into them in place."""
        for name, t in self.experts.parameters().items():
            p = torch.nn.Parameter(t, requires_grad=True)
            if self.training_config.fp32_grad_accumulation and p.dtype in (torch.bfloat16, torch.float16):
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
            self.register_parameter(name, p)

    def zero_main_grad(self) -> None:
        """Zero the fp32 `main_grad` of every expert parameter (TrainingConfig(fp32_grad_accumulation=True))."""
        for p in self.parameters(recurse=False):
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()

    def expert_gradients(self) -> Optional[ExpertWeights]:
        """The gradients of this rank's local experts in the canonical layout (w1, w3, w2 [, b13, b2];
        first_expert = the first local expert; `main_grad` where fp32 accumulation is on), or None before
        any backward. A training layer only."""
        if self.training_config is None:
            raise ValueError(f"{self.name} was built without training; build it with training=True")
        p = dict(self.named_parameters(recurse=False))
        grad = lambda t: t.main_grad if hasattr(t, "main_grad") else t.grad  # noqa: E731 - fp32 accumulation
        if "w13" not in p or grad(p["w13"]) is None:
            return None
        E, I = self.num_local_experts, self.config.intermediate_size
        g13, g2 = grad(p["w13"])[:E], grad(p["w2"])[:E]
        w1, w3 = (g13[:, :I], g13[:, I:]) if self.config.is_gated else (g13, None)
        b13 = b2 = None
        if "b13" in p:
            b13 = grad(p["b13"])[:E] if grad(p["b13"]) is not None else torch.zeros_like(p["b13"][:E])
            b2 = grad(p["b2"])[:E] if grad(p["b2"]) is not None else torch.zeros_like(p["b2"][:E])
        return ExpertWeights(w1=w1, w2=g2, w3=w3, b13=b13, b2=b2, first_expert=self.first_local_expert)

    def _gradients_pending(self) -> bool:
        return any(p.grad is not None or (hasattr(p, "main_grad") and bool(p.main_grad.any()))
                   for p in self.parameters(recurse=False))

    # ------------------------------------------------------------------ expert placement (EPLB)
    @property
    def placement(self) -> Placement:
        """The placement in force (`Placement.contiguous(E, ep)` for a layer built without EPLB)."""
        if self._balancer is None:
            return Placement.contiguous(self.config.num_experts, self.ep_size)
        return self._balancer.placement

    @property
    def local_experts(self) -> Tuple[int, ...]:
        """The logical expert of each of this rank's slots, in local-slot order."""
        if self._balancer is None:
            return tuple(range(self.first_local_expert, self.first_local_expert + self.num_local_experts))
        return self._balancer.placement.local_experts(self.ep_rank)

    @property
    def last_rebalance(self) -> Optional[RebalanceReport]:
        """The report of the latest rebalance (automatic or called), None before the first."""
        return None if self._balancer is None else self._balancer.last_report

    def expert_load(self, reset: bool = False) -> ExpertLoad:
        """The load recorded over the window (`EPLBConfig.window`, else since the last rebalance or reset),
        summed over the ranks: per slot, per logical expert, per rank. Collective. reset: start a new
        window afterwards."""
        if self._balancer is None:
            raise ValueError(f"{self.name} records no expert load; build it with eplb=EPLBConfig(...)")
        return self._balancer.expert_load(self.group, self._watch.collective_timeout, reset)

    def rebalance(self, load: Any = None, *, placement: Union[Placement, Sequence[int], None] = None,
                  force: bool = False) -> RebalanceReport:
        """Move experts between ranks for a better balanced placement. Collective: every rank calls it
        between two calls of the layer, with the same arguments.

        load:      [E] load per logical expert to plan from (default: the recorded window, all ranks)
        placement: switch to this placement instead of planning one (same E, ep and slots)
        force:     move even when the plan lowers the busiest rank's load by less than
                   EPLBConfig.min_improvement

        Only the slots whose expert changes move, as stored (quantized data with its scales), through
        the process group in bounded rounds; then all ranks switch at once. All or nothing: a failure
        on any rank raises the same RebalanceError on every rank and the old placement stays in force;
        a lost peer raises CollectiveFailure with its fault report. Decode runners keep working (their
        tables and weights are updated in place). Returns a RebalanceReport (bytes moved, time,
        predicted load per rank before and after)."""
        if self._balancer is None:
            raise ValueError(f"{self.name} was built without EPLB; build it with eplb=EPLBConfig(...) (or placement=) "
                             "to rebalance")
        if not self._weights_loaded:
            raise RuntimeError("rebalance before load_weights: load the layer's weights first")
        if self.training_config is not None:
            # moving experts would leave their gradients (and the optimizer's state) on the old slots:
            # refused while any rank holds gradients, on every rank
            pending = edist.gather_ints([int(self._gradients_pending())], self.group, self._watch.collective_timeout)
            ranks = [edist.global_rank(self.group, r) for r in range(pending.shape[0]) if pending[r, 0]]
            if ranks:
                raise RuntimeError(
                    f"{self.name}: rebalance while expert gradients are pending on ranks {ranks}; rebalance between "
                    "optimizer steps, after optimizer.zero_grad(set_to_none=True) (and move or reset the "
                    "optimizer's state of moved experts: docs/training.md)")
        with torch.no_grad():  # moves rows of the training parameters in place
            return self._balancer.rebalance(self.experts, self.group, self._watch, self.name, load=load,
                                            placement=placement, force=force)

    def _auto_rebalance(self) -> None:
        """EPLBConfig.rebalance_every: due before this call on every rank. A failure raises (on every rank)
        and the next attempt waits another interval."""
        try:
            self.rebalance()
        except BaseException:
            self._balancer.calls_since_rebalance = 0
            raise

    # ------------------------------------------------------------------ forward
    def _check_local(self, hidden_states, router_logits, topk_ids, topk_weights) -> Optional[BaseException]:
        cfg = self.config
        try:
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(f"hidden_states is a {type(hidden_states).__name__}; expected a torch.Tensor")
            if hidden_states.dim() != 2 or hidden_states.shape[1] != cfg.hidden_size:
                raise ValueError(
                    f"hidden_states has shape {list(hidden_states.shape)}; expected [num_tokens, {cfg.hidden_size}]"
                )
            if hidden_states.dtype != cfg.dtype:
                raise TypeError(
                    f"hidden_states has dtype {dtype_name(hidden_states.dtype)}; the layer was built for "
                    f"{dtype_name(cfg.dtype)} (cast the input or build the layer with that dtype)"
                )
            if hidden_states.device.type != self.device.type:
                raise ValueError(f"hidden_states is on {hidden_states.device}; the layer runs on {self.device}")
            T = hidden_states.shape[0]
            if (router_logits is None) == (topk_ids is None):
                raise ValueError("pass either router_logits or topk_ids/topk_weights (routing replay), not both")
            if router_logits is not None:
                if router_logits.dim() != 2 or tuple(router_logits.shape) != (T, cfg.num_experts):
                    raise ValueError(
                        f"router_logits has shape {list(router_logits.shape)}; expected [{T}, {cfg.num_experts}]"
                    )
                if not router_logits.is_floating_point():
                    raise TypeError(f"router_logits has dtype {router_logits.dtype}; expected a float dtype")
            else:
                if topk_weights is None:
                    raise ValueError("topk_ids given without topk_weights")
                for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
                    if tuple(t.shape) != (T, cfg.top_k):
                        raise ValueError(f"{name} has shape {list(t.shape)}; expected [{T}, {cfg.top_k}]")
                if topk_ids.dtype not in (torch.int32, torch.int64):
                    raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected torch.int32")
                if T:
                    # both checks in one host sync: range, then the same expert twice in a row of top-k
                    out_of_range = ((topk_ids < -1) | (topk_ids >= cfg.num_experts)).any()
                    s = topk_ids.sort(dim=1).values
                    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
                    bad_range, bad_dup = torch.stack([out_of_range, dup.any()]).tolist()
                    if bad_range:
                        raise ValueError(f"topk_ids has values outside [-1, {cfg.num_experts}); -1 means no expert")
                    if bad_dup:
                        row = int(dup.any(dim=1).nonzero()[0])
                        raise ValueError(
                            f"topk_ids row {row} lists expert {int(s[row, 1:][dup[row]][0])} more than once "
                            f"({topk_ids[row].tolist()}); each token's top-k experts must differ (-1 for none)")
                if not topk_weights.is_floating_point():
                    raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; expected a float dtype")
            if self.strict and T > self.max_num_tokens_per_rank:
                raise ValueError(
                    f"{T} tokens exceed max_num_tokens_per_rank={self.max_num_tokens_per_rank} with strict=True; "
                    "pass fewer tokens, raise the limit, or build the layer with strict=False to run in rounds"
                )
            if not self._weights_loaded:
                raise RuntimeError("EPMoE.forward before load_weights")
            if self.check_finite:
                for tname, t in (("hidden_states", hidden_states), ("router_logits", router_logits),
                                 ("topk_weights", topk_weights)):
                    if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
                        raise NonFiniteError(f"{self.name}: input {tname} holds NaN/Inf on rank "
                                             f"{edist.global_rank(self.group, self.ep_rank)}")
        except (ValueError, TypeError, RuntimeError) as e:
            return e
        return None

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: Optional[torch.Tensor] = None,
        *,
        topk_ids: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        return_routing: bool = False,
        return_stats: bool = False,
    ) -> Union[torch.Tensor, MoEOutput]:
        """hidden_states [T, H] (config.dtype), router_logits [T, E] -> [T, H].

        Instead of router_logits, pass topk_ids [T, K] int32 (-1: none) and topk_weights [T, K] f32 to
        replay a routing. With return_routing / return_stats a MoEOutput is returned.
        Every rank of the group must call forward once per step (T = 0 is fine)."""
        if self._balancer is not None and self._balancer.due:  # between two calls, on every rank
            self._auto_rebalance()
        error = self._check_local(hidden_states, router_logits, topk_ids, topk_weights)
        T = hidden_states.shape[0] if error is None else 0
        M = self.max_num_tokens_per_rank
        watch, to = self._watch, self._watch.collective_timeout
        watch.next_call()
        # differentiable: a training layer with gradients enabled (agreed: the backward is collective too)
        train = self.training_config is not None and torch.is_grad_enabled()
        if not self._distributed:  # one rank: nothing to agree on, no collective
            if error is not None:
                with watch.phase("agree"):
                    raise error
            tokens_per_rank = (T,)
        else:
            with watch.phase("agree"):
                agreed = edist.gather_ints([T, 0 if error is None else 1, int(train)], self.group, to).tolist()
                failed = [r for r, (_, bad, _) in enumerate(agreed) if bad]
                edist.raise_if_any_failed(error, failed, self.group, to)
                if len({g for _, _, g in agreed}) > 1:
                    on = [edist.global_rank(self.group, r) for r, (_, _, g) in enumerate(agreed) if g]
                    off = [edist.global_rank(self.group, r) for r, (_, _, g) in enumerate(agreed) if not g]
                    raise RuntimeError(
                        f"{self.name}: ranks {on} run with gradients enabled, ranks {off} without (torch.no_grad / "
                        "inference_mode); the backward is collective: run every rank's forward in the same grad mode")
            tokens_per_rank = tuple(t for t, _, _ in agreed)
        rounds = max(1, -(-max(tokens_per_rank) // M))

        if train:
            return self._forward_train(hidden_states, router_logits, topk_ids, topk_weights, tokens_per_rank,
                                       rounds, return_routing, return_stats)
        blocks = None  # the experts' block alignment, when the routing launch computed it too
        if router_logits is None:
            routing = Routing(topk_ids=topk_ids.to(torch.int32), topk_weights=topk_weights.float())
        elif self._fuse_alignment and rounds == 1 and T:
            block_m = self.experts.fused_alignment(T * self.config.top_k)
            if block_m is None:
                routing = self.router(router_logits, self.e_score_correction_bias)
            else:
                routing, blocks = self.router.route_aligned(router_logits, self.e_score_correction_bias,
                                                            self.num_local_experts, block_m)
        else:
            routing = self.router(router_logits, self.e_score_correction_bias)

        slot_ids = routing.topk_ids if self._balancer is None else self._balancer.route(routing.topk_ids)
        outputs: List[torch.Tensor] = []
        bad_expert_out = False
        rows = 0
        bytes_sent = 0
        per_expert = torch.zeros(self.num_local_experts, dtype=torch.int64, device=hidden_states.device) if return_stats else None
        armed = self._arm_watchdog()  # None unless the dispatcher's kernels wait on peers on the GPU
        try:
            for r in range(rounds):
                # the one agreement of this call, handed down: the dispatcher neither validates nor agrees again
                per_rank = tokens_per_rank if rounds == 1 else tuple(min(M, max(0, t - r * M)) for t in tokens_per_rank)
                agreement = Agreement(per_rank, inputs_checked=True, want_bytes=return_stats)
                if rounds == 1:  # no slicing (each view costs host time)
                    x_r, ids_r, w_r = hidden_states, slot_ids, routing.topk_weights
                else:
                    lo, hi = min(r * M, T), min((r + 1) * M, T)
                    x_r, ids_r, w_r = hidden_states[lo:hi], slot_ids[lo:hi], routing.topk_weights[lo:hi]
                if armed is not None:
                    armed.phase = "dispatch" if rounds == 1 else f"dispatch[round {r}]"
                with watch.phase("dispatch" if rounds == 1 else f"dispatch[round {r}]"):
                    tokens, handle = self.dispatcher.dispatch(x_r, ids_r, w_r, agreement=agreement)
                if armed is not None:
                    armed.phase = "experts" if rounds == 1 else f"experts[round {r}]"
                with watch.phase("experts" if rounds == 1 else f"experts[round {r}]"):
                    if blocks is not None and tokens.topk_ids is routing.topk_ids:  # the ids it aligns
                        expert_out = self.experts(tokens, alignment=blocks)
                    else:
                        expert_out = self.experts(tokens)
                if self.check_finite and isinstance(expert_out, torch.Tensor) and expert_out.numel():
                    bad_expert_out = bad_expert_out or not bool(torch.isfinite(expert_out).all())
                if tokens.layout != "masked":
                    rows += tokens.num_tokens
                    if per_expert is not None and tokens.topk_ids is not None:
                        # before combine (the received ids may be views of a dispatch workspace), no sync
                        ids = tokens.topk_ids.reshape(-1).long()
                        per_expert.index_add_(0, ids.clamp(min=0), (ids >= 0).long())
                if armed is not None:
                    armed.phase = "combine" if rounds == 1 else f"combine[round {r}]"
                with watch.phase("combine" if rounds == 1 else f"combine[round {r}]"):
                    outputs.append(self.dispatcher.combine(expert_out, handle))
                bytes_sent += handle.bytes_sent
                if tokens.layout == "masked" and return_stats:  # [E_local, slots, H], valid rows per expert
                    counts = tokens.expert_counts.to(torch.int64)
                    per_expert += counts
                    rows += int(counts.sum())
        finally:
            if armed is not None:  # the watchdog thread disarms it once these kernels have finished
                armed.launched(_watchdog.completion_marker(self.device))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        if self._balancer is not None:
            self._balancer.end_call()
        if self.check_finite:
            with watch.phase("finite check"):
                self._agree_finite(bad_expert_out, out, to)
        if torch.is_grad_enabled():
            out = self._refuse_backward(out, hidden_states, router_logits, topk_weights)
        if not (return_routing or return_stats):
            return out
        stats = None
        if return_stats:
            stats = StepStats(
                tokens_per_rank=tokens_per_rank, rounds=rounds, received_rows=rows,
                tokens_per_local_expert=per_expert.cpu(), bytes_sent=bytes_sent,
            )
        return MoEOutput(hidden_states=out, routing=routing if return_routing else None, stats=stats)

    def _refuse_backward(self, out, *inputs):
        """A layer without training whose inputs require grad: its output carries a node that raises at
        backward (never a missing gradient passed off as zero)."""
        needs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needs:
            return out
        why = ("build it with training=True (this plan trains)" if self._trains else
               f"this plan cannot train: {self._trains.reason}" + (f"; {self._trains.hint}" if self._trains.hint else ""))
        return _RefuseBackward.apply(f"{self.name} was built for inference only: no gradient flows through it; {why} "
                                     "(docs/training.md)", out, *needs)

    def _forward_train(self, hidden_states, router_logits, topk_ids, topk_weights, tokens_per_rank, rounds,
                       return_routing, return_stats):
        """The differentiable forward (docs/training.md): the same routing, bytes and arithmetic as the
        inference path; dispatch / combine are autograd Functions (backward: the reverse all-to-all),
        the experts run `train_forward`, the routing weights are recomputed from the logits."""
        from epmoe.dispatch.autograd import differentiable_combine, differentiable_dispatch

        watch, M = self._watch, self.max_num_tokens_per_rank
        if router_logits is not None:
            with torch.no_grad():
                ids = self.router(router_logits, self.e_score_correction_bias).topk_ids
            weights = routing_weights(self.config, router_logits, ids)
        else:
            ids = topk_ids.to(torch.int32)
            weights = topk_weights.to(torch.float64 if topk_weights.dtype == torch.float64 else torch.float32)
        routing = Routing(topk_ids=ids, topk_weights=weights)
        slot_ids = ids if self._balancer is None else self._balancer.route(ids)
        T = hidden_states.shape[0]
        outputs: List[torch.Tensor] = []
        rows = bytes_sent = 0
        per_expert = torch.zeros(self.num_local_experts, dtype=torch.int64, device=hidden_states.device) \
            if return_stats else None
        for r in range(rounds):
            per_rank = tokens_per_rank if rounds == 1 else tuple(min(M, max(0, t - r * M)) for t in tokens_per_rank)
            agreement = Agreement(per_rank, inputs_checked=True, want_bytes=return_stats)
            lo, hi = (0, T) if rounds == 1 else (min(r * M, T), min((r + 1) * M, T))
            x_r, ids_r, w_r = hidden_states[lo:hi], slot_ids[lo:hi], weights[lo:hi]
            tag = "" if rounds == 1 else f"[round {r}]"
            with watch.phase("dispatch" + tag):
                tokens, handle = differentiable_dispatch(self.dispatcher, x_r, ids_r, w_r, agreement, watch, self.name)
            with watch.phase("experts" + tag):
                expert_out = self._train_experts(tokens)
            rows += tokens.num_tokens
            if per_expert is not None and tokens.topk_ids is not None:
                e = tokens.topk_ids.reshape(-1).long()
                per_expert.index_add_(0, e.clamp(min=0), (e >= 0).long())
            with watch.phase("combine" + tag):
                outputs.append(differentiable_combine(self.dispatcher, expert_out, handle, watch, self.name))
            bytes_sent += handle.bytes_sent
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        if self._balancer is not None:
            self._balancer.end_call()
        if self.check_finite:
            with watch.phase("finite check"):
                self._agree_finite(False, out, watch.collective_timeout)
        if not (return_routing or return_stats):
            return out
        stats = None
        if return_stats:
            stats = StepStats(tokens_per_rank=tokens_per_rank, rounds=rounds, received_rows=rows,
                              tokens_per_local_expert=per_expert.cpu(), bytes_sent=bytes_sent)
        return MoEOutput(hidden_states=out, routing=routing if return_routing else None, stats=stats)

    def _train_experts(self, tokens) -> torch.Tensor:
        # the module's parameters as looked up now (torch.func.functional_call may stand in others)
        params = {name: getattr(self, name) for name in self.experts.parameters()}
        if self.training_config.recompute_experts:
            from torch.utils.checkpoint import checkpoint

            def run(hidden, weights):
                return self.experts.train_forward(replace(tokens, hidden=hidden, topk_weights=weights), params)

            out = checkpoint(run, tokens.hidden, tokens.topk_weights, use_reentrant=False)
        else:
            out = self.experts.train_forward(tokens, params)
        if not bool((tokens.topk_ids >= 0).any()):  # no routed row here: the experts used no parameter
            out = _ZeroGrads.apply(out, *params.values())
        return out

    def _arm_watchdog(self, phase: str = "dispatch"):
        """Arm the watchdog for this call (epmoe/core/watchdog.py); None when it is off for this layer."""
        if not self._watchdog_active:
            return None
        # through the module: a forked child gets a fresh watchdog (os.register_at_fork)
        entry = _watchdog.WATCHDOG.arm(self._watch, self._watch.call, self.timeout_s)
        entry.phase = phase
        return entry

    def _agree_finite(self, bad_expert_out: bool, out: torch.Tensor, timeout_s) -> None:
        bad_out = bool(out.numel()) and not bool(torch.isfinite(out).all())
        flags = edist.gather_ints([int(bad_expert_out), int(bad_out)], self.group, timeout_s)
        if not bool(flags.any()):
            return
        ranks = lambda col: [edist.global_rank(self.group, r) for r in range(flags.shape[0]) if flags[r, col]]
        parts = []
        if ranks(0):
            parts.append(f"expert output (this rank's experts' results before the combine) on ranks {ranks(0)}")
        if ranks(1):
            parts.append(f"combined output on ranks {ranks(1)}")
        raise NonFiniteError(
            f"{self.name} call {self._watch.call}: NaN/Inf in " + "; ".join(parts)
            + ". NaN/Inf in a rank's expert output comes from its weights or from the tokens it received")

    # ------------------------------------------------------------------ decode (CUDA graphs)
    def decode_runner(self, max_tokens: int, *, cuda_graph: bool = True) -> "DecodeRunner":
        """A fixed-shape runner for decode steps: route + dispatch + experts + combine for exactly
        `max_tokens` rows per rank (padding rows route nowhere), captured once in a CUDA graph and
        replayed for any T <= max_tokens. Collective: every rank builds it and calls it each step.
        `cuda_graph=False` runs the same fixed-shape code eagerly (any device; used to check replay)."""
        runner = DecodeRunner(self, max_tokens, cuda_graph)
        self._runners.append(runner)
        return runner

    def close(self) -> None:
        """Free what this layer allocated: its decode runners' dispatchers and its own dispatcher
        (collective for backends with symmetric memory: every rank calls it). A shared dispatcher is
        left to its owner. The layer cannot run afterwards."""
        for runner in self._runners:
            runner.close()
        self._runners = []
        if self._owns_dispatcher and self.dispatcher is not None:
            self.dispatcher.close()
        self.dispatcher = None

    def extra_repr(self) -> str:
        c = self.config
        where = (f"experts=[{self.first_local_expert}, {self.first_local_expert + self.num_local_experts})"
                 if self._balancer is None else f"slots={list(self.local_experts)} of {self.slot_config.num_experts}")
        return (
            f"E={c.num_experts}, K={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
            f"ep={self.ep_rank}/{self.ep_size}, {where}, dispatcher={self.dispatcher.name}, "
            f"experts_backend={self.experts.name}"
        )


class DecodeRunner:
    """See EPMoE.decode_runner. Inputs are copied into static buffers; the returned tensor is a view of
    the static output buffer (copy it if you need it after the next call). Weight updates
    (`update_weights`, in place) and EPLB rebalances (replica tables and weights, in place) are seen by
    later replays without recapturing.

    In this mode there is no per-call agreement collective: every rank must call with T <= max_tokens
    (checked locally) and the same kind of routing input (logits or replayed ids/weights)."""

    def __init__(self, layer: EPMoE, max_tokens: int, cuda_graph: bool):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens!r}; pass a positive int")
        if cuda_graph and layer.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the layer runs on {layer.device} (cuda_graph=False)")
        if not layer._weights_loaded:
            raise RuntimeError("decode_runner before load_weights")
        self.layer, self.max_tokens, self.cuda_graph = layer, max_tokens, cuda_graph
        cfg, dev, M = layer.config, layer.device, max_tokens
        # one static-shape dispatcher per (layer dispatcher, M): runners of one size share it
        for other in layer._runners:
            if other.max_tokens == M and other.dispatcher is not None:
                self.dispatcher, self._owns_dispatcher = other.dispatcher, False
                break
        else:
            spec = replace(layer.dispatcher.spec, static_shapes=True, max_tokens_per_rank=M)
            self.dispatcher, self._owns_dispatcher = type(layer.dispatcher)(spec), True
        self.x = torch.zeros(M, cfg.hidden_size, dtype=cfg.dtype, device=dev)
        self.logits = torch.zeros(M, cfg.num_experts, dtype=torch.float32, device=dev)
        self.ids = torch.full((M, cfg.top_k), -1, dtype=torch.int32, device=dev)
        self.weights = torch.zeros(M, cfg.top_k, dtype=torch.float32, device=dev)
        self.count = torch.zeros((), dtype=torch.int64, device=dev)
        self.out = torch.zeros(M, cfg.hidden_size, dtype=cfg.dtype, device=dev)
        self.topk_ids_out = torch.full((M, cfg.top_k), -1, dtype=torch.int32, device=dev)
        self.topk_weights_out = torch.zeros(M, cfg.top_k, dtype=torch.float32, device=dev)
        self._graphs: Dict[bool, Any] = {}

    def close(self) -> None:
        """Free the static-shape dispatcher this runner built and its captured graphs (collective for
        backends with symmetric memory). EPMoE.close() closes its runners."""
        self._graphs = {}
        if self._owns_dispatcher and self.dispatcher is not None:
            self.dispatcher.close()
        self.dispatcher = None

    def _body(self, from_logits: bool) -> None:
        layer, M = self.layer, self.max_tokens
        if from_logits:
            r = layer.router(self.logits, layer.e_score_correction_bias)
            ids, w = r.topk_ids, r.topk_weights
        else:
            ids, w = self.ids, self.weights
        valid = (torch.arange(M, device=self.count.device) < self.count).unsqueeze(1)
        ids = torch.where(valid, ids, torch.full_like(ids, -1))
        w = torch.where(valid, w, torch.zeros_like(w))
        self.topk_ids_out.copy_(ids)
        self.topk_weights_out.copy_(w)
        if layer._balancer is not None:  # its tables are updated in place: a rebalance keeps the graph valid
            ids = layer._balancer.route(ids)
        tokens, handle = self.dispatcher.dispatch(self.x, ids, w)
        self.out.copy_(self.dispatcher.combine(layer.experts(tokens), handle))

    def _graph(self, from_logits: bool):
        g = self._graphs.get(from_logits)
        if g is None:
            recorder = self.layer._balancer.recorder if self.layer._balancer is not None else None
            counted = recorder.current.clone() if recorder is not None else None  # warm-up calls do not count
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy init, Triton compiles, NCCL setup outside capture
                    self._body(from_logits)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._body(from_logits)
            self._graphs[from_logits] = g
            if counted is not None:
                recorder.current.copy_(counted)
        return g

    def __call__(
        self,
        hidden_states: torch.Tensor,
        router_logits: Optional[torch.Tensor] = None,
        *,
        topk_ids: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        return_routing: bool = False,
    ) -> Union[torch.Tensor, MoEOutput]:
        T = hidden_states.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"{T} tokens exceed this decode runner's max_tokens={self.max_tokens}; "
                             "build a runner for more tokens or use EPMoE.forward")
        if torch.is_grad_enabled() and (self.layer.training_config is not None or any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden_states, router_logits, topk_weights))):
            raise RuntimeError(
                "decode runners do not train (their static buffers and CUDA graphs hold no autograd graph); call "
                "the runner under torch.no_grad() / torch.inference_mode(), or EPMoE.forward for training")
        error = self.layer._check_local(hidden_states, router_logits, topk_ids, topk_weights)
        if error is not None:
            raise error
        balancer = self.layer._balancer
        if balancer is not None and balancer.due:
            self.layer._auto_rebalance()
        self.x[:T].copy_(hidden_states)
        self.x[T:].zero_()
        from_logits = router_logits is not None
        if from_logits:
            self.logits[:T].copy_(router_logits)
        else:
            self.ids[:T].copy_(topk_ids)
            self.weights[:T].copy_(topk_weights)
        self.count.fill_(T)
        self.layer._watch.next_call()
        armed = self.layer._arm_watchdog("decode runner")
        try:
            if self.cuda_graph:
                self._graph(from_logits).replay()
            else:
                self._body(from_logits)
        finally:
            if armed is not None:
                armed.launched(_watchdog.completion_marker(self.layer.device))
        if balancer is not None:
            balancer.end_call()
        out = self.out[:T]
        if return_routing:
            return MoEOutput(out, Routing(self.topk_ids_out[:T], self.topk_weights_out[:T]))
        return out


def _check_finite_weights(w: ExpertWeights, corr: Optional[torch.Tensor], expert_ids: Sequence[int]) -> None:
    """NaN/Inf in one rank's weights would poison the tokens other ranks send it: refuse at load,
    naming the tensor and the expert (expert_ids: the logical expert of each row; float tensors only;
    packed quantized data has no NaN)."""
    for name, t in w.tensors().items():
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or t.numel() == 0:
            continue
        ok = torch.isfinite(t).reshape(t.shape[0] if t.dim() else 1, -1).all(dim=1)
        if not bool(ok.all()):
            e = expert_ids[int((~ok).nonzero()[0])]
            raise ValueError(f"expert weight {name!r} of expert {e} holds NaN/Inf values; fix the checkpoint "
                             "(nothing was loaded on any rank)")
    if corr is not None and not bool(torch.isfinite(corr).all()):
        raise ValueError("e_score_correction_bias holds NaN/Inf values; fix the checkpoint")


def _resolve_placement(config: MoEConfig, ep_size: int, eplb: Optional[EPLBConfig],
                       placement: Union[Placement, Sequence[int], None]) -> Optional[Placement]:
    """The placement a layer starts from (None: the contiguous one without EPLB). ValueError / TypeError
    naming the field (the layer agrees on it across ranks)."""
    if eplb is not None and not isinstance(eplb, EPLBConfig):
        raise TypeError(f"eplb is a {type(eplb).__name__}; pass an epmoe.eplb.EPLBConfig or None")
    E = config.num_experts
    if placement is not None:
        if isinstance(placement, Mapping):
            placement = Placement.from_dict(placement)
        elif not isinstance(placement, Placement):
            if isinstance(placement, (str, bytes)) or not isinstance(placement, Sequence):
                raise TypeError(f"placement is a {type(placement).__name__}; pass an epmoe.Placement or its "
                                "slot_to_expert list")
            placement = Placement(E, ep_size, tuple(placement))
        if placement.num_experts != E:
            raise ValueError(f"placement.num_experts={placement.num_experts}; the layer has num_experts={E}")
        if placement.ep_size != ep_size:
            raise ValueError(f"placement.ep_size={placement.ep_size}; the layer's EP group has {ep_size} ranks")
        if eplb is not None and placement.num_slots != E + eplb.num_redundant_experts:
            raise ValueError(
                f"placement.num_slots={placement.num_slots} but eplb.num_redundant_experts="
                f"{eplb.num_redundant_experts} asks for {E + eplb.num_redundant_experts} slots (E + R); make them agree")
        return placement
    if eplb is None:
        return None
    R = eplb.num_redundant_experts
    S = E + R
    if S % ep_size:
        fit = R + (-S) % ep_size
        raise ValueError(
            f"num_experts={E} + eplb.num_redundant_experts={R} = {S} slots is not divisible by the EP size {ep_size}; "
            f"choose num_redundant_experts so that E + R is a multiple of {ep_size} (e.g. {fit})")
    if S > E * ep_size:
        raise ValueError(f"eplb.num_redundant_experts={R} gives {S} slots for {E} experts on {ep_size} ranks: more than "
                         f"one replica per rank; use at most {E * ep_size - E}")
    if ep_size % eplb.num_nodes:
        raise ValueError(f"eplb.num_nodes={eplb.num_nodes} does not divide the EP size {ep_size}")
    return initial_placement(E, ep_size, S, num_nodes=eplb.num_nodes, expert_groups=eplb.expert_groups)
