"""Training benchmark of the experts stage: forward + backward at the DeepSeek-V3 shape per rank (128 local
experts, H=7168, I=2048, top-8, T=4096 tokens, every routed entry local, uniform random routing), bf16.

    python benchmarks/bench_training.py                # GPU run, JSON on stdout and in $OUT/bench_training.json
    python benchmarks/bench_training.py --dry-run      # the plan, no GPU
    python benchmarks/bench_training.py --device cpu --experts 8 --top-k 2 --hidden 64 --inter 32 --tokens 16
                                                       # a tiny float32 run on CPU (checks the script;
                                                       # TRITON_INTERPRET=1: the Triton kernels too)

Rows (same run, same inputs, same output gradient):
  epmoe             `fused_grouped_mm_train_forward` (what experts 'grouped_mm' runs with gradients where
                    Triton runs): sort by expert, Triton gather, torch._grouped_mm, Triton activation
                    (fp32 -> bf16), torch._grouped_mm, Triton weighted sum (fp32), each with a Triton
                    backward kernel; the GEMMs keep torch's autograd (CPU: the torch composite below)
  epmoe_torch       `grouped_mm_train_forward`, the torch composite of the same arithmetic
                    (grouped_mm_epilogue=torch, and what models with expert biases run)
  epmoe_recompute   epmoe under torch.utils.checkpoint (TrainingConfig(recompute_experts=True))
  peer_torch_bf16   torch's grouped GEMMs run the same way in plain bf16 (activation and weighted sum
                    in bf16, the torchtitan-style composite): the same two torch._grouped_mm per pass
Each row: forward ms, forward + backward ms (CUDA events, median of --iters after --warmup), peak
memory above the inputs and weights (MiB), and its gradients' max relative difference from epmoe's
(hidden, weights, w13, w2). FLOPs: 3 x 2 x entries x (2*I*H + H*I) (forward + the two backward GEMMs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_inputs(E, H, I, K, T, dtype, device, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)  # K distinct experts per token
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    gd = torch.Generator(device=device).manual_seed(seed)  # the big tensors made on the device
    x = torch.randn(T, H, generator=gd, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gd, device=device, dtype=dtype) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gd, device=device, dtype=dtype) * I ** -0.5).to(dtype)
    gout = torch.randn(T, H, generator=gd, device=device).to(dtype)
    return dict(ids=ids.to(device), weights=weights.to(device), x=x, w13=w13, w2=w2, gout=gout)


def peer_forward(x, ids, weights, w13, w2, E, I):
    """torch's grouped GEMMs in plain bf16 (activation and weighted sum in the model dtype)."""
    import torch

    N, K = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    token = order // K
    h = torch._grouped_mm(x.index_select(0, token), w13.transpose(1, 2), offs=offs)
    a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1).index_select(0, order).to(y.dtype).unsqueeze(1)
    return torch.zeros(N, x.shape[1], dtype=x.dtype, device=x.device).index_add(0, token, y)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=128, help="local experts")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rows", default="epmoe,epmoe_torch,epmoe_recompute,peer_torch_bf16")
    ap.add_argument("--json", default=None, help="output JSON (default $OUT/bench_training.json or bench_results/)")
    args = ap.parse_args(argv)
    E, H, I, K, T = args.experts, args.hidden, args.inter, args.top_k, args.tokens
    rows = [r for r in args.rows.split(",") if r]
    known = ("epmoe", "epmoe_torch", "epmoe_recompute", "peer_torch_bf16")
    unknown = [r for r in rows if r not in known]
    if unknown:
        ap.error(f"unknown row {unknown[0]!r}; rows: {', '.join(known)}")
    flops = 3 * 2 * T * K * (2 * I * H + H * I)
    print(f"plan: experts stage forward + backward, E_local={E} H={H} I={I} top_k={K} T={T}, rows {rows}, "
          f"{flops / 1e12:.2f} TFLOP per forward + backward", flush=True)
    if args.dry_run:
        return 0

    import torch
    from torch.utils.checkpoint import checkpoint

    from epmoe import MoEConfig
    from epmoe.experts.triton.grouped_mm import fused_grouped_mm_train_forward, grouped_mm_train_forward
    from epmoe.experts.triton.launch import KernelLauncher

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # torch._grouped_mm on CPU: float32
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=dtype)
    inp = make_inputs(E, H, I, K, T, dtype, dev)

    def leaves():  # the same tensors for every row (no second copy of the weights); grads reset per call
        return tuple(inp[k].requires_grad_() for k in ("x", "weights", "w13", "w2"))

    def rel_diff(a, b) -> float:  # chunked: no full float32 copy of a weight gradient
        num = den = 0.0
        for ca, cb in zip(a.split(1), b.split(1)):
            num = max(num, float((ca.float() - cb.float()).abs().max()))
            den = max(den, float(cb.float().abs().max()))
        return round(num / max(den, 1e-30), 5)

    def run_torch(x, w, w13, w2):
        return grouped_mm_train_forward(x, inp["ids"], w, {"w13": w13, "w2": w2}, cfg, E)

    from epmoe.experts.triton.launch import interpreter_enabled

    # the Triton kernels on a GPU, or on CPU under the interpreter (TRITON_INTERPRET=1: checks the script)
    launcher = KernelLauncher(dev) if dev.type == "cuda" or interpreter_enabled() else None

    def run_epmoe(x, w, w13, w2):
        if launcher is None:  # no Triton on this device: the composite
            return run_torch(x, w, w13, w2)
        return fused_grouped_mm_train_forward(x, inp["ids"], w, {"w13": w13, "w2": w2}, cfg, E, launcher)

    fns = {
        "epmoe": run_epmoe,
        "epmoe_torch": run_torch,
        "epmoe_recompute": lambda x, w, w13, w2: checkpoint(run_epmoe, x, w, w13, w2, use_reentrant=False),
        "peer_torch_bf16": lambda x, w, w13, w2: peer_forward(x, inp["ids"], w, w13, w2, E, I),
    }

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e)
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    results = {}
    grads = {}
    for name in rows:
        fn = fns[name]
        x, w, w13, w2 = leaves()

        def fwd():
            with torch.no_grad():
                fn(x, w, w13, w2)

        def fwd_bwd():
            for t in (x, w, w13, w2):
                t.grad = None
            fn(x, w, w13, w2).backward(inp["gout"])

        for _ in range(args.warmup):
            fwd_bwd()
        sync()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        fb = [timed(fwd_bwd) for _ in range(args.iters)]
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda" else None
        f = [timed(fwd) for _ in range(args.iters)]
        g = [t.grad for t in (x, w, w13, w2)]
        if "epmoe" not in grads:
            grads["epmoe"] = g if name == "epmoe" else None
        if grads.get("epmoe") is not None:
            results_diff = {k: rel_diff(a, b) for k, a, b in zip(("hidden", "weights", "w13", "w2"), g, grads["epmoe"])}
        else:
            results_diff = None
        for t in (x, w, w13, w2):
            t.grad = None
        ms = statistics.median(fb)
        results[name] = dict(forward_ms=round(statistics.median(f), 3), forward_backward_ms=round(ms, 3),
                             tflops=round(flops / (ms * 1e-3) / 1e12, 1), peak_extra_mib=None if peak is None else round(peak),
                             grad_max_rel_diff_vs_epmoe=results_diff)
        print(f"{name:16s} forward {results[name]['forward_ms']:8.3f} ms   forward+backward {ms:8.3f} ms   "
              f"{results[name]['tflops']:6.1f} TFLOP/s   peak +{results[name]['peak_extra_mib']} MiB", flush=True)
        del g
    if "epmoe" in results and "peer_torch_bf16" in results:
        results["ratio_epmoe_over_peer"] = round(results["epmoe"]["forward_backward_ms"]
                                                 / results["peer_torch_bf16"]["forward_backward_ms"], 3)
    report = dict(shape=dict(E_local=E, H=H, I=I, top_k=K, T=T), device=str(torch.cuda.get_device_name(dev))
                  if dev.type == "cuda" else "cpu", torch=torch.__version__, dtype=str(dtype), results=results)
    text = json.dumps(report, indent=1)
    print(text)
    path = args.json or os.path.join(os.environ.get("OUT", "bench_results"), "bench_training.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
