"""The Triton activation codec on a GPU: bit-identical to the torch reference on the same GPU, and
how much faster it is.

Run:  python -m pytest tests/gpu/test_triton_codec.py -q -s
Prints one line per check (shape, format, result) and a timing table (CUDA events, eager and CUDA
graph). Fresh seeds, printed with every failure. The interpreter run of the same cases (no GPU) is
tests/cpu/test_triton_codec_interpret.py; here the inline-PTX path (mul.rn / div.rn, hardware
bf16 / fp16 casts) and the real layouts are what is new.
"""

import importlib.util
import random

import pytest
import torch

from epmoe.quant import codec
from tests.cpu._triton_codec_cases import CASES, compare, run_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]
DEV = torch.device("cuda")
SHAPES = [(0, 7168), (1, 7168), (5, 2880), (128, 7168), (333, 4096), (4096, 7168)]


@pytest.fixture
def seed():
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    return s


@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_bit_exact(case, seed):
    errs = run_case(case, seed, DEV)
    assert not errs, f"{case} (seed {seed}):\n" + "\n".join(errs[:5])
    print(f"\n[triton_codec] {case}: bit-exact", end="")


def _tokens(T, H, g):
    """bf16 activations: N(0,1) rows scaled by 2^U[-8, 8], a few outlier columns, one zero row."""
    x = torch.randn(T, H, generator=g) * torch.pow(2.0, torch.randint(-8, 9, (T, 1), generator=g).float())
    if T and H:
        x[:, torch.randint(0, H, (4,), generator=g)] *= 50.0
        x[T // 2] = 0
    return x.to(torch.bfloat16).to(DEV)


@pytest.mark.parametrize("T,H", SHAPES)
def test_model_shapes_bit_exact(T, H, seed):
    """Both paths give the same wire rows (what the torch / FlashInfer dispatchers send) and the same
    dequantized tokens; FP8 1x128 rejects H = 2880 with the reference's own error."""
    g = torch.Generator().manual_seed(seed)
    x = _tokens(T, H, g)
    per_row = (torch.rand(T, generator=g) * 1000 + 1).to(DEV)
    done = []
    for fmt, gs in ((codec.NVFP4, None), (codec.NVFP4, per_row), (codec.NVFP4, torch.tensor(96.0, device=DEV)),
                    (codec.FP8_BLOCK, None), (codec.MXFP8, None)):  # fmt: skip
        label = f"{fmt.name}" + ("" if fmt != codec.NVFP4 else ("/gs per row" if gs is per_row else ("/gs given" if gs is not None else "/gs amax")))
        tag = f"{label} T={T} H={H}"
        if H % fmt.block_size:
            outcome = []
            for use in (False, True):
                with pytest.raises(ValueError) as e:
                    codec.quantize_activation(x, fmt, gs, use_triton=use)
                outcome.append(str(e.value))
            assert outcome[0] == outcome[1], f"{tag}: {outcome}"
            done.append(f"{label}: same ValueError")
            continue
        ref = codec.quantize_activation(x, fmt, gs, use_triton=False)
        got = codec.quantize_activation(x, fmt, gs, use_triton=True)
        errs = compare(f"{tag} rows", codec.pack_rows(ref), codec.pack_rows(got))
        if fmt == codec.NVFP4:
            errs += compare(f"{tag} global_scale", ref.global_scale, got.global_scale)
        rows = codec.unpack_rows(codec.pack_rows(ref), fmt, H)  # the receiver: per-row global scales
        errs += compare(
            f"{tag} dequant",
            codec.dequantize_activation(rows, torch.bfloat16, use_triton=False),
            codec.dequantize_activation(rows, torch.bfloat16, use_triton=True),
        )
        assert not errs, f"seed {seed}:\n" + "\n".join(errs)
        done.append(f"{label}: {codec.wire_bytes_per_token(fmt, H) * T} B identical")
    print(f"\n[triton_codec] T={T} H={H}: " + "; ".join(done))


def test_default_path_is_triton_on_cuda(monkeypatch):
    assert codec.triton_codec_for(DEV) is not None, codec._triton_error
    monkeypatch.setenv(codec.TRITON_CODEC_ENV, "0")
    assert codec.triton_codec_for(DEV) is None


def test_cuda_graph_capture(seed):
    """No host sync inside: the quantize (device-side global scale) and dequantize kernels capture
    into a CUDA graph and replay to the reference bytes."""
    g = torch.Generator().manual_seed(seed)
    x = _tokens(64, 7168, g)
    for _ in range(2):  # compile + warm up outside the capture
        q = codec.quantize_activation(x, codec.NVFP4, use_triton=True)
        codec.dequantize_activation(q, torch.bfloat16, use_triton=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = codec.quantize_activation(x, codec.NVFP4, use_triton=True)
        y = codec.dequantize_activation(q, torch.bfloat16, use_triton=True)
    x.copy_(_tokens(64, 7168, g))
    graph.replay()
    ref = codec.quantize_activation(x, codec.NVFP4, use_triton=False)
    errs = compare("graph rows", codec.pack_rows(ref), codec.pack_rows(q))
    errs += compare("graph dequant", codec.dequantize_activation(ref, torch.bfloat16, use_triton=False), y)
    assert not errs, f"seed {seed}:\n" + "\n".join(errs)


def _time_us(fn, iters=20, graph=False):
    """Mean microseconds per call over `iters` calls (CUDA events), eager or replaying a graph of one
    call (the GPU time without Python / launch overhead)."""
    for _ in range(3):
        fn()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def test_timing(seed):
    """Per-call time of both paths for the DeepSeek-V3 hidden size; bytes = what the kernels move."""
    g = torch.Generator().manual_seed(seed)
    H = 7168
    lines = []
    nvfp4_4096 = None
    for T in (128, 4096):
        x = _tokens(T, H, g)
        n = T * H
        q_nv = codec.quantize_activation(x, codec.NVFP4, use_triton=False)
        q_f8 = codec.quantize_activation(x, codec.FP8_BLOCK, use_triton=False)
        q_mx = codec.quantize_activation(x, codec.MXFP8, use_triton=False)
        gs = torch.tensor(1.5, device=DEV)
        ops = [  # name, fn(use_triton), bytes the kernels read + write
            ("nvfp4 quant (amax)", lambda u: codec.quantize_activation(x, codec.NVFP4, use_triton=u), 4 * n + n * 9 // 16),
            ("nvfp4 quant (gs given)", lambda u: codec.quantize_activation(x, codec.NVFP4, gs, use_triton=u), 2 * n + n * 9 // 16),
            ("nvfp4 dequant", lambda u: codec.dequantize_activation(q_nv, torch.bfloat16, use_triton=u), 2 * n + n * 9 // 16),
            ("fp8 1x128 quant", lambda u: codec.quantize_activation(x, codec.FP8_BLOCK, use_triton=u), 3 * n + n // 32),
            ("fp8 1x128 dequant", lambda u: codec.dequantize_activation(q_f8, torch.bfloat16, use_triton=u), 3 * n + n // 32),
            ("mxfp8 quant", lambda u: codec.quantize_activation(x, codec.MXFP8, use_triton=u), 3 * n + n // 32),
            ("mxfp8 dequant", lambda u: codec.dequantize_activation(q_mx, torch.bfloat16, use_triton=u), 3 * n + n // 32),
        ]  # fmt: skip
        for name, fn, nbytes in ops:
            t_ref = _time_us(lambda: fn(False), iters=10)
            t_tri = _time_us(lambda: fn(True))
            t_graph = _time_us(lambda: fn(True), graph=True)
            lines.append(
                f"T={T:5d} H={H} {name:24s} torch {t_ref:8.1f} us | triton {t_tri:7.1f} us eager, {t_graph:7.1f} us graph "
                f"({nbytes / t_graph / 1e6:6.2f} TB/s) | {t_ref / t_tri:6.1f}x"
            )
            if T == 4096 and name == "nvfp4 quant (amax)":
                nvfp4_4096 = (t_ref, t_tri)
    print(f"\n[triton_codec] {torch.cuda.get_device_name()} timings (seed {seed}):\n  " + "\n  ".join(lines))
    assert nvfp4_4096[1] < nvfp4_4096[0], f"the Triton NVFP4 quantizer is not faster: {nvfp4_4096}"
