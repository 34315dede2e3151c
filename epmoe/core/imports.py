"""Importing an optional native package in a child process: its import-time side effects (JIT set-up,
NCCL checks) and a crash or an undefined symbol stay in the child, and the error comes back in one line;
and finding such a package's installation (directory, owning distribution, what it shadows) without
importing it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from typing import List, Optional, Tuple


def import_in_child(module: str, timeout_s: float = 180.0) -> str:
    """Import `module` in a child process (same interpreter and sys.path): "" when it imports, else its
    error in one line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                           timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"the import did not finish within {timeout_s:g} s"
    except OSError as e:
        return f"could not start {sys.executable} ({e})"
    if r.returncode == 0:
        return ""
    if r.returncode < 0:
        return f"the importing process died of signal {-r.returncode}"
    lines = [line.strip() for line in r.stderr.splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit code {r.returncode}")[:400]


# ---------------------------------------------------------------------------- finding an installation
# What `--doctor` reads about an optional native package (DeepEP, DeepGEMM) without importing it.

def is_installed(module: str) -> bool:
    """Can `module` be imported (found on sys.path; nothing is imported)?"""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def package_dir(module: str) -> Optional[str]:
    """The real path of the package directory `import module` would load, or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def owning_distributions(module: str, where: str) -> Tuple[List[importlib.metadata.Distribution], str]:
    """(distributions whose files hold the package at `where`, a note naming the others that ship a
    `module` package somewhere else, which the one on sys.path shadows: "" when there are none)."""
    owners, elsewhere = [], []
    for name in dict.fromkeys(importlib.metadata.packages_distributions().get(module, [])):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        init = os.path.realpath(str(dist.locate_file(os.path.join(module, "__init__.py"))))
        if os.path.dirname(init) == where:
            owners.append(dist)
        else:
            elsewhere.append(f"{dist.metadata['Name']} {dist.version}")
    return owners, f"shadows {', '.join(elsewhere)} installed elsewhere" if elsewhere else ""


def dist_version(name: str) -> str:
    """The installed version of distribution `name`, "" when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def same_name(a: str, b: str) -> bool:
    """Distribution names compared as pip does (case, '-', '_' and '.' alike)."""
    norm = lambda s: s.lower().replace("_", "-").replace(".", "-")  # noqa: E731
    return norm(a) == norm(b)


def torch_minor(torch_version: str) -> str:
    """"2.11.0+cu130" -> "2.11"."""
    return ".".join(torch_version.split("+")[0].split(".")[:2])


def describe_install(kind: str, distribution: str, version: str, location: str, extra: str = "") -> str:
    """One line: which installation (kind "pypi", "source", "unpackaged" or "absent") and where."""
    if kind == "absent":
        return "not installed"
    what = {"pypi": f"PyPI {distribution} {version}", "source": f"source build, distribution {distribution} {version}",
            "unpackaged": "unpackaged (no distribution metadata)"}[kind]
    return f"{what} at {location}" + (f" ({extra})" if extra else "")
