"""The one resolver: which dispatcher, experts backend and wire format run a layer.

    env  = detect_environment(device)                  # arch, FlashInfer version, packages (no imports)
    plan = resolve_plan(config, dispatcher="torch", experts="auto", quant=None, dispatch_dtype="auto",
                        environment=env, ep_size=2)     # a frozen QuantPlan

The backend classes are the only place that knows what they run: the resolver builds a typed
`BackendRequest` and asks them (`supports`, `consumes`, `accepts_wire`). It walks the experts
registry in preference order (`experts_preference`), records why each skipped candidate was
skipped (`QuantPlan.skipped`, printed by `--plan`), and lets the KERNEL decide the wire: with
dispatch dtype "auto" tokens travel in what the chosen experts consume when the dispatcher can move
it, else unquantized. EPMoE, the launcher's --plan and --doctor all call `resolve_plan`.

Lives at the layer level (it imports `epmoe.dispatch` and `epmoe.experts`); the plan record and the
format rules stay in `epmoe.quant.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from epmoe.config import MoEConfig, dtype_name
from epmoe.core.availability import Availability
from epmoe.core.capability import PACKAGE_NAMES, BackendRequest
from epmoe.core.imports import is_installed
from epmoe.dispatch import DISPATCHERS
from epmoe.experts import EXPERTS
from epmoe.quant.plan import (
    ARCHES,
    EXPERT_MODES,
    QuantPlan,
    _check_choice,
    _parse_version,
    detect_arch,
    installed_flashinfer_version,
    normalize_arch,
    resolve_mode,
)

DISPATCH_DTYPES = ("auto", "bf16", "nvfp4", "fp8")
WIRES = ("bf16", "nvfp4", "fp8")

# Which experts backend to prefer when several can run a plan (fastest first, by arch; measured on
# H200 for sm90: docs/benchmarks.md). Backends not listed come before "masked_reference"/"reference".
_PREFERENCE: Dict[str, Tuple[str, ...]] = {
    "sm90": ("triton", "grouped_mm", "flashinfer_cutlass"),
    "sm100": ("flashinfer_trtllm", "flashinfer_cutedsl", "flashinfer_cutlass", "triton", "grouped_mm"),
    "sm120": ("flashinfer_cutlass", "triton"),
}
_FALLBACKS = ("masked_reference", "reference")


@dataclass(frozen=True)
class MeasuredChoice:
    """One row of the measured `experts="auto"` table: up to `max_tokens` tokens per rank per forward
    (None: any larger batch) the fastest backend that was also checked correct was `backend`; `evidence`
    is the measurement (machine, date, times) that `--plan` quotes."""

    max_tokens: Optional[int]
    backend: str
    evidence: str


# experts="auto": per arch and expert mode, the backend measured fastest (and checked correct) at each
# batch size, from `benchmarks/bench_experts.py` (DeepSeek-V3 expert shape, 128 local experts, decode
# T=128 and prefill T=4096 per rank, same run; docs/benchmarks.md "Expert stage"). The
# batch is the layer's max tokens per rank. FlashInfer's module there was a FAST_BUILD (one tile shape).
_H200 = "H200 2026-12-04 (docs/results/h200-2026-12-04)"
_H200_07 = "H200 2026-12-07 (docs/results/h200-2026-12-07)"
MEASURED_AUTO: Dict[Tuple[str, str], Tuple[MeasuredChoice, ...]] = {
    ("sm90", "bf16"): (
        MeasuredChoice(128, "triton", f"{_H200}: T=128 triton 2.528 ms, flashinfer_cutlass 2.584 ms"),
        MeasuredChoice(None, "triton", f"{_H200}: T=4096 triton 6.76 ms, flashinfer_cutlass 7.69 ms"),
    ),
    ("sm90", "fp8_block"): (
        MeasuredChoice(128, "triton", f"{_H200}: T=128 triton 1.352 ms, flashinfer_cutlass 1.742 ms"),
        MeasuredChoice(None, "deepgemm", f"{_H200_07}: T=4096 deepgemm 3.761 ms, triton 5.282 ms, "
                                         "flashinfer_cutlass 5.786 ms"),
    ),
    ("sm90", "mxfp4_w4a16"): (
        MeasuredChoice(128, "triton", f"{_H200}: T=128 triton 0.939 ms, flashinfer_cutlass 43.0 ms"),
        MeasuredChoice(None, "triton", f"{_H200}: T=4096 triton 6.390 ms, flashinfer_cutlass 109.2 ms"),
    ),
    ("sm90", "mxfp4_w4a8"): (
        MeasuredChoice(128, "flashinfer_cutlass", f"{_H200}: T=128 0.889 ms (the one sm90 kernel of this mode)"),
        MeasuredChoice(None, "flashinfer_cutlass", f"{_H200}: T=4096 4.189 ms (the one sm90 kernel of this mode)"),
    ),
}


def measured_choice(arch: str, mode: str, max_tokens_per_rank: Optional[int]) -> Optional[MeasuredChoice]:
    """The MEASURED_AUTO row for a layer of `max_tokens_per_rank` (None: the largest batch row)."""
    rows = MEASURED_AUTO.get((arch, mode), ())
    for row in rows:
        if row.max_tokens is not None and max_tokens_per_rank is not None and max_tokens_per_rank <= row.max_tokens:
            return row
    return rows[-1] if rows else None


def experts_preference(arch: str, registered: Optional[Sequence[str]] = None) -> List[str]:
    """Experts backend names in the order `experts="auto"` tries them on `arch`."""
    names = list(EXPERTS.names() if registered is None else registered)
    first = [n for n in _PREFERENCE.get(arch, ()) if n in names]
    rest = [n for n in names if n not in first and n not in _FALLBACKS]
    return first + rest + [n for n in _FALLBACKS if n in names]


# ---------------------------------------------------------------------------- environment
@dataclass(frozen=True)
class Environment:
    """What the resolver may assume about the machine: arch family, FlashInfer version (None: not
    installed) and the optional packages / prebuilt modules present (`BackendRequest.packages`)."""

    arch: str = "cpu"
    flashinfer_version: Optional[str] = None
    packages: FrozenSet[str] = frozenset()

    @classmethod
    def hypothetical(cls, arch: str, flashinfer_version: Optional[str] = None, *, deep_ep: bool = True) -> "Environment":
        """A machine of `arch` with every optional package installed (FlashInfer only when a version is
        given, with its prebuilt modules): for planning on another machine, the support matrix, tests."""
        arch = normalize_arch(arch)
        pk = {"triton", "cuda", "pynvml", "mpi4py", "deep_gemm"}
        if deep_ep:
            pk.add("deep_ep")
        if flashinfer_version is not None:
            from epmoe.experts.flashinfer_cutlass import fused_moe_package

            pk |= {"flashinfer", "cutlass", fused_moe_package(arch)}
        if arch == "cpu":
            pk = {p for p in pk if p in ("triton", "mpi4py")} | ({"flashinfer"} if flashinfer_version else set())
        return cls(arch=arch, flashinfer_version=flashinfer_version, packages=frozenset(pk))


def detect_environment(device=None, arch: Optional[str] = None) -> Environment:
    """This machine: the arch of `device` (or `arch`), the installed FlashInfer version (package
    metadata), installed optional packages (import specs only: nothing is imported, so DeepEP's and
    FlashInfer's import-time side effects never run) and FlashInfer's prebuilt fused-MoE module."""
    arch = normalize_arch(arch) if arch is not None else detect_arch(device if device is not None else "cpu")
    packages = {p for p in PACKAGE_NAMES if is_installed(p)}
    version = installed_flashinfer_version()
    if version is not None:
        packages.add("flashinfer")
        if arch not in ("cpu",):
            status = _fused_moe_prebuilt(arch)
            if status:
                from epmoe.experts.flashinfer_cutlass import fused_moe_package

                packages.add(fused_moe_package(arch))
    return Environment(arch=arch, flashinfer_version=version, packages=frozenset(packages))


def _fused_moe_prebuilt(arch: str) -> Optional[str]:
    try:
        from epmoe.experts.flashinfer_cutlass import ARCH_NUMBER, fused_moe_module_name, prebuilt_module_status

        return prebuilt_module_status(fused_moe_module_name(ARCH_NUMBER[arch]))
    except Exception:  # noqa: BLE001 - FlashInfer's jit env missing or broken: not prebuilt
        return None


# ---------------------------------------------------------------------------- the resolver

@dataclass(frozen=True)
class _Candidate:
    name: str
    wire: str
    notes: Tuple[str, ...] = ()


def resolve_plan(
    config: MoEConfig,
    *,
    dispatcher: str = "torch",
    experts: str = "auto",
    quant: Optional[str] = None,
    dispatch_dtype: str = "auto",
    humming: bool = False,
    mxfp8_act_scaling: bool = False,
    environment: Optional[Environment] = None,
    ep_size: int = 1,
    max_tokens_per_rank: Optional[int] = None,
    training: bool = False,
) -> QuantPlan:
    """Resolve the plan once. Raises ValueError naming the conflicting settings and the fix.

    dispatcher:     a name in epmoe.dispatch.DISPATCHERS
    experts:        "auto" or a name in epmoe.experts.EXPERTS
    quant:          None / "auto" (from the checkpoint) or one of EXPERT_MODES
    dispatch_dtype: "auto" (the experts' kernel decides), "bf16", "nvfp4", "fp8"
    environment:    what to assume (default: `Environment()`, a CPU without optional packages;
                    EPMoE passes `detect_environment(device)`)
    ep_size:        ranks in the EP group
    max_tokens_per_rank: the batch `experts="auto"` picks for (MEASURED_AUTO); None: the largest
    training:       gradients flow through the layer: the dispatcher and the experts must answer yes to
                    `supports_training` (quantized modes and wires are inference-only); docs/training.md
    """
    env = environment or Environment()
    _check_choice("dispatch dtype", dispatch_dtype, DISPATCH_DTYPES)
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {dispatcher!r}; choose one of {DISPATCHERS.names()}")
    if experts != "auto" and experts not in EXPERTS:
        raise ValueError(f"unknown experts backend {experts!r}; choose 'auto' or one of {EXPERTS.names()}")
    md = resolve_mode(
        config, requested_mode=quant, arch=env.arch, flashinfer_version=env.flashinfer_version,
        humming=humming, mxfp8_act_scaling=mxfp8_act_scaling,
    )
    d_cls = DISPATCHERS.get(dispatcher)
    base = BackendRequest(
        expert_mode=md.mode, layout=getattr(d_cls, "layout", "flat"), wire="bf16", arch=md.arch,
        flashinfer_version=env.flashinfer_version, ep_size=ep_size, packages=env.packages,
        model_dtype=dtype_name(config.dtype), act_format=md.act_format, humming=md.humming,
        mxfp8_act_scaling=md.mxfp8_act_scaling, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_experts=config.num_experts, top_k=config.top_k,
        checkpoint=md.family, has_bias=config.has_bias, training=bool(training),
    )

    # the dispatcher must run here at all (bf16 wire, or the explicit one)
    first_wire = "bf16" if dispatch_dtype == "auto" else dispatch_dtype
    ok = _ask(d_cls, "supports", replace(base, wire=first_wire))
    if not ok:
        raise ValueError(
            f"dispatcher {dispatcher!r} cannot run this plan ({md.mode} experts, dispatch {dispatch_dtype}, "
            f"{md.arch}): {ok.reason}" + (f"; {ok.hint}" if ok.hint else "")
        )

    if training:
        ok = _ask_training(d_cls, replace(base, wire=first_wire))
        if not ok:
            raise ValueError(f"training through dispatcher {dispatcher!r} (dispatch {dispatch_dtype}): {ok.reason}"
                             + (f"; {ok.hint}" if ok.hint else ""))

    order = experts_preference(md.arch) if experts == "auto" else [experts]
    # the table was measured on the flat layout; the masked layout has its own backends
    measured = measured_choice(md.arch, md.mode, max_tokens_per_rank) \
        if experts == "auto" and base.layout == "flat" else None
    if measured is not None and measured.backend in order:
        order = [measured.backend] + [n for n in order if n != measured.backend]
    skipped: List[str] = []
    chosen: Optional[_Candidate] = None
    for name in order:
        cand = _try_experts(name, base, d_cls, dispatch_dtype)
        if isinstance(cand, Availability):
            skipped.append(f"{name}: {cand.reason}" + (f" ({cand.hint})" if cand.hint else ""))
            continue
        chosen = cand
        break
    if chosen is None:
        if experts != "auto":
            raise ValueError(
                f"experts backend {experts!r} cannot run {md.mode} ({base.layout} layout, dispatch "
                f"{dispatch_dtype}) on {md.arch}: {skipped[0].split(': ', 1)[1]}; backends that can: "
                f"{_who_can(base, d_cls, dispatch_dtype) or 'none'} (or experts='auto')"
            )
        raise ValueError(
            f"no experts backend runs {md.mode} ({base.layout} layout from dispatcher {dispatcher!r}, "
            f"dispatch {dispatch_dtype}) on {md.arch}: " + "; ".join(skipped)
            + ". Choose another quant mode, dispatcher or dispatch dtype"
        )
    notes = list(md.notes) + list(chosen.notes)
    if experts == "auto":
        if chosen.name in _FALLBACKS and md.arch != "cpu":
            notes.append(f"experts auto -> {chosen.name}: no fast kernel runs {md.mode} ({base.layout} layout, "
                         f"dispatch {chosen.wire}) on {md.arch} here (emulation in float32; slow)")
        elif measured is not None and chosen.name == measured.backend:
            smaller = [r.max_tokens for r in MEASURED_AUTO[(md.arch, md.mode)] if r.max_tokens is not None]
            batch = f"<= {measured.max_tokens}" if measured.max_tokens is not None else \
                f"> {max(smaller)}" if smaller else "any number of"
            notes.append(f"experts auto -> {chosen.name}: measured fastest and checked for {md.mode} at {batch} "
                         f"tokens/rank ({measured.evidence})")
        else:
            why = f", not the measured {measured.backend} (it cannot run this plan)" if measured is not None else ""
            notes.append(f"experts auto -> {chosen.name}" + (f" (skipped {len(skipped)})" if skipped else "") + why)
    return QuantPlan(
        expert_mode=md.mode, dispatch_dtype=chosen.wire, combine_dtype="bf16", experts_backend=chosen.name,
        dispatcher=dispatcher, arch=md.arch, act_format=md.act_format, checkpoint_quant=md.family,
        humming=md.humming, mxfp8_act_scaling=md.mxfp8_act_scaling, flashinfer_version=env.flashinfer_version,
        notes=tuple(notes), layout=base.layout, skipped=tuple(skipped), training=bool(training),
    )


def _try_experts(name: str, base: BackendRequest, d_cls, dispatch_dtype: str):
    """A _Candidate, or the Availability saying why `name` cannot run the plan."""
    e_cls = EXPERTS.get(name)
    ok = _ask(e_cls, "supports", base)
    if not ok:
        return ok
    if base.training:
        ok = _ask_training(e_cls, base)
        if not ok:
            return ok
    consumed = e_cls.consumes(base) if hasattr(e_cls, "consumes") else "bf16"
    if dispatch_dtype == "auto":
        if consumed == "bf16":
            return _Candidate(name, "bf16", (f"dispatch auto -> bf16 ({name} {base.expert_mode} consumes unquantized tokens)",))
        if _ask(d_cls, "supports", replace(base, wire=consumed)):
            return _Candidate(name, consumed, (
                f"dispatch auto -> {consumed} ({name} {base.expert_mode} consumes {consumed}; quantized once, before the A2A)",))
        return _Candidate(name, "bf16", (
            f"dispatch auto -> bf16 ({d_cls.name} cannot move {consumed}; the experts quantize after dispatch)",))
    wire = dispatch_dtype
    ok = _ask(d_cls, "supports", replace(base, wire=wire))
    if not ok:
        return ok
    ok = e_cls.accepts_wire(replace(base, wire=wire), wire) if hasattr(e_cls, "accepts_wire") else \
        Availability(wire == "bf16", f"it takes bf16 tokens, not {wire}")
    if not ok:
        return ok
    notes = ()
    if wire not in ("bf16", consumed):
        again = "" if base.expert_mode == "bf16" else f" and quantized again by {name} (its kernel takes {consumed})"
        notes = (f"dispatch {wire} for {base.expert_mode} experts: tokens are quantized before the A2A and "
                 f"dequantized on arrival{again} (lossy transport, requested explicitly)",)
    return _Candidate(name, wire, notes)


def _ask(cls, what: str, request: BackendRequest) -> Availability:
    """cls.supports(request); a registered class without it (not derived from Dispatcher / Experts)
    runs bf16 on the flat layout only."""
    fn = getattr(cls, what, None)
    if fn is None:
        ok = request.wire == "bf16" and request.layout == "flat"
        return Availability(ok, "" if ok else "it declares no capabilities (supports) beyond bf16, flat layout")
    return fn(request)


def _ask_training(cls, request: BackendRequest) -> Availability:
    """cls.supports_training(request); a registered class without it does not train."""
    fn = getattr(cls, "supports_training", None)
    if fn is None:
        return Availability.no(f"{getattr(cls, 'name', cls.__name__)!r} declares no training support")
    return fn(request)


def _who_can(base: BackendRequest, d_cls, dispatch_dtype: str) -> List[str]:
    return [n for n in experts_preference(base.arch) if isinstance(_try_experts(n, base, d_cls, dispatch_dtype), _Candidate)]


def resolve_quant_plan(
    config: MoEConfig,
    *,
    requested_mode: Optional[str] = None,
    dispatch_dtype: str = "auto",
    dispatcher: str = "torch",
    experts_backend: str = "auto",
    arch: str = "cpu",
    flashinfer_version: Optional[str] = None,
    humming: bool = False,
    mxfp8_act_scaling: bool = False,
    ep_size: int = 1,
    packages: Optional[FrozenSet[str]] = None,
) -> QuantPlan:
    """`resolve_plan` with the earlier keyword names, for a machine of `arch` with every optional
    package installed (FlashInfer when `flashinfer_version` is given) unless `packages` says which."""
    if flashinfer_version is not None:
        _parse_version(flashinfer_version, "flashinfer_version")
    env = Environment.hypothetical(arch, flashinfer_version)
    if packages is not None:
        env = replace(env, packages=frozenset(packages))
    plan = resolve_plan(
        config, dispatcher=dispatcher, experts=experts_backend, quant=requested_mode, dispatch_dtype=dispatch_dtype,
        humming=humming, mxfp8_act_scaling=mxfp8_act_scaling, environment=env, ep_size=ep_size,
    )
    if env.arch != arch:
        plan = replace(plan, notes=(f"arch {arch} -> {env.arch} family",) + plan.notes)
    return plan


# ---------------------------------------------------------------------------- enumeration
@dataclass(frozen=True)
class Combination:
    """One (mode x dispatcher x experts x wire x arch) the resolver was asked about: `plan` when it
    accepted it (resolved with experts and dispatch dtype explicit), else `reason`."""

    arch: str
    mode: str
    dispatcher: str
    experts: str
    wire: str
    plan: Optional[QuantPlan] = None
    reason: str = ""

    @property
    def accepted(self) -> bool:
        return self.plan is not None


def enumerate_combinations(
    config: MoEConfig, arches: Sequence[str] = ("cpu", "sm90", "sm100", "sm120"), *,
    flashinfer_version: str = "0.7.2.post1", ep_size: int = 2,
) -> Iterator[Combination]:
    """Every (arch, mode, dispatcher, experts, wire) asked of the resolver, accepted or not (with the
    reason). Quantized modes are requested as online quantization of an unquantized checkpoint."""
    for arch in arches:
        env = Environment.hypothetical(arch, flashinfer_version)
        for mode in EXPERT_MODES:
            for dispatcher in DISPATCHERS.names():
                for experts in EXPERTS.names():
                    for wire in WIRES:
                        try:
                            plan = resolve_plan(
                                config, dispatcher=dispatcher, experts=experts, quant=mode, dispatch_dtype=wire,
                                environment=env, ep_size=ep_size,
                            )
                        except ValueError as e:
                            yield Combination(arch, mode, dispatcher, experts, wire, reason=str(e))
                        else:
                            yield Combination(arch, mode, dispatcher, experts, wire, plan=plan)


__all__ = [
    "ARCHES",
    "Combination",
    "DISPATCH_DTYPES",
    "Environment",
    "detect_environment",
    "enumerate_combinations",
    "experts_preference",
    "resolve_plan",
    "resolve_quant_plan",
]
