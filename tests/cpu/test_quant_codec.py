"""Activation payload codec: formats, quantize/dequantize, byte rows across senders, errors."""

import random

import pytest
import torch

from epmoe.quant import codec, fp8_block, mxfp8, nvfp4
from epmoe.quant.payload import PayloadFormat, QuantizedActivation


@pytest.fixture
def seed():
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    return s


def test_payload_format_names():
    assert codec.payload_format("nvfp4", torch.bfloat16) is codec.NVFP4
    assert codec.payload_format("fp8", torch.bfloat16) is codec.FP8_BLOCK
    assert codec.payload_format("fp8_block", torch.float16) is codec.FP8_BLOCK
    assert codec.payload_format("mxfp8", torch.bfloat16) is codec.MXFP8
    assert codec.payload_format("bf16", torch.float16) == PayloadFormat.unquantized(torch.float16)
    assert codec.payload_format("bf16", torch.bfloat16).dtype == torch.bfloat16
    nv = codec.NVFP4
    assert (nv.dtype, nv.values_per_element, nv.block_size, nv.scale_dtype, nv.scale_layout, nv.global_scale) == (
        torch.uint8, 2, 16, torch.float8_e4m3fn, "linear", True,
    )
    assert (codec.FP8_BLOCK.block_size, codec.FP8_BLOCK.scale_dtype) == (128, torch.float32)
    assert (codec.MXFP8.block_size, codec.MXFP8.scale_dtype) == (32, torch.uint8)
    with pytest.raises(ValueError, match="unknown payload format 'int4'"):
        codec.payload_format("int4", torch.bfloat16)


@pytest.mark.parametrize("name", ["nvfp4", "fp8", "mxfp8"])
def test_quantize_matches_format_modules(seed, name):
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    fmt = codec.payload_format(name, torch.bfloat16)
    q = codec.quantize_activation(x, fmt)
    assert isinstance(q, QuantizedActivation) and q.shape == (7, 256) and q.format is fmt
    d = codec.dequantize_activation(q, torch.float32)
    if name == "nvfp4":
        ref = nvfp4.quantize(x)
        assert torch.equal(q.data, ref.packed) and q.global_scale.dim() == 0
        want = nvfp4.dequantize(*ref, dtype=torch.float32)
    elif name == "fp8":
        ref = fp8_block.quantize_activation(x)
        want = fp8_block.dequantize_activation(*ref, dtype=torch.float32)
    else:
        ref = mxfp8.quantize(x)
        want = mxfp8.dequantize(*ref, dtype=torch.float32)
    assert torch.equal(d, want), f"seed={seed}"
    assert ((d - x.float()).norm() / x.float().norm()).item() < 0.11, f"seed={seed}"


@pytest.mark.parametrize("name", ["nvfp4", "fp8", "mxfp8"])
def test_rows_round_trip_and_mix_senders(seed, name):
    # Two senders with different data (different NVFP4 global scales) exchange rows; the receiver
    # rebuilds one QuantizedActivation from interleaved rows and must get each row back bit-exactly.
    fmt = codec.payload_format(name, torch.bfloat16)
    H = 512
    xa = torch.randn(5, H, dtype=torch.bfloat16)
    xb = torch.randn(3, H, dtype=torch.bfloat16) * 40
    qa, qb = codec.quantize_activation(xa, fmt), codec.quantize_activation(xb, fmt)
    ra, rb = codec.pack_rows(qa), codec.pack_rows(qb)
    assert ra.dtype == torch.uint8 and ra.shape == (5, codec.wire_bytes_per_token(fmt, H))
    order = [("a", 0), ("b", 2), ("a", 3), ("b", 0), ("a", 4)]
    recv = torch.stack([(ra if s == "a" else rb)[i] for s, i in order])
    q = codec.unpack_rows(recv, fmt, H)
    got = codec.dequantize_activation(q, torch.float32)
    da = codec.dequantize_activation(qa, torch.float32)
    db = codec.dequantize_activation(qb, torch.float32)
    want = torch.stack([(da if s == "a" else db)[i] for s, i in order])
    assert torch.equal(got, want), f"seed={seed}"
    if fmt.global_scale:
        assert q.global_scale.shape == (5,)
        assert q.global_scale[1].item() == qb.global_scale.item() != qa.global_scale.item()


def test_select_rows_and_empty(seed):
    x = torch.randn(6, 64)
    q = codec.quantize_activation(x, codec.NVFP4)
    idx = torch.tensor([5, 0, 0, 3])
    s = codec.select_rows(q, idx)
    assert s.num_tokens == 4 and s.global_scale.shape == (4,)
    assert torch.equal(codec.dequantize_activation(s, torch.float32), codec.dequantize_activation(q, torch.float32)[idx])
    e = codec.quantize_activation(x[:0], codec.NVFP4)
    rows = codec.pack_rows(e)
    assert rows.shape == (0, codec.wire_bytes_per_token(codec.NVFP4, 64))
    assert codec.dequantize_activation(codec.unpack_rows(rows, codec.NVFP4, 64), torch.bfloat16).shape == (0, 64)


