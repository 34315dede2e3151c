"""DeepEP's buffer sizing, replicated from its C++ (csrc/config.hpp, deep_ep.cpp, launch.cuh) so that
buffers are sized and checked without importing DeepEP: used by the DeepEP dispatchers and by the
quant plan's workspace sizing (`epmoe.quant.workspace`), so both give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from epmoe.core.availability import Availability
from epmoe.quant.payload import PayloadFormat

# Constants of DeepEP V1 (csrc/kernels/configs.cuh, launch.cuh, config.hpp); the sizing below mirrors
# its C++ so that buffers can be sized (and checked) without importing it.
NUM_MAX_NVL_PEERS = 8
BUFFER_ALIGNMENT_BYTES = 128
SOURCE_META_BYTES = 8  # sizeof(internode::SourceMeta): two ints
TOPK_IDX_BYTES = 8  # deep_ep.topk_idx_t is int64 (TOPK_IDX_BITS=64, the default build)
_HINT_MAX_TOPK = 128  # kNumMaxTopK / kNumMaxScales assumed by Config::get_nvl_buffer_size_hint
_HINT_MAX_SCALES = 128
NORMAL_MODE_EP_SIZES = (2, 4, 8)  # SWITCH_RANKS in launch.cuh
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # SWITCH_HIDDEN in launch.cuh
LL_MAX_TOP_K = 11  # kNumMaxTopK in internode_ll.cu
LL_DEFAULT_QP_DEPTH = 1024  # NVSHMEM_QP_DEPTH default in deep_ep.Buffer
FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4  # DeepEP clamps the block amax to this before dividing


def fp8_block_format() -> PayloadFormat:
    """DeepEP's FP8 token format: e4m3 data [T, H] + float32 scale per 1x128 [T, H/128]."""
    return PayloadFormat(
        name="fp8_block", dtype=torch.float8_e4m3fn, block_size=FP8_BLOCK,
        scale_dtype=torch.float32, scale_layout="linear",
    )


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class DeepEPConfig:
    """Mirror of `deep_ep.Config` (normal-mode tuning): SMs used (two per channel) and the NVLink /
    RDMA chunk sizes in tokens. Validated like the C++ constructor."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_sms <= 0 or self.num_sms % 2:
            raise ValueError(f"DeepEP num_sms={self.num_sms}; it must be a positive even number (2 SMs per channel)")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                f"DeepEP NVLink chunks: send={self.num_max_nvl_chunked_send_tokens} must be in "
                f"(0, recv={self.num_max_nvl_chunked_recv_tokens})"
            )
        rdma_recv = _align(self.num_max_rdma_chunked_recv_tokens, self.num_max_rdma_chunked_send_tokens)
        if not 0 < self.num_max_rdma_chunked_send_tokens <= rdma_recv // 2:
            raise ValueError(
                f"DeepEP RDMA chunks: send={self.num_max_rdma_chunked_send_tokens} must be in "
                f"(0, recv/2={rdma_recv // 2}]"
            )

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def to_deep_ep(self, deep_ep: Any) -> Any:
        return deep_ep.Config(
            self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens,
        )


# DeepEP's tuned intranode configs (Buffer.get_dispatch_config / get_combine_config), SMs set apart.
_DISPATCH_CHUNKS = {2: (24, 256), 4: (6, 256), 8: (6, 256)}
_COMBINE_CHUNKS = {2: (10, 256), 4: (9, 256), 8: (4, 256)}


def default_configs(ep_size: int, num_sms: int = 20) -> Tuple[DeepEPConfig, DeepEPConfig]:
    """(dispatch, combine) configs DeepEP recommends for an intranode group of `ep_size` ranks."""
    ok = normal_mode_ep_support(ep_size)
    if not ok:
        raise ValueError(ok.reason)
    d_send, d_recv = _DISPATCH_CHUNKS[ep_size]
    c_send, c_recv = _COMBINE_CHUNKS[ep_size]
    return (
        DeepEPConfig(num_sms, d_send, d_recv, 6, 128),
        DeepEPConfig(num_sms, c_send, c_recv, 6, 128),
    )


def nvl_buffer_size_hint(config: DeepEPConfig, hidden_bytes: int, num_ranks: int) -> int:
    """`Config::get_nvl_buffer_size_hint` (csrc/config.hpp) of an NVSHMEM-enabled build, in bytes."""
    if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
        raise ValueError(f"num_ranks={num_ranks}: DeepEP needs < 8 ranks or a multiple of 8")
    rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
    nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
    slots = config.num_channels * nvl_ranks
    recv = config.num_max_nvl_chunked_recv_tokens
    n = slots * (2 * rdma_ranks + 3) * 4  # channel start/end offsets, head/tail
    n += slots * recv * hidden_bytes  # data
    n += slots * recv * SOURCE_META_BYTES  # source meta
    n += slots * recv * _HINT_MAX_TOPK * TOPK_IDX_BYTES  # top-k ids
    n += slots * recv * _HINT_MAX_TOPK * 4  # top-k weights
    n += slots * recv * _HINT_MAX_SCALES * 4  # FP8 scales
    return _align(n, BUFFER_ALIGNMENT_BYTES)


def intranode_dispatch_bytes(
    config: DeepEPConfig, num_ranks: int, hidden_bytes: int, top_k: int, num_scales: int
) -> int:
    """Exact NVLink bytes `Buffer::intranode_dispatch` asserts it needs (csrc/deep_ep.cpp)."""
    slots = config.num_channels * num_ranks
    recv = config.num_max_nvl_chunked_recv_tokens
    return (
        num_ranks * num_ranks * 4 + slots * 4 * 4
        + slots * recv * (hidden_bytes + 4 + top_k * TOPK_IDX_BYTES + top_k * 4 + num_scales * 4)
    )


def intranode_combine_bytes(config: DeepEPConfig, num_ranks: int, hidden_bytes: int, top_k: int) -> int:
    """Exact NVLink bytes `Buffer::intranode_combine` asserts it needs (csrc/deep_ep.cpp)."""
    slots = config.num_channels * num_ranks
    recv = config.num_max_nvl_chunked_recv_tokens
    return slots * 2 * 4 + slots * recv * (hidden_bytes + 4 + top_k * 4)


def low_latency_rdma_size_hint(max_tokens_per_rank: int, hidden_size: int, num_ranks: int, num_experts: int) -> int:
    """`get_low_latency_rdma_size_hint` (csrc/config.hpp, `LowLatencyLayout`), in bytes: two
    (odd/even) copies of a send buffer, a receive buffer and a signalling buffer."""
    H, M, E = hidden_size, max_tokens_per_rank, num_experts
    num_scales = H // 128
    if num_scales * 4 > H:
        raise ValueError(f"hidden_size={H} is too small for DeepEP's low-latency layout")
    dispatch_msg = 16 + max(H * 2, H + num_scales * 4)  # int4 header + BF16 row or FP8 row + scales
    combine_msg = num_scales * 4 + H * 2  # per-128-channel bf16x2 min/max + BF16 row
    send = max(M * dispatch_msg, E * M * combine_msg)
    recv = max(E * M * dispatch_msg, E * M * combine_msg)
    signalling = _align(E * 4, 128)
    total = 2 * send + 2 * recv + 2 * signalling
    # DeepEP rounds up by one alignment unit even when already aligned; kept for byte equality.
    return (total + BUFFER_ALIGNMENT_BYTES) // BUFFER_ALIGNMENT_BYTES * BUFFER_ALIGNMENT_BYTES


@dataclass(frozen=True)
class DeepEPBufferSizes:
    """num_nvl_bytes: NVLink IPC buffer (normal mode); num_rdma_bytes: NVSHMEM buffer (low latency)."""

    num_nvl_bytes: int = 0
    num_rdma_bytes: int = 0


def deepep_buffer_bytes(
    *,
    low_latency: bool,
    hidden_size: int,
    ep_size: int,
    num_experts: int,
    top_k: int,
    max_tokens_per_rank: int,
    wire: Optional[PayloadFormat] = None,
    configs: Optional[Tuple[DeepEPConfig, DeepEPConfig]] = None,
) -> DeepEPBufferSizes:
    """The buffer DeepEP needs for one layer shape (pure: no DeepEP, no GPU).

    Normal mode: the NVLink buffer is a ring per channel and does not grow with the batch; it is the
    largest of DeepEP's size hint for the dispatch and combine configs (hidden bytes of the BF16
    combine, the wider of the two directions) and the exact byte counts its kernels assert.
    Low latency: DeepEP's RDMA size hint, which grows with max_tokens_per_rank * num_experts."""
    if low_latency:
        return DeepEPBufferSizes(
            num_rdma_bytes=low_latency_rdma_size_hint(max_tokens_per_rank, hidden_size, ep_size, num_experts)
        )
    wire = wire or PayloadFormat.unquantized(torch.bfloat16)
    dispatch_cfg, combine_cfg = configs or default_configs(ep_size)
    combine_bytes = hidden_size * 2
    dispatch_bytes = wire.data_bytes_per_token(hidden_size)
    num_scales = -(-hidden_size // FP8_BLOCK) if wire.is_quantized else 0
    local_experts = num_experts // ep_size
    need = max(
        nvl_buffer_size_hint(dispatch_cfg, max(dispatch_bytes, combine_bytes), ep_size),
        nvl_buffer_size_hint(combine_cfg, max(dispatch_bytes, combine_bytes), ep_size),
        intranode_dispatch_bytes(dispatch_cfg, ep_size, dispatch_bytes, top_k, num_scales),
        intranode_combine_bytes(combine_cfg, ep_size, combine_bytes, top_k),
        ep_size * (ep_size + local_experts) * 4,  # notify_dispatch's metadata
    )
    return DeepEPBufferSizes(num_nvl_bytes=_align(need, BUFFER_ALIGNMENT_BYTES))


def normal_mode_ep_support(ep_size: int) -> Availability:
    if ep_size in NORMAL_MODE_EP_SIZES:
        return Availability.yes()
    if ep_size == 1:
        return Availability.no(
            "DeepEP's normal kernels cannot run with one rank: they are compiled for 2, 4 or 8 ranks only "
            "(SWITCH_RANKS in csrc/kernels/launch.cuh -> EP_HOST_ASSERT 'Unsupported ranks' in "
            "intranode::notify_dispatch; Buffer.get_dispatch_config(1) already asserts 'Unsupported number "
            "of EP ranks: 1')",
            "use dispatcher 'deepep_ll' (any EP size) or 'torch' for one rank",
        )
    return Availability.no(
        f"DeepEP's normal intranode kernels support ep_size 2, 4 or 8 (got {ep_size}); larger groups need "
        "its internode (RDMA) kernels, which epmoe does not drive",
        "use an EP size of 2, 4 or 8 on one node, or dispatcher 'deepep_ll' / 'torch'",
    )


