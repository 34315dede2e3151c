"""A CPU stand-in for DeepEP V1's Python API (`deep_ep.Buffer`), for testing epmoe's DeepEP
dispatchers without DeepEP or a GPU. Written from DeepEP's documented semantics, over a gloo group:

* normal mode: a token goes once to every rank owning one of its experts; received rows are
  source-rank-major, token-ascending; received top-k ids are local (-1 elsewhere) with weight 0 where
  -1; combine sums the partial rows in fp32 in rank order and rounds to BF16 once.
* low-latency mode: one message per (token, expert) pair; per local expert the valid rows are packed
  at the front ([0, count)), the rest is garbage (NaN here, so reading it shows); FP8 scales come as
  DeepEP returns them (a transposed, column-major view); combine weights and sums in fp32 in top-k
  order and rounds to BF16 once.

It enforces the DeepEP assertions epmoe must respect (dtypes, shapes, 2/4/8 ranks in normal mode,
QP depth, `(ranks * max_tokens) % 4`), and records calls in `Buffer.calls` for argument checks.
Install it with `sys.modules["deep_ep"] = fake_deep_ep` (tests do, per process).
"""

from __future__ import annotations

import os
from typing import Any, List

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
_E4M3_MAX = 448.0


class Config:
    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
        assert num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens
        self.num_sms = num_sms
        self.args = (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                     num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)


class _Event:
    def current_stream_wait(self) -> None:
        pass


class DeepEPAssertion(RuntimeError):
    pass


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise DeepEPAssertion(f"Failed: Assertion error (fake deep_ep) '{what}'")


