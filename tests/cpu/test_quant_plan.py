"""Every QuantPlan rule (docs/quant-plan.md lists rule -> test)."""

import dataclasses

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.quant import codec
from epmoe.experts import EXPERTS
from epmoe.quant.plan import QuantPlan, detect_arch, flashinfer_at_least
from epmoe.resolve import Environment, experts_preference, resolve_quant_plan

EXPERTS_BACKEND_NAMES = tuple(EXPERTS.names())

FI = "0.7.2.post1"


def cfg(quant_method=None, **kw):
    # hidden 2048: a size DeepEP's low-latency kernels are compiled for
    base = dict(num_experts=8, top_k=2, hidden_size=2048, intermediate_size=128, quant_method=quant_method)
    base.update(kw)
    return MoEConfig(**base)


def notes(plan):
    return "\n".join(plan.notes)


# ------------------------------------------------------------------ validation and compatibility
def test_old_call_signature():
    p = resolve_quant_plan(
        cfg(), requested_mode="bf16", dispatch_dtype="auto", dispatcher="torch", experts_backend="reference", arch="cpu"
    )
    assert (p.expert_mode, p.dispatch_dtype, p.combine_dtype, p.experts_backend, p.dispatcher, p.arch) == (
        "bf16", "bf16", "bf16", "reference", "torch", "cpu",
    )
    assert "dispatch auto -> bf16" in notes(p)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(requested_mode="int4"), "unknown quant mode 'int4'"),
        (dict(dispatch_dtype="fp4"), "unknown dispatch dtype 'fp4'"),
        (dict(dispatcher="nccl"), "unknown dispatcher 'nccl'"),
        (dict(arch="sm75"), "unknown arch 'sm75'"),
        (dict(experts_backend="cutlass"), "unknown experts backend 'cutlass'"),
        (dict(flashinfer_version="latest"), "flashinfer_version='latest' is not a valid version"),
    ],
)
def test_rejects_unknown_names(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_quant_plan(cfg(), **kwargs)


def test_option_types_are_checked():
    with pytest.raises(TypeError, match="humming must be True or False"):
        resolve_quant_plan(cfg("mxfp4"), humming="yes")
    with pytest.raises(TypeError, match="mxfp8_act_scaling must be True or False"):
        resolve_quant_plan(cfg("mxfp4"), mxfp8_act_scaling=1)
    with pytest.raises(TypeError, match="MoEConfig"):
        resolve_quant_plan({"hidden_size": 1})


def test_unknown_checkpoint_method():
    with pytest.raises(ValueError, match="checkpoint quant_method='gptq' is not supported"):
        resolve_quant_plan(cfg("gptq"))


@pytest.mark.parametrize(
    "method,arch,mode",
    [
        (None, "cpu", "bf16"),
        (None, "sm90", "bf16"),
        ("fp8", "sm90", "fp8_block"),
        ("fp8", "sm100", "fp8_block"),
        ("mxfp4", "sm90", "mxfp4_w4a16"),
        ("mxfp4", "sm100", "mxfp4_w4a16"),
        ("modelopt_fp4", "sm100", "nvfp4_w4a4"),
        ("nvfp4", "sm120", "nvfp4_w4a4"),
        ("modelopt_fp4", "sm90", "nvfp4_w4a16"),
        ("nvfp4", "cpu", "nvfp4_w4a4"),
        ("mxfp8", "sm100", "mxfp8"),
    ],
)
def test_default_modes(method, arch, mode):
    p = resolve_quant_plan(cfg(method), arch=arch)
    assert p.expert_mode == mode
    assert f"quant mode auto -> {mode}" in notes(p)  # every default is recorded
    if method == "modelopt_fp4" and arch == "sm90":
        assert "no FP4 MMA" in notes(p)
    p2 = resolve_quant_plan(cfg(method), arch=arch, requested_mode="auto")
    assert p2 == p


def test_mode_incompatible_with_checkpoint():
    with pytest.raises(ValueError, match=r"quant mode 'nvfp4_w4a4' cannot run a mxfp4 checkpoint.*choose one of"):
        resolve_quant_plan(cfg("mxfp4"), requested_mode="nvfp4_w4a4")
    with pytest.raises(ValueError, match="cannot run a fp8 checkpoint"):
        resolve_quant_plan(cfg("fp8"), requested_mode="mxfp4_w4a16")


def test_mode_notes_online_and_dequant():
    assert "quantized online to fp8_block" in notes(resolve_quant_plan(cfg(), requested_mode="fp8_block"))
    assert "dequantized to the model dtype" in notes(resolve_quant_plan(cfg("fp8"), requested_mode="bf16"))


# ------------------------------------------------------------------ dispatch dtype rules (the kernel decides)
@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("dispatcher", ["flashinfer", "torch", "deepep"])
def test_w4a16_auto_never_nvfp4(mode, dispatcher):
    p = resolve_quant_plan(cfg(), requested_mode=mode, dispatcher=dispatcher, arch="sm90", ep_size=4, flashinfer_version=FI)
    assert p.dispatch_dtype == "bf16" and p.is_w4a16
    assert "consumes unquantized tokens" in notes(p)


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_w4a16_explicit_nvfp4_dispatch_rejected(mode):
    with pytest.raises(ValueError) as e:
        resolve_quant_plan(cfg(), requested_mode=mode, dispatch_dtype="nvfp4", dispatcher="flashinfer", arch="sm90",
                           flashinfer_version=FI)
    msg = str(e.value)
    assert "dispatch nvfp4" in msg and mode in msg  # names both settings
    assert "consumes bf16 activations" in msg and "dispatch dtype 'auto'" in msg  # why, and the fix


def test_w4a4_wire_is_what_the_kernel_consumes():
    # CPU: the emulating reference consumes NVFP4 -> tokens travel as NVFP4, quantized once
    for dispatcher in ("torch",):
        p = resolve_quant_plan(cfg("nvfp4"), arch="cpu", dispatcher=dispatcher)
        assert (p.expert_mode, p.dispatch_dtype, p.act_format) == ("nvfp4_w4a4", "nvfp4", "nvfp4")
        assert "quantized once, before the A2A" in notes(p)
    # SM100: CuTe-DSL quantizes BF16 itself -> auto moves BF16 (no dequantize/requantize round trip)
    for dispatcher in ("torch", "flashinfer"):
        p = resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatcher=dispatcher, flashinfer_version=FI)
        assert (p.expert_mode, p.experts_backend, p.dispatch_dtype) == ("nvfp4_w4a4", "flashinfer_cutedsl", "bf16")
        # explicit NVFP4 wire is accepted and says it is a round trip
        q = resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatcher=dispatcher, flashinfer_version=FI,
                               dispatch_dtype="nvfp4")
        assert q.dispatch_dtype == "nvfp4" and "quantized again by flashinfer_cutedsl" in notes(q)


