"""`TritonExperts` ("triton"): grouped expert GEMMs in Triton for Hopper (and any sm80+ GPU), built
in seconds at first use. Flat layout only.

    experts = TritonExperts(spec)          # spec.plan.expert_mode: bf16 | fp8_block | nvfp4_w4a16 | mxfp4_w4a16
    experts.load_weights(weights)          # canonical ExpertWeights: quantized ones of the mode's format
                                           #   as they are, float ones quantized here at load
    out [N, H] = experts(tokens)           # DispatchedTokens, flat layout

Forward (no host sync, fixed shapes for a fixed N, so it can be captured in a CUDA graph):
  1. `align`: sort the N*K (row, slot) entries by local expert, pad each expert to BLOCK_M rows
     (torch ops).
  2. gemm1: gathered rows x[tok] @ [w1; w3][e].T (+ b13), activation fused in the epilogue -> [P, I]
     (fp8_block: fp8 out with 1x128 scales, also fused).
  3. gemm2: act @ w2[e].T (+ b2), times the routing weight, stored by entry -> y [N*K, H].
  4. reduce: out[n] = sum_k y[n*K + k] over valid k in fixed k order (deterministic, no atomics).

Modes (kernel-facing weight layouts; canonical formats in `epmoe.experts.triton.kernel_formats`):
  bf16         w13 [E, R, H], w2 [E, H, I] in the model dtype (R = 2I: rows gate j, up j interleaved
               (default, GATE_UP_LAYOUT) or gate-then-up (option triton_gate_up=blocked); I for relu2)
  fp8_block    W8A8: w13/w2 e4m3 with 128x128 fp32 block scales (gate and up each their own grid);
               activations quantized per token in 1x128 groups (on the fly, or taken from an fp8_block
               payload); the activation of gemm1 is re-quantized 1x128 in gemm1's epilogue
  nvfp4_w4a16  e2m1 weights (k64-interleaved), e4m3 scale per 16 and fp32 global scale per expert and
               projection half; bf16 activations, weights dequantized exactly to bf16 in the kernel
  mxfp4_w4a16  as nvfp4 with an e8m0 scale per 32 and no global scale
Biases are kept in float32: b13 [E, R], b2 [E, H].
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch

from epmoe.core.availability import Availability
from epmoe.core.capability import BackendOptions, BackendRequest
from epmoe.core.errors import BackendUnavailableError
from epmoe.experts.activation import kernel_activation_args
from epmoe.experts.base import Experts, ExpertsOptions, ExpertsSpec
from epmoe.experts.triton import kernel_formats as kf
from epmoe.experts.triton.align import (BlockAlignment, TailTiles, align_blocks, align_blocks_triton, max_blocks_for,
                                        single_launch_applies, sort_by_expert, split_tail_tiles, split_tail_tiles_triton)
from epmoe.experts.triton.launch import LaunchOptions, interpreter_enabled, kernel_module
from epmoe.quant.codec import FP8_BLOCK
from epmoe.quant.payload import PayloadFormat, QuantizedActivation
from epmoe.quant.weights import ExpertWeights

SUPPORTED_MODES = ("bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16")
_W_FMT = {"bf16": 0, "fp8_block": 1, "nvfp4_w4a16": 2, "mxfp4_w4a16": 3}
# What an fp8 dispatch delivers (the codec's 1x128 e4m3 + fp32 scales, linear).
FP8_BLOCK_PAYLOAD = FP8_BLOCK


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class GemmConfig:
    """Static tile shape of one grouped GEMM launch (no autotuning: no device time spent)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@dataclass(frozen=True)
class TritonConfig:
    """block_m is shared by both GEMMs (they share the padded routing). split_m: an expert's tail
    tile with <= block_m/2 real rows runs a block_m/2-row copy of the tile code (less MMA work on
    padding; block_m >= 32 in the Triton kernels, 16 in the Gluon decode kernel). wgmma (W4A16, block_m
    64 / 128): the GEMMs run the Gluon wgmma kernel (`gluon_w4a16.w4a16_wgmma_kernel`: block_n outputs
    per program, num_warps, num_stages K steps in flight) where `TritonExperts.uses_gluon_w4a16` says it
    can; elsewhere the Triton kernels with these tiles (a forced preset) or WGMMA_FALLBACK's (auto).
    wgmma_pending: that kernel keeps each K step's wgmmas in flight while it dequantizes the next step's
    weights (its PENDING). tail_rows (wgmma only): an expert's last tile with <= tail_rows real rows runs
    on the Gluon decode kernel instead, in 16-row tiles (`align.split_tail_tiles`; the wgmma kernel
    converts an expert's weights once per tile, whatever its rows), where that kernel runs the shapes."""

    name: str
    block_m: int
    gemm1: GemmConfig
    gemm2: GemmConfig
    split_m: bool = False
    wgmma: bool = False
    wgmma_pending: bool = False
    tail_rows: int = 0

    def describe(self) -> str:
        g1, g2 = self.gemm1, self.gemm2
        tails = f"/tails<={self.tail_rows}" if self.tail_rows else ""
        return (
            f"{self.name}: BM={self.block_m}{'/split' if self.split_m else ''}{'/pending' if self.wgmma_pending else ''}"
            f"{tails} "
            f"g1(BN={g1.block_n},BK={g1.block_k},w{g1.num_warps},s{g1.num_stages},G{g1.group_m}) "
            f"g2(BN={g2.block_n},BK={g2.block_k},w{g2.num_warps},s{g2.num_stages},G{g2.group_m})"
        )


def _cfg(name, bm, g1, g2, split=False, wgmma=False, pending=False, tails=0) -> TritonConfig:
    return TritonConfig(name, bm, GemmConfig(*g1), GemmConfig(*g2), split, wgmma, pending, tails)


