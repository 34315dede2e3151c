"""Global <-> local expert ids and per-expert tensor slicing for contiguous EP placement.

Rank r of an EP group of size ep owns the global experts [r * E/ep, (r + 1) * E/ep) (E must be
divisible by ep). Expert ids are int32 with -1 = "no expert"; after mapping, ids an other rank
owns are -1 too.

Every per-expert tensor is sliced the same way, `placement.slice_per_expert(t, dim)`: weights
[E, ...], biases [E, ...], block scales [E, ...], per-expert global scales [E] / [E, 2],
per-local-expert residual scales such as Humming's x64 residuals ([E] globally -> [E_local]).
`scatter_to_global` / `gather_global` are the inverse, for reporting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Sequence, Union

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """num_experts: E (global); ep_size; ep_rank. Frozen; validated on construction."""

    num_experts: int
    ep_size: int
    ep_rank: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "ep_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ExpertPlacement.{name} must be a positive int, got {v!r}")
        if isinstance(self.ep_rank, bool) or not isinstance(self.ep_rank, int):
            raise ValueError(f"ExpertPlacement.ep_rank must be an int, got {self.ep_rank!r}")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}; choose an "
                f"EP size that divides the expert count (divisors: "
                f"{[d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]})"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} is outside [0, ep_size={self.ep_size})")

    @classmethod
    def all_ranks(cls, num_experts: int, ep_size: int) -> list:
        """The placement of every rank of the group, rank order."""
        return [cls(num_experts, ep_size, r) for r in range(ep_size)]

    # ------------------------------------------------------------------ ranges
    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    @property
    def end_local_expert(self) -> int:
        """One past the last local expert."""
        return self.first_local_expert + self.num_local_experts

    @property
    def local_range(self) -> range:
        return range(self.first_local_expert, self.end_local_expert)

    def owner_of_expert(self, expert: int) -> int:
        """Rank that owns global expert `expert` (a Python int)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert id {expert} is outside [0, num_experts={self.num_experts})")
        return expert // self.num_local_experts

    # ------------------------------------------------------------------ id maps (tensors)
    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{what} must be an integer tensor (int32), got {ids.dtype}")

    def _check_range(self, ids: torch.Tensor, upper: int, what: str) -> None:
        # One host sync; pass check=False on hot paths whose ids are known valid.
        if ids.numel() and bool(((ids < -1) | (ids >= upper)).any()):
            bad = ids[(ids < -1) | (ids >= upper)].flatten()[:5].tolist()
            raise ValueError(f"{what} contains ids outside [-1, {upper}) (e.g. {bad})")

    def is_local(self, ids: torch.Tensor) -> torch.Tensor:
        """bool tensor: global id is owned by this rank (-1 -> False)."""
        return (ids >= self.first_local_expert) & (ids < self.end_local_expert)

    def global_to_local(self, ids: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Global ids (any shape) -> int32 local ids in [0, E_local); -1 and other ranks' ids -> -1.

        check: raise ValueError for ids outside [-1, E) (one host sync; pass False on hot paths)."""
        self._check_ids(ids, "global expert ids")
        if check:
            self._check_range(ids, self.num_experts, "global expert ids")
        local = ids.to(torch.int32) - self.first_local_expert
        return torch.where(self.is_local(ids), local, torch.full_like(local, -1))

    def local_to_global(self, local_ids: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Local ids in [0, E_local) (any shape) -> int32 global ids; -1 stays -1."""
        self._check_ids(local_ids, "local expert ids")
        if check:
            self._check_range(local_ids, self.num_local_experts, "local expert ids")
        g = local_ids.to(torch.int32) + self.first_local_expert
        return torch.where(local_ids >= 0, g, torch.full_like(g, -1))

    def owner_of(self, ids: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Global ids (any shape) -> int32 owning rank; -1 -> -1."""
        self._check_ids(ids, "global expert ids")
        if check:
            self._check_range(ids, self.num_experts, "global expert ids")
        owner = torch.div(ids.to(torch.int32), self.num_local_experts, rounding_mode="floor")
        return torch.where(ids >= 0, owner, torch.full_like(owner, -1))

    # ------------------------------------------------------------------ per-expert tensors
    def slice_per_expert(self, tensor: torch.Tensor, dim: int = 0, *, name: str = "tensor") -> torch.Tensor:
        """The local experts' part of a global per-expert tensor (size num_experts along `dim`).

        A view (narrow): weights [E, ...], biases, block scales, per-expert global scales [E] /
        [E, 2], per-local-expert residual scales. ValueError names `name`, its shape and the dim."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() == 0:
            raise ValueError(f"{name} is a scalar; a per-expert tensor needs an expert dimension")
        d = dim if dim >= 0 else dim + tensor.dim()
        if not 0 <= d < tensor.dim():
            raise ValueError(f"dim={dim} is out of range for {name} of shape {list(tensor.shape)}")
        if tensor.shape[d] != self.num_experts:
            raise ValueError(
                f"{name} has {tensor.shape[d]} entries along dim {dim} (shape {list(tensor.shape)}); "
                f"a global per-expert tensor has num_experts={self.num_experts} there"
            )
        return tensor.narrow(d, self.first_local_expert, self.num_local_experts)

    def slice_tensors(self, tensors: Mapping[str, torch.Tensor], dims: Union[int, Mapping[str, int]] = 0) -> Dict[str, torch.Tensor]:
        """`slice_per_expert` for every named tensor (dims: one dim for all, or name -> dim)."""
        out = {}
        for name, t in tensors.items():
            d = dims if isinstance(dims, int) else dims.get(name, 0)
            out[name] = self.slice_per_expert(t, d, name=name)
        return out

    def scatter_to_global(self, local: torch.Tensor, dim: int = 0, fill_value: float = 0.0) -> torch.Tensor:
        """Inverse of `slice_per_expert` for reporting: a global-size tensor with this rank's slice
        filled in and `fill_value` elsewhere."""
        d = dim if dim >= 0 else dim + local.dim()
        if not 0 <= d < local.dim() or local.shape[d] != self.num_local_experts:
            raise ValueError(
                f"local tensor has shape {list(local.shape)}; expected {self.num_local_experts} "
                f"(num_local_experts) entries along dim {dim}"
            )
        shape = list(local.shape)
        shape[d] = self.num_experts
        out = torch.full(shape, fill_value, dtype=local.dtype, device=local.device)
        out.narrow(d, self.first_local_expert, self.num_local_experts).copy_(local)
        return out

    @staticmethod
    def gather_global(per_rank: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's local slice (rank order, e.g. after an all_gather) into the
        global per-expert tensor; the exact inverse of slicing on all ranks."""
        if not per_rank:
            raise ValueError("gather_global needs one local tensor per rank")
        sizes = {t.shape[dim] for t in per_rank}
        if len(sizes) != 1:
            raise ValueError(f"ranks' local tensors differ in size along dim {dim}: {sorted(sizes)}")
        return torch.cat(list(per_rank), dim=dim)
