"""Doctor and soak on a real GPU host (run on the device; skipped without a GPU). Each well under a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = os.environ.get("PYTHONPATH")  # keep what the machine put there (e.g. FlashInfer's site dir)
    env.update(PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""), PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    return env


def test_doctor_on_gpu(tmp_path):
    out = tmp_path / "doctor.json"
    r = subprocess.run([sys.executable, "-m", "epmoe.launch", "--doctor", "--device", "cuda", "--experts", "reference",
                        "--json", str(out)], capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    print(r.stdout[-6000:])  # the report, for the device log
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    cuda = data["cuda"]
    assert cuda["available"] and cuda["device_count"] == torch.cuda.device_count()
    major, minor = torch.cuda.get_device_capability(0)
    assert cuda["gpus"][0]["arch"] == f"sm{major}{minor}" and cuda["gpus"][0]["total_bytes"] > 0
    assert cuda["nccl_version"], "torch.cuda.nccl.version() gave nothing on a CUDA build"
    backends = {(b["kind"], b["name"]): b for b in data["backends"]}
    assert backends[("dispatcher", "torch")]["status"] == "ok"
    assert backends[("experts", "reference")]["status"] == "ok"
    assert data["requested"]["device"] == "cuda" and data["requested"]["ok"]


def test_short_soak_on_one_gpu(tmp_path):
    """2000 steps, one rank: CUDA allocated after warm-up vs end must not grow (nor RSS)."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--device", "cuda", "--experts", "reference",
           "--steps", "2000", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["grew"] == [] and data["check_passed"] and data["bad_input_missed"] == []
    growth = {g["name"]: g for g in data["ranks"][0]["growth"]}
    assert growth["cuda_allocated"]["start"] is not None and not growth["cuda_allocated"]["grew"]