# Presets for H200 (GemmConfig fields: block_n, block_k, num_warps, num_stages[, group_m]).
# "decode": few rows per expert -> weight streaming; small BLOCK_M, deep pipeline, many programs.
# "prefill": >= 128 rows per expert -> tensor-core bound; 128-row tiles, gate+up = 256 columns, tail
# tiles split to 64 rows. Variants stay listed so benchmarks/tune_hopper.py can re-measure them.
_DENSE_PRESETS = {
    "decode": _cfg("decode", 16, (64, 128, 4, 4), (64, 128, 4, 4)),
    "decode_wide": _cfg("decode_wide", 16, (128, 64, 4, 4), (128, 64, 4, 4)),
    "decode_deep": _cfg("decode_deep", 16, (64, 128, 4, 3), (64, 256, 4, 3)),
    "small": _cfg("small", 32, (64, 128, 4, 4), (128, 64, 4, 4)),
    "medium": _cfg("medium", 64, (128, 64, 4, 4), (128, 64, 4, 4)),
    "prefill": _cfg("prefill", 128, (128, 64, 8, 3), (256, 64, 8, 3), split=True),
    "prefill_nosplit": _cfg("prefill_nosplit", 128, (128, 64, 8, 3), (256, 64, 8, 3)),
    "prefill_s4": _cfg("prefill_s4", 128, (128, 64, 8, 4), (256, 64, 8, 4), split=True),
    "prefill_g16": _cfg("prefill_g16", 128, (128, 64, 8, 3, 16), (256, 64, 8, 3, 16), split=True),
    "prefill_n128": _cfg("prefill_n128", 128, (128, 64, 8, 3), (128, 64, 4, 4), split=True),
    "prefill_m64": _cfg("prefill_m64", 64, (128, 64, 4, 4), (256, 64, 8, 3)),
}
# fp8 W8A8: BLOCK_K == 128 (one scale per K step); gemm1 BLOCK_N == 128 (one 1x128 group per row).
# The per-K-step scale promotion keeps a second accumulator live: 128-row gate+up tiles spill with 8
# warps (sm90 compile, benchmarks/aot_sm90.py), so the large presets use 64-row tiles with 8 warps.
# Measured on H200 (T=4096, 256 rows per expert): "medium" 6.05 ms, "prefill" 6.25 ms.
_FP8_PRESETS = {
    "decode": _cfg("decode", 16, (128, 128, 4, 4), (64, 128, 4, 4)),
    "decode_deep": _cfg("decode_deep", 16, (128, 128, 4, 5), (64, 128, 4, 6)),
    "decode_n128": _cfg("decode_n128", 16, (128, 128, 4, 4), (128, 128, 4, 4)),
    "small": _cfg("small", 32, (128, 128, 8, 4), (128, 128, 4, 4)),
    "medium": _cfg("medium", 64, (128, 128, 8, 3), (128, 128, 4, 4)),
    "medium_s4": _cfg("medium_s4", 64, (128, 128, 8, 4), (128, 128, 4, 5)),
    "medium_g2w8": _cfg("medium_g2w8", 64, (128, 128, 8, 3), (256, 128, 8, 3)),
    "prefill": _cfg("prefill", 64, (128, 128, 8, 4), (256, 128, 8, 3)),
    "medium_split": _cfg("medium_split", 64, (128, 128, 8, 3), (128, 128, 4, 4), split=True),
    "medium_s4w8": _cfg("medium_s4w8", 64, (128, 128, 8, 4), (128, 128, 8, 4)),
}
# fp4 W4A16: BLOCK_K == 64 (the interleave block).
_FP4_PRESETS = {
    "decode": _cfg("decode", 16, (64, 64, 4, 4), (64, 64, 4, 4)),
    "decode_n128": _cfg("decode_n128", 16, (128, 64, 4, 4), (128, 64, 4, 4)),
    "decode_s6": _cfg("decode_s6", 16, (64, 64, 4, 6), (64, 64, 4, 6)),
    "decode_w8": _cfg("decode_w8", 16, (128, 64, 8, 4), (128, 64, 8, 4)),
    # 8-row tiles: the Gluon kernels only (tl.dot needs 16 rows)
    "decode_m8": _cfg("decode_m8", 8, (64, 64, 4, 4), (64, 64, 4, 4)),
    # 16-row tiles whose <= 8 real rows (at T = 128 x top-8 over 128 experts: most experts) run the 8-row
    # code (the Gluon decode kernel's SPLIT_M): half the token loads and mmas, the weights converted once
    "decode_split": _cfg("decode_split", 16, (64, 64, 4, 4), (64, 64, 4, 4), split=True),
    # (an L2 prefetch of the weight rows K steps ahead in the decode kernel, "decode_l2_8" / "_16", was
    # slower: 1.53 / 1.79 ms against 1.47 nvfp4; the next iteration's weight and scale words loaded
    # before this one's math, "decode_split_pf" (commit 1aaf983), no faster: 1.44-1.46 / 1.41-1.43 ms
    # against 1.41 / 1.29; H200 2026-12-02; removed: docs/hopper-experts.md)
    "small": _cfg("small", 32, (64, 64, 4, 4), (128, 64, 4, 4)),
    "medium": _cfg("medium", 64, (64, 64, 4, 4), (128, 64, 4, 4)),
    "prefill": _cfg("prefill", 128, (64, 64, 8, 3), (128, 64, 8, 3)),
    "prefill_n128": _cfg("prefill_n128", 128, (128, 64, 8, 3), (128, 64, 8, 3)),
    "prefill_split": _cfg("prefill_split", 128, (64, 64, 8, 3), (128, 64, 8, 3), split=True),
    "prefill_n256": _cfg("prefill_n256", 128, (128, 64, 8, 3), (256, 64, 8, 3), split=True),
    # the Gluon wgmma kernel: MMA tiles of 16 * num_warps * 2^i weight rows (gated: half gate, half up),
    # num_stages K steps in flight (>= 3); block_n = its outputs per program
    # (the natural-K-order variants "wgmma", "_m64", "_w4", "_w4r128", "_r256", ..., measured slower
    # than the decode kernel's K order, were removed after 2026-12-02: docs/hopper-experts.md)
    "wgmma_w4r128_kp": _cfg("wgmma_w4r128_kp", 128, (64, 64, 4, 4), (128, 64, 4, 4), wgmma=True),
    "wgmma_w4r128_kp_m64": _cfg("wgmma_w4r128_kp_m64", 64, (64, 64, 4, 4), (128, 64, 4, 4), wgmma=True),
    # (256-row tiles over two warpgroups, "wgmma_w8m256_kp" / "_s4" / "_pend": each weight value converted
    # half as often, but one CTA per SM; no faster than the 128-row tiles at T = 4096, H200 2026-12-02:
    # 4 stages 8.69 / 8.82 ms against 8.68 / 8.42, the others 9.5-9.9; removed: docs/hopper-experts.md)
    # each K step's wgmmas stay in flight while the next step's weights are dequantized (ptxas then gives
    # the two steps of an iteration different operand registers: no wait before either conversion)
    "wgmma_w4r128_kp_pend": _cfg("wgmma_w4r128_kp_pend", 128, (64, 64, 4, 4), (128, 64, 4, 4), wgmma=True,
                                 pending=True),
    # the same with each expert's last tile of <= 32 real rows on the Gluon decode kernel (16-row tiles: the
    # weights of such a tile read once per 16 rows at the decode kernel's speed instead of converted for a
    # whole 128-row wgmma tile). (<= 16 and <= 48 rows, "_t16" / "_t48", measured slower / no faster at
    # T = 4096, H200 2026-12-02: 7.26-7.47 / 7.16-7.19 ms against 7.16-7.17 nvfp4; removed)
    "wgmma_w4r128_kp_pend_t32": _cfg("wgmma_w4r128_kp_pend_t32", 128, (64, 64, 4, 4), (128, 64, 4, 4), wgmma=True,
                                     pending=True, tails=32),
    # (64-row tiles under a 168-register cap, "wgmma_w4r128_kp_m64_r168", and 64 outputs per gemm2 program,
    # "wgmma_w4r128_kp_pend_n64" (GPT-OSS's H = 2880 on this kernel), ran correct and no faster than the
    # auto presets, H200 2026-12-02: 9.40 / 8.94 and 9.62 / 8.94 ms against 8.73 / 8.21 at the DeepSeek-V3
    # shape; 3.58 against 3.57 ms (Triton kernels) at GPT-OSS's; removed: docs/hopper-experts.md)
}

