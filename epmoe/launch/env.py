"""Process groups for the launcher: torchrun (env://), mpirun (via mpi4py or OMPI/PMI variables),
or a single process. The backend follows the device: NCCL on CUDA, gloo on CPU, and gloo when several
ranks share one GPU (`--ranks-per-gpu N`, an explicit opt-in: NCCL refuses two ranks on one device)."""

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
    """Under mpirun without MASTER_ADDR/PORT: rank 0 picks a port and mpi4py broadcasts it. Raises
    SystemExit naming the fix (no mpi4py; a loopback address across hosts), the same on every rank."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise SystemExit(
            f"launched by mpirun without MASTER_ADDR/MASTER_PORT, and mpi4py cannot be imported ({e}); "
            "pip install 'epmoe[mpi]', or export MASTER_ADDR and MASTER_PORT (mpirun -x MASTER_ADDR -x MASTER_PORT)"
        ) from None
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
        raise SystemExit(
            f"mpirun across hosts {sorted(set(hosts))}: rank 0's host name {hosts[0]!r} resolves to {addr}, which "
            f"the other hosts cannot reach; export MASTER_ADDR=<an address of {hosts[0]} they can reach> and "
            "MASTER_PORT=<a free port> (e.g. mpirun -x MASTER_ADDR -x MASTER_PORT)"
        )
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


def sigkill_delay_s(le: LaunchEnv) -> Optional[float]:
    """Seconds between the SIGTERM a launcher sends the other ranks when one fails and its SIGKILL,
    where this process can know it: Open MPI's mpirun waits `odls_base_sigkill_timeout` (default 1 s;
    `mpirun --mca odls_base_sigkill_timeout S` or OMPI_MCA_odls_base_sigkill_timeout=S sets it).
    None otherwise (torchrun waits 30 s)."""
    if le.launcher != "mpirun" or "OMPI_COMM_WORLD_RANK" not in os.environ:
        return None
    try:
        return max(0.0, float(os.environ.get("OMPI_MCA_odls_base_sigkill_timeout", "1")))
    except ValueError:
        return 1.0


def check_ranks_per_gpu(ranks_per_gpu: int, device_kind: str) -> None:
    """--ranks-per-gpu N: N >= 1; N > 1 only on CUDA (raises SystemExit naming the value and the fix)."""
    if isinstance(ranks_per_gpu, bool) or not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1:
        raise SystemExit(f"--ranks-per-gpu {ranks_per_gpu!r}: must be an integer >= 1")
    if ranks_per_gpu > 1 and device_kind != "cuda":
        raise SystemExit(f"--ranks-per-gpu {ranks_per_gpu} shares GPUs between ranks, but the device is "
                         f"{device_kind}; use --device cuda, or drop --ranks-per-gpu on CPU")


def gpu_of_local_rank(local_rank: int, ranks_per_gpu: int, device_count: int) -> int:
    """The GPU of a local rank: ranks 0..N-1 on GPU 0, N..2N-1 on GPU 1, ... (N = ranks_per_gpu).
    Raises SystemExit when the node's ranks need more GPUs than it has."""
    gpu = local_rank // ranks_per_gpu
    if gpu >= device_count:
        raise SystemExit(
            f"local rank {local_rank} with --ranks-per-gpu {ranks_per_gpu} needs GPU {gpu}, but {device_count} "
            f"GPU(s) are visible; launch at most {ranks_per_gpu * device_count} ranks per node or raise "
            "--ranks-per-gpu"
        )
    return gpu


def init_distributed(device_kind: str, timeout_s: float = 300.0, ranks_per_gpu: int = 1) -> LaunchEnv:
    """Initialise the default process group if this is a multi-process launch; returns the env.
    ranks_per_gpu > 1 (CUDA only): local ranks share GPUs in blocks of that size over a gloo group."""
    check_ranks_per_gpu(ranks_per_gpu, device_kind)
    le = detect_launch_env()
    if device_kind == "cuda" and ranks_per_gpu > 1:
        torch.cuda.set_device(gpu_of_local_rank(le.local_rank, ranks_per_gpu, torch.cuda.device_count()))
    if le.world_size == 1 or (dist.is_available() and dist.is_initialized()):
        return le
    if device_kind == "cuda" and ranks_per_gpu == 1:
        torch.cuda.set_device(le.local_rank % max(1, torch.cuda.device_count()))
    if le.launcher == "mpirun":
        _mpi_rendezvous(le)
    backend = "nccl" if device_kind == "cuda" and ranks_per_gpu == 1 else "gloo"
    kwargs = {}
    if backend == "nccl":
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
