"""Stand-ins for the parts of FlashInfer 0.7.2 that epmoe calls, for CPU tests (FlashInfer is not
installed on CPU machines). They record their calls and mimic the real semantics:

* `install(monkeypatch, ...)` puts a fake `flashinfer` package into sys.modules with the submodules
  epmoe imports (`comm.trtllm_moe_alltoall`, `comm.mnnvl`, `comm.mapping`, `comm.comm_backend`,
  `fused_moe`, `jit.env`) and top-level `block_scale_interleave` / `mxfp8_quantize`.
* `FakeMoeAlltoAll` implements the one-sided all-to-all between ranks that run as threads of one
  process (`Fabric`): dispatch writes every token once into the receive block of each target rank,
  in a deliberately non-identity slot order (the real kernel's order is set by atomics), marks padded
  rows with the invalid id (FlashInfer's sanitize), and combine sums each token's partial outputs in
  float32 in top-k order of first appearance, like the real kernel.
* `cutlass_fused_moe` keeps the real keyword signature (optionally without newer keywords) and
  records its kwargs.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

AUX_BYTES = 4096  # stand-in for moe_a2a_get_aux_data_size


def _module(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__path__ = []  # a package, so submodule imports resolve through sys.modules
    return m


# ----------------------------------------------------------------------------- comm fakes
class Fabric:
    """Shared state of `ep_size` ranks running as threads."""

    def __init__(self, ep_size: int):
        self.ep_size = ep_size
        self.barrier = threading.Barrier(ep_size, timeout=30)
        self.slots: List[Any] = [None] * ep_size
        self.recv: List[Optional[List[torch.Tensor]]] = [None] * ep_size
        self.recv_counts = [[0] * ep_size for _ in range(ep_size)]
        self.combine_src: List[Optional[torch.Tensor]] = [None] * ep_size
        self.calls: List[tuple] = []
        self.lock = threading.Lock()

    def log(self, *entry) -> None:
        with self.lock:
            self.calls.append(entry)


class FakeComm:
    """FlashInfer CommBackend over a Fabric (allgather through the shared slots)."""

    def __init__(self, fabric: Fabric, rank: int):
        self.fabric, self.rank = fabric, rank

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.fabric.ep_size

    def allgather(self, data):
        f = self.fabric
        f.barrier.wait()
        f.slots[self.rank] = data
        f.barrier.wait()
        out = tuple(f.slots)
        f.barrier.wait()
        return out

    def bcast(self, data, root: int):
        return self.allgather(data)[root]

    def barrier(self) -> None:
        self.fabric.barrier.wait()

    def Split(self, color: int, key: int):
        return self


@dataclass
class MnnvlConfig:
    comm_backend: Any = None
    allocation_granularity: int = 0
    fabric_page_size: int = 1 << 29


class Mapping:
    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, tp_size=1, moe_ep_size=-1, **kw):
        self.world_size, self.rank, self.tp_size = world_size, rank, tp_size
        self.moe_ep_size = moe_ep_size
        self.moe_ep_rank = rank
        self.kwargs = dict(gpus_per_node=gpus_per_node, **kw)


class TorchDistBackend:
    def __init__(self, group=None):
        self._group = group


class MPIBackend:
    pass


def moe_a2a_get_workspace_size_per_rank(
    ep_size, max_num_tokens, total_dispatch_payload_size_per_token, combine_payload_size_per_token,
    eplb_stats_num_experts=0, *, backend="trtllm",
):
    def pad(x):
        return -(-x // 128) * 128

    return (
        pad(AUX_BYTES)
        + pad(ep_size * max_num_tokens * total_dispatch_payload_size_per_token)
        + pad(ep_size * max_num_tokens * combine_payload_size_per_token)
    )


class FakeMoeAlltoAll:
    """MoeAlltoAll for ranks that are threads of this process (see module docstring)."""

    instances: List["FakeMoeAlltoAll"] = []

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None, eplb_stats_num_experts=0, enable_rank_mask=False,
                 *, backend="trtllm"):
        comm = mnnvl_config.comm_backend
        self.fabric: Fabric = comm.fabric if isinstance(comm, FakeComm) else Fabric(1)
        self.ep_size, self.ep_rank = mapping.moe_ep_size, mapping.moe_ep_rank
        self.max_num_tokens, self.top_k, self.num_experts = max_num_tokens, top_k, num_experts
        self.workspace_size_per_rank = workspace_size_per_rank
        self.mnnvl_config = mnnvl_config
        self.phase = "idle"
        self.reset_called = False
        self.combine_calls: List[dict] = []
        self.dispatch_calls: List[dict] = []
        self._combine_region: Optional[torch.Tensor] = None
        FakeMoeAlltoAll.instances.append(self)

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None, eplb_local_stats=None,
                 active_rank_mask=None):
        assert self.phase == "idle", "dispatch called twice without combine"
        f, ep, me, rt = self.fabric, self.ep_size, self.ep_rank, runtime_max_tokens_per_rank
        assert rt <= self.max_num_tokens
        T = token_selected_experts.shape[0]
        for p in input_payloads:
            assert p.dim() == 2 and p.shape[0] == T and p.is_contiguous()
        self.dispatch_calls.append(dict(
            route=token_selected_experts.clone(), payloads=[p.clone() for p in input_payloads], rt=rt,
            invalid=invalid_token_expert_id, ids_index=expert_id_payload_index,
        ))
        # Receive buffers hold stale bytes from earlier rounds: emulate with a 0x5A pattern.
        f.recv[me] = [
            torch.full((ep, rt, p.shape[1] * p.element_size()), 0x5A, dtype=torch.uint8).view(p.dtype)
            for p in input_payloads
        ]
        f.barrier.wait()
        per_rank = self.num_experts // ep
        targets_of = {}
        for t in range(T):  # distinct target ranks, in top-k order of first appearance
            targets = []
            for e in token_selected_experts[t].tolist():
                r = e // per_rank
                assert 0 <= r < ep, f"route id {e} maps to rank {r}: the kernel would write out of bounds"
                if r not in targets:
                    targets.append(r)
            targets_of[t] = targets
        counters = [0] * ep
        slot_of = {}
        for t in reversed(range(T)):  # slots are NOT token order, as with the real atomics
            for r in targets_of[t]:
                slot_of[(t, r)] = counters[r]
                counters[r] += 1
                for p, buf in zip(input_payloads, f.recv[r]):
                    buf[me, slot_of[(t, r)]] = p[t]
        self._sends = [(t, r) for t in range(T) for r in targets_of[t]]
        self._slot_of = slot_of
        for r in range(ep):
            f.recv_counts[r][me] = counters[r]
        self._T = T
        f.barrier.wait()
        mine = f.recv[me]
        if invalid_token_expert_id is not None:
            ids = mine[expert_id_payload_index]
            for src in range(ep):
                ids[src, f.recv_counts[me][src]:] = invalid_token_expert_id
        f.barrier.wait()
        self.phase = "dispatched"
        self._rt = rt
        return list(mine)

    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank, hidden_size, dtype):
        assert self.phase == "dispatched"
        n = self.ep_size * runtime_max_tokens_per_rank * hidden_size
        if self._combine_region is None or self._combine_region.numel() < n or self._combine_region.dtype != dtype:
            self._combine_region = torch.zeros(self.ep_size * self.max_num_tokens * hidden_size, dtype=dtype)
        return self._combine_region[:n].view(self.ep_size, runtime_max_tokens_per_rank, hidden_size)

    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False, output_dtype=None,
                output_scales=None, output_scalar_scale=1.0, sf_layout=None, output=None, *,
                use_low_precision=False, active_rank_mask=None):
        assert self.phase == "dispatched", "combine called before successful dispatch"
        f, me, rt = self.fabric, self.ep_rank, runtime_max_tokens_per_rank
        assert rt == self._rt and payload.shape[:2] == (self.ep_size, rt)
        self.combine_calls.append(dict(payload_in_workspace=payload_in_workspace, use_low_precision=use_low_precision))
        staged = payload.clone()
        if use_low_precision:
            staged = staged.to(torch.float8_e4m3fn)
        f.combine_src[me] = staged
        f.barrier.wait()
        H = payload.shape[2]
        acc = torch.zeros(self._T, H, dtype=torch.float32)
        for t, r in self._sends:
            acc[t] += f.combine_src[r][me, self._slot_of[(t, r)]].float()
        f.barrier.wait()
        self.phase = "idle"
        return acc.to(torch.bfloat16 if use_low_precision else payload.dtype)

    def _reset_workspace(self):
        self.reset_called = True
        self.phase = "deleted"


# ----------------------------------------------------------------------------- fused-MoE fakes
class Recorder:
    def __init__(self):
        self.calls: List[tuple] = []

    def add(self, name: str, **kw) -> None:
        self.calls.append((name, kw))

    def named(self, name: str) -> List[dict]:
        return [kw for n, kw in self.calls if n == name]


class ActivationType:  # the IntEnum values of flashinfer.tllm_enums.ActivationType that we use
    Swiglu = 3
    Relu2 = 6


# The real keyword parameters of flashinfer.fused_moe.cutlass_fused_moe (0.7.2.post1).
CUTLASS_PARAMS_0_7_2 = (
    "input", "token_selected_experts", "token_final_scales", "fc1_expert_weights", "fc2_expert_weights",
    "output_dtype", "quant_scales", "fc1_expert_biases", "fc2_expert_biases", "input_sf", "swiglu_alpha",
    "swiglu_beta", "swiglu_limit", "tp_size", "tp_rank", "ep_size", "ep_rank", "cluster_size",
    "cluster_rank", "output", "enable_alltoall", "use_deepseek_fp8_block_scale", "use_w4_group_scaling",
    "use_mxfp8_act_scaling", "min_latency_mode", "use_packed_weights", "use_wfp4afp8_humming",
    "tune_max_num_tokens", "enable_pdl", "activation_type", "swizzled_input_sf", "use_fused_finalize",
    "profile_ids", "workspace_buffer",
)
# 0.6.17 had neither Humming nor the workspace buffer.
CUTLASS_PARAMS_0_6_17 = tuple(p for p in CUTLASS_PARAMS_0_7_2 if p not in ("use_wfp4afp8_humming", "workspace_buffer"))


def make_cutlass_fused_moe(recorder: Recorder, params=CUTLASS_PARAMS_0_7_2):
    def impl(**kwargs):
        recorder.add("cutlass_fused_moe", **kwargs)
        return kwargs.get("output")

    sig = inspect.Signature([inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY, default=None) for p in params])
    impl.__signature__ = sig
    return impl


class _FakeCutlassModule:
    """`get_cutlass_fused_moe_module(arch)`: only the tactic counts of its runner (FAKE_TACTICS)."""

    def __init__(self, rec):
        outer = self

        class MoERunner:
            def __init__(self, **kwargs):
                rec.add("MoERunner", **kwargs)
                self.fused_moe_runner = outer

        self.MoERunner = MoERunner

    def get_gemm1_tactic_count(self):
        return FAKE_TACTICS[0]

    def get_gemm2_tactic_count(self):
        return FAKE_TACTICS[1]


FAKE_TACTICS = (2, 3)  # GEMM1 ids 0..1, GEMM2 ids 2..4 (made-up counts)


def install(monkeypatch, *, version: str = "0.7.2.post1", cutlass_params=CUTLASS_PARAMS_0_7_2,
            humming_preprocess: bool = True, recorder: Optional[Recorder] = None) -> Recorder:
    """Put the fake package into sys.modules (undone by monkeypatch). Returns the call recorder."""
    rec = recorder or Recorder()
    fi = _module("flashinfer")
    fi.__version__ = version
    comm = _module("flashinfer.comm")
    a2a = _module("flashinfer.comm.trtllm_moe_alltoall")
    a2a.MoeAlltoAll = FakeMoeAlltoAll
    a2a.moe_a2a_get_workspace_size_per_rank = moe_a2a_get_workspace_size_per_rank
    mnnvl = _module("flashinfer.comm.mnnvl")
    mnnvl.MnnvlConfig = MnnvlConfig
    mapping = _module("flashinfer.comm.mapping")
    mapping.Mapping = Mapping
    cb = _module("flashinfer.comm.comm_backend")
    cb.TorchDistBackend = TorchDistBackend
    cb.MPIBackend = MPIBackend
    fm = _module("flashinfer.fused_moe")
    fm.ActivationType = ActivationType
    fm.cutlass_fused_moe = make_cutlass_fused_moe(rec, cutlass_params)

    def interleave_w(weight, quant_type="fp4"):
        rec.add("interleave_weights", weight=weight.clone(), quant_type=quant_type)
        return weight.flip(-1).contiguous()  # a visible, invertible change

    def interleave_s(scales, group_size=32):
        rec.add("interleave_scales", scales=scales.clone(), group_size=group_size)
        return scales.flip(-1).contiguous()

    core = _module("flashinfer.fused_moe.core")
    core.get_cutlass_fused_moe_module = lambda backend="100", use_fast_build=False: _FakeCutlassModule(rec)
    fm.core = core
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe.core", core)
    fm.interleave_moe_weights_for_sm90_mixed_gemm = interleave_w
    fm.interleave_moe_scales_for_sm90_mixed_gemm = interleave_s
    if humming_preprocess:
        def humming(weight, raw_scale, max_range=11, *, interleave=True):
            rec.add("humming", weight=weight.clone(), raw_scale=raw_scale.clone())
            # Residual as FlashInfer defines it: 2^(min exponent - 127) * 0.5 per expert.
            flat = raw_scale.reshape(raw_scale.shape[0], -1)
            lo = torch.maximum(flat.max(1).values.int() - max_range, flat.min(1).values.int())
            residual = torch.exp2(lo.float() - 127.0) * 0.5
            return weight.flip(-1).contiguous(), raw_scale.flip(-1).contiguous(), residual

        fm.preprocess_moe_weights_for_sm90_mixed_gemm_humming = humming

    def block_scale_interleave(unswizzled_sf, *, out=None):
        rec.add("block_scale_interleave", sf=unswizzled_sf.clone())
        return unswizzled_sf.flip(-1).reshape(-1).contiguous()

    fi.block_scale_interleave = block_scale_interleave

    def mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=32, **kw):
        rec.add("mxfp8_quantize", shape=tuple(x.shape), swizzled=is_sf_swizzled_layout)
        return x.to(torch.float8_e4m3fn), torch.full((x.shape[0] * x.shape[1] // 32,), 127, dtype=torch.uint8)

    fi.mxfp8_quantize = mxfp8_quantize
    # ---- SM100 (CuTe-DSL / TRT-LLM-gen) stand-ins
    from dataclasses import dataclass as _dc
    from enum import Enum as _Enum

    class QuantFormat(_Enum):
        BF16 = 0
        NVFP4 = 5
        MXFP4 = 6

    @_dc(frozen=True)
    class QuantConfig:
        weight: Any = QuantFormat.BF16
        activation: Any = QuantFormat.BF16

    @_dc(frozen=True)
    class SwiGLU:
        alpha: float = 1.0
        beta: float = 0.0
        limit: float = float("inf")

    @_dc(frozen=True)
    class ReLU2:
        pass

    class CuteDslMoEWrapper:
        def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                     max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128,
                     sf_vec_size=16, output_dtype=torch.bfloat16, device="cuda", enable_pdl=True,
                     activation_type=3, swiglu_alpha=1.0, swiglu_beta=0.0, swiglu_limit=float("inf"),
                     situ_beta=None, situ_linear_beta=None, use_fused_finalize=True, quant_mode="w4a4"):
            rec.add("CuteDslMoEWrapper", **{k: v for k, v in locals().items() if k not in ("self", "rec")})
            self.hidden_size = hidden_size

        def run(self, **kw):
            rec.add("cutedsl_run", **kw)
            return torch.zeros(kw["token_selected_experts"].shape[0], self.hidden_size, dtype=torch.bfloat16)

    def prepare_cute_dsl_weights(w1_bf16, w2_bf16, *, quant, num_local_experts, hidden_size, intermediate_size,
                                 activation=None, device=None, nvfp4_4over6=None):
        rec.add("prepare_cute_dsl_weights", w1=w1_bf16.clone(), w2=w2_bf16.clone(), quant=quant, activation=activation)
        E = num_local_experts
        view = {"w1_weight": torch.zeros(E, w1_bf16.shape[1], hidden_size // 2, dtype=torch.uint8),
                "w1_weight_sf": torch.zeros(E, 4, dtype=torch.uint8), "w1_alpha": torch.ones(E),
                "w2_weight": torch.zeros(E, hidden_size, intermediate_size // 2, dtype=torch.uint8),
                "w2_weight_sf": torch.zeros(E, 4, dtype=torch.uint8), "w2_alpha": torch.ones(E)}
        if quant.activation == QuantFormat.NVFP4:
            view["fc2_input_scale"] = torch.ones(1)
        return view

    def prepare_trtllm_fp4_weights(w1_bf16, w2_bf16, *, quant, num_local_experts, hidden_size, intermediate_size,
                                   activation=None, device=None, permute_cache=None):
        rec.add("prepare_trtllm_fp4_weights", w1=w1_bf16.clone(), quant=quant, activation=activation)
        E = num_local_experts
        return {"gemm1_weights": torch.zeros(E, w1_bf16.shape[1], hidden_size // 2, dtype=torch.uint8),
                "gemm1_weights_scale": torch.zeros(E, w1_bf16.shape[1], hidden_size // 32, dtype=torch.uint8),
                "gemm2_weights": torch.zeros(E, hidden_size, intermediate_size // 2, dtype=torch.uint8),
                "gemm2_weights_scale": torch.zeros(E, hidden_size, intermediate_size // 32, dtype=torch.uint8),
                "output1_scale_scalar": torch.ones(E), "output1_scale_gate_scalar": torch.ones(E),
                "output2_scale_scalar": torch.ones(E)}

    def trtllm_fp4_block_scale_routed_moe(**kw):
        rec.add("trtllm_routed", **kw)
        return [torch.zeros(kw["hidden_states"].shape[0], kw["hidden_states"].shape[1], dtype=torch.bfloat16)]

    def fp4_quantize(x, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True, **kw):
        rec.add("fp4_quantize", shape=tuple(x.shape), swizzled=is_sf_swizzled_layout, global_scale=global_scale)
        return (torch.zeros(x.shape[0], x.shape[1] // 2, dtype=torch.uint8),
                torch.zeros(x.shape[0] * x.shape[1] // 16, dtype=torch.uint8))

    fm.QuantFormat, fm.QuantConfig, fm.SwiGLU, fm.ReLU2 = QuantFormat, QuantConfig, SwiGLU, ReLU2
    fm.CuteDslMoEWrapper = CuteDslMoEWrapper
    fm.trtllm_fp4_block_scale_routed_moe = trtllm_fp4_block_scale_routed_moe
    prep = _module("flashinfer.fused_moe.prepare")
    prep.prepare_cute_dsl_weights = prepare_cute_dsl_weights
    prep.prepare_trtllm_fp4_weights = prepare_trtllm_fp4_weights
    fm.prepare = prep
    fi.fp4_quantize = fp4_quantize
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe.prepare", prep)
    jit = _module("flashinfer.jit")
    env = _module("flashinfer.jit.env")
    env.get_aot_artifacts = lambda name: ()
    import pathlib

    env.FLASHINFER_JIT_DIR = pathlib.Path("/nonexistent-flashinfer-jit")
    fi.comm, comm.trtllm_moe_alltoall, comm.mnnvl, comm.mapping, comm.comm_backend = comm, a2a, mnnvl, mapping, cb
    fi.fused_moe, fi.jit, jit.env = fm, jit, env
    for name, mod in {
        "flashinfer": fi, "flashinfer.comm": comm, "flashinfer.comm.trtllm_moe_alltoall": a2a,
        "flashinfer.comm.mnnvl": mnnvl, "flashinfer.comm.mapping": mapping,
        "flashinfer.comm.comm_backend": cb, "flashinfer.fused_moe": fm, "flashinfer.jit": jit,
        "flashinfer.jit.env": env,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeMoeAlltoAll.instances = []
    return rec


def run_ranks(ep_size: int, fn, timeout: float = 60.0) -> List[Any]:
    """Run fn(rank, fabric) for every rank in its own thread; re-raise the first error."""
    fabric = Fabric(ep_size)
    results: List[Any] = [None] * ep_size
    errors: List[Optional[BaseException]] = [None] * ep_size

    def body(r):
        try:
            results[r] = fn(r, fabric)
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            errors[r] = e
            fabric.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(ep_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results, errors
