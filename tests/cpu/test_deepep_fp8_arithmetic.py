"""The arithmetic behind the DeepEP normal-mode FP8 check, without the kernel (docs/deepep.md, "FP8 in
normal mode").

The GPU check failed with "FP8 data bytes equal, FP8 scales differ". The dispatcher quantized on the
GPU with `amax / 448.0` and the check recomputed the expected rows on the CPU with the same
expression. PyTorch's CUDA division by a CPU scalar computes `a * (1 / b)` (ATen's
div_true_kernel_cuda: "may lose one bit of precision"), the CPU divides: the scales of some blocks
differ in their last bit. The data bytes came from `x * (448.0 / amax)`, which is
`amax.reciprocal() * 448` on both devices, hence equal. The CUDA side is emulated here exactly:
a float32 product with fl32(1/448) is correctly rounded on every device."""

from __future__ import annotations

import torch

from epmoe.dispatch import deepep as dd
from epmoe.quant import codec
from tests.cpu.helpers import fresh_seed

INV_448 = torch.tensor(1.0) / torch.tensor(448.0)  # fl32(1/448), as CUDA's `1.0f / 448.0f`


def _bf16_blocks(seed: int, rows: int = 512, hidden: int = 7168) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, hidden, generator=g) * torch.logspace(-2, 1, rows).unsqueeze(1)).to(torch.bfloat16)


def _amax(x: torch.Tensor, floor: float) -> torch.Tensor:
    return x.float().view(x.shape[0], -1, 128).abs().amax(dim=2).clamp(min=floor)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def test_cuda_scalar_division_differs_from_the_cpu_division_in_the_last_bit():
    """The old check's mechanism: the same expression gives other scales on the two devices (by one
    ulp at most), while the data factor is the same on both."""
    seed = fresh_seed()
    amax = _amax(_bf16_blocks(seed), 1e-4)
    cpu = amax / 448.0  # true division
    cuda = amax * INV_448  # what CUDA computes for `amax / 448.0`
    ulps = _ulps(cpu, cuda)
    assert 0 < int((ulps > 0).sum()) and int(ulps.max()) == 1, f"seed {seed}: {int((ulps > 0).sum())} differ"
    # the data factor `448.0 / amax` is `amax.reciprocal() * 448` on every device (Tensor.__rtruediv__)
    assert torch.equal(448.0 / amax, amax.reciprocal() * 448.0)


def test_deepep_low_latency_cast_is_deepeps_recipe_on_every_device():
    """fp8_block_quantize replicates DeepEP's low-latency cast: scale = amax * fl32(1/448) (its
    kFinfoAmaxInvE4M3), data = e4m3(x * (448 / amax)) with a true division; no Python-number divisor,
    so CPU and CUDA give the same bits."""
    seed = fresh_seed()
    x = _bf16_blocks(seed, rows=64, hidden=1024)
    x[0, :128] = 0  # an all-zero block: amax floor 1e-4, zero data
    data, scales = dd.fp8_block_quantize(x)
    amax = _amax(x, 1e-4)
    assert torch.equal(scales.view(torch.int32), (amax * INV_448).view(torch.int32)), f"seed {seed}"
    factor = torch.full_like(amax, 448.0) / amax  # a true division, as DeepEP's `kFinfoAmaxE4M3 / amax`
    want = (x.float().view(64, -1, 128) * factor.unsqueeze(2)).to(torch.float8_e4m3fn).view(64, 1024)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), f"seed {seed}"
    assert not data[0, :128].float().any()


def test_normal_mode_quantizer_divides_by_a_tensor():
    """The normal mode sends `codec.quantize_for_wire` bytes (eps 1e-10, scale = amax / 448 divided by
    a device tensor, data = x / scale): on the CPU a true division, the same bits CUDA gives (the GPU
    side of this is checked by tests/gpu/test_triton_codec.py and tests/gpu/deepep_fp8_diag.py)."""
    seed = fresh_seed()
    x = _bf16_blocks(seed, rows=64, hidden=1024)
    q = codec.quantize_for_wire(x, dd.fp8_block_format(), use_triton=False)
    amax = _amax(x, 1e-10)
    assert torch.equal(q.scales.view(torch.int32), (amax / torch.tensor(448.0)).view(torch.int32)), f"seed {seed}"
    assert dd.fp8_block_format() == codec.FP8_BLOCK
