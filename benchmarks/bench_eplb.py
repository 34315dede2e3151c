"""EPLB under skewed routing: max/mean rank load and layer step time without EPLB, rearranged (R = 0) and
with redundant experts, on gloo ranks (CPU, or several ranks sharing one GPU).

    python benchmarks/bench_eplb.py --json out.json --png load.png               # CPU, 2 ranks
    python benchmarks/bench_eplb.py --device cuda --ep 4 --experts triton --shape qwen3 --tokens 2048 \\
        --json eplb_gpu.json                                                      # 4 ranks sharing one GPU

Routing: `tests/experts_testing.skewed_local_routing` (the experts benchmark's skewed router: each token
draws top-k distinct experts with probabilities ~ u^4 + 0.01, u uniform per expert, the same for every
token), one pool of rows drawn once and sliced per step and rank: a stationary skew, new tokens every
step, replayed into the layer as (topk_ids, topk_weights).
Per configuration: a fresh layer, `--window` steps measured as "before" (load and time; the first two
untimed), then for EPLB configurations one `layer.rebalance()` planned from those steps' recorded load
(its time and bytes reported), then `--steps` steps measured as "after". Load per rank = routed
(token, expert) pairs its experts computed (`StepStats.tokens_per_local_expert`); step time = the
slowest rank's, median over steps; on CPU also the experts stage alone (the slowest rank's, median).

On several ranks sharing one GPU (`--device cuda`, gloo, shared-GPU mode) the ranks' kernels run on the
same device and the torch dispatcher stages tokens through host memory: step times are local cost
only and measure no link (docs/shared-gpu.md). The load figures do not depend on the device.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SHAPES = {
    # name: MoEConfig kwargs (E, K, H, I)
    "tiny": dict(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128),
    "mid": dict(num_experts=32, top_k=4, hidden_size=1024, intermediate_size=512),
    "qwen3": dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),  # Qwen3-30B-A3B experts
}


def _configurations(redundant):
    """(name, EPLBConfig kwargs or None)."""
    out = [("off", None), ("R=0", dict(num_redundant_experts=0))]
    out += [(f"R={r}", dict(num_redundant_experts=r)) for r in redundant if r > 0]
    return out


def _worker(rank, world, init_file, a, queue):
    import torch.distributed as dist

    from epmoe import EPLBConfig, EPMoE, MoEConfig
    from epmoe.core import dist as edist
    from tests import experts_testing as T
    from tests.cpu.helpers import random_weights

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    # CPU: float32 (the reference experts would convert bf16 weights on every call, a cost per expert
    # rather than per routed token, which is what placement changes)
    cfg = MoEConfig(dtype=torch.bfloat16 if cuda else torch.float32, **SHAPES[a.shape])
    weights = random_weights(cfg, a.seed)
    steps_total = a.window + a.steps
    T_rank, K = a.tokens, cfg.top_k
    pool_ids, pool_w = T.skewed_local_routing(T_rank * world * steps_total, K, cfg.num_experts, seed=a.seed,
                                              power=a.power)
    g = torch.Generator().manual_seed(a.seed + rank)
    x = (torch.randn(T_rank, cfg.hidden_size, generator=g) * 0.5).to(dev, cfg.dtype)

    def routing(step):
        lo = (step * world + rank) * T_rank
        return pool_ids[lo:lo + T_rank].to(dev), pool_w[lo:lo + T_rank].to(dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results = []
    for name, eplb in _configurations(a.redundant):
        layer = EPMoE(cfg, dispatcher=a.dispatcher, experts=a.experts, quant=a.quant, device=dev,
                      max_num_tokens_per_rank=T_rank, shared_gpu=cuda,
                      eplb=None if eplb is None else EPLBConfig(min_improvement=0.0, **eplb))
        layer.load_weights(weights)
        expert_s = []
        if not cuda:  # CPU: the experts stage alone, timed per call (synchronous there)
            forward = layer.experts.forward

            def timed(tokens, _forward=forward, **kw):
                t = time.perf_counter()
                y = _forward(tokens, **kw)
                expert_s.append(time.perf_counter() - t)
                return y
            layer.experts.forward = timed
        phases = {"before": [], "after": []}
        report = None
        for step in range(steps_total):
            if step == a.window and eplb is not None:
                dist.barrier()
                report = layer.rebalance(force=True)
            ids, w = routing(step)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            out = layer(x, topk_ids=ids, topk_weights=w, return_stats=True)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            phase = "before" if step < a.window else "after"
            phases[phase].append((ms if step >= 2 else None, int(out.stats.tokens_per_local_expert.sum()),
                                  expert_s[-1] * 1e3 if expert_s else None))
        gathered = edist.all_gather_objects(phases, None, 600)
        row = {"config": name, "slots": layer.placement.num_slots,
               "placement": layer.placement.slot_to_expert if eplb is not None else None}
        for phase in ("before", "after"):
            load = [sum(l for _, l, _ in g[phase]) for g in gathered]
            timed_steps = [i for i in range(len(gathered[0][phase])) if gathered[0][phase][i][0] is not None]
            slowest = lambda col: [max(g[phase][i][col] for g in gathered) for i in timed_steps]  # noqa: E731
            row[f"rank_load_{phase}"] = load
            row[f"imbalance_{phase}"] = max(load) * world / sum(load) if sum(load) else 0.0
            row[f"step_ms_{phase}"] = statistics.median(slowest(0)) if timed_steps else None
            row[f"experts_ms_{phase}"] = statistics.median(slowest(2)) if timed_steps and not cuda else None
        if report is not None:
            row.update(rebalance_ms=report.seconds * 1e3, moved_slots=report.moved_slots,
                       bytes_moved=report.bytes_moved, planned_imbalance=report.imbalance_after)
        results.append(row)
        layer.close()
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def run(a):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="epmoe-eplb-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, a.ep, init_file, a, queue)) for r in range(a.ep)]
    for p in procs:
        p.start()
    try:
        results = queue.get(timeout=a.timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def plot(results, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.2), sharey=True)
    for ax, r in zip(axes, results):
        ranks = range(len(r["rank_load_before"]))
        mean_b = sum(r["rank_load_before"]) / len(r["rank_load_before"])
        mean_a = sum(r["rank_load_after"]) / len(r["rank_load_after"])
        ax.bar([i - 0.2 for i in ranks], [v / mean_b for v in r["rank_load_before"]], 0.4, label="before",
               color="#c8c8c8")
        ax.bar([i + 0.2 for i in ranks], [v / mean_a for v in r["rank_load_after"]], 0.4, label="after",
               color="#3b6ea8")
        ax.axhline(1.0, color="black", linewidth=0.6, linestyle=":")
        ax.set_title(f"{r['config']}: {r['imbalance_before']:.2f} -> {r['imbalance_after']:.2f}", fontsize=9)
        ax.set_xlabel("rank")
        ax.set_xticks(list(ranks))
    axes[0].set_ylabel("load / mean load")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: every rank on GPU 0 (shared-GPU mode, gloo): local cost only, no link measured")
    p.add_argument("--ep", type=int, default=2, help="ranks")
    p.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--window", type=int, default=8, help="steps measured before the rebalance (load it plans from)")
    p.add_argument("--steps", type=int, default=8, help="steps measured after")
    p.add_argument("--redundant", default=None,
                   help="comma list of redundant expert counts (default: E/8 rounded up to a multiple of --ep)")
    p.add_argument("--power", type=float, default=4.0, help="skew: expert probabilities ~ u^power + 0.01")
    p.add_argument("--dispatcher", default="torch")
    p.add_argument("--experts", default="auto")
    p.add_argument("--quant", default=None, help="expert quant mode (e.g. fp8_block on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="write the per-rank load before / after as a PNG (matplotlib)")
    a = p.parse_args(argv)
    E = SHAPES[a.shape]["num_experts"]
    if a.redundant is None:
        r = -(-E // 8)
        a.redundant = [r + (-(E + r)) % a.ep]
    else:
        a.redundant = [int(v) for v in a.redundant.split(",")]
    bad = [r for r in a.redundant if (E + r) % a.ep]
    if E % a.ep or bad:
        p.error(f"E={E} and E + R for R in {bad} must be multiples of --ep {a.ep}")
    if a.window < 3 or a.steps < 1 or a.tokens < 1:
        p.error("--window >= 3 (two untimed warm-up steps), --steps >= 1, --tokens >= 1")
    t0 = time.time()
    results = run(a)
    where = (f"{a.ep} ranks sharing one GPU ({torch.cuda.get_device_name(0)}; local cost only, no link measured)"
             if a.device == "cuda" else f"{a.ep} gloo ranks on CPU ({os.cpu_count()} cores)")
    print(f"EPLB, {a.shape} {SHAPES[a.shape]}, {a.tokens} tokens/rank/step, skew u^{a.power:g}, {where}")
    print(f"{'config':>7} {'slots':>5} {'max/mean before':>15} {'after':>6} {'ms/step before':>14} {'after':>7} "
          f"{'experts ms before':>17} {'after':>7} {'rebalance':>10} {'moved':>14}")
    for r in results:
        moved = f"{r['moved_slots']} / {r['bytes_moved'] / 2 ** 20:.1f} MiB" if "moved_slots" in r else "-"
        reb = f"{r['rebalance_ms']:.1f} ms" if "rebalance_ms" in r else "-"
        em = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{r['config']:>7} {r['slots']:>5} {r['imbalance_before']:>15.2f} {r['imbalance_after']:>6.2f} "
              f"{r['step_ms_before']:>14.2f} {r['step_ms_after']:>7.2f} {em(r['experts_ms_before']):>17} "
              f"{em(r['experts_ms_after']):>7} {reb:>10} {moved:>14}")
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "cpu": platform.processor()
            or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__, "device": a.device,
            "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
            "local_cost_only": a.device == "cuda", "args": {k: v for k, v in vars(a).items()},
            "seconds": time.time() - t0}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)
        print(f"wrote {a.json}")
    if a.png:
        plot(results, a.png, f"per-rank load before / after one rebalance ({a.shape}, ep={a.ep}, "
                             f"{a.tokens} tok/rank, skew u^{a.power:g})")
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
