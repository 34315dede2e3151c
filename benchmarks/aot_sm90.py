"""Compile every Triton kernel variant the `triton` experts backend (and the fused routing) launches for sm90, on a machine
WITHOUT a GPU (Triton's bundled ptxas), and report registers, spills, shared memory and the matrix
instructions in the SASS (HGMMA / QGMMA = Hopper wgmma; HMMA = mma.sync).

    python benchmarks/aot_sm90.py                 # all modes x presets, DeepSeek-V3 and GPT-OSS shapes
    python benchmarks/aot_sm90.py --quick         # one variant per weight format
    python benchmarks/aot_sm90.py --cases ds --modes nvfp4_w4a16 --presets wgmma_w4r128_kp,wgmma_w4r128_kp_pend

Columns: registers, spill instructions, shared memory, wgmma / mma.sync instructions, and the main
loop (the longest loop with a matrix instruction): its instructions per iteration and its full
wgmma waits (`WARPGROUP.DEPBAR.LE gsb0, 0x0`; 0 where each step's wgmmas stay in flight while the
next step's operands are made).

The launches are recorded from a real `TritonExperts.forward` on CPU tensors (launch intercepted), so
the compiled signatures, constexprs and specializations are the ones the device will see. Costs no
device time; catches compile errors (e.g. non-constexpr globals) the interpreter does not.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epmoe.config import MoEConfig  # noqa: E402
from epmoe.core.availability import Availability  # noqa: E402
from epmoe.dispatch.base import DispatchedTokens  # noqa: E402
from tests import experts_testing as T  # noqa: E402
from epmoe.experts.triton import triton_experts as TE  # noqa: E402
from epmoe.experts.base import ExpertsSpec  # noqa: E402
from epmoe.quant.plan import QuantPlan  # noqa: E402

_TL_TYPE = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}
_NO_SPECIALIZE = {"num_entries", "max_blocks"}


@dataclass(frozen=True)
class Launch:
    kernel: str
    args: tuple
    kwargs: tuple


def record_launches(config: MoEConfig, mode: str, num_tokens: int, num_experts: int, preset=None, grouped=False,
                    options: tuple = ()):
    """Run TritonExperts.forward on CPU with the kernel launches recorded instead of run (grouped:
    the bf16 torch._grouped_mm path with its fused gather / activation / combine kernels; options: the
    backend's spec options, e.g. (("triton_fp4_layout", "tiles"),))."""
    launches = []
    # A few local experts are enough: strides and shapes per expert are the real ones.
    ep_size = config.num_experts // num_experts
    spec = ExpertsSpec(config, 0, ep_size, torch.device("cpu"), plan=QuantPlan(expert_mode=mode), options=options)
    saved = TE.TritonExperts.__dict__["availability"]
    TE.TritonExperts.availability = classmethod(lambda cls, spec: Availability.yes("aot"))
    try:
        ex = TE.TritonExperts(spec)
    finally:
        TE.TritonExperts.availability = saved
    ex._launch = lambda name, grid, args, kwargs: launches.append(Launch(name, args, tuple(kwargs.items())))
    ex.load_weights(T.random_expert_weights(config, num_experts, seed=0))
    if preset is not None:
        ex.config_override = TE.presets_for(mode)[preset]
    if grouped:
        ex._grouped_mm_ok, ex.grouped_mm = True, "on"
    x = torch.randn(num_tokens, config.hidden_size).to(config.dtype)
    ids, w = T.random_local_routing(num_tokens, config.top_k, num_experts, seed=1)
    ex(DispatchedTokens(x, ids, w))
    return launches


def record_routing_launches(config: MoEConfig, num_tokens: int, align_block_m: int = 0):
    """The fused routing's launch (`epmoe.routing.Router`, impl "triton") for `config`, recorded;
    align_block_m > 0: the launch that also aligns (`Router.route_aligned`, one rank)."""
    from epmoe.routing import Router

    launches = []
    router = Router(config, torch.device("cuda"))  # the device's choice; nothing runs on it
    if router.impl != "triton":
        return launches
    router._launch = lambda name, grid, args, kwargs: launches.append(Launch(name, args, tuple(kwargs.items())))
    router.device = torch.device("cpu")  # the CPU logits below take the kernel's path (recorded)
    bias = torch.zeros(config.num_experts) if config.routing == "sigmoid_grouped" else None
    logits = torch.randn(num_tokens, config.num_experts)
    if align_block_m:
        router.route_aligned(logits, bias, config.num_experts, align_block_m)
    else:
        router(logits, bias)
    return launches


def to_source(launch: Launch):
    from triton.compiler import ASTSource

    if launch.kernel.startswith("w4a16_"):  # Gluon kernels (epmoe.experts.triton.gluon_w4a16)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

        from epmoe.experts.triton import gluon_w4a16 as module
    elif launch.kernel.startswith("route_"):  # the fused routing (epmoe.routing_kernels)
        from epmoe import routing_kernels as module
    else:
        from epmoe.experts.triton import triton_kernels as module
    fn = getattr(module, launch.kernel)
    kwargs = dict(launch.kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    names = fn.arg_names
    sig, consts, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(names, launch.args)):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TL_TYPE[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and name not in _NO_SPECIALIZE:
                sig[name] = "constexpr"
                consts[name] = 1
                continue
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and name not in _NO_SPECIALIZE:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{launch.kernel}.{name}: cannot type {type(value)}")
    for name, value in kwargs.items():
        sig[name] = "constexpr"
        consts[name] = value
    for p in fn.params:  # constexprs the launch leaves at their defaults (the JIT fills them in the same way)
        if p.is_constexpr and p.name not in sig and p.has_default:
            sig[p.name] = "constexpr"
            consts[p.name] = p.default
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), options


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def analyze(compiled) -> dict:
    cubin = compiled.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        res = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, _, local = (int(v) for v in m.groups()) if m else (-1, -1, -1, -1)
    return dict(
        regs=regs,
        stack=stack,
        local=local,
        smem=compiled.metadata.shared,
        hgmma=len(re.findall(r"\bHGMMA\b", sass)),
        qgmma=len(re.findall(r"\bQGMMA\b", sass)),
        hmma=len(re.findall(r"\bHMMA\b", sass)),
        ldl_stl=len(re.findall(r"\b(LDL|STL)\b", sass)),
        loop_ldl_stl=loop_spills(sass),
        **mma_loop(sass),
    )


def _instructions(sass: str):
    return [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _loops(ins):
    """[(first, last) address] of every loop: a backward branch and its target."""
    out = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            out.append((int(m.group(1), 16), addr))
    return out


def loop_spills(sass: str) -> int:
    """LDL / STL instructions inside loops of the SASS (between a backward branch's target and the
    branch): the spills that cost in every iteration, unlike a few values kept across a loop."""
    ins = _instructions(sass)
    inside = {a for lo, hi in _loops(ins) for a, _ in ins if lo <= a <= hi}
    return sum(1 for a, t in ins if a in inside and re.search(r"\b(LDL|STL)\b", t))


def mma_loop(sass: str) -> dict:
    """The main loop (the longest loop with a matrix instruction): its instructions per iteration, and
    its full wgmma waits (`WARPGROUP.DEPBAR.LE gsb0, 0x0`: every wgmma issued so far must finish,
    e.g. before registers they read are written)."""
    ins = _instructions(sass)
    best = []
    for lo, hi in _loops(ins):
        body = [t for a, t in ins if lo <= a <= hi]
        if any(re.search(r"\b(HGMMA|QGMMA|HMMA)\b", t) for t in body) and len(body) > len(best):
            best = body
    return dict(mma_loop=len(best), mma_loop_full_waits=sum(1 for t in best if re.search(r"DEPBAR\.LE gsb0, 0x0\b", t)))


CASES = {
    "ds": MoEConfig(num_experts=8, top_k=8, hidden_size=7168, intermediate_size=2048),
    "gptoss": MoEConfig(
        num_experts=8, top_k=4, hidden_size=2880, intermediate_size=2880, has_bias=True,
        swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
    ),  # fmt: skip
    "relu2": MoEConfig(num_experts=8, top_k=4, hidden_size=1024, intermediate_size=512, activation="relu2"),
}


ROUTING_CASES = {
    "ds": MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, routing="sigmoid_grouped",
                    n_group=8, topk_group=4, routed_scaling_factor=2.5),
    "qwen": MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
    "wide": MoEConfig(num_experts=512, top_k=10, hidden_size=2048, intermediate_size=512),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one variant per weight format")
    ap.add_argument("--modes", default=",".join(TE.SUPPORTED_MODES))
    ap.add_argument("--cases", default=",".join(CASES), help="shapes: " + ", ".join(CASES))
    ap.add_argument("--presets", default="", help="only these tile presets (default: every preset of each mode)")
    args = ap.parse_args(argv)
    bad = [c for c in args.cases.split(",") if c not in CASES]
    if bad:
        ap.error(f"unknown cases {bad}; use {', '.join(CASES)}")
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    modes = args.modes.split(",")
    jobs = []
    only = [p for p in args.presets.split(",") if p]
    for case, cfg in CASES.items():
        if case not in args.cases.split(","):
            continue
        for mode in modes:
            if mode in ("nvfp4_w4a16", "mxfp4_w4a16") and (cfg.hidden_size % 64 or cfg.intermediate_size % 64):
                continue
            presets = ["decode"] if args.quick else list(TE.presets_for(mode))
            if only:
                presets = [p for p in presets if p in only]
            if args.quick and case != "ds":
                continue
            for preset in presets:
                jobs.append((case, mode, preset))
            if mode == "bf16" and not only:
                jobs.append((case, mode, "grouped_mm"))
    seen = {}
    failures = 0
    print(f"triton {triton.__version__}, target sm90")
    print(f"{'case':7} {'mode':12} {'preset':13} {'kernel':22} {'regs':>4} {'spill':>5} {'smem':>6} {'wgmma':>5} {'mma':>4} "
          f"{'loop':>5} {'waits':>5} {'s':>5}")
    if not only:
        for routing_cfg in ROUTING_CASES.values():
            jobs.append((routing_cfg, "routing", "-"))
    for case, mode, preset in jobs:
        if mode == "routing":
            launches, case = record_routing_launches(case, num_tokens=64), case.routing[:7]
        else:
            cfg = CASES[case]
            grouped = preset == "grouped_mm"
            launches = record_launches(cfg, mode, num_tokens=16, num_experts=2, preset=None if grouped else preset,
                                       grouped=grouped)  # fmt: skip
        for launch in launches:
            src, opts = to_source(launch)
            key = (launch.kernel, repr(sorted(src.signature.items())), repr(launch.kwargs), repr(launch.args[-3:]))
            if key in seen:
                continue
            t0 = time.time()
            try:
                compiled = triton.compile(src, target=target, options=opts)
                info = analyze(compiled)
                seen[key] = info
                print(
                    f"{case:7} {mode:12} {preset:13} {launch.kernel:22} {info['regs']:4d} "
                    f"{info['local'] + info['ldl_stl']:5d} {info['smem']:6d} "
                    f"{info['hgmma'] + info['qgmma']:5d} {info['hmma']:4d} {info['mma_loop']:5d} "
                    f"{info['mma_loop_full_waits']:5d} {time.time() - t0:5.1f}"
                )
            except Exception as e:  # report and continue: the point is to see every failure
                failures += 1
                seen[key] = None
                msg = str(e).strip().splitlines()
                print(f"{case:7} {mode:12} {preset:13} {launch.kernel:22} FAILED: {' | '.join(msg[-3:])[:400]}")
    print(f"{len(seen)} variants, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
