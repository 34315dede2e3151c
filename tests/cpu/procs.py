"""A launcher (torchrun, mpirun) started with its workers found through /proc, for tests that signal
one rank of a running job."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import List, Sequence, Tuple


def launcher_workers(pid: int) -> List[int]:
    """The pids of the `epmoe.launch` processes whose parent is `pid` (torchrun's or mpirun's workers)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                if int(fields[1]) == pid and b"epmoe.launch" in cmd:
                    kids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return sorted(kids)


def start_job(cmd: Sequence[str], env: dict, cwd, stdout, stderr, workers: int = 2) -> Tuple[subprocess.Popen, List[int]]:
    """Start a launcher command in its own session; (its process, its workers' pids) once all are up."""
    p = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
    deadline = time.monotonic() + 90
    kids: List[int] = []
    while time.monotonic() < deadline and len(kids) < workers and p.poll() is None:
        time.sleep(0.5)
        kids = launcher_workers(p.pid)
    if len(kids) != workers:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    assert len(kids) == workers, (kids, p.returncode)
    return p, kids


def kill_job(p: subprocess.Popen, kids: Sequence[int]) -> None:
    """SIGKILL a job from `start_job`: its session and each worker by pid (torchrun's workers may sit in
    sessions of their own, and a worker stopped with SIGSTOP would otherwise outlive the test)."""
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)


def rank_of(pid: int) -> int:
    """The global rank a launcher gave the process (torchrun's RANK, Open MPI's OMPI_COMM_WORLD_RANK)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env.get(b"RANK", env.get(b"OMPI_COMM_WORLD_RANK", b"-1")))


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_for_text(path, needle: str, timeout_s: float = 90) -> str:
    """Poll the file at `path` until it holds `needle` (assert it does by `timeout_s`); its text."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and needle not in open(path).read():
        time.sleep(0.5)
    text = open(path).read()
    assert needle in text, text[-4000:]
    return text
