"""The launcher over the DeepEP dispatchers on two CPU ranks, with tests/cpu/fake_deep_ep STANDING IN for
DeepEP (tests/cpu/_launch_standin_deepep.py): every layer uses one DeepEP buffer per rank, made once
and destroyed once, and --check passes for normal mode (FP8 wire, an FP8 checkpoint) and low latency.
This checks what the launcher assembles, not DeepEP's kernels (tests/gpu/test_deepep.py;
`scripts/gpu_checks.sh deepep-launch` runs the same launcher commands on a GPU)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "cpu", "_launch_standin_deepep.py")


@pytest.mark.parametrize("flags", [
    ["--preset", "tiny", "--dispatcher", "deepep", "--checkpoint-format", "fp8", "--tokens", "24"],
    ["--preset", "qwen3-moe", "--scale", "0.125", "--dispatcher", "deepep_ll", "--experts", "masked_reference",
     "--tokens", "16"],
], ids=["normal-fp8", "low-latency-bf16"])
def test_launcher_shares_one_deepep_buffer_across_layers_standin(flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT,
           "--device", "cpu", "--dtype", "bfloat16", "--layers", "2", "--steps", "2", "--tokens-jitter", "1.0",
           "--check", *flags]
    if "--experts" not in flags:
        cmd += ["--experts", "reference"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "check | passed" in r.stdout, r.stdout
    assert f"over {flags[flags.index('--dispatcher') + 1]}" in r.stdout, r.stdout  # the plan names the dispatcher
    counts = [ln for ln in r.stdout.splitlines() if ln.startswith("standin deep_ep buffers")]
    assert counts == ["standin deep_ep buffers: made 1, destroyed 1"] * 2, r.stdout
