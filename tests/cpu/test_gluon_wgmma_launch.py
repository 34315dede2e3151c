"""Argument assembly of the Gluon W4A16 launches (wgmma prefill and mma.sync decode kernels), with the
launches RECORDED instead of run (a recording stand-in: this proves what the backend passes, not what
the kernels compute; they run in tests/gpu/test_hopper_experts.py::test_w4a16_gluon_wgmma and
::test_w4a16_gluon_decode*). Every runtime parameter of each kernel gets one argument, in order: a
missing or extra one would shift every later argument (the kernel would read the tile rows as
strides)."""

import importlib.util

import pytest
import torch

from tests.cpu.helpers import load_aot_sm90

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _recorded(kernel, mode, preset, num_tokens, monkeypatch):
    """(tile preset, the recorded launches of `kernel` (gemm1, gemm2), its runtime parameter names, its
    constexpr names) for a small DeepSeek-like layer (nvfp4: K / 16 % 16 == 0) with the Gluon kernels on."""
    from epmoe.config import MoEConfig
    from epmoe.experts.triton import gluon_w4a16 as G
    from epmoe.experts.triton import triton_experts as TE

    monkeypatch.setattr(TE, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(TE, "_gluon_available", lambda: True)
    cfg = MoEConfig(num_experts=8, top_k=8, hidden_size=512, intermediate_size=256)
    launches = [l for l in load_aot_sm90().record_launches(cfg, mode, num_tokens=num_tokens, num_experts=2, preset=preset)
                if l.kernel == kernel]  # fmt: skip
    assert [dict(l.kwargs)["GEMM1"] for l in launches] == [True, False]
    fn = getattr(G, kernel)
    return (TE.presets_for(mode)[preset], launches, [p.name for p in fn.params if not p.is_constexpr],
            {p.name for p in fn.params if p.is_constexpr})


@pytest.mark.parametrize("mode,preset", [("nvfp4_w4a16", "wgmma_w4r128_kp"), ("mxfp4_w4a16", "wgmma_w4r128_kp_m64"),
                                         ("nvfp4_w4a16", "wgmma_w4r128_kp_pend")])
def test_wgmma_launch_arguments_match_the_kernel(mode, preset, monkeypatch):
    tiles, launches, runtime, constexpr = _recorded("w4a16_wgmma_kernel", mode, preset, 80, monkeypatch)
    for launch in launches:
        kw = dict(launch.kwargs)
        assert len(launch.args) == len(runtime), (len(launch.args), runtime)
        assert set(kw) - {"num_warps"} <= constexpr
        args = dict(zip(runtime, launch.args))
        assert kw["BLOCK_M"] == tiles.block_m
        assert kw["PENDING"] == tiles.wgmma_pending
        assert kw["num_warps"] == (tiles.gemm1 if kw["GEMM1"] else tiles.gemm2).num_warps
        max_blocks = args["max_blocks"]
        assert args["block_expert_ptr"].shape == (max_blocks,)
        assert args["sorted_ids_ptr"].shape == (max_blocks * tiles.block_m,)
        n_out, k = (256, 512) if kw["GEMM1"] else (512, 256)
        assert (args["N_OUT"], args["K"]) == (n_out, k)
        assert args["stride_xm"] == args["x_ptr"].stride(0) == k
        assert args["stride_om"] == args["out_ptr"].stride(0) == n_out
        pair = 128 // (16 if mode == "nvfp4_w4a16" else 32)  # scales in K-step pairs (`kernel_formats.pair_fp4_scales`)
        rows = 2 * n_out if kw["GEMM1"] else n_out
        assert (args["stride_wsn"], args["stride_wsp"]) == (pair, rows * pair)


@pytest.mark.parametrize("mode,preset", [("nvfp4_w4a16", "decode"), ("mxfp4_w4a16", "decode_split"),
                                         ("nvfp4_w4a16", "decode_split")])
def test_decode_launch_arguments_match_the_kernel(mode, preset, monkeypatch):
    """The same for the Gluon decode kernel (`w4a16_swap_kernel`): its tile rows (block_rows, read by
    SPLIT_M) sit between the routing tables and the scalars; the register cap is a launch option."""
    from epmoe.experts.triton import triton_experts as TE

    tiles, launches, runtime, constexpr = _recorded("w4a16_swap_kernel", mode, preset, 6, monkeypatch)
    for launch in launches:
        kw = dict(launch.kwargs)
        assert len(launch.args) == len(runtime), (len(launch.args), runtime)
        assert set(kw) - {"num_warps", "maxnreg"} <= constexpr
        assert kw["BLOCK_M"] == tiles.block_m == 16 and kw["SPLIT_M"] == tiles.split_m == (preset == "decode_split")
        assert kw.get("maxnreg") == TE.GLUON_W4A16_MAXNREG
        args = dict(zip(runtime, launch.args))
        max_blocks = args["max_blocks"]
        assert args["block_rows_ptr"].dtype == torch.int32 and args["block_rows_ptr"].shape == (max_blocks,)
        assert args["block_expert_ptr"].shape == (max_blocks,)
        assert args["sorted_ids_ptr"].shape == (max_blocks * tiles.block_m,)
        n_out, k = (256, 512) if kw["GEMM1"] else (512, 256)  # the shape as constexprs, by keyword
        group = 16 if mode == "nvfp4_w4a16" else 32
        # scales in K-step pairs (`kernel_formats.pair_fp4_scales`): a row's pair 128 / group bytes, a pair of
        # all n_out rows (gemm1 gated: gate and up) contiguous
        pair = 128 // group
        rows = 2 * n_out if kw["GEMM1"] else n_out
        assert (kw["N_OUT"], kw["K"], kw["stride_wn"], kw["stride_wsn"], kw["stride_wsp"]) == (
            n_out, k, k // 2, pair, rows * pair), kw
        assert args["stride_xm"] == args["x_ptr"].stride(0) == k
        assert args["stride_om"] == args["out_ptr"].stride(0)



@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_tail_tiles_launch_arguments(mode, monkeypatch):
    """A wgmma preset with tail_rows (recorded, not run): one `tail_tiles_kernel` launch first, then per GEMM
    the wgmma kernel on the big tiles' expert list and the decode kernel on the small tiles' table (16-row
    half-split tiles at the table's rows, ROW_TABLE; gemm1 on the tokens in their natural K order, not the
    wgmma kernel's permuted copy); the same preset without tail_rows launches neither."""
    from epmoe.config import MoEConfig
    from epmoe.experts.triton import gluon_w4a16 as G
    from epmoe.experts.triton import triton_experts as TE

    monkeypatch.setattr(TE, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(TE, "_gluon_available", lambda: True)
    cfg = MoEConfig(num_experts=8, top_k=8, hidden_size=512, intermediate_size=256)
    preset = "wgmma_w4r128_kp_pend_t32"
    tiles = TE.presets_for(mode)[preset]
    assert tiles.tail_rows == 32 and tiles.wgmma
    launches = load_aot_sm90().record_launches(cfg, mode, num_tokens=80, num_experts=2, preset=preset)
    names = [l.kernel for l in launches]
    assert names.count("tail_tiles_kernel") == 1 and names.index("tail_tiles_kernel") < names.index("w4a16_wgmma_kernel")
    wg = [l for l in launches if l.kernel == "w4a16_wgmma_kernel"]
    sw = [l for l in launches if l.kernel == "w4a16_swap_kernel"]
    assert len(wg) == len(sw) == 2
    params = {k: ([p.name for p in getattr(G, k).params if not p.is_constexpr],
                  {p.name for p in getattr(G, k).params if p.is_constexpr}) for k in ("w4a16_wgmma_kernel", "w4a16_swap_kernel")}
    runtime_w = params["w4a16_wgmma_kernel"][0]
    runtime_s, constexpr_s = params["w4a16_swap_kernel"]
    for w_launch, s_launch in zip(wg, sw):
        kw = dict(s_launch.kwargs)
        assert kw["GEMM1"] == dict(w_launch.kwargs)["GEMM1"]
        assert len(s_launch.args) == len(runtime_s) and set(kw) - {"num_warps", "maxnreg"} <= constexpr_s
        assert kw["ROW_TABLE"] is True and kw["SPLIT_M"] is True and kw["BLOCK_M"] == TE.TAIL_SUB_M == 16
        a, aw = dict(zip(runtime_s, s_launch.args)), dict(zip(runtime_w, w_launch.args))
        n_tiles = 2 * (32 // 16)  # local experts x sub-tiles per expert
        assert a["max_blocks"] == n_tiles
        for name in ("block_expert_ptr", "block_rows_ptr", "block_row0_ptr"):
            assert a[name].shape == (n_tiles,) and a[name].dtype == torch.int32, name
        assert a["sorted_ids_ptr"] is aw["sorted_ids_ptr"] and a["out_ptr"] is aw["out_ptr"]
        assert aw["block_expert_ptr"].shape == (aw["max_blocks"],)
        if kw["GEMM1"]:  # the wgmma kernel reads a K-permuted copy, the decode kernel the tokens themselves
            assert a["x_ptr"] is not aw["x_ptr"] and a["x_ptr"].shape == aw["x_ptr"].shape
        else:
            assert a["x_ptr"] is aw["x_ptr"]
    plain = [l.kernel for l in load_aot_sm90().record_launches(cfg, mode, num_tokens=80, num_experts=2,
                                                               preset="wgmma_w4r128_kp_pend")]  # fmt: skip
    assert "w4a16_swap_kernel" not in plain and "tail_tiles_kernel" not in plain


@pytest.mark.parametrize("mode", ["nvfp4_w4a16", "mxfp4_w4a16"])
def test_fp4_row_tiles_option_tiles_the_weights_and_every_launch_reads_them(mode, monkeypatch):
    """Option triton_fp4_layout=tiles (recorded, not run): w13 / w2 are `tile_fp4_rows` of the rows
    layout's, and the decode and prefill launches of the Gluon kernels carry TILED=True (a constexpr of
    each kernel); a value outside rows / tiles is refused, naming it."""
    from epmoe.config import MoEConfig
    from epmoe.core.availability import Availability
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts.triton import gluon_w4a16 as G
    from epmoe.experts.triton import kernel_formats as kf
    from epmoe.experts.triton import triton_experts as TE
    from epmoe.experts.base import ExpertsSpec
    from epmoe.quant.plan import QuantPlan
    from tests import experts_testing as T

    monkeypatch.setattr(TE, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(TE, "_gluon_available", lambda: True)
    monkeypatch.setattr(TE.TritonExperts, "availability", classmethod(lambda cls, spec: Availability.yes("test")))
    cfg = MoEConfig(num_experts=8, top_k=8, hidden_size=512, intermediate_size=256)
    exs = {}
    for layout in ("rows", "tiles"):
        spec = ExpertsSpec(cfg, 0, 4, torch.device("cpu"), plan=QuantPlan(expert_mode=mode),
                           options=(("triton_fp4_layout", layout),))  # fmt: skip
        exs[layout] = TE.TritonExperts(spec)
        exs[layout].load_weights(T.random_expert_weights(cfg, 2, seed=0))
    rows, tiles = exs["rows"], exs["tiles"]
    assert tiles.fp4_tiles and not rows.fp4_tiles
    for n in ("w13", "w2"):
        assert torch.equal(tiles.parameters()[n], kf.tile_fp4_rows(rows.parameters()[n])), n
    launches = []
    tiles._launch = lambda name, grid, args, kwargs: launches.append((name, dict(kwargs)))
    for n_tokens in (3, 512):  # 12 rows per local expert (decode tiles), 2048 (prefill tiles)
        ids, w = T.random_local_routing(n_tokens, 8, 2, seed=n_tokens)
        tiles(DispatchedTokens(torch.randn(n_tokens, 512).bfloat16(), ids, w))
    for kernel, n in (("w4a16_swap_kernel", 4), ("w4a16_wgmma_kernel", 2)):  # decode; prefill: + the tail tiles'
        kws = [kw for name, kw in launches if name == kernel]
        assert len(kws) == n and all(kw["TILED"] is True for kw in kws), kernel
        assert "TILED" in {p.name for p in getattr(G, kernel).params if p.is_constexpr}
    with pytest.raises(ValueError, match="triton_fp4_layout='columns'"):
        TE.TritonExperts(ExpertsSpec(cfg, 0, 4, torch.device("cpu"), plan=QuantPlan(expert_mode=mode),
                                     options=(("triton_fp4_layout", "columns"),)))  # fmt: skip
