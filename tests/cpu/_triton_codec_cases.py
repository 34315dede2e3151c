"""Bit-exactness cases for the Triton activation codec against the torch reference, shared by the
interpreter test (tests/cpu/test_triton_codec_interpret.py: device "cpu" under TRITON_INTERPRET=1)
and the GPU test (tests/gpu/test_triton_codec.py: device "cuda").

`run_case(name, seed, device)` returns a list of mismatch descriptions ([] = bit-identical). Inputs
are built on the CPU from a seeded generator, then moved to `device`. Every comparison is bitwise;
NaN-aware only where a case feeds NaN on purpose (docs/formats.md, NaN policy).
"""

import numpy as np
import torch

from epmoe.quant import codec, fp8_block, mxfp8, nvfp4

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(_INT_VIEW[t.element_size()]).to(torch.int64)


def compare(name: str, ref: torch.Tensor, got: torch.Tensor, nan_aware: bool = False) -> list:
    """[] when identical bit for bit (or both NaN, with nan_aware), else one description."""
    if ref.shape != got.shape or ref.dtype != got.dtype or ref.device != got.device:
        return [f"{name}: {list(ref.shape)} {ref.dtype} {ref.device} vs {list(got.shape)} {got.dtype} {got.device}"]
    same = bits(ref) == bits(got)
    if nan_aware and ref.dtype == torch.float8_e4m3fn:
        same |= ((bits(ref) & 0x7F) == 0x7F) & ((bits(got) & 0x7F) == 0x7F)
    elif nan_aware and ref.is_floating_point():
        same |= torch.isnan(ref.float()) & torch.isnan(got.float())
    bad = (~same).nonzero()
    if len(bad) == 0:
        return []
    i = tuple(bad[0].tolist())
    return [
        f"{name}: {len(bad)} of {same.numel()} differ, first at {list(i)}: "
        f"ref {ref[i].float().item()!r} (bits {bits(ref)[i].item():#x}) vs triton {got[i].float().item()!r} "
        f"(bits {bits(got)[i].item():#x})"
    ]


