"""A short soak in CI (benchmarks/soak.py): 300 steps on 2 gloo ranks with random T per rank (0 included,
multi-round batches, injected invalid inputs, reference checks) and no memory growth; and proof that the
soak does flag a leak."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOAK = REPO / "benchmarks" / "soak.py"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    return env


def test_soak_two_ranks_no_growth(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SOAK),
           "--device", "cpu", "--steps", "300", "--bad-every", "100", "--check-every", "100", "--tol-objects", "200",
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    log = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, log
    assert "): none" in r.stdout and "raised on every rank: yes" in r.stdout, log
    data = json.loads(out.read_text())
    assert data["ep_size"] == 2 and data["grew"] == [] and data["check_passed"] and data["bad_input_missed"] == []
    for rank in data["ranks"]:
        assert rank["zero_steps"] > 0 and rank["multi_round_steps"] > 0, rank  # T = 0 and T > round size both ran
        assert rank["bad_steps"] >= 3 and rank["bad_raised"] == rank["bad_steps"]
        names = {g["name"]: g for g in rank["growth"]}
        assert names["rss"]["start"] > 0 and names["rss"]["limit"] >= 8 << 20
    assert data["ranks"][0]["checks"] >= 3
    # the gated ms/step counts the steps after the warm-up (50 of 300) only, not the memory probes between them
    for rk in data["ranks"]:
        assert 0 < rk["warmup_seconds"] < rk["seconds"]
        assert 0 < rk["steps_ms"] < 1e3 * (rk["seconds"] - rk["warmup_seconds"])
        slow = rk["slowest_steps"]
        assert len(slow) == 5 and all(50 <= d["step"] < 300 and d["kind"] in ("step", "check", "invalid") for d in slow)
        assert [d["ms"] for d in slow] == sorted((d["ms"] for d in slow), reverse=True)
        assert 0 < rk["median_step_ms"] <= slow[-1]["ms"]
    assert data["ms_per_step"] == pytest.approx(max(r["steps_ms"] for r in data["ranks"]) / 250) and data["warmup_s"] > 0
    assert "after the warm-up: median" in log and "slowest step" in log


def test_soak_flags_an_injected_leak(tmp_path):
    """One process, 64 KiB kept per step: ~16 MiB after warm-up, above the 8 MiB noise floor."""
    cmd = [sys.executable, str(SOAK), "--device", "cpu", "--steps", "300", "--inject-leak-kib", "64", "--json", str(tmp_path / "s.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "GREW: rank 0 rss" in r.stdout, r.stdout
    data = json.loads((tmp_path / "s.json").read_text())
    rss = next(g for g in data["ranks"][0]["growth"] if g["name"] == "rss")
    assert rss["grew"] and rss["delta"] > 12 << 20


def _load_soak():
    spec = importlib.util.spec_from_file_location("epmoe_soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["epmoe_soak"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_growth_rule_and_slope():
    soak = _load_soak()
    args = Namespace(tol_mib=8.0, tol_frac=0.05, tol_objects=500)
    MiB = 1 << 20

    def s(step, rss, objs=1000, alloc=None):
        return soak.MemorySample(step, rss, rss, objs, alloc, alloc)

    # 400 MiB baseline: the limit is 5% = 20 MiB, so +15 MiB is noise and +25 MiB is growth
    g = {x.name: x for x in soak.judge(s(0, 400 * MiB), s(1, 415 * MiB), args)}
    assert not g["rss"].grew and g["rss"].limit == 20 * MiB
    g = {x.name: x for x in soak.judge(s(0, 400 * MiB), s(1, 425 * MiB), args)}
    assert g["rss"].grew and g["hwm"].grew
    # 100 MiB baseline: the 8 MiB floor applies
    g = {x.name: x for x in soak.judge(s(0, 100 * MiB), s(1, 109 * MiB), args)}
    assert g["rss"].grew and g["rss"].limit == 8 * MiB
    g = {x.name: x for x in soak.judge(s(0, 100 * MiB, 1000), s(1, 100 * MiB, 1600), args)}
    assert g["gc_objects"].grew and not g["rss"].grew
    g = {x.name: x for x in soak.judge(s(0, MiB, alloc=50 * MiB), s(1, MiB, alloc=50 * MiB + 2 * MiB), args)}
    assert g["cuda_allocated"].grew and not g["cuda_max_allocated"].grew  # the peak is reported, never judged
    g = {x.name: x for x in soak.judge(s(0, None), s(1, None), args)}
    assert not g["rss"].grew and g["rss"].delta is None  # no /proc: nothing to judge
    # slope: 1 KiB per step = 1000 KiB per 1000 steps
    slope = soak.slope_per_kstep([s(i * 100, 100 * MiB + i * 100 * 1024) for i in range(10)])
    assert abs(slope - 1000 * 1024) < 1e-6
