"""Which DeepEP `--doctor` finds (epmoe/dispatch/deepep_install.py), with stand-in installations: fake
`deep_ep` packages and distribution metadata written to a temporary directory. These prove the
detection logic only (metadata, torch pin, CUDA major, V1 API in the sources, the one-line import
error); the real sgl-deep-ep wheel and a real source build are read the same way (docs/deepep.md)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epmoe.dispatch import deepep_install as di

REPO = Path(__file__).resolve().parents[2]

V1_BUFFER = '''
class Buffer:
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False):
        pass
    def destroy(self): pass
    def get_dispatch_layout(self, topk_idx, num_experts): pass
    def dispatch(self, x, handle=None): pass
    def combine(self, x, handle): pass
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts): pass
    def low_latency_combine(self, x, topk_idx, topk_weights, handle): pass
'''
IMPORT_FAILS = "raise ImportError('/x/deep_ep/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa')\n"


def _package(root: Path, *, wheel_layout: bool, buffer_src: str = V1_BUFFER, cuda_major=None,
             init_head: str = IMPORT_FAILS) -> None:
    """A deep_ep package: sgl-deep-ep's layout (buffers/legacy.py, _build_info.py) or V1's (buffer.py)."""
    pkg = root / "deep_ep"
    (pkg / "buffers").mkdir(parents=True)
    if wheel_layout:
        (pkg / "buffers" / "legacy.py").write_text(buffer_src)
        (pkg / "buffers" / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text(init_head + "from .buffers.legacy import Buffer\n")
    else:
        (pkg / "buffer.py").write_text(buffer_src)
        (pkg / "__init__.py").write_text(init_head + "from .buffer import Buffer\n")
    if cuda_major is not None:
        (pkg / "_build_info.py").write_text(f"EXPECTED_CUDA_MAJOR = {cuda_major}\nCUDA_TAG = 'cu{cuda_major}0'\n")


def _dist(root: Path, name: str, version: str, requires=()) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "top_level.txt").write_text("deep_ep\n")
    (info / "RECORD").write_text("deep_ep/__init__.py,,\n")


@pytest.fixture
def on_path(monkeypatch):
    def add(*dirs: Path) -> None:
        for d in reversed(dirs):
            monkeypatch.syspath_prepend(str(d))
        importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    return add


def test_pypi_wheel_with_its_torch_pin_and_cuda_major(tmp_path, on_path):
    _package(tmp_path, wheel_layout=True, cuda_major=13)
    _dist(tmp_path, "sgl-deep-ep", "0.1.2.post1", ["nvidia-ml-py", "torch==2.14.1"])
    on_path(tmp_path)
    d = di.probe(torch_version="2.13.0+cpu", torch_cuda=None)
    assert (d.kind, d.distribution, d.version) == ("pypi", "sgl-deep-ep", "0.1.2.post1")
    assert d.location == os.path.realpath(tmp_path / "deep_ep") and d.describe().startswith("PyPI sgl-deep-ep 0.1.2.post1")
    assert d.v1_api and "deep_ep/buffers/legacy.py" in d.v1_detail
    assert d.torch_requirement == "torch==2.14.1" and d.torch_ok is False
    assert d.cuda_major == 13 and d.cuda_ok is False
    problems = d.problems()
    assert len(problems) == 2 and "built for torch==2.14.1, this torch is 2.13.0+cpu" in problems[0], problems
    assert "built for CUDA 13, this torch for CUDA none (CPU build)" in problems[1], problems
    ok = di.probe(torch_version="2.14.1+cu130", torch_cuda="13.0")  # a local label does not break the pin
    assert ok.torch_ok and ok.cuda_ok and ok.problems() == []
    assert "deep_ep" not in sys.modules


@pytest.mark.parametrize("version, missing", [("0.1.0", 1), ("0.1.2.post1", 2)])
def test_every_pypi_release_on_torch_2_11_points_to_the_source_build(tmp_path, on_path, version, missing):
    """The symbol tables say no sgl-deep-ep release loads on torch 2.11: the verdict says so and names the
    source build, whatever the wheel's pin says; an absent DeepEP on 2.11 gets the same advice."""
    _package(tmp_path, wheel_layout=True, cuda_major=13)
    _dist(tmp_path, "sgl-deep-ep", version, ["torch==2.11.0"])  # even a pin that matches
    on_path(tmp_path)
    d = di.probe(torch_version="2.11.0+cu130", torch_cuda="13.0")
    assert d.known_missing == missing and d.torch_ok and d.cuda_ok
    assert d.problems() == [f"sgl-deep-ep {version}'s native module needs {missing} torch symbol(s) torch 2.11.0+cu130 "
                            "lacks (read from the symbol tables; no sgl-deep-ep release loads on this torch); bash "
                            "scripts/build_deepep.sh (DeepEP V1 built against this torch, docs/deepep.md)"], d.problems()
    assert di.probe(torch_version="2.14.1+cu130", torch_cuda="13.0").known_missing is None  # not checked there
    absent = di.DeepEPInstall("absent", torch_version="2.11.0+cu130").problems()[0]
    assert "no sgl-deep-ep release loads on torch 2.11.0+cu130" in absent and "scripts/build_deepep.sh" in absent


