"""The launcher as a user runs it: torchrun with gloo on CPU, --check, --plan, --json, errors."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(args, nproc=None, timeout=180):
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "epmoe.launch", *args]
    else:
        cmd = [sys.executable, "-m", "epmoe.launch", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_torchrun_two_ranks_check_json_jitter(tmp_path):
    out = tmp_path / "run.json"
    # fp8_block experts: tokens travel as FP8 (what the reference experts consume); the reference models it
    r = _run(["--preset", "tiny", "--check", "--steps", "6", "--layers", "2", "--tokens", "24", "--quant", "fp8_block",
              "--tokens-jitter", "1.0", "--max-tokens-per-rank", "16", "--json", str(out)], nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check | passed" in r.stdout, r.stdout
    data = json.loads(out.read_text())
    assert data["ep_size"] == 2 and len(data["step_ms"]) == 6 and data["check"]["passed"]
    assert len(data["tokens_per_expert"]) == 2 and len(data["tokens_per_expert"][0]) == 16


def test_torchrun_four_ranks_check():
    # the lossy NVFP4 wire the user asked for is part of what --check models
    r = _run(["--preset", "tiny", "--check", "--steps", "3", "--tokens", "16", "--dispatch-dtype", "nvfp4"], nproc=4)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check | passed" in r.stdout and "ranks | 4" in r.stdout
    assert "dispatch=nvfp4 over torch" in r.stdout


def test_plan_dsv3_prints_placement_and_memory():
    r = _run(["--plan", "--preset", "dsv3", "--ep", "8"])
    assert r.returncode == 0, r.stderr
    for needle in ("E=256 top_k=8 H=7168 I=2048", "rank 7: experts [224, 256)", "expert weights :", "a2a workspace",
                   "quant plan:"):
        assert needle in r.stdout, (needle, r.stdout)


def test_plan_for_another_arch_names_skipped_backends():
    """The headline H200 example: FP8 experts over the FlashInfer dispatcher move BF16 (FlashInfer has
    no FP8 payload); --plan says which experts backends were skipped and why."""
    r = _run(["--plan", "--preset", "dsv3", "--ep", "8", "--quant", "fp8_block", "--dispatcher", "flashinfer",
              "--arch", "sm90"])
    assert r.returncode == 0, r.stderr
    assert "dispatch=bf16 over flashinfer" in r.stdout and "via triton" in r.stdout, r.stdout
    r = _run(["--plan", "--preset", "dsv3", "--ep", "8", "--quant", "fp8_block", "--dispatcher", "flashinfer",
              "--arch", "sm90", "--dispatch-dtype", "fp8"])
    assert r.returncode != 0 and "FlashInfer dispatch carries bf16 or nvfp4 payloads, not fp8" in r.stderr, r.stderr


def test_torchrun_two_ranks_eplb(tmp_path):
    """--redundant-experts / --rebalance-every: the run stays checked against float64, prints what each
    rebalance did and the rank load before and after; --plan prints the slots; bad counts exit 2."""
    out = tmp_path / "run.json"
    r = _run(["--preset", "tiny", "--check", "--steps", "7", "--tokens", "24", "--redundant-experts", "2",
              "--rebalance-every", "3", "--json", str(out)], nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check | passed" in r.stdout and "over 18 slots" in r.stdout and "rank load | max/mean" in r.stdout, r.stdout
    assert r.stderr.count("eplb: layer 0 before step") == 2, r.stderr  # steps 3 and 6 of 9 (2 warm-up steps)
    data = json.loads(out.read_text())
    assert set(data["eplb"]) == {"rank_load_before", "rank_load_after", "rebalance_steps"}
    assert len(data["tokens_per_expert"][0]) == 18  # per slot, all ranks
    plan = _run(["--plan", "--preset", "tiny", "--ep", "4", "--redundant-experts", "4"])
    assert plan.returncode == 0 and "20 slots, 5 per rank" in plan.stdout and "5 local experts" in plan.stdout, plan.stdout
    bad = _run(["--plan", "--preset", "tiny", "--ep", "4", "--redundant-experts", "3"])
    assert bad.returncode == 2 and "pass --redundant-experts 4 or 8" in bad.stderr, bad.stderr


def test_torchrun_two_ranks_skewed_routing_rebalances(tmp_path):
    """--routing skewed: a few experts take most tokens, so a rebalance moves experts and lowers the rank
    load; the skew changes at the middle step and a later rebalance follows it; --check still passes
    (the reference sees the biased logits). Without it the summary says why nothing moved."""
    out = tmp_path / "run.json"
    r = _run(["--preset", "tiny", "--check", "--steps", "10", "--tokens", "64", "--redundant-experts", "2",
              "--rebalance-every", "3", "--routing", "skewed", "--json", str(out)], nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "routing=skewed" in r.stdout and "check | passed" in r.stdout, r.stdout
    moved = [ln for ln in r.stderr.splitlines() if ln.startswith("eplb: layer 0") and "moved" in ln]
    assert moved and "before step 3" in moved[0], r.stderr  # the first window already sees the skew
    assert any("before step 9" in ln for ln in moved), r.stderr  # the skew moved at step 6: step 9 follows it
    eplb = json.loads(out.read_text())["eplb"]
    assert eplb["rank_load_after"] < eplb["rank_load_before"] and eplb["rebalance_steps"][0] == 3, eplb
    even = _run(["--preset", "tiny", "--steps", "4", "--tokens", "32", "--redundant-experts", "2",
                 "--rebalance-every", "2"], nproc=2)
    assert even.returncode == 0 and "--routing skewed gives EPLB work" in even.stdout, even.stdout + even.stderr


def test_preset_too_large_asks_for_scale():
    r = _run(["--preset", "dsv3", "--steps", "1"])
    assert r.returncode == 2
    assert "pass --scale " in r.stderr and "available" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--tokens", "-1"], "--tokens -1"),
    (["--scale", "2"], "--scale 2.0: use a factor in (0, 1]"),
    (["--preset", "nope"], "invalid choice"),
    (["--rebalance-every", "0"], "--rebalance-every 0: must be >= 1"),
    (["--redundant-experts", "-2"], "--redundant-experts -2: must be >= 0"),
    (["--routing", "zipf"], "argument --routing: invalid choice: 'zipf'"),
])
def test_bad_flags(args, needle):
    r = _run(args + ["--steps", "1"])
    assert r.returncode != 0 and needle in (r.stdout + r.stderr), r.stderr


def test_bench_layer_dry_run():
    r = subprocess.run([sys.executable, "benchmarks/bench_layer.py", "--dry-run", "--tokens", "128,4096",
                        "--experts", "triton,grouped_mm"], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    assert "T/rank=128: baseline, triton eager, triton graph" in r.stdout
    r = subprocess.run([sys.executable, "benchmarks/bench_layer.py", "--dry-run", "--tokens", "0"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode != 0 and "--tokens must be positive" in r.stderr
