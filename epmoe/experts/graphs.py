"""CUDA-graph replay of an experts backend's forward for a fixed row count (decode).

    graph = CapturedExperts(experts, max_rows=256, top_k=8)     # warms up, then captures
    out = graph(tokens)                                          # tokens.num_tokens <= max_rows

Works for any backend whose flat forward has no host sync and fixed shapes for a fixed N (`triton`,
`grouped_mm`). Rows past the caller's n get topk_ids -1 (no local expert), so they take no GEMM
work and come out as zeros. The returned tensor is a view of the graph's static output: valid until
the next replay (clone it to keep it). Weights must be reloaded in place (both backends do), so a
reload does not invalidate the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from epmoe.quant.payload import QuantizedActivation


@dataclass(frozen=True)
class _StaticTokens:
    """The flat-layout fields of `DispatchedTokens` (experts/ does not import dispatch/)."""

    hidden: Any
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    layout: str = "flat"
    expert_counts: Any = None
    static: bool = True  # fixed row count, padding rows have ids -1

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]


class CapturedExperts:
    def __init__(self, experts, max_rows: int, top_k: int, warmup: int = 2, pool=None):
        if max_rows <= 0:
            raise ValueError(f"max_rows must be positive, got {max_rows}")
        cfg = experts.config
        device = torch.device(getattr(experts, "device", experts.spec.device))
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the experts run on {device}")
        self.experts = experts
        self.max_rows = max_rows
        self.top_k = top_k
        fmt = experts.payload_format
        H = cfg.hidden_size
        if fmt.is_quantized:
            self.hidden = QuantizedActivation(
                fmt,
                torch.zeros(max_rows, H // fmt.values_per_element, dtype=fmt.dtype, device=device),
                torch.ones(max_rows, -(-H // fmt.block_size), dtype=fmt.scale_dtype, device=device),
                H,
            )
        else:
            self.hidden = torch.zeros(max_rows, H, dtype=fmt.dtype, device=device)
        self.topk_ids = torch.full((max_rows, top_k), -1, dtype=torch.int32, device=device)
        self.topk_weights = torch.zeros(max_rows, top_k, dtype=torch.float32, device=device)
        tokens = self._tokens()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):  # compiles kernels and settles the allocator outside capture
                experts(tokens)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = experts(tokens)

    def _tokens(self) -> "_StaticTokens":
        return _StaticTokens(self.hidden, self.topk_ids, self.topk_weights)

    def __call__(self, tokens) -> torch.Tensor:
        n = tokens.num_tokens
        if n > self.max_rows:
            raise ValueError(f"{n} rows exceed the captured max_rows={self.max_rows}; capture a larger graph")
        if tokens.topk_ids.shape[1] != self.top_k:
            raise ValueError(f"topk_ids has {tokens.topk_ids.shape[1]} slots; the graph was captured for {self.top_k}")
        src = tokens.hidden
        if isinstance(self.hidden, QuantizedActivation):
            if not isinstance(src, QuantizedActivation):
                raise TypeError("this graph takes a quantized payload; got a dense tensor")
            self.hidden.data[:n].copy_(src.data)
            self.hidden.scales[:n].copy_(src.scales)
        else:
            self.hidden[:n].copy_(src)
        self.topk_ids[:n].copy_(tokens.topk_ids)
        self.topk_ids[n:].fill_(-1)
        self.topk_weights[:n].copy_(tokens.topk_weights)
        self.graph.replay()
        return self.out[:n]

    def replay(self) -> Optional[torch.Tensor]:
        """Replay with the inputs already in the static buffers (benchmarks)."""
        self.graph.replay()
        return self.out
