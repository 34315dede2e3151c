"""Dispatch / combine latency and link bandwidth of epmoe dispatchers, generic over their names.

    # one GPU (ep=1: nothing crosses a link, times are the local copy + bookkeeping)
    python benchmarks/bench_dispatch.py --dispatchers flashinfer,torch
    # ep ranks, one GPU each
    torchrun --nproc-per-node 2 benchmarks/bench_dispatch.py --dispatchers flashinfer,torch
    # ep ranks sharing one GPU (gloo control group; docs/shared-gpu.md): real kernels, but the
    # figures are LOCAL cost (ranks time-slice one GPU, nothing crosses a link): labelled shared-GPU
    torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --ranks-per-gpu 4
    # CPU: the plan only (payload bytes per token, expected link bytes for the routing), no GPU
    python benchmarks/bench_dispatch.py --dry-run

Defaults: DeepSeek-V3 shape (H=7168, top-8 of E=256), T = 128 and 4096 tokens per rank, BF16 and
NVFP4 payloads. Per configuration: warm-up, then `--iters` timed iterations; dispatch and combine are
timed separately with CUDA events (eagerly, or as replays of captured CUDA graphs with `--graph`),
the median per rank is taken and the MAX over ranks reported. GB/s = bytes this rank actually sent
to other GPUs (the dispatcher's `stats`) / time, max over ranks. Any dispatcher registered in
`epmoe.dispatch.DISPATCHERS` can be named; unavailable ones are reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epmoe.quant.codec import payload_format  # noqa: E402

FORMATS = {name: payload_format(name, torch.bfloat16) for name in ("bf16", "nvfp4")}
# Per-dispatcher options for timing: no per-call collective or host sync inside the timed region.
TIMING_OPTIONS = {"flashinfer": (("handle_bytes", False), ("runtime_max_tokens", "uniform"))}


@dataclass(frozen=True)
class Result:
    dispatcher: str
    format: str
    tokens_per_rank: int
    ep_size: int
    dispatch_us: float
    combine_us: float
    dispatch_bytes: int  # per iteration, max over ranks
    combine_bytes: int
    dispatch_gbps: float
    combine_gbps: float
    mode: str  # "eager" / "graph"
    note: str = ""
    placement: str = "one GPU per rank"  # or "shared GPU (N ranks per GPU): local cost, no link"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dispatchers", default="flashinfer,torch", help="comma list of registered dispatcher names")
    p.add_argument("--tokens", default="128,4096", help="tokens per rank, comma list")
    p.add_argument("--formats", default="bf16,nvfp4", help="payload formats: bf16, nvfp4")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--graph", action="store_true", help="time replays of captured CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results to this JSON file (rank 0)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and expected bytes; no GPU")
    p.add_argument("--ranks-per-gpu", type=int, default=1, metavar="N",
                   help="N ranks share each GPU over a gloo group (shared-GPU mode): figures are local cost, "
                        "no link; GB/s is not reported")
    return p.parse_args(argv)


def make_routing(T, E, K, seed, device):
    """Uniform top-k routing (distinct experts per token), float32 weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    w = torch.rand(T, K, generator=g)
    return ids.to(device), w.to(device)


def expected_link_bytes(ids, E, ep, rank, bytes_per_token):
    """(token, remote rank) sends of this rank's routing x bytes per token."""
    per = E // ep
    ranks = torch.div(ids.long(), per, rounding_mode="floor")
    hit = torch.zeros(ids.shape[0], ep, dtype=torch.bool)
    hit.scatter_(1, ranks.cpu(), True)
    hit[:, rank] = False
    return int(hit.sum()) * bytes_per_token


def dry_run(args) -> List[dict]:
    from epmoe.dispatch.flashinfer_a2a import plan_payloads

    rows = []
    for fmt in args.formats.split(","):
        wire = FORMATS[fmt]
        slots = plan_payloads(wire, args.hidden, args.topk, send_global_scale=wire.is_quantized)
        bpt = sum(s.bytes_per_token for s in slots)
        for T in (int(t) for t in args.tokens.split(",")):
            for ep in (1, 2, 8):
                ids, _ = make_routing(T, args.experts, args.topk, args.seed, "cpu")
                link = expected_link_bytes(ids, args.experts, ep, 0, bpt)
                rows.append(dict(format=fmt, tokens_per_rank=T, ep_size=ep, dispatch_bytes_per_token=bpt,
                                 payloads=[s.name for s in slots], rank0_link_bytes=link))
                print(f"[dry-run] {fmt:5s} T={T:5d} ep={ep}: {bpt} B/token ({', '.join(s.name for s in slots)}); "
                      f"rank 0 sends {link / 1e6:.2f} MB per dispatch")
    return rows


def _expert_output(tokens, H, device):
    """What the experts would hand back: one bf16 row per received row (flat), or the masked
    [E_local, rows, H] layout of the low-latency dispatchers."""
    if tokens.layout == "masked":
        data = getattr(tokens.hidden, "data", tokens.hidden)
        return torch.randn(*data.shape[:-1], H, device=device).to(torch.bfloat16)
    return torch.randn(tokens.num_tokens, H, device=device).to(torch.bfloat16)


def _time_eager(d, x, ids, w, iters, warmup, H):
    y = None
    t_d, t_c = [], []
    for i in range(warmup + iters):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        tokens, h = d.dispatch(x, ids, w)
        e1.record()
        if y is None or (tokens.layout != "masked" and y.shape[0] != tokens.num_tokens):
            y = _expert_output(tokens, H, x.device)
        e1b = torch.cuda.Event(enable_timing=True)
        e1b.record()
        d.combine(y, h)
        e2.record()
        torch.cuda.synchronize()
        if i >= warmup:
            t_d.append(e0.elapsed_time(e1) * 1e3)
            t_c.append(e1b.elapsed_time(e2) * 1e3)
    return statistics.median(t_d), statistics.median(t_c)


