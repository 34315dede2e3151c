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
