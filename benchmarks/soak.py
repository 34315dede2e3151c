"""Soak: many EPMoE steps with a random number of tokens per rank (0 included, and batches above the
round size), invalid inputs injected now and then, and periodic checks against the float64 reference.
Reports memory per rank after warm-up vs at the end, and whether it grew beyond noise.

    torchrun --nproc-per-node 2 benchmarks/soak.py --steps 10000                 # CPU, gloo, 2 ranks
    torchrun --nproc-per-node 1 benchmarks/soak.py --steps 10000 --device cuda   # 1 GPU (N GPUs: N ranks, NCCL)
    python benchmarks/soak.py --steps 2000                                       # one process, no group

Memory per rank: resident set (VmRSS) and its peak (VmHWM) from /proc/self/status, gc-tracked Python
objects, and on CUDA torch.cuda.memory_allocated / max_memory_allocated. The baseline is taken after
warm-up (the first --warmup steps, default 5% of the run and at least 50: allocator pools, gloo buffers
and lazy initialisation settle there). "Grew" means: end minus baseline above max(--tol-mib MiB,
--tol-frac x baseline) for RSS and VmHWM (defaults 8 MiB, 5%), above max(1 MiB, 1%) for CUDA allocated,
or more than --tol-objects gc-tracked objects (default 500). The reported ms/step (the nightly's
`soak.ms_per_step`) counts the steps after the warm-up, not the memory probes between them; beside it
each rank's median step and its slowest steps after the warm-up (step, ms, T, kind), which show where
first-use costs land. Exit 1 on growth, on a failed check, or when an injected invalid input did not
raise on every rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its epmoe

import torch  # noqa: E402

MIB = 1 << 20
_LEAK: list = []  # --inject-leak-kib


# ---------------------------------------------------------------------------- memory probes
def proc_status() -> dict:
    """VmRSS / VmHWM of this process in bytes (empty off Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


@dataclass(frozen=True)
class MemorySample:
    step: int
    rss: Optional[int]
    hwm: Optional[int]
    gc_objects: int
    cuda_allocated: Optional[int]
    cuda_max_allocated: Optional[int]


def sample(step: int, device: torch.device) -> MemorySample:
    gc.collect()
    st = proc_status()
    alloc = peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        alloc, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return MemorySample(step, st.get("VmRSS"), st.get("VmHWM"), len(gc.get_objects()), alloc, peak)


@dataclass(frozen=True)
class Growth:
    name: str
    start: Optional[int]
    end: Optional[int]
    limit: Optional[int]

    @property
    def delta(self) -> Optional[int]:
        return None if self.start is None or self.end is None else self.end - self.start

    @property
    def grew(self) -> bool:
        return self.delta is not None and self.limit is not None and self.delta > self.limit


def judge(base: MemorySample, end: MemorySample, args) -> List[Growth]:
    def lim(v: Optional[int], floor: int, frac: float) -> Optional[int]:
        return None if v is None else max(floor, int(frac * v))

    tol = int(args.tol_mib * MIB)
    return [
        Growth("rss", base.rss, end.rss, lim(base.rss, tol, args.tol_frac)),
        Growth("hwm", base.hwm, end.hwm, lim(base.hwm, tol, args.tol_frac)),
        Growth("gc_objects", base.gc_objects, end.gc_objects, args.tol_objects),
        Growth("cuda_allocated", base.cuda_allocated, end.cuda_allocated, lim(base.cuda_allocated, MIB, 0.01)),
        # the peak follows the largest batch seen, not a leak: reported, judged only through allocated
        Growth("cuda_max_allocated", base.cuda_max_allocated, end.cuda_max_allocated, None),
    ]


def _type_counts():
    import collections

    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def slope_per_kstep(samples: List[MemorySample]) -> Optional[float]:
    """Least-squares RSS slope over the samples, bytes per 1000 steps."""
    pts = [(s.step, s.rss) for s in samples if s.rss is not None]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    den = sum((p[0] - mx) ** 2 for p in pts)
    return 1000.0 * sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


# ---------------------------------------------------------------------------- the run
@dataclass
class RankResult:
    rank: int
    steps: int
    zero_steps: int = 0
    multi_round_steps: int = 0
    min_tokens: int = 1 << 30
    max_tokens: int = 0
    bad_steps: int = 0
    bad_raised: int = 0
    checks: int = 0
    max_rel_err: float = 0.0
    seconds: float = 0.0
    warmup_seconds: float = 0.0  # of `seconds`, the warm-up steps' (one-off costs: kernel compiles, pools)
    steps_ms: float = 0.0  # the steps after the warm-up, memory probes left out: the gated ms/step's sum
    median_step_ms: Optional[float] = None  # host time per step after the warm-up, the median
    slowest_steps: List[dict] = field(default_factory=list)  # after the warm-up: step, ms, T, kind; slowest first
    samples: List[MemorySample] = field(default_factory=list)
    growth: List[Growth] = field(default_factory=list)
    object_growth: List[tuple] = field(default_factory=list)  # (type name, delta), largest first
    rss_slope_per_kstep: Optional[float] = None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--warmup", type=int, default=None, help="steps before the baseline (default: 5%%, >= 50)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dispatcher", default="torch")
    p.add_argument("--experts", default="auto")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=64)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-tokens", type=int, default=24, help="T per rank per step is drawn from [1, this], or 0")
    p.add_argument("--zero-frac", type=float, default=0.1, help="probability that a rank passes T = 0")
    p.add_argument("--max-tokens-per-rank", type=int, default=16,
                   help="the layer's round size; T above it runs in several rounds")
    p.add_argument("--bad-every", type=int, default=500, help="every N steps one rank passes an invalid input (0: never)")
    p.add_argument("--check-every", type=int, default=1000, help="compare with the float64 reference every N steps (0: never)")
    p.add_argument("--sample-every", type=int, default=100, help="memory sample interval in steps")
    p.add_argument("--tol-mib", type=float, default=8.0)
    p.add_argument("--tol-frac", type=float, default=0.05)
    p.add_argument("--tol-objects", type=int, default=500,
                   help="gc-tracked object growth above this counts (the run itself adds one per memory sample)")
    p.add_argument("--inject-leak-kib", type=int, default=0, metavar="K",
                   help="keep K KiB per step alive on purpose (shows that the soak detects a leak)")
    p.add_argument("--top-objects", type=int, default=0, metavar="N",
                   help="print the N object types whose gc-tracked count grew most (leak hunting)")
    p.add_argument("--slowest", type=int, default=5, metavar="N",
                   help="report the N slowest steps after the warm-up per rank (where first-use costs land)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    if args.warmup is None:
        args.warmup = max(50, args.steps // 20)
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be below --steps {args.steps} (the baseline is taken after warm-up)")
    if not 0 <= args.zero_frac <= 1:
        p.error(f"--zero-frac {args.zero_frac}: use a probability in [0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from epmoe import EPMoE, MoEConfig, reference_moe
    from epmoe.config import dtype_name, parse_dtype
    from epmoe.core import dist as edist
    from epmoe.core.errors import PeerInputError
    from epmoe.launch.env import init_distributed, resolve_device, shutdown
    from epmoe.launch.synthetic import make_layer

    device = resolve_device(args.device)
    torch.set_num_threads(1)  # ranks share the host's cores
    le = init_distributed(device.type, args.timeout)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rank, ep = le.rank, le.world_size
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = MoEConfig(num_experts=args.num_experts, top_k=args.top_k, hidden_size=args.hidden_size,
                    intermediate_size=args.intermediate_size, dtype=dtype)
    synthetic = make_layer(cfg, args.seed, 0)  # the same global weights on every rank
    layer = EPMoE(cfg, dispatcher=args.dispatcher, device=device, max_num_tokens_per_rank=args.max_tokens_per_rank,
                  experts=args.experts, name="EPMoE[soak]")
    layer.load_weights(synthetic.experts)
    gate = synthetic.gate.to(device)
    tol = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 1e-2}[dtype]

    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    res = RankResult(rank=rank, steps=args.steps)
    if rank == 0:
        print(f"soak: {args.steps} steps, ep={ep} ({le.launcher}, {'nccl' if device.type == 'cuda' else 'gloo'} on "
              f"{device}), E={cfg.num_experts} K={cfg.top_k} H={cfg.hidden_size} I={cfg.intermediate_size} "
              f"{dtype_name(dtype)}, T per rank in [0, {args.max_tokens}] (P(T=0)={args.zero_frac}), round size "
              f"{args.max_tokens_per_rank}, warm-up {args.warmup}", flush=True)
    steps_after: List[tuple] = []  # (ms, step, T, kind) of each step after the warm-up
    t_start = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            res.warmup_seconds = time.perf_counter() - t_start
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            res.samples.append(sample(step, device))
            types_at_base = _type_counts() if args.top_objects else None
        elif step > args.warmup and step % args.sample_every == 0:
            res.samples.append(sample(step, device))
        t_step = time.perf_counter()  # the memory probe above (gc.collect, ~0.1 s) is not the step's
        zero = float(torch.rand((), generator=g)) < args.zero_frac
        T = 0 if zero else int(torch.randint(1, args.max_tokens + 1, (), generator=g))
        x = torch.randn(T, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
        logits = x.float() @ gate.float().t()
        # one check and one invalid input inside the warm-up too, so their one-off costs (first reference
        # call, first exception path) land before the baseline
        check_step = args.check_every and (step % args.check_every == args.check_every - 1
                                           or step in (args.warmup - 1, args.steps - 1))
        if rank == 0 and (step + 1) % max(1, args.steps // 10) == 0:
            el = time.perf_counter() - t_start
            print(f"  step {step + 1}/{args.steps}  {1e3 * el / (step + 1):.2f} ms/step", flush=True)
        bad_step = args.bad_every and (step % args.bad_every == args.bad_every // 2 or step == args.warmup - 2)
        if bad_step and not check_step:
            res.bad_steps += 1
            bad_rank = (step // args.bad_every) % ep
            try:  # one rank passes a wrong width; every rank must raise, and the group must stay usable
                layer(x[:, :-1] if rank == bad_rank else x, logits)
            except (ValueError, TypeError, PeerInputError):
                res.bad_raised += 1
            if step >= args.warmup:
                steps_after.append((1e3 * (time.perf_counter() - t_step), step, T, "invalid"))
            continue
        out = layer(x, logits, return_stats=True)
        if args.inject_leak_kib:
            _LEAK.append(torch.ones(args.inject_leak_kib * 1024, dtype=torch.uint8))
        res.zero_steps += T == 0
        res.multi_round_steps += out.stats.rounds > 1
        res.min_tokens, res.max_tokens = min(res.min_tokens, T), max(res.max_tokens, T)
        if check_step:
            everything = edist.all_gather_objects((x.cpu(), logits.cpu(), out.hidden_states.cpu()))
            if rank == 0:
                xs = torch.cat([e[0] for e in everything])
                if xs.shape[0]:
                    ref = reference_moe(cfg, xs, synthetic.experts, torch.cat([e[1] for e in everything]))
                    ys = torch.cat([e[2] for e in everything]).double()
                    err = float((ys - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    res.max_rel_err = max(res.max_rel_err, err if torch.isfinite(ys).all() else float("inf"))
                res.checks += 1
        if step >= args.warmup:
            steps_after.append((1e3 * (time.perf_counter() - t_step), step, T, "check" if check_step else "step"))
    res.seconds = time.perf_counter() - t_start
    res.steps_ms = sum(t[0] for t in steps_after)
    if steps_after:
        ordered = sorted(steps_after, reverse=True)
        res.median_step_ms = ordered[len(ordered) // 2][0]
        res.slowest_steps = [dict(step=st, ms=ms, T=t, kind=k) for ms, st, t, k in ordered[:args.slowest]]
    res.samples.append(sample(args.steps, device))
    if args.top_objects:
        diff = _type_counts()
        diff.subtract(types_at_base)
        res.object_growth = [(k, v) for k, v in diff.most_common(args.top_objects) if v > 0]
    res.growth = judge(res.samples[0], res.samples[-1], args)
    res.rss_slope_per_kstep = slope_per_kstep(res.samples)

    results = edist.all_gather_objects(res)
    layer.dispatcher.close()
    shutdown()
    if rank != 0:
        return 0
    return report(results, args, ep, device, tol)


def _mib(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / MIB:.1f}"


def _delta(gr: Growth, unit: str = "MiB") -> str:
    if gr.delta is None:
        return "-"
    if unit == "MiB":
        return f"{_mib(gr.start)} -> {_mib(gr.end)} ({gr.delta / MIB:+.2f})"
    return f"{gr.start} -> {gr.end} ({gr.delta:+d})"


def report(results: List[RankResult], args, ep: int, device: torch.device, tol: float) -> int:
    grew = [(r.rank, g.name) for r in results for g in r.growth if g.grew]
    bad_missed = [r.rank for r in results if r.bad_raised != r.bad_steps]
    r0 = results[0]
    check_ok = r0.max_rel_err <= tol
    print("\nrank | T range  zeros  multi-round | RSS MiB after warm-up -> end (delta) | VmHWM MiB (delta) | "
          "gc objects (delta) | RSS slope KiB/1k steps" + (" | CUDA alloc MiB (delta) | CUDA peak MiB" if device.type == "cuda" else ""))
    for r in results:
        g = {x.name: x for x in r.growth}
        slope = "-" if r.rss_slope_per_kstep is None else f"{r.rss_slope_per_kstep / 1024:+.1f}"
        line = (f"{r.rank:4d} | [{r.min_tokens}, {r.max_tokens}]  {r.zero_steps:5d}  {r.multi_round_steps:11d} | "
                f"{_delta(g['rss'])} | {_delta(g['hwm'])} | {_delta(g['gc_objects'], 'n')} | {slope}")
        if device.type == "cuda":
            line += f" | {_delta(g['cuda_allocated'])} | {_mib(g['cuda_max_allocated'].end)}"
        print(line)
    for r in results:
        if r.slowest_steps:
            print(f"rank {r.rank} after the warm-up: median {r.median_step_ms:.2f} ms/step, slowest "
                  + ", ".join(f"step {d['step']} {d['ms']:.1f} ms (T={d['T']}, {d['kind']})" for d in r.slowest_steps))
    for r in results:
        if r.object_growth:
            print(f"rank {r.rank} object types that grew: " + ", ".join(f"{k} {v:+d}" for k, v in r.object_growth))
    # the gated figure: steps after the warm-up (a fresh machine's kernel compiles land in the warm-up), without
    # the memory probes between them
    ms = max(r.steps_ms for r in results) / (args.steps - args.warmup)
    warm_s = max(r.warmup_seconds for r in results)
    tol_rss = f"max({args.tol_mib:g} MiB, {100 * args.tol_frac:g}% of the warm-up value)"
    print(f"\nsteps: {args.steps} in {max(r.seconds for r in results):.1f} s ({ms:.2f} ms/step after the warm-up), "
          f"warm-up {args.warmup} steps in {warm_s:.1f} s")
    print(f"invalid-input steps: {r0.bad_steps} per rank, raised on every rank: {'yes' if not bad_missed else f'NO (ranks {bad_missed})'}")
    print(f"reference checks: {r0.checks}, max rel err {r0.max_rel_err:.3g} (tolerance {tol:g}): {'passed' if check_ok else 'FAILED'}")
    print(f"memory growth (noise: RSS/VmHWM {tol_rss}, gc objects {args.tol_objects}, CUDA allocated max(1 MiB, 1%)): "
          + ("none" if not grew else "GREW: " + ", ".join(f"rank {r} {n}" for r, n in grew)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "args": vars(args), "ep_size": ep, "device": str(device), "host": platform.node(),
                "torch": torch.__version__, "ms_per_step": ms, "warmup_s": warm_s, "grew": grew, "check_passed": check_ok,
                "bad_input_missed": bad_missed,
                "ranks": [dict(asdict(r), growth=[dict(asdict(g), delta=g.delta, grew=g.grew) for g in r.growth])
                          for r in results],
            }, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if (grew or bad_missed or not check_ok) else 0


if __name__ == "__main__":
    sys.exit(main())
