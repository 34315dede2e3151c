"""Every (mode x dispatcher x experts x wire x arch) the resolver is asked about, for cpu, sm90, sm100
and sm120: each accepted plan is BUILT, each rejected one has a reason.

* CPU plans run for real on 2 gloo ranks (one spawned job for all of them) and are compared with the
  float64 reference that models the plan's path (lossy wire, weight and activation quantization):
  what `--check` does.
* GPU plans are built on CPU with stand-ins for what needs the hardware (stand-in tests: they prove
  construction, weight conversion and argument assembly, not the kernels): the device probe of
  `availability()` answers yes, FlashInfer is `tests/cpu/flashinfer_fakes.py`, DeepEP is
  `tests/cpu/fake_deep_ep.py`. Construction, weight loading and the data path around the kernel
  are real; Triton plans stop after weight conversion (their kernels need the GPU or the slow
  interpreter, which tests/cpu/test_triton_experts_interpret.py runs).
"""

from __future__ import annotations

import sys
from functools import lru_cache

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.core.availability import Availability
from epmoe.dispatch import DISPATCHERS, DispatchedTokens, DispatchSpec
from epmoe.experts import EXPERTS, ExpertsSpec
from epmoe.quant import codec
from epmoe.quant.payload import PayloadFormat
from epmoe.resolve import Environment, enumerate_combinations, resolve_plan
from tests.cpu.helpers import fresh_seed, max_rel_err, random_weights
from tests.cpu.mp import run_group

ARCHES = ("cpu", "sm90", "sm100", "sm120")
FI = "0.7.2.post1"
EP = 2
# DeepEP low-latency kernels exist for a few hidden sizes only (2048 is one); 128-multiples for FP8 blocks
CFG = MoEConfig(num_experts=4, top_k=2, hidden_size=2048, intermediate_size=128, dtype=torch.bfloat16)
# kernels' data path is checked on a smaller layer of the same kind (fast on CPU)
SMALL = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
CPU_CFG = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.float32)
ARCH_NUMBER = {"sm90": 90, "sm100": 100, "sm120": 120}


@lru_cache(maxsize=None)
def combinations(config: MoEConfig = CFG):
    return tuple(enumerate_combinations(config, ARCHES, flashinfer_version=FI, ep_size=EP))


def accepted(config: MoEConfig = CFG):
    return [c for c in combinations(config) if c.accepted]


# ---------------------------------------------------------------------------- the enumeration
def test_every_combination_is_accepted_or_rejected_with_a_reason():
    combos = combinations()
    modes = 7
    assert len(combos) == len(ARCHES) * modes * len(DISPATCHERS.names()) * len(EXPERTS.names()) * 3
    for c in combos:
        if c.accepted:
            p = c.plan
            assert (p.dispatcher, p.experts_backend, p.dispatch_dtype, p.expert_mode, p.arch) == (
                c.dispatcher, c.experts, c.wire, c.mode, c.arch)
        else:
            assert len(c.reason) > 30 and ("cannot" in c.reason or "no experts backend" in c.reason), c
    for arch in ARCHES:
        assert any(c.accepted for c in combos if c.arch == arch), arch
    ok = [c for c in combos if c.accepted]
    # the defects this redesign fixed stay fixed
    assert not [c for c in ok if c.dispatcher == "flashinfer" and c.wire == "fp8"]
    assert not [c for c in ok if c.dispatcher in ("deepep", "deepep_ll") and c.wire == "nvfp4"]
    assert not [c for c in ok if c.dispatcher == "deepep_ll" and c.mode.startswith("nvfp4")]
    assert not [c for c in ok if c.dispatcher == "deepep_ll" and c.experts not in ("masked_reference", "deepgemm")]
    assert not [c for c in ok if c.arch == "cpu" and c.dispatcher != "torch"]
    assert not [c for c in ok if c.mode.endswith("w4a16") and c.wire != "bf16"]


