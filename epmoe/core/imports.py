"""Importing an optional native package in a child process: its import-time side effects (JIT set-up,
NCCL checks) and a crash or an undefined symbol stay in the child, and the error comes back in one line."""

from __future__ import annotations

import os
import subprocess
import sys


def import_in_child(module: str, timeout_s: float = 180.0) -> str:
    """Import `module` in a child process (same interpreter and sys.path): "" when it imports, else its
    error in one line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                           timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"the import did not finish within {timeout_s:g} s"
    except OSError as e:
        return f"could not start {sys.executable} ({e})"
    if r.returncode == 0:
        return ""
    if r.returncode < 0:
        return f"the importing process died of signal {-r.returncode}"
    lines = [line.strip() for line in r.stderr.splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit code {r.returncode}")[:400]
