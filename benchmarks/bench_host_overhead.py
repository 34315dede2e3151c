"""Eager host overhead of one EPMoE layer call: wall time of a synchronized call (CPU timer) against
the GPU's busy time for the same call (sum of kernel durations from the profiler) and the CUDA-event
span. overhead = wall - busy: Python, launches and host syncs that the GPU waits for.

    python benchmarks/bench_host_overhead.py                      # torch + flashinfer dispatchers, T 128 / 4096
    python benchmarks/bench_host_overhead.py --dispatchers torch --tokens 128 --json out.json
    python benchmarks/bench_host_overhead.py --cpu-smoke          # tiny shape on CPU (CI): wall time only

ep = 1 (one GPU, no process group), DeepSeek-V3 MoE shape with the experts scaled to fit (default 128
local experts, H 7168, I 2048, top-8, bf16, triton experts). Uses only the API that existed before the
resolver redesign (EPMoE(config, dispatcher=, experts=, max_num_tokens_per_rank=), load_weights with
an ExpertWeights, forward), so the same file measures an older checkout too: run it from each checkout
(PYTHONPATH=<checkout>) and compare the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch


def _git_rev() -> str:
    try:
        import epmoe

        root = os.path.dirname(os.path.dirname(os.path.abspath(epmoe.__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def _weights(cfg, device, seed=0):
    from epmoe.quant.weights import ExpertWeights

    g = torch.Generator(device=device).manual_seed(seed)  # on the device: 5e9 values are slow on a CPU
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=cfg.dtype).mul_(0.02)

    return ExpertWeights(w1=rnd(E, I, H), w3=rnd(E, I, H), w2=rnd(E, H, I))


def _busy_ms(prof, calls: int) -> float:
    """Sum of GPU kernel time per call (profiler, self device time of every event)."""
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        total += t
    return total / 1e3 / calls


def measure(dispatcher: str, experts: str, T: int, cfg, device, iters: int, warmup: int) -> dict:
    from epmoe import EPMoE

    layer = EPMoE(cfg, dispatcher=dispatcher, experts=experts, device=device, max_num_tokens_per_rank=max(T, 128))
    layer.load_weights(_weights(cfg, device))
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(device=device, dtype=cfg.dtype)
    logits = torch.randn(T, cfg.num_experts, generator=g).to(device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        layer(x, logits)
    sync()
    wall = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        layer(x, logits)
        sync()
        wall.append((time.perf_counter() - t0) * 1e3)
    out = {"dispatcher": dispatcher, "experts": getattr(layer.experts, "name", experts), "tokens": T,
           "wall_ms_median": statistics.median(wall), "wall_ms_min": min(wall)}
    if cuda:
        spans = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sync()
            start.record()
            layer(x, logits)
            end.record()
            sync()
            spans.append(start.elapsed_time(end))
        from torch.profiler import ProfilerActivity, profile

        n = max(3, iters // 4)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                layer(x, logits)
            sync()
        busy = _busy_ms(prof, n)
        out.update(event_ms_median=statistics.median(spans), device_busy_ms=busy,
                   host_overhead_ms=out["wall_ms_median"] - busy)
    close = getattr(layer, "close", None)
    if close is not None:
        close()
    else:
        layer.dispatcher.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dispatchers", default="torch,flashinfer")
    p.add_argument("--experts", default="triton")
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--num-experts", type=int, default=128, help="local experts (DeepSeek-V3 has 256; 128 fit with room)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--label", default=None, help="name this run in the JSON (e.g. before / after)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU, reference experts (CI)")
    args = p.parse_args(argv)

    from epmoe import MoEConfig

    if args.cpu_smoke:
        device = torch.device("cpu")
        cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.float32)
        dispatchers, experts, tokens = ["torch"], "reference", [16]
        args.iters, args.warmup = 3, 1
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        cfg = MoEConfig(num_experts=args.num_experts, top_k=8, hidden_size=7168, intermediate_size=2048,
                        dtype=torch.bfloat16)
        dispatchers, experts = args.dispatchers.split(","), args.experts
        tokens = [int(t) for t in args.tokens.split(",")]
    results = []
    for d in dispatchers:
        for T in tokens:
            try:
                results.append(measure(d, experts, T, cfg, device, args.iters, args.warmup))
            except Exception as e:  # noqa: BLE001 - one backend missing must not lose the others
                results.append({"dispatcher": d, "experts": experts, "tokens": T, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(results[-1]), file=sys.stderr)
    report = {
        "bench": "host_overhead", "label": args.label, "revision": _git_rev(), "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "shape": {"num_experts": cfg.num_experts, "top_k": cfg.top_k,
                                              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                                              "dtype": str(cfg.dtype)},
        "results": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
