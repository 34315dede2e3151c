"""TritonExperts fed from synthetic checkpoints in each shipped format, under the Triton interpreter
(started by test_checkpoint_formats.py with TRITON_INTERPRET=1). Prints one RESULT line per format."""

import json
import os
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from epmoe.checkpoint import load_expert_weights  # noqa: E402
from epmoe.config import MoEConfig  # noqa: E402
from epmoe.dispatch.base import DispatchedTokens  # noqa: E402
from epmoe.experts.triton import kernel_formats as kf  # noqa: E402
from tests import experts_testing as T  # noqa: E402
from epmoe.experts.base import ExpertsSpec  # noqa: E402
from epmoe.experts.triton.triton_experts import GemmConfig, TritonConfig, TritonExperts  # noqa: E402
from tests.triton_interpret import match_gpu_rounding  # noqa: E402
from epmoe.launch.synthetic import write_checkpoint  # noqa: E402
from epmoe.quant.plan import QuantPlan  # noqa: E402

match_gpu_rounding()

# fp8: H = 320 (a partial 128-block along K, as GPT-OSS's 2880); fp4: K % 64 == 0
CASES = {
    "fp8": ("fp8_block", {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                          "hidden_size": 320, "moe_intermediate_size": 128}),
    "nvfp4-modelopt": ("nvfp4_w4a16", {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                       "hidden_size": 192, "moe_intermediate_size": 64}),
    "nvfp4-compressed": ("nvfp4_w4a16", {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                         "hidden_size": 192, "moe_intermediate_size": 64}),
    "mxfp4-gpt-oss": ("mxfp4_w4a16", {"model_type": "gpt_oss", "num_local_experts": 4, "experts_per_token": 2,
                                      "hidden_size": 128, "intermediate_size": 64, "swiglu_limit": 7.0}),
}


def run(fmt: str) -> dict:
    mode, hf = CASES[fmt]
    d = tempfile.mkdtemp()
    write_checkpoint(d, MoEConfig.from_hf_config(hf, dtype=torch.bfloat16), hf, 1, 4, fmt)
    cfg = MoEConfig.from_hf_config(d, dtype=torch.bfloat16)
    w = load_expert_weights(d, cfg, layer_idx=0).experts
    ex = TritonExperts(ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode=mode)))
    bk = 128 if mode == "fp8_block" else 64
    ex.config_override = TritonConfig("tiny", 16, GemmConfig(128 if mode == "fp8_block" else 32, bk, 4, 1, 2),
                                      GemmConfig(32, bk, 4, 1, 2), False)
    ex.load_weights(w)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, cfg.hidden_size, generator=g).to(cfg.dtype)
    ids, tw = T.random_local_routing(9, cfg.top_k, cfg.num_experts, seed=2)
    out = ex(DispatchedTokens(x, ids, tw))
    deq = kf.dequantize_expert_weights(w)  # the checkpoint's values
    xr, rt = x, (lambda a: a.to(torch.bfloat16).double())
    if mode == "fp8_block":
        xr = kf.dequantize_fp8_tokens(*kf.quantize_fp8_tokens(x))
        rt = lambda a: kf.dequantize_fp8_tokens(*kf.quantize_fp8_tokens(a.float())).double()  # noqa: E731
    ref = T.experts_reference(cfg, w, xr, ids, tw, w13=deq.w13(), w2=deq.w2, act_roundtrip=rt)
    return {"case": fmt, "err": T.relative_error(out, ref), "global_scales_differ": bool(
        w.w1_global_scale is not None and not torch.equal(w.w1_global_scale, w.w3_global_scale))}


if __name__ == "__main__":
    for fmt in sys.argv[1:]:
        try:
            print("RESULT " + json.dumps(run(fmt)), flush=True)
        except Exception as e:  # noqa: BLE001
            print("RESULT " + json.dumps({"case": fmt, "error": f"{type(e).__name__}: {e}"}), flush=True)
