"""`python -m epmoe.launch --doctor`: what can this host run, and if not, why.

A read-only preflight report: Python / torch / CUDA, GPUs (arch, memory), peer-access and NVLink
matrices, NCCL, optional packages (probed without importing them), launch environment, and every
registered dispatcher and experts backend with its `availability()` answer. Nothing here starts a
process group or allocates on a GPU beyond what `torch.cuda` device queries do.

With --dispatcher / --experts / --device / --quant (and --ep) it also judges that one requested
configuration: exit code 3 and the reasons when it cannot run here, 0 when it can.

Backends are read from the registries (`epmoe.dispatch.DISPATCHERS`, `epmoe.experts.EXPERTS`), so a
backend registered later appears without changes here. Every probe is isolated: a backend whose
module raises on import is reported, never fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

EXIT_OK = 0
EXIT_CANNOT_RUN = 3

# Status words used in every table.
OK, NO, NOT_BUILT, ERROR, INFO = "ok", "no", "not built", "error", "info"

# Backends this project ships (some on other branches until merged). A name listed here but absent from
# the registry is reported as "not built into this version" rather than silently missing.
EXPECTED_BACKENDS = {
    "dispatcher": ("torch", "flashinfer", "deepep", "deepep_ll"),
    "experts": ("reference", "triton", "grouped_mm", "flashinfer_cutlass"),
}

# Environment variables worth showing (exact names, then prefixes).
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TRITON_INTERPRET", "OMP_NUM_THREADS")
ENV_PREFIXES = ("NCCL_", "NVSHMEM_", "GLOO_", "TORCH_SYMM_MEM_", "TORCH_NCCL_", "OMPI_COMM_WORLD_", "PMI_",
                "FLASHINFER_", "DEEP_EP_")


@dataclass(frozen=True)
class PackageProbe:
    """An optional package: import name, distribution names to ask for a version, what it enables."""

    module: str
    dists: Tuple[str, ...]
    purpose: str
    hint: str
    importable: bool = True  # False: importing it has side effects (deep_ep initialises JIT/NCCL)


PACKAGES: Tuple[PackageProbe, ...] = (
    PackageProbe("flashinfer", ("flashinfer-python", "flashinfer"),
                 "dispatcher 'flashinfer' (MoE all-to-all), experts 'flashinfer_cutlass'",
                 "pip install flashinfer-python (or pip install 'epmoe[gpu]')"),
    PackageProbe("deep_ep", ("sgl-deep-ep", "deep_ep", "deep-ep"), "dispatchers 'deepep', 'deepep_ll'",
                 "pip install 'epmoe[deepep]' (sgl-deep-ep, for its torch), or build DeepEP V1 (docs/deepep.md)",
                 importable=False),
    PackageProbe("deep_gemm", ("sgl-deep-gemm", "deep_gemm", "deep-gemm"), "experts 'deepgemm'",
                 "pip install 'epmoe[deepgemm]' (docs/deepgemm.md)", importable=False),
    PackageProbe("triton", ("triton", "pytorch-triton"), "experts 'triton'", "pip install triton"),
    PackageProbe("mpi4py", ("mpi4py",), "mpirun rendezvous without MASTER_ADDR/MASTER_PORT",
                 "pip install 'epmoe[mpi]' (or export MASTER_ADDR and MASTER_PORT)"),
    PackageProbe("pynvml", ("nvidia-ml-py", "pynvml"), "NVLink matrix here; FlashInfer MNNVL memory",
                 "pip install nvidia-ml-py"),
    PackageProbe("cuda", ("cuda-python", "cuda-bindings"), "FlashInfer MNNVL memory", "pip install cuda-python"),
    PackageProbe("nvidia.nvshmem", ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
                 "DeepEP internode / low-latency (NVSHMEM)", "pip install nvidia-nvshmem-cu13 (match your CUDA)"),
    PackageProbe("safetensors", ("safetensors",), "checkpoint loading", "pip install safetensors"),
    PackageProbe("numpy", ("numpy",), "tensor utilities (an epmoe dependency)", "pip install numpy"),
)


# ---------------------------------------------------------------------------- report records
@dataclass(frozen=True)
class PackageInfo:
    name: str
    status: str  # OK | NO | ERROR
    version: str
    detail: str
    hint: str


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    arch: str  # "sm90"
    total_bytes: int
    free_bytes: Optional[int]
    multiprocessors: int
    pci_bus: str


@dataclass(frozen=True)
class CudaInfo:
    available: bool
    torch_cuda: Optional[str]  # the CUDA version torch was built with (None: CPU build)
    device_count: int
    gpus: Tuple[GpuInfo, ...]
    peer_access: Tuple[Tuple[Optional[bool], ...], ...]  # [i][j]; None on the diagonal
    nvlink: Tuple[Tuple[Optional[bool], ...], ...]  # [i][j] via pynvml; empty when not probed
    nvlink_active_links: Tuple[int, ...]
    fabric: Tuple[str, ...]  # per GPU: multi-node NVLink (MNNVL) fabric membership, via NVML
    nvlink_note: str
    topo: Optional[str]  # `nvidia-smi topo -m` output
    nccl_version: Optional[str]
    note: str


@dataclass(frozen=True)
class BackendStatus:
    kind: str  # "dispatcher" | "experts"
    name: str
    status: str  # OK | NO | NOT_BUILT | ERROR
    reason: str
    hint: str


@dataclass(frozen=True)
class RequestedConfig:
    device: str
    dispatcher: str
    experts: str  # as resolved by the quant plan when possible
    quant: str
    ep_size: int
    ok: bool
    problems: Tuple[str, ...]
    ranks_per_gpu: int = 1  # > 1: shared-GPU mode (--ranks-per-gpu), gloo control group, no link measured


@dataclass(frozen=True)
class DoctorReport:
    host: Dict[str, Any]
    python: str
    torch: str
    distributed: Dict[str, bool]
    cuda: CudaInfo
    packages: Tuple[PackageInfo, ...]
    launch: Dict[str, Any]
    env: Dict[str, str]
    backends: Tuple[BackendStatus, ...]
    backend_context: str
    requested: RequestedConfig
    notes: Tuple[str, ...] = field(default_factory=tuple)
    deepep: Any = None  # epmoe.dispatch.deepep_install.DeepEPInstall
    deepgemm: Any = None  # epmoe.experts.deepgemm.install.DeepGEMMInstall

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.requested.ok else EXIT_CANNOT_RUN

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["exit_code"] = self.exit_code
        return d


# ---------------------------------------------------------------------------- probes
def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def probe_package(p: PackageProbe) -> PackageInfo:
    """find_spec + distribution metadata only: the package is never imported."""
    try:
        spec = importlib.util.find_spec(p.module)
    except (ImportError, ValueError) as e:  # a parent package that is missing or broken
        spec = None
        if not isinstance(e, ModuleNotFoundError):
            return PackageInfo(p.module, ERROR, "", f"find_spec failed ({_short(e)}); needed for {p.purpose}", p.hint)
    if spec is None:
        return PackageInfo(p.module, NO, "", f"not installed; needed for {p.purpose}", p.hint)
    version = ""
    for dist_name in p.dists:
        try:
            version = importlib.metadata.version(dist_name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - broken metadata is reported as "unknown"
            continue
    detail = "installed" + (" (not imported)" if not p.importable else "") + f"; for {p.purpose}"
    return PackageInfo(p.module, OK, version or "unknown", detail, "")


def _arch(major: int, minor: int) -> str:
    return f"sm{major}{minor}"


def _fabric_state(pynvml, handle) -> str:
    """Is this GPU part of a multi-node NVLink fabric (GB200 NVL72 etc.)? The test FlashInfer's MNNVL uses."""
    import ctypes

    try:
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        if info.state >= pynvml.NVML_GPU_FABRIC_STATE_COMPLETED and any(info.clusterUuid):
            return "MNNVL fabric member"
        return "no NVLink fabric"
    except Exception as e:  # noqa: BLE001 - NOT_SUPPORTED on GPUs without a fabric, old drivers, old pynvml
        return f"no NVLink fabric ({_short(e)})"


