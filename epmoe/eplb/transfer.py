"""Moving expert weights between ranks for a new placement, as stored (quantized data with its scales).

    moves = schedule_moves(old, new)                       # the same list on every rank
    rounds = schedule_rounds(moves, slot_bytes, staging)   # remote moves grouped into bounded rounds
    staged = fetch_slots(tensors, moves, rounds, ...)      # new rows of this rank's changed slots
    ... every rank agrees ..., then commit_slots(tensors, staged) copies them in place

Only slots whose expert changes move. A slot whose new expert already sits on its rank is copied
locally; otherwise one rank holding the expert under the old placement sends it (the holder with the
fewest sends so far). Each round is one all_to_all of a staging buffer that holds, per peer, a 16-byte
header (this rank's status) and at most `staging_bytes` of weights in all. A rank that fails (packing,
unpacking, out of memory) keeps joining the rounds with its header saying so, so every rank learns it
from the same round and stops after it; nothing waits. Nothing live is written here: `fetch_slots`
fills new buffers, and `commit_slots` runs only after every rank agreed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from epmoe.core import dist as edist
from epmoe.core.fault import run_collective
from epmoe.core.placement import Placement

HEADER = 16  # bytes per peer per round: the sender's status (int64) and padding
ALIGN = 16  # every tensor piece starts 16-byte aligned in the staging buffer (dtype views need it)


@dataclass(frozen=True)
class SlotMove:
    """Slot `slot` (global) receives `expert` from global slot `source` (on another rank or its own)."""

    slot: int
    expert: int
    source: int


def schedule_moves(old: Placement, new: Placement) -> List[SlotMove]:
    """One move per changed slot, in slot order; identical on every rank (pure)."""
    per = old.slots_per_rank
    sends = [0] * old.ep_size
    moves = []
    for s in old.changed_slots(new):
        e = new.slot_to_expert[s]
        holders = old.replicas(e)
        local = [h for h in holders if h // per == s // per]
        if local:
            src = local[0]
        else:
            src = min(holders, key=lambda h: (sends[h // per], h))
            sends[src // per] += 1
        moves.append(SlotMove(s, e, src))
    return moves


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_bytes(tensors: Dict[str, torch.Tensor]) -> int:
    """Staging bytes of one slot: every tensor's row, each padded to ALIGN."""
    return sum(_padded(t[0].numel() * t.element_size()) for t in tensors.values())


