"""Where an experts backend's time goes: the CUDA kernels of one forward at the DeepSeek-V3 expert shape
(128 local experts, H 7168, I 2048, top-8, uniform routing as bench_experts), from torch.profiler.

    python benchmarks/profile_experts.py --backend deepgemm --mode fp8_block --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="deepgemm")
    ap.add_argument("--mode", default="fp8_block")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from epmoe.config import MoEConfig
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts import EXPERTS
    from epmoe.experts.base import ExpertsSpec
    from epmoe.quant.plan import QuantPlan
    from tests import experts_testing as T

    dev = torch.device("cuda")
    E, K = args.experts, args.top_k
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=args.hidden, intermediate_size=args.inter)
    ex = EXPERTS.get(args.backend)(ExpertsSpec(cfg, 0, 1, dev, plan=QuantPlan(expert_mode=args.mode)))
    ex.load_weights(T.random_expert_weights(cfg, E, device=dev, seed=0))
    x = torch.randn(args.tokens, args.hidden, device=dev).bfloat16()
    ids, w = T.random_local_routing(args.tokens, K, E, dev, 101)
    tokens = DispatchedTokens(x, ids, w)
    for _ in range(3):
        ex(tokens)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            ex(tokens)
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows[ev.key] = rows.get(ev.key, 0.0) + t / args.iters / 1000.0
    total = sum(rows.values())
    print(f"{args.backend} {args.mode} T={args.tokens}: {total:.3f} ms of kernels per forward")
    for k, ms in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.3f} ms  {k[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