@pytest.mark.parametrize("H", [1024, 2048, 2880, 3072, 4096, 7168])
def test_nvfp4_wire_bytes_at_most_030_of_bf16(H):
    # data H/2 + scales H/16 + 4-byte global scale vs 2H bytes of BF16: 0.28125 + 2/H <= 0.30
    ratio = codec.wire_bytes_per_token(codec.NVFP4, H) / (2 * H)
    assert ratio <= 0.30, ratio
    assert codec.wire_bytes_per_token(codec.NVFP4, H) == H // 2 + H // 16 + 4


def test_per_token_global_scale_and_encode_decode(seed):
    x = torch.randn(4, 32) * torch.tensor([[1.0], [10.0], [100.0], [0.1]])
    gs = 2688.0 / x.abs().amax(dim=1)
    q = codec.quantize_activation(x, codec.NVFP4, gs)
    assert torch.equal(q.global_scale, gs)
    assert torch.equal(codec.unpack_rows(codec.pack_rows(q), codec.NVFP4, 32).global_scale, gs)
    bf = codec.payload_format("bf16", torch.bfloat16)
    t = codec.encode_activation(x, bf)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
    assert torch.equal(codec.decode_activation(t, torch.float32), x.to(torch.bfloat16).float())
    e = codec.encode_activation(x, codec.MXFP8)
    assert isinstance(e, QuantizedActivation) and codec.decode_activation(e, torch.float32).shape == (4, 32)


def test_byte_views():
    t = torch.randn(3, 4).to(torch.float8_e4m3fn)
    b = codec.as_bytes(t)
    assert b.dtype == torch.uint8 and b.data_ptr() == t.data_ptr()
    assert torch.equal(codec.from_bytes(b, torch.float8_e4m3fn).view(torch.uint8), b)
    f = torch.randn(3, 5)
    fb = codec.as_bytes(f)
    assert fb.shape == (3, 20) and torch.equal(codec.from_bytes(fb, torch.float32), f)
    # an unaligned slice is copied, not misread
    rows = torch.cat([torch.zeros(3, 1, dtype=torch.uint8), fb], dim=1)[:, 1:]
    assert torch.equal(codec.from_bytes(rows, torch.float32), f)
    with pytest.raises(ValueError, match="whole"):
        codec.from_bytes(torch.zeros(2, 6, dtype=torch.uint8), torch.float32)
    with pytest.raises(TypeError):
        codec.from_bytes(f, torch.float32)


def test_codec_errors():
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="not quantized"):
        codec.quantize_activation(x, PayloadFormat.unquantized(torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[num_tokens, hidden_size\]"):
        codec.quantize_activation(x.reshape(2, 2, 128), codec.NVFP4)
    with pytest.raises(ValueError, match="has no global scale"):
        codec.quantize_activation(x, codec.FP8_BLOCK, 1.0)
    odd = PayloadFormat("nvfp4", torch.uint8, 2, 32, torch.float8_e4m3fn, "linear", True)
    with pytest.raises(ValueError, match="not one the codec implements"):
        codec.quantize_activation(x, odd)
    with pytest.raises(TypeError, match="PayloadFormat"):
        codec.quantize_activation(x, "nvfp4")
    q = codec.quantize_activation(x, codec.NVFP4)
    rows = codec.pack_rows(q)
    with pytest.raises(ValueError, match=r"uint8 \[N, 76\]"):
        codec.unpack_rows(rows[:, :-1], codec.NVFP4, 128)
    with pytest.raises(ValueError, match="needs its global_scale"):
        codec.dequantize_activation(QuantizedActivation(codec.NVFP4, q.data, q.scales, 128), torch.float32)
    with pytest.raises(TypeError, match="QuantizedActivation"):
        codec.dequantize_activation(x, torch.float32)
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        codec.quantize_activation(torch.randn(2, 40), codec.NVFP4)


def test_roundtrip_activation_per_token_fp8_for_humming():
    """act_format "fp8" (FlashInfer's Humming W4A8) rounds each token with ONE scale (amax / 448 of
    the row), "fp8_block" with one scale per 1x128 group: checked against float64 arithmetic."""
    from epmoe.quant.codec import roundtrip_activation

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g, dtype=torch.float64)
    x[:, :128] *= 100.0  # one loud half: per-token and per-group scales differ
    per_token = roundtrip_activation(x.float(), "fp8", torch.float64)
    s = x.abs().amax(dim=1, keepdim=True).float() / 448.0
    want = ((x.float() / s).to(torch.float8_e4m3fn).float() * s).double()  # dequantized in float32
    assert torch.equal(per_token, want)
    grouped = roundtrip_activation(x.float(), "fp8_block", torch.float64)
    s2 = x.view(5, 2, 128).abs().amax(dim=2, keepdim=True).float() / 448.0
    want2 = ((x.view(5, 2, 128).float() / s2).to(torch.float8_e4m3fn).float() * s2).double().view(5, 256)
    assert torch.equal(grouped, want2)
    assert not torch.equal(per_token, grouped)
    assert torch.equal(roundtrip_activation(x.float(), "bf16", torch.float64), x.float().double())
    assert roundtrip_activation(x[:0].float(), "fp8", torch.float64).shape == (0, 256)
