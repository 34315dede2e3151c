"""Triton experts (fp8_block, nvfp4_w4a16, mxfp4_w4a16) loaded from synthetic checkpoints in the
formats models ship in, on one GPU, against

  * the float64 reference of the dequantized checkpoint (`reference_moe`, unquantized activations):
    ||out - ref|| / ||ref|| <= 2e-2 for W4A16 (weights exact; bf16 activations and outputs), <= 0.1
    for fp8_block (its 1x128 FP8 activations add ~3-5%);
  * the reference experts running the same plan on the CPU: <= 1e-2 (W4A16 modes; the CPU test
    tests/cpu/test_checkpoint_formats.py::test_triton_experts_read_each_checkpoint_format_interpreter
    checks fp8_block with emulated activation round trips at a partial-block hidden size).
fp8_block runs with dispatch_dtype="bf16": FP8 dispatch needs hidden % 128 == 0.

Shapes: hidden 2880 (GPT-OSS; not a multiple of 128, so FP8 weight blocks have a partial edge),
8 experts, top-2, I = 768; GPT-OSS MXFP4 with its biases and clamped SwiGLU. The checkpoint is
quantized on the GPU while it is written (the reference codecs give the same bytes as on the CPU). Run: `python -m pytest tests/gpu/test_checkpoint_formats_gpu.py -q` (about a minute).
"""

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.launch.synthetic import read_gate, reference_layers, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H = 2880
PER_EXPERT = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": H,
              "moe_intermediate_size": 768, "norm_topk_prob": True}
GPT_OSS = {"model_type": "gpt_oss", "num_local_experts": 8, "experts_per_token": 2, "hidden_size": H,
           "intermediate_size": 768, "swiglu_limit": 7.0}
CASES = [("fp8", "fp8_block", PER_EXPERT, 0.1, "triton"), ("nvfp4-modelopt", "nvfp4_w4a16", PER_EXPERT, 2e-2, "triton"),
         ("nvfp4-compressed", "nvfp4_w4a16", PER_EXPERT, 2e-2, "triton"),
         ("mxfp4-gpt-oss", "mxfp4_w4a16", GPT_OSS, 2e-2, "triton"),
         # FlashInfer CUTLASS (where its fused-MoE module is prebuilt): hidden 2880 padded to 2944 at load
         ("fp8", "fp8_block", PER_EXPERT, 0.1, "flashinfer_cutlass"),
         ("mxfp4-gpt-oss", "mxfp4_w4a16", GPT_OSS, 2e-2, "flashinfer_cutlass"),
         ("mxfp4-gpt-oss", "mxfp4_w4a8", GPT_OSS, 0.1, "flashinfer_cutlass")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt, mode, hf, bound, experts", CASES, ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in CASES])
def test_experts_from_checkpoint_match_dequantized_reference(tmp_path, fmt, mode, hf, bound, experts):
    if experts == "flashinfer_cutlass":
        from epmoe.resolve import detect_environment
        from epmoe.experts.flashinfer_cutlass import fused_moe_package

        env = detect_environment(torch.device("cuda"))
        if fused_moe_package(env.arch) not in env.packages:
            pytest.skip(f"FlashInfer's {env.arch} fused-MoE module is not prebuilt here")
    write_checkpoint(str(tmp_path), MoEConfig.from_hf_config(hf, dtype=torch.bfloat16), hf, 1, 11, fmt,
                     device=torch.device("cuda"))
    cfg = MoEConfig.from_hf_config(tmp_path, dtype=torch.bfloat16)
    assert cfg.quant_method is not None and cfg.hidden_size == H
    # fp8 dispatch needs hidden % 128 == 0; at 2880 tokens travel bf16 and the experts quantize them
    dispatch = "bf16" if mode == "fp8_block" else "auto"
    layer = EPMoE(cfg, device="cuda", experts=experts, quant=mode, dispatch_dtype=dispatch, max_num_tokens_per_rank=128)
    assert layer.plan.expert_mode == mode, layer.plan.describe()
    layer.load_weights(tmp_path, layer_idx=0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, H, generator=g).to(torch.bfloat16)
    logits = x.float() @ read_gate(str(tmp_path), 0).float().t()
    y = layer(x.cuda(), logits.cuda()).float().cpu()
    assert torch.isfinite(y).all()
    ref_layer = reference_layers(str(tmp_path), cfg, 1)[0]
    ref = reference_moe(cfg, x, ref_layer.experts, logits)
    err = _rel(y, ref)
    err_emu = 0.0
    if mode not in ("fp8_block", "mxfp4_w4a8"):  # the reference experts' fp8 activation codec needs hidden % 128 == 0
        emulated = EPMoE(cfg, device="cpu", experts="reference", quant=mode)
        emulated.load_weights(tmp_path, layer_idx=0)
        err_emu = _rel(y, emulated(x, logits))
    print(f"{fmt} {mode} {experts}: vs float64 of the dequantized checkpoint {err:.3g} (bound {bound}), "
          f"vs reference experts {err_emu:.3g} (bound 1e-2)")
    assert err <= bound and err_emu <= 1e-2
