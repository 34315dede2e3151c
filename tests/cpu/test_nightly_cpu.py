"""`python -m epmoe.nightly` on CPU, end to end, as a user's CI runs it: the CPU subset (2 gloo ranks,
reference experts, tiny shapes) records a baseline of two runs and writes JUnit XML, the JSON of
figures and the plot; a planted slowdown in one dispatcher's layer then fails the gate; a rank that
hangs is reported with epmoe's fault report and the suite goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("EPMOE_NIGHTLY")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


def _nightly(*args, env=None, timeout=150):
    cmd = [sys.executable, "-m", "epmoe.nightly", "--gpus", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env(), cwd=REPO)


def test_cpu_subset_records_a_baseline_then_a_planted_slowdown_fails_the_gate(tmp_path):
    base = tmp_path / "baselines" / "cpu.json"
    quick = ["--only", "correctness,bench", "--modes", "bf16", "--bench-tokens", "16,64", "--iters", "6"]
    r = _nightly("--out", str(tmp_path / "a"), "--baseline", str(base), "--update-baseline", *quick)
    log = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, log
    assert "NIGHTLY PASSED" in r.stdout and "step 2/2" in r.stdout and f"wrote a new baseline" in r.stdout, log
    data = json.loads((tmp_path / "a" / "nightly.json").read_text())
    assert data["verdict"] == "passed" and data["machine"]["machine_kind"] == "cpu"
    for key in ("date", "torch", "python", "fingerprint", "host"):
        assert data["machine"][key], key
    figs = data["figures"]
    assert figs["layer.torch.T16.vs_baseline"]["kind"] == "ratio" and figs["dispatch.torch.T64.bytes"]["value"] > 0
    assert figs["correctness.torch.bf16.passed"]["value"] == 1.0
    assert data["plot"] and os.path.getsize(data["plot"]) > 0
    suite = ET.parse(tmp_path / "a" / "junit.xml").getroot()
    assert suite.get("failures") == "0" and suite.find("testcase[@name='correctness/torch/bf16']") is not None
    saved = json.loads(base.read_text())
    assert saved["machine_kind"] == "cpu" and "layer.torch.T64.vs_baseline" in saved["figures"]

    # a second run added: every figure has both runs' values, the bands follow their spread. A run beyond
    # the baseline's bands is not added (test_nightly_gate.py); the 2-core box's noise must not refuse this
    # one, so the one-run ratio band is widened first, as a person may tune it in the file.
    base.write_text(json.dumps(dict(saved, bands=dict(saved["bands"], ratio=3.0))))
    r = _nightly("--out", str(tmp_path / "c"), "--baseline", str(base), "--add-to-baseline", *quick)
    log = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0 and "added this run to" in r.stdout and "2 runs" in r.stdout, log
    saved = json.loads(base.read_text())
    assert len(saved["runs"]) == 2 and len(saved["figures"]["layer.torch.T64.vs_baseline"]["values"]) == 2
    assert saved["runs"][1]["source"] == str(tmp_path / "c" / "nightly.json")

    # the planted sleep must fail the gate. The tiny layer takes a few ms (T = 64: ~6.5 ms, the plain
    # baseline as much), but on a loaded 2-core box both sides take several times that and the CPU band
    # allows 2x: 30 ms went unnoticed at T = 64 once under load; 120 ms would need a 70 ms baseline call.
    r = _nightly("--out", str(tmp_path / "b"), "--baseline", str(base), *quick[:1], "bench", *quick[4:],
                 env=_env(EPMOE_NIGHTLY_PLANT_SLEEP_MS="120"))
    log = r.stdout + r.stderr[-3000:]
    assert r.returncode == 1, log
    assert "PLANTED slowdown" in r.stdout and "NIGHTLY FAILED" in r.stdout and "FAIL layer.torch.T16.vs_baseline" in r.stdout, log
    data = json.loads((tmp_path / "b" / "nightly.json").read_text())
    verdicts = {c["name"]: c["verdict"] for c in data["comparison"]}
    assert verdicts["layer.torch.T16.vs_baseline"] == "regressed" and verdicts["layer.torch.T64.vs_baseline"] == "regressed"
    assert "correctness.torch.bf16.passed" not in verdicts  # not run with --only bench: not judged
    suite = ET.parse(tmp_path / "b" / "junit.xml").getroot()
    assert suite.find("testcase[@name='layer.torch.T16.vs_baseline']/failure").get("type") == "regressed"


def test_a_hung_rank_is_reported_with_the_fault_report_and_the_suite_goes_on(tmp_path):
    r = _nightly("--out", str(tmp_path), "--only", "bench,soak", "--collective-timeout", "3", "--soak-steps", "60",
                 "--bench-tokens", "16", "--iters", "3", env=_env(EPMOE_NIGHTLY_PLANT_HANG_RANK="1"))
    log = r.stdout + r.stderr[-3000:]
    assert r.returncode == 1, log
    data = json.loads((tmp_path / "nightly.json").read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert steps["bench/layer/torch"]["status"] == "failed"
    assert "epmoe fault report: layer 'EPMoE[bench torch]" in steps["bench/layer/torch"]["fault_report"]
    assert "waiting on ranks [1]" in steps["bench/layer/torch"]["fault_report"]
    assert steps["soak/short"]["status"] == "passed", log  # the next step ran
    fail = ET.parse(tmp_path / "junit.xml").getroot().find("testcase[@name='bench/layer/torch']/failure")
    assert "rank 1: no report" in fail.text


def _procs_mentioning(text: str):
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and int(pid) != os.getpid():
                out.append((int(pid), cmd))
    return out


def test_cancelling_the_suite_takes_its_running_steps_down(tmp_path):
    """A CI job cancelled mid-step (SIGTERM to the suite): no worker of the running step survives."""
    import signal
    import time

    cmd = [sys.executable, "-m", "epmoe.nightly", "--gpus", "0", "--only", "bench", "--out", str(tmp_path),
           "--collective-timeout", "300"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                         env=_env(EPMOE_NIGHTLY_PLANT_HANG_RANK="1"))
    try:
        marker = str(tmp_path / "results")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_procs_mentioning(marker)) < 3:  # torchrun + 2 workers
            time.sleep(0.5)
        assert len(_procs_mentioning(marker)) >= 3, "the bench step never started"
        time.sleep(2)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 128 + signal.SIGTERM, out
        assert "killed running steps ['bench/layer/torch']" in out, out
        for _ in range(50):
            left = _procs_mentioning(marker)
            if not left:
                break
            time.sleep(0.1)
        assert not left, left
    finally:
        if p.poll() is None:
            p.kill()


def test_a_run_cut_short_by_max_minutes_fails_and_records_no_baseline(tmp_path):
    """--max-minutes ends before the steps do: the steps it left out or killed fail the run, with the
    flag named, and --update-baseline writes nothing (a baseline must not lose their figures)."""
    base = tmp_path / "cpu.json"
    r = _nightly("--out", str(tmp_path / "a"), "--baseline", str(base), "--update-baseline", "--max-minutes", "0.03",
                 "--only", "correctness,bench", "--modes", "bf16", "--bench-tokens", "16", "--iters", "2")
    log = r.stdout + r.stderr[-3000:]
    assert r.returncode == 1 and "NIGHTLY FAILED" in r.stdout, log
    assert "NOT updating the baseline" in r.stdout and not base.exists(), log
    steps = json.loads((tmp_path / "a" / "nightly.json").read_text())["steps"]
    assert steps and all(st["status"] == "timed out" and "time budget (--max-minutes 0.03)" in st["message"]
                         and "raise --max-minutes" in st["message"] for st in steps), steps
