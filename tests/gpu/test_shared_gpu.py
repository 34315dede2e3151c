"""Several ranks on ONE GPU (shared-GPU mode, docs/shared-gpu.md): the multi-rank paths on real kernels.

N processes (ep = 2 and 4) all on cuda:0, joined by a gloo group (NCCL refuses two ranks on one
device), `shared_gpu=True`. FlashInfer's MoeAlltoAll kernels move the tokens between the processes
through its MNNVL workspace; the torch dispatcher stages CUDA tensors through host memory for gloo.
Nothing here measures a link.

Checks (each rank runs all checks of its group in one process and reports them per check):
  dispatch (DeepSeek-V3 shape H=7168, E=256, top-8, uneven T per rank including 0):
    * BF16 and NVFP4 payloads: FlashInfer == torch dispatcher == the pure-torch reference of the
      dispatch/combine math, bit for bit (row-wise stand-in experts, `fake_experts`). At ep = 4 a
      token may have partial sums from 3-4 ranks, and the two dispatchers may add them in another
      order: there bit-exactness is asserted on dyadic inputs (every float32 sum exact, so order
      cannot matter) and the random-input difference is bounded and reported.
    * low-precision (FP8) combine: within its bound of the BF16 combine, reported.
  layer (EPMoE, reference experts, small shape), FlashInfer and torch dispatchers:
    * uneven T incl. 0, batches above max tokens (rounds) vs float64 reference
    * CUDA-graph decode runner replays bit for bit what it computes eagerly (FlashInfer)
    * update_weights between steps (eager and graph runner see the new weights)
    * routing capture / replay bitwise; deterministic mode bitwise over repeated runs
    * a bad input on one rank: every rank raises, and the next step works
  faults (separate processes, not the run_group harness): one rank SIGKILLed mid-step -> the others
    raise a FaultReport within the timeout (time measured), nothing hangs, no GPU memory left; one rank
    SIGKILLed inside FlashInfer's dispatch kernel -> the watchdog ends the survivor with the fault report
    (exit code 4) within the timeout + grace, nothing hangs, no GPU memory left.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.cpu.mp import assert_checks, run_checks, run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
HAS_FI = importlib.util.find_spec("flashinfer") is not None
needs_fi = [pytest.mark.requires_flashinfer,
            pytest.mark.skipif(not HAS_FI, reason="needs flashinfer-python")]
TIMEOUT_S = 15.0  # the layers' collective timeout in the fault tests


# ----------------------------------------------------------------------------- dispatch level
COUNTS = {2: [77, 0], 4: [128, 0, 77, 5]}
COUNTS2 = {2: [128, 31], 4: [3, 128, 0, 64]}


def _dispatch_worker(rank, world, seed, with_fi):
    import torch.distributed as dist

    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher
    from tests.gpu import test_flashinfer_a2a as fa

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    group = dist.group.WORLD
    per = fa.E // world

    def owners(ids):  # [T] distinct owner ranks per token
        rk = torch.where(ids >= 0, ids.long() // per, torch.full_like(ids.long(), -1))
        return torch.stack([(rk == r).any(dim=1) for r in range(world)], dim=1).sum(dim=1)

    def spec(payload=None, **opts):
        from dataclasses import replace

        return replace(fa._spec(rank, world, 128, payload=payload, group=group, **opts), shared_gpu=True)

    def dyadic(x):  # values k/8, |k| <= 16: every float32 partial and sum below is exact
        return (x.float() * 8).round().clamp(-16, 16).div(8).to(torch.bfloat16)

    def compare(payload_name):
        payload = fa._nvfp4_format() if payload_name == "nvfp4" else None
        dispatchers = [("torch", TorchA2ADispatcher(spec(payload)))]
        if with_fi:
            from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

            dispatchers.append(("flashinfer", FlashInferA2ADispatcher(spec(payload))))
        notes = []
        try:
            cases = [(COUNTS[world], "random"), (COUNTS2[world], "random")]
            if payload_name == "bf16":  # NVFP4-dequantized values are not dyadic: no exact-sum case
                cases.append((COUNTS[world], "dyadic"))
            for i, (counts, kind) in enumerate(cases):
                inputs = fa.make_inputs(seed + i, counts, dev)
                x, ids, w = inputs[rank]
                if kind == "dyadic":
                    x = dyadic(x)
                    w = (w * 4).round().div(4)
                xr = fa.nvfp4_roundtrip(x) if payload_name == "nvfp4" and x.shape[0] else x
                ref = fa.reference(xr, ids, w, world)
                outs = {}
                for name, d in dispatchers:
                    out, tokens, handle = fa.round_trip(d, x, ids, w)
                    outs[name] = out
                    if name == "flashinfer":
                        fa._check_arrivals(tokens, handle, [i for _, i, _ in inputs], rank, world)
                # the torch dispatcher sums in rank order: exactly the reference
                assert torch.equal(outs["torch"], ref), f"{kind} {counts}: torch dispatcher != reference"
                if "flashinfer" in outs:
                    fi = outs["flashinfer"]
                    same = (fi == outs["torch"]).all(dim=1)
                    few = owners(ids) <= 2  # two partial sums: order cannot matter
                    assert bool(same[few].all()), f"{kind} {counts}: FlashInfer != torch on tokens with <= 2 owners"
                    if kind == "dyadic":
                        assert torch.equal(fi, outs["torch"]), f"dyadic {counts}: FlashInfer != torch"
                    else:
                        diff = (fi.float() - outs["torch"].float()).abs().max().item() if fi.numel() else 0.0
                        scale = outs["torch"].float().abs().max().item() if fi.numel() else 1.0
                        assert diff <= 1e-2 * max(scale, 1e-30), f"{kind} {counts}: max diff {diff} vs {scale}"
                        notes.append(f"T={counts[rank]}: {int((~same).sum())}/{len(same)} rows differ "
                                     f"(max {diff:.3g}; all on tokens with >2 owners)")
                    notes.append(f"{kind} T={counts[rank]} bit-exact" if bool(same.all()) else "")
        finally:
            for _, d in dispatchers:
                d.close()
        return f"{payload_name}: " + "; ".join(n for n in notes if n)

    def low_precision_combine():
        from epmoe.dispatch.flashinfer_a2a import FlashInferA2ADispatcher

        inputs = fa.make_inputs(seed + 9, COUNTS2[world], dev)
        x, ids, w = inputs[rank]
        d = FlashInferA2ADispatcher(spec(None, low_precision_combine=True))
        t = TorchA2ADispatcher(spec(None))
        try:
            out, _, _ = fa.round_trip(d, x, ids, w)
            ref, _, _ = fa.round_trip(t, x, ids, w)
        finally:
            d.close()
            t.close()
        if not x.shape[0]:
            return "T=0"
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < 0.08, f"FP8 combine max rel err {err:.3g} vs the BF16 torch combine"
        return f"FP8 combine vs BF16 torch combine: max rel err {err:.3g}"

    checks = [("bf16", lambda: compare("bf16")), ("nvfp4", lambda: compare("nvfp4"))]
    if with_fi:
        checks.append(("low_precision_combine", low_precision_combine))
    return run_checks(f"shared-gpu ep={world} dispatch", checks)


@pytest.fixture(scope="module", params=[2, 4])
def dispatch_results(request):
    from tests.cpu.helpers import fresh_seed

    seed = fresh_seed()
    ep = request.param
    res = run_group(_dispatch_worker, ep, seed, HAS_FI, timeout=300, pg_timeout=120)
    return ep, seed, res


@pytest.mark.parametrize("check", ["bf16", "nvfp4"])
def test_dispatch_flashinfer_vs_torch(dispatch_results, check):
    ep, seed, res = dispatch_results
    if check not in res[0]:
        pytest.skip("not run")
    assert_checks(res, [check], seed)


@pytest.mark.requires_flashinfer
def test_dispatch_low_precision_combine(dispatch_results):
    ep, seed, res = dispatch_results
    if "low_precision_combine" not in res[0]:
        pytest.skip("flashinfer not installed")
    assert_checks(res, ["low_precision_combine"], seed)


# ----------------------------------------------------------------------------- layer level
def _layer_worker(rank, world, seed, dispatcher):
    import torch.distributed as dist

    from epmoe import EPMoE, MoEConfig, reference_moe
    from epmoe.core.errors import PeerInputError
    from tests.cpu.helpers import max_rel_err, random_inputs, random_weights

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    M = 32
    w0, w1 = random_weights(cfg, seed), random_weights(cfg, seed + 1)

    def build(**kw):
        layer = EPMoE(cfg, dispatcher=dispatcher, device=dev, experts="reference", max_num_tokens_per_rank=M,
                      shared_gpu=True, **kw)
        layer.load_weights(w0)
        return layer

    layer = build(deterministic=True)

    def all_inputs(counts, s):
        return [random_inputs(cfg, T, s + 101 * r) for r, T in enumerate(counts)]

    def check_vs_reference(counts, weights, s, expect_rounds):
        xs = all_inputs(counts, s)
        x, logits = xs[rank]
        out = layer(x.to(dev), logits.to(dev), return_stats=True)
        ref = reference_moe(cfg, x, weights, logits)
        err = max_rel_err(out.hidden_states, ref)
        assert err < 2e-2, f"T={counts}: max rel err {err:.3g}"
        assert out.stats.rounds == expect_rounds, (out.stats.rounds, expect_rounds)
        assert out.stats.tokens_per_rank == tuple(counts)
        return err

    def uneven_and_rounds():
        counts = [70, 0, 33, 5][:world]
        e1 = check_vs_reference(counts, w0, seed, expect_rounds=3)
        e2 = check_vs_reference([0] * world, w0, seed + 1, expect_rounds=1)
        e3 = check_vs_reference([M] * world, w0, seed + 2, expect_rounds=1)
        return f"T={counts} (3 rounds), all 0, all {M}: max rel err {max(e1, e2, e3):.2e}"

    def update_weights_between_steps():
        check_vs_reference([20, 9, 0, 3][:world], w0, seed + 3, 1)
        ptrs = {k: v.data_ptr() for k, v in layer.experts.parameters().items()}
        layer.update_weights(w1)
        assert {k: v.data_ptr() for k, v in layer.experts.parameters().items()} == ptrs
        err = check_vs_reference([20, 9, 0, 3][:world], w1, seed + 4, 1)
        layer.update_weights(w0)
        return f"new weights seen at once, storage kept, max rel err {err:.2e}"

    def routing_capture_replay():
        x, logits = all_inputs([40, 12, 0, 7][:world], seed + 5)[rank]
        x, logits = x.to(dev), logits.to(dev)
        first = layer(x, logits, return_routing=True)
        again = layer(x, topk_ids=first.routing.topk_ids, topk_weights=first.routing.topk_weights)
        assert torch.equal(first.hidden_states, again), "replayed routing gives other bits"
        return "replay bitwise equal"

    def deterministic_repeats():
        x, logits = all_inputs([64, 3, 50, 0][:world], seed + 6)[rank]
        x, logits = x.to(dev), logits.to(dev)
        runs = [layer(x, logits) for _ in range(3)]
        assert all(torch.equal(runs[0], r) for r in runs[1:]), "deterministic runs differ"
        return "3 runs bitwise equal (2 rounds each)"

    def bad_input_then_recover():
        x, logits = all_inputs([10] * world, seed + 7)[rank]
        x, logits = x.to(dev), logits.to(dev)
        bad_logits = logits[:, :5] if rank == world - 1 else logits  # wrong router width on the last rank
        try:  # PeerInputError is a ValueError: catch it first
            layer(x, bad_logits)
        except PeerInputError as e:
            assert rank != world - 1 and f"rank {world - 1}" in str(e), e
        except ValueError as e:
            assert rank == world - 1 and "router_logits has shape" in str(e), e
        else:
            raise AssertionError("no rank raised")
        ids = torch.full((10, cfg.top_k), 3, dtype=torch.int32, device=dev)
        if rank == 0:
            ids[4, 1] = cfg.num_experts  # out of range
        w = torch.full((10, cfg.top_k), 0.25, device=dev)
        try:
            layer(x, topk_ids=ids, topk_weights=w)
        except PeerInputError as e:
            assert rank != 0, e
        except ValueError as e:
            assert rank == 0 and "topk_ids has values outside" in str(e), e
        else:
            raise AssertionError("bad expert id: no rank raised")
        check_vs_reference([10] * world, w0, seed + 7, 1)  # the next step works
        return "every rank raised (twice); next step correct"

    checks = [
        ("uneven_and_rounds", uneven_and_rounds),
        ("update_weights", update_weights_between_steps),
        ("routing_replay", routing_capture_replay),
        ("deterministic", deterministic_repeats),
        ("bad_input", bad_input_then_recover),
    ]

    def cuda_graph_decode():
        graph = layer.decode_runner(16, cuda_graph=True)
        eager = layer.decode_runner(16, cuda_graph=False)
        for step, counts in enumerate([[16] * world, [5, 0, 16, 1][:world], [0] * world]):
            x, logits = all_inputs(counts, seed + 20 + step)[rank]
            g = graph(x.to(dev), logits.to(dev)).clone()
            e = eager(x.to(dev), logits.to(dev)).clone()
            assert torch.equal(g, e), f"graph replay differs from eager at T={counts}"
            if counts[rank]:
                err = max_rel_err(g, reference_moe(cfg, x, w0, logits))
                assert err < 2e-2, err
        layer.update_weights(w1)  # in place: the captured graph must see it
        x, logits = all_inputs([9] * world, seed + 30)[rank]
        g = graph(x.to(dev), logits.to(dev)).clone()
        assert torch.equal(g, eager(x.to(dev), logits.to(dev)))
        assert max_rel_err(g, reference_moe(cfg, x, w1, logits)) < 2e-2
        ids = torch.full((9, cfg.top_k), -1, dtype=torch.int32, device=dev)
        routed = graph(x.to(dev), logits.to(dev), return_routing=True)
        ids.copy_(routed.routing.topk_ids)
        w = routed.routing.topk_weights.clone()
        y1 = routed.hidden_states.clone()
        y2 = graph(x.to(dev), topk_ids=ids, topk_weights=w).clone()  # replayed routing, second graph
        assert torch.equal(y1, y2), "graph routing replay differs"
        layer.update_weights(w0)
        graph.dispatcher.close()
        eager.dispatcher.close()
        return "T in {16, mixed, 0}: replay == eager bitwise; update seen; routing replay bitwise"

    if dispatcher == "flashinfer":
        checks.append(("cuda_graph_decode", cuda_graph_decode))
    results = run_checks(f"shared-gpu ep={world} layer {dispatcher}", checks)
    layer.dispatcher.close()
    dist.barrier()
    return results


LAYER_CHECKS = ["uneven_and_rounds", "update_weights", "routing_replay", "deterministic", "bad_input"]


@pytest.fixture(scope="module", params=[(2, "torch"), (4, "torch"), (2, "flashinfer"), (4, "flashinfer")],
                ids=lambda p: f"ep{p[0]}-{p[1]}")
def layer_results(request):
    from tests.cpu.helpers import fresh_seed

    ep, dispatcher = request.param
    if dispatcher == "flashinfer" and not HAS_FI:
        pytest.skip("needs flashinfer-python")
    seed = fresh_seed()
    # a failed check can leave the ranks in different collectives: the group is killed after 120 s
    return seed, run_group(_layer_worker, ep, seed, dispatcher, timeout=120, pg_timeout=60)


@pytest.mark.parametrize("check", LAYER_CHECKS + ["cuda_graph_decode"])
def test_layer(layer_results, check):
    seed, res = layer_results
    if check not in res[0]:
        pytest.skip("CUDA graphs need a dispatcher without host staging (flashinfer)")
    assert_checks(res, [check], seed)


# ----------------------------------------------------------------------------- faults
FAULT_SCRIPT = os.path.join(os.path.dirname(__file__), "shared_gpu_fault_worker.py")


def _gpu_pids():
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {int(line.split(",")[0]) for line in out.splitlines() if line.strip()}


def _native_stacks(pid: int) -> str:
    """Every thread's native stack of `pid` (gdb, else cuda-gdb, when installed; else each thread's
    name, state and kernel wait channel from /proc): where a process hangs when its Python stacks end
    in a C call."""
    import shutil

    gdb = shutil.which("gdb") or shutil.which("cuda-gdb")
    if gdb:
        try:
            out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
                                  "-ex", "thread apply all bt 14"], capture_output=True, text=True, timeout=60)
            frames = [line[:180] for line in out.stdout.splitlines() if line.startswith(("Thread ", "#"))]
            if frames:
                return f"\n[native stacks, {os.path.basename(gdb)}]\n" + "\n".join(frames)[-5000:] + "\n"
            head = f"\n[native stacks: {os.path.basename(gdb)} printed none: {(out.stderr or '').strip()[-300:]}]\n"
        except (OSError, subprocess.TimeoutExpired) as e:
            head = f"\n[native stacks: {os.path.basename(gdb)} failed: {type(e).__name__}]\n"
    else:
        head = "\n[native stacks: no gdb; /proc task name, state, wchan]\n"
    rows = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            def rd(name):
                try:
                    with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                        return f.read().strip()
                except OSError:
                    return "?"
            rows.append(f"  {tid} {rd('comm')!r} state={rd('stat').split(')')[-1].split()[0:1]} wchan={rd('wchan')}")
    except OSError as e:
        rows.append(f"  ({type(e).__name__}: {e})")
    return head + "\n".join(rows) + "\n"


def run_fault(world, dispatcher, where, timeout=75, timeout_s=TIMEOUT_S):
    """Start `world` worker processes (shared_gpu, gloo); rank world-1 SIGKILLs itself at step 3 (`where`:
    "forward" = on entering the step, "kernel" = inside dispatch after the agreement). -> (per-rank lines,
    seconds the test waited, ranks that hung, pids still on the GPU after exit, logs, return codes, seconds
    from each rank's step 3 to its exit)."""
    import tempfile

    from tests.cpu.mp import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "PYTHONUNBUFFERED": "1"}
    outdir = tempfile.mkdtemp(prefix="epmoe-fault-")
    procs = []
    t0 = time.monotonic()
    for r in range(world):
        log = open(os.path.join(outdir, f"log{r}.txt"), "w")  # a file, not a pipe: a full pipe would block
        procs.append(subprocess.Popen(
            [sys.executable, FAULT_SCRIPT, dispatcher, where, str(timeout_s), os.path.join(outdir, f"r{r}.txt")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    exits = [None] * world
    while time.monotonic() - t0 < timeout and any(e is None for e in exits):
        for r, p in enumerate(procs):
            if exits[r] is None and p.poll() is not None:
                exits[r] = time.time()
        time.sleep(0.05)
    hung = [r for r, e in enumerate(exits) if e is None]
    for r in hung:  # where it hangs: the worker dumps every thread's stack on SIGUSR1, then it is killed
        try:
            procs[r].send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if hung:
        time.sleep(2.0)
    for r in hung:  # and its native stacks (which C call holds the main thread), appended to its log
        with open(os.path.join(outdir, f"log{r}.txt"), "a") as log:
            log.write(_native_stacks(procs[r].pid))
    for r in hung:
        procs[r].kill()
        procs[r].wait()
    waited = time.monotonic() - t0
    lines, step3_to_exit = [], []
    for r in range(world):
        path = os.path.join(outdir, f"r{r}.txt")
        lines.append(open(path).read().strip() if os.path.exists(path) else f"(no result; rc {procs[r].returncode})")
        step = os.path.join(outdir, f"r{r}.txt.step3")
        t3 = float(open(step).read()) if os.path.exists(step) else None
        step3_to_exit.append(None if t3 is None or exits[r] is None else exits[r] - t3)
    time.sleep(2.0)
    pids = _gpu_pids()
    left = sorted(pids & {p.pid for p in procs}) if pids is not None else None
    logs = [open(os.path.join(outdir, f"log{r}.txt")).read()[-6000:] for r in range(world)]
    return lines, waited, hung, left, logs, [p.returncode for p in procs], step3_to_exit


@pytest.mark.parametrize("dispatcher", ["torch", "flashinfer"])
@pytest.mark.parametrize("world", [2, 4])
def test_rank_killed_mid_step(dispatcher, world):
    if dispatcher == "flashinfer" and not HAS_FI:
        pytest.skip("needs flashinfer-python")
    free_before = torch.cuda.mem_get_info(0)[0]
    lines, waited, hung, left, logs, _, _ = run_fault(world, dispatcher, "forward")
    free_after = torch.cuda.mem_get_info(0)[0]
    print(f"[shared-gpu fault] free GPU memory before {free_before / 2**20:.0f} MiB, after exit "
          f"{free_after / 2**20:.0f} MiB")
    print(f"[shared-gpu fault] ep={world} {dispatcher} kill on entering step 3: waited {waited:.1f}s, hung {hung}, "
          f"GPU pids left {left}")
    for r, line in enumerate(lines):
        print(f"  rank {r}: {line}")
    assert not hung, f"ranks {hung} hung: " + "\n".join(logs)
    for r, line in enumerate(lines[:-1]):
        assert line.startswith("FAULT"), f"rank {r}: {line}\n{logs[r]}"
        assert float(line.split("after=")[1].split("s")[0]) < TIMEOUT_S + 10, line
    assert left == [] or left is None, f"processes still on the GPU: {left}"
    assert free_after >= free_before - 64 * 2**20, "GPU memory not returned after the processes exited"


KERNEL_TIMEOUT_S = 8.0  # the layers' timeout in the kill-inside-the-kernel test (shorter: the run stays < 90 s)


@pytest.mark.requires_flashinfer
@pytest.mark.skipif(not HAS_FI, reason="needs flashinfer-python")
def test_rank_killed_inside_flashinfer_dispatch():
    """The victim dies after the per-call agreement, so the survivor is inside FlashInfer's dispatch kernel
    waiting for its tokens; no host timeout reaches it. The watchdog (epmoe/core/watchdog.py) ends the
    survivor within timeout + grace + slack with exit code 4 and one fault report naming the layer,
    call 4, phase 'dispatch/combine kernel' and the dead rank; nothing hangs and the memory comes back."""
    from epmoe.core.watchdog import WATCHDOG_EXIT_CODE

    lines, codes, took, logs = run_kill_inside_dispatch("flashinfer", timeout=60)
    assert codes[0] == WATCHDOG_EXIT_CODE, f"rank 0: rc {codes[0]}, {lines[0]}\n{logs[0]}"
    assert took[0] is not None and KERNEL_TIMEOUT_S <= took[0] < KERNEL_TIMEOUT_S + KERNEL_GRACE_S + 5, took
    assert_watchdog_report(logs[0])


KERNEL_GRACE_S = min(5.0, max(1.0, KERNEL_TIMEOUT_S / 4))  # the watchdog's wait for the peers' states


def run_kill_inside_dispatch(dispatcher, timeout):
    """2 ranks sharing GPU 0, rank 1 SIGKILLed inside `dispatcher`'s all-to-all call: prints what
    happened and asserts what holds for every dispatcher (nothing hung, the victim died of SIGKILL,
    no process left on the GPU, the memory came back). -> (lines, return codes, step 3 -> exit, logs)."""
    free_before = torch.cuda.mem_get_info(0)[0]
    lines, waited, hung, left, logs, codes, took = run_fault(2, dispatcher, "kernel", timeout=timeout,
                                                             timeout_s=KERNEL_TIMEOUT_S)
    free_after = torch.cuda.mem_get_info(0)[0]
    print(f"[shared-gpu fault] free GPU memory before {free_before / 2**20:.0f} MiB, after {free_after / 2**20:.0f} MiB")
    print(f"[shared-gpu fault] ep=2 {dispatcher} kill inside dispatch: waited {waited:.1f}s, hung {hung}, "
          f"return codes {codes}, step 3 -> exit {took}, GPU pids left {left}")
    for r, line in enumerate(lines):
        print(f"  rank {r}: {line}")
    print(logs[0][-6000:])
    assert not hung, f"ranks {hung} hung (killed by the harness after {waited:.0f}s)\n{logs[0]}"
    assert codes[1] == -9, f"the victim should have SIGKILLed itself: rc {codes[1]}\n{logs[1]}"
    assert left == [] or left is None, f"processes still on the GPU: {left}"
    assert free_after >= free_before - 64 * 2**20, "GPU memory not returned after the processes exited"
    return lines, codes, took, logs


def assert_watchdog_report(log: str, backstop: bool = False) -> None:
    """One report in the watchdog's format: the thread's names the dead rank; the backstop's
    (epmoe/core/backstop.py: the thread could not run) cannot read the peers' states."""
    reports = [ln for ln in log.splitlines() if ln.startswith("epmoe fault report:")]
    assert len(reports) == 1, log
    ranks = "unknown" if backstop else "[1]"
    assert ("layer 'fault-test#0', call 4, phase 'dispatch/combine kernel': rank 0 timed out after "
            f"{KERNEL_TIMEOUT_S:g} s waiting on ranks {ranks}") in reports[0], reports[0]
    if backstop:
        assert "watchdog backstop" in log, log