def test_w4a4_explicit_bf16_dispatch_allowed():
    p = resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatch_dtype="bf16", flashinfer_version=FI)
    assert p.dispatch_dtype == "bf16" and p.expert_mode == "nvfp4_w4a4"


def test_deepep_ll_runs_only_what_masked_experts_run():
    # nvfp4 W4A16 and W4A4: no masked-layout experts backend runs them -> rejected with every reason
    for arch, fi in (("sm90", None), ("sm100", FI)):
        with pytest.raises(ValueError, match=r"no experts backend runs nvfp4_w4a\d+ \(masked layout") as e:
            resolve_quant_plan(cfg("nvfp4"), arch=arch, dispatcher="deepep_ll", flashinfer_version=fi)
        assert "masked_reference:" in str(e.value) and "W4A4 only" in str(e.value) or "implements" in str(e.value)
    with pytest.raises(ValueError, match="no experts backend"):
        resolve_quant_plan(cfg("nvfp4"), arch="sm100", requested_mode="nvfp4_w4a4", dispatcher="deepep_ll",
                           flashinfer_version=FI)
    # sm90 with DeepGEMM: its masked grouped GEMMs; without it, the masked reference
    p = resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher="deepep_ll")
    assert (p.expert_mode, p.layout, p.dispatch_dtype, p.experts_backend) == ("fp8_block", "masked", "fp8", "deepgemm")
    no_dg = Environment.hypothetical("sm90").packages - {"deep_gemm"}
    p = resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher="deepep_ll", packages=no_dg)
    assert (p.expert_mode, p.layout, p.dispatch_dtype, p.experts_backend) == ("fp8_block", "masked", "fp8", "masked_reference")
    assert any(s.startswith("deepgemm: deep_gemm is not installed") for s in p.skipped)


