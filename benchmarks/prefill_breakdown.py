"""Where an expert-stage forward's device time goes, launch by launch, and same-run A/B of backend
knobs (one GPU). DeepSeek-V3 expert shape (128 local experts, H 7168, I 2048, top-8), uniform routing
(--routing skewed: very unequal experts), triton experts, auto presets.

    python benchmarks/prefill_breakdown.py                               # bf16, nvfp4, mxfp4 at T = 4096
    python benchmarks/prefill_breakdown.py --modes nvfp4_w4a16 --variants base,register_scales --rounds 5

Per (mode, variant): the forward's time (CUDA events around --iters back-to-back forwards, rotating
among 3 input sets, median of --rounds rounds taken in alternating order with the other variants of
the mode), and the device time of each launch of one forward from the torch profiler (median over 5
forwards), in launch order. Every variant's output is compared with the mode's first variant's
(`equal` bit for bit, else the largest absolute difference).

Variants (module knobs of `epmoe.experts.triton.triton_experts`, set for the variant and restored after):
  base             the defaults
  register_scales  the wgmma kernel's scales loaded from global memory one K step ahead into registers
                   (WGMMA_SCALE_RING off) instead of through its cp.async ring
  torch_permute    gemm1's tokens put in the wgmma kernel's K order by torch ops (`gluon_w4a16.permute_k`)
                   instead of `permute_k_kernel`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {
    "base": {},
    "register_scales": {"WGMMA_SCALE_RING": False},
    "torch_permute": {"_torch_permute": True},
}


class knobs:
    """Set module attributes of triton_experts (and, "_torch_permute", the backend's K permutation by torch
    ops) for a with-block, restore them after."""

    def __init__(self, values: dict, ex=None):
        from epmoe.experts.triton import triton_experts as TE

        self.mod, self.values, self.saved, self.ex = TE, values, {}, ex

    def __enter__(self):
        for k, v in self.values.items():
            if k == "_torch_permute":
                from epmoe.experts.triton.gluon_w4a16 import permute_k

                self.ex._permute_k = permute_k
            else:
                self.saved[k] = getattr(self.mod, k)
                setattr(self.mod, k, v)

    def __exit__(self, *exc):
        self.ex.__dict__.pop("_permute_k", None)
        for k, v in self.saved.items():
            setattr(self.mod, k, v)


def build(mode: str, E: int, H: int, I: int, K: int, dev):
    from epmoe.config import MoEConfig
    from epmoe.experts import EXPERTS
    from epmoe.experts.base import ExpertsSpec
    from epmoe.quant.plan import QuantPlan
    from tests import experts_testing as X

    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=torch.bfloat16)
    w = X.random_expert_weights(cfg, E, device=dev, seed=0)
    ex = EXPERTS.get("triton")(ExpertsSpec(cfg, 0, 1, dev, plan=QuantPlan(expert_mode=mode)))
    ex.load_weights(w)
    del w
    torch.cuda.empty_cache()
    return ex


def inputs(T: int, H: int, K: int, E: int, dev, routing: str, n: int = 3):
    from epmoe.dispatch.base import DispatchedTokens
    from tests import experts_testing as X

    out = []
    for s in range(n):
        g = torch.Generator(device=dev).manual_seed(100 + s)
        x = torch.randn(T, H, generator=g, device=dev).bfloat16()
        if routing == "skewed":
            ids, tw = X.skewed_local_routing(T, K, E, dev, seed=200 + s)
        else:
            ids, tw = X.random_local_routing(T, K, E, dev, seed=200 + s)
        out.append(DispatchedTokens(x, ids, tw))
    return out


def timed(ex, ins, iters: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for i in range(iters):
        ex(ins[i % len(ins)])
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def launches(ex, inp, forwards: int = 5) -> list:
    """[(kernel name, median device us)] of one forward, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            ex(inp)
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    ev.sort(key=lambda e: e.time_range.start)
    n = len(ev) // forwards
    rows = []
    for i in range(n):
        times = [ev[f * n + i].device_time for f in range(forwards) if f * n + i < len(ev)]
        rows.append((ev[i].name[:60], statistics.median(times)))
    return rows


def tail_stats(ex, inp) -> dict:
    """Tiles of the forward's alignment (wgmma presets: how many go to the decode kernel)."""
    cfg = ex.tile_config(inp.topk_ids.numel())
    if not cfg.tail_rows:
        return {"preset": cfg.name}
    ids32 = inp.topk_ids.to(torch.int32).contiguous()
    blocks = ex._align(ids32, cfg)
    tails = ex._tail_tiles(blocks, cfg)
    torch.cuda.synchronize()
    return {"preset": cfg.name, "tiles": int((blocks.block_expert >= 0).sum()),
            "big_tiles": int((tails.block_expert >= 0).sum()), "tail_sub_tiles": int((tails.tail_expert >= 0).sum()),
            "tail_rows": int(tails.tail_rows.sum()), "sub_m": tails.sub_m}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="bf16,nvfp4_w4a16,mxfp4_w4a16")
    ap.add_argument("--variants", default="base", help=",".join(VARIANTS))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routing", default="uniform", choices=("uniform", "skewed"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    E, H, I, K, T = args.experts, 7168, 2048, 8, args.tokens
    names = args.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            ap.error(f"unknown variant {n!r}; known: {', '.join(VARIANTS)}")
    ins = inputs(T, H, K, E, dev, args.routing)
    report = {"bench": "prefill_breakdown", "device": torch.cuda.get_device_name(), "tokens": T,
              "routing": args.routing, "torch": torch.__version__, "results": []}
    for mode in args.modes.split(","):
        ex = build(mode, E, H, I, K, dev)
        ref = None
        per = {n: {"mode": mode, "variant": n, "ms": []} for n in (names if mode != "bf16" else ["base"])}
        for n, r in per.items():
            with knobs(VARIANTS[n], ex):
                out = ex(ins[0])
                torch.cuda.synchronize()
                if ref is None:
                    ref = out
                    r["vs_first"] = "reference"
                else:
                    r["vs_first"] = ("equal" if torch.equal(out, ref)
                                     else f"max abs diff {(out.float() - ref.float()).abs().max().item():.3g}")
                timed(ex, ins, 5)
                r["launches_us"] = launches(ex, ins[0])
                r["tiles"] = tail_stats(ex, ins[0])
        order = list(per)
        for rd in range(args.rounds):
            for n in (order if rd % 2 == 0 else order[::-1]):
                with knobs(VARIANTS[n], ex):
                    per[n]["ms"].append(timed(ex, ins, args.iters))
        for n, r in per.items():
            r["ms_median"] = statistics.median(r["ms"])
            print(f"== {mode} {n}: {r['ms_median']:.3f} ms (rounds {', '.join(f'{m:.3f}' for m in r['ms'])}); "
                  f"output vs {order[0]}: {r['vs_first']}; tiles {r['tiles']}", flush=True)
            tot = sum(t for _, t in r["launches_us"])
            for name, us in r["launches_us"]:
                print(f"     {us:9.1f} us  {name}")
            print(f"     {tot:9.1f} us  sum of launches")
            report["results"].append(r)
        del ex, ref
        torch.cuda.empty_cache()
    path = args.json or os.path.join(os.environ.get("OUT", "bench_results"), "prefill_breakdown.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
