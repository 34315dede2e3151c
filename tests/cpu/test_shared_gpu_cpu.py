"""Shared-GPU mode's plumbing on CPU (gloo): the opt-in is explicit, typed, agreed across ranks, and
reported by the launcher. The kernels themselves run in tests/gpu/test_shared_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epmoe import EPMoE, MoEConfig
from epmoe.launch.env import check_ranks_per_gpu, gpu_of_local_rank
from tests.cpu.mp import run_group

REPO = Path(__file__).resolve().parents[2]
CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype=torch.float32)


def _launch(*args, nproc=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "epmoe.launch", *args]
    else:
        cmd = [sys.executable, "-m", "epmoe.launch", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_local_ranks_fill_gpus_in_blocks():
    assert [gpu_of_local_rank(r, 4, 2) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [gpu_of_local_rank(r, 1, 8) for r in range(3)] == [0, 1, 2]
    with pytest.raises(SystemExit, match="needs GPU 1, but 1 GPU"):
        gpu_of_local_rank(4, 4, 1)


@pytest.mark.parametrize("value, kind, needle", [
    (0, "cuda", "must be an integer >= 1"), (True, "cuda", "must be an integer >= 1"),
    (2, "cpu", "use --device cuda"),
])
def test_bad_ranks_per_gpu(value, kind, needle):
    with pytest.raises(SystemExit, match=needle):
        check_ranks_per_gpu(value, kind)
    check_ranks_per_gpu(1, "cpu")


def test_launcher_refuses_ranks_per_gpu_on_cpu():
    r = _launch("--device", "cpu", "--ranks-per-gpu", "2", "--steps", "1")
    assert r.returncode != 0
    assert "--ranks-per-gpu 2 shares GPUs between ranks, but the device is cpu" in r.stderr + r.stdout


def _print_plan(capsys, *argv):
    from epmoe.launch.cli import build_parser, load_config, print_plan

    args = build_parser().parse_args(["--plan", *argv])
    cfg, _ = load_config(args, torch.device("cpu"))
    assert print_plan(cfg, args, args.ep, torch.device("cpu")) == 0
    return capsys.readouterr().out


def test_plan_reports_shared_gpu(capsys):
    out = _print_plan(capsys, "--preset", "tiny", "--ep", "4", "--ranks-per-gpu", "4")
    assert "shared GPU: --ranks-per-gpu 4: 4 ranks on 1 GPU(s)" in out and "no link is measured" in out
    assert "shared GPU" not in _print_plan(capsys, "--preset", "tiny", "--ep", "4")


def test_doctor_reports_shared_gpu_and_refuses_it_on_cpu():
    from epmoe.launch import doctor
    from epmoe.launch.cli import build_parser

    args = build_parser().parse_args(["--doctor", "--device", "cpu", "--ep", "2", "--ranks-per-gpu", "2"])
    report = doctor.collect(args)
    text = doctor.format_report(report)
    assert report.exit_code == 3 and report.requested.ranks_per_gpu == 2
    assert "ranks-per-gpu=2" in text and "shared-GPU mode (--ranks-per-gpu 2, explicit opt-in)" in text
    assert "--ranks-per-gpu 2 shares GPUs between ranks, but the device is cpu" in text


def _build(rank, world, shared_by_rank, device):
    try:
        EPMoE(CFG, device=device, shared_gpu=shared_by_rank[rank])
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"
    return "built"


def test_layer_refuses_shared_gpu_on_cpu_on_every_rank():
    res = run_group(_build, 2, [True, True], "cpu")
    assert all(r.startswith("ValueError: shared_gpu=True puts several ranks on one GPU, but device is cpu") for r in res), res


def test_layer_ranks_disagreeing_on_shared_gpu_all_raise():
    res = run_group(_build, 2, [True, False], "cpu")
    assert all(r.startswith("ConfigMismatchError") and "shared_gpu differs" in r for r in res), res


def test_layer_shared_gpu_is_typed():
    with pytest.raises(TypeError, match="shared_gpu='yes'; pass True or False"):
        EPMoE(CFG, device="cpu", shared_gpu="yes")


def _torch_dispatch(rank, world, shared):
    """The torch dispatcher's result does not depend on the flag on CPU (no staging there)."""
    from dataclasses import replace

    import torch.distributed as dist

    from epmoe.dispatch.base import DispatchSpec
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher
    from epmoe.quant.payload import PayloadFormat

    spec = DispatchSpec(group=dist.group.WORLD, ep_rank=rank, ep_size=world, num_experts=8, top_k=2, hidden_size=16,
                        max_tokens_per_rank=8, payload=PayloadFormat.unquantized(torch.float32),
                        combine_dtype=torch.float32, device=torch.device("cpu"))
    d = TorchA2ADispatcher(replace(spec, shared_gpu=shared))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5 + rank, 16, generator=g)
    ids = torch.randint(0, 8, (5 + rank, 2), generator=g, dtype=torch.int32)
    w = torch.rand(5 + rank, 2, generator=g)
    tokens, h = d.dispatch(x, ids, w)
    return d.combine(tokens.hidden * 2, h), d._host_staging


def test_torch_dispatcher_stages_only_for_gloo_and_gives_the_same_bits():
    a = run_group(_torch_dispatch, 2, False)
    b = run_group(_torch_dispatch, 2, True)
    for (ya, stage_a), (yb, stage_b) in zip(a, b):
        assert torch.equal(ya, yb)
        assert stage_a and stage_b  # gloo group: CUDA tensors would be staged (CPU tensors go as they are)


def test_flashinfer_availability_skips_the_peer_check_only_when_asked(monkeypatch):
    """Stand-in for CUDA, FlashInfer and NVML (argument assembly only): without the opt-in a GPU with no
    peer access is refused with a hint naming the opt-in; with shared_gpu=True it is accepted."""
    import importlib.util

    from epmoe.dispatch import flashinfer_a2a as fa

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(fa.importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("flashinfer", "cuda", "pynvml") else real_find_spec(name, *a))
    monkeypatch.setattr(fa.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa, "_peer_access", lambda device: (False, "GPU 0 has no P2P-capable NVLink"))
    no = fa.FlashInferA2ADispatcher.availability(torch.device("cuda", 0), 4)
    assert not no and "--ranks-per-gpu" in no.hint and "shared_gpu=True" in no.hint
    assert fa.FlashInferA2ADispatcher.availability(torch.device("cuda", 0), 4, shared_gpu=True)


def test_launcher_check_compares_on_the_dispatched_values_with_nvfp4():
    """--check with an NVFP4 dispatch: the reference sees the codec's round trip of each rank's input per
    dispatch round (each round has its own global scale), so the float32 tolerance holds."""
    r = _launch("--device", "cpu", "--dispatch-dtype", "nvfp4", "--check", "--steps", "1", "--warmup", "1", "--tokens", "40",
                "--tokens-jitter", "1.0", "--max-tokens-per-rank", "16", nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check | passed" in r.stdout, r.stdout


def test_bench_dispatch_takes_ranks_per_gpu_and_labels_results():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_dispatch
    finally:
        sys.path.pop(0)
    assert bench_dispatch.parse_args(["--ranks-per-gpu", "4"]).ranks_per_gpu == 4
    assert bench_dispatch.parse_args([]).ranks_per_gpu == 1
    assert "placement" in bench_dispatch.Result.__dataclass_fields__
