"""DeepGEMM as a peer of the expert stage: the grouped GEMMs SGLang and vLLM call for DeepSeek-V3 on
Hopper, on the same routed rows as the other peers of `bench_experts.py`.

    python benchmarks/deepgemm_peer.py            # check against torch, then time (needs deep_gemm)

Per phase, with the benchmark routing's per-expert counts (gate-up [E, 2I, H], then down [E, H, I]):

  prefill  `m_grouped_fp8_gemm_nt_contiguous` (FP8 e4m3, activations 1x128 / weights 128x128 fp32
           scales, the DeepSeek-V3 recipe on SM90) and `m_grouped_bf16_gemm_nt_contiguous`: every
           expert's rows padded to DeepGEMM's M alignment (`get_mk_alignment_for_contiguous_layout`),
           `m_indices` = expert of each padded row (-1 for padding).
  decode   `m_grouped_fp8_gemm_nt_masked`: [E, max_m, H] per expert, `masked_m` = the counts.

Timed apart: "gemms" = the two GEMMs on inputs already in DeepGEMM's layout (what `bench_experts`
calls the GEMMs of a peer) and "prep" = what a caller must do first for the first GEMM: pad rows per
expert into the layout and quantize them to FP8 (1x128). The SwiGLU + re-quantization between the
two GEMMs is in neither. FLOPs count useful rows only, as in `bench_experts`.

deep_gemm is built from its public source (https://github.com/deepseek-ai/DeepGEMM) and compiles
its kernels at run time with the machine's CUDA compiler; nothing here builds it.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load():
    """deep_gemm, or None (with the reason printed)."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - a broken build is "not available", said once
        print(f"deepgemm peer: not available ({type(e).__name__}: {str(e)[:200]})")
        return None
    return deep_gemm


def masked_fp8(dg):
    """The masked FP8 grouped GEMM (sgl-deep-gemm 0.1.2 names it only m_grouped_fp8_fp4_gemm_nt_masked)."""
    return getattr(dg, "m_grouped_fp8_gemm_nt_masked", None) or dg.m_grouped_fp8_fp4_gemm_nt_masked


