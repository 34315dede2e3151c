"""GPU time of the routing launch that also aligns (`Router.route_aligned`: `route_align_kernel`, one
program) against the two launches it replaces (the fused routing kernel, then the one-program
alignment `align_small_kernel`), measured in the same run: CUDA events around `reps` calls queued behind
a sleep kernel (the host is ahead, so the span is the kernels' own time back to back), per call. The one program
routes all T rows one block after another, so its GPU time grows with T where the routing kernel's
programs run side by side; in the layer it overlaps the host's work up to the gemm1 launch
(benchmarks/host_timeline.py shows both on one clock). Needs a GPU.

    python benchmarks/bench_route_align.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def measure(routing: str, E: int, K: int, T: int, block_m: int, reps: int) -> dict:
    from epmoe.config import MoEConfig
    from epmoe.experts.triton import align as A
    from epmoe.experts.triton.launch import KernelLauncher
    from epmoe.routing import Router

    extra = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5) if routing == "sigmoid_grouped" else {}
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16,
                    routing=routing, **extra)
    dev = torch.device("cuda")
    router = Router(cfg, dev)
    launch = KernelLauncher(dev)
    logits = torch.randn(T, E, device=dev)
    bias = torch.randn(E, device=dev) * 0.1 if routing == "sigmoid_grouped" else None

    def fused():
        router.route_aligned(logits, bias, E, block_m)

    def two():
        r = router(logits, bias)
        A.align_blocks_triton(r.topk_ids, E, block_m, launch)

    out = {"routing": routing, "num_experts": E, "top_k": K, "tokens": T, "block_m": block_m}
    for name, fn in (("two_launches", two), ("route_aligned", fused), ("two_launches_again", two)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # ~25 ms: every call below is queued before the GPU reaches them
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out[f"{name}_us"] = start.elapsed_time(end) * 1e3 / reps
    out["fused_over_two"] = out["route_aligned_us"] / min(out["two_launches_us"], out["two_launches_again_us"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = []
    for routing, E, K in (("softmax", 128, 8), ("softmax", 256, 8), ("sigmoid_grouped", 256, 8)):
        for T in (1, 16, 64, 128):
            try:
                results.append(measure(routing, E, K, T, 16, args.reps))
            except Exception as e:  # noqa: BLE001 - one case must not lose the others
                results.append({"routing": routing, "num_experts": E, "tokens": T, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(results[-1]), file=sys.stderr)
    report = {"bench": "route_align", "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "results": results}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