def schedule_rounds(moves: Sequence[SlotMove], per: int, ep: int, nbytes: int, staging_bytes: int
                    ) -> List[List[SlotMove]]:
    """Remote moves in rounds: in each, every rank sends and receives at most `staging_bytes`
    (at least one move per round, hence the check that one slot fits)."""
    if nbytes > staging_bytes:
        raise ValueError(
            f"one expert's weights take {nbytes} bytes but the staging buffer holds {staging_bytes}; raise "
            f"EPLBConfig.staging_bytes to at least {nbytes}")
    todo = [m for m in moves if m.source // per != m.slot // per]
    rounds = []
    while todo:
        sent, got = [0] * ep, [0] * ep
        this, rest = [], []
        for m in todo:
            a, b = m.source // per, m.slot // per
            if sent[a] + nbytes <= staging_bytes and got[b] + nbytes <= staging_bytes:
                sent[a] += nbytes
                got[b] += nbytes
                this.append(m)
            else:
                rest.append(m)
        rounds.append(this)
        todo = rest
    return rounds


@dataclass
class StagedSlots:
    """The new rows of this rank's changed slots: local slot index -> name -> row (not yet live)."""

    rows: Dict[int, Dict[str, torch.Tensor]]
    bytes_received: int = 0


def _pack_row(buf: torch.Tensor, off: int, t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    buf[off:off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=False)
    return off + _padded(n)


def _unpack_row(buf: torch.Tensor, off: int, like: torch.Tensor, device) -> Tuple[torch.Tensor, int]:
    n = like.numel() * like.element_size()
    piece = buf[off:off + n].view(like.dtype).reshape(like.shape).to(device, copy=True)
    return piece, off + _padded(n)


def _starts(splits: Sequence[int]) -> List[int]:
    """Offsets of the peers' parts of a staging buffer (each: HEADER, then its rows)."""
    out, at = [], 0
    for n in splits:
        out.append(at)
        at += n
    return out


def _walk(splits: Sequence[int], moves_by_peer: Sequence[Sequence[SlotMove]], each) -> Optional[BaseException]:
    """Call each(move, offset) -> next offset for every peer's moves, laid out after that peer's header;
    the first exception is returned, not raised (it travels in the next header)."""
    try:
        for at, moves in zip(_starts(splits), moves_by_peer):
            at += HEADER
            for m in moves:
                at = each(m, at)
    except Exception as e:  # noqa: BLE001 - any failure on one rank becomes every rank's error
        return e
    return None


def fetch_slots(
    tensors: Dict[str, torch.Tensor], moves: Sequence[SlotMove], rounds: Sequence[Sequence[SlotMove]],
    placement: Placement, ep_rank: int, group: Any, timeout_s: Optional[float],
) -> Tuple[StagedSlots, Optional[BaseException]]:
    """Collective: every rank calls it with the same moves and rounds (`schedule_rounds`, which bounds
    the staging buffers). `tensors`: name -> [S_local, ...] live rows (read only). Returns this rank's staged rows and its own error (None when it
    succeeded); a failure reported by another rank's header ends the rounds early on every rank. The
    caller agrees on the outcome across ranks before committing."""
    per, ep = placement.slots_per_rank, placement.ep_size
    mine = range(ep_rank * per, (ep_rank + 1) * per)
    staged = StagedSlots(rows={})
    error: Optional[BaseException] = None
    any_device = next(iter(tensors.values())).device
    try:
        for m in moves:  # local copies first: they read the old rows before anything changes
            if m.slot in mine and m.source in mine:
                staged.rows[m.slot - mine.start] = {n: t[m.source - mine.start].clone() for n, t in tensors.items()}
    except Exception as e:  # noqa: BLE001 - reported to every rank through the first round's header
        error = e
    distributed = edist.is_distributed(group)
    if not distributed or not rounds:
        return staged, error
    stage_dev = edist.collective_device(group)
    row_bytes = slot_bytes(tensors)
    most = max(max(sum(row_bytes for m in r if m.source // per == q) for q in range(ep)) for r in rounds)
    most_in = max(max(sum(row_bytes for m in r if m.slot // per == q) for q in range(ep)) for r in rounds)
    send = torch.zeros(ep * HEADER + most, dtype=torch.uint8, device=stage_dev)
    recv = torch.zeros(ep * HEADER + most_in, dtype=torch.uint8, device=stage_dev)
    for r in rounds:
        out_moves = [[m for m in r if m.source in mine and m.slot // per == q] for q in range(ep)]
        in_moves = [[m for m in r if m.slot in mine and m.source // per == q] for q in range(ep)]
        in_splits = [HEADER + row_bytes * len(ms) for ms in out_moves]
        out_splits = [HEADER + row_bytes * len(ms) for ms in in_moves]

        def pack(m, at):
            for t in tensors.values():
                at = _pack_row(send, at, t[m.source - mine.start])
            return at

        def unpack(m, at):
            row = {}
            for n, t in tensors.items():
                row[n], at = _unpack_row(recv, at, t[0], any_device)
            staged.rows[m.slot - mine.start] = row
            staged.bytes_received += row_bytes
            return at

        if error is None:
            error = _walk(in_splits, out_moves, pack)
        status = torch.tensor([0 if error is None else 1], dtype=torch.int64).view(torch.uint8)
        for at in _starts(in_splits):  # every peer's header: this rank's status after packing
            send[at:at + 8].copy_(status)
        run_collective(
            lambda: dist.all_to_all_single(recv[:sum(out_splits)], send[:sum(in_splits)], out_splits, in_splits,
                                           group=group, async_op=True),
            timeout_s, "expert weights transfer (rebalance)")
        if any(bool(recv[at:at + 8].view(torch.int64).item()) for at in _starts(out_splits)):
            break  # every rank saw the same headers: all stop after this round
        if error is None:  # a failure here reaches the others in the next round or the final agreement
            error = _walk(out_splits, in_moves, unpack)
    return staged, error


def commit_slots(tensors: Dict[str, torch.Tensor], staged: StagedSlots) -> None:
    """Copy the staged rows into the live tensors (in place: storage and captured CUDA graphs stay valid)."""
    for i, row in sorted(staged.rows.items()):
        for n, t in tensors.items():
            t[i].copy_(row[n])


def moved_bytes(moves: Sequence[SlotMove], per: int, nbytes: int) -> int:
    """Bytes sent between ranks (local copies not counted)."""
    return nbytes * sum(1 for m in moves if m.source // per != m.slot // per)

