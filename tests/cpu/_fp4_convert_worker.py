"""Triton-interpreter worker (TRITON_INTERPRET=1): the packed fp4 -> bf16 conversion
(`_fp4_dequant_packed`) against the legacy one (`_fp4_dequant`) on every byte value and a sweep of
scales, bit for bit; then the W4A16 experts forward with each, output bit for bit. One JSON line per case."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.cpu.interpret import report_cases  # noqa: E402
from epmoe.experts.triton import kernel_formats as kf  # noqa: E402
from epmoe.experts.triton import triton_kernels as K  # noqa: E402
from epmoe.quant.e2m1 import e2m1_codes_to_float  # noqa: E402
from tests.triton_interpret import match_gpu_rounding  # noqa: E402

match_gpu_rounding()


@triton.jit
def _convert_both(p_ptr, s_ptr, legacy_ptr, packed_ptr, BN: tl.constexpr, W_FMT: tl.constexpr):
    """One k64 block: p [32, BN] bytes (row j, column n), scales s [BN, 4] (nvfp4) / [BN, 2] (mxfp4),
    kk = 0. Writes both conversions as [64, BN] bf16 (rows 0..31 low nibbles, 32..63 high)."""
    HALF: tl.constexpr = 32
    rows = tl.arange(0, HALF)[:, None]
    cols = tl.arange(0, BN)[None, :]
    p = tl.load(p_ptr + rows * BN + cols)
    G: tl.constexpr = 4 if W_FMT == 2 else 2
    s_ptrs = s_ptr + tl.arange(0, BN) * G
    s0, s1, s2, s3 = K._fp4_scales(s_ptrs, 0, 2 * G, W_FMT)  # (kk = 0: the pair stride is not read)
    a_lo, a_hi = K._fp4_dequant(p, s0, s1, s2, s3, HALF, W_FMT, tl.bfloat16)
    b_lo, b_hi = K._fp4_dequant_packed(p, s0, s1, s2, s3, HALF, W_FMT)
    tl.store(legacy_ptr + rows * BN + cols, a_lo)
    tl.store(legacy_ptr + (rows + HALF) * BN + cols, a_hi)
    tl.store(packed_ptr + rows * BN + cols, b_lo)
    tl.store(packed_ptr + (rows + HALF) * BN + cols, b_hi)


def convert_case(fmt: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    BN = 64
    W_FMT = 2 if fmt == "nvfp4" else 3
    res = {}
    # every byte value in every (row, column) position over a few blocks
    for rep in range(4):
        p = torch.randperm(256, generator=g).repeat(8)[: 32 * BN].reshape(32, BN).to(torch.uint8).contiguous()
        if fmt == "nvfp4":
            # every finite e4m3 value > 0 appears as a scale (incl. subnormals 2^-9.., max 448); +0 scales
            # come with +0 weights after a load (`normalize_nvfp4_scales`), as the load tests check
            allv = torch.arange(1, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
            s8 = allv[torch.randint(0, allv.numel(), (BN, 4), generator=g)].view(torch.float8_e4m3fn).contiguous()
            s = kf.encode_nvfp4_scales(s8.clone())  # the kernels read scale codes (what a load stores)
        else:
            # e8m0 exponents 0..128 (the packed range)
            s = torch.randint(0, 129, (BN, 2), generator=g, dtype=torch.int32).to(torch.uint8).contiguous()
            if rep == 0:
                s[:, 0] = torch.arange(BN) * 2 % 129
        legacy = torch.empty(64, BN, dtype=torch.bfloat16)
        packed = torch.empty(64, BN, dtype=torch.bfloat16)
        _convert_both[(1,)](p, s, legacy, packed, BN=BN, W_FMT=W_FMT)
        # packed nvfp4 weights carry 2^-7 (the global scale takes it back): legacy / 2^7 exactly
        want = legacy if fmt == "mxfp4" else (legacy.float() / 128).to(torch.bfloat16)
        bad = int((packed.view(torch.int16) != want.view(torch.int16)).sum())
        if fmt == "nvfp4":  # and the exact relation the other way round
            bad += int(((packed.float() * 128).to(torch.bfloat16).view(torch.int16) != legacy.view(torch.int16)).sum())
        if fmt == "nvfp4":  # absolute: legacy is bf16(value * e4m3 scale) exactly (<= 6 significant bits)
            v = e2m1_codes_to_float(torch.cat([p & 15, p >> 4])).double()  # [64, BN]: low nibbles, then high
            grp = torch.cat([torch.arange(32) // 16, 2 + torch.arange(32) // 16])  # k64 block rows -> group
            sc = s8.double()[:, grp].T  # [64, BN]
            bad += int(((v * sc).to(torch.bfloat16).view(torch.int16) != legacy.view(torch.int16)).sum())
        res[f"mismatch_{rep}"] = bad
        res["nonzero"] = res.get("nonzero", 0) + int((legacy != 0).sum())
    res["mismatch"] = sum(v for k, v in res.items() if k.startswith("mismatch_"))
    return res


def forward_case(mode: str, seed: int) -> dict:
    from epmoe.config import MoEConfig
    from epmoe.dispatch.base import DispatchedTokens
    from tests import experts_testing as T
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.triton.triton_experts import GemmConfig, TritonConfig, TritonExperts
    from epmoe.quant.plan import QuantPlan

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, has_bias=True,
                    swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)  # fmt: skip
    w = T.random_expert_weights(cfg, 4, seed=seed)
    tcfg = TritonConfig("tiny", 16, GemmConfig(32, 64, 4, 1, 2), GemmConfig(32, 64, 4, 1, 2))
    outs = {}
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(7, 128, generator=g).bfloat16()
    ids, tw = T.random_local_routing(7, 2, 4, seed=seed + 2, invalid_frac=0.2)
    for conv in ("legacy", "packed"):
        spec = ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode=mode),
                           options=(("triton_fp4_convert", conv),))  # fmt: skip
        ex = TritonExperts(spec)
        ex.config_override = tcfg
        ex.load_weights(w)
        assert ex.fp4_packed == (conv == "packed")
        outs[conv] = ex(DispatchedTokens(x, ids, tw))
    return dict(equal=bool(torch.equal(outs["legacy"], outs["packed"])),
                max_diff=float((outs["legacy"].float() - outs["packed"].float()).abs().max()))  # fmt: skip


def _same_outputs(a, b, hidden: int, seed: int, res: dict) -> dict:
    """Experts a and b (4 experts, top-2) on the same tokens: a small forced preset, then the auto presets
    at decode and prefill sizes (invalid slots included); per size into res: outputs equal bit for bit,
    a's preset, the largest difference, a's nonzero outputs."""
    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.experts.triton.triton_experts import GemmConfig, TritonConfig
    from tests import experts_testing as T

    tiny = TritonConfig("tiny", 16, GemmConfig(32, 64, 4, 1, 2), GemmConfig(32, 64, 4, 1, 2))
    g = torch.Generator().manual_seed(seed + 1)
    for name, n, override in (("tiny", 7, tiny), ("decode", 5, None), ("prefill", 300, None)):
        x = torch.randn(n, hidden, generator=g).bfloat16()
        ids, tw = T.random_local_routing(n, 2, 4, seed=seed + 2, invalid_frac=0.2)
        outs = []
        for ex in (a, b):
            ex.config_override = override
            outs.append(ex(DispatchedTokens(x, ids, tw)))
        res[f"{name}_equal"] = bool(torch.equal(outs[0], outs[1]))
        res[f"{name}_preset"] = a.tile_config(n * 2).name
        res[f"{name}_max_diff"] = float((outs[0].float() - outs[1].float()).abs().max())
        res[f"{name}_nonzero"] = int((outs[0] != 0).sum())
    return res


def tiles_case(mode: str, seed: int) -> dict:
    """triton_fp4_layout=tiles (fp4 weights in row tiles, the kernels' TILED) against rows: the Triton
    kernels' output bit for bit, with a small forced preset and with the auto presets at decode and
    prefill sizes (biases, clamped swiglu, invalid slots)."""
    from epmoe.config import MoEConfig
    from tests import experts_testing as T
    from epmoe.experts.triton import kernel_formats as kf
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.triton.triton_experts import TritonExperts
    from epmoe.quant.plan import QuantPlan

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, has_bias=True,
                    swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)  # fmt: skip
    w = T.random_expert_weights(cfg, 4, seed=seed)
    exs = {}
    for layout in ("rows", "tiles"):
        spec = ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode=mode),
                           options=(("triton_fp4_layout", layout),))  # fmt: skip
        exs[layout] = TritonExperts(spec)
        exs[layout].load_weights(w)
    rows, tiles = exs["rows"], exs["tiles"]
    res = dict(tiled=bool(tiles.fp4_tiles and not rows.fp4_tiles),
               layout_ok=all(torch.equal(tiles.parameters()[n], kf.tile_fp4_rows(rows.parameters()[n]))
                             for n in ("w13", "w2")))  # fmt: skip
    return _same_outputs(rows, tiles, 128, seed, res)


def pairs_case(mode: str, seed: int) -> dict:
    """The fp4 scales in K-step pairs (`kernel_formats.pair_fp4_scales`, what the backend loads) against
    the same scales row-major (pair stride = one pair: [E, R, K/group] padded to whole pairs, viewed as
    pairs): the Triton kernels' output bit for bit, H = 192 (3 K steps: an odd count, the last pair half
    padding) and I = 64 (1 step), a small forced preset and the auto presets at decode and prefill sizes."""
    from epmoe.config import MoEConfig
    from tests import experts_testing as T
    from epmoe.experts.triton import kernel_formats as kf
    from epmoe.experts.base import ExpertsSpec
    from epmoe.experts.triton.triton_experts import TritonExperts
    from epmoe.quant.plan import QuantPlan

    H, I = 192, 64
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=H, intermediate_size=I, has_bias=True,
                    swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)  # fmt: skip
    w = T.random_expert_weights(cfg, 4, seed=seed)
    group = 16 if mode == "nvfp4_w4a16" else 32
    exs = []
    for _ in range(2):
        ex = TritonExperts(ExpertsSpec(cfg, 0, 1, torch.device("cpu"), plan=QuantPlan(expert_mode=mode)))
        ex.load_weights(w)
        exs.append(ex)
    paired, rowmajor = exs
    res = dict(strides={})
    for name, k in (("w13_scale", H), ("w2_scale", I)):
        p = paired._params[name]
        E, R, pairs, pair = p.shape
        flat = torch.zeros(E, R, pairs * pair, dtype=torch.uint8)
        flat[:, :, : k // group] = kf.unpair_fp4_scales(p, group, k)
        rowmajor._params[name] = flat.view(E, R, pairs, pair)
        res["strides"][name] = [list(p.stride()), list(rowmajor._params[name].stride())]
    rowmajor._wops = None  # the launch operands are cached per weight set
    return _same_outputs(paired, rowmajor, H, seed, res)


def _run(case: str, seed: int) -> dict:
    kind, what = case.split(":")
    if kind == "tiles":
        return tiles_case(what, seed)
    if kind == "pairs":
        return pairs_case(what, seed)
    return convert_case(what, seed) if kind == "convert" else forward_case(what, seed)


def main() -> None:
    report_cases(sys.argv[1:], _run)


if __name__ == "__main__":
    main()
