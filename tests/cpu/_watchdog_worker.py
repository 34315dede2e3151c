"""One rank of the watchdog STAND-IN tests (tests/cpu/test_watchdog.py; not collected by pytest).

    RANK=r WORLD_SIZE=n MASTER_ADDR=.. MASTER_PORT=.. python _watchdog_worker.py MODE TIMEOUT PROGRESS

CPU, gloo, the torch dispatcher posing as one whose kernels wait on the GPU for peers
(`waits_on_device = True`: a stand-in for FlashInfer/DeepEP; no kernel runs). The last rank is the
victim. MODE:
  host     the victim SIGKILLs itself inside dispatch of step 3 (after the agreement); the others'
           dispatch blocks forever there, as a host blocked at a device sync behind a kernel that
           spins on the dead peer (a sleep holds no GIL, like cudaStreamSynchronize)
  event    step 3 completes on the host, but the survivors' completion marker never reports done (a
           stand-in for a CUDA event behind a kernel that never finishes); the victim dies after step
           3 and the survivors then block forever ("the next device sync")
  runner   as `event`, through a decode runner (EPMoE.decode_runner, cuda_graph=False: the same
           arming as a CUDA-graph replay)
  healthy  every call's marker reports done 0.2 s after the call; 5 steps, then idle for 3 timeouts,
           then print DONE and exit 0
  off      as `host`, with EPMoE(watchdog=False)
  gil      as `host`, but the survivors block in a native call that holds the GIL (a regex that never
           ends, as DeepEP's normal-mode host wait): the watchdog thread cannot run, the backstop
           process (margin 2 s) writes the report and SIGKILLs them
Before step 3 each rank writes "step3 <time.time()>" to PROGRESS.<rank>.
"""

import os
import signal
import sys
import time


class NeverDone:  # stand-in for a CUDA event behind a kernel that never finishes
    def query(self):
        return False


class DoneAfter:  # stand-in for a CUDA event of a healthy call: done 0.2 s later
    def __init__(self):
        self.t = time.monotonic() + 0.2

    def query(self):
        return time.monotonic() >= self.t


def main() -> None:
    mode, timeout_s, progress = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from epmoe import EPMoE, MoEConfig
    from epmoe.core import watchdog
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher
    from tests.cpu.helpers import random_inputs, random_weights

    TorchA2ADispatcher.waits_on_device = True  # the stand-in: see the module docstring
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = rank == world - 1
    cfg = MoEConfig(num_experts=12, top_k=2, hidden_size=32, intermediate_size=16, dtype=torch.float32)
    layer = EPMoE(cfg, dispatcher="torch", experts="reference", max_num_tokens_per_rank=16, timeout_s=timeout_s,
                  watchdog=mode != "off", name="wd-test")
    assert layer._watchdog_active == (mode != "off")
    layer.load_weights(random_weights(cfg, 5))
    x, logits = random_inputs(cfg, 12, 11 + rank)
    if mode == "healthy":
        watchdog.completion_marker = lambda device: DoneAfter()

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    def block_forever(*_a, **_k):
        while True:
            time.sleep(3600)

    def hold_gil_forever(*_a, **_k):  # catastrophic backtracking: _sre runs for ages holding the GIL
        import re

        re.match(r"(a|aa)+$", "a" * 80 + "b")

    if mode == "gil":
        from epmoe.core import backstop

        backstop.MARGIN_S = 2.0

    call = layer.decode_runner(16, cuda_graph=False) if mode == "runner" else layer
    for step in range(5):
        if step == 3:
            with open(f"{progress}.{rank}", "w") as f:
                f.write(f"step3 {time.time():.3f}\n")
            if mode in ("host", "off", "gil"):
                layer.dispatcher.dispatch = die if victim else (hold_gil_forever if mode == "gil" else block_forever)
            elif mode in ("event", "runner") and not victim:
                watchdog.completion_marker = lambda device: NeverDone()
        call(x, logits)
        if step == 3 and mode in ("event", "runner"):
            if victim:
                die()
            block_forever()
    if mode == "healthy":
        time.sleep(3 * timeout_s)
        assert watchdog.WATCHDOG.pending() == 0, watchdog.WATCHDOG.pending()
        print("DONE", flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    main()
