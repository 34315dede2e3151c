"""benchmarks/bench_experts.py --dry-run: argument validation and the plan, no GPU."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_experts.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_dry_run_plan():
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "E_local=128 H=7168 I=2048 top_k=8" in out
    for needle in ("triton     bf16         decode  T=  128", "triton     bf16         prefill T= 4096",
                   "grouped_mm bf16", "torch_loop bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16"):
        assert needle in out, needle
    assert "grouped_mm fp8_block" not in out, "grouped_mm is bf16 only"
    # 2 * T * K * 3 * H * I
    assert "2886.2 GFLOP" in out and "90.2 GFLOP" in out


def test_dry_run_quick_and_bad_args():
    r = _run("--dry-run", "--quick", "--backends", "triton", "--modes", "bf16")
    # bf16 prefill twice: auto (the grouped_mm path) and the Triton GEMMs (preset prefill)
    assert r.returncode == 0 and "plan: 3 runs" in r.stdout, r.stdout + r.stderr
    assert "prefill T= 4096 preset=prefill" in r.stdout
    r = _run("--dry-run", "--quick", "--backends", "grouped_mm,triton", "--modes", "bf16,nvfp4_w4a16")
    assert r.returncode == 0, r.stderr
    for needle in ("grouped_mm bf16         prefill T= 4096 preset=torch_epilogue",  # before / after rows
                   "nvfp4_w4a16  decode  T=  128 preset=triton_w4a16",  # Triton kernels vs the Gluon default
                   "nvfp4_w4a16  decode  T=  128 preset=packed_fp4"):
        assert needle in r.stdout, needle
    r = _run("--dry-run", "--backends", "nope")
    assert r.returncode != 0 and "unknown backend 'nope'" in r.stderr
    r = _run("--dry-run", "--modes", "int4")
    assert r.returncode != 0 and "unknown mode 'int4'" in r.stderr
    r = _run("--dry-run", "--top-k", "300")
    assert r.returncode != 0 and "exceeds" in r.stderr


def test_dry_run_presets_filter():
    """--presets replaces the triton runs' presets with those the mode has (others are left out)."""
    r = _run("--dry-run", "--backends", "triton", "--modes", "bf16,nvfp4_w4a16", "--decode-tokens", "0",
             "--presets", "auto,wgmma_w4r128_kp,prefill_n128,nope")
    assert r.returncode == 0, r.stderr
    assert "plan: 5 runs" in r.stdout, r.stdout
    assert "nvfp4_w4a16  prefill T= 4096 preset=wgmma_w4r128_kp" in r.stdout
    assert "bf16         prefill T= 4096 preset=prefill_n128" in r.stdout
    assert "wgmma" not in r.stdout.split("nvfp4")[0], "bf16 has no wgmma presets"
    assert "nope" not in r.stdout
