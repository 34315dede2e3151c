"""Compile the Triton codec kernels for sm90 on this CPU-only machine (Triton's bundled ptxas) and
check the PTX keeps the bit-exactness guarantees the interpreter cannot see: no approximate division
(`div.full` / `div.approx`), no flush-to-zero (`.ftz`), no FMA contraction (`fma`), every float
multiply / divide / add an explicit `mul.rn` / `div.rn` / `add.rn.f32`; plus no register spills and vectorised
global loads in the streaming kernels (~5 s)."""

import importlib.util
import os
import re

import pytest

from tests.cpu.helpers import load_aot_sm90

pytestmark = [pytest.mark.slow]

# kernel, pointer / int argument types, constexprs, num_warps
_I = "i32"
KERNELS = [
    ("_absmax_partial_kernel", dict(x_ptr="*i16", part_ptr="*i32", n_groups=_I, iters=_I),
     dict(IN_KIND=1, TILE=8192), 8),
    ("_nvfp4_quant_kernel", dict(x_ptr="*i16", q_ptr="*u8", sf_ptr="*u8", gs_ptr="*fp32", gs_stride=_I,
                                 gs_out_ptr="*fp32", part_ptr="*i32", n_partials=_I, n_blocks=_I, blocks_per_row=_I),
     dict(IN_KIND=1, COMPUTE_GS=True, NPART=256, BLK=256, PTX=True), 4),
    ("_nvfp4_quant_kernel", dict(x_ptr="*fp16", q_ptr="*u8", sf_ptr="*u8", gs_ptr="*fp32", gs_stride=_I,
                                 gs_out_ptr="*fp32", part_ptr="*fp32", n_partials=_I, n_blocks=_I, blocks_per_row=_I),
     dict(IN_KIND=2, COMPUTE_GS=False, NPART=256, BLK=256, PTX=True), 4),
    ("_nvfp4_dequant_kernel", dict(q_ptr="*u8", sf_ptr="*u8", gs_ptr="*fp32", gs_stride=_I, out_ptr="*bf16",
                                   n_blocks=_I, blocks_per_row=_I),
     dict(OUT_KIND=1, BLK=256, PTX=True), 4),
    ("_fp8_block_quant_kernel", dict(x_ptr="*i16", q_ptr="*u8", s_ptr="*fp32", n_groups=_I),
     dict(IN_KIND=1, GB=32, PTX=True), 8),
    ("_fp8_block_dequant_kernel", dict(q_ptr="*u8", s_ptr="*fp32", out_ptr="*bf16", n_groups=_I),
     dict(OUT_KIND=1, GB=32, PTX=True), 8),
    ("_mxfp8_quant_kernel", dict(x_ptr="*fp32", q_ptr="*u8", s_ptr="*u8", n_blocks=_I),
     dict(IN_KIND=0, BLK=128, PTX=True), 8),
    ("_mxfp8_dequant_kernel", dict(q_ptr="*u8", s_ptr="*u8", out_ptr="*fp16", n_blocks=_I),
     dict(OUT_KIND=2, BLK=128, PTX=True), 8),
]  # fmt: skip


def _setup():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiling needs triton without the interpreter")
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton has no bundled ptxas")
    aot = load_aot_sm90()
    from epmoe.quant import triton_codec

    return triton, aot, triton_codec


@pytest.mark.parametrize("i", range(len(KERNELS)), ids=[f"{k[0]}-{k[2].get('IN_KIND', k[2].get('OUT_KIND'))}" for k in KERNELS])
def test_sm90_ptx_is_exact_and_spill_free(i):
    triton, aot, tc = _setup()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, sig, consts, num_warps = KERNELS[i]
    fn = getattr(tc, name)
    sig = dict(sig)
    attrs = {(j,): [["tt.divisibility", 16]] for j, a in enumerate(fn.arg_names) if sig.get(a, "").startswith("*")}
    sig.update({k: "constexpr" for k in consts})
    assert set(sig) == set(fn.arg_names), f"{name}: signature out of date: {sorted(set(fn.arg_names) ^ set(sig))}"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    ptx = compiled.asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    bad = {op: len(re.findall(pat, body)) for op, pat in
           (("div.full/approx", r"\bdiv\.(full|approx)"), (".ftz", r"\.ftz\b"), ("fma", r"\bfma\."),
            ("mul/add/sub.f32 without .rn", r"\b(mul|add|sub)\.f32\b"), ("rcp.approx", r"\brcp\.approx"))}  # fmt: skip
    assert not any(bad.values()), f"{name}: inexact float ops in the PTX: {bad}"
    info = aot.analyze(compiled)
    assert info["local"] == 0 and info["ldl_stl"] == 0, f"{name}: register spills: {info}"
    if "quant" in name or "absmax" in name:
        assert re.search(r"ld\.global(\.\w+)*\.v[24]", body), f"{name}: input loads are not vectorised"
