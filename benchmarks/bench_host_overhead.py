"""Eager host overhead of one EPMoE layer call: wall time of a synchronized call (CPU timer) against
the GPU's busy time for the same call (sum of kernel durations from the profiler) and the CUDA-event
span. overhead = wall - busy: Python, launches and host syncs that the GPU waits for. Also: the host
time to issue one call while the GPU is busy with earlier work (`host_issue_ms_median`: the CPU cost
of a layer when layers follow each other without a sync) and the wall time per call of 10 calls back
to back against the busy time (`back_to_back_overhead_ms`).

`per_call_idle_ms_median` (`per_call_idle`): wall - busy of the same call, both from one profiler
trace (the GPU idle time inside each synchronized call; the profiler slows the host, so an upper bound).

`host_overhead_vs_graph_ms` (`against_graph`) isolates the host's share: the eager call against the
same call replayed from a CUDA graph (the same kernels, no Python, no launches from the host), both
synchronized, one right after the other, median of the differences. wall - busy also holds what the
GPU adds to a synchronized call without any host work (`graph_wall_minus_busy_ms`: starting and
finishing, the sync; at prefill sizes also the GPU's own time, which varies from loop to loop: the
same kernels took 6.1-6.7 ms in one process on an H200, so there wall - busy moves by 0.2 ms and more
between runs of the same code).

    python benchmarks/bench_host_overhead.py                      # torch + flashinfer dispatchers, T 128 / 4096
    python benchmarks/bench_host_overhead.py --dispatchers torch --tokens 128 --json out.json
    python benchmarks/bench_host_overhead.py --cpu-smoke          # tiny shape on CPU (CI): wall time only
    python benchmarks/bench_host_overhead.py --cpu-host [--host-device meta] [--profile]
                                                                  # host cost only, no GPU (below)

ep = 1 (one GPU, no process group), DeepSeek-V3 MoE shape with the experts scaled to fit (default 128
local experts, H 7168, I 2048, top-8, bf16, triton experts). Uses only the API that existed before the
resolver redesign (EPMoE(config, dispatcher=, experts=, max_num_tokens_per_rank=), load_weights with
an ExpertWeights, forward), so the same file measures an older checkout too: run it from each checkout
(PYTHONPATH=<checkout>) and compare the JSON.

--cpu-host measures the Python side of the eager forward without a GPU: the layer (torch dispatcher,
triton experts) runs with every Triton launch and every torch._grouped_mm replaced by a no-op
recorder, and the report gives host microseconds per forward (and up to the launch of the first
expert GEMM: the time the GPU would idle at the start of a call), the launches and torch ops per forward
and before the first expert GEMM.
--host-device cpu (default) runs the remaining torch ops on small CPU tensors (H 256, I 128; the same
op count as on the GPU, any checkout); --host-device meta runs them on meta tensors at the real shape
(no data at all: a host sync, e.g. .item() / .cpu() / nonzero, raises, so only a sync-free forward
runs there). Neither includes the CUDA launch itself (~5 us per torch op / Triton kernel on an H200).
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


def _device_times(prof) -> dict:
    """Profiler event name -> its self device time (us, all calls), for the events that have any."""
    times = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t:
            times[e.key] = t
    return times


def _busy_ms(prof, calls: int) -> float:
    """Sum of GPU kernel time per call (profiler, self device time of every event)."""
    return sum(_device_times(prof).values()) / 1e3 / calls


def against_graph(layer, x, logits, iters: int, sync) -> dict:
    """The eager call against the same call replayed from a CUDA graph (the same kernels, launched
    without Python), both synchronized, alternating: `host_overhead_vs_graph_ms` = median(eager_i -
    graph_i) is the time the host adds to a call; `graph_wall_minus_busy_ms` what a synchronized call
    costs beyond its kernels' durations without any host work (the GPU starting and finishing, the
    sync). Under capture the routing would take its two-launch form at decode sizes (the one-launch
    form is gated to small batches there, epmoe.routing.ROUTE_ALIGN_GPU_MAX_LOGITS); the gate is
    lifted for this capture so that the graph runs the eager call's kernels."""
    try:
        import epmoe.routing as R
    except ImportError:  # an older checkout
        R = None
    gate = getattr(R, "ROUTE_ALIGN_GPU_MAX_LOGITS", None)
    try:
        if gate is not None:
            R.ROUTE_ALIGN_GPU_MAX_LOGITS = 1 << 62
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                layer(x, logits)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer(x, logits)
    except Exception as e:  # noqa: BLE001 - a path that cannot be captured: reported, not fatal
        return {"graph_error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        if gate is not None:
            R.ROUTE_ALIGN_GPU_MAX_LOGITS = gate
    for _ in range(3):
        g.replay()
    diffs, graph = [], []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        layer(x, logits)
        sync()
        t1 = time.perf_counter()
        g.replay()
        sync()
        t2 = time.perf_counter()
        graph.append((t2 - t1) * 1e3)
        diffs.append((t1 - t0 - (t2 - t1)) * 1e3)
    del g
    return {"graph_wall_ms_median": statistics.median(graph), "host_overhead_vs_graph_ms": statistics.median(diffs)}


def call_window_times(t0: float, t1: float, kernels) -> "tuple | None":
    """(busy, idle, first kernel after, after last kernel) of the window [t0, t1] (us) given kernel spans
    (start, end) on the same clock, sorted by start: busy = the union of the spans' parts inside the window
    (kernels of two streams can overlap), idle = the window's length - busy. None if no kernel falls in it."""
    spans = [(max(a, t0), min(b, t1)) for a, b in kernels if a < t1 and b > t0]
    if not spans:
        return None
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, t1 - t0 - busy, spans[0][0] - t0, t1 - max(b for _, b in spans)


def per_call_idle(layer, x, logits, iters: int, sync) -> dict:
    """GPU idle time inside each synchronized call, from one profiler trace (CPU and GPU on one clock):
    per call, (CPU time from the call's start to the sync's return) - (union of that call's kernel
    spans). Wall and busy come from the same call, so the GPU's own time varying from loop to loop (which
    moves wall - busy of separate loops by 0.2 ms and more at T = 4096) does not enter. The profiler
    records every op on the host too, which slows the host down: this is an upper bound of the idle time
    without it. Also: the first kernel's start and the time from the last kernel's end to the sync's
    return, per call (medians)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters + 2):
            sync()
            with record_function(f"epmoe_call{i}"):
                layer(x, logits)
                sync()
    evs = list(prof.events())
    # the calls: their CPU ranges (the profiler also puts each range on the GPU's timeline, as an annotation
    # from the range's first kernel to its last: neither a call nor a kernel here)
    calls = sorted((e for e in evs if e.name.startswith("epmoe_call") and e.device_type.name == "CPU"),
                   key=lambda e: e.time_range.start)[2:]
    kernels = sorted(((e.time_range.start, e.time_range.end) for e in evs
                      if e.device_type.name == "CUDA" and not e.name.startswith("epmoe_call")))
    idle, first, tail, busy = [], [], [], []
    for c in calls:
        window = call_window_times(c.time_range.start, c.time_range.end, kernels)
        if window is None:
            continue
        for out, v in zip((busy, idle, first, tail), window):
            out.append(v / 1e3)
    if not idle:
        return {"per_call_error": "no kernel spans inside the profiled calls"}
    return {"per_call_idle_ms_median": statistics.median(idle), "per_call_idle_ms_max": max(idle),
            "per_call_busy_ms_median": statistics.median(busy),
            "per_call_first_kernel_ms_median": statistics.median(first),
            "per_call_after_last_kernel_ms_median": statistics.median(tail), "per_call_calls": len(idle)}


def layer_and_inputs(cfg, dispatcher: str, T: int, device, experts: str = "triton", warmup: int = 10,
                     routing_impl: str = "auto"):
    """(layer, x, logits): an ep = 1 EPMoE with random weights (`_weights`) and T random tokens and
    router logits (seed 1), after `warmup` calls (they compile) and a synchronize."""
    from epmoe import EPMoE

    layer = EPMoE(cfg, dispatcher=dispatcher, experts=experts, device=device, max_num_tokens_per_rank=max(T, 128))
    if routing_impl != "auto" and hasattr(layer, "router"):  # A/B: the torch-op routing in the same run
        layer.router.impl = routing_impl
    layer.load_weights(_weights(cfg, device))
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(device=device, dtype=cfg.dtype)
    logits = torch.randn(T, cfg.num_experts, generator=g).to(device)
    for _ in range(warmup):
        layer(x, logits)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return layer, x, logits


def measure(dispatcher: str, experts: str, T: int, cfg, device, iters: int, warmup: int,
            routing_impl: str = "auto") -> dict:
    layer, x, logits = layer_and_inputs(cfg, dispatcher, T, device, experts=experts, warmup=warmup,
                                        routing_impl=routing_impl)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
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
        # Host time to issue one call while the GPU is still busy with earlier work (a queued sleep
        # kernel): what each layer costs the CPU when layers follow each other without a sync. A host
        # sync inside the call would show up here as the sleep's length.
        issue = []
        for _ in range(iters):
            sync()
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time queued ahead of the call
            t0 = time.perf_counter()
            layer(x, logits)
            issue.append((time.perf_counter() - t0) * 1e3)
        sync()
        # Layers back to back (one sync per 10 calls): wall per call against the GPU's busy time.
        reps = []
        for _ in range(max(3, iters // 5)):
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                layer(x, logits)
            sync()
            reps.append((time.perf_counter() - t0) * 1e3 / 10)
        out.update(host_issue_ms_median=statistics.median(issue), back_to_back_ms_per_call=statistics.median(reps),
                   back_to_back_overhead_ms=statistics.median(reps) - busy)
        out.update(per_call_idle(layer, x, logits, iters, sync))
        out.update(against_graph(layer, x, logits, 3 * iters, sync))
        if "graph_wall_ms_median" in out:
            out["graph_wall_minus_busy_ms"] = out["graph_wall_ms_median"] - busy
    close = getattr(layer, "close", None)
    if close is not None:
        close()
    else:
        layer.dispatcher.close()
    return out


# --------------------------------------------------------------------------- host cost without a GPU
def host_layer(T: int, device: str = "cpu", num_experts: int = 128, hidden: int = 0, intermediate: int = 0,
               dispatcher: str = "torch", routing: str = "softmax", set_env: bool = True,
               routing_impl: str = "auto"):
    """(layer, x, logits, counts) for a host-cost run: an ep = 1 EPMoE with triton experts whose kernel
    launches (and, on CPU, torch._grouped_mm: replaced process-wide) are no-op recorders;
    counts["launches"] counts them. The weights are empty tensors of the real shapes (the GEMMs never
    run). routing_impl: the layer's routing ("auto": what a GPU runs, the fused Triton kernel where it
    applies, its launch recorded too; "torch": torch ops; checkouts without `epmoe.routing.Router`:
    torch ops). device "meta": the torch ops run on meta tensors (any host sync raises). The triton backend
    is accepted on CPU only with TRITON_INTERPRET=1 (set here unless set_env=False)."""
    if set_env:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # nothing is launched: no interpreter runs
    from epmoe import EPMoE, MoEConfig

    H = hidden or (7168 if device == "meta" else 256)
    I = intermediate or (2048 if device == "meta" else 128)
    extra = dict(n_group=8, topk_group=4) if routing == "sigmoid_grouped" else {}
    cfg = MoEConfig(num_experts=num_experts, top_k=8, hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
                    routing=routing, **extra)
    from epmoe.resolve import detect_environment, resolve_plan

    # the plan an H200 resolves (arch sm90); the layer is built on the CPU
    plan = resolve_plan(cfg, dispatcher=dispatcher, experts="triton", environment=detect_environment(arch="sm90"))
    layer = EPMoE(cfg, dispatcher=dispatcher, experts="triton", device="cpu", max_num_tokens_per_rank=max(T, 128),
                  plan=plan)
    dev = torch.device(device)
    ex = layer.experts
    ex.device = dev
    ex._params = {"w13": torch.empty(num_experts, cfg.w13_rows, H, dtype=cfg.dtype, device=dev),
                  "w2": torch.empty(num_experts, H, I, dtype=cfg.dtype, device=dev)}
    layer._weights_loaded = True
    layer.device = dev
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    counts = {"launches": 0, "grouped_mm": 0, "gemm1_at": None, "launches_before_gemm": 0}

    def record(name, grid, args, kwargs):
        counts["launches"] += 1
        if counts["gemm1_at"] is None and name in _FIRST_GEMMS:  # the host time the GPU idles before it
            counts["gemm1_at"] = time.perf_counter()
        if counts["gemm1_at"] is None:
            counts["launches_before_gemm"] += 1

    ex._launch = record
    router = getattr(layer, "router", None)
    if router is not None and routing_impl == "auto":  # the choice an H200 makes: fused where it applies
        from epmoe.routing import fused_routing_available

        routing_impl = "triton" if fused_routing_available(cfg, "cuda") is None else "torch"
    if router is not None and routing_impl != "auto":
        router.impl, router.device = routing_impl, dev
        router._launch = record  # the fused routing kernel's launch, recorded like the experts' ones
    if device != "meta":  # on meta tensors the real op only computes shapes
        def grouped_mm(a, b, offs=None, **kw):  # shape only: the GEMM is not run
            counts["grouped_mm"] += 1
            if counts["gemm1_at"] is None:
                counts["gemm1_at"] = time.perf_counter()
            return torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)

        torch._grouped_mm = grouped_mm
    elif _REAL_GROUPED_MM is not None:  # meta: the real op (shapes only), its first call timed
        def grouped_mm_meta(*a, **kw):
            if counts["gemm1_at"] is None:
                counts["gemm1_at"] = time.perf_counter()
            return _REAL_GROUPED_MM(*a, **kw)

        torch._grouped_mm = grouped_mm_meta
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(device=dev, dtype=cfg.dtype)
    logits = torch.randn(T, num_experts, generator=g).to(device=dev)
    return layer, x, logits, counts


_REAL_GROUPED_MM = getattr(torch, "_grouped_mm", None)
# the first expert GEMM of a forward: a triton GEMM kernel, a Gluon W4A16 one, or torch._grouped_mm
_FIRST_GEMMS = ("moe_gemm1_kernel", "w4a16_swap_kernel", "w4a16_wgmma_kernel")


def count_torch_ops(fn, before=None) -> dict:
    """aten ops one call of fn() dispatches (each a kernel launch or at least a host round through
    torch's dispatcher on a GPU; views included), by name. before: a callable; the ops dispatched while
    it returns True are also counted under "<name> (before)"."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts[name] = counts.get(name, 0) + 1
            if before is not None and before():
                counts[name + " (before)"] = counts.get(name + " (before)", 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts


def measure_host(T: int, device: str, iters: int, warmup: int, profile: bool = False, **kw) -> dict:
    layer, x, logits, counts = host_layer(T, device, **kw)
    for _ in range(warmup):
        layer(x, logits)
    counts["gemm1_at"] = None
    ops = count_torch_ops(lambda: layer(x, logits), before=lambda: counts["gemm1_at"] is None)
    before = {k[: -len(" (before)")]: v for k, v in ops.items() if k.endswith(" (before)")}
    ops = {k: v for k, v in ops.items() if not k.endswith(" (before)")}
    counts.update(launches=0, grouped_mm=0, launches_before_gemm=0)
    times = []
    to_gemm1 = []
    for _ in range(iters):
        counts["gemm1_at"] = None
        t0 = time.perf_counter()
        layer(x, logits)
        times.append((time.perf_counter() - t0) * 1e6)
        if counts.get("gemm1_at") is not None:
            to_gemm1.append((counts["gemm1_at"] - t0) * 1e6)
    out = {"dispatcher": layer.dispatcher.name, "experts": "triton (launches recorded)", "tokens": T,
           "host_device": device, "hidden_size": layer.config.hidden_size,
           "host_us_median": statistics.median(times), "host_us_min": min(times),
           "host_us_to_first_gemm_median": statistics.median(to_gemm1) if to_gemm1 else None,
           "torch_ops_per_forward": sum(ops.values()), "torch_ops": dict(sorted(ops.items())),
           "torch_ops_before_first_gemm": sum(before.values()),
           "torch_ops_before_first_gemm_by_name": dict(sorted(before.items())),
           "triton_launches_per_forward": counts["launches"] / iters,
           "triton_launches_before_first_gemm": counts["launches_before_gemm"] / iters,
           "grouped_mm_per_forward": counts["grouped_mm"] / iters}
    if profile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(iters):
            layer(x, logits)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"--- cProfile, T={T}, {iters} forwards ---\n{buf.getvalue()}", file=sys.stderr)
    return out


def _emit(report: dict, json_path) -> int:
    """Print the report (and write it to json_path); exit code 1 if any row failed."""
    text = json.dumps(report, indent=1)
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    return 0 if all("error" not in r for r in report["results"]) else 1


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
    p.add_argument("--cpu-host", action="store_true", help="host cost per forward without a GPU (launches recorded)")
    p.add_argument("--host-device", default="cpu", choices=("cpu", "meta"), help="--cpu-host: where torch ops run")
    p.add_argument("--routing", default="softmax", choices=("softmax", "sigmoid_grouped"), help="--cpu-host routing")
    p.add_argument("--routing-impl", default="auto", choices=("auto", "torch", "triton"),
                   help="the layer's routing implementation (auto: the fused kernel on a GPU)")
    p.add_argument("--align-single-max", type=int, default=None,
                   help="entries up to which the alignment runs one program (0: always three kernels)")
    p.add_argument("--profile", action="store_true", help="--cpu-host: print a cProfile breakdown to stderr")
    args = p.parse_args(argv)
    if args.align_single_max is not None:
        from epmoe.experts.triton import align

        align.SINGLE_LAUNCH_MAX_ENTRIES = args.align_single_max
    if args.cpu_host:
        torch.set_num_threads(1)  # host cost, not CPU kernels: no intra-op threads to wait on
        results = []
        for T in [int(t) for t in args.tokens.split(",")]:
            iters = args.iters if args.iters != 20 else (200 if T <= 512 else 50)
            try:
                results.append(measure_host(T, args.host_device, iters, args.warmup, args.profile,
                                            num_experts=args.num_experts, routing=args.routing,
                                            routing_impl=args.routing_impl))
            except Exception as e:  # noqa: BLE001 - e.g. a host sync on meta tensors
                results.append({"tokens": T, "host_device": args.host_device, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(results[-1]), file=sys.stderr)
        report = {"bench": "host_overhead_cpu", "label": args.label, "revision": _git_rev(),
                  "date": time.strftime("%Y-%m-%d"), "device": platform.processor() or "cpu",
                  "torch": torch.__version__, "routing": args.routing, "routing_impl": args.routing_impl,
                  "results": results}
        return _emit(report, args.json)

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
                results.append(measure(d, experts, T, cfg, device, args.iters, args.warmup, args.routing_impl))
            except Exception as e:  # noqa: BLE001 - one backend missing must not lose the others
                results.append({"dispatcher": d, "experts": experts, "tokens": T, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(results[-1]), file=sys.stderr)
    report = {
        "bench": "host_overhead", "label": args.label, "revision": _git_rev(), "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton_fast_launch_env": os.environ.get("EPMOE_TRITON_FAST_LAUNCH", "unset"),
        "routing_impl": args.routing_impl, "align_single_max": args.align_single_max,
        "shape": {"num_experts": cfg.num_experts, "top_k": cfg.top_k,
                                              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                                              "dtype": str(cfg.dtype)},
        "results": results,
    }
    return _emit(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
