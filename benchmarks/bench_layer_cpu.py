"""CPU layer time and bytes dispatched vs tokens per rank, ep = 1 and 2 (gloo), tiny and a mid-size shape.

    python benchmarks/bench_layer_cpu.py [--tokens 64,256,1024,4096] [--ep 1,2] [--dispatch-dtypes bf16,nvfp4]
                                         [--json out.json]

Each configuration: a fresh process group, warm-up, then the median of --repeats forwards (the slowest
rank's time per step). Prints a table with time per token relative to the smallest T, so a cost that
does not grow linearly in T stands out (ratio far from 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {
    # name: MoEConfig kwargs
    "tiny": dict(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128),
    "mid": dict(num_experts=32, top_k=8, hidden_size=2048, intermediate_size=768),  # Qwen3-MoE experts, 1/4 of them
}


def _worker(rank, world, init_file, shape, tokens_list, repeats, queue, dispatch_dtype="bf16"):
    from epmoe import EPMoE, ExpertWeights, MoEConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    cfg = MoEConfig(dtype=torch.bfloat16, **SHAPES[shape])
    g = torch.Generator().manual_seed(0)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w = ExpertWeights(w1=(torch.randn(E, I, H, generator=g) * H ** -0.5).bfloat16(),
                      w3=(torch.randn(E, I, H, generator=g) * H ** -0.5).bfloat16(),
                      w2=(torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16())
    layer = EPMoE(cfg, max_num_tokens_per_rank=max(tokens_list), dispatch_dtype=dispatch_dtype)
    layer.load_weights(w)
    rows = []
    for T in tokens_list:
        x = torch.randn(T, H, generator=g).bfloat16()
        logits = torch.randn(T, E, generator=g)
        layer(x, logits)  # warm-up
        times, sent = [], 0
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            out = layer(x, logits, return_stats=True)
            times.append(time.perf_counter() - t0)
            sent = out.stats.bytes_sent
        rows.append((T, statistics.median(times), sent))  # bytes this rank sent to the others
    all_rows = [None] * world
    dist.all_gather_object(all_rows, rows)
    if rank == 0:
        queue.put(all_rows)
    dist.destroy_process_group()


def run(shape: str, ep: int, tokens_list, repeats: int, dispatch_dtype: str = "bf16"):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, ep, init_file, shape, tokens_list, repeats, queue, dispatch_dtype))
             for r in range(ep)]
    for p in procs:
        p.start()
    per_rank = queue.get(timeout=1800)
    for p in procs:
        p.join()
    out = []
    for i, T in enumerate(tokens_list):
        t = max(r[i][1] for r in per_rank)
        sent = sum(r[i][2] for r in per_rank) / ep
        out.append({"shape": shape, "ep": ep, "dispatch": dispatch_dtype, "tokens_per_rank": T, "ms": t * 1e3,
                    "bytes_sent_per_rank": sent})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,256,1024,4096")
    p.add_argument("--ep", default="1,2")
    p.add_argument("--shapes", default="tiny,mid")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dispatch-dtypes", default="bf16", help="comma list of bf16,nvfp4 (tokens on the wire)")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    a = p.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    eps = [int(e) for e in a.ep.split(",")]
    shapes = a.shapes.split(",")
    dds = a.dispatch_dtypes.split(",")
    for d in dds:
        if d not in ("bf16", "nvfp4", "fp8"):
            p.error(f"unknown dispatch dtype {d!r}; use bf16, nvfp4 or fp8")
    for s in shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {sorted(SHAPES)}")
    if a.dry_run:
        for s in shapes:
            for ep in eps:
                print(f"would run shape={s} ep={ep} dispatch={dds} tokens={tokens} repeats={a.repeats}")
        return 0
    results = []
    print(f"{'shape':>5} {'ep':>3} {'wire':>5} {'T/rank':>7} {'ms/fwd':>9} {'us/token':>9} {'vs smallest T':>13} "
          f"{'KiB sent/rank':>13}")
    for s in shapes:
        for ep in eps:
            for dd in (dds if ep > 1 else ["bf16"]):  # one rank sends nothing: the wire format is moot
                rows = run(s, ep, tokens, a.repeats, dd)
                base = rows[0]["ms"] / rows[0]["tokens_per_rank"]
                for r in rows:
                    per_tok = r["ms"] / r["tokens_per_rank"]
                    r["time_per_token_vs_smallest"] = per_tok / base
                    print(f"{s:>5} {ep:>3} {dd:>5} {r['tokens_per_rank']:>7} {r['ms']:>9.2f} {per_tok * 1e3:>9.1f} "
                          f"{per_tok / base:>13.2f} {r['bytes_sent_per_rank'] / 1024:>13.1f}", flush=True)
                results += rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
