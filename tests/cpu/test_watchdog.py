"""The watchdog for device-side waits (epmoe/core/watchdog.py), on CPU with real processes and a real
gloo group, against STAND-INS: the torch dispatcher poses as one whose kernels wait on the GPU
(`waits_on_device = True`), and a stuck kernel is a host that blocks forever at its "device sync" or a
completion marker whose query() stays False (tests/cpu/_watchdog_worker.py). These prove the
mechanism (deadline, disarm, report, exit code, opt-out), not that FlashInfer's kernels are caught:
that is tests/gpu/test_shared_gpu.py::test_rank_killed_inside_flashinfer_dispatch."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from epmoe import EPMoE, MoEConfig
from epmoe.core.watchdog import WATCHDOG_EXIT_CODE
from tests.cpu.mp import free_port, run_group

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "cpu" / "_watchdog_worker.py")
TIMEOUT_S = 3.0
GRACE_S = 1.0  # the watchdog's wait for the peers' states: min(5, max(1, timeout / 4))
SLACK_S = 3.0  # polling, writing the report, process exit, a loaded 2-core box
CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype=torch.float32)


def _run(mode: str, world: int, limit: float, after_step3: float = None):
    """Start `world` worker processes; wait up to `limit` s, and (after_step3) no longer than that many
    seconds after every rank has reached step 3. -> (returncodes, exit times, step-3 times, logs); a rank
    still running at the end has returncode None (then killed)."""
    outdir = tempfile.mkdtemp(prefix="epmoe-wd-")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    procs = []
    for r in range(world):
        log = open(os.path.join(outdir, f"log{r}.txt"), "w")
        procs.append(subprocess.Popen([sys.executable, WORKER, mode, str(TIMEOUT_S), os.path.join(outdir, "progress")],
                                      env={**env, "RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        log.close()
    t0 = time.monotonic()
    end = t0 + limit
    exits = [None] * world
    progress = [os.path.join(outdir, f"progress.{r}") for r in range(world)]
    while time.monotonic() < end and any(e is None for e in exits):
        if after_step3 is not None and all(map(os.path.exists, progress)):
            end = min(end, time.monotonic() + after_step3)
            after_step3 = None  # once: from the moment every rank had reached step 3
        for r, p in enumerate(procs):
            if exits[r] is None and p.poll() is not None:
                exits[r] = time.time()
        time.sleep(0.05)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    step3 = []
    for r in range(world):
        path = os.path.join(outdir, f"progress.{r}")
        step3.append(float(open(path).read().split()[1]) if os.path.exists(path) else None)
    logs = [open(os.path.join(outdir, f"log{r}.txt")).read() for r in range(world)]
    return codes, exits, step3, logs


def _check_fired(codes, exits, step3, logs, victim_waited_on):
    world = len(codes)
    assert codes[-1] == -9, f"the victim should have SIGKILLed itself: rc {codes[-1]}\n{logs[-1]}"
    for r in range(world - 1):
        assert codes[r] == WATCHDOG_EXIT_CODE, f"rank {r}: rc {codes[r]}\n{logs[r]}"
        assert step3[r] is not None, logs[r]
        took = exits[r] - step3[r]
        assert TIMEOUT_S <= took < TIMEOUT_S + GRACE_S + SLACK_S, f"rank {r} exited {took:.1f}s after step 3"
        first = [ln for ln in logs[r].splitlines() if ln.startswith("epmoe fault report:")]
        assert len(first) == 1, logs[r]
        assert (f"layer 'wd-test#0', call 4, phase 'dispatch/combine kernel': rank {r} timed out after "
                f"{TIMEOUT_S:g} s waiting on ranks {victim_waited_on}") in first[0], first[0]
        assert f"exits with code {WATCHDOG_EXIT_CODE}" in logs[r], logs[r]
        assert "Traceback" not in logs[r], logs[r]


def test_standin_host_blocked_behind_stuck_kernel_exits_with_report():
    """Stand-in: the victim dies inside dispatch of call 4 (after the agreement); the two survivors'
    hosts block forever there. Each exits within timeout + grace + slack, code 4 (WATCHDOG_EXIT_CODE),
    one report naming layer, call, phase and the dead rank (the other survivor reports 'timed out' itself)."""
    codes, exits, step3, logs = _run("host", 3, TIMEOUT_S + GRACE_S + SLACK_S + 25)
    _check_fired(codes, exits, step3, logs, [2])
    assert "rank 1: timed out in call 4, phase 'dispatch/combine kernel'" in logs[0], logs[0]
    assert "host blocked in 'dispatch'" in logs[0], logs[0]


def test_standin_completion_event_never_done_exits_with_report():
    """Stand-in: the host returned from call 4 but its completion marker never reports done (the
    kernel behind it spins on the dead victim); the host then blocks at its next 'device sync'."""
    codes, exits, step3, logs = _run("event", 2, TIMEOUT_S + GRACE_S + SLACK_S + 25)
    _check_fired(codes, exits, step3, logs, [1])
    assert "host left the call (kernels still running)" in logs[0], logs[0]


def test_standin_decode_runner_replay_never_done_exits_with_report():
    """Stand-in: as above through the decode runner (eager, cuda_graph=False: armed like a graph replay)."""
    codes, exits, step3, logs = _run("runner", 2, TIMEOUT_S + GRACE_S + SLACK_S + 25)
    _check_fired(codes, exits, step3, logs, [1])
    assert "host left the call (kernels still running)" in logs[0], logs[0]


def test_standin_native_call_holding_the_gil_ends_by_the_backstop():
    """Stand-in: the survivors block inside call 4 in a native call that never returns and holds the GIL
    (a regex: _sre never releases it; DeepEP's normal-mode dispatch waits on the host this way). The
    watchdog thread cannot run; the backstop process (epmoe/core/backstop.py, margin set to 2 s) writes
    one report in the watchdog's format and SIGKILLs each survivor within timeout + margin + slack."""
    margin = 2.0
    codes, exits, step3, logs = _run("gil", 3, TIMEOUT_S + margin + SLACK_S + 25)
    assert codes[-1] == -9, f"the victim should have SIGKILLed itself: rc {codes[-1]}\n{logs[-1]}"
    for r in range(2):
        assert codes[r] == -9, f"rank {r}: rc {codes[r]} (expected the backstop's SIGKILL)\n{logs[r]}"
        took = exits[r] - step3[r]
        assert TIMEOUT_S + margin <= took < TIMEOUT_S + margin + SLACK_S, f"rank {r} exited {took:.1f}s after step 3"
        first = [ln for ln in logs[r].splitlines() if ln.startswith("epmoe fault report:")]
        assert len(first) == 1, logs[r]
        assert (f"layer 'wd-test#0', call 4, phase 'dispatch/combine kernel': rank {r} timed out after "
                f"{TIMEOUT_S:g} s waiting on ranks unknown") in first[0], first[0]
        assert "watchdog backstop" in logs[r] and "holds the Python GIL" in logs[r], logs[r]


def test_standin_healthy_calls_disarm_and_nothing_fires():
    """Stand-in: every call's marker reports done shortly after the call; the ranks then idle for three
    timeouts with nothing armed: both exit 0, no report."""
    codes, exits, step3, logs = _run("healthy", 2, 3 * TIMEOUT_S + 40)
    for r in range(2):
        assert codes[r] == 0, f"rank {r}: rc {codes[r]}\n{logs[r]}"
        assert "DONE" in logs[r] and "fault report" not in logs[r], logs[r]


def test_standin_watchdog_off_does_not_fire():
    """Stand-in, EPMoE(watchdog=False): the survivor stays blocked past timeout + grace + slack (the
    hang the watchdog exists for); the test kills it."""
    codes, exits, step3, logs = _run("off", 2, TIMEOUT_S + GRACE_S + SLACK_S + 25,
                                     after_step3=TIMEOUT_S + GRACE_S + SLACK_S + 1)
    assert codes[1] == -9, logs[1]
    assert codes[0] is None, f"rank 0 should still be blocked: rc {codes[0]}\n{logs[0]}"
    assert "fault report" not in logs[0], logs[0]


def _active(rank, world, dispatcher_waits, **kw):
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher

    TorchA2ADispatcher.waits_on_device = dispatcher_waits  # stand-in for a device-waiting dispatcher when True
    layer = EPMoE(CFG, dispatcher="torch", experts="reference", max_num_tokens_per_rank=8, **kw)
    return layer._watchdog_active


@pytest.mark.parametrize("waits, kw, expect", [
    (True, dict(timeout_s=5.0), True),
    (True, dict(timeout_s=5.0, watchdog=False), False),
    (True, dict(), False),  # no timeout_s: nothing to enforce
    (False, dict(timeout_s=5.0), False),  # the torch dispatcher: host timeouts (gloo) / NCCL's own watchdog
])
def test_watchdog_only_where_kernels_wait_on_peers(waits, kw, expect):
    assert run_group(_active, 2, waits, **kw) == [expect, expect]


def test_which_dispatchers_wait_on_device():
    from epmoe.dispatch.deepep import DeepEPDispatcher, DeepEPLowLatencyDispatcher
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher

    assert FlashInferA2ADispatcher.waits_on_device and DeepEPDispatcher.waits_on_device
    assert DeepEPLowLatencyDispatcher.waits_on_device and not TorchA2ADispatcher.waits_on_device


def test_single_rank_and_bad_value():
    assert not EPMoE(CFG, dispatcher="torch", experts="reference", timeout_s=5.0)._watchdog_active  # no peer
    with pytest.raises(TypeError, match="watchdog='yes'; pass True or False"):
        EPMoE(CFG, dispatcher="torch", experts="reference", watchdog="yes")
