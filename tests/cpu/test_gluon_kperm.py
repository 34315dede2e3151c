"""The K order of the wgmma kernel's K_PERM presets: `permute_k` (the tensor copy gemm1's tokens get)
puts natural index 8t + 2c + b of each 32-wide group at position 8c + 2t + b, the position gemm1's
epilogue computes for act (`_permuted_k`, the same formula in Gluon; checked here in Python)."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _position(n: int) -> int:  # _permuted_k's formula
    return (n & ~31) | (n & 1) | (((n >> 3) & 3) << 1) | (((n >> 1) & 3) << 3)


def test_permute_k_matches_the_epilogue_positions():
    from epmoe.experts.triton.gluon_w4a16 import permute_k

    x = torch.arange(3 * 96).reshape(3, 96)
    y = permute_k(x)
    assert y.shape == x.shape and y.is_contiguous()
    for n in range(96):
        assert torch.equal(y[:, _position(n)], x[:, n]), n
    assert sorted(_position(n) for n in range(96)) == list(range(96))  # a permutation within the row
    for p in range(96):  # within each 32-wide group: position 8c + 2t + b holds natural 8t + 2c + b
        g, c, t, b = p // 32, (p % 32) // 8, (p % 8) // 2, p % 2
        assert int(y[0, p]) == 32 * g + 8 * t + 2 * c + b


_KERNEL_CHECK = r"""
import torch
from epmoe.experts.triton import triton_experts as TE
from epmoe.experts.triton.gluon_w4a16 import permute_k

class Backend:  # the launch path of TritonExperts._permute_k, without weights
    _permute_k = TE.TritonExperts._permute_k
    def __init__(self):
        from epmoe.experts.triton.launch import KernelLauncher
        self.launcher = KernelLauncher(torch.device("cpu"))
    def _launch(self, name, grid, args, kwargs):
        self.launcher(name, grid, args, kwargs)

b = Backend()
for n, k in ((1, 32), (13, 96), (8, 256), (3, 544), (9, 7168)):
    x = torch.randn(n + 2, k + 32, dtype=torch.float32).to(torch.bfloat16)[1:-1, 32:]  # a view, row stride k + 32
    y = b._permute_k(x)
    assert torch.equal(y, permute_k(x)) and y.is_contiguous(), (n, k)
    assert torch.equal(b._permute_k(x[:, :]), y)
assert b._permute_k(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 64)
x = torch.randn(64, 5, dtype=torch.float32).to(torch.bfloat16).t()  # column stride 5: copied first
assert torch.equal(b._permute_k(x), permute_k(x))
x = torch.randn(4, 97, dtype=torch.float32).to(torch.bfloat16)[:, 1:65]  # an odd element offset
assert torch.equal(b._permute_k(x), permute_k(x))
print("OK")
"""


def test_permute_k_kernel_equals_permute_k_under_the_interpreter():
    """`TritonExperts._permute_k` (one launch of `permute_k_kernel`: gemm1's tokens before the wgmma kernel)
    equals `permute_k` on random values, for row views with a stride, rows that do not fill a program, K not
    a multiple of its block, no rows, a transposed view and an odd element offset (both copied first)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
