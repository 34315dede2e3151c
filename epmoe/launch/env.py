"""Process groups for the launcher: torchrun (env://), mpirun (via mpi4py or OMPI/PMI variables),
or a single process. The backend follows the device: NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LaunchEnv:
    """rank / world_size / local_rank of this process; launcher: "torchrun", "mpirun" or "single"."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str
    node_rank: int = 0


def detect_launch_env() -> LaunchEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun",
                         int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))))
    for rank_var, size_var, local_var in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ):
        if rank_var in env and size_var in env:
            return LaunchEnv(int(env[rank_var]), int(env[size_var]), int(env.get(local_var, 0)), "mpirun")
    return LaunchEnv(0, 1, 0, "single")


def _mpi_rendezvous(le: LaunchEnv) -> None:
    """Under mpirun without MASTER_ADDR/PORT: rank 0 picks a port and mpi4py broadcasts it."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(
            "launched by mpirun without MASTER_ADDR/MASTER_PORT and mpi4py is not installed; "
            "pip install 'epmoe[mpi]' or export MASTER_ADDR and MASTER_PORT"
        ) from e
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    addr = port = None
    if comm.Get_rank() == 0:
        addr = socket.gethostbyname(socket.gethostname()) if le.world_size > 1 else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    addr, port = comm.bcast((addr, port), root=0)
    if addr.startswith("127.") and len(set(hosts)) > 1:  # every rank sees the same values: all raise together
        raise RuntimeError(
            f"mpirun across hosts {sorted(set(hosts))}: rank 0's host name {hosts[0]!r} resolves to {addr}, which "
            f"the other hosts cannot reach; export MASTER_ADDR=<an address of {hosts[0]} they can reach> and "
            "MASTER_PORT=<a free port> (e.g. mpirun -x MASTER_ADDR -x MASTER_PORT)"
        )
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


def init_distributed(device_kind: str, timeout_s: float = 300.0) -> LaunchEnv:
    """Initialise the default process group if this is a multi-process launch; returns the env."""
    le = detect_launch_env()
    if le.world_size == 1 or (dist.is_available() and dist.is_initialized()):
        return le
    if device_kind == "cuda":
        torch.cuda.set_device(le.local_rank % max(1, torch.cuda.device_count()))
    if le.launcher == "mpirun":
        _mpi_rendezvous(le)
    backend = "nccl" if device_kind == "cuda" else "gloo"
    kwargs = {}
    if device_kind == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend, init_method="env://", rank=le.rank, world_size=le.world_size,
        timeout=datetime.timedelta(seconds=timeout_s), **kwargs,
    )
    return le


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible here; use --device cpu (gloo) or auto")
    if requested not in ("cpu", "cuda"):
        raise SystemExit(f"--device {requested!r}: use auto, cpu or cuda")
    return torch.device(requested)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def available_memory_bytes(device: torch.device) -> Optional[int]:
    """Free memory of the device (CPU: MemAvailable of this machine)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
