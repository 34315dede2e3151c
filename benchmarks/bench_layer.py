"""Full MoE layer time against a plain baseline in the same run (GPU), and a plot of time vs tokens.

    python benchmarks/bench_layer.py [--shape dsv3|gpt-oss] [--tokens 128,512,1024,2048,4096]
        [--experts triton,grouped_mm,reference] [--dispatcher torch] [--json out.json] [--plot out.png]
    torchrun --nproc-per-node N benchmarks/bench_layer.py ...        # EP over N GPUs (NCCL)

Per tokens-per-rank T and configuration:
  baseline  plain PyTorch: route, NCCL all_to_all_single of the routed (token, expert) rows with
            exchanged split sizes, one torch matmul chain per local expert, all_to_all back, sum
  eager     EPMoE.forward (agreement collective, dispatch, experts, combine)
  graph     EPMoE.decode_runner(T) replayed from a CUDA graph (fixed shapes, no host sync)
Times are CUDA-event medians over --iters after --warmup, inputs rotated over 4 sets; the slowest
rank counts. `--dry-run` prints the runs without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

SHAPES = {
    # DeepSeek-V3 MoE layer: 256 experts, top-8, H=7168, I=2048 (one H200 holds 128 of them)
    "dsv3": dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048),
    # gpt-oss-120b: 128 experts, top-4, H=I=2880, biases, clamped SwiGLU
    "gpt-oss": dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880, has_bias=True,
                    swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="dsv3", choices=sorted(SHAPES))
    p.add_argument("--local-experts", type=int, default=128,
                   help="experts per rank (the shape's E is scaled to local_experts x ranks)")
    p.add_argument("--tokens", default="128,512,1024,2048,4096")
    p.add_argument("--experts", default="triton,grouped_mm")
    p.add_argument("--dispatcher", default="torch")
    p.add_argument("--graph-max-tokens", type=int, default=4096, help="capture graphs up to this T")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    a.tokens = [int(t) for t in a.tokens.split(",")]
    a.experts = [e for e in a.experts.split(",") if e]
    if any(t <= 0 for t in a.tokens):
        p.error("--tokens must be positive")
    return a


def _time(fn, iters, warmup, sets):
    for i in range(warmup):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        if dist.is_initialized():
            dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(sets[i % len(sets)])
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    ms = statistics.median(times)
    if dist.is_initialized():
        t = torch.tensor([ms], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t)
    return ms


def main(argv=None) -> int:
    a = parse(argv)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if a.dry_run:
        for T in a.tokens:
            print(f"would time shape={a.shape} ranks={ranks} T/rank={T}: baseline, "
                  + ", ".join(f"{e} eager" + (f", {e} graph" if T <= a.graph_max_tokens else "") for e in a.experts))
        return 0
    if not torch.cuda.is_available():
        print("bench_layer needs a CUDA GPU (use --dry-run to see the runs)", file=sys.stderr)
        return 2
    from epmoe import EPMoE, ExpertWeights, MoEConfig

    if ranks > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    shape = dict(SHAPES[a.shape])
    shape["num_experts"] = a.local_experts * ranks
    cfg = MoEConfig(dtype=torch.bfloat16, **shape)
    E_local, H, I = a.local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    dev = torch.device("cuda", torch.cuda.current_device())

    def rnd(*s, scale):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(torch.bfloat16)

    # this rank's experts only (the layer keeps only its slice anyway)
    w1, w3, w2 = rnd(E_local, I, H, scale=H ** -0.5), rnd(E_local, I, H, scale=H ** -0.5), rnd(E_local, H, I, scale=I ** -0.5)
    b13 = rnd(E_local, 2 * I, scale=0.05) if cfg.has_bias else None
    b2 = rnd(E_local, H, scale=0.05) if cfg.has_bias else None
    local = ExpertWeights(w1=w1, w3=w3, w2=w2, b13=b13, b2=b2, first_expert=rank * E_local)
    from epmoe.nightly.worker import PlainEPMoE  # the straightforward EP MoE a user would write

    baseline = PlainEPMoE(cfg, torch.cat([w1, w3], 1), w2, rank, ranks, b13=b13, b2=b2)
    peak = {"matmul_tflops": None}
    if rank == 0:
        m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        ms = _time(lambda _: m @ m, 10, 3, [None])
        peak["matmul_tflops"] = 2 * 8192 ** 3 / ms / 1e9
        print(f"[bench_layer] {torch.cuda.get_device_name()} | bf16 8192^3 matmul {peak['matmul_tflops']:.0f} TFLOP/s | "
              f"shape {a.shape} E={cfg.num_experts} ({E_local}/rank) ranks={ranks}", flush=True)
    results = []
    layers = {}
    for name in a.experts:
        try:
            layer = EPMoE(cfg, dispatcher=a.dispatcher, device=dev, experts=name, max_num_tokens_per_rank=max(a.tokens))
            layer.load_weights(local)
            layers[name] = layer
        except Exception as e:  # noqa: BLE001 - report and go on with the other backends
            if rank == 0:
                print(f"[bench_layer] {name}: cannot build ({type(e).__name__}: {e})", flush=True)
    for T in a.tokens:
        sets = []
        for _ in range(4):
            sets.append((rnd(T, H, scale=1.0), torch.randn(T, cfg.num_experts, generator=g, device=dev)))
        flop = 2 * T * cfg.top_k * (2 * I * H + H * I)  # per rank, for uniform routing
        row = {"tokens_per_rank": T, "ranks": ranks, "flop_per_rank": flop}
        with torch.no_grad():
            row["baseline_ms"] = _time(lambda s: baseline(*s), a.iters, a.warmup, sets)
            for name, layer in layers.items():
                row[f"{name}_eager_ms"] = _time(lambda s: layer(*s), a.iters, a.warmup, sets)
                if T <= a.graph_max_tokens:
                    try:
                        runner = layer.decode_runner(T, cuda_graph=True)
                        row[f"{name}_graph_ms"] = _time(lambda s: runner(*s), a.iters, a.warmup, sets)
                        del runner
                    except Exception as e:  # noqa: BLE001
                        row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
        if rank == 0:
            parts = [f"baseline {row['baseline_ms']:.3f} ms"]
            for name in layers:
                for kind in ("eager", "graph"):
                    k = f"{name}_{kind}_ms"
                    if k in row:
                        parts.append(f"{name} {kind} {row[k]:.3f} ms ({row['baseline_ms'] / row[k]:.2f}x, "
                                     f"{flop / row[k] / 1e9:.0f} TFLOP/s)")
                    elif f"{name}_{kind}_error" in row:
                        parts.append(f"{name} {kind} error: {row[f'{name}_{kind}_error']}")
            print(f"[bench_layer] T={T}: " + " | ".join(parts), flush=True)
        results.append(row)
        del sets
        torch.cuda.empty_cache()
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "shape": a.shape, "config": cfg.to_dict(), "local_experts": E_local, **peak}
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
        if a.plot:
            _plot(a.plot, results, list(layers), meta)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _plot(path, results, names, meta):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench_layer] matplotlib missing: no plot", file=sys.stderr)
        return
    T = [r["tokens_per_rank"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(T, [r["baseline_ms"] for r in results], "k--o", label="plain baseline (per-expert torch matmuls)")
    for name in names:
        for kind, style in (("eager", "-o"), ("graph", "-s")):
            pts = [(r["tokens_per_rank"], r[f"{name}_{kind}_ms"]) for r in results if f"{name}_{kind}_ms" in r]
            if pts:
                ax.plot(*zip(*pts), style, label=f"epmoe {name} ({kind})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("layer time (ms)")
    ax.set_title(f"{meta['shape']} MoE layer, {meta['local_experts']} experts/rank, {meta['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[bench_layer] wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
