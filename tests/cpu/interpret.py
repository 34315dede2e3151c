"""Run a Triton-interpreter worker script in a subprocess (TRITON_INTERPRET must be set before triton
is imported, so it cannot run inside the test process) and collect its `RESULT {json}` lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, Sequence

import pytest


def run_interpret_worker(worker: str, cases: Sequence[str], timeout: float = 240) -> Dict[str, dict]:
    """case name -> the worker's result dict; fails the test if the worker printed none."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, worker, *cases], capture_output=True, text=True, env=env, timeout=timeout)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["case"]] = r
    if not out:
        pytest.fail(f"interpreter worker produced no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return out
