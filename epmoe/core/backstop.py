"""The watchdog's backstop: a small helper process that ends a rank whose watchdog thread cannot run.

Why. The watchdog (epmoe/core/watchdog.py) is a Python thread, so it needs the GIL. A native call
that blocks while holding the GIL starves it: DeepEP's normal-mode dispatch waits on the host for the
received counts inside its C++ call (pybind11 keeps the GIL by default), so a rank whose peer died
there hangs until DeepEP's own 100 s timeout, and a call that never returns hangs for ever. Nothing
inside the process can help: every Python thread needs the GIL.

How. The first armed call starts one helper per process (`python -I -S backstop.py`, about 10 MB, no
imports beyond the standard library). It shares a page of memory with the rank (a memfd): the rank's
host writes each armed call there (start, timeout, call number; a few stores, no system call), the
watchdog thread writes which calls have finished, a heartbeat every poll and whether it is firing
itself. The helper reads the page four times a second. When calls are unfinished and the newest of
them (the one the host is in; an older one may have finished while the thread could not look) is
older than its timeout plus `MARGIN_S` on two reads in a row (the watchdog thread would have fired at
the timeout and finished its report well within the margin), the helper writes the watchdog's report to the
rank's stderr (first line in the watchdog's format; the peers' states are unknown, since reading them
needs the process group's store) and SIGKILLs the rank. It exits when the rank exits, and stands down
while the watchdog thread fires, unless that takes longer than `FIRED_LIMIT_S`.

Off with EPMOE_WATCHDOG_BACKSTOP=0 (then only the thread watches).
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys
import time

PHASE = "dispatch/combine kernel"  # the watchdog's report phase (watchdog.PHASE is this)
MARGIN_S = 10.0  # past an entry's timeout before the helper acts
FIRED_LIMIT_S = 60.0  # the watchdog thread's own report may take this long before the helper ends the rank
POLL_S = 0.25
RING = 64  # armed calls' slots (the helper reads the newest)

OFF_MAGIC, OFF_ARMED, OFF_DONE, OFF_HEART, OFF_FIRED, OFF_FIRED_AT, OFF_SLOTS = 0, 8, 16, 24, 32, 40, 48
MAGIC = 0x65706D6F65776462
Q, D = struct.Struct("<q"), struct.Struct("<d")
SLOT = struct.Struct("<ddqq")  # started (monotonic), timeout_s, call, watch index
SIZE = OFF_SLOTS + RING * SLOT.size


def slot_offset(seq: int) -> int:
    return OFF_SLOTS + (seq % RING) * SLOT.size


class Backstop:
    """The rank's side: start the helper, write armed calls, finished calls and the heartbeat."""

    def __init__(self):
        import subprocess

        fd = os.memfd_create("epmoe-watchdog", 0)
        try:
            os.ftruncate(fd, SIZE)
            self.mem = mmap.mmap(fd, SIZE)
            r, self._names = os.pipe()
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(fd), str(r),
                     repr(float(MARGIN_S))],
                    pass_fds=(fd, r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            finally:
                os.close(r)
        finally:
            os.close(fd)
        Q.pack_into(self.mem, OFF_MAGIC, MAGIC)
        self.seq = 0
        self._watches: dict = {}

    def arm(self, watch, call: int, started: float, timeout_s: float) -> int:
        key = (getattr(watch, "rank", "?"), getattr(watch, "layer_uid", "?"))  # layer uids are unique
        idx = self._watches.get(key)
        if idx is None:  # a new layer: its name and rank to the helper, once
            idx = self._watches[key] = len(self._watches)
            line = f"{idx}\t{key[0]}\t{key[1]!r}\n"
            try:
                os.write(self._names, line.encode())
            except OSError:
                pass
        self.seq += 1
        SLOT.pack_into(self.mem, slot_offset(self.seq), started, float(timeout_s), int(call), idx)
        Q.pack_into(self.mem, OFF_ARMED, self.seq)  # after the slot: the helper never reads a half-written one
        return self.seq

    def done(self, seq: int) -> None:
        Q.pack_into(self.mem, OFF_DONE, seq)

    def restarted(self, seq: int, started: float) -> None:
        D.pack_into(self.mem, slot_offset(seq), started)

    def heartbeat(self, now: float) -> None:
        D.pack_into(self.mem, OFF_HEART, now)

    def firing(self, now: float) -> None:
        D.pack_into(self.mem, OFF_FIRED_AT, now)
        Q.pack_into(self.mem, OFF_FIRED, 1)


def start() -> "Backstop | None":
    """The helper for this process, or None (EPMOE_WATCHDOG_BACKSTOP=0, or it could not start: a note on
    stderr, and the watchdog thread watches alone)."""
    if os.environ.get("EPMOE_WATCHDOG_BACKSTOP", "1") == "0":
        return None
    try:
        return Backstop()
    except (OSError, AttributeError, ValueError) as e:  # AttributeError: no os.memfd_create (not Linux)
        sys.stderr.write(f"epmoe: the watchdog's backstop process did not start ({type(e).__name__}: {e}); a native "
                         "call that holds the GIL can then keep the watchdog from firing\n")
        return None


# ---------------------------------------------------------------------- the helper process
def _report(rank: str, layer: str, call: int, timeout_s: float, waited: float, heart_age: float, pid: int) -> str:
    if heart_age > 2.0:
        why = f"the watchdog thread last ran {heart_age:.1f} s ago: a native call holds the Python GIL"
    else:
        why = "the watchdog thread runs but did not end the process"
    return (f"epmoe fault report: layer {layer}, call {call}, phase {PHASE!r}: rank {rank} timed out after "
            f"{timeout_s:g} s waiting on ranks unknown\n"
            f"  rank {rank}: watchdog backstop: the call's kernels did not finish within {timeout_s:g} s (waited "
            f"{waited:.1f} s); {why}; peers' states not read; process {pid} is killed (SIGKILL)\n")


def _helper(ppid: int, fd: int, names_fd: int, margin_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the rank; the helper follows it out
    mem = mmap.mmap(fd, SIZE, access=mmap.ACCESS_READ)
    os.close(fd)
    os.set_blocking(names_fd, False)
    names: dict = {}
    pending = b""
    suspect = None
    while True:
        time.sleep(POLL_S)
        if os.getppid() != ppid:
            return
        try:
            chunk = os.read(names_fd, 65536)
            if not chunk:  # the rank closed its end: it is exiting
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                idx, rank, layer = line.decode(errors="replace").split("\t", 2)
                names[int(idx)] = (rank, layer)
        except BlockingIOError:
            pass
        if Q.unpack_from(mem, OFF_MAGIC)[0] != MAGIC:
            continue
        now = time.monotonic()
        if Q.unpack_from(mem, OFF_FIRED)[0]:
            if now - D.unpack_from(mem, OFF_FIRED_AT)[0] > FIRED_LIMIT_S:
                os.kill(ppid, signal.SIGKILL)
                return
            continue
        armed, done = Q.unpack_from(mem, OFF_ARMED)[0], Q.unpack_from(mem, OFF_DONE)[0]
        if armed <= done:
            suspect = None
            continue
        seq = armed  # the newest call: the one the host is in (an older one may have finished unseen)
        started, timeout_s, call, idx = SLOT.unpack_from(mem, slot_offset(seq))
        waited = now - started
        if waited <= timeout_s + margin_s:
            suspect = None
            continue
        if suspect != seq:  # confirm on the next read (the watchdog thread may be between two writes)
            suspect = seq
            continue
        rank, layer = names.get(idx, ("?", "'?'"))
        text = _report(rank, layer, call, timeout_s, waited, now - D.unpack_from(mem, OFF_HEART)[0], ppid)
        try:
            os.write(2, text.encode())
        finally:
            os.kill(ppid, signal.SIGKILL)
        return


if __name__ == "__main__":
    _helper(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
