"""benchmarks/bench_host_overhead.py runs (CPU smoke: tiny shape, wall time only) and prints its JSON."""

import json
import os
import subprocess
import sys

from tests.cpu.helpers import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_smoke_prints_json():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_host_overhead.py"), "--cpu-smoke"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["bench"] == "host_overhead" and report["results"][0]["dispatcher"] == "torch"
    assert report["results"][0]["wall_ms_median"] > 0


def test_cpu_host_mode_counts_ops_and_launches():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_host_overhead.py"), "--cpu-host",
                        "--tokens", "16,512", "--num-experts", "16", "--iters", "3", "--warmup", "1"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["bench"] == "host_overhead_cpu"
    small, large = report["results"]
    assert small["host_us_median"] > 0 and small["triton_launches_per_forward"] >= 4
    assert large["grouped_mm_per_forward"] == 2  # 256 rows per expert: the grouped_mm path
    assert "nonzero" not in small["torch_ops"] and "_local_scalar_dense" not in small["torch_ops"]


def test_call_window_times_unions_overlapping_kernels_and_clips_to_the_call():
    """The per-call idle figure's arithmetic (`call_window_times`) on made-up spans: kernels of two streams
    overlapping count once, a kernel reaching past either end of the call counts only inside it, a window
    with no kernel gives None."""
    call_window_times = load_benchmark("bench_host_overhead").call_window_times
    # call [100, 200]: a kernel from before the call (90-110), two overlapping (120-150, 140-160), one nested
    # (145-155), one past the end (190-230), one after the call (250-260)
    kernels = [(90, 110), (120, 150), (140, 160), (145, 155), (190, 230), (250, 260)]
    busy, idle, first, after = call_window_times(100, 200, kernels)
    assert busy == 10 + 40 + 10 and idle == 100 - 60  # [100,110] + [120,160] + [190,200]
    assert first == 0 and after == 0
    busy, idle, first, after = call_window_times(115, 170, kernels)
    assert (busy, idle, first, after) == (40, 15, 5, 10)
    assert call_window_times(300, 400, kernels) is None