# The tuned table: preset by mean rows per local expert (upper bounds, inclusive; None = any).
# Update from benchmarks/tune_hopper.py's "winners" lines.
AUTO_PRESETS: Dict[str, Tuple[Tuple[Optional[float], str], ...]] = {
    "bf16": ((16, "decode"), (40, "small"), (96, "medium"), (None, "prefill")),
    "fp8_block": ((16, "decode"), (40, "small"), (None, "medium")),
    # W4A16 at T=4096 (H200, 2026-12-02): the Gluon wgmma kernel in the decode kernel's K order with its
    # wgmmas left in flight across the next step's conversion, "wgmma_w4r128_kp_pend", 8.63-8.68 / 8.17 ms
    # against "wgmma_w4r128_kp" 8.69-8.77 / 8.37-8.40 (three runs, scale words loaded a K step ahead in
    # both), the Triton kernels "prefill_n128" 10.9 / 10.4 (2026-12-01) (nvfp4 / mxfp4); where the Gluon
    # kernel cannot run (Triton interpreter, shapes it does not tile), WGMMA_FALLBACK instead.
    # Decode T = 128 (H200, 2026-12-02, 8 same-run pairs in alternating order): the Gluon decode kernel's
    # half tiles "decode_split" median 1.45 ms against "decode" 1.48 (nvfp4), 1.34 against 1.36 (mxfp4),
    # faster in every pair; GPT-OSS shape 0.80-0.83 / 0.76-0.78 against 0.88 / 0.80-0.81 ms; where that
    # kernel cannot run, SPLIT_FALLBACK
    # Tail tiles (H200, 2026-12-02, sixth set, two runs in opposite orders): each expert's last tile of <= 32
    # real rows on the Gluon decode kernel, "wgmma_w4r128_kp_pend_t32", 7.16 / 7.17 ms against 8.07 / 8.21
    # without (nvfp4), 6.83 / 6.89 against 7.72 / 7.82 (mxfp4); _t16 7.26-7.47 / 7.08-7.17, _t48 7.16-7.19 /
    # 6.89-7.32 (uniform routing: the tails are 1-37 or 90-127 rows); skewed routing 7.78 / 7.45 against
    # 8.54 / 8.17. The same outputs bit for bit in the GPU tests (skewed routing).
    # Mid-size batches (H200, 2026-12-02, sixth set; T tokens x top-8 over 128 experts, uniform; ms nvfp4 /
    # mxfp4): 16-row half-split decode tiles up to 32 rows per expert (T = 384: 1.94 / 1.87 against "small"
    # 2.83 / 2.34; T = 512: 2.41 / 2.29 against 3.80 / 3.10), "medium" up to 56 (T = 640: 2.89 / 2.44; T =
    # 768: 2.96 / 2.51 against the wgmma tail-tile preset 3.61 / 3.35), then the wgmma preset (T = 1024:
    # 3.36 / 3.22 against "medium" 4.11 / 3.57, whose 64-row tiles split experts of > 64 rows; T = 1536: 3.34
    # / 3.25 against 5.52 / 4.79). Before, "small" ran up to 40 rows and "medium" up to 96.
    "nvfp4_w4a16": ((32, "decode_split"), (56, "medium"), (None, "wgmma_w4r128_kp_pend_t32")),
    "mxfp4_w4a16": ((32, "decode_split"), (56, "medium"), (None, "wgmma_w4r128_kp_pend_t32")),
}
WGMMA_FALLBACK = "prefill_n128"  # the auto preset for W4A16 prefill tiles the Gluon wgmma kernel cannot run
SPLIT_FALLBACK = "decode"  # ... and for 16-row half tiles (split_m) the Gluon decode kernel cannot run
SPLIT_FALLBACK_WIDE = ((16, SPLIT_FALLBACK), (None, "small"))  # ... by mean rows per expert (the Triton tiles the
# auto table had up to 16 / 40 rows before the Gluon decode kernel's tiles took up to 32, 2026-12-02)
# Layout of w13 in bf16 mode (gated activations): "interleaved" (rows gate j, up j: one wide dot per
# K step) or "blocked" ([gate; up]: two dots). Quantized modes are always blocked. Fixed at load;
# spec option `triton_gate_up` overrides.
GATE_UP_LAYOUT = "interleaved"
# Per-phase backend preference, bf16 only: from this many mean rows per local expert (N*K/E) on, the
# forward runs torch._grouped_mm (CUTLASS grouped GEMMs) with the fused gather / activation / combine
# kernels (`epmoe.experts.triton.grouped_mm.fused_grouped_mm_forward`) on this backend's own weights, instead
# of the Triton GEMMs; None = never. Spec option `triton_grouped_mm`: auto (this threshold) | on | off.
# A forced tile preset (`config_override` / `triton_config`) keeps the Triton GEMMs under auto.
GROUPED_MM_MIN_ROWS: Optional[float] = 128.0
GROUPED_MM_CHOICES = ("auto", "on", "off")
# fp4 W4A16 weights -> bf16 in the GEMM loops: "asm" (the bf16 bits of 8 values built by a few inline
# PTX instructions per 4 bytes, one bf16 multiply by the scale), "packed" (the same bits from Triton
# integer ops, two values per op; `_fp4_dequant_packed`) or "legacy" (fp16 bits, fp32 multiply;
# `_fp4_dequant`). Same weights bit for bit. Spec option `triton_fp4_convert` overrides; asm and
# packed need a bf16 model (and, for mxfp4, scale exponents <= 128, checked at load); asm runs as
# packed under the Triton interpreter (which cannot run PTX). "words": asm on weights whose 4-byte
# words are bit-permuted at load (`kernel_formats.permute_fp4_words`, `_E2M1_BF16_WORDS_ASM`: 8 sm90
# instructions per 4 bytes); the same bf16 bits, the weights' bytes differ; under
# the interpreter (or where packed is not possible) it loads plain bytes and runs as packed / legacy.
# Default "auto": words for every mode and shape (H200, 2026-12-02, same runs as asm, decode T = 128 /
# prefill T = 4096: DeepSeek-V3 shape nvfp4 1.46 vs 1.55 ms / 9.16 vs 9.29, mxfp4 1.40 vs 1.47 ms with
# GLUON_W4A16_WORDS_TILES / 8.63 vs 8.75; GPT-OSS shape nvfp4 0.84 vs 0.99 ms / 4.87 vs 5.01, mxfp4
# 0.80 vs 0.86 ms with GLUON_W4A16_MAXNREG (0.91 without it) / 3.57 vs 3.65).
FP4_CONVERT = "auto"
FP4_CONVERT_CHOICES = ("auto", "asm", "words", "packed", "legacy")
# W4A16 decode tiles (block_m 8 or 16) with the asm or words conversion: "gluon" runs `epmoe.experts.triton.gluon_w4a16`
# (weights straight from global memory into the mma operand registers, no shared memory; swap-AB),
# "triton" the Triton kernels. Spec option `triton_w4a16_decode` overrides. Under the Triton
# interpreter (no Gluon) the Triton kernels run.
W4A16_DECODE_KERNEL = "gluon"
W4A16_DECODE_CHOICES = ("gluon", "triton")
GLUON_W4A16_BLOCK_MS = (8, 16)  # routed rows per tile (the tile preset's block_m: the mma's N)
TAIL_SUB_M = 16  # rows per tile of the small tiles a wgmma preset's tail_rows hands to the Gluon decode kernel
GLUON_W4A16_BLOCK_N = 64  # weight rows per program (16 per warp at GLUON_W4A16_WARPS, 32 with two row groups)
GLUON_W4A16_WARPS = 4  # warps per program (each owns 16 weight rows per row group)
GLUON_W4A16_UNROLL = 2  # K steps per loop iteration (loads of all issued first); lowered to divide K / 64
# Register cap passed to ptxas (None: its own choice). 128: with the words conversion ptxas then issues
# the loop's global loads before its first MMA (with its own choice, 96 / 66 registers for mxfp4, it
# puts some after: the second K step's loads no longer overlap the first step's wait). H200,
# 2026-12-02, decode T = 128, same runs: GPT-OSS shape mxfp4 words 0.80 ms (0.91 without the cap; asm
# 0.86); DeepSeek-V3 shape mxfp4 1.33-1.35 / 1.40-1.41 in the last two pairs (1.29-1.42 over five),
# nvfp4 unchanged (1.40-1.47 either way, four pairs).
GLUON_W4A16_MAXNREG: Optional[int] = 128
# With the words conversion, per mode: (unroll, block_n, warps) instead of the three above, where block_n
# divides both projections. mxfp4 (H200, 2026-12-02, decode T = 128, DeepSeek-V3 shape, two runs):
# 1.40 / 1.41 ms against 1.60 with the defaults, whose second K step's loads ptxas schedules after the
# first step's MMAs; nvfp4 keeps the defaults (1.46 / 1.47 ms; 1.48 / 1.49 with these).
GLUON_W4A16_WORDS_TILES: Dict[str, Tuple[int, int, int]] = {"mxfp4_w4a16": (4, 128, 8)}
# The Gluon wgmma kernel's weight scales: through its cp.async ring with the weights (its SCALE_RING: each
# row's scale pair of a K step copied with the step's weights, read from shared memory where it is used) or,
# False, loaded from global memory one K step ahead into registers. H200 2026-12-03, T = 4096, same run,
# alternating: 7.128 -> 6.872 ms nvfp4, 6.942 -> 6.580 mxfp4 (the bf16 auto prefill: 6.951), the same
# output bit for bit (docs/results/h200-2026-12-03c/README.md, "W4A16 scales through the wgmma kernel's ring")
WGMMA_SCALE_RING = True
# gemm1's tokens in the wgmma kernel's K order: rows per program of `permute_k_kernel` (256 K values each)
PERMUTE_K_ROWS = 8
_PERMUTE_K_OPTIONS = LaunchOptions(BLOCK_R=PERMUTE_K_ROWS, BLOCK_Q=128, num_warps=4)
GLUON_WGMMA_BLOCK_MS = (64, 128)  # routed rows per tile of the Gluon wgmma kernel (presets with wgmma=True)
# fp4 W4A16 GEMM loops read each K step's weight scales one step ahead (a register prefetch; the
# scale loads are too small for Triton's async copies). False: read them where they are used.
FP4_SCALE_PREFETCH = True
# Routing alignment (sort by expert, pad to BLOCK_M, tile list): "triton" (three small kernels,
# `epmoe.experts.triton.align.align_blocks_triton`) or "torch" (`align_blocks(sort_by_expert(...))`, ~15
# launches); the same outputs bit for bit. Spec option `triton_align` overrides (both backends).
ALIGN = "triton"
ALIGN_CHOICES = ("triton", "torch")
# fp4 W4A16 weight bytes: "tiles" (for every expert, group of 8 rows and K step of 64, the 8 x 32 bytes
# contiguous: `kernel_formats.tile_fp4_rows`) or "rows" (each weight row's K bytes contiguous); every
# kernel of this backend reads either (their TILED). Tiles: one warp load of the Gluon decode kernel
# covers two whole 128-byte lines instead of one sector of each of eight (with rows its L2 was bound by
# tag requests, 1.15 sectors per request: docs/hopper-experts.md). H200, 2026-12-02, T = 128: decode
# 1.18 / 1.07 ms against 1.41 / 1.29 with rows (nvfp4 / mxfp4; L2 read requests of gemm1 72 M -> 30 M),
# GPT-OSS shape 0.64 / 0.60 against 0.81 / 0.76; prefill T = 4096 8.47 / 8.03 against 8.62 / 8.17.
# Spec option `triton_fp4_layout`.
FP4_LAYOUT = "tiles"
FP4_LAYOUT_CHOICES = ("rows", "tiles")


def presets_for(mode: str) -> Dict[str, TritonConfig]:
    if mode == "fp8_block":
        return _FP8_PRESETS
    if mode in ("nvfp4_w4a16", "mxfp4_w4a16"):
        return _FP4_PRESETS
    return _DENSE_PRESETS


def _by_rows(table: Tuple[Tuple[Optional[float], str], ...], num_entries: int, num_experts: int) -> str:
    """The preset name of a (rows-per-expert upper bound, name) table (AUTO_PRESETS' form) for the mean
    rows per local expert (a host int: no sync)."""
    rows = num_entries / max(num_experts, 1)
    for bound, name in table:
        if bound is None or rows <= bound:
            return name
    return table[-1][1]


def pick_config(mode: str, num_entries: int, num_experts: int) -> TritonConfig:
    """Preset by the mean rows per local expert (a host int: no sync), from AUTO_PRESETS."""
    return presets_for(mode)[_by_rows(AUTO_PRESETS.get(mode, AUTO_PRESETS["bf16"]), num_entries, num_experts)]


# --------------------------------------------------------------------------- kernels (lazy)

_GLUON = None


def _gluon_available() -> bool:
    """Does this Triton have Gluon with the pieces `gluon_w4a16` uses (Triton >= 3.5)? Never under the
    Triton interpreter (it cannot run Gluon; nothing is cached then)."""
    global _GLUON
    if interpreter_enabled():
        return False
    if _GLUON is None:
        try:
            from epmoe.experts.triton import gluon_w4a16  # noqa: F401

            _GLUON = True
        except Exception:  # noqa: BLE001 - any import failure means: use the Triton kernels
            _GLUON = False
    return _GLUON


