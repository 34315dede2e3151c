"""Where the `deepgemm` fp8_block experts lose accuracy, stage by stage (docs/deepgemm.md, "Accuracy").

One GPU. For each shape, the same bf16 tokens and local routing through the deepgemm experts (flat
layout); the stages are captured inside the backend and each is checked against float64 math on the
*kernel's own input* to that stage, so an error is charged to the stage that made it:

  fc1   DeepGEMM's grouped GEMM 1 (bf16 out) vs fp8-roundtrip(x) @ w13^T on the dequantized weights:
        rms and max of |h - ref| / max|ref row|, and the share of elements whose bf16 differs from
        bf16(ref) (one-ulp flips: these are what re-quantization then amplifies)
  act   our activation + 1x128 e4m3 quantizer vs the codec on act(h) of the kernel's h, float64:
        share of e4m3 bytes that differ, max relative scale difference
  fc2   DeepGEMM's grouped GEMM 2 (bf16 out) vs dequantized(act) @ w2^T: rms / max as for fc1
  out   the experts' output vs tests.experts_testing.grouped_gemm_reference (float64 through the same
        roundings): ||d|| / ||ref|| and max|d| / max|ref| (the layer tests' metric), beside the triton
        fp8_block experts on the same tokens and weights

    python tests/gpu/deepgemm_fp8_diag.py [--seed N]
    TRITON_INTERPRET=1 python tests/gpu/deepgemm_fp8_diag.py --fake   # CPU stand-in: this script's plumbing only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

SHAPES = {
    "ll1-ep2": dict(num_experts=16, top_k=4, hidden_size=2048, intermediate_size=128, ep=2, N=134),
    "h2048-i512": dict(num_experts=16, top_k=4, hidden_size=2048, intermediate_size=512, ep=2, N=134),
    "dsv3-ep8": dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, ep=8, N=512),
}
FAKE_SHAPES = {"tiny": dict(num_experts=6, top_k=2, hidden_size=256, intermediate_size=128, ep=2, N=37)}


def _stats(got: torch.Tensor, ref: torch.Tensor):
    d = (got.double() - ref).abs()
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    r = d / scale
    flips = float((got.bfloat16() != ref.bfloat16()).double().mean())
    return float(r.pow(2).mean().sqrt()), float(r.max()), flips


def run(name: str, shape: dict, seed: int, fake: bool = False) -> None:
    from epmoe.config import MoEConfig
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.deepgemm import backend as B
    from epmoe.experts.triton import align as A
    from epmoe.experts.triton import kernel_formats as kf
    from epmoe.quant import fp8_block
    from epmoe.quant.plan import QuantPlan
    from tests import experts_testing as T
    from tests.cpu.helpers import max_rel_err

    shape = dict(shape)
    ep, N = shape.pop("ep"), shape.pop("N")
    cfg = MoEConfig(dtype=torch.bfloat16, **shape)
    H, I = cfg.hidden_size, cfg.intermediate_size
    dev = "cpu" if fake else "cuda"
    spec = ExpertsSpec(cfg, 0, ep, torch.device(dev), plan=QuantPlan(expert_mode="fp8_block", dispatch_dtype="bf16"))
    if fake:
        from tests.cpu.fake_deep_gemm import FakeDeepGEMM

        ex = B.DeepGEMMExperts(spec, gemms=FakeDeepGEMM())
    else:
        ex = B.DeepGEMMExperts(spec)
    E = spec.num_local_experts
    w = T.random_expert_weights(cfg, E, dev, seed, first_expert=spec.first_local_expert)
    ex.load_weights(w)
    p = ex.parameters()
    w13 = kf.dequantize_fp8_block(p["w13"], p["w13_scale"]).double()
    w2 = kf.dequantize_fp8_block(p["w2"], p["w2_scale"]).double()
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    x = torch.randn(N, H, generator=g, device=dev).bfloat16()
    ids, tw = T.random_local_routing(N, cfg.top_k, E, dev, seed + 2, invalid_frac=0.25)

    cap = {}
    orig_layout, orig_act, orig_gemm = A.contiguous_layout_rows, ex._act, ex._gemm_contiguous

    def layout(*a, **k):
        out = orig_layout(*a, **k)
        cap["layout"] = out
        return out

    def act(h, *a, **k):
        out = orig_act(h, *a, **k)
        cap["h"], cap["act"] = h.clone(), (out[0].clone(), out[1].clone())
        return out

    def gemm(a, b, d, m):
        orig_gemm(a, b, d, m)
        cap.setdefault("d", []).append(d)

    A.contiguous_layout_rows, ex._act, ex._gemm_contiguous = layout, act, gemm
    try:
        out = ex(DispatchedTokens(x, ids, tw))
        if not fake:
            torch.cuda.synchronize()
    finally:
        A.contiguous_layout_rows = orig_layout
        ex._act, ex._gemm_contiguous = orig_act, orig_gemm
    _, _, inv, _ = cap["layout"]  # (bound or exact rows, m_indices, each entry's row, used rows)
    K = cfg.top_k
    valid = (ids >= 0).reshape(-1)
    ent = torch.nonzero(valid).squeeze(1)
    rows = inv.long()[ent]
    tok = ent // K
    exp = ids.reshape(-1).long()[ent]
    xr = T.fp8_roundtrip(x)
    # fc1 on the rows that carry an entry
    h = cap["h"][rows]

    def per_expert(fn, width):  # fn(e, entries of expert e) -> [n_e, width], float64, in entry order
        out = torch.zeros(tok.numel(), width, dtype=torch.float64, device=x.device)
        for e in range(E):
            sel = torch.nonzero(exp == e).squeeze(1)
            if sel.numel():
                out[sel] = fn(e, sel)
        return out

    h_ref = per_expert(lambda e, sel: xr[tok[sel]] @ w13[e].T, w13.shape[1])
    fc1 = _stats(h, h_ref)
    # act: the codec on act(h of the kernel), float64 -> compare bytes and scales
    hk = h.double()
    a_ref = T.activation_reference(cfg, hk[:, :I], hk[:, I:] if cfg.is_gated else None)
    q_ref, s_ref = fp8_block.quantize_activation(a_ref.float())
    q, s = cap["act"]
    q_k, s_k = q[rows], s.t()[rows]
    bytes_differ = float((q_k.view(torch.uint8) != q_ref.view(torch.uint8).to(q_k.device)).double().mean())
    s_rel = float(((s_k.double() - s_ref.double().to(s_k.device)).abs() / s_ref.double().to(s_k.device).abs().clamp_min(1e-30)).max())
    # fc2 on the kernel's own quantized activation
    a_deq = fp8_block.dequantize_activation(q_k, s_k, torch.float64)
    y = cap["d"][1][rows]
    y_ref = per_expert(lambda e, sel: a_deq[sel] @ w2[e].T, H)
    fc2 = _stats(y, y_ref)
    ref = T.grouped_gemm_reference(cfg, x, ids, tw, w13, w2, True)
    nrm = T.relative_error(out, ref)
    mx = max_rel_err(out, ref)
    print(f"[{name}] H={H} I={I} E_local={E} top_k={K} N={N} seed={seed}")
    print(f"  fc1  rms {fc1[0]:.2e}  max {fc1[1]:.2e}  bf16 differs {100 * fc1[2]:.2f}%")
    print(f"  act  e4m3 bytes differ {100 * bytes_differ:.3f}%  max scale rel diff {s_rel:.2e}")
    print(f"  fc2  rms {fc2[0]:.2e}  max {fc2[1]:.2e}  bf16 differs {100 * fc2[2]:.2f}%")
    print(f"  out  deepgemm  norm {nrm:.2e}  max/max {mx:.2e}")
    # the masked layout (what DeepEP low-latency delivers): the same entries, grouped per expert, fed as
    # e4m3 + 1x128 scales viewed column-major (DeepEP's layout), through the masked grouped GEMMs
    from epmoe.experts.deepgemm.backend import FP8_PAYLOAD
    from epmoe.quant.payload import QuantizedActivation

    counts = torch.bincount(exp, minlength=E)
    M = max(1, int(counts.max()))
    slot = torch.zeros_like(exp)
    for e in range(E):
        sel = torch.nonzero(exp == e).squeeze(1)
        slot[sel] = torch.arange(sel.numel(), device=sel.device)
    xm = torch.zeros(E, M, H, dtype=torch.bfloat16, device=x.device)
    xm[exp, slot] = x[tok]
    q8, s8 = kf.quantize_fp8_tokens(xm.view(E * M, H))
    s_cm = s8.view(E, M, H // 128).transpose(1, 2).contiguous().transpose(1, 2)
    hidden = QuantizedActivation(FP8_PAYLOAD, q8.view(E, M, H), s_cm, H)
    capm = {}
    orig_gm = ex._gemm_masked

    def act_m(h, *a, **k):
        out = orig_act(h, *a, **k)
        capm["h"] = h.clone()
        return out

    def gemm_m(a, b, d, c, em):
        orig_gm(a, b, d, c, em)
        capm.setdefault("d", []).append(d)

    ex._act, ex._gemm_masked = act_m, gemm_m
    try:
        ym = ex(DispatchedTokens(hidden, None, None, layout="masked", expert_counts=counts.to(torch.int32)))
        if not fake:
            torch.cuda.synchronize()
    finally:
        ex._act, ex._gemm_masked = orig_act, orig_gm
    hm = capm["h"][exp, slot]
    fc1m = _stats(hm, h_ref)
    y_m = ym[exp, slot]
    y_full_ref = per_expert(lambda e, sel: T.grouped_gemm_expert_reference(cfg, x[tok[sel]], w13[e], w2[e], True), H)
    print(f"  masked fc1  rms {fc1m[0]:.2e}  max {fc1m[1]:.2e}  bf16 differs {100 * fc1m[2]:.2f}%  "
          f"(h equal to the flat layout's: {100 * float((hm == h).double().mean()):.2f}%)")
    yf = cap["d"][1][rows]
    print(f"  per entry y vs float64 pipeline: flat norm {T.relative_error(yf, y_full_ref):.2e}, "
          f"masked norm {T.relative_error(y_m, y_full_ref):.2e}; masked y equal to flat: "
          f"{100 * float((y_m == yf).double().mean()):.2f}%")
    try:
        from epmoe.experts.triton.triton_experts import TritonExperts

        tx = TritonExperts(spec)
        tx.load_weights(w)
        out_t = tx(DispatchedTokens(x, ids, tw))
        print(f"  out  triton    norm {T.relative_error(out_t, ref):.2e}  max/max "
              f"{max_rel_err(out_t, ref):.2e}  (against the deepgemm reference)")
        print(f"  deepgemm vs triton  max/max {max_rel_err(out, out_t):.2e}")
    except Exception as e:  # noqa: BLE001
        print(f"  triton: {type(e).__name__}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--fake", action="store_true", help="CPU, TRITON_INTERPRET=1, a torch stand-in for DeepGEMM")
    args = ap.parse_args()
    shapes = FAKE_SHAPES if args.fake else SHAPES
    if args.fake:
        from tests.triton_interpret import match_gpu_rounding

        match_gpu_rounding()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % 2**31
    for name in (args.shapes or ",".join(shapes)).split(","):
        for s in (seed, seed + 1000):
            run(name, shapes[name], s, fake=args.fake)


if __name__ == "__main__":
    main()