# ---------------------------------------------------------------------------- CPU: run on 2 gloo ranks
def _cpu_plans():
    """(mode, wire) of every accepted CPU plan (torch dispatcher, reference experts)."""
    out = sorted({(c.mode, c.wire) for c in accepted() if c.arch == "cpu"})
    assert all(c.experts == "reference" and c.dispatcher == "torch" for c in accepted() if c.arch == "cpu")
    return out


def _cpu_worker(rank, world, seed, items, tokens_per_rank):
    from epmoe import EPMoE

    results = []
    for mode, wire in items:
        plan = resolve_plan(CPU_CFG, dispatcher="torch", experts="reference", quant=mode, dispatch_dtype=wire,
                            environment=Environment("cpu"), ep_size=world)
        layer = EPMoE(CPU_CFG, dispatcher="torch", device="cpu", max_num_tokens_per_rank=16, plan=plan)
        layer.load_weights(random_weights(CPU_CFG, seed))
        g = torch.Generator().manual_seed(seed + 7 * rank)
        T = tokens_per_rank[rank]
        x = torch.randn(T, CPU_CFG.hidden_size, generator=g)
        logits = torch.randn(T, CPU_CFG.num_experts, generator=g)
        out = layer(x, logits, return_stats=True)
        results.append((mode, wire, plan, x, logits, out.hidden_states, out.stats.rounds))
        layer.close()
    return results


def test_every_accepted_cpu_plan_runs_on_two_ranks_and_matches_the_reference():
    from epmoe.reference import reference_moe

    items = _cpu_plans()
    modes = {m for m, _ in items}
    assert len(modes) == 7 and ("nvfp4_w4a4", "nvfp4") in items and ("fp8_block", "fp8") in items
    assert ("bf16", "nvfp4") in items and ("bf16", "fp8") in items  # lossy transport for bf16 experts
    seed = fresh_seed()
    tokens = [20, 7]  # rank 0 runs two rounds (max 16 per rank)
    per_rank = run_group(_cpu_worker, EP, seed, items, tokens, timeout=300)
    w = random_weights(CPU_CFG, seed)
    for i, (mode, wire) in enumerate(items):
        plan = per_rank[0][i][2]
        x = torch.cat([r[i][3] for r in per_rank])
        logits = torch.cat([r[i][4] for r in per_rank])
        y = torch.cat([r[i][5] for r in per_rank])
        assert per_rank[0][i][6] == 2
        err = max_rel_err(y, reference_moe(CPU_CFG, x, w, logits, plan=plan))
        assert err < 1e-4, f"{mode} over a {wire} wire: max rel err {err:.3g} (seed {seed})"


# ---------------------------------------------------------------------------- GPU plans: stand-in tests
@pytest.fixture
def stand_ins(monkeypatch):
    """FlashInfer stand-in, device probes answering yes (we are on a CPU)."""
    from tests.cpu import flashinfer_fakes as ff

    rec = ff.install(monkeypatch)
    for name in EXPERTS.names():
        monkeypatch.setattr(EXPERTS.get(name), "availability", classmethod(lambda c, spec: Availability.yes("stand-in")))
    return rec


def _local_weights(config, rank):
    w = random_weights(config, 11)
    n = config.num_experts // EP
    return w.slice_experts(rank * n, (rank + 1) * n)