def _nvml_matrices(n: int, bus_ids: Sequence[str]) -> Tuple[tuple, tuple, tuple, str]:
    """(nvlink [i][j] bools, active links per GPU, fabric state per GPU, note) via pynvml; empty when unavailable."""
    if importlib.util.find_spec("pynvml") is None:
        return (), (), (), "pynvml not installed (pip install nvidia-ml-py); see nvidia-smi topo -m instead"
    try:
        import pynvml  # nvidia-ml-py: a thin ctypes binding, safe to import

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        return (), (), (), f"NVML init failed ({_short(e)})"
    try:
        handles = []
        note = ""
        for i in range(n):
            h = None
            if bus_ids[i]:
                try:  # CUDA and NVML may number GPUs differently; the PCI bus id is the common key
                    h = pynvml.nvmlDeviceGetHandleByPciBusId(bus_ids[i])
                except Exception:  # noqa: BLE001
                    h = None
            if h is None:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                note = "matched CUDA and NVML GPUs by index (PCI bus lookup failed)"
            handles.append(h)
        max_links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
        active = []
        for h in handles:
            count = 0
            for link in range(max_links):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                        count += 1
                except Exception:  # noqa: BLE001 - link not present / not supported
                    continue
            active.append(count)
        matrix = []
        for i in range(n):
            row = []
            for j in range(n):
                if i == j:
                    row.append(None)
                    continue
                try:
                    status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    row.append(status == pynvml.NVML_P2P_STATUS_OK)
                except Exception:  # noqa: BLE001
                    row.append(None)
            matrix.append(tuple(row))
        fabric = tuple(_fabric_state(pynvml, h) for h in handles)
        return tuple(matrix), tuple(active), fabric, note
    except Exception as e:  # noqa: BLE001
        return (), (), (), f"NVML query failed ({_short(e)})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _nvidia_smi_topo() -> Optional[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(nvidia-smi topo -m failed: {_short(e)})"
    return (r.stdout or r.stderr).rstrip() or None


