"""Quantization: formats (reference quantize/dequantize), typed quantized tensors, the plan record,
workspace sizing, expert-weight containers and layout conversion. Which backend runs which format
is not here: the backend classes say (`supports()`), `epmoe.resolve` asks them.

    e2m1, nvfp4, mxfp4, mxfp8, fp8_block   formats (pure torch, CPU and GPU, bit-exact docs in docs/formats.md)
    payload, codec                         what dispatchers send (PayloadFormat, QuantizedActivation, byte rows)
    triton_codec                           the codec's Triton kernels for CUDA tensors (imports triton; codec
                                           loads it on first use, bit-exact with the reference formats)
    plan                                   QuantPlan record, expert modes, checkpoint families, resolve_mode
    workspace                              workspace and memory sizing from a plan
    weights                                ExpertWeights (canonical expert tensors)
    checkpoint_formats                     how shipped checkpoints store experts (FP8 block, ModelOpt /
                                           compressed-tensors NVFP4, GPT-OSS MXFP4) -> ExpertWeights

Imports only `epmoe.core` and `epmoe.config`; submodules are imported explicitly
(`from epmoe.quant import nvfp4`), nothing optional is imported here.
"""