def _tokens_for(experts, config, layout, wire):
    """A few dispatched rows in what the dispatcher would deliver to these experts."""
    H, n, K = config.hidden_size, config.num_experts // EP, config.top_k
    g = torch.Generator().manual_seed(5)
    fmt = experts.payload_format
    if layout == "masked":
        M = 4
        x = torch.randn(n * M, H, generator=g).to(config.dtype)
        hidden = codec.quantize_activation(x, fmt) if fmt.is_quantized else x
        if fmt.is_quantized:
            from epmoe.quant.payload import QuantizedActivation

            hidden = QuantizedActivation(fmt, hidden.data.reshape(n, M, -1), hidden.scales.reshape(n, M, -1), H)
        else:
            hidden = hidden.reshape(n, M, H)
        return DispatchedTokens(hidden, None, None, layout="masked", expert_counts=torch.tensor([3] + [1] * (n - 1), dtype=torch.int32))
    x = torch.randn(5, H, generator=g).to(config.dtype)
    delivered = fmt.is_quantized and codec.payload_format(wire, config.dtype) == fmt
    hidden = codec.quantize_for_wire(x, fmt) if delivered else x
    ids = torch.tensor([[0, -1], [1, 0], [-1, -1], [1, -1], [0, 1]], dtype=torch.int32)
    return DispatchedTokens(hidden, ids, torch.rand(5, K, generator=g))


def test_every_accepted_gpu_plan_builds_its_experts_against_stand_ins(stand_ins, monkeypatch):
    """Stand-in test: construction, weight conversion and the call around the kernel for every
    (arch, mode, experts, wire) the resolver accepts on sm90 / sm100 / sm120."""
    import epmoe.experts.flashinfer_cutlass as fc

    built = set()
    for c in accepted():
        if c.arch == "cpu":
            continue
        key = (c.arch, c.mode, c.experts, c.wire, c.plan.layout)
        if key in built:
            continue
        built.add(key)
        monkeypatch.setattr(fc, "_device_arch", lambda device, a=ARCH_NUMBER[c.arch]: a)
        spec = ExpertsSpec(config=SMALL, ep_rank=1, ep_size=EP, device=torch.device("cpu"), plan=c.plan, max_tokens=32)
        if c.experts == "deepgemm":  # its GEMMs: a stand-in for deep_gemm
            from tests.cpu.fake_deep_gemm import FakeDeepGEMM

            ex = EXPERTS.get(c.experts)(spec, gemms=FakeDeepGEMM())
        else:
            ex = EXPERTS.get(c.experts)(spec)
        ex.load_weights(_local_weights(SMALL, 1))
        assert ex.parameters() or c.experts in ("masked_reference",), key
        if c.experts in ("triton", "deepgemm"):
            continue  # Triton kernels need a GPU (or the interpreter tests)
        out = ex(_tokens_for(ex, SMALL, c.plan.layout, c.wire))
        n = SMALL.num_experts // EP
        want = (n, 4, SMALL.hidden_size) if c.plan.layout == "masked" else (5, SMALL.hidden_size)
        assert tuple(out.shape) == want, key
    archs = {k[0] for k in built}
    assert archs == {"sm90", "sm100", "sm120"} and len(built) > 20


def test_every_accepted_flashinfer_and_torch_dispatch_builds_and_moves_tokens(stand_ins):
    """Stand-in test for FlashInfer (fake one-sided A2A), real for torch: every (dispatcher, wire,
    payload) an accepted plan asks for is built from the plan's DispatchSpec and moves tokens."""
    seen = set()
    for c in accepted():
        if c.dispatcher not in ("torch", "flashinfer"):
            continue
        spec = ExpertsSpec(config=SMALL, ep_rank=0, ep_size=1, device=torch.device("cpu"), plan=c.plan)
        payload = EXPERTS.get(c.experts).Options  # noqa: F841 - class exists
        wire = codec.payload_format(c.wire, SMALL.dtype)
        pay = _payload_of(c, spec)
        key = (c.dispatcher, wire.name, pay.name)
        if key in seen:
            continue
        seen.add(key)
        d = DISPATCHERS.get(c.dispatcher)(DispatchSpec(
            group=None, ep_rank=0, ep_size=1, num_experts=SMALL.num_experts, top_k=SMALL.top_k,
            hidden_size=SMALL.hidden_size, max_tokens_per_rank=8, payload=pay, wire=wire, combine_dtype=SMALL.dtype,
            device=torch.device("cpu"), options={"check_availability": False} if c.dispatcher == "flashinfer" else None,
        ))
        x = torch.randn(6, SMALL.hidden_size).to(SMALL.dtype)
        ids = torch.tensor([[0, 1], [2, -1], [3, 0], [-1, -1], [1, 2], [0, 3]], dtype=torch.int32)
        tokens, handle = d.dispatch(x, ids, torch.rand(6, 2))
        assert isinstance(tokens.hidden, torch.Tensor) != (pay.is_quantized and pay == wire), key
        back = tokens.hidden if isinstance(tokens.hidden, torch.Tensor) else codec.dequantize_activation(tokens.hidden, SMALL.dtype)
        assert d.combine(back.to(SMALL.dtype), handle).shape == x.shape
        d.close()
    assert ("flashinfer", "nvfp4", "nvfp4") in seen or ("flashinfer", "nvfp4", "bf16") in seen
    assert not [k for k in seen if k[0] == "flashinfer" and k[1] == "fp8_block"]


