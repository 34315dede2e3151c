"""Quantization: formats (reference quantize/dequantize), typed quantized tensors, the quant plan,
workspace sizing, expert-weight containers and layout conversion.

Imports only `epmoe.core` and `epmoe.config`; submodules are imported explicitly
(`from epmoe.quant import nvfp4`), nothing optional is imported here.
"""