def _time_graph(d, x, ids, w, iters, warmup, H):
    """Capture dispatch and combine as two graphs; each dispatch replay is followed by its combine."""
    tokens, h = d.dispatch(x, ids, w)  # eager warm-up, also sizes y
    y = _expert_output(tokens, H, x.device)
    d.combine(y, h)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g_d, g_c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g_d, stream=s):
            tokens, h = d.dispatch(x, ids, w)
        with torch.cuda.graph(g_c, stream=s):
            d.combine(y, h)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    d.stats.reset()  # replays add to the device-side byte counters captured in the graph
    t_d, t_c = [], []
    for i in range(warmup + iters):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        g_d.replay()
        e1.record()
        g_c.replay()
        e2.record()
        torch.cuda.synchronize()
        if i >= warmup:
            t_d.append(e0.elapsed_time(e1) * 1e3)
            t_c.append(e1.elapsed_time(e2) * 1e3)
    return statistics.median(t_d), statistics.median(t_c)


def _max_over_ranks(values, world):
    if world == 1:
        return values
    import torch.distributed as dist

    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run(args) -> List[Result]:
    import torch.distributed as dist

    from epmoe.dispatch import get_dispatcher_class
    from epmoe.dispatch.base import DispatchSpec

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    rpg = args.ranks_per_gpu
    if rpg < 1:
        raise SystemExit(f"--ranks-per-gpu {rpg}: must be >= 1")
    shared = rpg > 1
    gpu = local // rpg
    if gpu >= torch.cuda.device_count():
        raise SystemExit(f"local rank {local} with --ranks-per-gpu {rpg} needs GPU {gpu}; "
                         f"{torch.cuda.device_count()} visible")
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    if world > 1 and not dist.is_initialized():
        if shared:  # NCCL refuses two ranks on one GPU
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD if world > 1 else None
    placement = f"shared GPU ({rpg} ranks per GPU): local cost, no link" if shared else "one GPU per rank"
    if rank == 0 and shared:
        print(f"[bench] shared-GPU mode: {world} ranks, {rpg} per GPU, gloo control group. Times are the local cost "
              "of the real kernels with the ranks time-slicing one GPU; nothing crosses a link (no GB/s).")
    E, K, H = args.experts, args.topk, args.hidden
    results: List[Result] = []
    for name in args.dispatchers.split(","):
        try:
            cls = get_dispatcher_class(name)
        except (ValueError, ImportError) as e:
            if rank == 0:
                print(f"[bench] {name}: skipped ({e})")
            continue
        avail = cls.availability(dev, world, shared) if shared else cls.availability(dev, world)
        if not avail:
            if rank == 0:
                print(f"[bench] {name}: {avail.describe()}")
            continue
        for fmt in args.formats.split(","):
            for T in (int(t) for t in args.tokens.split(",")):
                opts = TIMING_OPTIONS.get(name, ())
                spec = DispatchSpec(group=group, ep_rank=rank, ep_size=world, num_experts=E, top_k=K, hidden_size=H,
                                    max_tokens_per_rank=T, payload=FORMATS[fmt], combine_dtype=torch.bfloat16,
                                    device=dev, shared_gpu=shared, options=opts)
                try:
                    d = cls(spec)
                except Exception as e:  # noqa: BLE001 - report and go on with the next configuration
                    if rank == 0:
                        print(f"[bench] {name} {fmt} T={T}: cannot construct ({type(e).__name__}: {e})")
                    continue
                ids, w = make_routing(T, E, K, args.seed + rank, dev)
                x = torch.randn(T, H, device=dev).to(torch.bfloat16)
                mode, note = "eager", ""
                try:
                    d.stats.reset()
                    if args.graph:
                        try:
                            td, tc = _time_graph(d, x, ids, w, args.iters, args.warmup, H)
                            mode = "graph"
                        except Exception as e:  # noqa: BLE001
                            note = f"graph capture failed ({type(e).__name__}); eager"
                            torch.cuda.synchronize()
                            d.close()
                            d = cls(spec)
                            td, tc = _time_eager(d, x, ids, w, args.iters, args.warmup, H)
                    else:
                        td, tc = _time_eager(d, x, ids, w, args.iters, args.warmup, H)
                    st = d.stats
                    calls = args.warmup + args.iters  # stats were reset right before these calls
                    db, cb = st.dispatch_bytes_sent / calls, st.combine_bytes_sent / calls
                    td, tc, db, cb = _max_over_ranks([td, tc, db, cb], world)
                    link_ok = not shared and world > 1  # bytes per second over a link only when one was crossed
                    results.append(Result(name, fmt, T, world, td, tc, int(db), int(cb),
                                          db / (td * 1e3) if td and link_ok else 0.0,
                                          cb / (tc * 1e3) if tc and link_ok else 0.0, mode, note, placement))
                    r = results[-1]
                    if rank == 0:
                        link = ("n/a (ep=1)" if world == 1 else "n/a (shared GPU: no link)" if shared
                                else f"{r.dispatch_gbps:6.1f} / {r.combine_gbps:6.1f} GB/s")
                        print(f"[bench] {name:10s} {fmt:5s} T={T:5d} ep={world}: dispatch {td:8.1f} us, "
                              f"combine {tc:8.1f} us, link {link} [{mode}]{' ' + note if note else ''}")
                finally:
                    d.close()
    if world > 1:
        dist.barrier()
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        rows = dry_run(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        print("[bench] no CUDA GPU; use --dry-run on CPU")
        return 1
    results = run(args)
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
