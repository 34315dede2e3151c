"""Markers: `gpu`, `multigpu(n)`, `requires_flashinfer`, `requires_deepep` auto-skip where the
machine lacks what they need, with the reason in the skip message."""

import importlib.util

import pytest
import torch


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    n_gpu = _gpu_count()
    for item in items:
        if item.get_closest_marker("gpu") and n_gpu == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        m = item.get_closest_marker("multigpu")
        if m:
            need = m.args[0] if m.args else 2
            if n_gpu < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs, found {n_gpu}"))
        if item.get_closest_marker("requires_flashinfer") and not _has("flashinfer"):
            item.add_marker(pytest.mark.skip(reason="flashinfer is not installed (pip install 'epmoe[gpu]')"))
        if item.get_closest_marker("requires_deepep") and not _has("deep_ep"):
            item.add_marker(pytest.mark.skip(reason="deep_ep is not installed (scripts/build_deepep.sh)"))