# --------------------------------------------------------------------------- backend


def _words_tiles(mode: str, hidden_size: int, intermediate_size: int) -> Optional[Tuple[int, int, int]]:
    """GLUON_W4A16_WORDS_TILES' entry for `mode` where its rows divide both projections, else None."""
    tiles = GLUON_W4A16_WORDS_TILES.get(mode)
    if tiles is None or intermediate_size % tiles[1] or hidden_size % tiles[1]:
        return None
    return tiles


def resolve_fp4_convert(convert: str) -> str:
    """The fp4 conversion a backend runs for `convert` (FP4_CONVERT_CHOICES): "auto" is "words" (every
    mode and shape), the others as given."""
    return "words" if convert == "auto" else convert


def _owned(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """A contiguous copy this backend owns (never an alias of the caller's tensor: reloads copy
    into it in place)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=device).copy_(t)


def _mx_scales_packable(params: Dict[str, torch.Tensor]) -> bool:
    """Every mxfp4 e8m0 scale exponent <= 128 (the packed conversion's range; one host sync, at load)."""
    return all(int(params[k].max()) <= 128 for k in ("w13_scale", "w2_scale") if params[k].numel())


@dataclass(frozen=True)
class TritonOptions(ExpertsOptions):
    """triton_config: a preset name from `presets_for(mode)` (None: picked per call by rows per
    expert); triton_gate_up: "interleaved" or "blocked" w13 rows (bf16, gated activations)."""

    triton_config: Optional[str] = None
    triton_gate_up: str = GATE_UP_LAYOUT
    # None = the module default (GROUPED_MM_MIN_ROWS / "auto", ALIGN, FP4_CONVERT): read at construction
    triton_grouped_mm: Optional[str] = None  # auto | on | off: bf16 through torch._grouped_mm
    triton_align: Optional[str] = None  # triton | torch: routing alignment kernels
    triton_fp4_convert: Optional[str] = None  # auto | asm | words | packed | legacy: fp4 -> bf16 in the W4A16 loops
    triton_w4a16_decode: Optional[str] = None  # gluon | triton: kernels of W4A16 decode tiles
    triton_fp4_layout: Optional[str] = None  # rows | tiles: fp4 weight bytes as rows or in row tiles


class TritonExperts(Experts):
    """Our Triton kernels: bf16, fp8_block (consumes FP8 1x128 tokens), nvfp4_w4a16, mxfp4_w4a16 on
    sm90 / sm100 / sm120, flat layout."""

    name = "triton"
    accepted_layouts = ("flat",)
    Options = TritonOptions

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        if not base:
            return base
        if request.arch not in ("sm90", "sm100", "sm120"):
            return Availability.no(
                f"the triton kernels run on sm90/sm100/sm120 GPUs, not {request.arch}",
                "use experts 'reference' (CPU) or another backend",
            )
        if request.expert_mode not in SUPPORTED_MODES:
            return Availability.no(f"it runs {list(SUPPORTED_MODES)}, not {request.expert_mode!r}")
        if request.model_dtype not in ("bfloat16", "float16"):
            return Availability.no(f"it needs a bf16/fp16 model, not {request.model_dtype}")
        if request.expert_mode in ("nvfp4_w4a16", "mxfp4_w4a16") and (request.hidden_size % 64 or request.intermediate_size % 64):
            return Availability.no(f"{request.expert_mode} needs hidden and intermediate sizes divisible by 64")
        if not request.has("triton"):
            return Availability.no("triton is not installed", "pip install triton")
        return Availability.yes()

    @classmethod
    def consumes(cls, request: BackendRequest) -> str:
        return "fp8" if request.expert_mode == "fp8_block" else "bf16"

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        mode = spec.expert_mode
        if mode not in SUPPORTED_MODES:
            return Availability.no(
                f"expert mode {mode!r} is not implemented by the triton backend",
                f"use one of {SUPPORTED_MODES}",
            )
        cfg = spec.config
        if cfg.dtype not in (torch.bfloat16, torch.float16):
            return Availability.no(
                f"model dtype {cfg.dtype} is not supported by the triton backend", "use bfloat16 or float16"
            )
        if mode in ("nvfp4_w4a16", "mxfp4_w4a16") and (cfg.hidden_size % 64 or cfg.intermediate_size % 64):
            return Availability.no(
                f"{mode} needs hidden_size and intermediate_size divisible by 64, got "
                f"H={cfg.hidden_size}, I={cfg.intermediate_size}",
                "use bf16 or fp8_block for this shape",
            )
        if importlib.util.find_spec("triton") is None:
            return Availability.no("triton is not installed", "pip install triton")
        device = torch.device(spec.device)
        if device.type == "cpu":
            if interpreter_enabled():
                return Availability.yes("Triton interpreter on CPU (TRITON_INTERPRET=1, slow)")
            return Availability.no(
                "the triton backend needs a CUDA device",
                "run on a GPU (or set TRITON_INTERPRET=1 for the slow CPU interpreter)",
            )
        if device.type != "cuda" or not torch.cuda.is_available():
            return Availability.no(f"device {device} is not a usable CUDA device", "run on an NVIDIA GPU")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return Availability.no(f"sm{major}{minor} is too old for these kernels", "use an sm80+ GPU")
        if mode == "fp8_block" and (major, minor) < (8, 9):
            return Availability.no(f"fp8 needs sm89+, this GPU is sm{major}{minor}", "use bf16 or a W4A16 mode")
        return Availability.yes(f"sm{major}{minor}")

    def __init__(self, spec: ExpertsSpec):
        super().__init__(spec)
        avail = self.availability(spec)
        if not avail:
            raise BackendUnavailableError(self.name, avail.reason, avail.hint)
        self.mode = spec.expert_mode
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        cfg = self.config
        self.num_experts = spec.num_local_experts
        self.hidden_size = cfg.hidden_size
        self.intermediate_size = cfg.intermediate_size
        self.gated = cfg.is_gated
        self.act_args = kernel_activation_args(cfg)
        self._params: Dict[str, torch.Tensor] = {}
        self._gmm_params: Dict[str, torch.Tensor] = {}  # _params and the transposed views grouped_mm reads
        self._wops: Optional[tuple] = None  # _weight_operands
        self._tile_plans: Dict[tuple, tuple] = {}  # _tile_plan
        self._reduce_options: Dict[int, "LaunchOptions"] = {}  # moe_reduce_kernel's keywords by top_k
        # Set by benchmarks to force a tile preset (TritonConfig); None = pick by rows per expert.
        self.config_override: Optional[TritonConfig] = None
        name = spec.option("triton_config")
        if name is not None:
            presets = presets_for(self.mode)
            if name not in presets:
                raise ValueError(f"triton_config={name!r}; use one of {sorted(presets)}")
            self.config_override = presets[name]
        layout = spec.option("triton_gate_up", GATE_UP_LAYOUT)
        if layout not in ("interleaved", "blocked"):
            raise ValueError(f"triton_gate_up={layout!r}; use 'interleaved' or 'blocked'")
        # Kernel-facing w13 rows alternate gate j / up j (bf16 mode, gated activations only).
        self.gate_up_interleaved = layout == "interleaved" and self.mode == "bf16" and self.gated
        self.align_impl = spec.option("triton_align") or ALIGN
        if self.align_impl not in ALIGN_CHOICES:
            raise ValueError(f"triton_align={self.align_impl!r}; use one of {ALIGN_CHOICES}")
        conv = spec.option("triton_fp4_convert") or FP4_CONVERT
        if conv not in FP4_CONVERT_CHOICES:
            raise ValueError(f"triton_fp4_convert={conv!r}; use one of {FP4_CONVERT_CHOICES}")
        self.fp4_convert = resolve_fp4_convert(conv)
        self.w4a16_decode = spec.option("triton_w4a16_decode") or W4A16_DECODE_KERNEL
        if self.w4a16_decode not in W4A16_DECODE_CHOICES:
            raise ValueError(f"triton_w4a16_decode={self.w4a16_decode!r}; use one of {W4A16_DECODE_CHOICES}")
        layout = spec.option("triton_fp4_layout") or FP4_LAYOUT
        if layout not in FP4_LAYOUT_CHOICES:
            raise ValueError(f"triton_fp4_layout={layout!r}; use one of {FP4_LAYOUT_CHOICES}")
        # row tiles: fp4 modes only (other modes have no fp4 weights: the option changes nothing there)
        self.fp4_tiles = layout == "tiles" and self.mode in ("nvfp4_w4a16", "mxfp4_w4a16")
        self._fp4_scales_ok = True  # mxfp4: every scale exponent <= 128 (set at load)
        self._fp4_words = False  # fp4 weights stored bit-permuted per word (convert mode "words"; set at load)
        self.grouped_mm = spec.option("triton_grouped_mm") or "auto"
        if self.grouped_mm not in GROUPED_MM_CHOICES:
            raise ValueError(f"triton_grouped_mm={self.grouped_mm!r}; use one of {GROUPED_MM_CHOICES}")
        why_not = self._grouped_mm_unavailable()
        self._grouped_mm_ok = why_not is None
        if self.grouped_mm == "on" and why_not:
            raise ValueError(f"triton_grouped_mm=on: {why_not}; use triton_grouped_mm=auto or off")

    def _grouped_mm_unavailable(self) -> Optional[str]:
        """Why the bf16 torch._grouped_mm path cannot run here (None: it can)."""
        cfg = self.config
        if self.mode != "bf16":
            return f"mode {self.mode!r} (the grouped_mm path is bf16 only)"
        if cfg.dtype != torch.bfloat16 or cfg.hidden_size % 8 or cfg.intermediate_size % 8:
            return f"needs bfloat16 and H, I divisible by 8 (dtype {cfg.dtype}, H {cfg.hidden_size}, I {cfg.intermediate_size})"
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        if self.device.type == "cpu":
            return None if interpreter_enabled() else "no CUDA device"
        cap = torch.cuda.get_device_capability(self.device)
        if cap not in ((9, 0), (10, 0)):
            return f"torch._grouped_mm has its CUTLASS path on sm90 / sm100 only, this GPU is sm{cap[0]}{cap[1]}"
        return None

    def _packed_with(self, scales_ok: bool) -> bool:
        """`fp4_packed` for weights whose mxfp4 scale exponents are all <= 128 (scales_ok) or not."""
        return (
            self.mode in ("nvfp4_w4a16", "mxfp4_w4a16")
            and self.fp4_convert in ("asm", "words", "packed")
            and self.config.dtype == torch.bfloat16
            and scales_ok
        )

    @property
    def fp4_packed(self) -> bool:
        """Do the fp4 GEMM loops build bf16 bits (`_fp4_dequant_packed`, Triton ops or inline PTX)?"""
        return self._packed_with(self._fp4_scales_ok)

    def _kernel_convert_with(self, scales_ok: bool) -> int:
        """`_fp4_kernel_convert` for weights with or without scales_ok (see `_packed_with`)."""
        if not self._packed_with(scales_ok):
            return 0
        if interpreter_enabled():
            return 1
        return {"asm": 2, "words": 3}.get(self.fp4_convert, 1)

    @property
    def _fp4_kernel_convert(self) -> int:
        """FP4_PACKED for the kernels: 0 legacy, 1 packed (Triton ops), 2 packed bits from inline PTX,
        3 the same from bit-permuted words (not under the interpreter, which cannot run PTX: there
        asm and words are 1, the same bits, on plain bytes). 3 is also the weights' layout: bit-permuted
        words (`kernel_formats.permute_fp4_words`)."""
        return self._kernel_convert_with(self._fp4_scales_ok)

    def uses_grouped_mm(self, num_entries: int) -> bool:
        """Does a forward of `num_entries` routed (row, slot) entries run the grouped_mm path?"""
        if not self._grouped_mm_ok or self.grouped_mm == "off":
            return False
        if self.grouped_mm == "on":
            return True
        if self.config_override is not None or GROUPED_MM_MIN_ROWS is None:
            return False
        return num_entries / max(self.num_experts, 1) >= GROUPED_MM_MIN_ROWS

    # ------------------------------------------------------------------ format
    @property
    def payload_format(self) -> PayloadFormat:
        plan = self.spec.plan
        if self.mode == "fp8_block" and plan is not None and getattr(plan, "dispatch_dtype", None) == "fp8":
            return FP8_BLOCK_PAYLOAD
        return PayloadFormat.unquantized(self.config.dtype)

    def parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: ExpertWeights) -> None:
        """Local experts' canonical weights -> kernel layout. A reload copies in place."""
        self.commit_weights(self.prepare_weights(weights))

    def prepare_weights(self, weights: ExpertWeights) -> Dict[str, torch.Tensor]:
        """Validate and convert (new tensors; nothing live is touched).

        bf16 mode: float weights (a quantized checkpoint is dequantized). Quantized modes: quantized
        weights of the mode's format are converted as they are; float weights are quantized here, a
        few experts at a time to bound temporary memory."""
        self.check_local_weights(weights)
        cfg, dev = self.config, self.device
        fmt = kf.FORMAT_OF_MODE.get(self.mode)
        if self.mode == "bf16":
            if weights.is_quantized:
                weights = kf.dequantize_expert_weights(weights)
            w1 = weights.w1.to(dev)
            if weights.w3 is None:
                w13 = w1
            elif self.gate_up_interleaved:
                w13 = kf.interleave_gate_up(w1, weights.w3.to(dev))
            else:
                w13 = torch.cat([w1, weights.w3.to(dev)], dim=1)
            new = {"w13": _owned(w13, dev, cfg.dtype), "w2": _owned(weights.w2, dev, cfg.dtype)}
        elif weights.is_quantized:
            if weights.format != fmt:
                raise ValueError(
                    f"expert weights are {weights.format}, but mode {self.mode!r} reads {fmt}; resolve the "
                    f"quant plan for this checkpoint (or pass float weights to quantize at load)"
                )
            new = kf.kernel_tensors(weights, self.gated, dev)
        else:
            E, first = self.num_experts, weights.first_expert
            chunk = max(1, (1 << 27) // (cfg.w13_rows * self.hidden_size))  # ~0.5 GB of f32 scratch
            parts = []
            for lo in range(0, E, chunk):
                sub = weights.slice_experts(first + lo, first + min(E, lo + chunk)).to(dev)
                sub = replace(sub, b13=None, b2=None)
                parts.append(kf.kernel_tensors(kf.quantize_expert_weights(sub, self.mode), self.gated, dev))
            new = {k: torch.cat([p[k] for p in parts], dim=0).contiguous() for k in parts[0]}
        if cfg.has_bias:
            new["b13"] = _owned(weights.b13, dev, torch.float32)
            new["b2"] = _owned(weights.b2, dev, torch.float32)
        scales_ok = self.mode != "mxfp4_w4a16" or _mx_scales_packable(new)
        if self.mode == "mxfp4_w4a16" and self._params and self.fp4_packed and not scales_ok:
            # captured CUDA graphs keep the packed conversion: refuse rather than compute garbage
            raise ValueError(
                "reloaded mxfp4 weights have scale exponents > 128 (weights above 2 * 6), which the packed "
                "fp4 conversion this backend was loaded with cannot represent; construct it with "
                "triton_fp4_convert=legacy"
            )
        if self.mode == "nvfp4_w4a16":  # scales >= +0, zero-scale weights +0, then the scales as codes (uint8):
            # every kernel's scale conversion reads the codes (`kernel_formats.encode_nvfp4_scales`)
            for name in ("w13", "w2"):
                kf.normalize_nvfp4_scales(new[name], new[name + "_scale"], name, weights.first_expert)
                new[name + "_scale"] = kf.encode_nvfp4_scales(new[name + "_scale"])
        words = self._kernel_convert_with(scales_ok) == 3  # the layout these bytes get (plain or words)
        if self._params and words != self._fp4_words:
            # captured CUDA graphs read the loaded layout: refuse rather than compute garbage
            raise ValueError(
                f"reloaded {self.mode} weights need the {'bit-permuted' if words else 'plain'} fp4 layout (mxfp4 "
                f"scale exponents {'<=' if words else '>'} 128), but this backend was loaded with the other one; "
                f"construct it with triton_fp4_convert=asm"
            )
        if words:  # new's fp4 tensors are this call's own contiguous copies: permuted in place
            new["w13"] = kf.permute_fp4_words(new["w13"], inplace=True)
            new["w2"] = kf.permute_fp4_words(new["w2"], inplace=True)
        if self.fp4_tiles:  # every kernel of this backend reads the tiles (their TILED); in place, as above
            new["w13"] = kf.tile_fp4_rows(new["w13"], inplace=True)
            new["w2"] = kf.tile_fp4_rows(new["w2"], inplace=True)
        if fmt in ("nvfp4", "mxfp4"):  # every kernel reads the scales in K-step pairs, a pair of all rows contiguous
            group = 16 if fmt == "nvfp4" else 32
            for name in ("w13_scale", "w2_scale"):
                new[name] = kf.pair_fp4_scales(new[name].view(torch.uint8), group)
        expected = self._expected_shapes()
        for name, shape in expected.items():
            if tuple(new[name].shape) != shape:
                raise ValueError(
                    f"converted expert tensor {name!r} has shape {list(new[name].shape)}, expected "
                    f"{list(shape)} for mode {self.mode!r}"
                )
        return new

    def commit_weights(self, prepared: Dict[str, torch.Tensor]) -> None:
        if self.mode == "mxfp4_w4a16":
            # the packed conversion folds 2^126 into a bf16 scale 2^(e-1): exact for e <= 128
            # (weights up to 6 * 2); larger exponents take the legacy conversion (a reload re-checks)
            self._fp4_scales_ok = _mx_scales_packable(prepared)
        self._fp4_words = self._fp4_kernel_convert == 3  # the layout prepare_weights gave these bytes
        if not self._params:
            # 16-byte aligned storage (a prepared tensor may be a view): the Gluon W4A16 kernels read
            # a row's scales of two K steps as one 8-byte word
            self._params = {k: (t.clone() if t.data_ptr() % 16 else t) for k, t in prepared.items()}
            return
        for name, t in prepared.items():
            old = self._params[name]
            if old.shape != t.shape or old.dtype != t.dtype:
                raise ValueError(
                    f"reloaded {name!r} is {list(t.shape)} {t.dtype}; the loaded one is {list(old.shape)} {old.dtype}"
                )
        for name, t in prepared.items():
            self._params[name].copy_(t)  # in place: captured CUDA graphs keep pointing at valid weights

    def check_moved_slots(self, rows: Dict[int, Dict[str, torch.Tensor]]) -> None:
        """mxfp4 weights moved onto a rank that runs the packed fp4 conversion must have scale exponents
        <= 128 too (as a reload checks)."""
        if self.mode == "mxfp4_w4a16" and self.fp4_packed and rows:
            if not all(_mx_scales_packable(r) for r in rows.values()):
                raise ValueError(
                    "moved mxfp4 experts have scale exponents > 128, which the packed fp4 conversion this rank "
                    "runs cannot represent; construct the layer with experts_options triton_fp4_convert=legacy")

    def stored_layout(self) -> str:
        """fp4 weights are stored bit-permuted (`words`) or plain per rank, decided at load."""
        return f"fp4_words={self._fp4_words}"

    def _expected_shapes(self) -> Dict[str, tuple]:
        E, H, I, R = self.num_experts, self.hidden_size, self.intermediate_size, self.config.w13_rows
        halves = 2 if self.gated else 1
        if self.mode == "bf16":
            return {"w13": (E, R, H), "w2": (E, H, I)}
        if self.mode == "fp8_block":
            return {
                "w13": (E, R, H),
                "w13_scale": (E, halves * kf._cdiv(I, 128), kf._cdiv(H, 128)),
                "w2": (E, H, I),
                "w2_scale": (E, kf._cdiv(H, 128), kf._cdiv(I, 128)),
            }
        group = 16 if self.mode == "nvfp4_w4a16" else 32
        pair = 2 * kf.FP4_SCALE_STEP // group  # scale pairs (`kernel_formats.pair_fp4_scales`)
        shapes = {
            "w13": (E, R, H // 2),
            "w13_scale": (E, R, kf._cdiv(H, 2 * kf.FP4_SCALE_STEP), pair),
            "w2": (E, H, I // 2),
            "w2_scale": (E, H, kf._cdiv(I, 2 * kf.FP4_SCALE_STEP), pair),
        }
        if self.mode == "nvfp4_w4a16":
            shapes["w13_global_scale"] = (E, halves)
            shapes["w2_global_scale"] = (E, 1)
        return shapes

    # ------------------------------------------------------------------ forward
    def fused_alignment(self, num_entries: int) -> Optional[int]:
        """The tile preset's block_m where the forward would run the one-program alignment (decode tiles
        of the Triton GEMMs, triton alignment): the routing launch may compute it instead."""
        if (self.align_impl != "triton" or not self._params or not single_launch_applies(num_entries, self.num_experts)
                or self.uses_grouped_mm(num_entries)):  # fmt: skip
            return None
        return self.tile_config(num_entries).block_m

    def forward(self, tokens, alignment: Optional[BlockAlignment] = None) -> torch.Tensor:
        """alignment: `align_blocks` of tokens.topk_ids (the caller's guarantee) for the block_m that
        `fused_alignment` gave; used when it fits this forward's tiles, else computed here."""
        if getattr(tokens, "layout", "flat") != "flat":
            raise ValueError(f"experts backend 'triton' takes the flat layout, got {tokens.layout!r}")
        if not self._params:
            raise RuntimeError("TritonExperts.forward before load_weights; load the local experts first")
        hidden, topk_ids, topk_weights = tokens.hidden, tokens.topk_ids, tokens.topk_weights
        H, E = self.hidden_size, self.num_experts
        N = hidden.shape[0]
        if tuple(hidden.shape) != (N, H):
            raise ValueError(f"hidden has shape {list(hidden.shape)}; expected [num_tokens, {H}]")
        if topk_ids is None or topk_ids.dim() != 2 or topk_ids.shape[0] != N:
            raise ValueError(
                f"topk_ids has shape {None if topk_ids is None else list(topk_ids.shape)}; "
                f"expected [{N}, top_k]"
            )
        K = topk_ids.shape[1]
        if topk_weights is None or tuple(topk_weights.shape) != (N, K):
            raise ValueError(
                f"topk_weights has shape {None if topk_weights is None else list(topk_weights.shape)}; "
                f"expected [{N}, {K}]"
            )
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected torch.int32")
        out_dtype = self.config.dtype
        if N == 0:
            return torch.empty(0, H, dtype=out_dtype, device=self.device)

        x, x_scale = self._input_activations(hidden)
        if self.uses_grouped_mm(N * K):
            from epmoe.experts.triton.grouped_mm import fused_grouped_mm_forward

            return fused_grouped_mm_forward(
                x, topk_ids, topk_weights, self._grouped_mm_params(), self.config, E, self.gate_up_interleaved, self._launch,
                align=self.align_impl, act_args=self.act_args,
            )
        cfg = self.tile_config(N * K)
        plan = self._tile_plan(cfg, K)  # checked, launch keywords built: once per preset
        # no-op conversions skipped (each call costs host time); the kernels index ids and weights
        # flat by entry j = n * K + k, so [N, K] contiguous tensors serve as they are
        ids32 = (topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)).contiguous()
        if alignment is None or alignment.block_m != cfg.block_m or alignment.max_blocks != max_blocks_for(
                N * K, E, cfg.block_m):  # fmt: skip
            alignment = self._align(ids32, cfg)
        tails = self._tail_tiles(alignment, cfg) if plan[4] else None
        act, act_scale = self._gemm1(x, x_scale, alignment, N * K, K, cfg, plan, tails)
        # what gemm1 does not read is prepared after its launch (the GPU idles until then)
        w_flat = (topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()).contiguous()
        y = torch.empty(N * K, H, dtype=out_dtype, device=self.device)
        self._gemm2(act, act_scale, alignment, N * K, w_flat, y, cfg, plan, tails)
        return self._reduce(y, ids32)

    def _tile_plan(self, cfg: TritonConfig, top_k: int) -> tuple:
        """(cfg, runs the Gluon W4A16 kernels, gemm1 launch keywords, gemm2 launch keywords, hands its small
        tiles to the decode kernel (`runs_tails`)) of the Triton GEMMs for tile preset `cfg`: checked (`_check_tile_config`) and built once, then kept, keyed by the
        preset and what else the plan reads that may change (the fp4 conversion: a reload can switch
        it; the W4A16 decode kernel choice; FP4_SCALE_PREFETCH and the Gluon decode tiles, module settings)."""
        conv = self._fp4_kernel_convert
        key = (id(cfg), top_k, conv, FP4_SCALE_PREFETCH, self.w4a16_decode, self._gluon_decode_tiles(conv))
        plan = self._tile_plans.get(key)
        if plan is not None and plan[0] is cfg:
            return plan
        self._check_tile_config(cfg)
        ACT, HAS_LIMIT = self.act_args[:2]
        g1, g2 = cfg.gemm1, cfg.gemm2
        fp8 = self.mode == "fp8_block"
        kw1 = LaunchOptions(
            TOP_K=top_k, W_FMT=_W_FMT[self.mode], GATED=self.gated, ACT=ACT, HAS_LIMIT=HAS_LIMIT,
            HAS_BIAS=self.config.has_bias, OUT_FP8=fp8,
            GATE_UP_IL=self.gate_up_interleaved, SPLIT_M=cfg.split_m,
            BLOCK_M=cfg.block_m, BLOCK_N=g1.block_n, BLOCK_K=g1.block_k, GROUP_M=g1.group_m,
            EVEN_K=self.hidden_size % g1.block_k == 0, FP4_PACKED=conv, FP4_PREFETCH=FP4_SCALE_PREFETCH,
            TILED=self.fp4_tiles, num_warps=g1.num_warps, num_stages=g1.num_stages,
        )  # fmt: skip
        kw2 = LaunchOptions(
            W_FMT=_W_FMT[self.mode], HAS_BIAS=self.config.has_bias, SPLIT_M=cfg.split_m,
            BLOCK_M=cfg.block_m, BLOCK_N=g2.block_n, BLOCK_K=g2.block_k, GROUP_M=g2.group_m,
            EVEN_K=self.intermediate_size % g2.block_k == 0, FP4_PACKED=conv, FP4_PREFETCH=FP4_SCALE_PREFETCH,
            TILED=self.fp4_tiles, num_warps=g2.num_warps, num_stages=g2.num_stages,
        )  # fmt: skip
        if len(self._tile_plans) >= 64:
            self._tile_plans.clear()
        plan = self._tile_plans[key] = (cfg, self.uses_gluon_w4a16(cfg), kw1, kw2, self.runs_tails(cfg))
        return plan

    def _weight_operands(self, gemm1: bool) -> tuple:
        """(w, ws, wg, b, w.stride(0), w.stride(1), ws.stride(0), ws.stride(1) or 0, ws.stride(2) (fp4 scale
        pairs: `kernel_formats.pair_fp4_scales`) or 0, wg.stride(0), b.stride(0))
        of gemm1 (w13) or gemm2 (w2) as the Triton GEMMs take them (ws / wg / b: w where absent), made once
        per set of weight tensors (a reload copies in place: they stay valid)."""
        p = self._params
        c = self._wops
        if c is None or c[0] is not p["w13"] or c[1] is not p["w2"]:
            def one(name, bias):
                w = p[name]
                ws, wg, b = p.get(name + "_scale", w), p.get(name + "_global_scale", w), p.get(bias, w)
                return (w, ws, wg, b, w.stride(0), w.stride(1), ws.stride(0), ws.stride(1) if ws.dim() > 1 else 0,
                        ws.stride(2) if ws.dim() == 4 else 0, wg.stride(0), b.stride(0))
            c = self._wops = (p["w13"], p["w2"], one("w13", "b13"), one("w2", "b2"))
        return c[2] if gemm1 else c[3]

    def _grouped_mm_params(self) -> Dict[str, torch.Tensor]:
        """The weights as the grouped_mm path reads them: `_params` and w13 / w2 transposed ([E, K, N]
        views, made once per set of weight tensors: a reload copies in place, so they stay valid)."""
        p = self._gmm_params
        if p.get("w13") is not self._params["w13"] or p.get("w2") is not self._params["w2"]:
            w13, w2 = self._params["w13"], self._params["w2"]
            p = self._gmm_params = dict(self._params, w13_t=w13.transpose(1, 2), w2_t=w2.transpose(1, 2))
        return p

    # The stages of `forward` (benchmarks/tune_hopper.py times them one by one).
    def _align(self, ids32: torch.Tensor, cfg: TritonConfig):
        if self.align_impl == "triton":
            return align_blocks_triton(ids32, self.num_experts, cfg.block_m, self._launch)
        return align_blocks(sort_by_expert(ids32, self.num_experts), cfg.block_m)

    def _tail_tiles(self, blocks: BlockAlignment, cfg: TritonConfig) -> Optional[TailTiles]:
        """The small tiles of a preset that `runs_tails`, split off for the Gluon decode kernel (None for an
        empty alignment)."""
        if blocks.max_blocks == 0:
            return None
        if self.align_impl == "triton":
            return split_tail_tiles_triton(blocks, self.num_experts, cfg.tail_rows, TAIL_SUB_M, self._launch)
        return split_tail_tiles(blocks, self.num_experts, cfg.tail_rows, TAIL_SUB_M)

    def runs_tails(self, cfg: TritonConfig) -> bool:
        """Does a forward with tile preset cfg hand its small tiles to the Gluon decode kernel? (A wgmma
        preset with tail_rows, both Gluon kernels running the shapes.)"""
        if not cfg.tail_rows or not cfg.wgmma or not self.uses_gluon_w4a16(cfg):
            return False
        rows = self._gluon_decode_tiles(self._fp4_kernel_convert)[1]
        return (self.w4a16_decode == "gluon" and self.intermediate_size % rows == 0
                and self.hidden_size % rows == 0)  # fmt: skip

    def _reduce(self, y: torch.Tensor, ids32: torch.Tensor) -> torch.Tensor:
        """y [N*K, H] by entry -> out [N, H]: sum over the valid slots in k order."""
        N, K = ids32.shape
        H = self.hidden_size
        out = torch.empty(N, H, dtype=y.dtype, device=self.device)
        BLOCK_H = 1024
        kw = self._reduce_options.get(K)
        if kw is None:
            kw = self._reduce_options[K] = LaunchOptions(TOP_K=K, BLOCK_H=BLOCK_H, num_warps=4)
        self._launch(
            "moe_reduce_kernel",
            (N, triton_cdiv(H, BLOCK_H)),
            (y, ids32, out, H, self.num_experts, y.stride(0), out.stride(0)),
            kw,
        )
        return out

    def tile_config(self, num_entries: int) -> TritonConfig:
        """The tile preset of a forward over num_entries routed rows: config_override, else the auto
        table's (a wgmma preset the Gluon kernel cannot run here gives way to WGMMA_FALLBACK, 16-row half
        tiles the Gluon decode kernel cannot run to SPLIT_FALLBACK_WIDE's Triton tiles: the Triton
        kernels' half tiles need >= 32 rows)."""
        if self.config_override is not None:
            return self.config_override
        cfg = pick_config(self.mode, num_entries, self.num_experts)
        if cfg.wgmma and not self.uses_gluon_w4a16(cfg):
            cfg = presets_for(self.mode)[WGMMA_FALLBACK]
        elif self._half_tiles_unrunnable(cfg):
            cfg = presets_for(self.mode)[_by_rows(SPLIT_FALLBACK_WIDE, num_entries, self.num_experts)]
        return cfg

    def _half_tiles_unrunnable(self, cfg: TritonConfig) -> bool:
        """Half tiles (split_m) of < 16 rows, which only the Gluon decode kernel runs, where it cannot
        (the auto table falls back, a forced preset is refused)."""
        return cfg.split_m and cfg.block_m < 32 and not self.uses_gluon_w4a16(cfg)

    def uses_gluon_w4a16(self, cfg: TritonConfig) -> bool:
        """Do this tile preset's GEMMs run the Gluon W4A16 kernels (`epmoe.experts.triton.gluon_w4a16`)?"""
        conv = self._fp4_kernel_convert
        if conv not in (2, 3) or not _gluon_available():  # W4A16, bf16, asm / words, no interpreter
            return False
        I, H = self.intermediate_size, self.hidden_size
        if cfg.wgmma:
            n1, n2 = self._wgmma_block_n(True, cfg), self._wgmma_block_n(False, cfg)
            # nvfp4 scale rows 16-byte aligned (the kernel reads 4-byte words; only such shapes ran)
            scales_align = self.mode != "nvfp4_w4a16" or ((H // 16) % 16 == 0 and (I // 16) % 16 == 0)
            return (cfg.block_m in GLUON_WGMMA_BLOCK_MS and not cfg.split_m and scales_align
                    and I % n1 == 0 and H % n2 == 0 and H % 64 == 0 and I % 64 == 0)
        rows = self._gluon_decode_tiles(conv)[1]
        return (
            self.w4a16_decode == "gluon"
            and cfg.block_m in GLUON_W4A16_BLOCK_MS
            and (not cfg.split_m or cfg.block_m == 16)
            and I % rows == 0
            and H % rows == 0
        )

    def _gluon_decode_tiles(self, conv: int) -> Tuple[int, int, int]:
        """(K steps per iteration, weight rows per program, warps) of the Gluon W4A16 decode kernel for
        the kernels' fp4 conversion `conv` (`_fp4_kernel_convert`): GLUON_W4A16_WORDS_TILES' for this
        mode with the words conversion (3) where its rows divide both projections, else
        GLUON_W4A16_UNROLL / _BLOCK_N / _WARPS."""
        t = _words_tiles(self.mode, self.hidden_size, self.intermediate_size) if conv == 3 else None
        return t if t is not None else (GLUON_W4A16_UNROLL, GLUON_W4A16_BLOCK_N, GLUON_W4A16_WARPS)

    def _wgmma_block_n(self, gemm1: bool, cfg: TritonConfig) -> int:
        """Outputs per program of the Gluon wgmma kernel: the preset's block_n gated (its MMA tile: as many
        gate then up rows), else twice that (gemm1 of ungated activations: the same MMA tile rows)."""
        n = cfg.gemm1.block_n if gemm1 else cfg.gemm2.block_n
        return 2 * n if gemm1 and not self.gated else n

    def _gluon_w4a16(self, gemm1: bool, x, out, blocks, num_entries, top_k, w_flat, cfg: TritonConfig,
                     tails: Optional[TailTiles] = None) -> None:
        """One Gluon W4A16 GEMM (swap-AB): gemm1 x [N, H] -> act [P, I]; gemm2 act -> y [N*K, H]. tails (wgmma
        presets): the small tiles run on the decode kernel (16-row tiles, the rows in tails' table; x in
        its natural K order, act of those rows written and read in it), the wgmma kernel the others."""
        p = self._params
        H, I = self.hidden_size, self.intermediate_size
        w, ws = (p["w13"], p["w13_scale"]) if gemm1 else (p["w2"], p["w2_scale"])
        wg = p.get("w13_global_scale" if gemm1 else "w2_global_scale", w)
        b = p.get("b13" if gemm1 else "b2", w)
        n_out, k = (I, H) if gemm1 else (H, I)
        ACT, HAS_LIMIT, alpha, beta, limit = self.act_args
        conv = self._fp4_kernel_convert
        x_natural = x
        if cfg.wgmma and gemm1:  # the tokens' K in the wgmma kernel's order (gemm1 writes act in it for gemm2)
            x = self._permute_k(x)
        # the two kernels' arguments start with these
        block_expert = blocks.block_expert if tails is None else tails.block_expert
        head = (x, w, ws, wg, b, out, w_flat if w_flat is not None else out, blocks.sorted_ids, block_expert)
        consts = dict(GEMM1=gemm1, TOP_K=top_k, W_FMT=_W_FMT[self.mode], GATED=self.gated and gemm1, ACT=ACT,
                      HAS_LIMIT=HAS_LIMIT, HAS_BIAS=self.config.has_bias, BLOCK_M=blocks.block_m,
                      WORDS=conv == 3, TILED=self.fp4_tiles)
        if cfg.wgmma:  # prefill tiles (uses_gluon_w4a16 checked block_m and the shapes)
            g = cfg.gemm1 if gemm1 else cfg.gemm2
            BN = self._wgmma_block_n(gemm1, cfg)
            tail = (
                num_entries, blocks.max_blocks, n_out, k,
                x.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), ws.stride(2), wg.stride(0),
                b.stride(0), out.stride(0), alpha, beta, limit,
            )  # fmt: skip
            self._launch("w4a16_wgmma_kernel", (blocks.max_blocks * (n_out // BN),), head + tail,
                         dict(consts, BLOCK_N=BN, STAGES=g.num_stages, PENDING=cfg.wgmma_pending,
                              SCALE_RING=WGMMA_SCALE_RING, num_warps=g.num_warps))
            if tails is None:
                return
            # the small tiles: 16-row half-split tiles of the decode kernel at the rows of tails' table
            head = (x_natural,) + head[1:8] + (tails.tail_expert,)
            tiles, table, n_tiles, split = (tails.tail_rows, tails.tail_row0, tails.num_tail_tiles, True)
            consts = dict(consts, BLOCK_M=tails.sub_m, ROW_TABLE=True)
        else:
            tiles, table, n_tiles, split = blocks.block_rows, blocks.block_rows, blocks.max_blocks, cfg.split_m
            consts = dict(consts, ROW_TABLE=False)
        unroll, BN, warps = self._gluon_decode_tiles(conv)
        while (k // 64) % unroll:
            unroll //= 2
        extra = {} if GLUON_W4A16_MAXNREG is None else {"maxnreg": GLUON_W4A16_MAXNREG}
        # the decode kernel takes the shape as constexprs (by keyword: launches are keyed on them by value)
        swap_tail = (num_entries, n_tiles, head[0].stride(0), w.stride(0), ws.stride(0), wg.stride(0), b.stride(0),
                     out.stride(0), alpha, beta, limit)  # fmt: skip
        self._launch("w4a16_swap_kernel", (n_tiles * (n_out // BN),), head + (tiles, table) + swap_tail,
                     dict(consts, BLOCK_N=BN, UNROLL=unroll, SPLIT_M=split, N_OUT=n_out, K=k,
                          stride_wn=w.stride(1), stride_wsn=ws.stride(1), stride_wsp=ws.stride(2), num_warps=warps, **extra))

    def _permute_k(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, K] in the wgmma kernel's K order (`gluon_w4a16.permute_k`), one launch of `permute_k_kernel`."""
        N, K = x.shape
        out = torch.empty(N, K, dtype=x.dtype, device=x.device)
        if N:
            if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:  # value pairs need 4-byte rows
                x = x.contiguous()
            x32 = x.view(torch.int32)
            self._launch("permute_k_kernel", (triton_cdiv(N, PERMUTE_K_ROWS), triton_cdiv(K // 2, 128)),
                         (x32, out.view(torch.int32), N, K // 2, x32.stride(0), K // 2), _PERMUTE_K_OPTIONS)
        return out

    def _launch(self, kernel_name: str, grid: tuple, args: tuple, kwargs: dict) -> None:
        """Every kernel launch goes through here (tools replace it to record the launches);
        `epmoe.experts.triton.launch.KernelLauncher` (kernels by `kernel_function`) keeps its host cost small."""
        from epmoe.experts.triton.launch import launch

        launch(self, kernel_name, grid, args, kwargs)

    def _input_activations(self, hidden):
        """-> (x [N, H], x_scale [N, H/128] or None) in the form gemm1 reads."""
        if isinstance(hidden, QuantizedActivation):
            f = hidden.format
            if self.mode != "fp8_block" or f.name != "fp8_block" or f.block_size != 128:
                raise TypeError(
                    f"experts backend 'triton' in mode {self.mode!r} cannot take a {f.describe()} payload; "
                    f"it consumes {self.payload_format.describe()}"
                )
            return hidden.data.contiguous(), hidden.scales.to(torch.float32).contiguous()
        if hidden.dtype != self.config.dtype:
            raise TypeError(f"hidden has dtype {hidden.dtype}; expected the model dtype {self.config.dtype}")
        x = hidden.contiguous()
        if self.mode != "fp8_block":
            return x, None
        N, H = x.shape
        q = torch.empty(N, H, dtype=torch.float8_e4m3fn, device=self.device)
        s = torch.empty(N, triton_cdiv(H, 128), dtype=torch.float32, device=self.device)
        self._launch(
            "quant_fp8_rows_kernel",
            (N, triton_cdiv(H, 128)),
            (x, q, s, H, x.stride(0), q.stride(0), s.stride(0)),
            dict(GROUP=128, num_warps=1),
        )
        return q, s

    def _gemm1(self, x, x_scale, blocks, num_entries, top_k, cfg: TritonConfig, plan: Optional[tuple] = None,
               tails: Optional[TailTiles] = None):
        if plan is None:
            plan = self._tile_plan(cfg, top_k)
        I = self.intermediate_size
        P = blocks.num_padded_rows
        fp8 = self.mode == "fp8_block"
        out = torch.empty(P, I, dtype=torch.float8_e4m3fn if fp8 else self.config.dtype, device=self.device)
        if plan[1]:
            self._gluon_w4a16(True, x, out, blocks, num_entries, top_k, None, cfg, tails)
            return out, None
        out_s = torch.empty(P, triton_cdiv(I, 128), dtype=torch.float32, device=self.device) if fp8 else out
        w, ws, wg, b, sw0, sw1, sws0, sws1, sws2, swg0, sb0 = self._weight_operands(True)
        xs = x_scale if x_scale is not None else x
        _, _, alpha, beta, limit = self.act_args
        grid = (blocks.max_blocks * triton_cdiv(I, cfg.gemm1.block_n),)
        self._launch("moe_gemm1_kernel", grid, (
            x, xs, w, ws, wg, b, out, out_s,
            blocks.sorted_ids, blocks.block_expert, blocks.block_rows,
            num_entries, blocks.max_blocks, self.hidden_size, I,
            x.stride(0), xs.stride(0), sw0, sw1, sws0, sws1, sws2, swg0, sb0, out.stride(0), out_s.stride(0),
            alpha, beta, limit,
        ), plan[2])  # fmt: skip
        return out, (out_s if fp8 else None)

    def _gemm2(self, act, act_scale, blocks, num_entries, w_flat, y, cfg: TritonConfig, plan: Optional[tuple] = None,
               tails: Optional[TailTiles] = None):
        if plan is None:
            plan = self._tile_plan(cfg, 1)
        if plan[1]:
            self._gluon_w4a16(False, act, y, blocks, num_entries, 1, w_flat, cfg, tails)
            return
        w, ws, wg, b, sw0, sw1, sws0, sws1, sws2, swg0, sb0 = self._weight_operands(False)
        a_s = act_scale if act_scale is not None else act
        grid = (blocks.max_blocks * triton_cdiv(self.hidden_size, cfg.gemm2.block_n),)
        self._launch("moe_gemm2_kernel", grid, (
            act, a_s, w, ws, wg, b, y, w_flat,
            blocks.sorted_ids, blocks.block_expert, blocks.block_rows,
            num_entries, blocks.max_blocks, self.hidden_size, self.intermediate_size,
            act.stride(0), a_s.stride(0), sw0, sw1, sws0, sws1, sws2, swg0, sb0, y.stride(0),
        ), plan[3])  # fmt: skip

    def _check_tile_config(self, cfg: TritonConfig) -> None:
        if cfg.block_m < 16 and not self.uses_gluon_w4a16(cfg):
            raise ValueError(f"block_m {cfg.block_m} runs on the Gluon W4A16 kernels only (decode, asm conversion), "
                             f"not in mode {self.mode!r} here: {cfg.describe()}")
        if self._half_tiles_unrunnable(cfg):
            raise ValueError(f"tile preset {cfg.name!r} (split_m, block_m {cfg.block_m}) runs on the Gluon W4A16 decode "
                             f"kernel only (the Triton kernels' half tiles need >= 16 rows), not here (mode {self.mode!r}); "
                             "use preset 'decode'")
        for g, gate_up in ((cfg.gemm1, True), (cfg.gemm2, False)):
            if self.mode == "fp8_block":
                if g.block_k != 128 or (gate_up and g.block_n != 128) or (not gate_up and 128 % g.block_n and g.block_n % 128):
                    raise ValueError(f"fp8_block needs BLOCK_K=128 (and gemm1 BLOCK_N=128), got {g}")
            elif self.mode in ("nvfp4_w4a16", "mxfp4_w4a16") and g.block_k != 64:
                raise ValueError(f"{self.mode} needs BLOCK_K=64 (the fp4 interleave block), got {g}")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "TritonExperts",
    "TritonConfig",
    "GemmConfig",
    "pick_config",
    "presets_for",
    "kernel_module",
    "SUPPORTED_MODES",
    "FP8_BLOCK_PAYLOAD",
]
