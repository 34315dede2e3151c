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


def test_masked_tokens_fp8_are_what_deepep_low_latency_delivers():
    """The masked decode rows of an fp8_block plan take FP8 tokens, as DeepEP's FP8 low-latency dispatch
    delivers them: each expert's slots hold the codec's e4m3 bytes of its tokens, scales MN-major."""
    import torch

    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.quant import fp8_block
    from tests.cpu.helpers import load_benchmark

    bench = load_benchmark("bench_experts")
    T, H, E, K = 37, 256, 6, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    flat = DispatchedTokens(x, ids, torch.rand(T, K, generator=g))
    plain, q = bench.masked_tokens(flat, E), bench.masked_tokens(flat, E, fp8=True)
    assert torch.equal(q.expert_counts, torch.bincount(ids.flatten().long(), minlength=E).int())
    assert q.hidden.format.name == "fp8_block" and q.hidden.data.shape == (E, T, H)
    assert q.hidden.scales.shape == (E, T, H // 128) and q.hidden.scales.stride(1) == 1, q.hidden.scales.stride()
    want_q, want_s = fp8_block.quantize_activation(plain.hidden.reshape(E * T, H).float())
    assert torch.equal(q.hidden.data.reshape(E * T, H).view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(q.hidden.scales.reshape(E * T, H // 128), want_s)
    for e, n in enumerate(q.expert_counts.tolist()):  # each expert's first n slots: its tokens in order
        assert torch.equal(plain.hidden[e, :n], x[(ids == e).any(dim=1)])
