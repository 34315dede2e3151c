"""A stand-in for `deep_gemm`'s grouped GEMMs (the four the `deepgemm` experts call), in float32 torch.

Stand-in only: it proves what our glue hands DeepGEMM (rows, m_indices, masked counts, scale values and
their MN-major layout) computes the right function; it says nothing of DeepGEMM's own kernels. Every
call is recorded with whether each activation scale tensor came MN-major (stride 1 along M, and along K
the row count rounded up to 4: TMA's 16-byte alignment), the layout DeepGEMM's SM90 kernels take
without a copy.
"""

from __future__ import annotations

import torch


def _deq_rows(x, s):
    """e4m3 [M, K] with fp32 scales [M, K/128] (any strides) -> float32."""
    return x.float() * s.float().repeat_interleave(128, dim=-1)[..., : x.shape[-1]]


def _deq_blocks(w, s):
    """e4m3 [N, K] with fp32 128x128 block scales [N/128, K/128] -> float32."""
    f = s.float().repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    return w.float() * f[: w.shape[-2], : w.shape[-1]]


class FakeDeepGEMM:
    def __init__(self, align: int = 128):
        self.align = align
        self.calls = []

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return self.align

    def _check_blocks(self, m_indices):
        """DeepGEMM's contiguous kernels take a tile's expert from its first row and skip a tile whose
        first row is -1: every tile must hold one expert's rows (then padding), or none."""
        tiles = m_indices.view(-1, self.align)
        first = tiles[:, :1]
        assert bool(((tiles == first) | (tiles < 0)).all()), "a tile mixes the rows of two experts"
        assert bool(((first >= 0) | (tiles < 0).all(dim=1, keepdim=True)).all()), \
            "a tile starts with a padding row but holds real rows (DeepGEMM would skip them)"
        assert bool((tiles[:, 1:] >= 0).le(tiles[:, :-1] >= 0).all()), "padding rows before real rows in a tile"

    def _record(self, name, sf=None, rows=None):
        mn_major = None if sf is None else (sf.stride(-2) == 1 and sf.stride(-1) == (sf.shape[-2] + 3) // 4 * 4)
        self.calls.append(dict(name=name, mn_major=mn_major, rows=rows))

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, m_indices, disable_ue8m0_cast=False):
        (x, xs), (w, ws) = a, b
        assert x.dtype == torch.float8_e4m3fn and w.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16
        assert m_indices.dtype == torch.int32 and m_indices.shape == (x.shape[0],) and x.shape[0] % self.align == 0
        assert tuple(xs.shape) == (x.shape[0], x.shape[1] // 128), xs.shape
        self._check_blocks(m_indices)
        self._record("fp8_contiguous", xs, rows=x.shape[0])
        for g in range(w.shape[0]):
            rows = (m_indices == g).nonzero().flatten()
            if rows.numel():
                d[rows] = (_deq_rows(x[rows], xs[rows]) @ _deq_blocks(w[g], ws[g]).T).to(d.dtype)

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, m_indices):
        assert a.dtype == b.dtype == d.dtype == torch.bfloat16 and a.shape[0] % self.align == 0
        self._check_blocks(m_indices)
        self._record("bf16_contiguous", rows=a.shape[0])
        for g in range(b.shape[0]):
            rows = (m_indices == g).nonzero().flatten()
            if rows.numel():
                d[rows] = (a[rows].float() @ b[g].float().T).to(d.dtype)

    # DeepGEMM's SM90 masked kernels store whole BLOCK_M-row tiles with a 2-D TMA store at row
    # g * M + m_block * BLOCK_M of the [G * M, N] output (include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh,
    # common/scheduler.cuh), clipped only at the end of the tensor: when M is not a multiple of BLOCK_M
    # (64 or 128, the heuristic's choice), a group's last tile overwrites the next group's first rows.
    # Emulated with BLOCK_M = 128, the groups in reverse order (so a spill lands on written rows).
    MASKED_BLOCK_M = 128

    def _masked_tiles(self, rows_fn, d, masked_m):
        G, M, N = d.shape
        flat = d.view(G * M, N)
        for g in reversed(range(G)):
            n = int(masked_m[g])
            for mb in range(-(-n // self.MASKED_BLOCK_M)):
                lo = g * M + mb * self.MASKED_BLOCK_M
                hi = min(lo + self.MASKED_BLOCK_M, G * M)
                flat[lo:hi] = rows_fn(g, lo, hi).to(d.dtype)

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m, disable_ue8m0_cast=False):
        (x, xs), (w, ws) = a, b
        assert x.dim() == 3 and tuple(xs.shape) == (x.shape[0], x.shape[1], x.shape[2] // 128), xs.shape
        assert masked_m.dtype == torch.int32 and isinstance(expected_m, int) and expected_m >= 1
        self._record("fp8_masked", xs)
        G, M, K = x.shape
        xf, xsf = x.reshape(G * M, K), xs.reshape(G * M, K // 128)
        self._masked_tiles(lambda g, lo, hi: _deq_rows(xf[lo:hi], xsf[lo:hi]) @ _deq_blocks(w[g], ws[g]).T, d, masked_m)

    def m_grouped_bf16_gemm_nt_masked(self, a, b, d, masked_m, expected_m):
        assert a.dtype == torch.bfloat16 and masked_m.dtype == torch.int32 and expected_m >= 1
        self._record("bf16_masked")
        G, M, K = a.shape
        af = a.reshape(G * M, K)
        self._masked_tiles(lambda g, lo, hi: af[lo:hi].float() @ b[g].float().T, d, masked_m)