class _Cmp:
    """Quantize with both paths on one device and compare every output, then dequantize the
    reference bytes with both paths."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.calls = 0

    def __call__(self, fmt, x, gs=None, tag="", nan_aware=False, out_dtypes=(torch.bfloat16,)) -> list:
        self.calls += 1
        x = x.to(self.device)
        gs = gs.to(self.device) if isinstance(gs, torch.Tensor) else gs
        ref = codec.quantize_activation(x, fmt, gs, use_triton=False)
        got = codec.quantize_activation(x, fmt, gs, use_triton=True)
        errs = compare(f"{tag} data", ref.data, got.data, nan_aware)
        errs += compare(f"{tag} scales", ref.scales, got.scales, nan_aware)
        if fmt == codec.NVFP4:
            errs += compare(f"{tag} global_scale", ref.global_scale, got.global_scale)
        for dt in out_dtypes:
            errs += compare(
                f"{tag} dequant {dt}",
                codec.dequantize_activation(ref, dt, use_triton=False),
                codec.dequantize_activation(ref, dt, use_triton=True),
                nan_aware=True,
            )
        return errs


def _blocky(g, T, H, block, lo, hi, dtype) -> torch.Tensor:
    """N(0,1) values, each `block` values scaled by 2^U[lo, hi] (block maxima over many binades)."""
    e = torch.randint(lo, hi + 1, (T, H // block, 1), generator=g).to(torch.float64)
    x = torch.randn(T, H // block, block, generator=g, dtype=torch.float64) * torch.pow(2.0, e)
    return x.reshape(T, H).to(dtype)


def _binade_range(dtype):
    return {torch.float16: (-20, 12), torch.bfloat16: (-60, 60), torch.float32: (-60, 60)}[dtype]


def _sign(g, n):
    return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


# ------------------------------------------------------------------ cases
def case_random(cmp, g, fmt_name: str, dtype_name: str) -> list:
    fmt = codec.QUANTIZED_FORMATS[fmt_name]
    dtype = DTYPES[dtype_name]
    errs = []
    for T, H in ((1, 256), (7, 384), (33, 128)):
        errs += cmp(fmt, torch.randn(T, H, generator=g).to(dtype), tag=f"randn {T}x{H}")
    lo, hi = _binade_range(dtype)
    for block in (16, 32, 128):
        errs += cmp(fmt, _blocky(g, 9, 512, block, lo, hi, dtype), tag=f"binades/{block}")
    return errs


def case_adversarial(cmp, g, fmt_name: str, dtype_name: str) -> list:
    """Zero rows / blocks / -0.0, all-equal blocks, subnormal and huge values, the dtype max, +-inf."""
    fmt = codec.QUANTIZED_FORMATS[fmt_name]
    dtype = DTYPES[dtype_name]
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    errs = []
    x = torch.randn(6, 256, generator=g).to(dtype)
    x[1] = 0
    x[2, :128] = -0.0
    x[3] = x[3, :1].expand(256)  # all-equal row
    x[4].view(-1, 16)[:, :] = torch.randn(16, 1, generator=g).to(dtype)  # all-equal 16-blocks
    x[5, ::3] = 0
    errs += cmp(fmt, x, tag="zeros/equal", out_dtypes=(torch.bfloat16, torch.float32))
    errs += cmp(fmt, torch.zeros(3, 128, dtype=dtype), tag="all zero")
    errs += cmp(fmt, -torch.zeros(2, 128, dtype=dtype), tag="all -0")
    sub = torch.randn(4, 256, generator=g).to(torch.float64) * tiny * 2.0 ** -torch.randint(0, 9, (4, 256), generator=g)
    errs += cmp(fmt, sub.to(dtype), tag="subnormal inputs", out_dtypes=(torch.bfloat16, torch.float16))
    mix = torch.randn(4, 256, generator=g).to(dtype)
    mix[:, 64:] = sub[:, 64:].to(dtype)
    errs += cmp(fmt, mix, tag="normal + subnormal")
    big = (torch.rand(3, 256, generator=g).to(torch.float64) * 2 - 1) * fmax
    big[0, 5] = fmax
    big[1, 7] = -fmax
    errs += cmp(fmt, big.to(dtype), tag="huge", out_dtypes=(torch.bfloat16, torch.float16))
    inf = torch.randn(3, 256, generator=g).to(dtype)
    inf[0, 3] = float("inf")
    inf[1, 100] = float("-inf")
    inf[2, 40:48] = float("inf")
    errs += cmp(fmt, inf, tag="inf")
    return errs


def case_nvfp4_scales(cmp, g, dtype_name: str) -> list:
    """NVFP4 global-scale variants: given float / [1] / per-row; saturating, subnormal and zero block
    scales; a tensor whose amax is subnormal (global scale inf); 3D input through triton_codec."""
    from epmoe.quant import triton_codec as tc

    dtype = DTYPES[dtype_name]
    fmt = codec.NVFP4
    errs = []
    x = torch.randn(5, 256, generator=g).to(dtype)
    errs += cmp(fmt, x, 2.5, tag="gs float")
    errs += cmp(fmt, x, torch.tensor([300.0]), tag="gs [1]")
    per_row = torch.pow(2.0, torch.randint(-12, 12, (5,), generator=g).float()) * torch.rand(5, generator=g).add(0.5)
    errs += cmp(fmt, x, per_row, tag="gs per row")
    errs += cmp(fmt, x, 1e-3, tag="gs small: block scales saturate at 448")
    errs += cmp(fmt, x, 1e9, tag="gs huge: codes saturate")
    # block maxima 2^0 .. 2^-40 below the tensor max: E4M3 subnormal block scales, then scales that
    # round to 0 with amax != 0 (out_scale = min(1/0, FLT_MAX))
    y = _blocky(g, 4, 512, 16, -40 if dtype != torch.float16 else -20, 0, dtype)
    y[:, 0] = 1.0
    errs += cmp(fmt, y, tag="subnormal / zero block scales")
    lo, hi = _binade_range(dtype)
    errs += cmp(fmt, _blocky(g, 4, 256, 16, lo, hi, dtype), per_row[:4] * 1e3, tag="binades + per-row gs")
    if dtype != torch.float16:  # tensor amax subnormal in float32: 2688 / amax overflows to inf
        errs += cmp(fmt, (torch.randn(2, 128, generator=g).double() * 1e-39).to(dtype), tag="gs = inf")
    # 3D input straight through the kernels (rows flattened, per-row gs of shape x.shape[:-1])
    z = torch.randn(2, 3, 64, generator=g).to(dtype).to(cmp.device)
    gz = (torch.rand(2, 3, generator=g) * 100 + 1).to(cmp.device)
    for gs in (None, gz):
        r = nvfp4.quantize(z, gs)
        q = tc.quantize_nvfp4(z, gs)
        errs += compare("3D packed", r.packed, q.packed) + compare("3D scales", r.scales, q.scales)
        errs += compare("3D gs", r.global_scale, q.global_scale)
        errs += compare(
            "3D dequant",
            nvfp4.dequantize(r.packed, r.scales, r.global_scale),
            tc.dequantize_nvfp4(r.packed, r.scales, r.global_scale),
        )
    return errs


def case_ties(cmp, g) -> list:
    """Values exactly halfway between two codes: E2M1 (NVFP4), E4M3 normal and subnormal (FP8, MXFP8)."""
    errs = []
    # NVFP4 with global_scale 1: a block with amax 6 * 2^k gets the exact block scale 2^k
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 0.125])
    rows = []
    for k in range(-6, 9):
        b = mids[torch.randperm(16, generator=g)] * 2.0**k * _sign(g, 16)
        b[b.abs().argmax()] = 6.0 * 2.0**k
        rows.append(b)
    x = torch.cat(rows).reshape(1, -1)
    for dtype in (torch.float32, torch.bfloat16):
        errs += cmp(codec.NVFP4, x.to(dtype), 1.0, tag=f"e2m1 ties {dtype}")
    # E4M3: a group with amax 448 * 2^k has scale exactly 2^k; midpoints of neighbouring E4M3 values
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = ((e4[1:] + e4[:-1]) / 2)[torch.randperm(126, generator=g)][:125]
    grp = torch.cat([mid, torch.tensor([448.0, 0.0, 2.0**-10])]) * _sign(g, 128)
    grp[0] = 448.0
    x8 = torch.stack([grp * 2.0**k for k in (-3, 0, 5)])
    errs += cmp(codec.FP8_BLOCK, x8, tag="e4m3 ties fp8_block")
    errs += cmp(codec.FP8_BLOCK, x8.to(torch.bfloat16), tag="e4m3 ties fp8_block bf16")
    # MXFP8: amax in [256, 512) * 2^k -> scale 2^k; the same midpoints, and 464 (clamped to 448)
    xm = x8.clone()
    xm[:, 1] = 464.0
    errs += cmp(codec.MXFP8, xm, tag="e4m3 ties mxfp8")
    return errs


def _near(points: torch.Tensor, ulps: int = 3) -> torch.Tensor:
    """float32 values within +-ulps ulps of each point (both signs)."""
    b = points.float().abs().view(torch.int32)
    b = (b.reshape(-1, 1) + torch.arange(-ulps, ulps + 1, dtype=torch.int32)).reshape(-1)
    v = b[b >= 0].view(torch.float32)
    return torch.cat([v, -v])


def _with_block_max(vals: torch.Tensor, block: int, top: float) -> torch.Tensor:
    """[1, n] rows of `block` values: block - 1 test values then `top` (fixes the block scale)."""
    vals = vals[vals.abs() <= top]
    n = -(-vals.numel() // (block - 1)) * (block - 1)
    vals = torch.cat([vals, vals.new_zeros(n - vals.numel())]).reshape(-1, block - 1)
    return torch.cat([vals, vals.new_full((vals.shape[0], 1), top)], dim=1).reshape(1, -1)


def case_exhaustive_rounding(cmp, g) -> list:
    """E2M1 and E4M3 rounding of every bf16 value in range and of float32 values +-3 ulps around every
    rounding midpoint: NVFP4 with global scale 1 and block max 6 quantizes x itself (scale 1); FP8
    1x128 with group max 448 too."""
    every_bf16 = torch.arange(0, 0x7F80, dtype=torch.int16).view(torch.bfloat16).float()
    every_bf16 = torch.cat([every_bf16, -every_bf16])
    e2m1_mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = _with_block_max(torch.cat([every_bf16, _near(e2m1_mid)]), 16, 6.0)
    errs = cmp(codec.NVFP4, x, 1.0, tag="e2m1 every value")
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    x8 = _with_block_max(torch.cat([every_bf16, _near(torch.cat([e4, (e4[1:] + e4[:-1]) / 2]))]), 128, 448.0)
    errs += cmp(codec.FP8_BLOCK, x8, tag="e4m3 every value")
    return errs


def case_nan(cmp, g, fmt_name: str) -> list:
    """NaN poisons its block in both paths (compared NaN-aware)."""
    fmt = codec.QUANTIZED_FORMATS[fmt_name]
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    x[0, 5] = float("nan")
    x[2, 200] = float("nan")
    errs = cmp(fmt, x, tag="nan", nan_aware=True)
    if fmt == codec.NVFP4:
        errs += cmp(fmt, x, 3.0, tag="nan, given gs", nan_aware=True)
    return errs


def case_dequant_random_bytes(cmp, g) -> list:
    """Every byte pattern the receiver can get: random data / scale bytes (NaN scales included),
    global scales and FP8 scales over many binades (subnormal, huge)."""
    from epmoe.quant import triton_codec as tc

    d = cmp.device
    errs = []
    N, H = 9, 256
    packed = torch.randint(0, 256, (N, H // 2), generator=g, dtype=torch.uint8).to(d)
    sf = torch.randint(0, 256, (N, H // 16), generator=g, dtype=torch.uint8).to(d)
    gs_rows = torch.pow(2.0, torch.randint(-100, 100, (N,), generator=g).float()) * (torch.rand(N, generator=g) + 0.5)
    gs_rows[0] = 1e-40  # subnormal global scale: 1 / gs overflows to inf
    for gs in (gs_rows.to(d), torch.tensor(448 * 6 / 3.7).to(d), 7.0):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            ref = nvfp4.dequantize(packed, sf, gs, dt)
            errs += compare(f"nvfp4 dequant {dt}", ref, tc.dequantize_nvfp4(packed, sf, gs, dt), nan_aware=True)
    data = torch.randint(0, 256, (N, H), generator=g, dtype=torch.uint8)
    s32 = torch.pow(2.0, torch.randint(-149, 128, (N, H // 128), generator=g).float())
    s32 = s32 * torch.where(torch.rand(N, H // 128, generator=g) < 0.5, 1.0, 1.7)
    s32[0, 0] = torch.finfo(torch.float32).max / 448
    e8 = torch.randint(0, 256, (N, H // 32), generator=g, dtype=torch.uint8)
    e8[0, :4] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)
    data, s32, e8 = data.to(d), s32.to(d), e8.to(d)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        ref = fp8_block.dequantize_activation(data, s32, dt)
        errs += compare(f"fp8_block dequant {dt}", ref, tc.dequantize_fp8_block(data, s32, dt), nan_aware=True)
        ref = mxfp8.dequantize(data, e8, dt)
        errs += compare(f"mxfp8 dequant {dt}", ref, tc.dequantize_mxfp8(data, e8, dt), nan_aware=True)
    return errs


def case_errors(cmp, g) -> list:
    """Same exception type and message as the reference for bad inputs; T = 0; H = 2880."""
    errs = []
    bad = [
        (codec.FP8_BLOCK, torch.randn(2, 2880, generator=g)),  # GPT-OSS hidden size: 2880 % 128 != 0
        (codec.NVFP4, torch.randn(2, 40, generator=g)),
        (codec.MXFP8, torch.randn(2, 48, generator=g)),
        (codec.NVFP4, torch.randint(0, 5, (2, 64), generator=g)),
    ]
    for fmt, x in bad:
        outcome = []
        for use in (False, True):
            try:
                codec.quantize_activation(x.to(cmp.device), fmt, use_triton=use)
                outcome.append("no error")
            except (TypeError, ValueError) as e:
                outcome.append(f"{type(e).__name__}: {e}")
        if outcome[0] != outcome[1] or outcome[0] == "no error":
            errs.append(f"{fmt.name} {list(x.shape)} {x.dtype}: reference {outcome[0]!r} vs triton {outcome[1]!r}")
    for fmt in (codec.NVFP4, codec.MXFP8, codec.FP8_BLOCK):
        errs += cmp(fmt, torch.randn(0, 256).to(torch.bfloat16), tag=f"{fmt.name} T=0")
    for fmt in (codec.NVFP4, codec.MXFP8):
        errs += cmp(fmt, torch.randn(2, 2880, generator=g).to(torch.bfloat16), tag=f"{fmt.name} H=2880")
    return errs


CASES = {}
for _f in ("nvfp4", "fp8_block", "mxfp8"):
    for _d in DTYPES:
        CASES[f"random:{_f}:{_d}"] = lambda cmp, g, f=_f, d=_d: case_random(cmp, g, f, d)
        CASES[f"adversarial:{_f}:{_d}"] = lambda cmp, g, f=_f, d=_d: case_adversarial(cmp, g, f, d)
    CASES[f"nan:{_f}"] = lambda cmp, g, f=_f: case_nan(cmp, g, f)
for _d in DTYPES:
    CASES[f"nvfp4_scales:{_d}"] = lambda cmp, g, d=_d: case_nvfp4_scales(cmp, g, d)
CASES["ties"] = case_ties
CASES["exhaustive_rounding"] = case_exhaustive_rounding
CASES["dequant_random_bytes"] = case_dequant_random_bytes
CASES["errors"] = case_errors


def run_case(name: str, seed: int, device="cpu") -> list:
    """Mismatches of case `name` ([] = bit-identical); numpy warnings of the interpreter silenced."""
    with np.errstate(all="ignore"):  # the interpreter's numpy warns on 1/0 and inf*0, which we mean
        return CASES[name](_Cmp(device), torch.Generator().manual_seed(seed))