def test_deepep_nvfp4_rejected_auto_bf16_or_fp8():
    with pytest.raises(ValueError, match=r"DeepEP moves bf16 or fp8 .* not nvfp4"):
        resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatcher="deepep", dispatch_dtype="nvfp4", ep_size=4)
    with pytest.raises(ValueError, match="dispatcher 'deepep_ll'"):
        resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatcher="deepep_ll", dispatch_dtype="nvfp4")
    p = resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatcher="deepep", ep_size=4, flashinfer_version=FI)
    assert p.dispatch_dtype == "bf16"
    p = resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher="deepep", ep_size=4)
    assert p.dispatch_dtype == "fp8" and p.experts_backend == "deepgemm"  # deepgemm consumes fp8 1x128
    p = resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher="deepep", ep_size=4, experts_backend="triton")
    assert p.dispatch_dtype == "fp8"  # triton consumes fp8 1x128 too


def test_flashinfer_dispatcher_never_gets_fp8():
    """FlashInfer's A2A has no FP8 payload layout: auto moves BF16 to FP8 experts, explicit fp8 fails."""
    p = resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher="flashinfer", flashinfer_version=FI)
    assert p.dispatch_dtype == "bf16" and "flashinfer cannot move fp8" in notes(p)
    with pytest.raises(ValueError, match=r"dispatcher 'flashinfer' cannot run .*not fp8"):
        resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher="flashinfer", dispatch_dtype="fp8", flashinfer_version=FI)


def test_no_reference_dispatcher():
    with pytest.raises(ValueError, match=r"unknown dispatcher 'reference'; choose one of"):
        resolve_quant_plan(cfg(), dispatcher="reference")


@pytest.mark.parametrize("dispatcher", ["torch", "deepep", "deepep_ll"])
def test_fp8_dispatch_rules(dispatcher):
    p = resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher=dispatcher, ep_size=4)
    assert p.dispatch_dtype == "fp8"
    assert resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher=dispatcher, dispatch_dtype="bf16",
                              ep_size=4).dispatch_dtype == "bf16"
    # bf16 experts take an explicit fp8 dispatch, dequantized on arrival (noted in the plan)
    p = resolve_quant_plan(cfg(), arch="sm90", dispatcher=dispatcher, dispatch_dtype="fp8", ep_size=4)
    assert p.dispatch_dtype == "fp8" and any("dequantized on arrival" in n for n in p.notes), p.describe()
    with pytest.raises(ValueError, match=r"not nvfp4|quantized for nothing|no experts backend"):
        resolve_quant_plan(cfg("fp8"), arch="sm90", dispatcher=dispatcher, dispatch_dtype="nvfp4", ep_size=4)


def test_combine_is_model_dtype():
    for method in (None, "fp8", "nvfp4", "mxfp4"):
        assert resolve_quant_plan(cfg(method), arch="sm100").combine_dtype == "bf16"


# ------------------------------------------------------------------ Humming / MXFP8 options
def test_humming_sm90():
    p = resolve_quant_plan(cfg("mxfp4"), arch="sm90", humming=True, flashinfer_version=FI)
    assert (p.expert_mode, p.act_format, p.humming, p.experts_backend, p.dispatch_dtype) == (
        "mxfp4_w4a8", "fp8", True, "flashinfer_cutlass", "bf16",
    )
    assert "mxfp4_w4a16 -> mxfp4_w4a8" in notes(p)


@pytest.mark.parametrize("arch", ["sm100", "sm120"])
def test_humming_inert_on_blackwell(arch):
    # no error, no FlashInfer needed, the arch's MXFP4 mode kept, a note recorded
    p = resolve_quant_plan(cfg("mxfp4"), arch=arch, humming=True, flashinfer_version=None)
    assert p.expert_mode == "mxfp4_w4a16" and p.humming is False and p.act_format == "bf16"
    assert f"humming=True is inert on {arch}" in notes(p)
    p = resolve_quant_plan(cfg("mxfp4"), arch=arch, humming=True, flashinfer_version="0.6.17")
    assert p.humming is False


@pytest.mark.parametrize(
    "version,ok",
    [(None, False), ("0.6.17", False), ("0.6.18rc1", False), ("0.6.18.dev3", False),
     ("0.6.18", True), ("0.6.18.post1", True), ("0.7.2.post1", True), ("0.10.0", True)],
)
def test_humming_version_gate(version, ok):
    if ok:
        assert resolve_quant_plan(cfg("mxfp4"), arch="sm90", humming=True, flashinfer_version=version).humming
        return
    with pytest.raises(ValueError) as e:
        resolve_quant_plan(cfg("mxfp4"), arch="sm90", humming=True, flashinfer_version=version)
    msg = str(e.value)
    assert "FlashInfer >= 0.6.18" in msg
    assert ("not installed" in msg) if version is None else (f"found {version}" in msg)


