"""`TorchA2ADispatcher` ("torch"): torch.distributed all_to_all_single with exchanged split sizes.
NCCL on GPU, gloo on CPU: the embedded default that runs anywhere.

dispatch (per call, three collectives):
  1. meta exchange: all_to_all of [ep, 2] int64 = (rows for that rank, "my input is bad" flag).
     Every rank learns every sender's flag, so a bad input on one rank makes all ranks raise
     instead of leaving the others in the next collective.
  2. payload: each token goes once to every rank owning at least one of its experts, as one packed
     uint8 row [hidden payload | local top-k ids int32 | top-k weights f32] (one collective instead
     of three; FP8 scales travel as bytes, which gloo needs anyway).
combine: all_to_all of the expert outputs back (model dtype), then each rank adds its partial sums
  per source rank in rank order, in fp32 (float64 for a float64 model): deterministic on every device.
backward (training, docs/training.md): combine's backward sends each token's output gradient to every
  rank its row went to (one all_to_all, the dispatch direction); dispatch's backward sends the received
  rows' gradients [hidden | top-k weights] back as one packed row (the combine direction) and adds them
  per source token in rank order. Split sizes come from the handle: no exchange, no host sync.

Host syncs: the split sizes must reach the host (all_to_all_single takes python ints), so a call over
several ranks reads both [ep] count vectors back in ONE device -> host copy; the rows to send are then
listed with `nonzero_static` of that known size (no second sync). One rank without a process group,
inputs already checked by the layer (`Agreement.inputs_checked`), has nothing to exchange: every token
stays in place (rows of no expert give 0 in the experts), no sync and no copy of the rows.

CUDA tensors over a gloo group (several ranks sharing one GPU, `spec.shared_gpu`, where NCCL refuses
duplicate devices): every collective stages its tensors through host memory (device -> host copy,
gloo all_to_all, host -> device copy). The bytes and the arithmetic are those of the NCCL path, so
results compare bit for bit with other dispatchers; the time is host-bound and says nothing about a
link. Staging syncs with the host, so this path cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from epmoe.core import dist as edist
from epmoe.core.availability import Availability
from epmoe.core.capability import BackendRequest
from epmoe.core.fault import run_collective
from epmoe.dispatch.base import Agreement, DispatchedTokens, DispatchHandle, Dispatcher, DispatchSpec
from epmoe.quant import codec
from epmoe.quant.payload import PayloadFormat


@dataclass(frozen=True)
class TorchA2AHandle(DispatchHandle):
    """send_token_idx [S] int64: source token of each sent row (rank-major, tokens ascending);
    send_on_dest [S, K] bool: which top-k slots of each sent row live on its destination rank (what
    dispatch's backward needs to hand the weights' gradients back; a view of what dispatch computed);
    send_counts / recv_counts: rows per peer rank (python ints, used as split sizes)."""

    send_token_idx: Optional[torch.Tensor] = None
    send_on_dest: Optional[torch.Tensor] = None
    send_counts: Tuple[int, ...] = ()
    recv_counts: Tuple[int, ...] = ()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] tensor -> [N, row_bytes] uint8 view (copying only if not contiguous)."""
    t = t.contiguous()
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.view(torch.uint8).reshape(t.shape[0], row_bytes)


