"""Expert-stage benchmark on one GPU: DeepSeek-V3 shape per rank (128 local experts, H=7168, I=2048,
top-8, every routed entry local, uniform random routing; --routing skewed: very unequal experts) at T=128 (decode) and T=4096 (prefill).

    python benchmarks/bench_experts.py                 # full run, table + JSON
    python benchmarks/bench_experts.py --dry-run       # validate arguments, print the plan (no GPU)
    python benchmarks/bench_experts.py --quick         # default configs only

Peers measured in the same run (GEMMs only, on rows already grouped by expert with the routing's
counts): `torch._grouped_mm` bf16 and `torch._scaled_grouped_mm` fp8 e4m3 with row-wise scales
(gate-up + down), at both token counts; the `ratios` block of the JSON (and the last table) sets our
rows against them and against the targets. The bf16 path that the triton backend takes at prefill
(torch._grouped_mm + fused gather / activation / combine) is also timed step by step (`stages`).

Ceilings measured in the same run: an 8192^3 bf16 torch.matmul (TFLOP/s) and a 4 GiB device copy
(bandwidth = bytes read + written / time). Decode is also compared with the HBM weight-read limit:
bytes of all local experts' weights (in the backend's format) / copy bandwidth.
Timing: triton.testing.do_bench (CUDA events, median, L2 flushed between calls) after warm-up;
prefill rotates among 3 input sets; decode replays a CUDA graph of the whole experts forward.
FLOPs counted: 2 * entries * (2*I*H + H*I) (useful work; padding rows of a tile not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BACKENDS = ("triton", "grouped_mm", "torch_loop", "flashinfer_cutlass", "deepgemm")
MODES = ("bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16", "mxfp4_w4a8")
# Modes each backend runs here (the others' rows are left out of the plan).
BACKEND_MODES = {
    "triton": ("bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16"),
    "grouped_mm": ("bf16",),
    "torch_loop": ("bf16",),
    # SM90 modes of FlashInfer's CUTLASS fused MoE; "autotuned": the tactics FlashInfer's autotuner
    # picks in this run; "default": the module's default tactics (what the layer runs unless told)
    "flashinfer_cutlass": ("bf16", "fp8_block", "mxfp4_w4a16", "mxfp4_w4a8"),
    # DeepGEMM's grouped GEMMs + our passes; decode also in the masked layout DeepEP low-latency delivers
    # (fp8_block: FP8 tokens in DeepEP's scale layout, as its FP8 dispatch delivers them)
    "deepgemm": ("bf16", "fp8_block"),
}
CUTLASS_PRESETS = ["autotuned", "default"]
# Triton presets swept per (mode, phase); "auto" = what the backend picks by itself. The wider
# layout / preset sweep with verification and fp8 diagnostics is benchmarks/tune_hopper.py.
SWEEP = {
    ("bf16", "decode"): ["auto", "decode_wide", "decode_deep", "small"],
    ("bf16", "prefill"): ["auto", "prefill", "prefill_nosplit", "prefill_m64", "medium"],
    ("fp8_block", "decode"): ["auto"],
    ("fp8_block", "prefill"): ["auto", "prefill", "medium_s4", "medium_s4w8", "medium_split", "medium_g2w8"],
    # W4A16 decode: the default (16-row tiles split to 8 rows where they have <= 8), the same without the split,
    # the Triton kernels, no split and no register cap, two row groups per warp (128 rows on 4 warps), the
    # other mode's tiles
    ("nvfp4_w4a16", "decode"): ["auto", "decode", "triton_w4a16", "g:2:0:decode", "g:2:128:decode:128:4",
                                "g:4:128:decode:128:8"],
    # W4A16 prefill: auto (the tail tiles since 2026-12-02) against the same wgmma preset without them
    ("nvfp4_w4a16", "prefill"): ["auto", "wgmma_w4r128_kp_pend", "prefill_n128", "medium"],
    ("mxfp4_w4a16", "decode"): ["auto", "decode", "triton_w4a16", "g:4:0:decode:128:8", "g:2:128:decode:128:4",
                                "g:2:128:decode"],
    ("mxfp4_w4a16", "prefill"): ["auto", "wgmma_w4r128_kp_pend", "prefill_n128", "medium"],
}
# Pseudo presets (configuration switches, not tile presets): "legacy_fp4" / "packed_fp4" /
# "asm_fp4" / "words_fp4" = triton with triton_fp4_convert=legacy / packed / asm / words (auto: the
# default, FP4_CONVERT; legacy and packed run the Triton kernels; words loads its own bit-permuted
# copy of the weights); "triton_w4a16" = W4A16 decode tiles on the Triton kernels instead of the Gluon ones
# (triton_w4a16_decode=triton); "noprefetch_fp4" = FP4_SCALE_PREFETCH off; "torch_epilogue" =
# grouped_mm with grouped_mm_epilogue=torch. "rows:<preset>" / "tiles:<preset>" = that preset with the fp4
# weights in that layout (option triton_fp4_layout, its own copy of the weights; e.g. "rows:auto"; without
# a prefix: the default, FP4_LAYOUT).
FP4_LAYOUT_PREFIXES = ("rows:", "tiles:")
FP4_CONVERT_PRESETS = {"legacy_fp4": "legacy", "packed_fp4": "packed", "asm_fp4": "asm", "words_fp4": "words"}
QUICK_SWEEP = {
    ("triton", "bf16", "prefill"): ["auto", "prefill"],  # the grouped_mm path and the Triton GEMMs
    ("triton", "nvfp4_w4a16", "decode"): ["auto", "triton_w4a16", "packed_fp4"],
    ("triton", "mxfp4_w4a16", "decode"): ["auto", "triton_w4a16", "packed_fp4"],
    ("grouped_mm", "bf16", "prefill"): ["auto", "torch_epilogue"],
    ("deepgemm", "bf16", "decode"): ["auto", "masked"],
    ("deepgemm", "fp8_block", "decode"): ["auto", "masked"],
}


@dataclass(frozen=True)
class Run:
    backend: str
    mode: str
    phase: str  # "decode" | "prefill"
    num_tokens: int
    preset: str = "auto"  # triton only


@dataclass
class Result:
    run: Run
    ms: float
    tflops: float
    pct_matmul: float
    weight_gbps: Optional[float] = None
    pct_hbm: Optional[float] = None
    preset_used: str = ""
    note: str = ""


@dataclass
class Report:
    gpu: str = ""
    torch: str = ""
    triton: str = ""
    matmul_tflops: float = 0.0
    copy_gbps: float = 0.0
    shape: dict = field(default_factory=dict)
    results: List[Result] = field(default_factory=list)
    peers: List[dict] = field(default_factory=list)  # torch grouped GEMMs only: name, phase, ms, tflops
    stages: dict = field(default_factory=dict)  # grouped_mm path, prefill: step -> ms
    ratios: List[dict] = field(default_factory=list)  # what / value / target / met


def build_plan(args) -> List[Run]:
    backends = args.backends.split(",")
    modes = args.modes.split(",")
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; choose from {BACKENDS}")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {MODES}")
    phases = [("decode", args.decode_tokens), ("prefill", args.prefill_tokens)]
    plan = []
    for backend in backends:
        for mode in modes:
            if mode not in BACKEND_MODES[backend]:
                continue
            for phase, T in phases:
                if T <= 0:
                    continue
                if backend == "flashinfer_cutlass":
                    presets = CUTLASS_PRESETS  # both: the layer runs the default tactics
                elif args.quick or backend != "triton":
                    presets = QUICK_SWEEP.get((backend, mode, phase), ["auto"])
                    if not args.quick and backend == "grouped_mm":
                        presets = ["auto", "torch_epilogue"] if phase == "prefill" else ["auto"]
                else:
                    presets = SWEEP[(mode, phase)]
                if args.presets and backend == "triton":
                    from epmoe.experts.triton.triton_experts import presets_for

                    known = set(presets_for(mode)) | {"auto"} | set(FP4_CONVERT_PRESETS)
                    presets = [p for p in args.presets.split(",")
                               if p in known or p.startswith(("g:",) + FP4_LAYOUT_PREFIXES)]
                if backend == "deepgemm" and phase == "decode" and args.expected_m:
                    presets = list(presets) + [f"masked:em={m}" for m in args.expected_m.split(",")]
                for p in presets:
                    plan.append(Run(backend, mode, phase, T, p))
    return plan


# --------------------------------------------------------------------------- GPU part


def _bench(fn, warmup_ms: float = 100, rep_ms: float = 400) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measure_ceilings(dev):
    import torch

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    # Sustained rate, timed exactly like the kernels below (do_bench: ~0.4 s of back-to-back products,
    # median). A short burst (10 products after 3 warm-ups, as KINDS.md measures) runs at higher
    # clocks: on the H200 here 747-788 TFLOP/s burst vs 687-708 sustained. Both are printed; the
    # percentages use the sustained rate, the like-for-like comparison.
    ms = _bench(lambda: torch.matmul(a, b))
    tflops = 2 * 8192**3 / (ms * 1e-3) / 1e12
    for _ in range(3):
        torch.matmul(a, b)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        torch.matmul(a, b)
    e.record()
    torch.cuda.synchronize()
    burst = 2 * 8192**3 * 10 / (s.elapsed_time(e) * 1e-3) / 1e12
    print(f"matmul ceiling: sustained {tflops:.0f} TFLOP/s (do_bench median), burst {burst:.0f} TFLOP/s (10 products)")
    del a, b
    src = torch.empty(4 << 30, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    gbps = 2 * src.numel() / (ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return tflops, gbps


def measure_peers(dev, E, H, I, K, phases, flops_per_entry, routing) -> List[dict]:
    """torch's own grouped GEMMs (gate-up then down) on rows pre-grouped with the benchmark routing's
    per-expert counts: bf16 `torch._grouped_mm` and fp8 e4m3 row-wise `torch._scaled_grouped_mm`
    (per-row activation scales, per-output-channel weight scales, bf16 out)."""
    import torch

    out = []
    g = torch.Generator(device=dev).manual_seed(7)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
    Mmax = max(T for _, T in phases) * K
    xs = torch.randn(Mmax, H, generator=g, device=dev, dtype=torch.bfloat16)
    a = torch.randn(Mmax, I, generator=g, device=dev, dtype=torch.bfloat16)

    def rowwise(t):  # e4m3 with one fp32 scale per row of the last-but-one axis
        amax = t.abs().amax(dim=-1).float().clamp_min(1e-12)
        s = amax / 448.0
        return (t.float() / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), s

    fp8 = None
    try:
        w13_8, s13 = rowwise(w13)
        w2_8, s2 = rowwise(w2)
        xs_8, sx = rowwise(xs)
        a_8, sa = rowwise(a)
        fp8 = (w13_8, s13, w2_8, s2, xs_8, sx, a_8, sa)
    except Exception as e:  # noqa: BLE001
        print(f"peer fp8 quantization failed: {type(e).__name__}: {str(e)[:200]}")
    for phase, T in phases:
        M = T * K
        ids = routing(T)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E)[:E]
        offs = torch.cumsum(counts, 0).to(torch.int32)
        variants = [("torch._grouped_mm bf16", lambda: (
            torch._grouped_mm(xs[:M], w13.transpose(1, 2), offs=offs),
            torch._grouped_mm(a[:M], w2.transpose(1, 2), offs=offs)))]  # fmt: skip
        if fp8 is not None and hasattr(torch, "_scaled_grouped_mm"):
            w13_8, s13, w2_8, s2, xs_8, sx, a_8, sa = fp8
            variants.append(("torch._scaled_grouped_mm fp8 rowwise", lambda: (
                torch._scaled_grouped_mm(xs_8[:M], w13_8.transpose(1, 2), sx[:M].contiguous(), s13, offs=offs,
                                         out_dtype=torch.bfloat16),
                torch._scaled_grouped_mm(a_8[:M], w2_8.transpose(1, 2), sa[:M].contiguous(), s2, offs=offs,
                                         out_dtype=torch.bfloat16))))  # fmt: skip
        for name, fn in variants:
            try:
                fn()
                torch.cuda.synchronize()
                ms = _bench(fn)
            except Exception as e:  # noqa: BLE001
                print(f"peer {name} {phase} failed: {type(e).__name__}: {str(e)[:300]}")
                out.append(dict(name=name, phase=phase, num_tokens=T, ms=float("nan"), tflops=float("nan"), note=str(e)[:300]))
                continue
            tflops = M * flops_per_entry / (ms * 1e-3) / 1e12
            out.append(dict(name=name, phase=phase, num_tokens=T, ms=ms, tflops=tflops))
            print(f"  peer {name:38} {phase:7} T={T:5d} {ms:8.3f} ms {tflops:6.1f} TFLOP/s (GEMMs only)", flush=True)
    del w13, w2, xs, a, fp8
    torch.cuda.empty_cache()
    return out


def grouped_stage_ms(ex, tokens) -> dict:
    """Step times of the grouped_mm path (align, gather, gemm1, act, gemm2, combine), each timed alone
    after one full pass has filled its inputs."""
    import torch

    from epmoe.experts.triton.grouped_mm import grouped_mm_steps

    if ex.name == "grouped_mm":
        params, il, launch = ex.parameters(), False, ex._launch
    else:
        params, il, launch = ex.parameters(), ex.gate_up_interleaved, ex._launch
    state = {}
    steps = grouped_mm_steps(tokens.hidden, tokens.topk_ids, tokens.topk_weights, params, ex.config,
                             ex.num_experts, il, launch, state, keep=True)  # fmt: skip
    for _, f in steps:
        f()
    torch.cuda.synchronize()
    res = {name: _bench(f, warmup_ms=20, rep_ms=100) for name, f in steps}
    res["sum"] = sum(res.values())
    return res


def compute_ratios(report) -> List[dict]:
    """Our rows against the peers of the same run and the targets."""

    def ours(backend, mode, phase, preset="auto"):
        for r in report.results:
            if (r.run.backend, r.run.mode, r.run.phase, r.run.preset) == (backend, mode, phase, preset) and r.ms == r.ms:
                return r
        return None

    def peer(prefix, phase):
        for p in report.peers:
            if p["name"].startswith(prefix) and p["phase"] == phase and p["ms"] == p["ms"]:
                return p["ms"]
        return None

    out = []

    def add(what, num, den, target, le=True):
        if num is None or den is None:
            return
        v = num / den
        out.append(dict(what=what, value=v, target=target, met=(v <= target) if le else (v >= target)))

    bf16_gemms = peer("torch._grouped_mm", "prefill")
    fp8_gemms = peer("torch._scaled_grouped_mm", "prefill")
    t = lambda *k: (ours(*k).ms if ours(*k) else None)  # noqa: E731
    add("triton bf16 prefill (auto) / torch._grouped_mm GEMMs", t("triton", "bf16", "prefill"), bf16_gemms, 1.15)
    add("triton bf16 prefill (Triton GEMMs, preset prefill) / torch._grouped_mm GEMMs",
        t("triton", "bf16", "prefill", "prefill"), bf16_gemms, 1.15)  # fmt: skip
    add("grouped_mm backend prefill / its GEMMs (torch._grouped_mm)", t("grouped_mm", "bf16", "prefill"), bf16_gemms, 1.25)
    add("triton fp8_block prefill / torch._scaled_grouped_mm rowwise GEMMs", t("triton", "fp8_block", "prefill"),
        fp8_gemms, 1.25)  # fmt: skip
    for mode, target in (("bf16", 0.7), ("fp8_block", 0.9), ("nvfp4_w4a16", 0.7), ("mxfp4_w4a16", 0.7)):
        r = ours("triton", mode, "decode")
        if r is not None and r.pct_hbm is not None:
            out.append(dict(what=f"triton {mode} decode: fraction of the HBM weight-read limit", value=r.pct_hbm / 100,
                            target=target, met=r.pct_hbm / 100 >= target))  # fmt: skip
    for mode in BACKEND_MODES["flashinfer_cutlass"]:
        for phase in ("decode", "prefill"):
            add(f"triton {mode} {phase} / flashinfer_cutlass {mode} {phase} (autotuned)", t("triton", mode, phase),
                t("flashinfer_cutlass", mode, phase, "autotuned"), 1.0)  # fmt: skip
    add("triton fp8_block prefill / DeepGEMM fp8 contiguous GEMMs", t("triton", "fp8_block", "prefill"),
        peer("deepgemm fp8 contiguous", "prefill"), 1.15)  # fmt: skip
    add("triton fp8_block decode / DeepGEMM fp8 masked GEMMs", t("triton", "fp8_block", "decode"),
        peer("deepgemm fp8 masked", "decode"), 1.0)  # fmt: skip
    add("triton bf16 prefill / DeepGEMM bf16 contiguous GEMMs", t("triton", "bf16", "prefill"),
        peer("deepgemm bf16 contiguous", "prefill"), 1.0)  # fmt: skip
    add("deepgemm fp8_block prefill / DeepGEMM fp8 contiguous GEMMs (bare)", t("deepgemm", "fp8_block", "prefill"),
        peer("deepgemm fp8 contiguous", "prefill"), 1.15)  # fmt: skip
    add("triton fp8_block prefill / deepgemm fp8_block prefill (speed-up)", t("triton", "fp8_block", "prefill"),
        t("deepgemm", "fp8_block", "prefill"), 1.8, le=False)  # fmt: skip
    add("deepgemm bf16 prefill / torch._grouped_mm GEMMs", t("deepgemm", "bf16", "prefill"), bf16_gemms, 0.87)
    add("deepgemm fp8_block prefill / triton fp8_block prefill", t("deepgemm", "fp8_block", "prefill"),
        t("triton", "fp8_block", "prefill"), 1.0)  # fmt: skip
    for mode in BACKEND_MODES["deepgemm"]:
        r = ours("deepgemm", mode, "decode", "masked")
        if r is not None and r.pct_hbm is not None:
            out.append(dict(what=f"deepgemm {mode} decode, masked layout: fraction of the HBM weight-read limit",
                            value=r.pct_hbm / 100, target=0.9, met=r.pct_hbm / 100 >= 0.9))  # fmt: skip
    r = ours("triton", "bf16", "prefill")
    if r is not None and r.pct_matmul == r.pct_matmul:
        out.append(dict(what="triton bf16 prefill: fraction of the sustained dense bf16 rate", value=r.pct_matmul / 100,
                        target=0.75, met=r.pct_matmul / 100 >= 0.75))  # fmt: skip
    add("grouped_mm backend prefill, torch epilogue (before) / its GEMMs", t("grouped_mm", "bf16", "prefill", "torch_epilogue"),
        bf16_gemms, 1.25)  # fmt: skip
    for mode in ("nvfp4_w4a16", "mxfp4_w4a16"):
        for phase in ("decode", "prefill"):
            new = t("triton", mode, phase)
            for name in list(FP4_CONVERT_PRESETS) + ["triton_w4a16"]:
                old = t("triton", mode, phase, name)
                if new is not None and old is not None:
                    what = ("Triton kernels" if name == "triton_w4a16" else f"{FP4_CONVERT_PRESETS[name]} fp4 conversion")
                    out.append(dict(what=f"triton {mode} {phase}: {what} time / default's (default's speed-up)", value=old / new,
                                    target=1.0, met=old / new >= 1.0))  # fmt: skip
        add(f"triton bf16 decode / triton {mode} decode (speed-up)", t("triton", "bf16", "decode"),
            t("triton", mode, "decode"), 2.5, le=False)  # fmt: skip
        add(f"triton {mode} prefill / triton bf16 prefill", t("triton", mode, "prefill"), t("triton", "bf16", "prefill"), 1.0)
    return out


def masked_tokens(tokens, num_experts: int, fp8: bool = False):
    """Flat DispatchedTokens (every slot local) -> the masked layout DeepEP low-latency delivers:
    hidden [E, M, H] with each expert's rows first (M = T: an expert gets each token at most once),
    expert_counts [E] int32. fp8: the tokens as DeepEP's FP8 low-latency dispatch delivers them (the
    wire of an fp8_block plan): e4m3 [E, M, H] and fp32 1x128 scales [E, M, H/128] stored MN-major
    (a transposed [E, H/128, M]), so the experts quantize nothing."""
    import torch

    from epmoe.dispatch.base import DispatchedTokens

    x, ids = tokens.hidden, tokens.topk_ids
    T_, K = ids.shape
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)
    e_of = flat[order]
    slot = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[e_of]
    hidden = torch.zeros(num_experts, T_, x.shape[1], dtype=x.dtype, device=x.device)
    hidden[e_of, slot] = x[order // K]
    if fp8:
        from epmoe.quant import codec, fp8_block
        from epmoe.quant.payload import QuantizedActivation

        E, M, H = hidden.shape
        q, s = fp8_block.quantize_activation(hidden.reshape(E * M, H).float())
        scales = s.view(E, M, H // 128).transpose(1, 2).contiguous().transpose(1, 2)  # MN-major, as DeepEP's
        hidden = QuantizedActivation(codec.payload_format("fp8", x.dtype), q.view(E, M, H), scales, H)
    return DispatchedTokens(hidden, None, None, layout="masked", expert_counts=counts.to(torch.int32))


class TorchLoopExperts:
    """Plain baseline: a Python loop over experts (host sync per expert), bf16 matmuls."""

    name = "torch_loop"

    def __init__(self, config, w13, w2):
        self.config, self.w13, self.w2 = config, w13, w2

    def __call__(self, tokens):
        import torch

        x, ids, w = tokens.hidden, tokens.topk_ids, tokens.topk_weights
        I = self.config.intermediate_size
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(self.w13.shape[0]):
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            h = x[rows] @ self.w13[e].T
            a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            y = a @ self.w2[e].T
            out.index_add_(0, rows, y.float() * w[rows, slots, None])
        return out.to(x.dtype)


class AutotunedCutlass:
    """A `flashinfer_cutlass` experts object called with FlashInfer's autotuner choosing the GEMM
    tactics (profile_ids=None after one tuning pass per input shape); the layer itself never
    autotunes (it passes explicit tactics)."""

    def __init__(self, ex):
        self.ex, self.config, self.spec, self.device = ex, ex.config, ex.spec, ex.device
        self.payload_format = ex.payload_format
        self.name = ex.name

    def parameters(self):
        return self.ex.parameters()

    def __call__(self, tokens):
        from flashinfer.fused_moe import cutlass_fused_moe

        kw = dict(self.ex.call_kwargs(tokens), profile_ids=None)
        cutlass_fused_moe(**kw)
        out = kw["output"]
        return out[:, : self.config.hidden_size] if self.ex.geometry.pads_hidden else out

    def tune(self, sets) -> str:
        import torch
        from flashinfer.autotuner import AutoTuner, autotune

        with autotune(True):
            for s in sets:
                self(s)
        torch.cuda.synchronize()
        picked = []
        try:
            for key, value in AutoTuner.get().profiling_cache.items():
                if "fused_moe" in str(key):
                    picked.append(f"{str(key)[:60]} -> {str(value)[:40]}")
        except Exception:  # noqa: BLE001 - which tactic won is informative only
            pass
        return "tactics by FlashInfer's autotuner" + (f" ({'; '.join(picked[-2:])})" if picked else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="triton default presets only")
    ap.add_argument("--presets", default="", help="triton runs: these presets (those the mode has), e.g. auto,prefill_n128")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--experts", type=int, default=128, help="local experts")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--expected-m", default="",
                    help="deepgemm decode: also the masked layout with these expected_m hints, e.g. 4,16,32")
    ap.add_argument("--no-peers", action="store_true", help="skip the torch grouped-GEMM peers")
    ap.add_argument("--routing", default="uniform", choices=("uniform", "skewed"),
                    help="uniform random experts per token (default), or skewed: experts drawn with "
                         "probabilities ~ u^4 + 0.01 (tests/experts_testing.skewed_local_routing)")
    ap.add_argument("--fp4-convert", default=None, choices=("auto", "asm", "words", "packed", "legacy"),
                    help="triton W4A16 runs without a *_fp4 preset: this conversion instead of the default")
    ap.add_argument("--json", default=None, help="output JSON (default $OUT/bench_experts.json or bench_results/)")
    args = ap.parse_args(argv)
    for name in ("experts", "hidden", "inter", "top_k"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.top_k > args.experts:
        raise SystemExit(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    plan = build_plan(args)
    E, H, I, K = args.experts, args.hidden, args.inter, args.top_k
    flops_per_entry = 2 * (2 * I * H + H * I)
    print(f"plan: {len(plan)} runs; shape E_local={E} H={H} I={I} top_k={K}")
    for r in plan:
        T = r.num_tokens
        print(f"  {r.backend:10} {r.mode:12} {r.phase:7} T={T:5d} preset={r.preset:13} "
              f"{T * K * flops_per_entry / 1e9:8.1f} GFLOP")  # fmt: skip
    if args.dry_run:
        return 0
    return run_plan(args, plan)


def run_plan(args, plan: List[Run]) -> int:
    import torch
    import triton

    from epmoe.config import MoEConfig
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts import EXPERTS
    from tests import experts_testing as T
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.graphs import CapturedExperts
    from epmoe.experts.triton import triton_experts as TE

    GLUON_DEFAULTS = (TE.GLUON_W4A16_UNROLL, TE.GLUON_W4A16_MAXNREG, TE.GLUON_W4A16_BLOCK_N, TE.GLUON_W4A16_WARPS)
    GLUON_WORDS_TILES = dict(TE.GLUON_W4A16_WORDS_TILES)
    from epmoe.experts.triton.triton_experts import FP4_CONVERT, pick_config, presets_for
    from epmoe.quant.plan import QuantPlan

    dev = torch.device("cuda")
    E, H, I, K = args.experts, args.hidden, args.inter, args.top_k
    report = Report(
        gpu=torch.cuda.get_device_name(dev),
        torch=torch.__version__,
        triton=triton.__version__,
        shape=dict(local_experts=E, hidden=H, inter=I, top_k=K, routing=args.routing),
    )
    report.matmul_tflops, report.copy_gbps = measure_ceilings(dev)
    print(f"{report.gpu}: bf16 matmul 8192^3 {report.matmul_tflops:.0f} TFLOP/s, copy {report.copy_gbps:.0f} GB/s")

    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    weights = T.random_expert_weights(cfg, E, device=dev, seed=0)
    flops_per_entry = 2 * (2 * I * H + H * I)

    def inputs(T_, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(T_, H, generator=g, device=dev).bfloat16()
        route = T.skewed_local_routing if args.routing == "skewed" else T.random_local_routing
        ids, w = route(T_, K, E, dev, seed + 1)  # all K entries local, distinct
        return DispatchedTokens(x, ids, w)

    path = args.json or os.path.join(os.environ.get("OUT", "bench_results"), "bench_experts.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def save():  # after every row: a run cut short by a time limit keeps what it measured
        with open(path, "w") as f:
            json.dump(asdict(report), f, indent=1, default=str)

    t_start = time.time()
    phases = [(p, n) for p, n in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)) if n > 0]
    if not args.no_peers and hasattr(torch, "_grouped_mm"):
        report.peers = measure_peers(dev, E, H, I, K, phases, flops_per_entry,
                                     lambda T_: inputs(T_, 100).topk_ids)  # fmt: skip
    if not args.no_peers:
        import deepgemm_peer

        # in a child process: a crash inside DeepGEMM must not end this benchmark
        report.peers += deepgemm_peer.measure_isolated(E, H, I, K, phases, args.routing)
    save()
    current = {}  # (backend, mode) -> experts object (weights resident for its runs only)
    for run in plan:
        TE.GLUON_W4A16_WORDS_TILES = dict(GLUON_WORDS_TILES)  # a "g:" run below replaces them for itself
        conv = FP4_CONVERT_PRESETS.get(run.preset) or TE.resolve_fp4_convert(args.fp4_convert or FP4_CONVERT)
        layout = run.preset.split(":", 1)[0] if run.preset.startswith(FP4_LAYOUT_PREFIXES) else None
        key = (run.backend, run.mode, conv == "words", layout)  # the words conversion reads its own weight layout
        if key not in current:
            current.clear()
            torch.cuda.empty_cache()
            if run.backend == "torch_loop":
                ex = TorchLoopExperts(cfg, weights.w13(), weights.w2)
            else:
                opts = (("triton_fp4_convert", conv),) if run.backend == "triton" else ()
                if layout:
                    opts += (("triton_fp4_layout", layout),)
                max_tokens = max(args.decode_tokens, args.prefill_tokens) if run.backend == "flashinfer_cutlass" else None
                spec = ExpertsSpec(cfg, 0, 1, dev, plan=QuantPlan(expert_mode=run.mode), options=opts,
                                   max_tokens=max_tokens)
                cls = EXPERTS.get(run.backend)
                avail = cls.availability(spec)
                if not avail:
                    print(f"skip {run}: {avail.describe()}")
                    continue
                ex = cls(spec)
                ex.load_weights(weights)
            current[key] = ex
        ex = current[key]
        entries = run.num_tokens * K
        preset_used = ""
        if run.backend == "triton":
            preset = run.preset.split(":", 1)[1] if layout else run.preset
            TE.GLUON_W4A16_UNROLL, TE.GLUON_W4A16_MAXNREG, TE.GLUON_W4A16_BLOCK_N, TE.GLUON_W4A16_WARPS = GLUON_DEFAULTS
            if preset.startswith("g:"):  # Gluon W4A16: g:<unroll>:<maxnreg or 0>:<tile preset>[:<block_n>[:<warps>]]
                _, unroll, maxnreg, preset, *more = preset.split(":")
                TE.GLUON_W4A16_UNROLL, TE.GLUON_W4A16_MAXNREG = int(unroll), (int(maxnreg) or None)
                TE.GLUON_W4A16_BLOCK_N = int(more[0]) if more else GLUON_DEFAULTS[2]
                TE.GLUON_W4A16_WARPS = int(more[1]) if len(more) > 1 else GLUON_DEFAULTS[3]
                TE.GLUON_W4A16_WORDS_TILES = {}  # the variant as given, for every conversion
            tile = preset not in ("auto", "noprefetch_fp4", "triton_w4a16") and preset not in FP4_CONVERT_PRESETS
            TE.FP4_SCALE_PREFETCH = preset != "noprefetch_fp4"
            ex.w4a16_decode = "triton" if preset == "triton_w4a16" else TE.W4A16_DECODE_KERNEL
            ex.config_override = presets_for(run.mode)[preset] if tile else None
            ex.fp4_convert = conv
            preset_used = ex.tile_config(entries).describe()
            if run.mode in ("nvfp4_w4a16", "mxfp4_w4a16"):
                preset_used += f" fp4 convert {ex.fp4_convert if ex.fp4_packed else 'legacy'}"
                if ex.uses_gluon_w4a16(ex.tile_config(entries)):
                    preset_used += " (Gluon kernels)"
        elif run.backend == "grouped_mm":
            ex.epilogue = "torch" if run.preset == "torch_epilogue" else "triton"
            preset_used = f"epilogue {ex.epilogue}"
        sets = [inputs(run.num_tokens, 100 + i) for i in range(3)]
        note = ""
        target = ex
        try:
            if run.backend == "flashinfer_cutlass":
                # module built with FAST_BUILD: one 128x128x128 tile shape per grouped GEMM (see docs)
                if run.preset == "autotuned":
                    target = AutotunedCutlass(ex)
                    preset_used = target.tune(sets)
                else:
                    preset_used = f"default tactics {ex.profile_ids} of {ex.tactics.describe()}"
            if run.preset.split(":")[0] == "masked":  # [E, M, H] per-expert slots + counts, as DeepEP LL delivers
                em = int(run.preset.split("=")[1]) if "=" in run.preset else None  # "masked:em=N": expected_m N
                target.options = dataclasses.replace(target.options, expected_m=em)
                preset_used = f"expected_m {em or 'default (M * top_k / E)'}"
                msets = [masked_tokens(s_, E, fp8=run.mode == "fp8_block") for s_ in sets]
                it = iter(range(1 << 30))
                fn = lambda: target(msets[next(it) % 3])  # noqa: E731
                fn()
                torch.cuda.synchronize()
                ms = _bench(fn)
                note = "masked layout, eager (no graph)"
                del msets
            elif run.phase == "decode" and run.backend != "torch_loop":
                graph = CapturedExperts(target, max_rows=run.num_tokens, top_k=K)
                graph(sets[0])
                ms = _bench(graph.replay)
                note = "cuda graph"
                del graph
            else:
                it = iter(range(1 << 30))
                fn = lambda: target(sets[next(it) % 3])  # noqa: E731
                fn()
                torch.cuda.synchronize()
                ms = _bench(fn, warmup_ms=50, rep_ms=300 if run.backend != "torch_loop" else 1000)
        except Exception as e:  # keep going: one failing config must not lose the rest of the table
            print(f"FAILED {run}: {type(e).__name__}: {str(e)[:300]}")
            report.results.append(Result(run, float("nan"), float("nan"), float("nan"), note=f"failed: {e}"[:500]))
            continue
        if run.backend == "triton" and run.preset == "auto" and ex.uses_grouped_mm(entries):
            preset_used = "grouped_mm path (torch._grouped_mm + fused gather / activation / combine)"
        if run.phase == "prefill" and run.mode == "bf16" and run.preset == "auto" and run.backend != "torch_loop":
            if run.backend == "grouped_mm" or getattr(ex, "uses_grouped_mm", lambda n: False)(entries):
                try:
                    st = grouped_stage_ms(ex, sets[0])
                    report.stages[run.backend] = st
                    print("    stages: " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()) + " ms", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"    stages failed: {type(e).__name__}: {str(e)[:200]}")
        tflops = entries * flops_per_entry / (ms * 1e-3) / 1e12
        res = Result(run, ms, tflops, 100 * tflops / report.matmul_tflops, preset_used=preset_used, note=note)
        if run.phase == "decode":
            wbytes = sum(t.numel() * t.element_size() for t in getattr(ex, "parameters", lambda: {})().values())
            if run.backend == "torch_loop":
                wbytes = (ex.w13.numel() + ex.w2.numel()) * 2
            res.weight_gbps = wbytes / (ms * 1e-3) / 1e9
            res.pct_hbm = 100 * res.weight_gbps / report.copy_gbps
        report.results.append(res)
        report.ratios = compute_ratios(report)
        save()
        extra = f" weights {res.weight_gbps:6.0f} GB/s = {res.pct_hbm:5.1f}% of HBM" if res.weight_gbps else ""
        print(f"  {run.backend:10} {run.mode:12} {run.phase:7} T={run.num_tokens:5d} {run.preset:13} "
              f"{ms:8.3f} ms {tflops:6.1f} TFLOP/s ({res.pct_matmul:5.1f}% of matmul){extra}", flush=True)  # fmt: skip
        del sets
    print(f"benchmark time {time.time() - t_start:.0f} s")
    report.ratios = compute_ratios(report)
    print_table(report)
    save()
    print(f"wrote {path}")
    return 0


def print_table(report: Report) -> None:
    print()
    print(f"{report.gpu} | torch {report.torch} | triton {report.triton} | ceilings: bf16 matmul "
          f"{report.matmul_tflops:.0f} TFLOP/s, copy {report.copy_gbps:.0f} GB/s")  # fmt: skip
    hdr = f"{'backend':10} {'mode':12} {'phase':7} {'T':>5} {'preset':13} {'ms':>8} {'TFLOP/s':>8} {'%mm':>6} {'%HBM':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in report.results:
        hbm = f"{r.pct_hbm:6.1f}" if r.pct_hbm is not None else f"{'':6}"
        print(f"{r.run.backend:10} {r.run.mode:12} {r.run.phase:7} {r.run.num_tokens:5d} {r.run.preset:13} "
              f"{r.ms:8.3f} {r.tflops:8.1f} {r.pct_matmul:6.1f} {hbm}")  # fmt: skip
    best = {}
    for r in report.results:
        if r.ms == r.ms:  # not NaN
            k = (r.run.backend, r.run.mode, r.run.phase)
            if k not in best or r.ms < best[k].ms:
                best[k] = r
    if report.peers:
        print("peers (GEMMs only, rows pre-grouped): " + "; ".join(
            f"{p['name']} {p['phase']} {p['ms']:.3f} ms ({p['tflops']:.0f} TFLOP/s)" for p in report.peers))  # fmt: skip
    for backend, st in report.stages.items():
        print(f"stages ({backend}, prefill): " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()) + " ms")
    if report.ratios:
        print(f"{'ratio':82} {'value':>7} {'target':>7} met")
        for r in report.ratios:
            cmp = "<=" if "speed-up" not in r["what"] and "fraction" not in r["what"] else ">="
            print(f"{r['what']:82} {r['value']:7.3f} {cmp}{r['target']:5.2f} {'yes' if r['met'] else 'NO'}")
    print("best per backend/mode/phase: " + "; ".join(
        f"{b}/{m}/{p}: {r.run.preset} {r.ms:.3f} ms" for (b, m, p), r in sorted(best.items())))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
