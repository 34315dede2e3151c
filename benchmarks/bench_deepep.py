"""Benchmark epmoe's DeepEP dispatchers: dispatch / combine time and bandwidth per rank.

    python benchmarks/bench_deepep.py --dry-run                 # CPU: the plan, buffer sizes, skips
    python benchmarks/bench_deepep.py --json bench.json         # GPU: one process per GPU (gloo group)
    python benchmarks/bench_deepep.py --ranks 4                 # 4 ranks sharing fewer GPUs (no link measured)

Default shape (DeepSeek-V3): H=7168, top-8, E=256, T = 128 and 4096 tokens per rank, BF16 and FP8.
Normal mode needs 2, 4 or 8 ranks (DeepEP compiles its intranode kernels for those only); low-latency
mode runs with any rank count, one included, but its buffer grows with tokens x experts (about 61 GB
per rank at T=4096, E=256), so it runs up to --ll-max-tokens (128) and reports the rest as skipped.

Time: median over --iters of CUDA events around the epmoe call (dispatch includes DeepEP's layout
kernel and, in normal mode, its host wait for the receive counts); the slowest rank is reported.
Bandwidth: "logical" bytes (DeepEP's convention: every received payload byte, the rank's own
included) per second; "remote" counts only bytes that crossed to another rank (0 with one rank).
Routing: uniform random distinct top-k per token (top-k of random scores), no padding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from epmoe.dispatch import deepep as dd  # noqa: E402  (pure module: imports no DeepEP)


@dataclass
class Run:
    mode: str  # "normal" | "ll"
    dtype: str  # "bf16" | "fp8"
    tokens: int
    hidden: int
    top_k: int
    experts: int
    ranks: int
    buffer_bytes: int = 0
    skip: str = ""
    result: dict = field(default_factory=dict)

    def label(self) -> str:
        return (f"deepep {self.mode:6s} {self.dtype:4s} T={self.tokens:<5d} H={self.hidden} K={self.top_k} "
                f"E={self.experts} ep={self.ranks}")


def plan_runs(args, ranks: int) -> List[Run]:
    """Every (mode, dtype, tokens) combination, with the buffer it needs or why it is skipped."""
    runs = []
    for mode in args.modes:
        for dtype in args.dtypes:
            for T in args.tokens:
                r = Run(mode, dtype, T, args.hidden, args.topk, args.experts, ranks)
                fp8 = dtype == "fp8"
                if args.experts % ranks:
                    r.skip = f"{args.experts} experts do not divide over {ranks} ranks"
                elif mode == "normal":
                    ok = dd.normal_mode_ep_support(ranks)
                    if not ok:
                        r.skip = ok.reason.split(":")[0] + f" (ep={ranks})"
                    else:
                        r.buffer_bytes = dd.deepep_buffer_bytes(
                            low_latency=False, hidden_size=args.hidden, ep_size=ranks, num_experts=args.experts,
                            top_k=args.topk, max_tokens_per_rank=T, wire=dd.fp8_block_format() if fp8 else None,
                        ).num_nvl_bytes
                else:
                    M = max(t for t in args.tokens if t <= args.ll_max_tokens) if any(
                        t <= args.ll_max_tokens for t in args.tokens) else T
                    need = dd.low_latency_rdma_size_hint(T, args.hidden, ranks, args.experts)
                    problems = dd.low_latency_shape_problems(
                        hidden_size=args.hidden, top_k=args.topk, num_experts=args.experts, ep_size=ranks,
                        max_tokens_per_rank=M, fp8=fp8,
                    )
                    if T > args.ll_max_tokens:
                        r.skip = (f"low-latency buffer for T={T} would be {need / 1e9:.1f} GB per rank "
                                  f"(raise --ll-max-tokens to run it)")
                    elif problems:
                        r.skip = "; ".join(problems)
                    else:
                        r.buffer_bytes = dd.low_latency_rdma_size_hint(M, args.hidden, ranks, args.experts)
                runs.append(r)
    return runs


def _payload_bytes(hidden: int, fp8: bool) -> int:
    return hidden + hidden // 128 * 4 if fp8 else 2 * hidden


# ------------------------------------------------------------------ GPU side (one process per rank)
class _Clock:
    """CUDA events on a GPU; perf_counter on CPU (the --cpu-fake plumbing test)."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        import time

        return time.perf_counter()

    def us(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) * 1e3
        return (b - a) * 1e6


