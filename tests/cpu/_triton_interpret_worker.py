"""Runs TritonExperts under the Triton interpreter (started by test_triton_experts_interpret.py in a
subprocess with TRITON_INTERPRET=1 set before triton is imported). Prints one JSON line per case."""

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as ti  # noqa: E402

from epmoe.config import MoEConfig  # noqa: E402
from epmoe.dispatch.base import DispatchedTokens  # noqa: E402
from epmoe.experts import kernel_formats as kf  # noqa: E402
from epmoe.experts import testing as T  # noqa: E402
from epmoe.experts.base import ExpertsSpec  # noqa: E402
from epmoe.experts.triton_experts import GemmConfig, TritonConfig, TritonExperts  # noqa: E402
from epmoe.quant.plan import QuantPlan  # noqa: E402

# The interpreter (Triton 3.9) multiplies bf16 dot operands as raw uint16 and truncates fp32 ->
# bf16 / fp8 casts, where the GPU rounds to nearest even; model the GPU here.
_TORCH_OF = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float8e4nv: torch.float8_e4m3fn}
_orig_dot = ti.InterpreterBuilder.create_dot
_orig_cast = ti.InterpreterBuilder.cast_impl
_orig_fp_to_fp = ti.InterpreterBuilder.create_fp_to_fp


def _rtne(src, dst_type):
    s, d = src.dtype.scalar, dst_type.scalar
    if s == tl.float32 and d in _TORCH_OF:
        t = torch.from_numpy(np.ascontiguousarray(src.data)).to(_TORCH_OF[d])
        bits = t.view(torch.uint8 if d == tl.float8e4nv else torch.int16).numpy()
        return ti.TensorHandle(bits.view(ti._get_np_dtype(dst_type)).reshape(src.data.shape), d)
    return None


def _cast_impl(self, src, dst_type):
    r = _rtne(src, dst_type)
    return r if r is not None else _orig_cast(self, src, dst_type)


def _fp_to_fp(self, src, dst_type, rounding_mode):
    r = _rtne(src, dst_type)
    return r if r is not None else _orig_fp_to_fp(self, src, dst_type, rounding_mode)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16:
        a = _orig_cast(self, a, tl.float32)
    if b.dtype.scalar == tl.bfloat16:
        b = _orig_cast(self, b, tl.float32)
    return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


ti.InterpreterBuilder.create_dot = _dot
ti.InterpreterBuilder.cast_impl = _cast_impl
ti.InterpreterBuilder.create_fp_trunc = lambda self, src, dst_type: _cast_impl(self, src, dst_type)
ti.InterpreterBuilder.create_fp_to_fp = _fp_to_fp

SHAPES = {
    # E local, K, H, I: H and I not multiples of the tiles (masks), I % 64 == 0 for fp4
    "swiglu": dict(num_experts=4, top_k=3, hidden_size=192, intermediate_size=64),
    "oai": dict(
        num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, has_bias=True,
        swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
    ),  # fmt: skip
    "relu2": dict(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, activation="relu2"),
    "ragged": dict(num_experts=3, top_k=2, hidden_size=80, intermediate_size=48),  # K tails, N masks
}


def tiny_config(mode: str) -> TritonConfig:
    bk = 128 if mode == "fp8_block" else 64
    bn1 = 128 if mode == "fp8_block" else 32
    return TritonConfig("tiny", 16, GemmConfig(bn1, bk, 4, 1, 2), GemmConfig(32, bk, 4, 1, 2))


def run_case(mode: str, shape: str, seed: int) -> dict:
    cfg = MoEConfig(**SHAPES[shape])
    E = cfg.num_experts
    spec = ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode=mode))
    ex = TritonExperts(spec)
    ex.config_override = tiny_config(mode)
    w = T.random_expert_weights(cfg, E, seed=seed)
    ex.load_weights(w)
    N = 9
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(N, cfg.hidden_size, generator=g).to(cfg.dtype)
    ids, tw = T.random_local_routing(N, cfg.top_k, E, seed=seed + 2, invalid_frac=0.3, empty_rows=2)
    out = ex(DispatchedTokens(x, ids, tw))
    rt = lambda a: a.to(torch.bfloat16).double()  # noqa: E731  (gemm1 writes a bf16 activation)
    w13 = w2 = None
    xr = x
    if mode != "bf16":
        d = kf.dequantize_expert_weights(kf.quantize_expert_weights(w, mode))
        w13, w2 = d.w13(), d.w2
        if mode == "fp8_block":
            xq, xs = kf.quantize_fp8_tokens(x)
            xr = kf.dequantize_fp8_tokens(xq, xs)

            def rt(a):
                aq, a_s = kf.quantize_fp8_tokens(a.float())
                return kf.dequantize_fp8_tokens(aq, a_s).double()

    ref = T.experts_reference(cfg, w, xr, ids, tw, w13=w13, w2=w2, act_roundtrip=rt)
    err = T.relative_error(out, ref)
    empty_zero = bool((out[-2:] == 0).all())
    finite = bool(torch.isfinite(out).all())
    return dict(err=err, empty_rows_zero=empty_zero, finite=finite, shape=list(out.shape), dtype=str(out.dtype))


def main() -> None:
    cases = sys.argv[1:]
    for i, case in enumerate(cases):
        mode, shape = case.split(":")
        seed = int.from_bytes(os.urandom(2), "little")
        try:
            res = run_case(mode, shape, seed)
            res.update(case=case, seed=seed, ok=True)
        except Exception:
            res = dict(case=case, seed=seed, ok=False, error=traceback.format_exc()[-3000:])
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
