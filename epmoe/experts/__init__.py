"""Experts backends: run the local experts on dispatched tokens.

One module per kernel family (`reference`, `triton`, `flashinfer_cutlass`, ...). Registered by name,
imported only when constructed. Never imports `epmoe.dispatch`.
"""

from epmoe.core.registry import Registry
from epmoe.experts.base import Experts, ExpertsOptions, ExpertsSpec

EXPERTS: "Registry[Experts]" = Registry("experts backend")
EXPERTS.register("reference", "epmoe.experts.reference:ReferenceExperts")
EXPERTS.register("masked_reference", "epmoe.experts.masked:MaskedReferenceExperts")
EXPERTS.register("flashinfer_cutlass", "epmoe.experts.flashinfer_cutlass:FlashInferCutlassExperts")
EXPERTS.register("flashinfer_cutedsl", "epmoe.experts.flashinfer_sm100:FlashInferCuteDslExperts")
EXPERTS.register("flashinfer_trtllm", "epmoe.experts.flashinfer_sm100:FlashInferTrtllmExperts")
EXPERTS.register("triton", "epmoe.experts.triton.triton_experts:TritonExperts")
EXPERTS.register("grouped_mm", "epmoe.experts.triton.grouped_mm:GroupedMMExperts")
EXPERTS.register("deepgemm", "epmoe.experts.deepgemm.backend:DeepGEMMExperts")


def get_experts_class(name: str):
    return EXPERTS.get(name)


__all__ = ["EXPERTS", "Experts", "ExpertsOptions", "ExpertsSpec", "get_experts_class"]
