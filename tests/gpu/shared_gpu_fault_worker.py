"""One rank of the shared-GPU fault test (tests/gpu/test_shared_gpu.py; not collected by pytest).

    RANK=r WORLD_SIZE=n MASTER_ADDR=.. MASTER_PORT=.. python shared_gpu_fault_worker.py DISPATCHER WHERE TIMEOUT OUT

All ranks on cuda:0 with a gloo group and shared_gpu=True. The last rank SIGKILLs itself at step 3:
WHERE="forward" on entering the step, "kernel" inside the dispatcher's all-to-all call (FlashInfer's
MoeAlltoAll.dispatch, DeepEP's Buffer.dispatch / low_latency_dispatch), after the per-call agreement,
so the others are already in the kernel. DeepEP's low-latency mode needs one of its hidden sizes
(2048) and the masked experts. Every other rank writes one line to OUT:
"FAULT <error type> after=<s>s report=<bool> ..." or "ERROR ..." or "DONE", then leaves at once
(os._exit: a peer is gone, so no collective teardown). With WHERE="kernel" the survivor's host cannot
raise (its kernel spins on the dead peer): the watchdog prints the fault report to stderr and exits
with code 4 instead, and OUT stays unwritten. Every rank writes time.time() at step 3 to OUT.step3.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    import faulthandler

    # the harness sends SIGUSR1 to a rank that hangs before killing it: every thread's Python stack to
    # the log (faulthandler writes it from the signal handler, also while a C++ call holds the GIL)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dispatcher, where, timeout_s, out_path = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    from epmoe import EPMoE, MoEConfig
    from epmoe.core.fault import CollectiveFailure
    from tests.cpu.helpers import random_inputs, random_weights

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = rank == world - 1
    hidden = 2048 if dispatcher == "deepep_ll" else 256
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=hidden, intermediate_size=128, dtype=torch.bfloat16)
    kw = {"experts": "reference"}
    if dispatcher == "deepep_ll":
        from epmoe.resolve import resolve_quant_plan

        kw = {"plan": resolve_quant_plan(cfg, dispatcher=dispatcher, experts_backend="masked_reference", arch="sm90",
                                         ep_size=dist.get_world_size())}
    layer = EPMoE(cfg, dispatcher=dispatcher, device="cuda:0", max_num_tokens_per_rank=32,
                  shared_gpu=True, timeout_s=timeout_s, name="fault-test", **kw)
    layer.load_weights(random_weights(cfg, 5))
    x, logits = random_inputs(cfg, 24, 11 + rank)
    x, logits = x.cuda(), logits.cuda()

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    for step in range(6):
        if step == 3:
            with open(out_path + ".step3", "w") as f:
                f.write(f"{time.time():.3f}")
        if victim and step == 3:
            if where == "forward":
                die()
            # the all-to-all call itself, after the agreement
            if dispatcher == "flashinfer":
                layer.dispatcher._a2a.dispatch = die  # FlashInfer's MoeAlltoAll
            elif dispatcher == "deepep":
                layer.dispatcher.buffer.raw.dispatch = die  # deep_ep.Buffer
            else:
                layer.dispatcher.buffer.raw.low_latency_dispatch = die
        t0 = time.monotonic()
        try:
            layer(x, logits)
            torch.cuda.synchronize()
        except CollectiveFailure as e:
            dt = time.monotonic() - t0
            first = str(e).splitlines()[0]
            with open(out_path, "w") as f:
                f.write(f"FAULT {type(e).__name__} after={dt:.2f}s step={step} report={e.report is not None} "
                        f"phase={getattr(e.report, 'phase', None)!r} | {first}\n")
            os._exit(0)
        except BaseException as e:  # noqa: BLE001
            dt = time.monotonic() - t0
            with open(out_path, "w") as f:
                f.write(f"ERROR {type(e).__name__} after={dt:.2f}s step={step} | {str(e).splitlines()[0][:300]}\n")
            os._exit(0)
    with open(out_path, "w") as f:
        f.write("DONE\n")
    os._exit(0)


if __name__ == "__main__":
    main()
