"""Watchdog for device-side waits: a rank whose GPU kernel waits forever for a dead peer's tokens ends
with a fault report instead of hanging.

Why. FlashInfer's and DeepEP's all-to-all kernels are one-sided: each rank's kernel spins on the GPU
until every peer's tokens have arrived. If a peer dies after the per-call agreement (so the others
are already in the kernel), their kernels spin forever, their host blocks at the next device sync,
and no host timeout can interrupt either: a kernel cannot be cancelled. NCCL has the same problem and
solves it with a watchdog that ends the process past the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING).
This is ours, for the kernels NCCL does not see.

How. `EPMoE` arms one entry per call (`arm`) just before it launches the first kernel that waits on
peers, and hands it a completion marker when the call's kernels are enqueued (`Entry.launched`: a CUDA
event recorded after the last combine). Nothing else happens on the hot path: no host sync, no
collective. One daemon thread per process polls the oldest entry every `POLL_S` seconds
(`event.query()` does not block): when the event has completed the entry is dropped. When an entry
is older than its `timeout_s`, the thread
  1. writes this rank's state ("timed out", call, phase) to the process group's store and waits a
     short grace period for the peers' states (the FaultWatch mechanism: a rank that reports nothing
     is dead or stuck elsewhere; a peer stuck in the same call reports "timed out" itself),
  2. writes the FaultReport to stderr (the launcher's format: first line
     `epmoe fault report: layer ..., call N, phase 'dispatch/combine kernel': rank R timed out after
     T s waiting on ranks [...]`, then one line per rank),
  3. ends the process with `os._exit(WATCHDOG_EXIT_CODE)`: the CUDA context holds a kernel that will
     never finish, so nothing in this process can continue; the driver frees its memory on exit.

The clock of an entry starts when it was armed or, if later, when the entry ahead of it completed
(events of one stream complete in order), so a host that runs ahead of the GPU does not charge the
queue in front of a call to that call.

Contract: `timeout_s` bounds one layer call, dispatch through combine, including waiting for the
slowest peer (its experts, a first-call kernel compile). A healthy call never legitimately takes
longer; that is the same promise the host-side collective timeout makes. Choose `timeout_s` above the
slowest step (the launcher's default is 300 s).

Which dispatchers (`Dispatcher.waits_on_device`): `flashinfer` (MoeAlltoAll's kernels spin until
every peer's tokens arrived) and `deepep` / `deepep_ll` (the same one-sided spin; DeepEP's own
in-kernel timeout traps the device after a fixed ~100 s, ignores `timeout_s` and leaves no report).
Not `torch`: over gloo its waits are host waits bounded by `timeout_s`; over NCCL the process group's
timeout and NCCL's own watchdog apply. Only with `timeout_s` set and more than one rank; off with
`EPMoE(watchdog=False)`.

The thread needs the GIL to run: torch releases it in every blocking device sync (`.item()`,
`.tolist()`, `torch.cuda.synchronize()`), which is where a host waits on a stuck kernel. A native
call that blocks holding the GIL (DeepEP's normal-mode dispatch waits on the host for the received
counts inside its C++ call) starves the thread; the backstop (epmoe/core/backstop.py), a helper
process that reads this thread's progress from shared memory, then writes the report and SIGKILLs the
rank `backstop.MARGIN_S` after the timeout.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any, Optional

import torch

from epmoe.core import backstop as _backstop

WATCHDOG_EXIT_CODE = 4  # launcher: 0 ok, 1 fault report, 2 usage error, 3 doctor refused; 4 = ended by the watchdog
PHASE = _backstop.PHASE  # "dispatch/combine kernel"
POLL_S = 0.05


class Entry:
    """One armed call. `phase` is where the host is (the layer updates it); `launched(marker)` hands over
    the completion marker (anything with `query() -> bool`, normally a recorded torch.cuda.Event)."""

    __slots__ = ("watch", "call", "timeout_s", "phase", "armed_at", "started", "marker", "seq")

    def __init__(self, watch: Any, call: int, timeout_s: float):
        self.watch, self.call, self.timeout_s = watch, call, timeout_s
        self.phase = "dispatch"
        self.armed_at = self.started = time.monotonic()
        self.marker: Any = None
        self.seq = 0  # the backstop's number for this entry (0: no backstop)

    def launched(self, marker: Any) -> None:
        self.marker = marker


def completion_marker(device: Any) -> Any:
    """A marker whose `query()` says when everything enqueued so far on `device` has finished: a CUDA
    event recorded on the current stream; True on a device whose work is already done (CPU)."""
    if getattr(device, "type", None) != "cuda" or torch.cuda.is_current_stream_capturing():
        return True  # nothing to wait for (CPU), or an outer CUDA-graph capture: its replay is not ours to time
    ev = torch.cuda.Event()
    ev.record()
    return ev


class _Watchdog:
    def __init__(self):
        self._entries: "collections.deque[Entry]" = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._backstop: Optional[_backstop.Backstop] = None

    def arm(self, watch: Any, call: int, timeout_s: float) -> Entry:
        entry = Entry(watch, call, timeout_s)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._backstop = _backstop.start()
                    self._thread = threading.Thread(target=self._run, name="epmoe-watchdog", daemon=True)
                    self._thread.start()
        if self._backstop is not None:
            entry.seq = self._backstop.arm(watch, call, entry.started, timeout_s)
        self._entries.append(entry)
        return entry

    def pending(self) -> int:
        return len(self._entries)

    def _run(self) -> None:
        entries, backstop = self._entries, self._backstop
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            if backstop is not None:
                backstop.heartbeat(now)
            while entries:
                head = entries[0]
                marker = head.marker
                if marker is None:  # the host is still inside the call
                    break
                try:
                    done = marker is True or bool(marker.query())
                except Exception:  # noqa: BLE001 - a broken context: treat as not done, the deadline decides
                    done = False
                if not done:
                    break
                entries.popleft()
                if backstop is not None:
                    backstop.done(head.seq)
                if entries:  # the next call's kernels could start only now
                    nxt = entries[0]
                    nxt.started = max(nxt.started, now)
                    if backstop is not None:
                        backstop.restarted(nxt.seq, nxt.started)
            if entries and now - entries[0].started > entries[0].timeout_s:
                self._fire(entries[0], now)

    def _fire(self, entry: Entry, now: float) -> None:
        if self._backstop is not None:
            self._backstop.firing(now)
        waited = now - entry.started
        watch = entry.watch
        where = "left the call (kernels still running)" if entry.marker is not None else f"blocked in {entry.phase!r}"
        detail = (f"watchdog: the call's kernels did not finish within {entry.timeout_s:g} s "
                  f"(waited {waited:.1f} s; host {where}); a kernel waiting on a peer cannot be cancelled, "
                  f"so this process exits with code {WATCHDOG_EXIT_CODE}")
        try:
            text = watch.report("timed out", PHASE, detail, call=entry.call, timeout_s=entry.timeout_s).format()
        except BaseException as e:  # noqa: BLE001 - the report must come out even if the store is gone
            text = (f"epmoe fault report: layer {watch.layer_uid!r}, call {entry.call}, phase {PHASE!r}: rank "
                    f"{watch.rank} timed out after {entry.timeout_s:g} s waiting on ranks unknown "
                    f"({type(e).__name__} reading the peers' states)\n  rank {watch.rank}: {detail}")
        try:
            sys.stderr.write(text.rstrip() + "\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(WATCHDOG_EXIT_CODE)


WATCHDOG = _Watchdog()


def _after_fork_in_child() -> None:  # a forked child has no watchdog thread and none of the parent's calls
    global WATCHDOG
    WATCHDOG = _Watchdog()


os.register_at_fork(after_in_child=_after_fork_in_child)
