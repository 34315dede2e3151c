"""Compile the `triton` experts kernels for sm90 on this CPU-only machine (Triton's bundled ptxas):
catches compile errors the interpreter cannot see, register spills in loops, and a missing wgmma path.
Full sweep: python benchmarks/aot_sm90.py."""

import importlib.util
import os

import pytest

from tests.cpu.helpers import load_aot_sm90

pytestmark = [pytest.mark.slow]


def _aot():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton has no bundled ptxas")
    return load_aot_sm90(), triton


@pytest.mark.parametrize(
    "mode,preset,wgmma",
    [
        ("bf16", "decode", False),
        ("bf16", "prefill", True),
        ("fp8_block", "decode", False),
        ("fp8_block", "prefill", True),
        ("nvfp4_w4a16", "decode", False),
        ("mxfp4_w4a16", "decode", False),
        ("mxfp4_w4a16", "prefill", True),
    ],
)
def test_sm90_compile_no_spills(mode, preset, wgmma, monkeypatch):
    aot, triton = _aot()
    from triton.backends.compiler import GPUTarget

    from epmoe.config import MoEConfig

    # Small GPT-OSS-like shape: biases, clamped swiglu, H % 128 != 0 (masked K tails for fp8).
    cfg = MoEConfig(
        num_experts=8, top_k=4, hidden_size=320, intermediate_size=192, has_bias=True,
        swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
    )  # fmt: skip
    launches = aot.record_launches(cfg, mode, num_tokens=16, num_experts=2, preset=preset)
    gluon = mode.endswith("w4a16") and preset == "decode"  # W4A16 decode tiles: the Gluon kernels
    gemms = {"w4a16_swap_kernel"} if gluon else {"moe_gemm1_kernel", "moe_gemm2_kernel"}
    assert {l.kernel for l in launches} >= gemms | {"moe_reduce_kernel"}
    for launch in launches:
        src, opts = aot.to_source(launch)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        info = aot.analyze(compiled)
        where = f"{mode}/{preset}/{launch.kernel}: {info}"
        # no spills in any loop; a few values kept across the main loop on the stack are allowed (Triton
        # 3.9's ptxas does that for the words-conversion decode kernel: 2 stores before it, 2 loads after)
        assert info["local"] == 0 and info["loop_ldl_stl"] == 0 and info["stack"] <= 16, f"register spills: {where}"
        if wgmma and launch.kernel.startswith("moe_gemm"):
            assert info["hgmma"] + info["qgmma"] > 0, f"no wgmma: {where}"
        if launch.kernel == "w4a16_swap_kernel":
            # fp4 bytes go from global memory straight into the mma.sync operand registers
            assert info["smem"] == 0 and info["hmma"] > 0, f"Gluon W4A16 kernel: {where}"
        ptx = compiled.asm["ptx"]
        if launch.kernel == "quant_fp8_rows_kernel":
            # The torch codec divides with IEEE rounding; Triton's `/` is div.full.f32 (<= 2 ulp),
            # which flips e4m3 rounding ties of bf16 inputs (~0.1% of values, 1.5e-2 output error
            # against the codec-quantized reference on the H200).
            assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx.f32" not in ptx, where
        if launch.kernel == "moe_gemm1_kernel" and mode == "fp8_block":
            assert "div.rn.f32" in ptx, f"gemm1's fp8 epilogue must divide with IEEE rounding: {where}"


def _compile_routing_launch(routing, E, K, kernel, **record):
    """Record the routing launch of a layer config (`aot.record_routing_launches(cfg, **record)`),
    check it is the one `kernel` launch, compile it for sm90 and check: no spills, IEEE division only
    (div.rn, never div.full / div.approx). -> the recorded launches."""
    aot, triton = _aot()
    from triton.backends.compiler import GPUTarget

    from epmoe.config import MoEConfig

    extra = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5) if routing == "sigmoid_grouped" else {}
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=256, intermediate_size=128, routing=routing, **extra)
    launches = aot.record_routing_launches(cfg, **record)
    assert [l.kernel for l in launches] == [kernel]
    src, opts = aot.to_source(launches[0])
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    info = aot.analyze(compiled)
    # no spills in any loop; a few values kept across the loops on the stack are allowed (Triton 3.6's
    # ptxas, the device's, does that for route_align_kernel with softmax over 128 experts: 3 instructions)
    assert info["local"] == 0 and info["loop_ldl_stl"] == 0 and info["stack"] <= 16, \
        f"register spills: {routing} E={E}: {info}"
    ptx = compiled.asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx.f32" not in ptx
    return launches


