"""Run a Triton-interpreter worker script in a subprocess (TRITON_INTERPRET must be set before triton
is imported, so it cannot run inside the test process) and collect its `RESULT {json}` lines.

Test side: `run_interpret_worker` + `case_result`; worker side: `report_cases` (no pytest import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Callable, Dict, Sequence


def run_interpret_worker(worker: str, cases: Sequence[str], timeout: float = 240) -> Dict[str, dict]:
    """case name -> the worker's result dict; fails the test if a worker printed none. The cases are
    dealt round-robin to one worker process per CPU core (at most 4), run at the same time."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cases = list(cases)
    jobs = max(1, min(len(cases), os.cpu_count() or 1, 4))
    procs = [subprocess.Popen([sys.executable, worker, *cases[j::jobs]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for j in range(jobs)]
    out = {}
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            got = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
            if not got:
                import pytest

                pytest.fail(f"interpreter worker produced no results (rc={proc.returncode}):\n{stderr[-4000:]}")
            out.update((r["case"], r) for r in got)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def case_result(results: Dict[str, dict], case: str) -> dict:
    """The worker's result for `case`; fails the test if it is missing or the case raised."""
    r = results.get(case)
    assert r is not None, f"{case}: no result"
    assert r["ok"], f"{case} (seed {r['seed']}) raised:\n{r.get('error')}"
    return r


def report_cases(cases: Sequence[str], run: Callable[[str, int], dict]) -> None:
    """Worker side: `run(case, seed)` for each case with a fresh random seed; one `RESULT {json}` line
    each (ok=False with the traceback when it raises)."""
    for case in cases:
        seed = int.from_bytes(os.urandom(2), "little")
        try:
            res = run(case, seed)
            res.update(case=case, seed=seed, ok=True)
        except Exception:
            res = dict(case=case, seed=seed, ok=False, error=traceback.format_exc()[-3000:])
        print("RESULT " + json.dumps(res), flush=True)
