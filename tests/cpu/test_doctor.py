"""`python -m epmoe.launch --doctor`: the report on a CPU host, exit codes for requested configurations,
and the per-backend isolation (a backend that is missing, broken, or raising never breaks the report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from epmoe.core.availability import Availability
from epmoe.dispatch import DISPATCHERS
from epmoe.experts import EXPERTS
from epmoe.launch import doctor
from epmoe.launch.cli import build_parser
from epmoe.experts.base import Experts

REPO = Path(__file__).resolve().parents[2]


def _doctor(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(REPO)) if p)
    return subprocess.run([sys.executable, "-m", "epmoe.launch", "--doctor", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def test_cpu_default_report_and_json(tmp_path):
    out = tmp_path / "doctor.json"
    r = _doctor("--device", "cpu", "--json", str(out))  # the CPU default, also on a GPU host
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout
    assert "torch.distributed | gloo ok" in text, text
    assert f"torch             | {torch.__version__}" in text, text
    assert "CAN RUN" in text and "CANNOT RUN" not in text, text
    flashinfer_row = next(line for line in text.splitlines() if line.strip().startswith("flashinfer "))
    if "| no |" in flashinfer_row:  # the CI machine: not installed, and the row says how to install it
        assert "pip install flashinfer-python" in flashinfer_row, flashinfer_row
    torch_row = next(line for line in text.splitlines() if line.strip().startswith("dispatcher | torch "))
    assert "| ok" in torch_row, torch_row

    data = json.loads(out.read_text())
    assert data["exit_code"] == 0 and data["requested"]["ok"] and data["requested"]["problems"] == []
    packages = {p["name"]: p for p in data["packages"]}
    assert set(packages) >= {"flashinfer", "deep_ep", "triton", "mpi4py", "pynvml"}
    if packages["flashinfer"]["status"] == "no":
        assert "pip install flashinfer-python" in packages["flashinfer"]["hint"]
    backends = {(b["kind"], b["name"]): b for b in data["backends"]}
    assert backends[("dispatcher", "torch")]["status"] == "ok"
    assert backends[("experts", "reference")]["status"] == "ok"
    # every shipped backend name appears, built or not
    for kind, names in doctor.EXPECTED_BACKENDS.items():
        for name in names:
            assert (kind, name) in backends, (kind, name)
    assert data["requested"]["device"] == "cpu"
    if not torch.cuda.is_available():
        assert data["cuda"]["available"] is False and data["cuda"]["gpus"] == []


def test_flashinfer_dispatcher_cannot_run_on_cpu():
    r = _doctor("--dispatcher", "flashinfer", "--device", "cpu")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "CANNOT RUN" in r.stdout
    assert "--dispatcher flashinfer:" in r.stderr, r.stderr  # names the flag and says why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cuda_requested_on_cpu_host():
    r = _doctor("--device", "cuda", "--experts", "nope", "--ep", "3")
    assert r.returncode == 3
    err = r.stderr
    assert "--device cuda:" in err and "--device cpu" in err, err  # the bad value and the fix
    assert "--experts 'nope' is not an experts backend; choose 'auto' or one of" in err, err
    assert "num_experts=16 is not divisible by ep=3" in err, err


def test_deep_ep_is_probed_not_imported(tmp_path):
    """A deep_ep whose import would blow up (as the real one initialises JIT/NCCL) is still reported."""
    pkg = tmp_path / "deep_ep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('deep_ep was imported by the doctor')\n")
    meta = tmp_path / "deep_ep-1.2.3.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: deep_ep\nVersion: 1.2.3\n")
    r = _doctor("--device", "cpu", "--json", str(tmp_path / "d.json"), pythonpath=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deep_ep was imported" not in r.stdout + r.stderr
    packages = {p["name"]: p for p in json.loads((tmp_path / "d.json").read_text())["packages"]}
    assert packages["deep_ep"]["status"] == "ok" and packages["deep_ep"]["version"] == "1.2.3"
    assert "installed (not imported)" in packages["deep_ep"]["detail"]


# ---------------------------------------------------------------- in-process: registry iteration
class _Unavailable:
    @classmethod
    def availability(cls, device, ep_size=1):
        return Availability.no(f"needs 8 widgets for ep_size={ep_size}", "pip install widgets")


class _Raising:
    @classmethod
    def availability(cls, device, ep_size=1):
        raise RuntimeError("driver exploded")


class _ExpertsNeedsCuda(Experts):
    @classmethod
    def supports(cls, request):  # what the resolver asks (static facts)
        if request.arch == "cpu":
            return Availability.no("needs a CUDA GPU, got device cpu", "run on an NVIDIA GPU")
        return Availability.yes()

    @classmethod
    def availability(cls, spec):
        if spec.device.type != "cuda":
            return Availability.no(f"needs a CUDA GPU, got device {spec.device}", "run on an NVIDIA GPU")
        return Availability.yes()


@pytest.fixture
def fake_backends(monkeypatch, tmp_path):
    mod = types.ModuleType("epmoe_doctor_fakes")
    mod.Unavailable, mod.Raising, mod.ExpertsNeedsCuda = _Unavailable, _Raising, _ExpertsNeedsCuda
    monkeypatch.setitem(sys.modules, "epmoe_doctor_fakes", mod)
    (tmp_path / "epmoe_doctor_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "epmoe_doctor_broken", raising=False)
    entries = {
        "zz_unavailable": "epmoe_doctor_fakes:Unavailable",
        "zz_raising": "epmoe_doctor_fakes:Raising",
        "zz_missing_module": "epmoe.dispatch.zz_not_here:Nope",
        "zz_missing_dep": "zz_third_party_pkg_not_installed:Nope",
        "zz_broken": "epmoe_doctor_broken:Nope",
    }
    for name, target in entries.items():
        monkeypatch.setitem(DISPATCHERS._entries, name, target)
    monkeypatch.setitem(EXPERTS._entries, "zz_needs_cuda", "epmoe_doctor_fakes:ExpertsNeedsCuda")


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--doctor", *argv])


def test_every_registered_backend_is_reported_with_its_reason(fake_backends):
    report = doctor.collect(_args("--device", "cpu", "--ep", "2"))
    by = {(b.kind, b.name): b for b in report.backends}
    assert by[("dispatcher", "zz_unavailable")].status == "no"
    assert by[("dispatcher", "zz_unavailable")].reason == "needs 8 widgets for ep_size=2"
    assert by[("dispatcher", "zz_unavailable")].hint == "pip install widgets"
    assert by[("dispatcher", "zz_raising")].status == "error"
    assert "availability() raised RuntimeError: driver exploded" in by[("dispatcher", "zz_raising")].reason
    missing = by[("dispatcher", "zz_missing_module")]
    assert missing.status == "not built" and "epmoe.dispatch.zz_not_here" in missing.reason
    dep = by[("dispatcher", "zz_missing_dep")]
    assert dep.status == "no" and "zz_third_party_pkg_not_installed" in dep.reason
    broken = by[("dispatcher", "zz_broken")]
    assert broken.status == "error" and "RuntimeError: boom at import" in broken.reason
    cuda_only = by[("experts", "zz_needs_cuda")]
    assert cuda_only.status == "no" and "needs a CUDA GPU, got device cpu" in cuda_only.reason
    assert by[("dispatcher", "torch")].status == "ok"
    assert report.requested.ok and report.exit_code == 0
    text = doctor.format_report(report)
    assert "zz_unavailable" in text and "pip install widgets" in text


def test_requested_unavailable_backends_give_exit_3(fake_backends):
    r = doctor.collect(_args("--device", "cpu", "--dispatcher", "zz_unavailable", "--experts", "zz_needs_cuda"))
    assert r.exit_code == 3 and not r.requested.ok
    problems = " | ".join(r.requested.problems)
    assert "--dispatcher zz_unavailable: needs 8 widgets for ep_size=1; pip install widgets" in problems
    # the one resolver asks the class, which says why (and which backends could)
    assert "--experts zz_needs_cuda" in problems and "needs a CUDA GPU, got device cpu" in problems, problems
    assert "backends that can: ['reference']" in problems, problems


def test_package_probe_reports_missing_with_hint():
    info = doctor.probe_package(doctor.PackageProbe("zz_no_such_pkg", ("zz-no-such-pkg",), "testing", "pip install zz"))
    assert info.status == "no" and info.hint == "pip install zz" and "not installed" in info.detail
    info = doctor.probe_package(doctor.PackageProbe("zz_parent.child", ("zz-parent",), "testing", "pip install zz"))
    assert info.status == "no"
    info = doctor.probe_package(doctor.PackageProbe("torch", ("torch",), "everything", ""))
    assert info.status == "ok" and info.version in (torch.__version__, torch.__version__.split("+")[0])


# ---------------------------------------------------------------- the GPU code path, with stand-ins
def test_gpu_host_report_with_stand_ins(monkeypatch):
    """Two fake H200s (peer access one way only), a fake pynvml with NVLink between them: the matrices,
    arch, memory and NCCL version land in the report without touching a real GPU."""
    import importlib.machinery

    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 << 30,
                                  multi_processor_count=132, pci_bus_id=0x18, pci_domain_id=0, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (100 << 30, 141 << 30))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) == (0, 1))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(doctor, "_nvidia_smi_topo", lambda: "        GPU0    GPU1\nGPU0     X      NV18\nGPU1    NV18     X")

    nvml = types.ModuleType("pynvml")
    nvml.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)
    calls = []
    nvml.NVML_FEATURE_ENABLED, nvml.NVML_NVLINK_MAX_LINKS = 1, 18
    nvml.NVML_P2P_CAPS_INDEX_NVLINK, nvml.NVML_P2P_STATUS_OK = 3, 0
    nvml.NVML_GPU_FABRIC_STATE_COMPLETED = 3
    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: ("h", bus)
    nvml.nvmlDeviceGetNvLinkState = lambda h, link: 1 if link < 18 else 0
    nvml.nvmlDeviceGetP2PStatus = lambda a, b, cap: 0

    import ctypes

    class FabricInfo(ctypes.Structure):  # zeros: not part of a fabric (like an H200 HGX board)
        _fields_ = [("clusterUuid", ctypes.c_ubyte * 16), ("state", ctypes.c_uint)]

    nvml.c_nvmlGpuFabricInfoV_t = FabricInfo
    nvml.nvmlDeviceGetGpuFabricInfoV = lambda h, ref: None
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    report = doctor.collect(_args("--experts", "reference"))  # (auto picks a GPU kernel family on sm90)
    c = report.cuda
    assert c.available and c.device_count == 2 and c.nccl_version == "2.28.9"
    assert [g.arch for g in c.gpus] == ["sm90", "sm90"] and c.gpus[0].free_bytes == 100 << 30
    assert c.gpus[0].pci_bus == "00000000:18:00.0"
    assert c.peer_access == ((None, True), (False, None))
    assert c.nvlink == ((None, True), (True, None)) and c.nvlink_active_links == (18, 18)
    assert c.fabric == ("no NVLink fabric", "no NVLink fabric")
    assert calls == ["init", "shutdown"]
    assert report.requested.device == "cuda" and report.requested.ok  # torch + reference run on any GPU
    assert any("no peer access" in n for n in report.notes)  # GPU1 -> GPU0 is missing
    text = doctor.format_report(report)
    for needle in ("GPU0 | NVIDIA H200 | sm90 | 141.0 GiB total, 100.0 GiB free", "NCCL              | 2.28.9",
                   "peer access (torch.cuda.can_device_access_peer):", "NVLink P2P (NVML):",
                   "active NVLinks per GPU: GPU0 18, GPU1 18", "nvidia-smi topo -m:", "NV18"):
        assert needle in text, (needle, text)
    json.dumps(report.to_dict())  # everything serialises


def test_flashinfer_experts_with_flashinfer_installed_are_judged_by_the_resolver(monkeypatch):
    """The doctor resolves with this host's FlashInfer version and packages (it once resolved without
    them and reported every FlashInfer backend as 'not installed' on a host that had FlashInfer)."""
    import epmoe.resolve as res

    monkeypatch.setattr(res, "installed_flashinfer_version", lambda: "0.7.2.post1")
    monkeypatch.setattr(res, "is_installed", lambda name: True)
    monkeypatch.setattr(res, "_fused_moe_prebuilt", lambda arch: None)  # like our H200: fused_moe_90 not built
    from epmoe.launch.presets import PRESETS
    from epmoe.config import MoEConfig

    cfg = MoEConfig.from_hf_config(PRESETS["tiny"])
    args = _args("--device", "cpu")
    cutlass = doctor.experts_status("flashinfer_cutlass", cfg, args, torch.device("cpu"), 1, "sm90")
    assert cutlass.status == "no" and "fused-MoE module is not prebuilt" in cutlass.reason, cutlass
    assert "not installed" not in cutlass.reason
    cutedsl = doctor.experts_status("flashinfer_cutedsl", cfg, args, torch.device("cpu"), 1, "sm90")
    assert "SM100/SM103" in cutedsl.reason and "not installed" not in cutedsl.reason, cutedsl
    plan = doctor._plan_for(cfg, args, "auto", "sm90")
    assert plan.flashinfer_version == "0.7.2.post1" and plan.experts_backend == "triton"