@pytest.mark.parametrize("routing, E, K", [("softmax", 128, 8), ("softmax", 512, 10), ("sigmoid_grouped", 256, 8)])
def test_sm90_compile_routing_kernels(routing, E, K):
    """The fused routing kernel compiles for sm90 without spills, with the precise expf of libdevice and
    IEEE division (as torch's kernels), never the approximate ones."""
    launches = _compile_routing_launch(routing, E, K, f"route_{routing}_kernel", num_tokens=64)
    assert dict(launches[0].kwargs)["PRECISE"] is True  # libdevice expf on the device, not ex2.approx alone


@pytest.mark.parametrize("routing, E, K, T", [("softmax", 128, 8, 128), ("sigmoid_grouped", 256, 8, 128),
                                              ("softmax", 60, 6, 5), ("softmax", 512, 2, 128)])
def test_sm90_compile_route_align_kernel(routing, E, K, T):
    """The routing launch that also aligns (`route_align_kernel`: the routing rows in a loop, then the
    one-program alignment) compiles for sm90 without spills, with the routing's precise math."""
    _compile_routing_launch(routing, E, K, "route_align_kernel", num_tokens=T, align_block_m=16)


def test_sm90_compile_alignment_kernels_both_paths():
    """align_small_kernel (one program), the three-kernel path with the padding rows written by
    align_plan, the one-launch sort (align_sort_kernel) and the deepgemm layout's scatter (expert and
    inverse written too) compile for sm90 without spills (DeepSeek-V3-like: 128 local experts)."""
    aot, triton = _aot()
    import torch
    from triton.backends.compiler import GPUTarget

    from epmoe.experts.triton import align as A

    launches = []
    rec = lambda name, grid, args, kwargs: launches.append(aot.Launch(name, args, tuple(kwargs.items())))  # noqa: E731
    for n in (128, 512):  # 1024 entries: one program; 4096: three kernels
        A.align_blocks_triton(torch.zeros(n, 8, dtype=torch.int32), 128, 16, rec)
    A.sort_by_expert_triton(torch.zeros(4096, 8, dtype=torch.int32), 128, rec)  # the grouped_mm path's sort
    # the deepgemm experts' contiguous layout: the scatter also writes m_indices and each entry's row
    A.contiguous_layout_rows(torch.zeros(4096, 8, dtype=torch.int32), 128, 128, rec)
    assert [l.kernel for l in launches] == ["align_small_kernel", "align_count_kernel", "align_plan_kernel",
                                            "align_scatter_kernel", "align_sort_kernel", "align_count_kernel",
                                            "align_plan_kernel", "align_scatter_kernel"]
    assert dict(launches[-1].kwargs)["WITH_INV"] and dict(launches[-1].kwargs)["WITH_EXPERT"]
    for launch in launches:
        src, opts = aot.to_source(launch)
        info = aot.analyze(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts))
        assert info["local"] == 0 and info["ldl_stl"] == 0, f"register spills: {launch.kernel}: {info}"


