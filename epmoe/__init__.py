"""epmoe — an expert-parallel Mixture-of-Experts inference runtime built around its all-to-all dispatcher.

Import direction (one way; nothing imports upwards):

    nightly -> launch -> layer, resolve -> {eplb, dispatch, experts} -> quant -> core (epmoe.core, epmoe.config)
    integrations (epmoe.integrations.transformers: transformers models) -> layer

`dispatch` and `experts` never import each other: the experts backend declares the
`PayloadFormat` it consumes and the layer hands that to the dispatcher. Optional packages
(flashinfer, deep_ep, mpi4py, triton) are imported only when a backend that needs them is built;
transformers only by `epmoe.integrations.transformers`.

Public API:
    MoEConfig                   shape and math of a layer (epmoe.config)
    EPMoE, MoEOutput, StepStats the layer (epmoe.layer)
    TrainingConfig              how a layer trains: gradients through the layer (docs/training.md)
    Placement, EPLBConfig       where experts live; load balancing (epmoe.core.placement, epmoe.eplb)
    Routing, route              top-k routing (epmoe.routing)
    ExpertWeights               canonical expert tensors (epmoe.quant.weights)
    QuantPlan                   the one resolved plan per model (epmoe.quant.plan)
    resolve_plan                the one resolver: asks the backend classes (epmoe.resolve)
    reference_moe               dense float64 reference (epmoe.reference)
    load_expert_weights         checkpoint loading (epmoe.checkpoint)
"""

import os as _os
import sys as _sys


def _run_as_launcher() -> bool:
    argv = list(getattr(_sys, "orig_argv", ()))
    return any(a == "-m" and b in ("epmoe.launch", "epmoe.launch.cli") for a, b in zip(argv, argv[1:])) or (
        len(argv) > 1 and _os.path.basename(argv[1]) == "epmoe-launch")


if _run_as_launcher():
    # The launcher reports faults itself (one fault report per rank). Without this, torch's C++ logging
    # prints a ~45-frame stack dump for every failed call to a store whose host rank died; it is read
    # once, when torch is first imported, hence here. An explicit setting wins.
    _os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from epmoe.checkpoint import load_expert_weights
from epmoe.config import MoEConfig
from epmoe.core.placement import Placement
from epmoe.eplb.config import EPLBConfig
from epmoe.layer import EPMoE, MoEOutput, StepStats, TrainingConfig
from epmoe.quant.plan import QuantPlan
from epmoe.quant.weights import ExpertWeights
from epmoe.reference import reference_moe
from epmoe.resolve import resolve_plan, resolve_quant_plan
from epmoe.routing import Routing, route

__version__ = "0.1.0"

__all__ = [
    "EPLBConfig",
    "EPMoE",
    "ExpertWeights",
    "MoEConfig",
    "MoEOutput",
    "Placement",
    "QuantPlan",
    "Routing",
    "StepStats",
    "TrainingConfig",
    "load_expert_weights",
    "reference_moe",
    "resolve_plan",
    "resolve_quant_plan",
    "route",
]
