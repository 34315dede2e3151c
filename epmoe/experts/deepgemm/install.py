"""Which DeepGEMM is installed and whether epmoe can use it here, found without importing it (`--doctor`).

DeepGEMM comes as SGLang's PyPI build `sgl-deep-gemm` (`import deep_gemm`), or built from its source.
Its native module links one torch, and its metadata pins none: a module built against another torch
fails to import with an undefined symbol. Checked by reading each wheel's undefined torch symbols
against torch 2.11.0+cu130's exported ones (2026-12-05, no run): `KNOWN_MISSING` below. Its kernels
compile at run time with the CUDA compiler (`nvcc` under CUDA_HOME, or NVRTC with DG_JIT_USE_NVRTC=1).

`probe()` reads the distribution metadata and the package's sources; `epmoe.core.imports.import_in_child`
tries the import in a child process on a CUDA host.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from epmoe.core import imports

MODULE = "deep_gemm"
PYPI_DIST = "sgl-deep-gemm"
INSTALL_HINT = "pip install 'epmoe[deepgemm]', or for torch 2.11: pip install sgl-deep-gemm==0.1.2 --no-deps (docs/deepgemm.md)"
# (sgl-deep-gemm version, torch minor) -> torch symbols its native module needs that torch lacks
KNOWN_MISSING: Dict[Tuple[str, str], int] = {
    ("0.2.5", "2.11"): 8, ("0.2.3.post2", "2.11"): 8, ("0.2.0", "2.11"): 2, ("0.1.7", "2.11"): 2, ("0.1.2", "2.11"): 0,
}


@dataclass(frozen=True)
class DeepGEMMInstall:
    """kind: "pypi" (sgl-deep-gemm), "source" (another distribution), "unpackaged" or "absent";
    native: "tvm-ffi module" / "torch extension" / "" (unknown); nvcc: the compiler its JIT would use
    ("" = none found); known_missing: torch symbols its module lacks here by `KNOWN_MISSING` (None =
    not checked for this version and torch); import_error: None = not tried, "" = imported fine."""

    kind: str
    distribution: str = ""
    version: str = ""
    location: str = ""
    native: str = ""
    tvm_ffi: str = ""
    nvcc: str = ""
    torch_version: str = ""
    known_missing: Optional[int] = None
    note: str = ""
    import_error: Optional[str] = None

    @property
    def found(self) -> bool:
        return self.kind != "absent"

    def describe(self) -> str:
        return imports.describe_install(self.kind, self.distribution, self.version, self.location,
                                        ", ".join(x for x in (self.native, self.note) if x))

    def problems(self) -> List[str]:
        """Why epmoe cannot use this DeepGEMM (empty: nothing known against it)."""
        if not self.found:
            return [f"deep_gemm is not installed; {INSTALL_HINT}"]
        out = []
        if self.known_missing:
            out.append(f"{self.distribution} {self.version}'s native module needs {self.known_missing} torch symbols "
                       f"torch {self.torch_version} lacks (read from the symbol tables); pip install "
                       "sgl-deep-gemm==0.1.2 --no-deps, or build DeepGEMM against this torch")
        if self.native == "tvm-ffi module" and not self.tvm_ffi:
            out.append("its native module is a tvm-ffi module and apache-tvm-ffi is not installed; pip install apache-tvm-ffi")
        if not self.nvcc:
            out.append("no CUDA compiler found (DeepGEMM compiles its kernels at run time): set CUDA_HOME or put nvcc "
                       "on PATH (or DG_JIT_USE_NVRTC=1 with NVRTC installed)")
        if self.import_error:
            out.append(f"import deep_gemm failed: {self.import_error}")
        return out


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or ""


def probe(torch_version: Optional[str] = None) -> DeepGEMMInstall:
    """What is installed, from metadata and sources only (deep_gemm is not imported)."""
    import torch

    torch_version = torch.__version__ if torch_version is None else torch_version
    package_dir = imports.package_dir(MODULE)
    if package_dir is None:
        return DeepGEMMInstall("absent", torch_version=torch_version)
    try:
        with open(os.path.join(package_dir, "__init__.py"), encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return DeepGEMMInstall("absent", torch_version=torch_version)
    native = "tvm-ffi module" if "import tvm_ffi" in source else "torch extension"
    owners, note = imports.owning_distributions(MODULE, package_dir)
    name = (owners[0].metadata["Name"] or MODULE) if owners else ""
    version = owners[0].version if owners else ""
    kind = ("pypi" if imports.same_name(name, PYPI_DIST) else "source") if owners else "unpackaged"
    return DeepGEMMInstall(
        kind, distribution=name, version=version, location=package_dir, native=native,
        tvm_ffi=imports.dist_version("apache-tvm-ffi"), nvcc=_nvcc(), torch_version=torch_version,
        known_missing=KNOWN_MISSING.get((version, imports.torch_minor(torch_version))) if kind == "pypi" else None,
        note=note,
    )


def import_check(timeout_s: float = 180.0) -> str:
    return imports.import_in_child(MODULE, timeout_s)