def _worker(rank: int, world: int, args, init_file: str, runs: List[Run], out_file: str) -> None:
    import torch
    import torch.distributed as dist

    from epmoe.dispatch.base import DispatchSpec
    from epmoe.quant.payload import PayloadFormat

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if args.cpu_fake:  # plumbing test on CPU: tests/cpu/fake_deep_ep stands in for DeepEP
        from tests.cpu import fake_deep_ep

        sys.modules["deep_ep"] = fake_deep_ep
        dd._device_problem = lambda device: None
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    clock = _Clock(dev)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    bf16 = PayloadFormat.unquantized(torch.bfloat16)
    fp8 = dd.fp8_block_format()
    todo = [r for r in runs if not r.skip]
    buffers, made = {}, []
    ll_M = max([r.tokens for r in todo if r.mode == "ll"], default=0)

    for r in todo:
        E, K, H = r.experts, r.top_k, r.hidden
        M = ll_M if r.mode == "ll" else max(r.tokens, 1)
        wire = fp8 if r.dtype == "fp8" else None
        opts = {"check_inputs": False, "count_bytes": False}
        if r.mode in buffers:
            opts["deepep_buffer"] = buffers[r.mode]
        spec = DispatchSpec(
            group=None, ep_rank=rank, ep_size=world, num_experts=E, top_k=K, hidden_size=H, max_tokens_per_rank=M,
            payload=wire or bf16, wire=wire, combine_dtype=torch.bfloat16, device=dev,
            options=tuple(sorted(opts.items())),
        )
        if r.mode == "normal" and "normal" not in buffers:
            # one NVLink buffer for every normal-mode run: the largest requirement of them
            spec = dataclasses.replace(spec, workspace_bytes=max(x.buffer_bytes for x in todo if x.mode == "normal"))
        cls = dd.DeepEPDispatcher if r.mode == "normal" else dd.DeepEPLowLatencyDispatcher
        d = cls(spec)
        buffers.setdefault(r.mode, d.buffer)
        g = torch.Generator(device="cpu").manual_seed(1000 + rank)
        x = torch.randn(r.tokens, H, generator=g).to(torch.bfloat16).to(dev)
        ids = torch.rand(r.tokens, E, generator=g).topk(K, dim=1).indices.to(torch.int32).to(dev)
        w = torch.rand(r.tokens, K, generator=g).to(dev)
        tok, h = d.dispatch(x, ids, w)
        if r.mode == "normal":
            rows = h.num_recv_tokens
            y = torch.randn(rows, H, device=dev).to(torch.bfloat16)
            recv_msgs = rows
        else:
            y = torch.randn(E // world, world * M, H, device=dev).to(torch.bfloat16)
            recv_msgs = int(tok.expert_counts.sum())
        dest = ids.long() // (E // world)  # [T, K] owner rank of each chosen expert
        if r.mode == "ll":  # one message per (token, remote expert)
            remote_msgs = int((dest != rank).sum())
        else:  # one message per (token, remote rank it has an expert on)
            hit = (dest.unsqueeze(-1) == torch.arange(world, device=dev)).any(dim=1)  # [T, world]
            remote_msgs = int(hit.sum() - hit[:, rank].sum())
        times = []
        for i in range(args.warmup + args.iters):
            dist.barrier()
            clock.sync()
            a = clock.mark()
            tok, h = d.dispatch(x, ids, w)
            b = clock.mark()
            d.combine(y, h)
            c = clock.mark()
            clock.sync()
            if i >= args.warmup:
                times.append((clock.us(a, b), clock.us(b, c)))
        disp = sorted(t[0] for t in times)[len(times) // 2]
        comb = sorted(t[1] for t in times)[len(times) // 2]
        pb = _payload_bytes(H, r.dtype == "fp8")
        r.result = dict(
            rank=rank, dispatch_us=disp, combine_us=comb, recv_messages=recv_msgs, remote_messages_sent=remote_msgs,
            dispatch_gbps=recv_msgs * pb / disp / 1e3, combine_gbps=recv_msgs * 2 * H / comb / 1e3,
            dispatch_remote_gbps=remote_msgs * pb / disp / 1e3,
        )
        made.append(d)
    for d in reversed(made):  # a buffer's owner (the first of its mode) closes last
        d.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, [asdict(r) for r in runs], group=None)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    # Leave without the interpreter's teardown: twice (once in CI, once in ~800 runs on a loaded 2-core
    # machine) a CPU rank aborted after its work ("terminate called without an active exception",
    # SIGABRT), the signature of a C++ thread unwound while the interpreter finalizes. The dispatchers
    # and buffers go first, the group is destroyed, then the process ends with os._exit (the results
    # are on disk, stdout flushed).
    made.clear()
    buffers.clear()
    import gc

    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(runs: List[Run], per_rank: List[List[dict]]) -> List[dict]:
    rows = []
    for i, r in enumerate(runs):
        row = asdict(r)
        if not r.skip:
            res = [pr[i]["result"] for pr in per_rank]
            slow = max(res, key=lambda q: q["dispatch_us"] + q["combine_us"])
            row["result"] = dict(slow, per_rank=res)
            print(f"{r.label()} | dispatch {slow['dispatch_us']:8.1f} us {slow['dispatch_gbps']:7.1f} GB/s "
                  f"(remote {slow['dispatch_remote_gbps']:6.1f}) | combine {slow['combine_us']:8.1f} us "
                  f"{slow['combine_gbps']:7.1f} GB/s | recv msgs {slow['recv_messages']}", flush=True)
        else:
            print(f"{r.label()} | skipped: {r.skip}", flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="128,4096", help="tokens per rank, comma separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--modes", default="normal,ll")
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--ll-max-tokens", type=int, default=128)
    p.add_argument("--ranks", type=int, default=0, help="processes (one per GPU); default: every GPU")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="print the plan and buffer sizes; no GPU, no DeepEP")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--cpu-fake", action="store_true", help=argparse.SUPPRESS)  # tests: fake DeepEP on CPU
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [m for m in args.modes if m not in ("normal", "ll")] + [d for d in args.dtypes if d not in ("bf16", "fp8")]
    if bad:
        p.error(f"unknown modes/dtypes {bad}; modes: normal, ll; dtypes: bf16, fp8")

    if args.dry_run:
        ranks = args.ranks or 1
        runs = plan_runs(args, ranks)
        print(f"[dry-run] {ranks} rank(s); buffers per rank:")
        for r in runs:
            what = f"skipped: {r.skip}" if r.skip else f"buffer {r.buffer_bytes / 2**20:9.1f} MiB"
            print(f"  {r.label()} | {what}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([asdict(r) for r in runs], f, indent=1)
        return 0

    import torch
    import torch.multiprocessing as mp

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.cpu_fake:
        ranks = args.ranks or 2
    else:
        if n_gpu == 0:
            print("no CUDA GPU: use --dry-run", file=sys.stderr)
            return 2
        ranks = args.ranks or min(n_gpu, 8)
        try:
            import deep_ep  # noqa: F401,I001  (fail here, once, with the reason)
        except Exception as e:  # noqa: BLE001
            print(f"deep_ep unavailable ({type(e).__name__}: {e}); {dd.INSTALL_HINT}", file=sys.stderr)
            return 2
    runs = plan_runs(args, ranks)
    fd, init_file = tempfile.mkstemp(prefix="bench-deepep-pg-")
    os.close(fd)
    os.unlink(init_file)
    out_file = init_file + ".json"
    shared = not args.cpu_fake and ranks > n_gpu
    print(f"[bench_deepep] {ranks} rank(s) on {n_gpu} GPU(s), {args.iters} iters after {args.warmup} warm-up"
          + (": ranks share GPUs, so the times are each rank's local cost and no link is measured" if shared else ""),
          flush=True)
    if any(not r.skip for r in runs):
        mp.spawn(_worker, args=(ranks, args, init_file, runs, out_file), nprocs=ranks, join=True)
        with open(out_file) as f:
            per_rank = json.load(f)
        os.unlink(out_file)
    else:
        per_rank = [[asdict(r) for r in runs]]
    rows = _report(runs, per_rank)
    for row in rows:
        row["gpus"], row["shared_gpu"] = n_gpu, shared
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
