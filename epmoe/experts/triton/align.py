"""Routing permutation for grouped expert GEMMs, in plain torch: fixed shapes, no host sync, no
atomics, so it is deterministic and can be captured in a CUDA graph for a fixed number of rows.

    sort = sort_by_expert(topk_ids [N, K] int, num_experts)         # (token, k) entries by expert
    blocks = align_blocks(sort, block_m)                           # each expert's rows padded to block_m

Entry j = n * K + k is (row n, slot k). Invalid entries (id < 0 or id >= num_experts: "not on this
rank") sort last and never reach a block. `contiguous_layout_rows` leaves its used row count on the
device: a caller that wants it on the host reads it back itself (eager DeepGEMM calls).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from epmoe.experts.triton.launch import LaunchOptions


@dataclass(frozen=True)
class ExpertSort:
    """num_entries: N * K (host int).
    order:          [N*K] int64, entry index j of each sorted position (by expert, then j)
    sorted_expert:  [N*K] int32, expert of each sorted position (num_experts for invalid entries)
    expert_ends:    [E] int64, cumulative row counts: expert e owns sorted positions
                    [expert_ends[e-1], expert_ends[e]) (positions past expert_ends[-1] are invalid)
    expert_counts:  [E] int64
    inverse:        [N*K] sorted position of each entry (inverse[order[p]] = p), when computed
    """

    num_entries: int
    num_experts: int
    order: torch.Tensor
    sorted_expert: torch.Tensor
    expert_ends: torch.Tensor
    expert_counts: torch.Tensor
    inverse: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class BlockAlignment:
    """Padded, block-tiled routing for a grouped GEMM with BLOCK_M = block_m rows per tile.

    max_blocks:    host int, upper bound of tiles (grid size); unused tiles have block_expert -1
    sorted_ids:    [max_blocks * block_m] int32, entry index j of each padded row, or num_entries
                   for a padding row
    block_expert:  [max_blocks] int32, local expert of each tile, -1 = unused tile
    block_rows:    [max_blocks] int32, real (non-padding) rows of each tile, in 1..block_m for a used
                   tile (only an expert's last tile has fewer than block_m), 0 for an unused one
    used_rows:     [1] int32 on the device, rows of the used tiles (the used tiles come first), where
                   the alignment computed it (the three-launch path); None otherwise
    """

    block_m: int
    max_blocks: int
    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    used_rows: Optional[torch.Tensor] = None

    @property
    def num_padded_rows(self) -> int:
        return self.max_blocks * self.block_m


def max_blocks_for(num_entries: int, num_experts: int, block_m: int) -> int:
    """Most tiles any routing of `num_entries` entries over `num_experts` experts can need:
    sum_e ceil(c_e / b) <= floor(sum c_e / b) + #nonempty experts, and each tile holds >= 1 row."""
    if num_entries <= 0:
        return 0
    return min(num_entries // block_m + min(num_experts, num_entries), num_entries)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertSort:
    """Stable sort of the (row, slot) entries of `topk_ids` [N, K] by local expert id."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids has shape {list(topk_ids.shape)}; expected [num_tokens, top_k]")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    flat = topk_ids.reshape(-1)
    nk = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts)).to(torch.int32)
    sorted_expert, order = torch.sort(key, stable=True)
    probe = torch.arange(num_experts, device=flat.device, dtype=torch.int32)
    # Cumulative counts by binary search on the sorted keys: no atomics, no host sync.
    ends = torch.searchsorted(sorted_expert, probe, right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return ExpertSort(nk, num_experts, order, sorted_expert, ends, counts)


def align_blocks(sort: ExpertSort, block_m: int) -> BlockAlignment:
    """Pad each expert's rows to a multiple of `block_m` and list the tiles (fixed sizes)."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    E, nk = sort.num_experts, sort.num_entries
    dev = sort.order.device
    max_blocks = max_blocks_for(nk, E, block_m)
    if max_blocks == 0:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        return BlockAlignment(block_m, 0, empty, empty, empty)
    counts = sort.expert_counts
    starts = sort.expert_ends - counts
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = torch.cumsum(padded, 0)
    pad_starts = pad_ends - padded
    block_first_row = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_m
    # Tile b belongs to the first expert whose padded segment ends after its first row.
    block_expert = torch.searchsorted(pad_ends, block_first_row, right=True)
    used = block_expert < E
    be = block_expert.clamp(max=E - 1)
    row_expert = be[:, None].expand(max_blocks, block_m).reshape(-1)
    row = torch.arange(max_blocks * block_m, device=dev, dtype=torch.int64)
    rank = row - pad_starts[row_expert]
    real = used[:, None].expand(max_blocks, block_m).reshape(-1) & (rank < counts[row_expert])
    src = (starts[row_expert] + rank).clamp(0, max(nk - 1, 0))
    sorted_ids = torch.where(real, sort.order[src], torch.full_like(src, nk)).to(torch.int32)
    block_expert = torch.where(used, block_expert, torch.full_like(block_expert, -1)).to(torch.int32)
    first_rank = block_first_row - pad_starts[be]
    block_rows = torch.where(used, (counts[be] - first_rank).clamp(0, block_m), 0).to(torch.int32)
    return BlockAlignment(block_m, max_blocks, sorted_ids, block_expert, block_rows)


# --------------------------------------------------------------------------- on the GPU (Triton)
# The same outputs from Triton kernels (`epmoe.experts.triton.triton_kernels`) instead of ~15 torch launches:
# the block alignment from three (align_count, align_plan, align_scatter), or one program
# (align_small_kernel) for few entries; the sort alone from one launch (align_sort_kernel).
# `launch(kernel_name, grid, args, kwargs)` runs one kernel (the backends' launcher). Index tensors
# come out int32.

def _chunk(nk: int) -> int:
    """Entries per scan step: 1024 (decode) up to 4096 (fewer serial steps at prefill)."""
    return max(1024, min(4096, _next_pow2(max(nk, 1))))


@functools.lru_cache(maxsize=None)
def _scan_options(chunk: int) -> LaunchOptions:
    return LaunchOptions(CHUNK=chunk, num_warps=chunk // 256)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=1024)
def _carve_sizes(sizes: tuple):
    """(split sizes, index of each size's view): a gap of 1-3 int32 after each size that is not a multiple
    of 4 and is not the last, so every view starts 16-byte aligned (tuples: cached per sizes)."""
    parts, keep = [], []
    for i, n in enumerate(sizes):
        keep.append(len(parts))
        parts.append(n)
        if n % 4 and i + 1 < len(sizes):
            parts.append(4 - n % 4)
    return tuple(parts), tuple(keep)


def _carve(dev, *sizes: int):
    """Views of the given sizes of ONE int32 allocation (one allocator call instead of several), each
    starting 16-byte aligned (Triton specializes kernels on a pointer's 16-byte alignment)."""
    parts, keep = _carve_sizes(sizes)
    views = torch.split_with_sizes(torch.empty(sum(parts), dtype=torch.int32, device=dev), parts)
    return views if len(keep) == len(parts) else [views[i] for i in keep]


# tiles per program of align_plan_kernel (a multiple of its 16 per step): T = 4096 x top-8 over 128 experts at
# 128-row tiles has 384 tiles, which one program planned in 42 us on an H200 (it also writes every padding row)
PLAN_BLOCKS_PER_PROGRAM = 32


def _count_and_plan(flat, num_experts, block_m, max_blocks, launch, sorted_ids_rows: int):
    """align_count + align_plan (max_blocks >= 1): also a [sorted_ids_rows] sorted_ids whose padding rows
    the plan fills with nk (the scatter writes the others). One allocation, split in views."""
    E, nk, dev = num_experts, flat.numel(), flat.device
    counts, starts, ends, block_expert, block_rows, sorted_ids = _carve(
        dev, E + 1, E + 1, E, max_blocks, max_blocks, sorted_ids_rows)
    launch("align_count_kernel", (E + 1,), (flat, counts, nk, E), _scan_options(_chunk(nk)))
    launch("align_plan_kernel", (-(-max_blocks // PLAN_BLOCKS_PER_PROGRAM),),
           (counts, starts, ends, block_expert, block_rows, sorted_ids, E, max_blocks, nk),
           dict(BLOCK_M=block_m, E_PAD=_next_pow2(E + 1), NB=16, WITH_PAD=True, BM_PAD=_next_pow2(block_m),
                BLOCKS_PER_PROGRAM=PLAN_BLOCKS_PER_PROGRAM, num_warps=4))  # fmt: skip
    return counts, starts, ends, block_expert, block_rows, sorted_ids


def _flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """int32, contiguous (the kernels index it flat as entry j = n * K + k: no view needed)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids has shape {list(topk_ids.shape)}; expected [num_tokens, top_k]")
    if topk_ids.dtype != torch.int32:
        topk_ids = topk_ids.to(torch.int32)
    return topk_ids.contiguous()


def sort_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, launch) -> ExpertSort:
    """`sort_by_expert` on the GPU in one launch (`align_sort_kernel`): order / sorted_expert /
    expert_ends / expert_counts int32, and the inverse permutation (same pass)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    flat = _flat_ids(topk_ids)
    nk, E = flat.numel(), num_experts
    counts, ends, order, sorted_expert, inverse = _carve(flat.device, E, E, nk, nk, nk)
    launch("align_sort_kernel", (E + 1,), (flat, counts, ends, order, sorted_expert, inverse, nk, E),
           _scan_options(_chunk(nk)))
    return ExpertSort(nk, E, order, sorted_expert, ends, counts, inverse)


# entries up to which `align_blocks_triton` runs one program (count + plan + scatter in one launch:
# decode) instead of three kernels over many programs; 0: always three kernels
SINGLE_LAUNCH_MAX_ENTRIES = 1024
SINGLE_LAUNCH_MAX_EXPERTS = 1024


def single_launch_applies(num_entries: int, num_experts: int) -> bool:
    """Does the one-program alignment (`align_small_kernel`, or the same code after the routing in
    `route_align_kernel`) take `num_entries` entries over `num_experts` experts?"""
    return 0 < num_entries <= SINGLE_LAUNCH_MAX_ENTRIES and num_experts <= SINGLE_LAUNCH_MAX_EXPERTS


@functools.lru_cache(maxsize=1024)
def single_launch_layout(num_entries: int, num_experts: int, block_m: int, extra: tuple):
    """(max_blocks, split sizes, which split views to keep, constexprs (do not modify)) of
    single_launch_alignment: host ints computed once per shape; the constexprs are align_small_kernel's
    launch keywords."""
    max_blocks = max_blocks_for(num_entries, num_experts, block_m)
    e_pad, n_pad = _next_pow2(num_experts + 1), max(16, _next_pow2(num_entries))
    parts, keep = _carve_sizes((max_blocks * block_m, 3 * e_pad, *extra, max_blocks, max_blocks))
    consts = LaunchOptions(BLOCK_M=block_m, E_PAD=e_pad, N_PAD=n_pad, LOG_N=n_pad.bit_length() - 1,
                           RB=max(1, min(1 << (block_m.bit_length() - 1), 4096 // e_pad)), TB=1024,
                           num_warps=8 if n_pad >= 1024 else 4)
    return max_blocks, parts, keep, consts


def single_launch_alignment(num_entries: int, num_experts: int, block_m: int, device, extra=()):
    """Outputs and constants of the one-program alignment of `num_entries` entries (at least one; see
    `single_launch_applies`): (BlockAlignment whose tensors the launch fills, scratch [3 * E_PAD] int32,
    the kernel's constexpr keywords (do not modify), int32 views of the `extra` sizes from the same
    allocation)."""
    max_blocks, parts, keep, consts = single_launch_layout(num_entries, num_experts, block_m, tuple(extra))
    views = torch.split_with_sizes(torch.empty(sum(parts), dtype=torch.int32, device=device), parts)
    sorted_ids, scratch, *more = [views[i] for i in keep]
    block_rows = more.pop()
    block_expert = more.pop()
    return BlockAlignment(block_m, max_blocks, sorted_ids, block_expert, block_rows), scratch, consts, more


def align_blocks_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, launch,
                        row_expert: Optional[torch.Tensor] = None, inverse: Optional[torch.Tensor] = None
                        ) -> BlockAlignment:
    """`align_blocks(sort_by_expert(topk_ids, num_experts), block_m)` on the GPU, bit for bit: one
    launch (`align_small_kernel`) for up to SINGLE_LAUNCH_MAX_ENTRIES entries, else three. Above that,
    the scatter also writes, when given, the local expert of each placed row into `row_expert` [P]
    (its other rows untouched) and each valid entry's row into `inverse` [N*K]."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    flat = _flat_ids(topk_ids)
    nk, E, dev = flat.numel(), num_experts, flat.device
    max_blocks = max_blocks_for(nk, E, block_m)
    if max_blocks == 0:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        return BlockAlignment(block_m, 0, empty, empty, empty)
    if single_launch_applies(nk, E):
        blocks, scratch, consts, _ = single_launch_alignment(nk, E, block_m, dev)
        launch("align_small_kernel", (1,), (flat, blocks.sorted_ids, blocks.block_expert, blocks.block_rows, scratch,
                                            nk, E, max_blocks), consts)  # fmt: skip
        return blocks
    P = max_blocks * block_m
    _, starts, _, block_expert, block_rows, sorted_ids = _count_and_plan(flat, E, block_m, max_blocks, launch, P)
    launch("align_scatter_kernel", (E,), (flat, starts, sorted_ids, sorted_ids if row_expert is None else row_expert,
                                          sorted_ids if inverse is None else inverse, nk, E),
           dict(CHUNK=_chunk(nk), WITH_INVALID=False, WITH_EXPERT=row_expert is not None,
                WITH_INV=inverse is not None, num_warps=_chunk(nk) // 256))  # fmt: skip
    return BlockAlignment(block_m, max_blocks, sorted_ids, block_expert, block_rows, used_rows=starts[E:])


def contiguous_layout_rows(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                           launch) -> Tuple[int, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """DeepGEMM's contiguous layout of the entries j = n * K + k (the rows of `align_blocks_triton`) ->
    (P, row_expert, inverse, used_rows): P padded rows (a host int), row_expert [P] int32 the local
    expert of each row (-1: a padding row or an unused tile; DeepGEMM's `m_indices`), inverse [N*K]
    int32 the row of each valid entry (entries of invalid ids are left unset: readers mask them by their
    id). Up to SINGLE_LAUNCH_MAX_ENTRIES entries P is exact and used_rows None. Above, the scatter that
    places the rows writes row_expert and inverse (plus one fill), P is an upper bound (unused tiles at
    the end) and used_rows [1] int32 on the device holds the rows of the used tiles (0 when no entry is
    valid): a caller reads it without waiting for the GPU (no sync here)."""
    flat = _flat_ids(topk_ids)
    nk, dev = flat.numel(), flat.device
    if nk and not single_launch_applies(nk, num_experts):
        P = max_blocks_for(nk, num_experts, block_m) * block_m
        row_expert = torch.full((P,), -1, dtype=torch.int32, device=dev)
        inverse = torch.empty(nk, dtype=torch.int32, device=dev)
        blocks = align_blocks_triton(flat, num_experts, block_m, launch, row_expert=row_expert, inverse=inverse)
        return P, row_expert, inverse, blocks.used_rows
    blocks = align_blocks_triton(flat, num_experts, block_m, launch)
    P = blocks.num_padded_rows
    row_expert = torch.where(blocks.sorted_ids < nk, blocks.block_expert.repeat_interleave(block_m),
                             torch.full((), -1, dtype=torch.int32, device=dev)).to(torch.int32)
    inverse = torch.zeros(nk + 1, dtype=torch.int32, device=dev)  # slot nk collects the padding rows
    inverse.scatter_(0, blocks.sorted_ids.long(), torch.arange(P, dtype=torch.int32, device=dev))
    return P, row_expert, inverse[:nk], None


# --------------------------------------------------------------------------- tail tiles
# Prefill tiles of many rows (the Gluon W4A16 wgmma kernel's 128) convert each expert's weights once per
# tile, however few of its rows are real: an expert's last tile with a few rows costs as much as a full
# one. `split_tail_tiles` hands such tiles (<= tail_rows real rows) to a kernel of small tiles (sub_m rows:
# the Gluon decode kernel) through a compact table (at most one such tile per expert: its last), and takes
# them out of the big tiles' list.

@dataclass(frozen=True)
class TailTiles:
    """The small tiles of a BlockAlignment, for a second kernel of sub_m-row tiles.

    block_expert:  [max_blocks] int32, the alignment's tiles with the small ones marked unused (-1)
    tail_expert:   [E * (tail_rows // sub_m)] int32, expert of sub-tile e * nsub + i of expert e's small
                   tile, -1 where it has no such tile or no real row from i * sub_m on
    tail_row0:     [same] int32, first padded row of each sub-tile (rows of the alignment's sorted_ids)
    tail_rows:     [same] int32, real rows of each sub-tile (1..sub_m, 0 unused)
    """

    sub_m: int
    block_expert: torch.Tensor
    tail_expert: torch.Tensor
    tail_row0: torch.Tensor
    tail_rows: torch.Tensor

    @property
    def num_tail_tiles(self) -> int:
        return self.tail_expert.numel()


def _check_tail_args(blocks: BlockAlignment, num_experts: int, tail_rows: int, sub_m: int) -> None:
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if sub_m <= 0 or tail_rows <= 0 or tail_rows % sub_m:
        raise ValueError(f"tail_rows ({tail_rows}) must be a positive multiple of sub_m ({sub_m})")
    if tail_rows >= blocks.block_m:
        raise ValueError(f"tail_rows ({tail_rows}) must be below the alignment's block_m ({blocks.block_m}): "
                         "only an expert's last tile may be split off")


def split_tail_tiles(blocks: BlockAlignment, num_experts: int, tail_rows: int, sub_m: int) -> TailTiles:
    """The tiles of `blocks` with 1..tail_rows real rows (each expert's last tile at most), as sub_m-row
    sub-tiles in a compact table, and `blocks.block_expert` without them (torch ops, no host sync)."""
    _check_tail_args(blocks, num_experts, tail_rows, sub_m)
    E, dev, nsub = num_experts, blocks.block_expert.device, tail_rows // sub_m
    be, rows = blocks.block_expert.long(), blocks.block_rows.long()
    small = (be >= 0) & (rows <= tail_rows)
    big = torch.where(small, torch.full_like(be, -1), be).to(torch.int32)
    slot = torch.where(small, be, torch.full_like(be, E))  # E: a slot for the other tiles, dropped
    tb = torch.full((E + 1,), -1, dtype=torch.int64, device=dev)
    tb.scatter_(0, slot, torch.arange(be.numel(), device=dev, dtype=torch.int64))
    tr = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_(0, slot, rows)
    tb, tr = tb[:E, None], tr[:E, None]
    i = torch.arange(nsub, device=dev, dtype=torch.int64)[None, :]
    n = tr - i * sub_m
    ok = (tb >= 0) & (n > 0)
    experts = torch.arange(E, device=dev, dtype=torch.int64)[:, None]
    tail_expert = torch.where(ok, experts, -1).reshape(-1).to(torch.int32)
    tail_row0 = torch.where(ok, tb * blocks.block_m + i * sub_m, 0).reshape(-1).to(torch.int32)
    tail_n = torch.where(ok, n.clamp(max=sub_m), 0).reshape(-1).to(torch.int32)
    return TailTiles(sub_m, big, tail_expert, tail_row0, tail_n)


def split_tail_tiles_triton(blocks: BlockAlignment, num_experts: int, tail_rows: int, sub_m: int,
                            launch) -> TailTiles:
    """`split_tail_tiles` in one launch (`tail_tiles_kernel`, one program), bit for bit."""
    _check_tail_args(blocks, num_experts, tail_rows, sub_m)
    E, nsub = num_experts, tail_rows // sub_m
    big, tail_expert, tail_row0, tail_n = _carve(blocks.block_expert.device, blocks.max_blocks, E * nsub,
                                                 E * nsub, E * nsub)
    launch("tail_tiles_kernel", (1,), (blocks.block_expert, blocks.block_rows, big, tail_expert, tail_row0, tail_n,
                                       E, blocks.max_blocks),
           _tail_options(blocks.block_m, tail_rows, sub_m, _next_pow2(E)))  # fmt: skip
    return TailTiles(sub_m, big, tail_expert, tail_row0, tail_n)


@functools.lru_cache(maxsize=None)
def _tail_options(block_m: int, tail_rows: int, sub_m: int, e_pad: int) -> LaunchOptions:
    return LaunchOptions(BLOCK_M=block_m, TAIL_ROWS=tail_rows, SUB_M=sub_m, E_PAD=e_pad,
                         NB=max(1, min(64, 4096 // e_pad)), num_warps=4)
