"""Process-group helpers that keep ranks in agreement, so that no rank is left waiting in a
collective while another raised.

A `group` of None means: the default (world) group if torch.distributed is initialised, else a
single process (rank 0 of 1) and every collective is a no-op.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import pickle

import torch
import torch.distributed as dist

from epmoe.core.errors import ConfigMismatchError, PeerInputError
from epmoe.core.fault import run_collective


def is_distributed(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized() and group_size(group) > 1


def group_rank(group: Any = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def group_size(group: Any = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def global_rank(group: Any, rank_in_group: int) -> int:
    """The world rank of `rank_in_group` (for messages that name ranks)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def collective_device(group: Any = None) -> torch.device:
    """Where small control tensors must live for this group's backend (NCCL: the current GPU)."""
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend(group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group: Any = None, timeout_s: Optional[float] = None) -> None:
    """A barrier whose failures are classified like every other collective (PeerLostError,
    CollectiveTimeoutError after `timeout_s` on gloo)."""
    if is_distributed(group):
        run_collective(lambda: dist.barrier(group=group, async_op=True), timeout_s, "barrier")


def _all_gather(src: torch.Tensor, group: Any, timeout_s: Optional[float], what: str) -> List[torch.Tensor]:
    parts = [torch.empty_like(src) for _ in range(group_size(group))]
    # list form: the same call on torch 2.8 .. 2.13, gloo and NCCL
    run_collective(lambda: dist.all_gather(parts, src, group=group, async_op=True), timeout_s, what)
    return parts


def all_gather_objects(obj: Any, group: Any = None, timeout_s: Optional[float] = None) -> List[Any]:
    """All-gather picklable objects (with an optional timeout on gloo, unlike dist.all_gather_object)."""
    if not is_distributed(group):
        return [obj]
    data = pickle.dumps(obj)
    sizes = gather_ints([len(data)], group, timeout_s)[:, 0].tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = _all_gather(buf.to(collective_device(group)), group, timeout_s, "all_gather of objects")
    return [pickle.loads(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]


def gather_ints(values: Sequence[int], group: Any = None, timeout_s: Optional[float] = None) -> torch.Tensor:
    """All-gather a few ints from every rank -> int64 CPU tensor [group_size, len(values)]."""
    local = torch.tensor(list(values), dtype=torch.int64)
    if not is_distributed(group):
        return local.unsqueeze(0)
    parts = _all_gather(local.to(collective_device(group)), group, timeout_s, "all_gather of ints")
    return torch.stack(parts).cpu()


def agree_fingerprint(
    fingerprint: Dict[str, str], group: Any = None, what: str = "EPMoE", timeout_s: Optional[float] = None
) -> None:
    """Compare `fingerprint` (field -> value) across the group; on any difference raise
    ConfigMismatchError on EVERY rank, naming the fields, their values and the ranks."""
    gathered = all_gather_objects(dict(fingerprint), group, timeout_s)
    if len(gathered) <= 1:
        return
    fields = sorted(set().union(*(g.keys() for g in gathered)))
    diffs = []
    for f in fields:
        values = [g.get(f, "<missing>") for g in gathered]
        if len(set(values)) > 1:
            by_value: Dict[str, List[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(v, []).append(global_rank(group, r))
            parts = "; ".join(f"ranks {rs}: {v}" for v, rs in by_value.items())
            diffs.append(f"{f} differs ({parts})")
    if diffs:
        raise ConfigMismatchError(
            f"{what} was constructed with different settings on the ranks of its group: "
            + " | ".join(diffs)
            + ". Build it with the same config, dispatcher and quant plan on every rank."
        )


def raise_if_any_failed(
    local_error: Optional[BaseException], failed_ranks: Sequence[int], group: Any = None,
    timeout_s: Optional[float] = None,
) -> None:
    """Called by every rank after an agreement collective that told each rank which ranks failed.

    A failing rank re-raises its own error; the others raise RemoteRankError naming the
    failing ranks and their messages (gathered here, so every rank calls this collectively)."""
    if not failed_ranks:
        return
    messages = all_gather_objects(
        None if local_error is None else f"{type(local_error).__name__}: {local_error}", group, timeout_s
    )
    if local_error is not None:
        raise local_error
    detail = "; ".join(f"rank {global_rank(group, r)}: {messages[r]}" for r in failed_ranks)
    raise PeerInputError(
        f"another rank of the EP group was given invalid input, so this rank stops too ({detail})"
    )
