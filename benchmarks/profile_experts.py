"""Where an experts backend's time goes: the CUDA kernels of one forward at the DeepSeek-V3 expert shape
(128 local experts, H 7168, I 2048, top-8, uniform routing as bench_experts), from torch.profiler,
beside the forward's own time in the same process: timed as bench_experts times it (do_bench, L2
flushed), back to back (CUDA events around a loop) and as a CUDA graph's replay. Kernel time below the
eager figures is time the GPU waited: on the host, or on a sync; the trace says before which kernel
the GPU sat idle and for how long (per forward, summed over the gaps before each kernel; the trace
records host ops too, which adds a little host time to each gap). Then the host's own time per forward:
each DeepGEMM call, kernel launch and the row-count read (which waits for the GPU), so a gap can be
put down to the call that held the host.

    python benchmarks/profile_experts.py --backend deepgemm --mode fp8_block --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="deepgemm")
    ap.add_argument("--mode", default="fp8_block")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rows-read", choices=("auto", "sync", "overlap"), default="auto",
                    help="deepgemm, exact_rows: read the row count right after the alignment (sync: the gather "
                         "launched after it), overlap its copy with the gather, or as the backend picks by the "
                         "number of routed entries (auto)")
    args = ap.parse_args(argv)

    import torch

    from epmoe.config import MoEConfig
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts import EXPERTS
    from epmoe.experts.base import ExpertsSpec
    from epmoe.quant.plan import QuantPlan
    from tests import experts_testing as T

    dev = torch.device("cuda")
    E, K = args.experts, args.top_k
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=args.hidden, intermediate_size=args.inter)
    ex = EXPERTS.get(args.backend)(ExpertsSpec(cfg, 0, 1, dev, plan=QuantPlan(expert_mode=args.mode)))
    ex.load_weights(T.random_expert_weights(cfg, E, device=dev, seed=0))
    if args.rows_read != "auto":
        ex.overlap_rows_read_min_entries = 0 if args.rows_read == "overlap" else float("inf")
    x = torch.randn(args.tokens, args.hidden, device=dev).bfloat16()
    ids, w = T.random_local_routing(args.tokens, K, E, dev, 101)
    tokens = DispatchedTokens(x, ids, w)
    for _ in range(3):
        ex(tokens)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            ex(tokens)
        torch.cuda.synchronize()
    spans = kernel_spans(prof)  # GPU kernels and copies only: CPU ops would count their kernels again
    rows = {}
    for name, start, end in spans:
        rows[name] = rows.get(name, 0.0) + (end - start) / args.iters / 1000.0
    total = sum(rows.values())
    how = f" (row count read: {args.rows_read})" if args.rows_read != "auto" else ""
    print(f"{args.backend} {args.mode} T={args.tokens}{how}: {total:.3f} ms of kernels per forward")
    for k, ms in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.3f} ms  {k[:110]}")
    gaps = idle_before(spans, args.iters)
    print(f"GPU idle between kernels: {sum(ms for _, ms in gaps):.3f} ms per forward, before:")
    for k, ms in gaps[:8]:
        print(f"  {ms:8.3f} ms  {k[:110]}")
    for name, ms in forward_times(lambda: ex(tokens), args.iters):
        print(f"forward {name}: {ms}")
    host = host_times(ex, lambda: ex(tokens), args.iters * 4)
    print(f"host time per forward, back to back: {sum(us for _, us in host):.0f} us in the calls below of "
          f"{host_forward_us(lambda: ex(tokens), args.iters * 4):.0f} us per forward")
    for k, us in host:
        print(f"  {us:8.1f} us  {k}")
    return 0


def host_forward_us(fn, n: int) -> float:
    import time

    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def host_times(ex, fn, n: int):
    """[(call, host us per forward)] of a backend's DeepGEMM calls (`ex.dg`), its Triton launches
    (`ex._launch`, by kernel name), the flat layout's alignment (`contiguous_layout_rows`, its launches
    included) and the wait for its row count (`_finish_rows_read`), timed on the host over n forwards
    run back to back; the backend is restored after."""
    import time

    import torch

    import epmoe.experts.triton.align as align

    acc = {}

    def timed(key, f):
        def g(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        return g

    class Timed:
        def __init__(self, inner, prefix):
            self._inner, self._prefix = inner, prefix

        def __getattr__(self, name):
            v = getattr(self._inner, name)
            return timed(f"{self._prefix}{name}", v) if callable(v) else v

        def __call__(self, name, *a, **kw):  # a KernelLauncher: launch(kernel name, grid, args, meta)
            return timed(f"{self._prefix}{name}", self._inner)(name, *a, **kw)

    saved = {k: getattr(ex, k) for k in ("dg", "_launch") if hasattr(ex, k)}
    saved_layout = align.contiguous_layout_rows
    try:
        for k, v in saved.items():
            setattr(ex, k, Timed(v, "deep_gemm." if k == "dg" else "launch "))
        if hasattr(ex, "_finish_rows_read"):
            ex._finish_rows_read = timed("the row count's read (waits for its copy)", ex._finish_rows_read)
        align.contiguous_layout_rows = timed("contiguous_layout_rows (the alignment's launches)", saved_layout)
        torch.cuda.synchronize()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    finally:
        for k, v in saved.items():
            setattr(ex, k, v)
        ex.__dict__.pop("_finish_rows_read", None)
        align.contiguous_layout_rows = saved_layout
    return sorted(((k, s / n * 1e6) for k, s in acc.items()), key=lambda kv: -kv[1])


def kernel_spans(prof):
    """(name, start_us, end_us) of every GPU kernel and memory copy in a torch.profiler trace."""
    from torch.autograd import DeviceType

    return [(ev.name, float(ev.time_range.start), float(ev.time_range.end)) for ev in prof.events()
            if ev.device_type == DeviceType.CUDA and ev.time_range.end > ev.time_range.start]


def idle_before(spans, iters: int):
    """[(kernel name, ms per forward)] of the time the GPU sat idle right before each kernel (from the
    end of the latest kernel before it), largest first; overlapping kernels leave no gap."""
    spans = sorted(spans, key=lambda s: s[1])
    idle, busy_until = {}, None
    for name, start, end in spans:
        if busy_until is not None and start > busy_until:
            idle[name] = idle.get(name, 0.0) + (start - busy_until) / 1000.0 / iters
        busy_until = end if busy_until is None else max(busy_until, end)
    return sorted(idle.items(), key=lambda kv: -kv[1])


def forward_times(fn, iters: int):
    """(how, figure) of one forward: do_bench (L2 flushed between calls, median), a back-to-back loop
    (CUDA events around `iters` x 4 calls, mean) and the replay of a captured CUDA graph (mean), or why not."""
    import torch
    from triton.testing import do_bench

    out = [("do_bench, L2 flushed (bench_experts)", f"{do_bench(fn, warmup=25, rep=200, return_mode='median'):.3f} ms")]
    n = iters * 4
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    out.append(("back to back", f"{s.elapsed_time(e) / n:.3f} ms"))
    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        s.record()
        for _ in range(n):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        out.append(("CUDA graph replay", f"{s.elapsed_time(e) / n:.3f} ms"))
    except Exception as ex:  # noqa: BLE001 - a backend that cannot be captured: say why
        out.append(("CUDA graph replay", f"not captured ({type(ex).__name__}: {str(ex).splitlines()[0][:120]})"))
    return out


if __name__ == "__main__":
    sys.exit(main())