def _payload_of(c, spec) -> PayloadFormat:
    """What the plan's experts consume (their payload_format), without building GPU backends."""
    from epmoe.core.capability import BackendRequest

    cls = EXPERTS.get(c.experts)
    consumed = cls.consumes(BackendRequest(expert_mode=c.mode, act_format=c.plan.act_format, arch=c.arch))
    if consumed == c.wire and consumed != "bf16":
        return codec.payload_format(consumed, CFG.dtype)
    return PayloadFormat.unquantized(CFG.dtype)


def _deepep_worker(rank, world, items):
    import epmoe.dispatch.deepep as dd
    from tests.cpu import fake_deep_ep

    sys.modules["deep_ep"] = fake_deep_ep
    dd._device_problem = lambda device: None  # the fake runs on CPU
    done = []
    for dispatcher, wire_name, payload_name in items:
        wire = codec.payload_format(wire_name, CFG.dtype)
        pay = codec.payload_format(payload_name, CFG.dtype)
        d = DISPATCHERS.get(dispatcher)(DispatchSpec(
            group=None, ep_rank=rank, ep_size=world, num_experts=CFG.num_experts, top_k=CFG.top_k,
            hidden_size=CFG.hidden_size, max_tokens_per_rank=8, payload=pay, wire=wire, combine_dtype=CFG.dtype,
            device=torch.device("cpu"),
        ))
        x = torch.randn(3, CFG.hidden_size).to(CFG.dtype)
        ids = torch.tensor([[0, 3], [2, -1], [1, 0]], dtype=torch.int32)
        tokens, handle = d.dispatch(x, ids, torch.rand(3, 2))
        h = tokens.hidden if isinstance(tokens.hidden, torch.Tensor) else dd.fp8_block_dequantize(
            tokens.hidden.data, tokens.hidden.scales, CFG.dtype)
        out = d.combine(h.to(CFG.dtype), handle)
        done.append((dispatcher, wire_name, payload_name, tuple(out.shape)))
        d.close()
    return done


def test_every_accepted_deepep_dispatch_builds_and_moves_tokens():
    """Stand-in test (fake deep_ep, 2 gloo ranks): every DeepEP (mode, wire, payload) an accepted
    plan asks for is built and moves tokens."""
    items = set()
    for c in accepted():
        if c.dispatcher in ("deepep", "deepep_ll"):
            spec = ExpertsSpec(config=CFG, ep_rank=0, ep_size=EP, device=torch.device("cpu"), plan=c.plan)
            pay = _payload_of(c, spec)
            items.add((c.dispatcher, c.wire, "bf16" if not pay.is_quantized else c.wire))
    items = sorted(items)
    assert {i[0] for i in items} == {"deepep", "deepep_ll"} and any(i[1] == "fp8" for i in items)
    res = run_group(_deepep_worker, EP, items, timeout=240)
    for rank_result in res:
        assert [r[:3] for r in rank_result] == items
        assert all(r[3] == (3, CFG.hidden_size) for r in rank_result)
