"""Runs the `deepgemm` experts' Triton passes under the Triton interpreter with a stand-in for DeepGEMM's
grouped GEMMs (tests/cpu/fake_deep_gemm.py), against float64 math (started by
test_deepgemm_standin_interpret.py with TRITON_INTERPRET=1). Prints one JSON line per case."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from epmoe.config import MoEConfig  # noqa: E402
from epmoe.dispatch.base import DispatchedTokens  # noqa: E402
from epmoe.experts.base import ExpertsSpec  # noqa: E402
from epmoe.experts.deepgemm.backend import FP8_PAYLOAD, DeepGEMMExperts  # noqa: E402
from epmoe.experts.triton.align import max_blocks_for  # noqa: E402
from epmoe.experts.triton import kernel_formats as kf  # noqa: E402
from epmoe.quant.payload import QuantizedActivation  # noqa: E402
from epmoe.quant.plan import QuantPlan  # noqa: E402
from tests import experts_testing as T  # noqa: E402
from tests.cpu.fake_deep_gemm import FakeDeepGEMM  # noqa: E402
from tests.cpu.interpret import report_cases  # noqa: E402
from tests.triton_interpret import match_gpu_rounding  # noqa: E402

import triton  # noqa: E402,F401

match_gpu_rounding()

SHAPES = {
    "swiglu": dict(num_experts=6, top_k=2, hidden_size=256, intermediate_size=128),  # 3 local experts on rank 1 of 2
    "relu2": dict(num_experts=6, top_k=2, hidden_size=256, intermediate_size=256, activation="relu2"),
}


def _weights64(ex):
    p = ex.parameters()
    if ex.fp8:
        deq = lambda w, s: kf.dequantize_fp8_block(w, s).double()  # noqa: E731
        return deq(p["w13"], p["w13_scale"]), deq(p["w2"], p["w2_scale"])
    return p["w13"].double(), p["w2"].double()


def run(case: str, seed: int) -> dict:
    mode, layout, *opts = case.split(":")
    opts = set(opts)
    cfg = MoEConfig(dtype=torch.bfloat16, **SHAPES["relu2" if "relu2" in opts else "swiglu"])
    qmode = "fp8_block" if mode == "fp8" else "bf16"
    wire = "fp8" if "fp8in" in opts else "bf16"
    plan = QuantPlan(expert_mode=qmode, dispatch_dtype=wire, layout=layout)
    fake = FakeDeepGEMM()
    # bound: the GEMMs on the alignment's upper bound of rows (option exact_rows off)
    spec = ExpertsSpec(cfg, 1, 2, torch.device("cpu"), plan=plan, options={"exact_rows": "bound" not in opts})
    ex = DeepGEMMExperts(spec, gemms=fake)
    if "overlap" in opts:  # the row count's copy overlapping the gather at any size (the scales' stride on the GPU)
        ex.overlap_rows_read_min_entries = 0
    E = spec.num_local_experts
    w = T.random_expert_weights(cfg, cfg.num_experts, seed=seed, dtype=torch.float32)
    ex.load_weights(w.slice_experts(E, 2 * E))
    w13, w2 = _weights64(ex)
    H, I = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(seed)
    res = {}
    if layout == "flat":
        # big: more than 1024 entries, where the row placement also writes m_indices and inv (3 launches)
        N = {"empty": 0, "one": 1, "big": 600}.get(next((o for o in opts if o in ("empty", "one", "big")), ""), 37)
        x = torch.randn(N, H, generator=g).bfloat16()
        ids, tw = T.random_local_routing(N, cfg.top_k, E, seed=seed, invalid_frac=0.3 if "invalid" in opts else 0.0,
                                         empty_rows=2 if "invalid" in opts and N > 2 else 0)
        hidden = x
        if wire == "fp8":
            q, s = kf.quantize_fp8_tokens(x.float())
            hidden = QuantizedActivation(FP8_PAYLOAD, q, s, H)
        assert ex.payload_format == (FP8_PAYLOAD if wire == "fp8" else ex.payload_format)
        out = ex(DispatchedTokens(hidden, ids, tw))
        assert out.shape == (N, H) and out.dtype == torch.bfloat16
        ref = T.grouped_gemm_reference(cfg, x, ids, tw, w13, w2, ex.fp8)
        if N:
            res["err"] = T.relative_error(out, ref)
            empty = (ids < 0).all(dim=1)
            res["empty_rows_zero"] = bool((out[empty] == 0).all())
            # rows the GEMMs ran on: each expert's entries padded to 128, or the alignment's upper bound
            counts = torch.bincount(ids[ids >= 0].long(), minlength=E)
            res["gemm_rows"] = sorted({c["rows"] for c in fake.calls})
            res["used_rows"] = max(int(((counts + 127) // 128 * 128).sum()), 128)
            res["bound_rows"] = max_blocks_for(ids.numel(), E, 128) * 128
    else:
        M = 5
        counts = torch.tensor([3, 0, M][:E], dtype=torch.int32)
        x = torch.randn(E, M, H, generator=g).bfloat16()
        hidden = x
        if wire == "fp8":
            q, s = kf.quantize_fp8_tokens(x.reshape(E * M, H).float())
            hidden = QuantizedActivation(FP8_PAYLOAD, q.view(E, M, H), s.view(E, M, H // 128), H)
        out = ex(DispatchedTokens(hidden, None, None, layout="masked", expert_counts=counts))
        assert out.shape == (E, M, H) and out.dtype == torch.bfloat16
        errs = [T.relative_error(out[e, :n], T.grouped_gemm_expert_reference(cfg, x[e, :n], w13[e], w2[e], ex.fp8))
                for e, n in enumerate(counts.tolist()) if n]
        res["err"] = max(errs)
    res["calls"] = [c["name"] for c in fake.calls]
    res["ours_mn_major"] = all(c["mn_major"] for c in fake.calls if c["mn_major"] is not None
                               and not (layout == "masked" and wire == "fp8" and c["name"] == "fp8_masked"
                                        and c is fake.calls[0]))
    return res


if __name__ == "__main__":
    report_cases(sys.argv[1:], run)