def _nccl_version() -> Optional[str]:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        return None
    if isinstance(v, int):  # older torch: 2xxyy / 2xyyzz encodings
        major, rest = divmod(v, 10000) if v >= 10000 else divmod(v, 1000)
        minor, patch = divmod(rest, 100)
        return f"{major}.{minor}.{patch}"
    return ".".join(str(x) for x in v)


def probe_cuda() -> CudaInfo:
    torch_cuda = torch.version.cuda
    nccl = _nccl_version()
    try:
        available = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001
        return CudaInfo(False, torch_cuda, 0, (), (), (), (), (), "", None, nccl, f"torch.cuda.is_available() raised {_short(e)}")
    if not available:
        note = ("torch is a CPU-only build" if torch_cuda is None
                else "no CUDA GPU visible (driver missing, or CUDA_VISIBLE_DEVICES hides them)")
        return CudaInfo(False, torch_cuda, 0, (), (), (), (), (), "", _nvidia_smi_topo() if torch_cuda else None, nccl, note)
    n = torch.cuda.device_count()
    gpus, bus_ids = [], []
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        bus = ""
        if hasattr(props, "pci_bus_id"):
            bus = f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
        free = None
        try:
            free, _ = torch.cuda.mem_get_info(i)
        except Exception:  # noqa: BLE001
            pass
        gpus.append(GpuInfo(i, props.name, _arch(props.major, props.minor), int(props.total_memory),
                            None if free is None else int(free), int(props.multi_processor_count), bus))
        bus_ids.append(bus)
    peer = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append(None)
                continue
            try:
                row.append(bool(torch.cuda.can_device_access_peer(i, j)))
            except Exception:  # noqa: BLE001
                row.append(None)
        peer.append(tuple(row))
    nvlink, active, fabric, nv_note = _nvml_matrices(n, bus_ids) if n else ((), (), (), "")
    return CudaInfo(True, torch_cuda, n, tuple(gpus), tuple(peer), nvlink, active, fabric, nv_note, _nvidia_smi_topo(),
                    nccl, "")


