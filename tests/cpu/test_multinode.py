"""Multi-node launches on one machine, loopback only: two torchrun "nodes" meeting through a c10d
rendezvous (EP group spanning both), and mpirun's environment (emulated: the real mpirun is in test_launch_mpirun.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import pytest

from tests.cpu.mp import free_port

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()  # never inherit a surrounding launch
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_COMM_WORLD_", "PMI_", "PMIX_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    if os.path.isdir("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo pairs on loopback, whatever the host name resolves to
    return env


def _run_all(cmds: Sequence[List[str]], envs: Sequence[dict]) -> List[subprocess.CompletedProcess]:
    """Start every command at once (they rendezvous with each other); kill all of them on timeout."""
    procs = [subprocess.Popen(c, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c, e in zip(cmds, envs)]
    deadline = time.monotonic() + TIMEOUT_S
    results = []
    try:
        for cmd, p in zip(cmds, procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        logs = []
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # torchrun's workers are in the same new session
            out, err = p.communicate()
            logs.append(f"--- rc={p.returncode}\n{out[-3000:]}\n{err[-3000:]}")
        pytest.fail(f"launches did not finish within {TIMEOUT_S}s:\n" + "\n".join(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return results


def _log(results) -> str:
    return "\n".join(f"--- node {i} rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}" for i, r in enumerate(results))


LAUNCH_ARGS = ["--device", "cpu", "--preset", "tiny", "--check", "--steps", "3", "--tokens", "16", "--tokens-jitter", "1.0",
               "--max-tokens-per-rank", "8", "--layers", "2"]


@pytest.mark.parametrize("shared_weights_dir", [False, True], ids=["per-node-temp-dirs", "shared-weights-dir"])
def test_torchrun_two_nodes_c10d_rendezvous(tmp_path, shared_weights_dir):
    """2 nodes x 2 processes, one EP group of 4 across both. Per node, local rank 0 writes the synthetic
    checkpoint: into its own temp dir, or (shared filesystem) both into one --write-synthetic dir at once."""
    port = free_port()
    out = tmp_path / "run.json"
    extra = ["--json", str(out)]
    if shared_weights_dir:
        extra += ["--write-synthetic", str(tmp_path / "weights")]
    cmds, envs = [], []
    for node in (0, 1):
        cmds.append([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                     "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--rdzv-id", f"epmoe-test-{port}", "--max-restarts", "0",
                     "-m", "epmoe.launch", *LAUNCH_ARGS, *extra])
        # each "node" its own TMPDIR, as separate machines would have
        node_tmp = tmp_path / f"node{node}"
        node_tmp.mkdir()
        envs.append(_env(TMPDIR=str(node_tmp)))
    results = _run_all(cmds, envs)
    log = _log(results)
    assert all(r.returncode == 0 for r in results), log
    for r in results:  # rank 0 prints the summary, the other node's local rank 0 its verdict line
        assert "check | passed" in r.stdout, log
    summary = [r.stdout for r in results if "ranks | 4" in r.stdout]
    assert len(summary) == 1, log  # exactly one global rank 0, and its EP group has all 4 ranks
    data = json.loads(out.read_text())
    assert data["ep_size"] == 4 and data["check"]["passed"], data
    assert len(data["tokens_per_expert"]) == 2 and len(data["tokens_per_expert"][0]) == 16
    if shared_weights_dir:
        assert (tmp_path / "weights" / "model.safetensors").is_file()
        assert json.loads((tmp_path / "weights" / "config.json").read_text())["num_hidden_layers"] == 2
        assert not [p for p in (tmp_path / "weights").iterdir() if p.name.startswith(".model")], "partial files left"
    else:  # both nodes cleaned up their temp checkpoints
        for node in (0, 1):
            assert not list((tmp_path / f"node{node}").glob("epmoe-synthetic-*")), log


@pytest.mark.parametrize("local_ranks", [(0, 1), (0, 0)], ids=["one-node", "two-nodes-one-process-each"])
def test_mpirun_environment_emulated(local_ranks):
    """What mpirun (Open MPI) hands each process, without mpirun: OMPI_COMM_WORLD_* plus MASTER_ADDR/PORT.
    (0, 0): two 'nodes' of one process each, both local rank 0 and without a node rank."""
    port = free_port()
    cmds, envs = [], []
    for rank, local in enumerate(local_ranks):
        cmds.append([sys.executable, "-m", "epmoe.launch", *LAUNCH_ARGS])
        envs.append(_env(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                         OMPI_COMM_WORLD_LOCAL_RANK=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    results = _run_all(cmds, envs)
    log = _log(results)
    assert all(r.returncode == 0 for r in results), log
    assert "(mpirun, gloo on cpu)" in results[0].stdout and "ranks | 2" in results[0].stdout, log
    assert "check | passed" in results[0].stdout, log


def test_pmi_environment_emulated():
    """MPICH / Intel MPI (Hydra) variables: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID."""
    port = free_port()
    cmds = [[sys.executable, "-m", "epmoe.launch", *LAUNCH_ARGS] for _ in range(2)]
    envs = [_env(PMI_RANK=str(r), PMI_SIZE="2", MPI_LOCALRANKID=str(r), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)) for r in range(2)]
    results = _run_all(cmds, envs)
    assert all(r.returncode == 0 for r in results), _log(results)
    assert "check | passed" in results[0].stdout and "(mpirun," in results[0].stdout, _log(results)


# ---------------------------------------------------------------- mpi4py rendezvous, with a stand-in MPI
class _FakeComm:
    def __init__(self, rank, hosts):
        self.rank, self.hosts = rank, hosts

    def Get_rank(self):
        return self.rank

    def allgather(self, value):
        return list(self.hosts)

    def bcast(self, value, root=0):
        assert root == 0
        return value if self.rank == 0 else ("10.0.0.1", 29400)


def _fake_mpi(monkeypatch, comm):
    import types

    mpi4py = types.ModuleType("mpi4py")
    mpi4py.MPI = types.SimpleNamespace(COMM_WORLD=comm)
    monkeypatch.setitem(sys.modules, "mpi4py", mpi4py)
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # set first so that teardown restores the original state
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)


def test_mpi4py_rendezvous_broadcasts_rank0_address(monkeypatch):
    from epmoe.launch.env import LaunchEnv, _mpi_rendezvous

    _fake_mpi(monkeypatch, _FakeComm(1, ["node0", "node1"]))
    _mpi_rendezvous(LaunchEnv(1, 2, 0, "mpirun"))
    assert os.environ["MASTER_ADDR"] == "10.0.0.1" and os.environ["MASTER_PORT"] == "29400"


def test_mpi4py_rendezvous_refuses_loopback_across_hosts(monkeypatch):
    import socket

    from epmoe.launch.env import LaunchEnv, _mpi_rendezvous

    _fake_mpi(monkeypatch, _FakeComm(0, ["node0", "node1"]))
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts default
    with pytest.raises(SystemExit, match=r"resolves to 127\.0\.1\.1.*export MASTER_ADDR="):
        _mpi_rendezvous(LaunchEnv(0, 2, 0, "mpirun"))
    assert "MASTER_ADDR" not in os.environ


def test_mpi4py_rendezvous_single_host_loopback_is_fine(monkeypatch):
    import socket

    from epmoe.launch.env import LaunchEnv, _mpi_rendezvous

    _fake_mpi(monkeypatch, _FakeComm(0, ["node0", "node0"]))
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.0.1")
    _mpi_rendezvous(LaunchEnv(0, 2, 0, "mpirun"))
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
