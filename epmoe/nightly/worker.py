"""The nightly's multi-rank workers, started under torchrun (one process per rank):

    python -m epmoe.nightly.worker check --dispatcher torch --quant fp8_block ...   # correctness
    python -m epmoe.nightly.worker bench --dispatchers torch,flashinfer ...         # layer vs baseline, dispatch

`check`: steps with a different T per rank (0 included, and batches above the round size), every
output compared on rank 0 with the float64 reference on the weights the kernels see (the quantized
weights, dequantized); activation-quantizing modes within their format's error bound.

`bench`: per dispatcher and tokens per rank, the EPMoE layer and a plain EP MoE (route,
all_to_all_single of the routed rows, one matmul chain per local expert, all_to_all back) are timed in
the same process, alternately, so the ratio between them does not depend on how fast this machine is
today; then the dispatcher's dispatch and combine alone, with the bytes it sent.

Ranks sharing a GPU (`--ranks-per-gpu N`): rank r uses cuda:(local_rank // N) and the process group is
gloo (NCCL refuses two ranks on one device); nothing crosses a link then, so the dispatch figures are
the local cost only.

Planted faults (read here, by the harness, never by the library):
  EPMOE_NIGHTLY_PLANT_SLEEP_MS=MS       every timed forward of one dispatcher's layer sleeps MS first
  EPMOE_NIGHTLY_PLANT_DISPATCHER=NAME   which dispatcher (default: the first one benchmarked)
  EPMOE_NIGHTLY_PLANT_HANG_RANK=R       rank R stops before its first layer call (the others time out)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist

PLANT_SLEEP = "EPMOE_NIGHTLY_PLANT_SLEEP_MS"
PLANT_DISPATCHER = "EPMOE_NIGHTLY_PLANT_DISPATCHER"
PLANT_HANG = "EPMOE_NIGHTLY_PLANT_HANG_RANK"

# Norm-relative error bounds against the float64 reference on the dequantized weights, by what is
# quantized on the way (activations for the GEMMs, tokens on the wire). From tests/cpu/test_quant_modes_layer.py
# (1.5x the worst of 40 seeds); a wrong layout or scale gives errors of order 1.
ACT_BOUND = {"fp8_block": 0.11, "fp8": 0.11, "nvfp4": 0.38, "mxfp8": 0.13}
DTYPE_BOUND = {torch.float32: 1e-5, torch.float64: 1e-9, torch.bfloat16: 2e-2, torch.float16: 1e-2}


# ---------------------------------------------------------------------------- process group
def init_group(device_kind: str, ranks_per_gpu: int, timeout_s: float):
    """Start the default group (torchrun env). Returns (rank, world, device)."""
    import datetime

    from epmoe.launch import env as lenv

    le = lenv.detect_launch_env()
    if device_kind == "cuda":
        torch.cuda.set_device(le.local_rank // ranks_per_gpu)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if le.world_size > 1 and not dist.is_initialized():
        params = inspect.signature(lenv.init_distributed).parameters
        if ranks_per_gpu > 1 and "ranks_per_gpu" in params:  # the launcher's own shared-GPU setup
            lenv.init_distributed(device_kind, timeout_s, ranks_per_gpu=ranks_per_gpu)
        elif device_kind == "cuda" and ranks_per_gpu == 1:
            lenv.init_distributed(device_kind, timeout_s)
        else:
            dist.init_process_group("gloo", rank=le.rank, world_size=le.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
    return le.rank, le.world_size, device


def layer_kwargs(ranks_per_gpu: int) -> dict:
    """EPMoE keyword arguments for the placement: ranks sharing a GPU opt in with shared_gpu=True."""
    if ranks_per_gpu == 1:
        return {}
    from epmoe import EPMoE

    if "shared_gpu" not in inspect.signature(EPMoE.__init__).parameters:
        raise SystemExit(f"--ranks-per-gpu {ranks_per_gpu}: this epmoe has no shared-GPU mode (EPMoE(shared_gpu=...)); "
                         "update epmoe or run one rank per GPU")
    return {"shared_gpu": True}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _maybe_hang(rank: int) -> None:
    if os.environ.get(PLANT_HANG, "") == str(rank):
        print(f"rank {rank}: {PLANT_HANG}={rank}: stopping here (planted hang)", flush=True)
        time.sleep(1e6)


def _die_with_report(e: BaseException) -> None:
    """Print the fault report once and leave without tearing the group down (a peer may be gone)."""
    report = getattr(e, "report", None)
    text = report.format() if report is not None else f"epmoe: {type(e).__name__}: {e}"
    sys.stderr.write(text.rstrip() + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def _config(args, ep: int, dtype: torch.dtype):
    from epmoe import MoEConfig

    return MoEConfig(num_experts=args.experts_per_rank * ep, top_k=args.top_k, hidden_size=args.hidden,
                     intermediate_size=args.inter, dtype=dtype)


def _dtype(args, device) -> torch.dtype:
    from epmoe.config import parse_dtype

    if args.dtype:
        return parse_dtype(args.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# ---------------------------------------------------------------------------- check
def check(args) -> int:
    from epmoe import EPMoE, reference_moe
    from epmoe.core import dist as edist
    from epmoe.launch.synthetic import make_layer
    from epmoe.quant.weights import dequantize_expert_weights, quantize_expert_weights

    rank, ep, device = init_group(args.device, args.ranks_per_gpu, args.timeout)
    dtype = _dtype(args, device)
    cfg = _config(args, ep, dtype)
    synthetic = make_layer(cfg, args.seed, 0)  # the same global weights on every rank
    quant = None if args.quant in (None, "none") else args.quant
    layer = EPMoE(cfg, dispatcher=args.dispatcher, device=device, max_num_tokens_per_rank=args.max_tokens_per_rank,
                  experts=args.experts, quant=quant, dispatch_dtype=args.dispatch_dtype, timeout_s=args.timeout,
                  name=f"EPMoE[check {args.dispatcher}/{args.quant}]", **layer_kwargs(args.ranks_per_gpu))
    layer.load_weights(synthetic.experts)
    plan = layer.plan
    seen = synthetic.experts
    if plan.weight_format != "bf16":
        seen = dequantize_expert_weights(quantize_expert_weights(synthetic.experts.to(dtype=torch.float32),
                                                                 plan.weight_format), torch.float32)
    bound = DTYPE_BOUND[dtype]
    for what in (plan.act_format, plan.dispatch_dtype):
        bound = max(bound, ACT_BOUND.get(what, 0.0))
    if rank == 0:
        print(plan.describe(), flush=True)
        print(f"check: ep={ep} dispatcher={args.dispatcher} mode={plan.expert_mode} dispatch={plan.dispatch_dtype} "
              f"experts={plan.experts_backend} {cfg.num_experts} experts H={cfg.hidden_size} I={cfg.intermediate_size} "
              f"top_k={cfg.top_k} dtype={dtype}; bound {bound:g} (norm-relative)", flush=True)
    gate = synthetic.gate.float()
    worst = 0.0
    failed = []
    _maybe_hang(rank)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 7919 + rank * 131 + step)
        # step 0: rank 1 passes nothing; step 1: above the round size (several rounds); then random
        T = args.tokens if step > 1 else (0 if rank == 1 and step == 0 else args.max_tokens_per_rank * 2 + 3)
        if step > 1:
            T = int(torch.randint(0, 2 * args.tokens + 1, (), generator=g))
        x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
        logits = x.float() @ gate.t()
        y = layer(x.to(device), logits.to(device))
        everything = edist.all_gather_objects((x, logits, y.cpu()))
        if rank == 0:
            xs = torch.cat([e[0] for e in everything])
            if xs.shape[0] == 0:
                continue
            ref = reference_moe(cfg, xs.double(), seen, torch.cat([e[1] for e in everything]))
            ys = torch.cat([e[2] for e in everything]).double()
            err = float((ys - ref).norm() / ref.norm().clamp_min(1e-30)) if torch.isfinite(ys).all() else float("inf")
            worst = max(worst, err)
            ok = err <= bound
            if not ok:
                failed.append(step)
            print(f"  step {step}: tokens per rank {[e[0].shape[0] for e in everything]}: err {err:.3g} "
                  f"{'ok' if ok else 'FAILED'}", flush=True)
    verdict = edist.all_gather_objects(failed)[0]
    layer.dispatcher.close()
    if rank == 0:
        print(f"check {'FAILED' if verdict else 'passed'}: max norm-relative error {worst:.3g} (bound {bound:g}) "
              f"over {args.steps} steps", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"dispatcher": args.dispatcher, "mode": plan.expert_mode, "dispatch_dtype": plan.dispatch_dtype,
                           "experts": plan.experts_backend, "ep_size": ep, "max_err": worst, "bound": bound,
                           "failed_steps": verdict}, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 1 if verdict else 0


# ---------------------------------------------------------------------------- bench
class PlainEPMoE:
    """What a user would write: route, all_to_all_single of the routed (token, expert) rows with
    exchanged split sizes, one matmul chain per local expert, all_to_all back, weighted sum.
    On a gloo group with CUDA tensors (ranks sharing a GPU) the exchanges go through host memory."""

    def __init__(self, cfg, w13, w2, ep_rank: int, ep_size: int, b13=None, b2=None):
        self.cfg, self.w13, self.w2, self.b13, self.b2 = cfg, w13, w2, b13, b2
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.E_local = cfg.num_experts // ep_size
        self.host = ep_size > 1 and dist.get_backend() == "gloo" and w13.is_cuda

    def _a2a(self, out, inp, out_splits=None, in_splits=None):
        if self.host:
            o = out.cpu()
            dist.all_to_all_single(o, inp.cpu(), out_splits, in_splits)
            out.copy_(o)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits)

    def __call__(self, x, logits):
        from epmoe.experts.reference import apply_activation
        from epmoe.routing import route

        cfg, ep = self.cfg, self.ep_size
        r = route(cfg, logits, impl="torch")  # what a user writes: torch ops, not epmoe's fused kernel
        ids = r.topk_ids.reshape(-1).long()
        order = torch.argsort(ids)
        rows = x.repeat_interleave(cfg.top_k, dim=0)[order]
        ids_sorted = ids[order]
        send = torch.bincount(ids_sorted // self.E_local, minlength=ep)
        if ep > 1:
            recv = torch.empty_like(send)
            self._a2a(recv, send)
            sc, rc = send.tolist(), recv.tolist()
            got = rows.new_empty(sum(rc), cfg.hidden_size)
            self._a2a(got, rows, rc, sc)
            gid = ids_sorted.new_empty(sum(rc))
            self._a2a(gid, ids_sorted, rc, sc)
        else:
            got, gid = rows, ids_sorted
        counts = torch.bincount(gid - self.ep_rank * self.E_local, minlength=self.E_local).tolist()
        out = torch.empty_like(got)
        start = 0
        for e, c in enumerate(counts):
            if c:
                h = got[start:start + c] @ self.w13[e].t()
                if self.b13 is not None:
                    h = h + self.b13[e]
                y = apply_activation(cfg, h) @ self.w2[e].t()
                if self.b2 is not None:
                    y = y + self.b2[e]
                out[start:start + c] = y
            start += c
        if ep > 1:
            back = torch.empty_like(rows)
            self._a2a(back, out, sc, rc)
        else:
            back = out
        unsorted = torch.empty_like(back)
        unsorted[order] = back
        y = unsorted.view(-1, cfg.top_k, cfg.hidden_size).float()
        return (y * r.topk_weights.unsqueeze(-1)).sum(dim=1).to(cfg.dtype)


class Planted:
    """Wraps a layer for the planted faults: sleeps `sleep_ms` before every call (the slowdown the
    gate must catch); with `hang`, stops for good at the first call (its peers must time out)."""

    def __init__(self, layer, sleep_ms: float = 0.0, hang: bool = False, rank: int = 0):
        self.layer, self.sleep_ms, self.hang, self.rank = layer, sleep_ms, hang, rank

    def __call__(self, *a, **k):
        if self.hang:
            _maybe_hang(self.rank)
        if self.sleep_ms:
            time.sleep(self.sleep_ms / 1e3)
        return self.layer(*a, **k)


def _timed(fn, device) -> float:
    _sync(device)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _max_over_ranks(values: List[float]) -> List[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() != "gloo":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def bench(args) -> int:
    from epmoe import EPMoE, ExpertWeights
    from epmoe.routing import route

    rank, ep, device = init_group(args.device, args.ranks_per_gpu, args.timeout)
    dtype = _dtype(args, device)
    cfg = _config(args, ep, dtype)
    E_local, H, I = args.experts_per_rank, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(1234 + rank)

    def rnd(*s, scale):
        return (torch.randn(*s, generator=g) * scale).to(dtype=dtype).to(device)

    w1, w3, w2 = rnd(E_local, I, H, scale=H ** -0.5), rnd(E_local, I, H, scale=H ** -0.5), rnd(E_local, H, I, scale=I ** -0.5)
    local = ExpertWeights(w1=w1, w3=w3, w2=w2, first_expert=rank * E_local)
    plain = PlainEPMoE(cfg, torch.cat([w1, w3], 1), w2, rank, ep)
    dispatchers = [d for d in args.dispatchers.split(",") if d]
    plant_ms = float(os.environ.get(PLANT_SLEEP, "0") or 0)
    plant_target = os.environ.get(PLANT_DISPATCHER) or dispatchers[0]
    meta = {"ep_size": ep, "ranks_per_gpu": args.ranks_per_gpu, "device": str(device), "dtype": str(dtype),
            "config": cfg.to_dict(), "experts_per_rank": E_local, "iters": args.iters, "warmup": args.warmup,
            "plant": {"sleep_ms": plant_ms, "dispatcher": plant_target} if plant_ms else None}
    if rank == 0:
        print(f"bench: ep={ep} ({'gloo' if not dist.is_initialized() or dist.get_backend() == 'gloo' else 'nccl'} on "
              f"{device}, {args.ranks_per_gpu} rank(s) per GPU) E={cfg.num_experts} H={H} I={I} top_k={cfg.top_k} "
              f"{dtype}; dispatchers {dispatchers}; tokens/rank {args.tokens}", flush=True)
        if plant_ms:
            print(f"bench: PLANTED slowdown: {plant_ms:g} ms sleep before every {plant_target} layer call", flush=True)
    rows, errors = [], {}
    for name in dispatchers:
        try:
            layer = EPMoE(cfg, dispatcher=name, device=device, experts=args.experts,
                          max_num_tokens_per_rank=max(args.tokens), timeout_s=args.timeout, name=f"EPMoE[bench {name}]",
                          **layer_kwargs(args.ranks_per_gpu))
            layer.load_weights(local)
        except Exception as e:  # noqa: BLE001 - report and go on with the other dispatchers
            from epmoe.core.fault import CollectiveFailure

            if isinstance(e, CollectiveFailure) or len(dispatchers) == 1:
                raise  # one dispatcher per step (the nightly): the step's status says it (skipped or failed)
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            if rank == 0:
                print(f"bench: {name}: cannot build ({errors[name]})", flush=True)
            continue
        fwd = Planted(layer, plant_ms if name == plant_target else 0.0, hang=True, rank=rank)
        for T in args.tokens:
            sets = []
            for _ in range(3):
                x = torch.randn(T, H, generator=g).to(dtype=dtype).to(device)
                sets.append((x, torch.randn(T, cfg.num_experts, generator=g).to(device)))
            t_base, t_layer, t_disp, t_comb = [], [], [], []
            sent = 0
            with torch.no_grad():
                for i in range(args.warmup + args.iters):
                    s = sets[i % len(sets)]
                    tb = _timed(lambda: plain(*s), device)  # alternate, so drift hits both alike
                    tl = _timed(lambda: fwd(*s), device)
                    r = route(cfg, s[1])
                    box = {}
                    td = _timed(lambda: box.update(zip(("tokens", "handle"), layer.dispatcher.dispatch(s[0], r.topk_ids, r.topk_weights))), device)
                    y = layer.experts(box["tokens"])
                    tc = _timed(lambda: layer.dispatcher.combine(y, box["handle"]), device)
                    if i >= args.warmup:
                        t_base.append(tb)
                        t_layer.append(tl)
                        t_disp.append(td)
                        t_comb.append(tc)
                        sent = int(box["handle"].bytes_sent)
            # per iteration the slowest rank counts; then the median over iterations
            n = len(t_base)
            allt = _max_over_ranks(t_base + t_layer + t_disp + t_comb)
            tb, tl, td, tc = (statistics.median(allt[k * n:(k + 1) * n]) for k in range(4))
            # the ratio of each back-to-back pair, then the median: drift of the machine cancels
            ratio = statistics.median(l / b for b, l in zip(allt[:n], allt[n:2 * n]) if b > 0) if tb > 0 else float("nan")
            sent_all = _max_over_ranks([float(sent)])[0]
            row = {"dispatcher": name, "tokens_per_rank": T, "baseline_ms": tb, "layer_ms": tl,
                   "layer_vs_baseline": ratio, "dispatch_us": td * 1e3,
                   "combine_us": tc * 1e3, "dispatch_bytes_max_rank": int(sent_all),
                   "dispatch_gbps": sent_all / (td * 1e6) if td > 0 else 0.0}
            rows.append(row)
            if rank == 0:
                print(f"bench: {name:10s} T={T:5d}: baseline {tb:8.3f} ms  layer {tl:8.3f} ms ({row['layer_vs_baseline']:.2f}x "
                      f"the baseline)  dispatch {td * 1e3:8.1f} us  combine {tc * 1e3:8.1f} us  "
                      f"{sent_all / 1024:.1f} KiB sent ({row['dispatch_gbps']:.2f} GB/s)", flush=True)
        layer.dispatcher.close()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "errors": errors}, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------- CLI
def parse(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(prog="python -m epmoe.nightly.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["check", "bench"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ranks-per-gpu", type=int, default=1)
    p.add_argument("--dispatcher", default="torch", help="check: the dispatcher")
    p.add_argument("--dispatchers", default="torch", help="bench: comma list")
    p.add_argument("--quant", default="none", help="check: expert quant mode (none: unquantized)")
    p.add_argument("--dispatch-dtype", default="auto")
    p.add_argument("--experts", default="auto", help="experts backend")
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tokens", default="24", help="check: mean tokens per rank; bench: comma list")
    p.add_argument("--max-tokens-per-rank", type=int, default=32, help="check: the round size")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    toks = [int(t) for t in a.tokens.split(",") if t]
    if not toks or any(t < 0 for t in toks):
        p.error(f"--tokens {a.tokens!r}: give non-negative integers")
    a.tokens = toks if a.what == "bench" else toks[0]
    if a.ranks_per_gpu < 1:
        p.error(f"--ranks-per-gpu {a.ranks_per_gpu}: must be >= 1")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    from epmoe.core.fault import CollectiveFailure

    args = parse(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        return check(args) if args.what == "check" else bench(args)
    except CollectiveFailure as e:
        _die_with_report(e)
    return 1


if __name__ == "__main__":
    sys.exit(main())
