"""Make the Triton interpreter (TRITON_INTERPRET=1, CPU) round like the GPU, for CPU runs of the
`triton` backend's kernels (tests/cpu, `benchmarks/tune_hopper.py --cpu-smoke`).

    from tests.triton_interpret import match_gpu_rounding
    match_gpu_rounding()          # once, after triton is imported with TRITON_INTERPRET=1

The interpreter (seen in Triton 3.9) multiplies bf16 dot operands and bf16 elementwise operands as raw
uint16 and truncates fp32 -> bf16 / fp8 casts, where the GPU rounds to nearest even; these patches
model the GPU. The
interpreter still divides with IEEE rounding (numpy), unlike `/` on the GPU (div.full.f32).
Imports triton: call only where the interpreter runs.
"""

from __future__ import annotations

import numpy as np
import torch

_DONE = []


def match_gpu_rounding() -> None:
    if _DONE:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    torch_of = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float8e4nv: torch.float8_e4m3fn}
    orig_dot = ti.InterpreterBuilder.create_dot
    orig_cast = ti.InterpreterBuilder.cast_impl
    orig_fp_to_fp = ti.InterpreterBuilder.create_fp_to_fp

    def rtne(src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == tl.float32 and d in torch_of:
            t = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch_of[d])
            bits = t.view(torch.uint8 if d == tl.float8e4nv else torch.int16).numpy()
            return ti.TensorHandle(bits.view(ti._get_np_dtype(dst_type)).reshape(src.data.shape), d)
        return None

    def bf16_to_f32(src):
        # exact (bits << 16); the interpreter's own conversion flushes bf16 subnormals to zero
        bits = np.ascontiguousarray(src.data).view(np.uint16).astype(np.uint32) << 16
        return ti.TensorHandle(bits.view(np.float32), tl.float32)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return bf16_to_f32(src)
        r = rtne(src, dst_type)
        return r if r is not None else orig_cast(self, src, dst_type)

    def fp_to_fp(self, src, dst_type, rounding_mode):
        r = rtne(src, dst_type)
        return r if r is not None else orig_fp_to_fp(self, src, dst_type, rounding_mode)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = bf16_to_f32(a)
        if b.dtype.scalar == tl.bfloat16:
            b = bf16_to_f32(b)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    orig_binary = ti.InterpreterBuilder.binary_op

    def binary_op(self, lhs, rhs, op):
        # bf16 elementwise arithmetic: the interpreter applies numpy to the raw uint16 bits; the GPU
        # (mul/fma/add .rn.bf16) rounds the exact result to nearest even: fp32 op, then RNE to bf16
        if lhs.dtype.scalar == tl.bfloat16 and rhs.dtype.scalar == tl.bfloat16:
            r = orig_binary(self, bf16_to_f32(lhs), bf16_to_f32(rhs), op)
            if r.data.dtype == np.float32:
                return rtne(r, tl.bfloat16)
            return r
        return orig_binary(self, lhs, rhs, op)

    ti.InterpreterBuilder.binary_op = binary_op
    ti.InterpreterBuilder.create_dot = dot
    ti.InterpreterBuilder.cast_impl = cast_impl
    ti.InterpreterBuilder.create_fp_trunc = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    ti.InterpreterBuilder.create_fp_to_fp = fp_to_fp
    _DONE.append(True)
