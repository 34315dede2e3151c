"""The launcher under the real Open MPI `mpirun`, as a user starts it (the torchrun cases are in
test_launch.py / test_launch_user.py): a `--check` run, usage errors, mpi4py missing, a rank killed.

mpirun kills every rank as soon as one exits with an error (SIGTERM, then SIGKILL 1 s later by
default), so each case also asserts that nothing is lost to that: a line from every rank that found
an error before the group existed, and the survivor's fault report."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cpu.procs import rank_of, start_job, wait_for_text

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _open_mpi() -> bool:
    if shutil.which("mpirun") is None:
        return False
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out


OPEN_MPI = _open_mpi()
needs_mpirun = pytest.mark.skipif(not OPEN_MPI, reason="Open MPI's mpirun is not installed here "
                                  "(apt-get install openmpi-bin); mpirun's environment is emulated in test_multinode.py")
needs_mpi4py = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                                  reason="mpi4py is not installed (pip install -e '.[mpi]')")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()  # never inherit a surrounding launch
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


def _mpirun(*launch_args: str) -> list:
    cmd = ["mpirun", "--oversubscribe", "-np", "2"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")  # Open MPI refuses root without it (CI containers)
    return [*cmd, sys.executable, "-m", "epmoe.launch", "--device", "cpu", *launch_args]


def _run(cmd, env) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed mpirun; its ranks die with it
        pytest.fail(f"mpirun did not finish within {TIMEOUT_S}s:\n{e.stdout}\n{e.stderr}")


@needs_mpirun
@needs_mpi4py
def test_mpirun_check_passes_with_mpi4py_rendezvous():
    """The README's `mpirun --oversubscribe -np 2 python -m epmoe.launch --preset tiny --check`."""
    r = _run(_mpirun("--preset", "tiny", "--check", "--steps", "3"), _env())
    log = f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert r.returncode == 0, log
    assert "(mpirun, gloo on cpu)" in r.stdout and "ranks | 2" in r.stdout and "check | passed" in r.stdout, log


@needs_mpirun
def test_mpirun_check_passes_with_master_addr_exported():
    """Without mpi4py's rendezvous: MASTER_ADDR/MASTER_PORT in the environment mpirun passes on."""
    from tests.cpu.mp import free_port

    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if os.path.isdir("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    r = _run(_mpirun("--preset", "tiny", "--check", "--steps", "3", "--tokens-jitter", "1.0"), env)
    log = f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert r.returncode == 0, log
    assert "(mpirun, gloo on cpu)" in r.stdout and "check | passed" in r.stdout, log


def _epmoe_lines(stderr: str) -> list:
    return [l for l in stderr.splitlines() if re.match(r"(epmoe|python -m epmoe\.launch): ", l)]


@needs_mpirun
@pytest.mark.parametrize("args, needle", [
    (["--bogus"], "unrecognized arguments: --bogus (see --help)"),  # argparse
    (["--tokens", "-1"], "--tokens -1: must be >= 0"),  # the launcher's own flag checks
], ids=["unknown-flag", "bad-value"])
def test_mpirun_usage_error_one_line_per_rank_exit_2(args, needle):
    """Found before the ranks can agree: every rank says it, in one line naming its rank (whichever
    exits first, mpirun kills the others), exit code 2, no traceback."""
    t0 = time.monotonic()
    r = _run(_mpirun("--preset", "tiny", *args), _env())
    lines = _epmoe_lines(r.stderr)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert sorted(lines) == sorted(l for l in lines if needle in l) and len(lines) == 2, r.stderr
    assert {re.search(r"error: rank (\d): ", l).group(1) for l in lines} == {"0", "1"}, lines
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 60, r.stderr


@needs_mpirun
def test_mpirun_without_mpi4py_one_line_per_rank_exit_2(tmp_path):
    """mpirun without MASTER_ADDR/PORT and without mpi4py: one line per rank naming both fixes, exit 2.
    mpi4py is made unimportable for the ranks by a module of that name first on PYTHONPATH that raises
    the ImportError a missing package raises (a stand-in for its absence where it is installed)."""
    (tmp_path / "mpi4py.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{REPO}"
    r = _run(_mpirun("--preset", "tiny", "--check"), env)
    lines = _epmoe_lines(r.stderr)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 2 and {l.split(": ")[2] for l in lines} == {"rank 0", "rank 1"}, r.stderr
    for line in lines:
        assert "mpi4py cannot be imported (No module named 'mpi4py')" in line and "pip install 'epmoe[mpi]'" in line \
            and "export MASTER_ADDR and MASTER_PORT" in line, line
    assert "Traceback" not in r.stderr, r.stderr


@needs_mpirun
@needs_mpi4py
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds mpirun's ranks through /proc")
def test_mpirun_rank_killed_survivor_reports_before_mpirun_kills_it(tmp_path):
    """Rank 1 SIGKILLed in the step loop: mpirun SIGTERMs rank 0 and SIGKILLs it 1 s later (Open MPI's
    default odls_base_sigkill_timeout); rank 0 prints its fault report, naming rank 1, within that."""
    err_path = tmp_path / "err"
    with open(err_path, "w") as err_file:
        p, kids = start_job(_mpirun("--steps", "100000", "--tokens", "8", "--timeout", "30"), _env(), REPO,
                            subprocess.DEVNULL, err_file)
    try:
        wait_for_text(err_path, "] step ")  # in the step loop
        by_rank = {rank_of(k): k for k in kids}
        os.kill(by_rank[1], signal.SIGKILL)
        t0 = time.monotonic()
        p.wait(timeout=60)
        waited = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=60)
    err = err_path.read_text()
    assert p.returncode != 0 and waited < 30, (p.returncode, waited, err[-4000:])
    report = [l for l in err.splitlines() if l.startswith("epmoe fault report:")]
    assert len(report) == 1 and "rank 0 " in report[0] and "waiting on ranks [1]" in report[0], err[-4000:]
    assert "Traceback" not in err and "frame #" not in err, err[-4000:]


def test_sigkill_delay_read_from_open_mpi_environment(monkeypatch):
    """The time between mpirun's SIGTERM and its SIGKILL, which bounds the survivors' SIGTERM grace."""
    from epmoe.launch.env import detect_launch_env, sigkill_delay_s

    for k in list(os.environ):
        if k.startswith(("OMPI_", "PMI_", "PMIX_")) or k in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    assert sigkill_delay_s(detect_launch_env()) is None  # a single process
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert sigkill_delay_s(detect_launch_env()) == 1.0  # Open MPI's default
    monkeypatch.setenv("OMPI_MCA_odls_base_sigkill_timeout", "15")
    assert sigkill_delay_s(detect_launch_env()) == 15.0
    monkeypatch.setenv("PMI_RANK", "0")  # MPICH / Hydra: not known
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert sigkill_delay_s(detect_launch_env()) is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sigkill_delay_s(detect_launch_env()) is None  # torchrun
