"""benchmarks/bench_deepep.py on CPU: the dry-run plan (skips, buffer sizes) and the whole GPU code
path with the fake DeepEP (two gloo ranks, perf_counter instead of CUDA events)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_deepep.py")


def _load():
    spec = importlib.util.spec_from_file_location("bench_deepep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_deepep"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_plan_one_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)  # another test file's stand-in, same worker
    bench = _load()
    out = tmp_path / "plan.json"
    assert bench.main(["--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "deep_ep" not in sys.modules
    runs = json.loads(out.read_text())
    assert len(runs) == 8  # {normal, ll} x {bf16, fp8} x {128, 4096}
    for r in runs:
        if r["mode"] == "normal":
            assert "cannot run with one rank" in r["skip"]
        elif r["tokens"] == 4096:
            assert "61.1 GB per rank" in r["skip"]
        else:
            assert r["skip"] == "" and r["buffer_bytes"] == 1_908_410_496
    assert "buffer    1820.0 MiB" in printed


def test_dry_run_plan_eight_ranks(tmp_path):
    bench = _load()
    out = tmp_path / "plan.json"
    assert bench.main(["--dry-run", "--ranks", "8", "--modes", "normal", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert all(r["skip"] == "" and r["buffer_bytes"] > 0 for r in runs)


def test_fake_run_covers_the_gpu_code_path(tmp_path):
    out = tmp_path / "res.json"
    cmd = [sys.executable, SCRIPT, "--cpu-fake", "--ranks", "2", "--hidden", "2048", "--experts", "16",
           "--topk", "4", "--tokens", "8", "--dtypes", "bf16,fp8", "--iters", "1", "--warmup", "0",
           "--ll-max-tokens", "8", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert {(r["mode"], r["dtype"]) for r in rows} == {("normal", "bf16"), ("normal", "fp8"), ("ll", "bf16"), ("ll", "fp8")}
    for r in rows:
        res = r["result"]
        assert res["dispatch_us"] > 0 and res["combine_us"] > 0 and res["recv_messages"] > 0
        assert len(res["per_rank"]) == 2
    assert "deepep ll     fp8  T=8" in p.stdout
