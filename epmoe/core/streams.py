"""CUDA stream state a backend asks before it syncs with the host."""

from __future__ import annotations

import torch


def capturing(device) -> bool:
    """Is the current stream of `device` capturing a CUDA graph (where a host sync is an error)? False
    off CUDA (CPU builds have no capture state to ask)."""
    return getattr(device, "type", None) == "cuda" and torch.cuda.is_current_stream_capturing()
