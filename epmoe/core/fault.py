"""Fault reports: when a collective times out or a rank fails inside a layer, every rank ends with one
structured report (layer, call sequence number, phase, which rank waits on which) instead of hanging or
printing a flood of lines.

Mechanism: nothing is written on the hot path. A rank that fails inside a layer call writes its state
(call, phase, error) to the process group's key-value store and re-raises. A rank whose collective times
out writes its own state, waits a short grace period for the peers' states, reads them and raises
`CollectiveTimeoutError` carrying the `FaultReport`.

A rank stopped from outside (torchrun SIGTERMs every rank when one fails) may be blocked inside a
collective that has not failed yet: `stopped_report()` builds the report of the phase the process is in,
from another thread (the launcher's SIGTERM watcher). Entering a phase records it in one module slot.

Timeouts: on gloo every collective of a layer is waited for at most `timeout_s`. On NCCL the CPU does
not block on collectives (it would cost a host sync and break CUDA graphs): the process group's own
timeout and watchdog apply (init_process_group(timeout=...), the launcher's --timeout).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from epmoe.core.errors import RemoteRankError


class CollectiveFailure(RemoteRankError):
    """A collective of a layer did not complete. `.report` is the FaultReport (None when raised below
    a layer, before the layer added its context)."""

    def __init__(self, message: str, report: "Optional[FaultReport]" = None):
        super().__init__(message)
        self.report = report


class CollectiveTimeoutError(CollectiveFailure):
    """A collective did not complete within the timeout."""


class PeerLostError(CollectiveFailure):
    """A peer closed its connection inside a collective (it crashed or exited)."""


_LOST = ("connection closed by peer", "connection reset", "broken pipe", "connection refused")


def _classify(e: RuntimeError, timeout_s: Optional[float], what: str) -> Optional[CollectiveFailure]:
    msg = str(e).lower()
    if "timed out" in msg or "timeout" in msg:
        return CollectiveTimeoutError(f"{what} did not complete within {timeout_s:g} s" if timeout_s
                                      else f"{what} timed out")
    if any(m in msg for m in _LOST):
        return PeerLostError(f"{what}: a peer closed its connection (it crashed or exited)")
    return None


def wait_work(work: Any, timeout_s: Optional[float], what: str) -> None:
    """Wait for an async collective; on gloo with a timeout, raise CollectiveTimeoutError after it,
    PeerLostError when a peer went away."""
    if work is None:
        return
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        failure = _classify(e, timeout_s, what)
        if failure is None:
            raise
        raise failure from e


def run_collective(start: Any, timeout_s: Optional[float], what: str) -> None:
    """`start()` issues an async collective and returns its work; wait as in `wait_work`."""
    try:
        work = start()
    except RuntimeError as e:
        failure = _classify(e, timeout_s, what)
        if failure is None:
            raise
        raise failure from e
    wait_work(work, timeout_s, what)


@dataclass(frozen=True)
class RankState:
    """rank: global rank; status: "failed", "timed out", "no report" (alive elsewhere, or gone)."""

    rank: int
    status: str
    call: Optional[int] = None
    phase: Optional[str] = None
    detail: str = ""


STOPPED = "stopped by SIGTERM"  # stopped_report's state and cause
_WAITING = ("timed out", "lost a peer", STOPPED)  # states of a rank that waits on others


@dataclass(frozen=True)
class FaultReport:
    layer: str
    call: int
    phase: str
    rank: int
    timeout_s: Optional[float]
    peers: Tuple[RankState, ...]
    cause: str = "timed out"  # or "lost a peer", or STOPPED (stopped_report)

    @property
    def waiting_on(self) -> List[int]:
        """Ranks this rank waits on: those that failed, or reported no state, or are at an earlier call."""
        out = []
        for p in self.peers:
            if p.rank == self.rank:
                continue
            if p.status not in _WAITING or (p.call is not None and p.call < self.call):
                out.append(p.rank)
        return out

    def format(self) -> str:
        if self.cause == "timed out":
            what = f"timed out after {self.timeout_s:g} s" if self.timeout_s else "timed out"
        elif self.cause == "lost a peer":
            what = "lost a peer's connection"
        else:  # STOPPED
            what = f"was {self.cause} (the launcher stops every rank when one fails)"
        lines = [
            f"epmoe fault report: layer {self.layer!r}, call {self.call}, phase {self.phase!r}: rank {self.rank} "
            f"{what} waiting on ranks {self.waiting_on or 'unknown'}"
        ]
        for p in sorted(self.peers, key=lambda s: s.rank):
            where = f" in call {p.call}, phase {p.phase!r}" if p.call is not None else ""
            lines.append(f"  rank {p.rank}: {p.status}{where}{': ' + p.detail if p.detail else ''}")
        return "\n".join(lines)


_DEAD_STORES: set = set()  # ids of stores that failed once (their host rank is gone): not touched again


def _store():
    """The default group's key-value store, or None when there is none or it failed before: a store
    whose host (rank 0 under env://) died makes every further call fail and log a C++ stack dump."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: reports carry only this rank's view
        return None
    return None if id(store) in _DEAD_STORES else store


def _store_failed(store) -> None:
    _DEAD_STORES.add(id(store))


class FaultWatch:
    """One per layer. `with watch.phase("dispatch"): ...` inside a call started by `watch.next_call()`."""

    def __init__(self, layer_uid: str, group: Any, timeout_s: Optional[float]):
        self.layer_uid = layer_uid
        self.group = group
        self.timeout_s = timeout_s
        self.call = 0
        self._own: Optional[tuple] = None
        self.ranks: List[int] = []
        if dist.is_available() and dist.is_initialized():
            self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            self.rank = dist.get_rank()
            self.enforce = dist.get_backend(group) == "gloo" and timeout_s is not None
        else:
            self.rank, self.enforce = 0, False

    @property
    def collective_timeout(self) -> Optional[float]:
        """What collectives pass to `wait_work` (None: block without a timeout of ours)."""
        return self.timeout_s if self.enforce else None

    def next_call(self) -> int:
        self.call += 1
        return self.call

    def _key(self, rank: int) -> str:
        return f"epmoe/fault/{self.layer_uid}/{rank}"

    def _write(self, status: str, phase: str, detail: str, call: Optional[int] = None) -> None:
        call = self.call if call is None else call
        self._own = (status, call, phase, detail[:500])
        store = _store()
        if store is None:
            return
        try:
            store.set(self._key(self.rank), json.dumps(
                {"status": status, "call": call, "phase": phase, "detail": detail[:500]}))
        except Exception:  # noqa: BLE001 - reporting must never mask the real error
            _store_failed(store)

    def _read_peers(self, grace_s: float) -> Tuple[RankState, ...]:
        store = _store()
        states = {}
        deadline = time.monotonic() + grace_s
        while True:
            for r in self.ranks:
                if r in states or store is None:
                    continue
                try:
                    if store.check([self._key(r)]):
                        d = json.loads(store.get(self._key(r)))
                        states[r] = RankState(r, d["status"], d["call"], d["phase"], d["detail"])
                except Exception:  # noqa: BLE001 - the store's host is gone: stop asking it
                    _store_failed(store)
                    store = None
            if len(states) == len(self.ranks) or time.monotonic() >= deadline or store is None:
                break
            time.sleep(0.05)
        if self.rank not in states and self._own is not None:  # this rank's view, even without a store
            states[self.rank] = RankState(self.rank, *self._own)
        return tuple(states.get(r, RankState(r, "no report", detail="alive elsewhere or gone"))
                     for r in self.ranks)

    def report(self, status: str, phase: str, detail: str, grace_s: Optional[float] = None,
               call: Optional[int] = None, timeout_s: Optional[float] = None) -> FaultReport:
        """Write this rank's state (`status`: "timed out", "lost a peer" or STOPPED, also the report's
        cause) to the store, wait at most `grace_s` (default: a quarter of the timeout, 1 to 5 s) for the
        peers' states, and the FaultReport of them. call / timeout_s: this call's, unless given."""
        call = self.call if call is None else call
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if grace_s is None:
            grace_s = min(5.0, max(1.0, (timeout_s or 4.0) / 4))
        self._write(status, phase, detail, call=call)
        return FaultReport(self.layer_uid, call, phase, self.rank, timeout_s, self._read_peers(grace_s), cause=status)

    def phase(self, name: str) -> "_Phase":
        """Context manager for one phase of a call (a plain class: entered several times per call, so
        it costs no generator)."""
        return _Phase(self, name)

    def _failed(self, name: str, e: BaseException) -> None:
        """Called for an exception leaving phase `name`: a collective failure becomes one raised with
        its FaultReport; anything else is recorded as this rank's state (the caller re-raises it)."""
        if isinstance(e, CollectiveFailure):
            if e.report is not None:
                return
            report = self.report("lost a peer" if isinstance(e, PeerLostError) else "timed out", name, str(e))
            raise type(e)(report.format(), report) from e
        self._write("failed", name, f"{type(e).__name__}: {e}")


class _Phase:
    __slots__ = ("watch", "name", "outer")

    def __init__(self, watch: FaultWatch, name: str):
        self.watch, self.name, self.outer = watch, name, None

    def __enter__(self) -> None:
        self.outer = _ACTIVE[0]
        _ACTIVE[0] = self
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is not None:
                self.watch._failed(self.name, exc)
        finally:
            _ACTIVE[0] = self.outer
        return False


_ACTIVE: List[Optional[_Phase]] = [None]  # the innermost phase this process is in (its main thread's)


def stopped_report(grace_s: float = 1.0) -> Optional[str]:
    """The fault report of a rank stopped by SIGTERM inside a phase, or None outside every phase. Safe
    from another thread while the main thread blocks in a collective: it writes this rank's state
    (STOPPED, call, phase) to the store and waits at most `grace_s` for the peers'."""
    phase = _ACTIVE[0]
    if phase is None:
        return None
    return phase.watch.report(STOPPED, phase.name, "blocked in this phase when the signal came", grace_s).format()