def _gather(obj: Any, group) -> List[Any]:
    out: List[Any] = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _fp8_cast(x: torch.Tensor):
    """DeepEP's low-latency per-token, per-128-channel cast: [N, H] bf16 -> (e4m3 [N, H], f32 [N, H/128])."""
    N, H = x.shape
    b = x.float().view(N, H // 128, 128)
    amax = b.abs().amax(dim=2).clamp(min=1e-4)
    e4m3_max = torch.tensor(_E4M3_MAX)  # DeepEP: scale = 448 / amax, scale_inv = amax * (1.0f / 448)
    return (b * (e4m3_max / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(N, H), amax * (1 / e4m3_max)


class Buffer:
    num_sms = 20
    instances: List["Buffer"] = []

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None):
        _check(group is not None, "group")
        _check(num_nvl_bytes % 128 == 0 and num_rdma_bytes % 128 == 0, "buffer bytes % 128 == 0")
        if num_rdma_bytes > 0:
            _check(group.size() > 8 or low_latency_mode, "num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode")
        if low_latency_mode:
            _check(num_qps_per_rank > 0, "num_qps_per_rank > 0")
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        self.group = group
        self.rank, self.group_size = group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        self.calls: List[tuple] = []
        _gather(self.rank, group)  # DeepEP all-gathers device ids / IPC handles here
        Buffer.instances.append(self)

    def destroy(self) -> None:
        _check(self.explicitly_destroy, "`explicitly_destroy` flag must be set")
        _check(not self.destroyed, "not destroyed")
        dist.barrier(group=self.group)
        self.destroyed = True

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        _check(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and contiguous")
        _check(topk_idx.dtype == topk_idx_t, "topk_idx dtype is topk_idx_t")
        R = self.group_size
        E_local = num_experts // R
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // E_local, torch.full_like(topk_idx, -1))
        in_rank = (dest.unsqueeze(-1) == torch.arange(R)).any(dim=1)
        per_rank = in_rank.sum(dim=0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        self.calls.append(("get_dispatch_layout", topk_idx.dtype, num_experts))
        return per_rank, None, per_expert, in_rank, _Event()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        R, me = self.group_size, self.rank
        _check(config is not None or R in (2, 4, 8, 16, 24, 32), f"Unsupported number of EP ranks: {R}")
        _check(R in (2, 4, 8), "false and \"Unsupported ranks\"")  # SWITCH_RANKS in the kernels
        if handle is not None:  # cached mode: the layout of the dispatch that made `handle`
            return self._cached_dispatch(x, handle, topk_idx, topk_weights, config)
        data, scales = x if isinstance(x, tuple) else (x, None)
        _check(data.dim() == 2 and data.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        _check((data.shape[1] * data.element_size()) % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        if scales is not None:
            _check(data.element_size() == 1, "x.element_size() == 1")
            _check(scales.dtype in (torch.float32, torch.int32) and scales.dim() == 2, "x_scales float32/int, 2-D")
        _check(topk_idx.dtype == topk_idx_t and topk_weights.dtype == torch.float32, "topk dtypes")
        _check(num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32, "int32 counts")
        E = num_tokens_per_expert.shape[0]
        E_local = E // R
        self.calls.append(("dispatch", data.dtype, None if scales is None else scales.dtype, topk_idx.dtype, config))
        # float8 tensors do not pickle: travel as bytes
        wire = data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data
        everyone = _gather((wire, scales, topk_idx, topk_weights, is_token_in_rank), self.group)
        rows, srows, ids, ws, src_idx = [], [], [], [], []
        lo, hi = me * E_local, (me + 1) * E_local
        for s in range(R):
            d_s, sc_s, idx_s, w_s, in_s = everyone[s]
            t = in_s[:, me].nonzero().flatten()  # ascending
            rows.append(d_s[t])
            if sc_s is not None:
                srows.append(sc_s[t])
            local = idx_s[t]
            mine = (local >= lo) & (local < hi)
            ids.append(torch.where(mine, local - lo, torch.full_like(local, -1)))
            ws.append(torch.where(mine, w_s[t], torch.zeros_like(w_s[t])))
            src_idx.append(t)
        recv = torch.cat(rows).view(data.dtype)
        recv_ids, recv_w = torch.cat(ids), torch.cat(ws)
        per_expert = [int((recv_ids == e).sum()) for e in range(E_local)]
        per_expert = [-(-n // expert_alignment) * expert_alignment for n in per_expert]
        # DeepEP's handle: (rank_prefix_matrix [R, R] int32: [i][j] = tokens ranks 0..i send to j,
        # channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx [N] int32, is_token_in_rank,
        # send_head [T, R] int32); the channel matrices and send_head are not emulated (zeros).
        sent = torch.stack([everyone[s][4].sum(dim=0) for s in range(R)]).to(torch.int32)  # [src, dst]
        rank_prefix = sent.cumsum(dim=0).to(torch.int32)
        C = (config.num_sms if config is not None else 20) // 2
        raw = (rank_prefix, torch.zeros(R, C, dtype=torch.int32), torch.zeros(R, C, dtype=torch.int32),
               torch.cat(src_idx).to(torch.int32), is_token_in_rank,
               torch.zeros(data.shape[0], R, dtype=torch.int32))
        out_x = (recv, torch.cat(srows)) if scales is not None else recv
        return out_x, recv_ids, recv_w, per_expert, raw, _Event()

    def _cached_dispatch(self, x, handle, topk_idx, topk_weights, config):
        """DeepEP's cached mode: `handle`'s is_token_in_rank and counts, no top-k (asserted None), the
        received rows in the same order as that dispatch's; returns (recv_x, None, None, None, None, event)."""
        _check(topk_idx is None and topk_weights is None, "topk_idx is None and topk_weights is None")
        data, scales = x if isinstance(x, tuple) else (x, None)
        _check(data.dim() == 2 and data.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        _, _, _, recv_src_idx, in_rank, _ = handle
        _check(data.shape[0] == in_rank.shape[0], "x.size(0) == is_token_in_rank.size(0)")
        self.calls.append(("cached_dispatch", data.dtype, None if scales is None else scales.dtype, config))
        everyone = _gather((data, scales, in_rank), self.group)
        me = self.rank
        rows, srows = [], []
        for d_s, sc_s, in_s in everyone:
            t = in_s[:, me].nonzero().flatten()
            rows.append(d_s[t])
            if sc_s is not None:
                srows.append(sc_s[t])
        recv = torch.cat(rows)
        _check(recv.shape[0] == recv_src_idx.shape[0], "num_recv_tokens == recv_src_idx.size(0)")
        out_x = (recv, torch.cat(srows)) if scales is not None else recv
        return out_x, None, None, None, None, _Event()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        _check(x.dtype == torch.bfloat16, "false and \"Unsupported type\"")  # SWITCH_TYPES: BF16 only
        _check(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and contiguous")
        rank_prefix, _, _, src_idx, _, send_head = handle
        _check(x.shape[0] == src_idx.shape[0], "x.size(0) == num_recv_tokens")
        if topk_weights is not None:
            _check(topk_weights.dtype == torch.float32 and topk_weights.dim() == 2
                   and topk_weights.shape[0] == x.shape[0], "topk_weights [num_recv_tokens, num_topk] float")
        self.calls.append(("combine", x.dtype, config))
        everyone = _gather((x, rank_prefix, src_idx, topk_weights), self.group)
        me = self.rank
        out = torch.zeros(send_head.shape[0], x.shape[1], dtype=torch.float32)
        w_out = None if topk_weights is None else torch.zeros(send_head.shape[0], topk_weights.shape[1])
        for r, (y, rp, si, w) in enumerate(everyone):  # rank order; rank r holds my rows in one run
            begin = int(rp[me - 1, r]) if me > 0 else 0
            end = int(rp[me, r])
            out.index_add_(0, si[begin:end].long(), y[begin:end].float())
            if w_out is not None:  # DeepEP sums the top-k weights over the ranks a token went to
                w_out.index_add_(0, si[begin:end].long(), w[begin:end].float())
        return out.to(torch.bfloat16), w_out, _Event()

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        M, R, me = num_max_dispatch_tokens_per_rank, self.group_size, self.rank
        _check(self.low_latency_mode, "low_latency_mode")
        _check(self.nvshmem_qp_depth >= (M + 1) * 2, "self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2")
        _check(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16, "x 2-D contiguous bf16")
        _check(x.shape[1] % 128 == 0, "x.size(1) % 128 == 0")
        _check(x.shape[0] == topk_idx.shape[0] and x.shape[0] <= M, "x.size(0) <= num_max_dispatch_tokens_per_rank")
        _check(topk_idx.dtype == topk_idx_t, "topk_idx dtype is topk_idx_t")
        _check(num_experts % R == 0, "num_experts % num_ranks == 0")
        _check((R * M) % 4 == 0, "TMA requires the number of tokens to be multiple of 4")
        if use_fp8:
            _check(x.shape[1] % 512 == 0, "hidden % 512 == 0")
        self.calls.append(("low_latency_dispatch", topk_idx.dtype, M, num_experts, use_fp8))
        H, E_local = x.shape[1], num_experts // R
        everyone = _gather((x, topk_idx), self.group)
        recv = torch.full((E_local, R * M, H), float("nan"), dtype=torch.bfloat16)  # garbage past the counts
        count = torch.zeros(E_local, dtype=torch.int32)
        # DeepEP's handle: src_info [E_local, R*M] int32 = source token of each slot; layout_range
        # [E_local, R] int64 = count | begin << 32 of each source rank's run of slots
        src_info = torch.full((E_local, R * M), -1, dtype=torch.int32)
        layout_range = torch.zeros(E_local, R, dtype=torch.int64)
        for e in range(E_local):
            g = me * E_local + e
            n = 0
            for s in range(R):
                xs, idx_s = everyone[s]
                begin = n
                for t in (idx_s == g).any(dim=1).nonzero().flatten().tolist():
                    recv[e, n] = xs[t]
                    src_info[e, n] = t
                    n += 1
                layout_range[e, s] = (n - begin) | (begin << 32)
            count[e] = n
        raw = (src_info, layout_range, M, H, num_experts)
        if not use_fp8:
            return recv, count, raw, _Event(), None
        data, sc = _fp8_cast(recv.view(-1, H).nan_to_num(0.0))
        data = data.view(E_local, R * M, H)
        scales_cm = torch.empty(E_local, H // 128, R * M, dtype=torch.float32)  # column-major like DeepEP
        scales = scales_cm.transpose(1, 2)
        scales.copy_(sc.view(E_local, R * M, H // 128))
        for e in range(E_local):  # garbage past the counts
            data[e, int(count[e]):] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
        return (data, scales), count, raw, _Event(), None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        src_info, layout_range, M, H, E = handle
        R, me = self.group_size, self.rank
        E_local = E // R
        _check(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16, "x 3-D contiguous bf16")
        _check(tuple(x.shape) == (E_local, R * M, H), "x is [num_local_experts, num_ranks * M, hidden]")
        _check(topk_idx.dtype == topk_idx_t and topk_weights.dtype == torch.float32, "topk dtypes")
        _check(topk_weights.shape[0] <= M, "topk_weights.size(0) <= num_max_dispatch_tokens_per_rank")
        self.calls.append(("low_latency_combine", x.dtype, topk_idx.dtype))
        everyone = _gather((x, src_info, layout_range), self.group)
        T = topk_idx.shape[0]
        result = torch.zeros(T, H, dtype=torch.float32)
        for t in range(T):
            for k in range(topk_idx.shape[1]):  # top-k order, like DeepEP's reduction
                g = int(topk_idx[t, k])
                if g < 0:
                    continue
                owner, e = divmod(g, E_local)
                y_o, info_o, range_o = everyone[owner]
                packed = int(range_o[e, me])
                n, begin = packed & 0xFFFFFFFF, packed >> 32
                hit = (info_o[e, begin:begin + n] == t).nonzero().flatten()
                _check(hit.numel() == 1, "one slot per (token, expert)")
                result[t] += topk_weights[t, k] * y_o[e, begin + int(hit[0])].float()
        return result.to(torch.bfloat16), _Event(), None


def install():
    """Make `import deep_ep` give this stand-in in this process, and let epmoe's DeepEP dispatchers run
    it on CPU. Returns epmoe.dispatch.deepep."""
    import sys

    import epmoe.dispatch.deepep as dd

    sys.modules["deep_ep"] = sys.modules[__name__]
    dd._device_problem = lambda device: None  # the stand-in runs on CPU
    return dd
