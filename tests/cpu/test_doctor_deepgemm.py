"""Which DeepGEMM `--doctor` finds (epmoe/experts/deepgemm/install.py), with stand-in installations: fake
`deep_gemm` packages and distribution metadata in a temporary directory. These prove the detection
logic only (metadata, native module kind, the known symbol-table verdicts, the JIT compiler, the
one-line import error); the real sgl-deep-gemm wheel is read the same way (docs/deepgemm.md)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from epmoe.experts.deepgemm import install as dgi

REPO = Path(__file__).resolve().parents[2]
UNDEFINED = "raise ImportError('/x/deep_gemm/_C.so: undefined symbol: _ZN3c1010ValueErrorD1Ev')\n"


def _package(root: Path, head: str = "import tvm_ffi\n") -> None:
    pkg = root / "deep_gemm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(head)


def _dist(root: Path, name: str, version: str) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("deep_gemm\n")
    (info / "RECORD").write_text("deep_gemm/__init__.py,,\n")


@pytest.fixture
def on_path(monkeypatch):
    def add(*dirs: Path) -> None:
        for d in reversed(dirs):
            monkeypatch.syspath_prepend(str(d))
        importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    return add


@pytest.mark.parametrize("version, missing", [("0.2.5", 8), ("0.1.7", 2), ("0.1.2", 0)])
def test_pypi_wheel_and_what_its_symbol_table_says_of_torch_2_11(tmp_path, on_path, monkeypatch, version, missing):
    _package(tmp_path)
    _dist(tmp_path, "sgl-deep-gemm", version)
    on_path(tmp_path)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("")
    d = dgi.probe(torch_version="2.11.0+cu130")
    assert (d.kind, d.distribution, d.version, d.native) == ("pypi", "sgl-deep-gemm", version, "tvm-ffi module")
    assert d.known_missing == missing and d.nvcc.endswith("cuda/bin/nvcc")
    problems = [p for p in d.problems() if "apache-tvm-ffi" not in p]
    if missing:
        assert problems == [f"sgl-deep-gemm {version}'s native module needs {missing} torch symbols torch "
                            "2.11.0+cu130 lacks (read from the symbol tables); pip install sgl-deep-gemm==0.1.2 "
                            "--no-deps, or build DeepGEMM against this torch"], problems
    else:
        assert problems == []
    assert dgi.probe(torch_version="2.14.1").known_missing is None  # not checked: the import tells
    assert "deep_gemm" not in sys.modules


def test_a_directory_on_the_path_shadowing_the_wheel_is_named(tmp_path, on_path):
    site, loose = tmp_path / "site", tmp_path / "build"
    _package(site)
    _dist(site, "sgl-deep-gemm", "0.1.2")
    _package(loose, head="")
    on_path(loose, site)
    d = dgi.probe(torch_version="2.11.0+cu130")
    assert d.kind == "unpackaged" and d.note == "shadows sgl-deep-gemm 0.1.2 installed elsewhere", d
    assert d.describe().endswith("(torch extension, shadows sgl-deep-gemm 0.1.2 installed elsewhere)"), d.describe()


def test_no_compiler_and_absent(tmp_path, on_path, monkeypatch):
    _package(tmp_path, head="")
    on_path(tmp_path)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    d = dgi.probe(torch_version="2.11.0+cu130")
    assert d.kind == "unpackaged" and d.native == "torch extension" and d.nvcc == ""
    assert any(p.startswith("no CUDA compiler found") for p in d.problems())
    absent = dgi.DeepGEMMInstall("absent")
    assert absent.problems()[0].startswith("deep_gemm is not installed; pip install 'epmoe[deepgemm]'")


def test_import_error_in_one_line(tmp_path, on_path):
    _package(tmp_path, head=UNDEFINED)
    on_path(tmp_path)
    assert dgi.import_check(timeout_s=60) == "ImportError: /x/deep_gemm/_C.so: undefined symbol: _ZN3c1010ValueErrorD1Ev"


def test_doctor_reports_deepgemm_without_importing_it_on_cpu(tmp_path):
    _package(tmp_path, head="raise SystemExit('imported')\n")
    _dist(tmp_path, "sgl-deep-gemm", "0.2.5")
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{REPO}")
    r = subprocess.run([sys.executable, "-m", "epmoe.launch", "--doctor"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert "DeepGEMM (read from its metadata" in r.stdout, r.stdout[-2000:]
    assert "PyPI sgl-deep-gemm 0.2.5" in r.stdout and "not tried (no CUDA GPU here)" in r.stdout