def test_sass_loop_parsers_on_a_written_listing():
    """benchmarks/aot_sm90.py's SASS readers on a listing written here (no compiler involved): the main
    loop is the longest loop with a matrix instruction, its full wgmma waits are the `gsb0, 0x0` ones
    (not the depth-2 waits), and spill instructions count only inside loops."""
    aot = load_aot_sm90()
    lines = [
        "STL [R1], R2",  # before every loop: not counted
        "IADD3 R0, R0, 0x1, RZ",  # loop 1 (0x0010 .. 0x0030): no matrix instruction
        "ISETP.GE.AND P0, PT, R0, 0x8, PT",
        "@!P0 BRA 0x0010",
        "HGMMA.64x128x16.F32.BF16 R24, R96, gdesc[UR16], R24, gsb0",  # loop 2 (0x0040 .. 0x00a0)
        "WARPGROUP.DEPBAR.LE gsb0, 0x2",
        "LDL R3, [R1]",
        "HGMMA.64x128x16.F32.BF16 R24, R100, gdesc[UR16], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "LOP3.LUT R5, R4, 0x81c081c0, RZ, 0xc0, !PT",
        "BRA 0x0040",
        "LDL R3, [R1]",  # after the loops: not counted
        "EXIT",
    ]
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(lines))
    assert aot.mma_loop(sass) == {"mma_loop": 7, "mma_loop_full_waits": 1}
    assert aot.loop_spills(sass) == 1
    assert aot.mma_loop(sass.replace("HGMMA", "IMAD")) == {"mma_loop": 0, "mma_loop_full_waits": 0}


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("preset", ["decode_split", "wgmma_w4r128_kp_pend", "prefill_n128"])
def test_sm90_compile_fp4_row_tiles(mode, preset, monkeypatch):
    """Option triton_fp4_layout=tiles (fp4 weights in row tiles, every kernel's TILED): the Gluon decode
    and wgmma kernels and the Triton kernels compile for sm90 without spills in a loop, with the same
    matrix instructions as the rows layout (only the address arithmetic differs)."""
    aot, triton = _aot()
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl

    from epmoe.config import MoEConfig
    from epmoe.experts.triton import triton_experts as TE

    if preset.startswith("wgmma") and not hasattr(gl, "thread_barrier"):
        pytest.skip(f"the Gluon wgmma kernel is written for Triton 3.6's Gluon API (this is {triton.__version__})")
    monkeypatch.setattr(TE, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(TE, "_gluon_available", lambda: True)
    cfg = MoEConfig(num_experts=8, top_k=8, hidden_size=1024, intermediate_size=512)
    infos = {}
    for layout in ("rows", "tiles"):
        launches = [l for l in aot.record_launches(cfg, mode, num_tokens=16, num_experts=2, preset=preset,
                                                   options=(("triton_fp4_layout", layout),))
                    if l.kernel.startswith(("w4a16_", "moe_gemm"))]  # fmt: skip
        assert len(launches) == 2 and all(dict(l.kwargs)["TILED"] == (layout == "tiles") for l in launches)
        infos[layout] = []
        for launch in launches:
            src, opts = aot.to_source(launch)
            infos[layout].append((launch.kernel, aot.analyze(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts))))
    for (kernel, plain), (_, tiled) in zip(infos["rows"], infos["tiles"]):
        where = f"{mode} {preset} {kernel}: rows {plain}, tiles {tiled}"
        assert tiled["local"] == 0 and tiled["loop_ldl_stl"] == 0 and tiled["stack"] <= 16, where
        assert (tiled["hmma"], tiled["hgmma"]) == (plain["hmma"], plain["hgmma"]) != (0, 0), where


def test_sm90_compile_grouped_mm_training_kernels():
    """The grouped_mm experts' fused training stage: its forward (gather, activation, combine) and backward
    (unit-weight combine, activation backward, combine backward) kernels compile for sm90 without spills,
    bf16, for every activation."""
    aot, triton = _aot()
    import torch
    from triton.backends.compiler import GPUTarget

    from epmoe.config import MoEConfig
    from epmoe.experts.triton.grouped_mm import fused_grouped_mm_train_forward

    launches = []
    rec = lambda name, grid, args, kwargs: launches.append(aot.Launch(name, args, tuple(kwargs.items())))  # noqa: E731
    for act in ({}, dict(swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0), dict(activation="relu2")):
        cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16, **act)
        x = torch.zeros(8, 256, dtype=torch.bfloat16, requires_grad=True)
        w = torch.full((8, 2), 0.5, requires_grad=True)
        p = {"w13": torch.zeros(4, cfg.w13_rows, 256, dtype=torch.bfloat16, requires_grad=True),
             "w2": torch.zeros(4, 256, 128, dtype=torch.bfloat16, requires_grad=True)}
        ids = torch.tensor([[0, 1], [2, 3]] * 4, dtype=torch.int32)
        out = fused_grouped_mm_train_forward(x, ids, w, p, cfg, 4, rec)
        out.float().sum().backward()
    names = [l.kernel for l in launches]
    assert names[:6] == ["gather_rows_kernel", "grouped_act_kernel", "grouped_combine_kernel",
                         "combine_bwd_kernel", "grouped_act_bwd_kernel", "grouped_combine_kernel"], names
    for launch in launches:
        src, opts = aot.to_source(launch)
        info = aot.analyze(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts))
        assert info["local"] == 0 and info["ldl_stl"] == 0, f"register spills: {launch.kernel}: {info}"