def test_version_compare_uses_packaging():
    assert not flashinfer_at_least("0.6.18rc1", "0.6.18")  # release[:3] would wrongly pass this
    assert flashinfer_at_least("0.6.18", "0.6.18") and flashinfer_at_least("0.6.18.post1", "0.6.18")
    assert not flashinfer_at_least(None, "0.6.18")
    assert flashinfer_at_least("0.10.0", "0.6.18")  # not a string comparison


def test_humming_cpu_rejected():
    with pytest.raises(ValueError, match=r"humming=True needs an SM90 GPU with FlashInfer >= 0.6.18.*arch='cpu'"):
        resolve_quant_plan(cfg("mxfp4"), arch="cpu", humming=True)


def test_humming_requires_mxfp4():
    with pytest.raises(ValueError, match="humming=True applies to MXFP4 experts.*'nvfp4_w4a16'"):
        resolve_quant_plan(cfg("nvfp4"), arch="sm90", humming=True, flashinfer_version=FI)
    with pytest.raises(ValueError, match="requested mode is 'mxfp4_w4a16'"):
        resolve_quant_plan(cfg("mxfp4"), arch="sm90", humming=True, flashinfer_version=FI, requested_mode="mxfp4_w4a16")


@pytest.mark.parametrize("arch", ["sm90", "sm100", "cpu"])
def test_humming_and_mxfp8_exclusive(arch):
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolve_quant_plan(cfg("mxfp4"), arch=arch, humming=True, mxfp8_act_scaling=True, flashinfer_version=FI)


def test_mxfp8_act_scaling_rules():
    p = resolve_quant_plan(cfg("mxfp4"), arch="sm100", mxfp8_act_scaling=True, flashinfer_version=FI)
    assert (p.expert_mode, p.act_format, p.mxfp8_act_scaling, p.experts_backend) == (
        "mxfp4_w4a8", "mxfp8", True, "flashinfer_cutlass",
    )
    p = resolve_quant_plan(cfg("mxfp4"), arch="sm120", mxfp8_act_scaling=True, flashinfer_version=FI)
    assert p.experts_backend == "flashinfer_cutlass"
    with pytest.raises(ValueError, match=r"needs Blackwell.*arch='sm90'.*humming=True"):
        resolve_quant_plan(cfg("mxfp4"), arch="sm90", mxfp8_act_scaling=True)
    with pytest.raises(ValueError, match="mxfp8_act_scaling=True applies to MXFP4 experts"):
        resolve_quant_plan(cfg("fp8"), arch="sm100", mxfp8_act_scaling=True)
    p = resolve_quant_plan(cfg("mxfp8"), arch="sm100", mxfp8_act_scaling=True)
    assert p.expert_mode == "mxfp8" and "already take MXFP8" in notes(p)


def test_explicit_w4a8_implies_path():
    p = resolve_quant_plan(cfg("mxfp4"), arch="sm90", requested_mode="mxfp4_w4a8", flashinfer_version=FI)
    assert p.humming and p.act_format == "fp8" and "humming -> True" in notes(p)
    with pytest.raises(ValueError, match="FlashInfer >= 0.6.18"):
        resolve_quant_plan(cfg("mxfp4"), arch="sm90", requested_mode="mxfp4_w4a8")
    p = resolve_quant_plan(cfg("mxfp4"), arch="sm100", requested_mode="mxfp4_w4a8")
    assert p.mxfp8_act_scaling and p.act_format == "mxfp8"


# ------------------------------------------------------------------ experts backend table
@pytest.mark.parametrize(
    "method,mode,arch,fi,layout_dispatcher,backend",
    [
        (None, None, "cpu", None, "torch", "reference"),
        (None, None, "cpu", FI, "torch", "reference"),
        (None, None, "sm90", None, "torch", "triton"),
        ("fp8", None, "sm90", FI, "torch", "deepgemm"),  # the largest batch: measured fastest (MEASURED_AUTO)
        ("nvfp4", None, "sm90", FI, "torch", "triton"),
        ("mxfp4", None, "sm90", None, "torch", "triton"),
        ("nvfp4", None, "sm100", FI, "flashinfer", "flashinfer_cutedsl"),
        ("mxfp4", None, "sm100", FI, "flashinfer", "flashinfer_trtllm"),
        ("nvfp4", None, "sm100", None, "torch", "reference"),
        ("nvfp4", "nvfp4_w4a16", "sm100", FI, "torch", "flashinfer_cutedsl"),
        ("nvfp4", "nvfp4_w4a16", "sm100", "0.6.17", "torch", "triton"),
        ("nvfp4", None, "sm120", FI, "torch", "flashinfer_cutlass"),
        ("mxfp8", None, "sm90", FI, "torch", "reference"),
        (None, None, "sm90", None, "deepep_ll", "deepgemm"),
        (None, None, "sm80", None, "torch", "reference"),
    ],
)
def test_experts_backend_auto(method, mode, arch, fi, layout_dispatcher, backend):
    p = resolve_quant_plan(cfg(method), requested_mode=mode, arch=arch, flashinfer_version=fi, dispatcher=layout_dispatcher)
    assert p.experts_backend == backend, p.describe()
    if backend == "reference" and arch != "cpu":
        assert "no fast kernel" in notes(p)
    else:
        assert f"experts auto -> {backend}" in notes(p)