def test_source_build_and_unpackaged_directory(tmp_path, on_path):
    build, loose = tmp_path / "site", tmp_path / "build"
    _package(build, wheel_layout=False)
    _dist(build, "deep_ep", "1.2.1+567632d")
    on_path(build)
    d = di.probe(torch_version="2.11.0+cu130", torch_cuda="13.0")
    assert (d.kind, d.distribution, d.version) == ("source", "deep_ep", "1.2.1+567632d")
    assert d.v1_api and "deep_ep/buffer.py" in d.v1_detail and d.torch_requirement == "" and d.torch_ok is None
    assert d.problems() == []
    _package(loose, wheel_layout=False)  # a build directory earlier on sys.path shadows the installed one
    on_path(loose, build)
    d = di.probe(torch_version="2.11.0+cu130", torch_cuda="13.0")
    assert d.kind == "unpackaged" and d.location == os.path.realpath(loose / "deep_ep")
    assert d.note == "shadows deep_ep 1.2.1+567632d installed elsewhere", d.note


@pytest.mark.parametrize("source, needle", [
    ("class ElasticBuffer:\n    pass\n", "no class Buffer"),
    (V1_BUFFER.replace("def low_latency_dispatch", "def low_latency_dispatch_v2"), "lacks methods ['low_latency_dispatch']"),
    (V1_BUFFER.replace("explicitly_destroy=False", "other=False"), "constructor arguments ['explicitly_destroy']"),
], ids=["v2-only", "method-missing", "argument-missing"])
def test_no_usable_v1_api_is_named(tmp_path, on_path, source, needle):
    _package(tmp_path, wheel_layout=True, buffer_src=source)
    on_path(tmp_path)
    d = di.probe(torch_version="2.14.1", torch_cuda="13.0")
    assert d.v1_api is False and needle in d.v1_detail, d.v1_detail
    assert any(p.startswith("no usable V1 API") for p in d.problems())


def test_absent():
    d = di.DeepEPInstall("absent")
    assert not d.found and d.problems()[0].startswith("deep_ep is not installed; pip install 'epmoe[deepep]'")


def test_import_error_in_one_line(tmp_path, on_path):
    """The import runs in a child process; a binary built for another torch fails with an undefined
    symbol, which comes back as the one line."""
    bad, good = tmp_path / "bad", tmp_path / "good"
    _package(bad, wheel_layout=True)
    on_path(bad)
    assert di.import_check(timeout_s=60) == \
        "ImportError: /x/deep_ep/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa"
    assert "deep_ep" not in sys.modules
    _package(good, wheel_layout=True, init_head="")
    on_path(good, bad)
    assert di.import_check(timeout_s=60) == ""


def test_doctor_reports_the_wheel_without_importing_it_on_cpu(tmp_path):
    _package(tmp_path, wheel_layout=True, cuda_major=13)
    _dist(tmp_path, "sgl-deep-ep", "0.1.2.post1", ["torch==2.14.1"])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{REPO}"
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "-m", "epmoe.launch", "--doctor", "--device", "cpu", "--json", str(out)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "_ZN3c104cuda9SetDeviceEa" not in r.stdout + r.stderr  # never imported on a CPU host
    assert "  found  | PyPI sgl-deep-ep 0.1.2.post1 at " in r.stdout and "  import | not tried (no CUDA GPU here)" in r.stdout
    d = json.loads(out.read_text())["deepep"]
    assert d["kind"] == "pypi" and d["torch_requirement"] == "torch==2.14.1" and d["v1_api"] is True
    packages = {p["name"]: p for p in json.loads(out.read_text())["packages"]}
    assert packages["deep_ep"]["version"] == "0.1.2.post1"
