"""benchmarks/bench_host_overhead.py runs (CPU smoke: tiny shape, wall time only) and prints its JSON."""

import json
import os
import subprocess
import sys

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


def test_trace_gaps_counts_the_gpu_idle_inside_each_call():
    """The trace arithmetic of `host_gap_ms` on made-up spans (us): idle before the first kernel and
    between kernels, overlapping kernels counted once, kernels outside a call's span ignored."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_host_overhead",
                                                  os.path.join(ROOT, "benchmarks", "bench_host_overhead.py"))
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    calls = [(0.0, 1000.0), (2000.0, 2500.0), (3000.0, 3100.0)]
    kernels = [(100.0, 300.0), (250.0, 400.0), (600.0, 900.0),  # call 0: idle 100 + 200, busy 600, tail 100
               (1500.0, 1600.0),  # between the calls: no call's
               (2050.0, 2450.0)]  # call 1: idle 50, tail 50; call 2: no kernel
    r = B.trace_gaps(calls, kernels)
    assert abs(r["host_gap_ms"] - 0.175) < 1e-9 and abs(r["host_gap_ms_min"] - 0.05) < 1e-9, r  # median of 0.3, 0.05
    assert abs(r["sync_return_ms"] - 0.075) < 1e-9, r
    assert "trace_error" in B.trace_gaps(calls, [])
