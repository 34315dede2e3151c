"""When each launch of an eager ep = 1 layer call leaves the host, without the torch profiler (which
slows the host it traces): every Triton launch and torch._grouped_mm is timestamped on the CPU
(perf_counter) relative to the call's start, medians over 30 calls, issued while the GPU is busy
with a queued sleep and while it is idle (synchronized calls). Also per case: wall - busy (as
bench_host_overhead.py), the kernels' GPU times, a cProfile of 20 calls, and the floors (a tiny op
plus a sync, a sync alone, torch.empty). DeepSeek-V3 expert shape, triton experts. Needs a GPU.

    python benchmarks/host_launch_times.py [torch,flashinfer]
"""
import cProfile, io, pstats, statistics, sys, time, torch, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_host_overhead as B
from epmoe import MoEConfig
from epmoe.experts.triton import launch as L

cfg = MoEConfig(num_experts=128, top_k=8, hidden_size=7168, intermediate_size=2048, dtype=torch.bfloat16)
dev = torch.device("cuda")
sync = torch.cuda.synchronize
# floor: launch one tiny kernel and sync, on an idle GPU
z = torch.zeros(16, device=dev)
ts = []
for _ in range(200):
    sync(); t0 = time.perf_counter(); z.add_(1); sync(); ts.append((time.perf_counter() - t0) * 1e6)
print(f"floor: one tiny torch op + sync on an idle GPU: median {statistics.median(ts):.1f} us, min {min(ts):.1f}")
ts = []
for _ in range(200):
    t0 = time.perf_counter(); sync(); ts.append((time.perf_counter() - t0) * 1e6)
print(f"floor: sync on an idle GPU: median {statistics.median(ts):.1f} us")
ts = []
for _ in range(200):
    t0 = time.perf_counter(); torch.empty(1024, device=dev); ts.append((time.perf_counter() - t0) * 1e6)
print(f"torch.empty on cuda: median {statistics.median(ts):.2f} us")

EV = []
orig_call = L.KernelLauncher.__call__
def traced(self, name, grid, args, kwargs):
    orig_call(self, name, grid, args, kwargs); EV.append((name, time.perf_counter()))
L.KernelLauncher.__call__ = traced
og = torch._grouped_mm
def gmm(*a, **k):
    r = og(*a, **k); EV.append(("_grouped_mm", time.perf_counter())); return r
torch._grouped_mm = gmm

for disp in (sys.argv[1] if len(sys.argv) > 1 else "torch,flashinfer").split(","):
    for T in (128, 4096):
        layer, x, logits = B.layer_and_inputs(cfg, disp, T, dev)
        wall = []
        for _ in range(30):
            sync(); t0 = time.perf_counter(); layer(x, logits); sync(); wall.append((time.perf_counter() - t0) * 1e3)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                layer(x, logits)
            sync()
        busy = B._busy_ms(prof, 5)
        kern = {k[:50]: t / 5 for k, t in B._device_times(prof).items()}
        # host timeline with the GPU busy
        runs = []
        for _ in range(30):
            sync(); torch.cuda._sleep(20_000_000)
            EV.clear(); t0 = time.perf_counter(); layer(x, logits); t1 = time.perf_counter()
            runs.append([(n, (t - t0) * 1e6) for n, t in EV] + [("return", (t1 - t0) * 1e6)])
        sync()
        # timeline on an idle GPU (synchronized call, like the wall measure)
        runs_idle = []
        for _ in range(30):
            sync(); EV.clear(); t0 = time.perf_counter(); layer(x, logits); t1 = time.perf_counter(); sync(); t2 = time.perf_counter()
            runs_idle.append([(n, (t - t0) * 1e6) for n, t in EV] + [("return", (t1 - t0) * 1e6), ("synced", (t2 - t0) * 1e6)])
        print(f"==== {disp} T={T}: wall median {statistics.median(wall):.3f} ms, busy {busy:.3f} ms, overhead {statistics.median(wall)-busy:.3f} ms")
        for k, v in sorted(kern.items(), key=lambda kv: -kv[1]):
            print(f"   GPU {v:9.1f} us  {k}")
        for label, rs in (("GPU busy", runs), ("GPU idle", runs_idle)):
            print(f"  host timeline ({label}), median us after call start:")
            for i, (n, _) in enumerate(rs[0]):
                print(f"    {statistics.median(r[i][1] for r in rs if len(r) == len(rs[0])):8.1f}  {n}")
        pr = cProfile.Profile()
        torch.cuda._sleep(50_000_000)
        pr.enable()
        for _ in range(20):
            layer(x, logits)
        pr.disable()
        sync()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        print("\n".join(l for l in buf.getvalue().splitlines() if l.strip())[:6000])
        getattr(layer, "close", lambda: None)()
