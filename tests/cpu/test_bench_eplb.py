"""benchmarks/bench_eplb.py runs end to end on 2 CPU ranks (tiny shape, a few steps): its JSON and PNG.
It asserts what the run measured about load, never about speed."""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_eplb_cpu_smoke(tmp_path):
    out, png = tmp_path / "eplb.json", tmp_path / "eplb.png"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_eplb.py"), "--shape", "tiny", "--ep", "2",
           "--tokens", "48", "--window", "3", "--steps", "2", "--json", str(out)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        cmd += ["--png", str(png)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [x["config"] for x in data["results"]] == ["off", "R=0", "R=2"]
    off, r0, r2 = data["results"]
    assert off["rank_load_before"] and "rebalance_ms" not in off and r2["slots"] == 18
    for x in (r0, r2):  # a stationary skew: the plan from the first steps balances the next ones
        assert x["moved_slots"] > 0 and x["imbalance_after"] < x["imbalance_before"], x
        assert sum(x["rank_load_after"]) == sum(off["rank_load_after"])  # the same routed pairs, elsewhere
    assert not data["local_cost_only"] and data["device"] == "cpu"
    if has_mpl:
        assert png.stat().st_size > 1000
