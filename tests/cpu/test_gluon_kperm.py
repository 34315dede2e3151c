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
    from epmoe.experts.gluon_w4a16 import permute_k

    x = torch.arange(3 * 96).reshape(3, 96)
    y = permute_k(x)
    assert y.shape == x.shape and y.is_contiguous()
    for n in range(96):
        assert torch.equal(y[:, _position(n)], x[:, n]), n
    assert sorted(_position(n) for n in range(96)) == list(range(96))  # a permutation within the row
    for p in range(96):  # within each 32-wide group: position 8c + 2t + b holds natural 8t + 2c + b
        g, c, t, b = p // 32, (p % 32) // 8, (p % 8) // 2, p % 2
        assert int(y[0, p]) == 32 * g + 8 * t + 2 * c + b