def fp8_rows(x):
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, K/128]): 1x128 groups, DeepGEMM's activation recipe
    (epmoe's FP8 block codec; a tuple as DeepGEMM takes it)."""
    from epmoe.quant import fp8_block

    return tuple(fp8_block.quantize_activation(x))


def fp8_blocks(w):
    """[E, N, K] -> (e4m3 [E, N, K], fp32 scales [E, N/128, K/128]): 128x128 weight blocks."""
    from epmoe.quant import fp8_block

    return tuple(fp8_block.quantize_weight(w))


def contiguous_layout(counts, align: int):
    """Per-expert counts [E] -> (m_indices [M_pad] int32, dst [sum(counts)] int64): rows of expert e
    go to its aligned block; padding rows carry -1."""
    import torch

    dev = counts.device
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    m_indices = torch.repeat_interleave(torch.arange(len(counts), device=dev, dtype=torch.int32), padded)
    pos = torch.arange(int(padded.sum()), device=dev) - torch.repeat_interleave(starts, padded)
    m_indices[pos >= torch.repeat_interleave(counts, padded)] = -1
    src_starts = torch.cumsum(counts, 0) - counts
    dst = torch.repeat_interleave(starts - src_starts, counts) + torch.arange(int(counts.sum()), device=dev)
    return m_indices, dst


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def measure(dev, E: int, H: int, I: int, K: int, phases, routing: Callable, flops_per_entry: int,
            bench: Callable, dg=None, on_row: Optional[Callable] = None) -> List[dict]:
    """Peer rows like `bench_experts.measure_peers`: name, phase, num_tokens, ms (GEMMs), tflops,
    prep_ms, check (max rel err of each GEMM against torch on the same quantized inputs)."""
    import torch

    dg = dg or load()
    if dg is None:
        return []
    out: List[dict] = []
    g = torch.Generator(device=dev).manual_seed(11)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
    w13_8, w2_8 = fp8_blocks(w13), fp8_blocks(w2)
    align = int(dg.get_mk_alignment_for_contiguous_layout())

    def check_fp8(a, b, d, m_indices, rows=256):
        """d == dequantized a @ dequantized b.T on the first `rows` rows of two experts."""
        errs = []
        for e in (0, E - 1):
            r = (m_indices == e).nonzero().flatten()[:rows]
            if r.numel() == 0:
                continue
            a_e = a[0][r].float() * a[1][r].repeat_interleave(128, 1)
            b_e = b[0][e].float() * b[1][e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            errs.append(_rel(d[r], a_e @ b_e.T))
        return max(errs) if errs else float("nan")

    for phase, T in phases:
        M = T * K
        ids = routing(T)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E)[:E]
        x = torch.randn(M, H, generator=g, device=dev, dtype=torch.bfloat16)
        act = torch.randn(M, I, generator=g, device=dev, dtype=torch.bfloat16)
        if phase == "prefill":
            m_indices, dst = contiguous_layout(counts, align)
            Mp = m_indices.numel()

            def prep():  # rows grouped by expert -> padded layout, quantized (first GEMM's input)
                xp = torch.zeros(Mp, H, device=dev, dtype=torch.bfloat16)
                xp[dst] = x
                return fp8_rows(xp)

            a1 = prep()
            ap = torch.zeros(Mp, I, device=dev, dtype=torch.bfloat16)
            ap[dst] = act
            a2 = fp8_rows(ap)
            d1 = torch.empty(Mp, 2 * I, device=dev, dtype=torch.bfloat16)
            d2 = torch.empty(Mp, H, device=dev, dtype=torch.bfloat16)

            def fp8_gemms():
                dg.m_grouped_fp8_gemm_nt_contiguous(a1, w13_8, d1, m_indices, disable_ue8m0_cast=True)
                dg.m_grouped_fp8_gemm_nt_contiguous(a2, w2_8, d2, m_indices, disable_ue8m0_cast=True)

            xb = torch.zeros(Mp, H, device=dev, dtype=torch.bfloat16)
            xb[dst] = x

            def bf16_gemms():
                dg.m_grouped_bf16_gemm_nt_contiguous(xb, w13, d1, m_indices)
                dg.m_grouped_bf16_gemm_nt_contiguous(ap, w2, d2, m_indices)

            variants = [("deepgemm fp8 contiguous", fp8_gemms, prep,
                         lambda: max(check_fp8(a1, w13_8, d1, m_indices), check_fp8(a2, w2_8, d2, m_indices))),
                        ("deepgemm bf16 contiguous", bf16_gemms, None,
                         lambda: _rel(d1[m_indices == 0][:256], xb[m_indices == 0][:256].float() @ w13[0].float().T))]
        else:
            max_m = max(align, int((int(counts.max()) + align - 1) // align * align))
            order = torch.argsort(ids.reshape(-1).long(), stable=True)
            starts = torch.cumsum(counts, 0) - counts
            slot = torch.arange(M, device=dev) - torch.repeat_interleave(starts, counts)
            e_of = torch.repeat_interleave(torch.arange(E, device=dev), counts)
            masked_m = counts.to(torch.int32)
            expected_m = max(1, -(-M // E))

            def prep():
                xm = torch.zeros(E, max_m, H, device=dev, dtype=torch.bfloat16)
                xm[e_of, slot] = x[order]
                q, s = fp8_rows(xm.view(E * max_m, H))
                return q.view(E, max_m, H), s.view(E, max_m, H // 128)

            a1 = prep()
            am = torch.zeros(E, max_m, I, device=dev, dtype=torch.bfloat16)
            am[e_of, slot] = act[order]
            q, s = fp8_rows(am.view(E * max_m, I))
            a2 = (q.view(E, max_m, I), s.view(E, max_m, I // 128))
            d1 = torch.empty(E, max_m, 2 * I, device=dev, dtype=torch.bfloat16)
            d2 = torch.empty(E, max_m, H, device=dev, dtype=torch.bfloat16)

            def fp8_gemms():
                masked_fp8(dg)(a1, w13_8, d1, masked_m, expected_m, disable_ue8m0_cast=True)
                masked_fp8(dg)(a2, w2_8, d2, masked_m, expected_m, disable_ue8m0_cast=True)

            def check():
                e = int(torch.argmax(counts))
                n = int(counts[e])
                a_e = a1[0][e, :n].float() * a1[1][e, :n].repeat_interleave(128, 1)
                b_e = w13_8[0][e].float() * w13_8[1][e].repeat_interleave(128, 0).repeat_interleave(128, 1)
                return _rel(d1[e, :n], a_e @ b_e.T)

            variants = [("deepgemm fp8 masked", fp8_gemms, prep, check)]
        for name, fn, prep_fn, check_fn in variants:
            row = dict(name=name, phase=phase, num_tokens=T)
            try:
                fn()
                torch.cuda.synchronize()
                row["check"] = check_fn()
                row["ms"] = bench(fn)
                row["tflops"] = M * flops_per_entry / (row["ms"] * 1e-3) / 1e12
                if prep_fn is not None:
                    row["prep_ms"] = bench(prep_fn)
            except Exception as e:  # noqa: BLE001 - one failing peer must not lose the others
                print(f"peer {name} {phase} failed: {type(e).__name__}: {str(e)[:300]}")
                row.update(ms=float("nan"), tflops=float("nan"), note=str(e)[:300])
            out.append(row)
            if on_row is not None:
                on_row(out)
            if row["ms"] == row["ms"]:
                extra = f", prep {row['prep_ms']:.3f} ms" if "prep_ms" in row else ""
                print(f"  peer {name:38} {phase:7} T={T:5d} {row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s "
                      f"(GEMMs only{extra}; check vs torch {row['check']:.2e})", flush=True)
    del w13, w2, w13_8, w2_8
    torch.cuda.empty_cache()
    return out


def measure_isolated(E: int, H: int, I: int, K: int, phases, routing: str, timeout: float = 300) -> List[dict]:
    """`measure` in a child process (a crash in DeepGEMM ends the child, not the benchmark); the
    routing is `tests/experts_testing`'s (`routing`: "uniform" | "skewed", seed 101, as bench_experts)."""
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--json", f.name, "--experts", str(E), "--hidden", str(H),
               "--inter", str(I), "--top-k", str(K), "--routing", routing]
        cmd += [f"--{p}-tokens={T}" for p, T in phases]
        try:
            r = subprocess.run(cmd, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"deepgemm peer: no result within {timeout:.0f} s")
            return []
        if r.returncode != 0:
            print(f"deepgemm peer: the child exited with {r.returncode}")
        try:
            with open(f.name) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return []


def smoke(dg) -> None:
    """The smallest call of each kernel this peer uses, one line before each (finds a crashing one)."""
    import torch

    dev = torch.device("cuda")
    E, N, Kd = 2, 256, 256
    w = fp8_blocks(torch.randn(E, N, Kd, device=dev, dtype=torch.bfloat16))
    align = int(dg.get_mk_alignment_for_contiguous_layout())
    print(f"smoke: alignment {align}", flush=True)
    a = fp8_rows(torch.randn(2 * align, Kd, device=dev, dtype=torch.bfloat16))
    d = torch.empty(2 * align, N, device=dev, dtype=torch.bfloat16)
    m_indices = torch.arange(2, device=dev, dtype=torch.int32).repeat_interleave(align)
    for name, fn in [
        ("fp8_gemm_nt", lambda: dg.fp8_gemm_nt(a, (w[0][0], w[1][0]), d, disable_ue8m0_cast=True)),
        ("m_grouped_fp8_gemm_nt_contiguous", lambda: dg.m_grouped_fp8_gemm_nt_contiguous(
            a, w, d, m_indices, disable_ue8m0_cast=True)),
        ("m_grouped_fp8_gemm_nt_masked", lambda: masked_fp8(dg)(
            (a[0].view(E, align, Kd), a[1].view(E, align, Kd // 128)), w, d.view(E, align, N),
            torch.tensor([align, 3], device=dev, dtype=torch.int32), align, disable_ue8m0_cast=True)),
    ]:
        print(f"smoke: {name} ...", flush=True)
        fn()
        torch.cuda.synchronize()
        print(f"smoke: {name} ok", flush=True)


def main(argv=None) -> int:
    import argparse
    import json

    import torch
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the smallest call of each kernel, then exit")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--routing", default="uniform", choices=("uniform", "skewed"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dg = load()
    if dg is None:
        return 1
    if args.smoke:
        smoke(dg)
        return 0
    from tests import experts_testing as T

    dev = torch.device("cuda")
    E, H, I, K = args.experts, args.hidden, args.inter, args.top_k
    route = T.skewed_local_routing if args.routing == "skewed" else T.random_local_routing
    phases = [(p, n) for p, n in (("prefill", args.prefill_tokens), ("decode", args.decode_tokens)) if n > 0]
    bench = lambda f: float(do_bench(f, warmup=100, rep=400, return_mode="median"))  # noqa: E731
    rows: List[dict] = []

    def save(current=None):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(current if current is not None else rows, f)

    rows = measure(dev, E, H, I, K, phases, lambda T_: route(T_, K, E, dev, 101)[0], 2 * 3 * I * H, bench, dg,
                   on_row=save)
    save()
    bad = [r for r in rows if not (r.get("check", 1.0) < 2e-2)]
    print("deepgemm peer:", "all checks passed" if not bad else f"FAILED {[(r['name'], r.get('check')) for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