def test_experts_backend_explicit_checked():
    p = resolve_quant_plan(cfg("mxfp4"), arch="sm90", experts_backend="flashinfer_cutlass", flashinfer_version=FI)
    assert p.experts_backend == "flashinfer_cutlass"
    with pytest.raises(ValueError, match=r"'flashinfer_cutlass' cannot run mxfp4_w4a16.*flashinfer is not installed.*\['triton', 'reference'\]"):
        resolve_quant_plan(cfg("mxfp4"), arch="sm90", experts_backend="flashinfer_cutlass")
    with pytest.raises(ValueError, match=r"'triton' cannot run nvfp4_w4a4.*sm90/sm100/sm120 GPUs, not cpu"):
        resolve_quant_plan(cfg("nvfp4"), arch="cpu", experts_backend="triton")
    with pytest.raises(ValueError, match=r"cannot run nvfp4_w4a4.*it runs bf16 only"):
        resolve_quant_plan(cfg("nvfp4"), arch="sm90", requested_mode="nvfp4_w4a4", experts_backend="grouped_mm")
    with pytest.raises(ValueError, match="it takes the masked layout, not flat"):
        resolve_quant_plan(cfg(), arch="sm90", experts_backend="masked_reference")
    with pytest.raises(ValueError, match="masked"):
        resolve_quant_plan(cfg(), arch="sm90", experts_backend="triton", dispatcher="deepep_ll")
    for arch in ("cpu", "sm90", "sm100", "sm120"):  # reference runs every mode everywhere
        assert resolve_quant_plan(cfg("nvfp4"), arch=arch, experts_backend="reference").experts_backend == "reference"


def test_auto_falls_back_when_a_backend_cannot_run_here():
    """SM100 bf16 without FlashInfer's prebuilt fused-MoE module: auto asks the classes and falls back
    to triton (the old table took its first row and failed at construction)."""
    from epmoe.experts.flashinfer_cutlass import fused_moe_package

    pk = {"flashinfer", "triton", "cutlass"}
    p = resolve_quant_plan(cfg(), arch="sm100", flashinfer_version=FI, packages=frozenset(pk))
    assert p.experts_backend == "triton", p.describe()
    assert any(s.startswith("flashinfer_cutlass: FlashInfer's sm100 fused-MoE module is not prebuilt") for s in p.skipped)
    assert "skipped: flashinfer_cutlass" in p.describe()  # --plan prints why
    p = resolve_quant_plan(cfg(), arch="sm100", flashinfer_version=FI, packages=frozenset(pk | {fused_moe_package("sm100")}))
    assert p.experts_backend == "flashinfer_cutlass"
    p = resolve_quant_plan(cfg(), arch="sm90", packages=frozenset())  # no triton: torch's grouped_mm
    assert p.experts_backend == "grouped_mm"
    p = resolve_quant_plan(cfg(), arch="sm90", requested_mode="fp8_block", packages=frozenset())
    assert p.experts_backend == "reference" and "no fast kernel" in notes(p)


def test_experts_preference_lists_every_registered_backend():
    for arch in ("cpu", "sm90", "sm100", "sm120"):
        order = experts_preference(arch)
        assert sorted(order) == sorted(EXPERTS_BACKEND_NAMES) and order[-1] == "reference"