class _RowCodec:
    """The dispatch row for one wire format: [payload (epmoe.quant.codec wire row) | ids | weights]."""

    def __init__(self, spec: DispatchSpec):
        self.spec = spec
        self.wire: PayloadFormat = spec.wire_format
        H, K = spec.hidden_size, spec.top_k
        # the top-k weights travel in float32; a float64 model keeps them in float64 (gradient checks)
        self.weight_dtype = torch.float64 if spec.combine_dtype == torch.float64 else torch.float32
        self.payload_bytes = codec.wire_bytes_per_token(self.wire, H) if self.wire.is_quantized \
            else self.wire.data_bytes_per_token(H)
        self.routing_bytes = K * 4 + K * self.weight_dtype.itemsize
        self.row_bytes = self.payload_bytes + self.routing_bytes

    def pack(self, hidden: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.wire.is_quantized:
            payload = codec.pack_rows(codec.quantize_for_wire(hidden, self.wire))
        else:
            payload = _as_bytes(hidden.to(self.wire.dtype))
        return torch.cat([payload, _as_bytes(local_ids.to(torch.int32)), _as_bytes(weights.to(self.weight_dtype))], dim=1)

    def unpack(self, rows: torch.Tensor) -> Tuple[object, torch.Tensor, torch.Tensor]:
        N, H, K = rows.shape[0], self.spec.hidden_size, self.spec.top_k
        o = self.payload_bytes
        ids = rows[:, o : o + 4 * K].contiguous().view(torch.int32).reshape(N, K)
        w = rows[:, o + 4 * K :].contiguous().view(self.weight_dtype).reshape(N, K)
        if not self.wire.is_quantized:
            return rows[:, :o].contiguous().view(self.wire.dtype).reshape(N, H), ids, w
        hidden = codec.unpack_rows(rows[:, :o].contiguous(), self.wire, H)
        if self.spec.payload != self.wire:  # experts take another format: dequantize on arrival
            hidden = codec.dequantize_activation(hidden, self.spec.combine_dtype)
        return hidden, ids, w


class TorchA2ADispatcher(Dispatcher):
    """Runs on any device torch.distributed serves (gloo on CPU, NCCL on GPU); moves every format the
    codec implements (BF16, NVFP4, FP8 1x128) as packed rows; flat layout."""

    name = "torch"
    wires = ("bf16", "nvfp4", "fp8")

    def __init__(self, spec: DispatchSpec):
        super().__init__(spec)

        self._codec = _RowCodec(spec)
        self._distributed = edist.is_distributed(spec.group)
        self._combine_elem = torch.empty((), dtype=spec.combine_dtype).element_size()
        # combine sums in fp32; a float64 model in float64
        self._acc_dtype = torch.float64 if spec.combine_dtype == torch.float64 else torch.float32
        # gloo moves host memory only: CUDA tensors are staged through the host (shared-GPU mode)
        self._host_staging = self._distributed and dist.get_backend(spec.group) == "gloo"

    @property
    def keeps_routing(self) -> bool:
        """One rank, unquantized wire: `_dispatch_local` passes the int32 / float32 routing through."""
        return not self._distributed and not self._codec.wire.is_quantized and not self.spec.static_shapes

    # ------------------------------------------------------------------ helpers
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, what: str) -> None:
        """all_to_all_single over the group (a copy for one rank); CUDA tensors over gloo go through
        host buffers."""
        if not self._distributed:
            out.copy_(inp)
            return
        if self._host_staging and (out.is_cuda or inp.is_cuda):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "the torch dispatcher over a gloo group stages CUDA tensors through host memory and cannot "
                    "be captured in a CUDA graph; use dispatcher 'flashinfer' (shared_gpu=True) or "
                    "decode_runner(..., cuda_graph=False)"
                )
            host_in = inp.cpu()
            host_out = torch.empty(out.shape, dtype=out.dtype)
            run_collective(
                lambda: dist.all_to_all_single(host_out, host_in, out_splits, in_splits, group=self.spec.group,
                                               async_op=True),
                self.spec.timeout_s, what,
            )
            out.copy_(host_out)
            return
        run_collective(
            lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.spec.group, async_op=True),
            self.spec.timeout_s, what,
        )

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int], in_splits: List[int]) -> None:
        self._all_to_all(out, inp, out_splits, in_splits, "all_to_all of token rows")

    def _validate(self, hidden, topk_ids, topk_weights) -> Tuple[Optional[BaseException], Optional[torch.Tensor]]:
        """Local checks. Returns (error or None, device flag tensor for id range)."""
        try:
            self.check_inputs(hidden, topk_ids, topk_weights)
        except (ValueError, TypeError) as e:
            return e, None
        E = self.spec.num_experts
        bad = ((topk_ids < -1) | (topk_ids >= E)).any()
        return None, bad

    # ------------------------------------------------------------------ static (CUDA graph) mode
    def _dispatch_static(self, hidden, topk_ids, topk_weights):
        """Every rank sends all its M rows to every rank (ids local there or -1): equal splits, no
        host sync, fixed shapes. Costs bandwidth for tokens a rank does not need; meant for decode."""
        s = self.spec
        ep, E_local, M = s.ep_size, s.num_local_experts, s.max_tokens_per_rank
        if hidden.shape[0] != M:
            raise ValueError(f"static dispatch takes exactly max_tokens_per_rank={M} rows, got {hidden.shape[0]}")
        ids = topk_ids.to(torch.int64)
        ranks = torch.arange(ep, device=ids.device).view(ep, 1, 1)
        dest = torch.where(ids >= 0, ids // E_local, torch.full_like(ids, -1)).unsqueeze(0)  # [1, M, K]
        on = dest == ranks  # [ep, M, K]
        local_ids = torch.where(on, ids.unsqueeze(0) - ranks * E_local, torch.full_like(on, -1, dtype=torch.int64))
        local_w = torch.where(on, topk_weights.float().unsqueeze(0), torch.zeros((), device=ids.device))
        send = self._codec.pack(hidden.repeat(ep, 1), local_ids.reshape(ep * M, -1), local_w.reshape(ep * M, -1))
        recv = torch.empty_like(send)
        self._a2a_meta(recv, send)  # equal splits
        recv_hidden, recv_ids, recv_w = self._codec.unpack(recv)
        handle = TorchA2AHandle(num_tokens=M, bytes_sent=(ep - 1) * M * self._codec.row_bytes)
        return DispatchedTokens(hidden=recv_hidden, topk_ids=recv_ids, topk_weights=recv_w, static=True), handle

    def _combine_static(self, expert_output, handle):
        s = self.spec
        ep, M = s.ep_size, s.max_tokens_per_rank
        back = expert_output.to(s.combine_dtype).contiguous()
        got = torch.empty_like(back)
        self._a2a_meta(got, back)
        got = got.view(ep, M, s.hidden_size)
        out = got[0].float()
        for r in range(1, ep):  # rank order: deterministic
            out = out + got[r].float()
        return out.to(s.combine_dtype)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 *, agreement: Optional[Agreement] = None):
        s = self.spec
        if s.static_shapes:
            return self._dispatch_static(hidden, topk_ids, topk_weights)
        ep, E_local = s.ep_size, s.num_local_experts
        checked = agreement is not None and agreement.inputs_checked
        if checked and not self._distributed:
            return self._dispatch_local(hidden, topk_ids, topk_weights)
        error, bad_ids = (None, None) if checked else self._validate(hidden, topk_ids, topk_weights)

        # split sizes (and, standalone, the "my input is bad" flag): one small all_to_all
        meta = torch.zeros(ep, 1 if checked else 2, dtype=torch.int64, device=hidden.device)
        if error is None:
            ids = topk_ids.to(torch.int64)
            dest = torch.where(ids >= 0, ids // E_local, torch.full_like(ids, -1))  # [T, K]
            ranks = torch.arange(ep, device=ids.device)
            sent = (dest.unsqueeze(-1) == ranks).any(dim=1)  # [T, ep]
            meta[:, 0] = sent.sum(dim=0)
            if not checked:
                meta[:, 1] = bad_ids.to(torch.int64)
        else:
            meta[:, 1] = 1
        recv_meta = torch.empty_like(meta)
        self._a2a_meta(recv_meta, meta)
        both = torch.stack([meta, recv_meta]).tolist()  # the one host sync of this dispatch
        send_counts = [row[0] for row in both[0]]
        recv_counts = [row[0] for row in both[1]]
        if not checked:
            failed = [r for r in range(ep) if both[1][r][1]]
            if error is None and bad_ids is not None and both[0][0][1]:
                bad = topk_ids[(topk_ids < -1) | (topk_ids >= s.num_experts)]
                error = ValueError(
                    f"topk_ids holds expert id {int(bad[0])} outside [0, {s.num_experts}) "
                    f"(-1 marks 'no expert'); fix the router output or num_experts"
                )
            edist.raise_if_any_failed(error, failed, s.group, s.timeout_s)

        # rows in rank-major order, tokens ascending within a rank; their number is known: no sync
        nz = torch.nonzero_static(sent.t().contiguous(), size=sum(send_counts))
        rank_of_row, token_of_row = nz[:, 0], nz[:, 1]
        row_dest = rank_of_row.unsqueeze(1)
        row_ids = ids[token_of_row]
        on_dest = dest[token_of_row] == row_dest
        local_ids = torch.where(on_dest, row_ids - row_dest * E_local, torch.full_like(row_ids, -1))
        local_w = torch.where(on_dest, topk_weights[token_of_row].to(self._codec.weight_dtype), torch.zeros((), device=hidden.device))
        send_rows = self._codec.pack(hidden[token_of_row], local_ids, local_w)

        recv_rows = torch.empty(sum(recv_counts), self._codec.row_bytes, dtype=torch.uint8, device=hidden.device)
        self._a2a(recv_rows, send_rows, recv_counts, send_counts)
        recv_hidden, recv_ids, recv_w = self._codec.unpack(recv_rows)

        me = s.ep_rank
        sent_remote = sum(c for r, c in enumerate(send_counts) if r != me)
        nbytes = sent_remote * self._codec.row_bytes
        st = self.stats
        st.dispatch_calls += 1
        st.dispatch_bytes_sent += nbytes
        st.tokens_sent += sent_remote
        fmt = st.by_format.setdefault(self._codec.wire.name, {"payload": 0, "routing": 0})
        fmt["payload"] += sent_remote * self._codec.payload_bytes
        fmt["routing"] += sent_remote * self._codec.routing_bytes
        handle = TorchA2AHandle(
            num_tokens=hidden.shape[0], bytes_sent=nbytes, send_token_idx=token_of_row, send_on_dest=on_dest,
            send_counts=tuple(send_counts), recv_counts=tuple(recv_counts),
        )
        return DispatchedTokens(hidden=recv_hidden, topk_ids=recv_ids, topk_weights=recv_w), handle

    def _dispatch_local(self, hidden, topk_ids, topk_weights):
        """One rank, inputs checked: every token stays here with its own ids (all local; -1 stays -1)
        and weights (a slot of id -1 keeps the caller's weight: experts read no weight of a -1 slot,
        as with the flashinfer dispatcher). No host sync, no row copy (a quantized wire still
        quantizes and dequantizes: the same numbers as over the wire)."""
        T = hidden.shape[0]
        ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)  # no-op calls skipped
        wdt = self._codec.weight_dtype
        w = topk_weights if topk_weights.dtype == wdt else topk_weights.to(wdt)
        if self._codec.wire.is_quantized:
            recv_hidden, ids, w = self._codec.unpack(self._codec.pack(hidden, ids, w))
        else:
            recv_hidden = hidden if hidden.dtype == self._codec.wire.dtype else hidden.to(self._codec.wire.dtype)
        st = self.stats
        st.dispatch_calls += 1
        if self._codec.wire.name not in st.by_format:
            st.by_format[self._codec.wire.name] = {"payload": 0, "routing": 0}
        handle = TorchA2AHandle(num_tokens=T, bytes_sent=0, send_token_idx=None, send_counts=(T,), recv_counts=(T,))
        return DispatchedTokens(hidden=recv_hidden, topk_ids=ids, topk_weights=w), handle

    def _a2a_meta(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._all_to_all(out, inp, None, None, "all_to_all of split sizes")

    # ------------------------------------------------------------------ combine
    def combine(self, expert_output: torch.Tensor, handle: TorchA2AHandle) -> torch.Tensor:
        s = self.spec
        if s.static_shapes:
            return self._combine_static(expert_output, handle)
        N = sum(handle.recv_counts)
        if expert_output.shape != (N, s.hidden_size):
            raise ValueError(
                f"expert_output has shape {list(expert_output.shape)}; expected [{N}, {s.hidden_size}] "
                "(one row per dispatched token)"
            )
        if handle.send_token_idx is None:  # _dispatch_local: the rows are the tokens, in order
            return expert_output.to(s.combine_dtype)
        back = expert_output.to(s.combine_dtype).contiguous()
        S = sum(handle.send_counts)
        got = torch.empty(S, s.hidden_size, dtype=s.combine_dtype, device=expert_output.device)
        self._a2a(got, back, list(handle.send_counts), list(handle.recv_counts))
        me = s.ep_rank
        self.stats.combine_bytes_sent += (sum(c for r, c in enumerate(handle.recv_counts) if r != me) * s.hidden_size
                                          * self._combine_elem)

        return self._sum_per_token(got, handle).to(s.combine_dtype)

    def _sum_per_token(self, rows: torch.Tensor, handle: TorchA2AHandle) -> torch.Tensor:
        """rows [S, C] in send order -> [T, C] (accumulation dtype): each token's rows summed, rank by
        rank (each rank's rows name distinct tokens: a fixed summation order on every device)."""
        out = torch.zeros(handle.num_tokens, rows.shape[1], dtype=self._acc_dtype, device=rows.device)
        start = 0
        for c in handle.send_counts:
            if c:
                out.index_add_(0, handle.send_token_idx[start : start + c], rows[start : start + c].to(self._acc_dtype))
            start += c
        return out

    # ------------------------------------------------------------------ backward (training)
    @classmethod
    def supports_training(cls, request: BackendRequest) -> Availability:
        if request.wire != "bf16":
            return Availability.no(
                f"dispatcher 'torch' trains with unquantized tokens only, not a {request.wire} wire "
                "(quantized wires are inference-only)", "use dispatch dtype 'auto' or 'bf16' for training")
        if request.layout != "flat":
            return Availability.no(f"dispatcher 'torch' trains on the flat layout, not {request.layout}")
        return Availability.yes("reverse all_to_all of the same group (gloo or NCCL)")

    def _check_backward_handle(self, handle) -> None:
        if self.spec.static_shapes:
            raise RuntimeError("a static-shape (CUDA-graph) dispatch has no backward; decode runners do not train")

    def combine_backward(self, grad_out: torch.Tensor, handle: TorchA2AHandle) -> torch.Tensor:
        """Each token's output gradient goes to every rank its row was sent to: [T, H] -> [N, H]."""
        self._check_backward_handle(handle)
        s = self.spec
        grad_out = grad_out.to(s.combine_dtype)
        if handle.send_token_idx is None:  # one rank: the rows are the tokens
            return grad_out
        rows = grad_out.index_select(0, handle.send_token_idx).contiguous()
        got = torch.empty(sum(handle.recv_counts), s.hidden_size, dtype=s.combine_dtype, device=grad_out.device)
        self._all_to_all(got, rows, list(handle.recv_counts), list(handle.send_counts), "all_to_all of output gradients")
        return got

    def dispatch_backward(self, grad_hidden: torch.Tensor, grad_weights: Optional[torch.Tensor],
                          handle: TorchA2AHandle) -> Tuple[torch.Tensor, torch.Tensor]:
        """The received rows' gradients [hidden | weights] travel back as one packed row and are summed
        per source token in rank order; a weight's gradient comes back from the one rank that holds
        its expert."""
        self._check_backward_handle(handle)
        s = self.spec
        wdt = self._codec.weight_dtype
        N, K = grad_hidden.shape[0], s.top_k
        if grad_weights is None:
            grad_weights = torch.zeros(N, K, dtype=wdt, device=grad_hidden.device)
        if handle.send_token_idx is None:  # one rank: in place, every slot the caller's
            return grad_hidden.to(s.combine_dtype), grad_weights.to(wdt)
        gh = grad_hidden.to(s.combine_dtype)
        row_h = s.hidden_size * gh.element_size()
        back = torch.cat([_as_bytes(gh), _as_bytes(grad_weights.to(wdt))], dim=1)
        got = torch.empty(sum(handle.send_counts), back.shape[1], dtype=torch.uint8, device=grad_hidden.device)
        self._all_to_all(got, back, list(handle.send_counts), list(handle.recv_counts),
                         "all_to_all of token-row gradients")
        S = got.shape[0]
        g_rows = got[:, :row_h].contiguous().view(s.combine_dtype).reshape(S, s.hidden_size)
        w_rows = got[:, row_h:].contiguous().view(wdt).reshape(S, K)
        w_rows = torch.where(handle.send_on_dest, w_rows, torch.zeros((), dtype=wdt, device=w_rows.device))
        grad_x = self._sum_per_token(g_rows, handle).to(s.combine_dtype)
        grad_w = self._sum_per_token(w_rows, handle).to(wdt)
        return grad_x, grad_w
