"""benchmarks/tune_hopper.py (the one-call H200 tuning script) runs its whole flow on CPU: the
Triton interpreter on tiny shapes (--cpu-smoke, bf16 sweep only to stay quick). Checks that every
section prints, every variant verifies against the float reference, and the JSON is written; the
device run then differs only in sizes and timings."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tune_hopper_cpu_smoke(tmp_path):
    out_json = tmp_path / "tune.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "tune_hopper.py"), "--cpu-smoke", "--only", "bf16",
         "--json", str(out_json)],
        capture_output=True, text=True, env=env, timeout=240, cwd=ROOT,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tags = {ln.split()[0] for ln in lines if ln.strip()}
    assert {"ENV", "CEIL", "DIAG", "RUN", "STAGE", "WINNER", "UPDATE", "DONE"} <= tags, proc.stdout[-3000:]
    runs = [ln for ln in lines if ln.startswith("RUN")]
    assert runs and not any(("WRONG" in ln or "FAILED" in ln) for ln in runs), "\n".join(runs)
    diag = [ln for ln in lines if ln.startswith("DIAG")]
    assert not any("FAILED" in ln for ln in diag), "\n".join(diag)
    report = json.loads(out_json.read_text())
    assert report["diag"]["quant"]["fixed"]["bytes_bad"] == 0.0, report["diag"]["quant"]
    assert set(report["winners"]) == {"bf16/prefill", "bf16/decode"}
    assert all(r["err"] < 1e-2 for r in report["results"] if r["status"] == "ok")