# ------------------------------------------------------------------ the plan object
def test_describe_fingerprint_frozen_and_formats():
    p = resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatcher="flashinfer", flashinfer_version=FI,
                           dispatch_dtype="nvfp4")
    d = p.describe()
    assert d.startswith("quant plan: experts=nvfp4_w4a4") and "dispatch=nvfp4 over flashinfer" in d
    assert all(f"note: {n}" in d for n in p.notes)
    fp = p.fingerprint()
    assert fp["plan.expert_mode"] == "nvfp4_w4a4" and fp["plan.dispatch_dtype"] == "nvfp4"
    assert all(isinstance(v, str) for v in fp.values()) and "plan.notes" not in fp
    q = resolve_quant_plan(cfg("nvfp4"), arch="sm100", dispatcher="flashinfer", flashinfer_version=FI, dispatch_dtype="bf16")
    assert q.fingerprint() != fp
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.expert_mode = "bf16"
    assert p.dispatch_format(torch.bfloat16) is codec.NVFP4
    assert q.dispatch_format(torch.float16).dtype == torch.float16
    assert QuantPlan().dispatch_format(torch.bfloat16).name == "bf16"
    assert p.weight_format == "nvfp4" and not p.is_w4a16 and p.dispatch_quantized


def test_arch_strings_map_to_family():
    p = resolve_quant_plan(cfg("nvfp4"), arch="sm103")
    assert p.arch == "sm100" and p.expert_mode == "nvfp4_w4a4" and "arch sm103 -> sm100 family" in notes(p)
    assert resolve_quant_plan(cfg(), arch="sm121").arch == "sm120"
    assert resolve_quant_plan(cfg(), arch="sm89").arch == "sm80"
    with pytest.raises(ValueError, match="unknown arch 'sm75'"):
        resolve_quant_plan(cfg(), arch="sm75")


def test_detect_arch_cpu():
    assert detect_arch("cpu") == "cpu"
    with pytest.raises(ValueError, match="pass arch= explicitly"):
        detect_arch("meta")


def test_backend_classes_agree_with_what_their_kernels_implement():
    """supports() is the backend's own knowledge: CUTLASS asks resolve_cutlass_variant, SM100 its mode maps."""
    from epmoe.core.capability import BackendRequest
    from epmoe.experts.flashinfer_cutlass import FlashInferCutlassExperts, fused_moe_package
    from epmoe.experts.flashinfer_sm100 import CUTEDSL_MODES, TRTLLM_MODES, FlashInferCuteDslExperts, FlashInferTrtllmExperts
    from epmoe.quant import flashinfer_layout
    from epmoe.quant.plan import EXPERT_MODES

    arch_num = {"sm90": 90, "sm100": 100, "sm120": 120}
    for arch, num in arch_num.items():
        for mode in EXPERT_MODES:
            req = BackendRequest(expert_mode=mode, arch=arch, flashinfer_version=FI, checkpoint="nvfp4" if "nvfp4" in mode else "none",
                                 packages=frozenset({"flashinfer", "cutlass", fused_moe_package(arch)}))
            try:
                flashinfer_layout.resolve_cutlass_variant(mode, num)
                kernel = True
            except ValueError:
                kernel = False
            assert bool(FlashInferCutlassExperts.supports(req)) == kernel, (arch, mode)
            assert bool(FlashInferTrtllmExperts.supports(req)) == (arch == "sm100" and mode in TRTLLM_MODES)
            assert bool(FlashInferCuteDslExperts.supports(req)) == (arch == "sm100" and mode in CUTEDSL_MODES)


def test_bf16_experts_take_explicit_quantized_dispatch_but_auto_never_picks_it():
    p = resolve_quant_plan(cfg(), arch="cpu", dispatch_dtype="nvfp4")
    assert (p.expert_mode, p.dispatch_dtype) == ("bf16", "nvfp4")
    assert any("dequantized on arrival" in n for n in p.notes)
    assert resolve_quant_plan(cfg(), arch="cpu").dispatch_dtype == "bf16"


def test_masked_layout_runs_what_the_masked_experts_run():
    from epmoe.core.capability import BackendRequest
    from epmoe.experts.masked import REFERENCE_EXPERT_MODES, MaskedReferenceExperts
    from epmoe.experts.reference import ReferenceExperts
    from epmoe.quant.plan import EXPERT_MODES

    for mode in EXPERT_MODES:
        req = BackendRequest(expert_mode=mode, layout="masked", arch="sm90")
        assert bool(MaskedReferenceExperts.supports(req)) == (mode in REFERENCE_EXPERT_MODES)
        assert not ReferenceExperts.supports(req), "ReferenceExperts takes the flat layout only"
    p = resolve_quant_plan(cfg(), arch="sm90", dispatcher="deepep_ll")
    assert p.experts_backend == "deepgemm" and p.layout == "masked"  # DeepGEMM's masked GEMMs where installed
