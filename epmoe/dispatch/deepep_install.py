"""Which DeepEP is installed and whether epmoe can use it, found without importing it (`--doctor`).

DeepEP comes two ways (docs/deepep.md):
  * PyPI `sgl-deep-ep`: SGLang's binary wheels (`import deep_ep`; CUDA 13; one wheel per CPython;
    pinned to one torch release by its `Requires-Dist`; the V1 `Buffer` and the V2 elastic buffers).
  * a source build of DeepEP V1 (`python setup.py install` / `pip install .`: distribution `deep_ep`),
    or its build directory on PYTHONPATH (no distribution at all).

`probe()` reads the distribution metadata, the torch pin, the CUDA major the wheel was built for and
the `deep_ep.Buffer` class in the package's Python sources (`ast`, never executed), so it runs on any
host. Importing deep_ep initialises its native runtime (NCCL checks, JIT) and a binary built for
another torch fails there with an undefined symbol: `import_check()` does it in a child process and
gives the error in one line.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from epmoe.core import imports

MODULE = "deep_ep"
PYPI_DIST = "sgl-deep-ep"
# What epmoe.dispatch.deepep calls on deep_ep.Buffer (V1 API), and the constructor keywords it passes.
V1_BUFFER_METHODS = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
                     "destroy")
V1_BUFFER_INIT_ARGS = ("num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                       "allow_nvlink_for_low_latency_mode", "explicitly_destroy")
INSTALL_HINT = ("pip install 'epmoe[deepep]' (sgl-deep-ep: CUDA 13 wheels for the one torch release each pins), "
                "or build DeepEP V1 from source against your torch (docs/deepep.md)")
SOURCE_BUILD = "bash scripts/build_deepep.sh (DeepEP V1 built against this torch, docs/deepep.md)"
# (sgl-deep-ep version, torch minor) -> torch symbols its native module needs that this torch lacks: read
# from the wheels' undefined symbols against torch 2.11.0+cu130's exported ones (no run). Every release
# misses some, so on torch 2.11 the source build is the way.
KNOWN_MISSING: Dict[Tuple[str, str], int] = {
    ("0.1.0", "2.11"): 1, ("0.1.1", "2.11"): 2, ("0.1.2", "2.11"): 2, ("0.1.2.post1", "2.11"): 2,
}
# torch minors on which every release checked misses symbols
NO_WHEEL_FITS = {m for _, m in KNOWN_MISSING if all(n for (_, m2), n in KNOWN_MISSING.items() if m2 == m)}


def install_hint(torch_version: str = "") -> str:
    """How to get a DeepEP epmoe can use with this torch."""
    if imports.torch_minor(torch_version) in NO_WHEEL_FITS:
        return (f"no sgl-deep-ep release loads on torch {torch_version} (each needs torch symbols it lacks); "
                f"{SOURCE_BUILD}")
    return INSTALL_HINT


@dataclass(frozen=True)
class DeepEPInstall:
    """kind: "pypi" (sgl-deep-ep), "source" (a source build's distribution), "unpackaged" (a deep_ep
    directory on sys.path without distribution metadata) or "absent". v1_api / torch_ok / cuda_ok:
    None when it could not be told. import_error: None = not tried, "" = imported fine."""

    kind: str
    distribution: str = ""
    version: str = ""
    location: str = ""
    note: str = ""
    v1_api: Optional[bool] = None
    v1_detail: str = ""
    torch_requirement: str = ""
    torch_version: str = ""
    torch_ok: Optional[bool] = None
    cuda_major: Optional[int] = None  # the CUDA major a wheel was built for (its _build_info.py)
    torch_cuda: Optional[str] = None
    cuda_ok: Optional[bool] = None
    known_missing: Optional[int] = None  # torch symbols the wheel's module lacks here (KNOWN_MISSING; None = not checked)
    import_error: Optional[str] = None

    @property
    def found(self) -> bool:
        return self.kind != "absent"

    def describe(self) -> str:
        return imports.describe_install(self.kind, self.distribution, self.version, self.location, self.note)

    def problems(self) -> List[str]:
        """Why epmoe cannot use this DeepEP (empty: nothing known against it)."""
        out = []
        if not self.found:
            return [f"deep_ep is not installed; {install_hint(self.torch_version)}"]
        if self.v1_api is False:
            out.append(f"no usable V1 API: {self.v1_detail}; epmoe drives deep_ep.Buffer (DeepEP V1)")
        if self.known_missing:
            out.append(f"{self.distribution} {self.version}'s native module needs {self.known_missing} torch symbol(s) "
                       f"torch {self.torch_version} lacks (read from the symbol tables; no sgl-deep-ep release loads "
                       f"on this torch); {SOURCE_BUILD}")
        elif self.torch_ok is False:
            out.append(f"{self.distribution} {self.version} is built for {self.torch_requirement}, this torch is "
                       f"{self.torch_version} (its import fails, usually with an undefined symbol); install that "
                       f"torch, or {SOURCE_BUILD}")
        if self.cuda_ok is False:
            out.append(f"{self.distribution} {self.version} is built for CUDA {self.cuda_major}, this torch for CUDA "
                       f"{self.torch_cuda or 'none (CPU build)'}; install a torch built with CUDA {self.cuda_major}")
        if self.import_error:
            out.append(f"import deep_ep failed: {self.import_error}")
        return out


def _torch_requirement(dist: importlib.metadata.Distribution) -> str:
    from packaging.requirements import InvalidRequirement, Requirement

    for text in dist.requires or ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if imports.same_name(req.name, "torch") and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return f"torch{req.specifier}" if str(req.specifier) else ""
    return ""


def _torch_matches(requirement: str, torch_version: str) -> Optional[bool]:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    try:
        return Requirement(requirement).specifier.contains(Version(torch_version), prereleases=True)
    except InvalidVersion:
        return None


def _classes(path: str) -> Dict[str, ast.ClassDef]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return {}
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _exports_buffer(package_dir: str) -> bool:
    try:
        with open(os.path.join(package_dir, "__init__.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == "Buffer" for a in node.names):
            return True
        if isinstance(node, ast.ClassDef) and node.name == "Buffer":
            return True
    return False


def v1_api(package_dir: str) -> Tuple[Optional[bool], str]:
    """Is DeepEP V1's `deep_ep.Buffer`, with what epmoe calls, in the package's Python sources?"""
    found = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__")) and d != "include"]
        for name in sorted(files):
            if name.endswith(".py"):
                cls = _classes(os.path.join(root, name)).get("Buffer")
                if cls is not None:
                    found.append((os.path.relpath(os.path.join(root, name), os.path.dirname(package_dir)), cls))
    if not found:
        return False, "no class Buffer in the package's Python sources (a V2-only DeepEP has ElasticBuffer only)"
    where, cls = found[0]
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    missing = [m for m in V1_BUFFER_METHODS if m not in methods]
    init = methods.get("__init__")
    params = {a.arg for a in (init.args.args + init.args.kwonlyargs)} if init is not None else set()
    missing_args = [a for a in V1_BUFFER_INIT_ARGS if a not in params]
    if missing or missing_args:
        what = [f"methods {missing}" if missing else "", f"constructor arguments {missing_args}" if missing_args else ""]
        return False, f"Buffer in {where} lacks " + " and ".join(w for w in what if w)
    if not _exports_buffer(package_dir):
        return False, f"Buffer is defined in {where} but deep_ep/__init__.py does not export it"
    return True, f"deep_ep.Buffer ({where}) has {', '.join(V1_BUFFER_METHODS)}"


def _wheel_cuda_major(package_dir: str) -> Optional[int]:
    """EXPECTED_CUDA_MAJOR of sgl-deep-ep's _build_info.py (read, not imported)."""
    try:
        with open(os.path.join(package_dir, "_build_info.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EXPECTED_CUDA_MAJOR" for t in node.targets):
            value = node.value
            return value.value if isinstance(value, ast.Constant) and isinstance(value.value, int) else None
    return None


def probe(torch_version: Optional[str] = None, torch_cuda: Optional[str] = "") -> DeepEPInstall:
    """What is installed, from metadata and sources only (deep_ep is not imported)."""
    import torch

    torch_version = torch.__version__ if torch_version is None else torch_version
    torch_cuda = torch.version.cuda if torch_cuda == "" else torch_cuda
    package_dir = imports.package_dir(MODULE)
    if package_dir is None:
        return DeepEPInstall("absent", torch_version=torch_version, torch_cuda=torch_cuda)
    owners, note = imports.owning_distributions(MODULE, package_dir)
    ok, detail = v1_api(package_dir)
    base = dict(location=package_dir, note=note, v1_api=ok, v1_detail=detail, torch_version=torch_version,
                torch_cuda=torch_cuda)
    if not owners:
        return DeepEPInstall("unpackaged", **base)
    dist = owners[0]
    name = dist.metadata["Name"] or MODULE
    kind = "pypi" if imports.same_name(name, PYPI_DIST) else "source"
    req = _torch_requirement(dist)
    cuda_major = _wheel_cuda_major(package_dir)
    cuda_ok = None
    if cuda_major is not None:
        cuda_ok = bool(torch_cuda) and str(torch_cuda).split(".")[0] == str(cuda_major)
    missing = KNOWN_MISSING.get((dist.version, imports.torch_minor(torch_version))) if kind == "pypi" else None
    return DeepEPInstall(kind, distribution=name, version=dist.version, torch_requirement=req,
                         torch_ok=_torch_matches(req, torch_version) if req else None, cuda_major=cuda_major,
                         cuda_ok=cuda_ok, known_missing=missing, **base)


def import_check(timeout_s: float = 180.0) -> str:
    """Import deep_ep in a child process: "" when it imports, else its error in one line. The child absorbs
    the import's side effects (NCCL checks, JIT set-up, NVSHMEM environment) and any crash."""
    return imports.import_in_child(MODULE, timeout_s)
