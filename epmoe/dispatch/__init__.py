"""Dispatchers: move routed tokens to the ranks owning their experts and back.

One module per backend (`torch_a2a`, `flashinfer_a2a`, `deepep`) plus `reference` (a pure-torch,
single-process oracle). Backends are registered by name and imported only when constructed.
Never imports `epmoe.experts`.
"""

from epmoe.core.registry import Registry
from epmoe.dispatch.base import (
    Agreement,
    DispatchedTokens,
    DispatchHandle,
    Dispatcher,
    DispatcherStats,
    DispatchSpec,
)

DISPATCHERS: "Registry[Dispatcher]" = Registry("dispatcher")
DISPATCHERS.register("torch", "epmoe.dispatch.torch_a2a:TorchA2ADispatcher")
DISPATCHERS.register("flashinfer", "epmoe.dispatch.flashinfer_a2a:FlashInferA2ADispatcher")
DISPATCHERS.register("deepep", "epmoe.dispatch.deepep:DeepEPDispatcher")
DISPATCHERS.register("deepep_ll", "epmoe.dispatch.deepep:DeepEPLowLatencyDispatcher")


def get_dispatcher_class(name: str):
    return DISPATCHERS.get(name)


__all__ = [
    "Agreement",
    "DISPATCHERS",
    "DispatchSpec",
    "DispatchedTokens",
    "DispatchHandle",
    "Dispatcher",
    "DispatcherStats",
    "get_dispatcher_class",
]
