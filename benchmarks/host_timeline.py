"""Where the GPU waits for the host in one eager ep = 1 layer call (torch dispatcher, triton experts,
DeepSeek-V3 expert shape, T = 128 and 4096): the torch profiler's CPU launch times and GPU kernel
spans on one clock, relative to the call's start, after two warm-up cycles. The profiler slows the
host down; use it for the order and the gaps, `bench_host_overhead.py` for the figures. Needs a GPU.

    python benchmarks/host_timeline.py
"""
import sys, torch
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_host_overhead as B
from epmoe import MoEConfig
from torch.profiler import ProfilerActivity, profile, schedule, record_function

cfg = MoEConfig(num_experts=128, top_k=8, hidden_size=7168, intermediate_size=2048, dtype=torch.bfloat16)
dev = torch.device("cuda")
for T in (128, 4096):
    layer, x, logits = B.layer_and_inputs(cfg, "torch", T, dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=2, active=3),
                 acc_events=True) as prof:
        for i in range(5):
            torch.cuda.synchronize()
            with record_function(f"call{i}"):
                layer(x, logits)
            torch.cuda.synchronize()
            prof.step()
    evs = list(prof.events())
    # the calls' CPU ranges (the profiler also puts each range on the GPU's timeline as an annotation from
    # its first kernel to its last, under the same name: not a call, not a kernel)
    calls = sorted([e for e in evs if e.name.startswith("call") and e.device_type.name == "CPU"],
                   key=lambda e: e.time_range.start)
    for c in calls[-2:]:
        t0, t1 = c.time_range.start, c.time_range.end
        print(f"==== T={T} {c.name}: CPU span {t1 - t0:.0f} us")
        rows = []
        for e in evs:
            s = e.time_range.start
            if not (t0 - 1 <= s <= t1 + 20000):
                continue
            if e.device_type.name == "CUDA" and not e.name.startswith("call"):
                rows.append((s - t0, f"GPU {e.time_range.elapsed_us():7.1f} us  {e.name[:60]}"))
            elif "LaunchKernel" in e.name or e.name.startswith("cuLaunch"):
                rows.append((s - t0, f"cpu launch {e.name}"))
        for t, r in sorted(rows):
            print(f"  {t:8.1f} us  {r}")