def probe_host() -> Dict[str, Any]:
    mem_total = mem_avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
                elif line.startswith("MemAvailable:"):
                    mem_avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
        "memory_total_bytes": mem_total, "memory_available_bytes": mem_avail,
    }


def probe_env() -> Dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def probe_launch() -> Dict[str, Any]:
    from epmoe.launch.env import detect_launch_env

    le = detect_launch_env()
    return {
        "detected": le.launcher, "rank": le.rank, "world_size": le.world_size, "local_rank": le.local_rank,
        "node_rank": le.node_rank, "torchrun": shutil.which("torchrun"),
        "mpirun": shutil.which("mpirun") or shutil.which("mpiexec"),
    }


def probe_distributed() -> Dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False, "gloo": False, "nccl": False, "mpi": False}
    return {"available": True, "gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}


# ---------------------------------------------------------------------------- backends
def _load_class(registry, name: str) -> Tuple[Optional[type], Optional[BackendStatus], str]:
    """(class, None) or (None, status saying why it cannot even be loaded)."""
    kind = "dispatcher" if "dispatch" in registry.kind else "experts"
    if name not in registry:
        return None, BackendStatus(kind, name, NOT_BUILT, "not built into this version of epmoe (not registered)",
                                   "upgrade epmoe to a version that ships it"), kind
    try:
        return registry.get(name), None, kind
    except ModuleNotFoundError as e:
        if e.name and (e.name == "epmoe" or e.name.startswith("epmoe.")):
            return None, BackendStatus(kind, name, NOT_BUILT, f"not built into this version of epmoe ({e.name} is missing)",
                                       "upgrade epmoe to a version that ships it"), kind
        return None, BackendStatus(kind, name, NO, f"its module needs {e.name!r}, which is not installed",
                                   f"pip install {e.name}"), kind
    except Exception as e:  # noqa: BLE001 - any import-time failure is reported, not fatal
        return None, BackendStatus(kind, name, ERROR, f"importing it failed: {_short(e)}", ""), kind


def _status_of(kind: str, name: str, avail: Any) -> BackendStatus:
    if avail:
        return BackendStatus(kind, name, OK, getattr(avail, "reason", "") or "", "")
    return BackendStatus(kind, name, NO, getattr(avail, "reason", "") or "unavailable", getattr(avail, "hint", "") or "")


def dispatcher_status(name: str, device: torch.device, ep_size: int, shared_gpu: bool = False) -> BackendStatus:
    from epmoe.dispatch import DISPATCHERS

    cls, failed, kind = _load_class(DISPATCHERS, name)
    if failed:
        return failed
    try:
        # the flag is passed only when set, so a backend registered with the older
        # availability(device, ep_size) signature is still judged for the usual placement
        return _status_of(kind, name, cls.availability(device, ep_size, shared_gpu) if shared_gpu
                          else cls.availability(device, ep_size))
    except Exception as e:  # noqa: BLE001
        return BackendStatus(kind, name, ERROR, f"availability() raised {_short(e)}", "")


def _plan_for(cfg, args, experts_backend: str, arch: str, ep_size: int = 1):
    """The plan through the one resolver, against this host (its FlashInfer version, installed
    packages and prebuilt FlashInfer modules), exactly as EPMoE would resolve it."""
    from epmoe.resolve import detect_environment, resolve_plan

    return resolve_plan(cfg, dispatcher=args.dispatcher, experts=experts_backend, quant=args.quant,
                        dispatch_dtype=args.dispatch_dtype, environment=detect_environment(arch=arch),
                        ep_size=ep_size)


def experts_status(name: str, cfg, args, device: torch.device, ep_size: int, arch: str) -> BackendStatus:
    from epmoe.experts import EXPERTS, ExpertsSpec

    cls, failed, kind = _load_class(EXPERTS, name)
    if failed:
        return failed
    try:
        plan = _plan_for(cfg, args, name, arch, ep_size)
    except ValueError as e:
        return BackendStatus(kind, name, NO, f"the plan rejects it: {e}", "")
    max_tokens = (args.max_tokens_per_rank or 4096) * ep_size
    spec = ExpertsSpec(config=cfg, ep_rank=0, ep_size=ep_size, device=device, plan=plan, max_tokens=max_tokens)
    try:
        return _status_of(kind, name, cls.availability(spec))
    except Exception as e:  # noqa: BLE001
        return BackendStatus(kind, name, ERROR, f"availability() raised {_short(e)}", "")


def _names(registry, kind: str) -> List[str]:
    names = list(registry.names())
    return names + [n for n in EXPECTED_BACKENDS[kind] if n not in names]


# ---------------------------------------------------------------------------- the requested configuration
def _resolve_device(requested: str, cuda: CudaInfo) -> Tuple[torch.device, List[str]]:
    if requested == "auto":
        return torch.device("cuda" if cuda.available else "cpu"), []
    if requested == "cuda" and not cuda.available:
        why = cuda.note or "no CUDA GPU visible"
        return torch.device("cuda"), [f"--device cuda: {why}; install a CUDA build of torch on a GPU host, "
                                      "or use --device cpu (gloo)"]
    return torch.device(requested), []


def _ep_size(args, launch: Dict[str, Any]) -> int:
    """--ep if given, else the launch's world size (1 for a plain `python -m epmoe.launch --doctor`)."""
    return args.ep or int(launch["world_size"])


def judge_requested(args, cfg, device: torch.device, device_problems: List[str], ep_size: int, arch: str,
                    distributed: Dict[str, bool], backends: Sequence[BackendStatus]) -> RequestedConfig:
    problems = list(device_problems)
    rpg = getattr(args, "ranks_per_gpu", 1)
    if rpg < 1:
        problems.append(f"--ranks-per-gpu {rpg}: must be >= 1")
    elif rpg > 1 and device.type != "cuda":
        problems.append(f"--ranks-per-gpu {rpg} shares GPUs between ranks, but the device is {device.type}; "
                        "use --device cuda or drop --ranks-per-gpu")
    if ep_size > 1:
        need = "nccl" if device.type == "cuda" and rpg == 1 else "gloo"
        if not distributed.get(need):
            problems.append(f"ep={ep_size} on {device.type} needs the torch.distributed '{need}' backend, which this "
                            f"torch build lacks; install a torch build with {need}")
    from epmoe.dispatch import DISPATCHERS
    from epmoe.experts import EXPERTS

    by_key = {(b.kind, b.name): b for b in backends}
    # names first: a typo is reported as a typo, not as whatever the quant plan makes of it
    known_dispatcher = args.dispatcher in DISPATCHERS or args.dispatcher in EXPECTED_BACKENDS["dispatcher"]
    known_experts = args.experts == "auto" or args.experts in EXPERTS or args.experts in EXPECTED_BACKENDS["experts"]
    if not known_dispatcher:
        problems.append(f"--dispatcher {args.dispatcher!r} is not a dispatcher; choose one of {DISPATCHERS.names()}")
    else:
        d = by_key.get(("dispatcher", args.dispatcher)) or dispatcher_status(args.dispatcher, device, ep_size, rpg > 1)
        if d.status != OK:
            problems.append(f"--dispatcher {args.dispatcher}: {d.reason}" + (f"; {d.hint}" if d.hint else ""))
    experts = args.experts
    if not known_experts:
        problems.append(f"--experts {args.experts!r} is not an experts backend; choose 'auto' or one of {EXPERTS.names()}")
    elif known_dispatcher:
        try:
            plan = _plan_for(cfg, args, args.experts, arch, ep_size)
            experts = plan.experts_backend
            e = by_key.get(("experts", experts)) or experts_status(experts, cfg, args, device, ep_size, arch)
            if e.status != OK:
                label = f"--experts {args.experts}" + (f" (-> {experts})" if args.experts != experts else "")
                problems.append(f"{label}: {e.reason}" + (f"; {e.hint}" if e.hint else ""))
        except ValueError as err:
            problems.append(f"quant plan (--quant {args.quant or 'bf16'}, --dispatch-dtype {args.dispatch_dtype}, "
                            f"--dispatcher {args.dispatcher}, --experts {args.experts}): {err}")
    if cfg.num_experts % ep_size:
        problems.append(f"num_experts={cfg.num_experts} is not divisible by ep={ep_size}; use an EP size dividing it")
    return RequestedConfig(device=str(device), dispatcher=args.dispatcher, experts=experts, quant=args.quant or "bf16",
                           ep_size=ep_size, ok=not problems, problems=tuple(problems), ranks_per_gpu=rpg)


# ---------------------------------------------------------------------------- assemble
def collect(args: argparse.Namespace) -> DoctorReport:
    """Every probe; `args` is the launcher's namespace (preset/config, device, dispatcher, experts, quant, ep)."""
    from epmoe.config import parse_dtype
    from epmoe.launch.presets import PRESETS

    cuda = probe_cuda()
    launch = probe_launch()
    distributed = probe_distributed()
    device, device_problems = _resolve_device(args.device, cuda)
    arch = "cpu"
    if device.type == "cuda" and cuda.gpus:
        arch = cuda.gpus[0].arch
    ep_size = _ep_size(args, launch)

    from epmoe.config import MoEConfig

    notes: List[str] = []
    try:
        if args.config:
            path = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
            with open(path) as f:
                hf = json.load(f)
        else:
            hf = dict(PRESETS[args.preset or "tiny"])
        dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
        cfg = MoEConfig.from_hf_config(hf, dtype=dtype)
        if args.quant is None and cfg.quant_method is not None:
            cfg = cfg.replace(quant_method=None)
    except (OSError, ValueError, TypeError, KeyError) as e:
        # the backend table still needs a shape: fall back to tiny and say so
        notes.append(f"model config unusable ({_short(e)}); backends judged on preset tiny")
        device_problems = device_problems + [f"model config: {_short(e)}; pass --config a HF config.json (or its "
                                              f"directory) or --preset one of {sorted(PRESETS)}"]
        cfg = MoEConfig.from_hf_config(dict(PRESETS["tiny"]),
                                       dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

    from epmoe.dispatch import DISPATCHERS
    from epmoe.experts import EXPERTS

    backends: List[BackendStatus] = []
    shared_gpu = getattr(args, "ranks_per_gpu", 1) > 1
    for name in _names(DISPATCHERS, "dispatcher"):
        backends.append(dispatcher_status(name, device, ep_size, shared_gpu))
    for name in _names(EXPERTS, "experts"):
        backends.append(experts_status(name, cfg, args, device, ep_size, arch))
    context = (f"judged for device={device.type} ({arch}), ep={ep_size}, model {cfg.model_type} "
               f"H={cfg.hidden_size} I={cfg.intermediate_size} E={cfg.num_experts} dtype={str(cfg.dtype).replace('torch.', '')}, "
               f"quant={args.quant or 'bf16'}"
               + (f", shared GPU ({args.ranks_per_gpu} ranks per GPU)" if shared_gpu else ""))
    requested = judge_requested(args, cfg, device, device_problems, ep_size, arch, distributed, backends)

    if cuda.available and cuda.device_count > 1 and any(v is False for row in cuda.peer_access for v in row):
        notes.append("some GPU pairs have no peer access: NVLink/P2P dispatchers (flashinfer) need all EP ranks "
                     "to reach each other; use dispatcher 'torch' (NCCL) across those pairs")
    if cuda.available and os.environ.get("NCCL_NVLS_ENABLE") is None:
        notes.append("NCCL_NVLS_ENABLE is unset: on shared or virtualised hosts without NVLink multicast set "
                     "NCCL_NVLS_ENABLE=0 (see docs/deploy.md)")
    return DoctorReport(
        host=probe_host(), python=platform.python_version() + f" ({sys.executable})",
        torch=torch.__version__, distributed=distributed, cuda=cuda,
        packages=tuple(probe_package(p) for p in PACKAGES), launch=launch, env=probe_env(),
        backends=tuple(backends), backend_context=context, requested=requested, notes=tuple(notes),
        deepep=probe_deepep(cuda.available), deepgemm=probe_deepgemm(cuda.available),
    )


def probe_deepgemm(cuda_available: bool):
    """Which DeepGEMM, from its metadata and sources; on a CUDA host also whether `import deep_gemm` works
    (in a child process: a module built for another torch fails with an undefined symbol)."""
    from epmoe.experts.deepgemm import install

    info = install.probe()
    if info.found and cuda_available:
        info = dataclasses.replace(info, import_error=install.import_check())
    return info


def _deepgemm_lines(d) -> List[str]:
    if d is None:
        return []
    L = ["", "DeepGEMM (read from its metadata and sources; imported only in a child process on a CUDA host)"]
    if not d.found:
        return L + [f"  not installed  -> {d.problems()[0].split('; ', 1)[1]}"]
    torch_row = ("not checked for this version and torch (the import below tells)" if d.known_missing is None else
                 "its native module's torch symbols all resolve (read from the symbol tables)" if d.known_missing == 0
                 else f"MISMATCH: needs {d.known_missing} torch symbols torch {d.torch_version} lacks")
    rows = [("found", d.describe()), ("torch", torch_row),
            ("JIT compiler", d.nvcc or "none found (set CUDA_HOME)")]
    if d.native == "tvm-ffi module":
        rows.append(("apache-tvm-ffi", d.tvm_ffi or "NOT installed"))
    rows.append(("import", "not tried (no CUDA GPU here)" if d.import_error is None
                 else "ok" if d.import_error == "" else f"FAILED: {d.import_error}"))
    L += _table(rows)
    L += [f"  - {p}" for p in d.problems()]
    return L


def probe_deepep(cuda_available: bool):
    """Which DeepEP, from its metadata and sources; on a CUDA host also whether `import deep_ep` works
    (in a child process: the import initialises DeepEP's runtime)."""
    from epmoe.dispatch import deepep_install

    info = deepep_install.probe()
    if info.found and cuda_available:
        info = dataclasses.replace(info, import_error=deepep_install.import_check())
    return info


def _deepep_lines(d) -> List[str]:
    if d is None:
        return []
    L = ["", "DeepEP (read from its metadata and sources; imported only in a child process on a CUDA host)"]
    if not d.found:
        return L + [f"  not installed  -> {d.problems()[0].split('; ', 1)[1]}"]
    if d.torch_requirement:
        torch_row = (f"built for {d.torch_requirement}; this torch is {d.torch_version}: "
                     + {True: "ok", False: "MISMATCH", None: "cannot tell"}[d.torch_ok])
    else:
        torch_row = ("no torch pin in its metadata (a source build runs with the torch it was compiled against; "
                     "the import below tells)")
    rows = [("found", d.describe()), ("V1 API", ("yes: " if d.v1_api else "NO: ") + d.v1_detail), ("torch", torch_row)]
    if d.cuda_major is not None:
        rows.append(("CUDA", f"built for CUDA {d.cuda_major}; this torch: CUDA {d.torch_cuda or 'none (CPU build)'}: "
                             + ("ok" if d.cuda_ok else "MISMATCH")))
    rows.append(("import", "not tried (no CUDA GPU here)" if d.import_error is None
                 else "ok" if d.import_error == "" else f"FAILED: {d.import_error}"))
    L += _table(rows)
    L += [f"  - {p}" for p in d.problems()]
    return L


# ---------------------------------------------------------------------------- text
def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> List[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths)] + [r[-1]]
        out.append((indent + " | ".join(cells)).rstrip())
    return out


def _matrix(title: str, m: Sequence[Sequence[Optional[bool]]]) -> List[str]:
    n = len(m)
    head = "       " + " ".join(f"GPU{j:<2}" for j in range(n))
    lines = [f"  {title}:", "  " + head]
    for i, row in enumerate(m):
        cells = " ".join(("  -  " if v is None else (" yes " if v else " no  ")) for v in row)
        lines.append(f"    GPU{i:<2} {cells}")
    return lines


def format_report(r: DoctorReport) -> str:
    L: List[str] = ["epmoe doctor: what this host can run", ""]
    h = r.host
    L.append("host")
    L += _table([
        ("hostname", h["hostname"]), ("platform", h["platform"]), ("cpus", str(h["cpus"])),
        ("memory", f"{_gib(h['memory_available_bytes'])} available of {_gib(h['memory_total_bytes'])}"),
        ("python", r.python), ("torch", r.torch + (f" (CUDA {r.cuda.torch_cuda})" if r.cuda.torch_cuda else " (CPU build)")),
        ("torch.distributed", ", ".join(f"{k} {'ok' if v else 'no'}" for k, v in r.distributed.items() if k != "available")
         if r.distributed["available"] else "not available in this torch build"),
        ("NCCL", r.cuda.nccl_version or "none (not in this torch build)"),
    ])
    c = r.cuda
    L += ["", "cuda"]
    if not c.available:
        L.append(f"  not available: {c.note}")
    else:
        L += _table([(f"GPU{g.index}", g.name, g.arch, f"{_gib(g.total_bytes)} total, {_gib(g.free_bytes)} free",
                      f"{g.multiprocessors} SMs  {g.pci_bus}") for g in c.gpus])
        if c.device_count > 1:
            L += _matrix("peer access (torch.cuda.can_device_access_peer)", c.peer_access)
            if c.nvlink:
                L += _matrix("NVLink P2P (NVML)", c.nvlink)
        if c.nvlink_active_links:
            L.append("  active NVLinks per GPU: " + ", ".join(f"GPU{i} {n}" for i, n in enumerate(c.nvlink_active_links)))
        if c.fabric:
            L.append("  multi-node NVLink: " + ", ".join(f"GPU{i} {f}" for i, f in enumerate(c.fabric)))
        if c.nvlink_note:
            L.append(f"  NVLink: {c.nvlink_note}")
    if c.topo:
        L += ["  nvidia-smi topo -m:"] + ["    " + line for line in c.topo.splitlines()]
    L += ["", "packages (probed, not imported)"]
    L += _table([(p.name, p.status, p.version or "-", p.detail + (f"  -> {p.hint}" if p.hint else "")) for p in r.packages])
    L += _deepep_lines(r.deepep)
    L += _deepgemm_lines(r.deepgemm)
    la = r.launch
    L += ["", "launch"]
    L += _table([
        ("detected", f"{la['detected']} (rank {la['rank']} of {la['world_size']}, local rank {la['local_rank']}, "
                     f"node {la['node_rank']})"),
        ("torchrun", la["torchrun"] or "not on PATH"), ("mpirun", la["mpirun"] or "not on PATH (mpirun launches skipped)"),
    ])
    if r.env:
        L += ["", "environment"] + _table([(k, v) for k, v in r.env.items()])
    L += ["", f"backends ({r.backend_context})"]
    L += _table([(b.kind, b.name, b.status, b.reason + (f"  -> {b.hint}" if b.hint else "")) for b in r.backends])
    q = r.requested
    L += ["", "requested configuration"]
    L.append(f"  device={q.device} dispatcher={q.dispatcher} experts={q.experts} quant={q.quant} ep={q.ep_size}"
             + (f" ranks-per-gpu={q.ranks_per_gpu}" if q.ranks_per_gpu > 1 else "") + ": "
             + ("CAN RUN" if q.ok else "CANNOT RUN"))
    if q.ranks_per_gpu > 1:
        L.append(f"  shared-GPU mode (--ranks-per-gpu {q.ranks_per_gpu}, explicit opt-in): ranks share a GPU over a "
                 "gloo group; real kernels and results, timings are local cost only (no link is measured)")
    L += [f"  - {p}" for p in q.problems]
    if r.notes:
        L += ["", "notes"] + [f"  - {n}" for n in r.notes]
    return "\n".join(L)


def run(args: argparse.Namespace) -> int:
    """Entry from the launcher's `--doctor`: print the report (local rank 0 only), write --json, return the exit code."""
    report = collect(args)
    quiet = report.launch["local_rank"] != 0  # under torchrun/mpirun one report per host is enough
    if not quiet:
        print(format_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report.to_dict(), f, indent=1)
            print(f"wrote {args.json}")
        if not report.requested.ok:
            print("error: the requested configuration cannot run here: " + " | ".join(report.requested.problems),
                  file=sys.stderr)
    return report.exit_code
