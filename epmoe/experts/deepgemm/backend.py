"""`DeepGEMMExperts` ("deepgemm"): the expert stage on DeepGEMM's grouped GEMMs (SM90), the kernels
SGLang and vLLM call on Hopper for DeepSeek-class FP8 models, with our fused Triton passes between them.
Modes fp8_block (W8A8: e4m3 weights with 128x128 fp32 block scales, activations 1x128) and bf16.

Flat layout (dispatchers torch, flashinfer, deepep), DeepGEMM's contiguous grouped GEMMs:

    align   rows of each local expert padded to DeepGEMM's M alignment (`contiguous_layout_rows`: one
            launch up to 1024 entries, else three and a fill); m_indices [P] = expert of each row
            (-1 padding), inv [N*K] = row of each valid entry, written by the pass that places the rows
    gather  a [P, H] = x[token] of every valid (token, slot); fp8: quantized 1x128 once per token (or
            the e4m3 bytes and scales as dispatched), scales written MN-major for DeepGEMM's TMA
    gemm1   h = m_grouped_{fp8,bf16}_gemm_nt_contiguous(a, w13)      [P, R] bf16
    act     act(gate, up) -> e4m3 + 1x128 scales (fp8) or bf16       one pass
    gemm2   y = m_grouped_*_gemm_nt_contiguous(act, w2)              [P, H] bf16
    combine out[n] = sum_k w[n,k] * y[inv[n*K+k]] over valid k, fp32, k order (no atomics)

Masked layout (DeepEP low-latency): `m_grouped_*_gemm_nt_masked` on [E_local, M, .] with the
per-expert counts, the activation pass between them; output [E_local, M, H] unweighted (rows past an
expert's count are unspecified; the dispatcher's combine reads the valid rows only).

No host sync and fixed shapes for a given number of rows (CUDA-graph capturable after one warm-up
call has compiled DeepGEMM's kernels). Weights: w13 [E, R, H] ([gate; up]) and w2 [E, H, I]; fp8
scales [E, R/128, H/128] and [E, H/128, I/128] as DeepSeek-V3 checkpoints ship them (DeepGEMM's SM90
kernels read 128x128 weight scales as stored). Needs H and I multiples of 128, no expert biases.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch

from epmoe.core.availability import Availability
from epmoe.core.capability import BackendRequest
from epmoe.core.errors import BackendUnavailableError
from epmoe.core.streams import capturing
from epmoe.experts.activation import kernel_activation_args
from epmoe.experts.base import Experts, ExpertsOptions, ExpertsSpec
from epmoe.quant.payload import PayloadFormat, QuantizedActivation
from epmoe.quant.weights import ExpertWeights

MODES = ("bf16", "fp8_block")
GROUP = 128  # fp8 block edge, and what H and I must be multiples of
NG = 8  # 128-groups per step of the Triton passes (1024 values)
MASKED_ROWS = 16  # rows per program of the masked-layout passes (a program stops at its expert's count)
# DeepGEMM's masked grouped GEMMs store whole BLOCK_M-row tiles (BLOCK_M 64 or 128, its heuristic's
# choice) at row g * M + m_block * BLOCK_M of the [G * M, N] output, clipped only at the tensor's end:
# with M (rows per expert) not a multiple of BLOCK_M, an expert's last tile overwrites the next
# expert's first rows. So the masked layout runs with M padded to a multiple of this.
MASKED_M_ALIGN = 128
FP8_PAYLOAD = PayloadFormat(name="fp8_block", dtype=torch.float8_e4m3fn, block_size=GROUP,
                            scale_dtype=torch.float32, scale_layout="linear")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def load_deep_gemm():
    """Import DeepGEMM (its import initialises its JIT); ImportError says how to install it."""
    try:
        import deep_gemm
    except ImportError as e:
        raise ImportError(f"deep_gemm cannot be imported ({e}); pip install 'epmoe[deepgemm]' (docs/deepgemm.md)") from e
    return deep_gemm


@dataclass(frozen=True)
class DeepGEMMOptions(ExpertsOptions):
    """expected_m: the masked GEMMs' hint of rows per expert (None: M * top_k / num_experts of the layer).
    exact_rows: flat layout, eager calls of more than 1024 routed entries whose tokens are not
    fixed-shape: read how many rows the per-expert alignment used (one host sync) and run the grouped
    GEMMs on those only. Off, the GEMMs run on the alignment's upper bound, about E / 2 tiles of 128
    rows more under even routing, which DeepGEMM's SM90 bf16 kernel computes in full (its FP8 kernel
    skips their math but still loads their operands)."""

    expected_m: Optional[int] = None
    exact_rows: bool = True

    def __post_init__(self):
        if not isinstance(self.exact_rows, bool):
            raise ValueError(f"option exact_rows={self.exact_rows!r}; use True or False")


class DeepGEMMExperts(Experts):
    """DeepGEMM grouped GEMMs (contiguous for the flat layout, masked for DeepEP low-latency), SM90."""

    name = "deepgemm"
    accepted_layouts = ("flat", "masked")
    Options = DeepGEMMOptions
    fc1_output_rounded = True  # the grouped GEMM writes FC1's output in bf16

    @classmethod
    def supports(cls, request: BackendRequest) -> Availability:
        base = super().supports(request)
        if not base:
            return base
        if request.expert_mode not in MODES:
            return Availability.no(f"it runs {list(MODES)}, not {request.expert_mode!r}",
                                   "use experts 'triton' or 'flashinfer_cutlass' for this mode")
        if request.arch != "sm90":
            return Availability.no(
                f"its kernels are wired up for sm90 (fp32 block scales), not {request.arch}",
                "use experts 'triton' or a FlashInfer backend on this GPU")
        if request.model_dtype != "bfloat16":
            return Availability.no(f"it needs a bfloat16 model, not {request.model_dtype}")
        if request.hidden_size % GROUP or request.intermediate_size % GROUP:
            return Availability.no(
                f"it needs hidden and intermediate sizes divisible by {GROUP}, got "
                f"{request.hidden_size} and {request.intermediate_size}", "use experts 'triton'")
        if request.has_bias:
            return Availability.no("DeepGEMM's GEMMs take no expert biases", "use experts 'triton'")
        if not request.has("deep_gemm"):
            return Availability.no("deep_gemm is not installed", "pip install 'epmoe[deepgemm]' (docs/deepgemm.md)")
        if not request.has("triton"):
            return Availability.no("triton is not installed (the passes between the GEMMs)", "pip install triton")
        return Availability.yes()

    @classmethod
    def consumes(cls, request: BackendRequest) -> str:
        return "fp8" if request.expert_mode == "fp8_block" else "bf16"

    @classmethod
    def availability(cls, spec: ExpertsSpec) -> Availability:
        cfg, mode = spec.config, spec.expert_mode
        if mode not in MODES:
            return Availability.no(f"expert mode {mode!r} is not run by deepgemm (it runs {list(MODES)})",
                                   "use experts 'triton'")
        if cfg.dtype != torch.bfloat16:
            return Availability.no(f"deepgemm needs a bfloat16 model, the model dtype is {cfg.dtype}", "use dtype bf16")
        if cfg.hidden_size % GROUP or cfg.intermediate_size % GROUP:
            return Availability.no(
                f"deepgemm needs H and I divisible by {GROUP}, got H={cfg.hidden_size}, I={cfg.intermediate_size}",
                "use experts 'triton'")
        if cfg.has_bias:
            return Availability.no("deepgemm runs experts without biases; this model's experts have biases",
                                   "use experts 'triton'")
        for pkg, how in (("deep_gemm", "pip install 'epmoe[deepgemm]' (docs/deepgemm.md)"), ("triton", "pip install triton")):
            if importlib.util.find_spec(pkg) is None:
                return Availability.no(f"{pkg} is not installed", how)
        device = torch.device(spec.device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return Availability.no(f"deepgemm needs a CUDA device, got {device}", "run on an sm90 GPU")
        cap = torch.cuda.get_device_capability(device)
        if cap != (9, 0):
            return Availability.no(f"deepgemm is wired up for sm90, this GPU is sm{cap[0]}{cap[1]}",
                                   "use experts 'triton'")
        return Availability.yes(f"sm{cap[0]}{cap[1]}")

    def __init__(self, spec: ExpertsSpec, gemms=None):
        """gemms: the module whose grouped GEMMs run (default: deep_gemm; tests pass a stand-in)."""
        super().__init__(spec)
        if gemms is None:
            avail = self.availability(spec)
            if not avail:
                raise BackendUnavailableError(self.name, avail.reason, avail.hint)
            gemms = load_deep_gemm()
        self.dg = gemms
        # sgl-deep-gemm 0.1.2 names the masked FP8 GEMM only by its fp8_fp4 name; later ones alias it
        self._fp8_masked = (getattr(gemms, "m_grouped_fp8_gemm_nt_masked", None)
                            or getattr(gemms, "m_grouped_fp8_fp4_gemm_nt_masked", None))
        self.mode = spec.expert_mode
        self.fp8 = self.mode == "fp8_block"
        self.device = torch.device(spec.device)
        self.num_experts = spec.num_local_experts
        self.align = int(gemms.get_mk_alignment_for_contiguous_layout())
        self.act_args = kernel_activation_args(self.config)
        self._params: Dict[str, torch.Tensor] = {}
        from epmoe.experts.triton.launch import KernelLauncher

        self._launch_align = KernelLauncher(self.device)  # epmoe.experts.triton.triton_kernels (alignment)
        self._launch = KernelLauncher(self.device, kernels=_kernels)

    @property
    def payload_format(self) -> PayloadFormat:
        plan = self.spec.plan
        if self.fp8 and plan is not None and getattr(plan, "dispatch_dtype", None) == "fp8":
            return FP8_PAYLOAD
        return PayloadFormat.unquantized(self.config.dtype)

    def parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: ExpertWeights) -> None:
        self.commit_weights(self.prepare_weights(weights))

    def prepare_weights(self, weights: ExpertWeights) -> Dict[str, torch.Tensor]:
        """bf16: w13 [E, R, H], w2 [E, H, I] bf16 (a quantized checkpoint dequantized). fp8_block: FP8
        block checkpoints as stored (w13 e4m3 + w13_scale [E, R/128, H/128] fp32, w2 likewise); float
        weights quantized here, a few experts at a time."""
        from epmoe.experts.triton import kernel_formats as kf

        self.check_local_weights(weights)
        dev, cfg, E = self.device, self.config, self.num_experts
        gated = cfg.is_gated
        if not self.fp8:
            if weights.is_quantized:
                weights = kf.dequantize_expert_weights(weights)
            w13 = torch.empty(E, cfg.w13_rows, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
            if weights.w3 is None or not gated:
                w13.copy_(weights.w1)
            else:
                torch.cat([weights.w1.to(dev, torch.bfloat16), weights.w3.to(dev, torch.bfloat16)], dim=1, out=w13)
            new = {"w13": w13, "w2": torch.empty(weights.w2.shape, dtype=torch.bfloat16, device=dev).copy_(weights.w2)}
        elif weights.is_quantized:
            if weights.format != "fp8_block":
                raise ValueError(f"expert weights are {weights.format}; deepgemm fp8_block reads fp8_block (128x128) "
                                 "weights or float weights to quantize at load")
            new = kf.kernel_tensors(weights, gated, dev)
        else:
            chunk = max(1, (1 << 27) // (cfg.w13_rows * cfg.hidden_size))
            parts = []
            for lo in range(0, E, chunk):
                sub = weights.slice_experts(weights.first_expert + lo, weights.first_expert + min(E, lo + chunk)).to(dev)
                parts.append(kf.kernel_tensors(kf.quantize_expert_weights(replace(sub, b13=None, b2=None), "fp8_block"),
                                               gated, dev))
            new = {k: torch.cat([p[k] for p in parts], dim=0).contiguous() for k in parts[0]}
        for name, shape in self._expected_shapes().items():
            if tuple(new[name].shape) != shape:
                raise ValueError(f"converted expert tensor {name!r} has shape {list(new[name].shape)}, expected "
                                 f"{list(shape)} for deepgemm {self.mode}")
            new[name] = new[name].contiguous()
        if self.fp8:
            new["w13_scale"] = new["w13_scale"].to(torch.float32)
            new["w2_scale"] = new["w2_scale"].to(torch.float32)
        return new

    def _expected_shapes(self) -> Dict[str, tuple]:
        E, H, I, R = self.num_experts, self.config.hidden_size, self.config.intermediate_size, self.config.w13_rows
        shapes = {"w13": (E, R, H), "w2": (E, H, I)}
        if self.fp8:
            shapes.update(w13_scale=(E, R // GROUP, H // GROUP), w2_scale=(E, H // GROUP, I // GROUP))
        return shapes

    def commit_weights(self, prepared: Dict[str, torch.Tensor]) -> None:
        if not self._params:
            self._params = prepared
            return
        for name, t in prepared.items():
            old = self._params[name]
            if old.shape != t.shape or old.dtype != t.dtype:
                raise ValueError(f"reloaded {name!r} is {list(t.shape)} {t.dtype}; the loaded one is "
                                 f"{list(old.shape)} {old.dtype}")
        for name, t in prepared.items():
            self._params[name].copy_(t)  # in place: captured CUDA graphs keep valid weights

    def _b(self, name: str):
        p = self._params
        return (p[name], p[name + "_scale"]) if self.fp8 else p[name]

    # ------------------------------------------------------------------ forward
    def forward(self, tokens) -> torch.Tensor:
        if not self._params:
            raise RuntimeError("DeepGEMMExperts.forward before load_weights; load the local experts first")
        layout = getattr(tokens, "layout", "flat")
        if layout == "masked":
            return self._forward_masked(tokens)
        if layout != "flat":
            raise ValueError(f"experts backend 'deepgemm' takes the flat or masked layout, got {layout!r}")
        return self._forward_flat(tokens.hidden, tokens.topk_ids, tokens.topk_weights,
                                  may_sync=not getattr(tokens, "static", False))

    def _check_wire(self, hidden) -> None:
        if isinstance(hidden, QuantizedActivation):
            f = hidden.format
            if not self.fp8 or f.name != "fp8_block" or f.block_size != GROUP:
                raise TypeError(f"experts backend 'deepgemm' in mode {self.mode!r} cannot take a {f.describe()} "
                                f"payload; it consumes {self.payload_format.describe()}")
        elif hidden.dtype != torch.bfloat16:
            raise TypeError(f"hidden has dtype {hidden.dtype}; expected bfloat16")

    def _forward_flat(self, hidden, topk_ids, topk_weights, may_sync: bool = True) -> torch.Tensor:
        from epmoe.experts.triton.align import contiguous_layout_rows

        self._check_wire(hidden)
        cfg, dev = self.config, self.device
        H, I, R, E = cfg.hidden_size, cfg.intermediate_size, cfg.w13_rows, self.num_experts
        N = hidden.shape[0]
        if tuple(hidden.shape) != (N, H):
            raise ValueError(f"hidden is {list(hidden.shape)}; expected [num_tokens, {H}]")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != N or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_ids {list(topk_ids.shape)} / topk_weights {list(topk_weights.shape)} do not "
                             f"match hidden [{N}, {H}]; expected [{N}, top_k] each")
        if N == 0:
            return torch.empty(0, H, dtype=torch.bfloat16, device=dev)
        K = topk_ids.shape[1]
        ids32 = (topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)).contiguous()
        # rows per expert padded to DeepGEMM's alignment (P: an upper bound when `used` is not None),
        # their experts (m_indices) and each entry's row
        P, m_indices, inv, used = contiguous_layout_rows(ids32, E, self.align, self._launch_align)
        if not (may_sync and self.options.exact_rows and not capturing(dev)):
            used = None  # the GEMMs run on the bound
        if used is not None and N * K < self.overlap_rows_read_min_entries:  # the row count first
            P, used = self._finish_rows_read(used), None
            m_indices = m_indices[:P]
        pending = self._start_rows_read(used) if used is not None else None

        # gather (and quantize once per token) into the contiguous layout; while the row count is on its
        # way to the host (pending), into buffers of the bound with the scales' stride read on the GPU
        a = torch.empty(P, H, dtype=torch.float8_e4m3fn if self.fp8 else torch.bfloat16, device=dev)
        G = H // GROUP
        a_s = torch.empty(G * P, dtype=torch.float32, device=dev).view(G, P) if self.fp8 else a  # MN-major scales
        if isinstance(hidden, QuantizedActivation):
            x, xs, quant = hidden.data, hidden.scales.to(torch.float32), 2
        else:
            x, xs, quant = hidden, hidden, (1 if self.fp8 else 0)
        if x.stride(-1) != 1:
            x = x.contiguous()
        xs_strides = (xs.stride(0), xs.stride(1)) if quant == 2 else (0, 0)
        self._launch("dg_gather_kernel", (N,), (x, xs, ids32, inv, a, a_s, H, E, x.stride(0), *xs_strides,
                                                a.stride(0), a_s.stride(0) if self.fp8 else 0,
                                                inv if used is None else used, self.align),
                     dict(TOP_K=K, QUANT=quant, NG=NG, ROWS_FROM_PTR=used is not None and self.fp8, num_warps=4))
        if used is not None:  # the used rows only: a prefix of each buffer, the scales at stride P
            P = self._finish_rows_read(pending)
            a, m_indices = a[:P], m_indices[:P]
            if self.fp8:
                a_s = a_s.view(-1)[: G * P].view(G, P)
        h = torch.empty(P, R, dtype=torch.bfloat16, device=dev)
        self._gemm_contiguous((a, a_s.t()) if self.fp8 else a, self._b("w13"), h, m_indices)
        act, act_s = self._act(h, m_indices, P, masked_rows=None)
        y = torch.empty(P, H, dtype=torch.bfloat16, device=dev)
        self._gemm_contiguous((act, act_s.t()) if self.fp8 else act, self._b("w2"), y, m_indices)

        out = torch.empty(N, H, dtype=torch.bfloat16, device=dev)
        w = topk_weights.to(torch.float32).contiguous()
        self._launch("grouped_combine_kernel", (N, _cdiv(H, 1024)),
                     (y, inv, ids32, w, w, out, H, E, y.stride(0), 0, out.stride(0)),
                     dict(TOP_K=K, HAS_BIAS=False, BLOCK_H=1024, num_warps=4))
        return out

    # exact_rows, from this many routed entries on: the row count's copy to the host overlaps the gather
    # (the scales' stride read on the GPU); below, the count is read right after the alignment and the
    # gather launched after. H200, DeepSeek-V3 expert shape, 2026-12-07 (docs/results/h200-2026-12-07):
    # overlapping took 1.2-3 % off at 4096 and 8192 tokens x top-8 and added 1-4 % at 1024 and 2048.
    overlap_rows_read_min_entries = 32768

    def _start_rows_read(self, used: torch.Tensor):
        """Start copying the layout's used rows ([1] int32 on the device) to the host (CPU: itself)."""
        if used.device.type != "cuda":
            return used
        if getattr(self, "_rows_host", None) is None:
            self._rows_host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self._rows_event = torch.cuda.Event()
        self._rows_host.copy_(used, non_blocking=True)
        self._rows_event.record()
        return self._rows_host

    def _finish_rows_read(self, pending) -> int:
        """The used rows (at least one tile) once their copy has landed (the device tensor itself:
        read now, waiting for the GPU)."""
        if pending is getattr(self, "_rows_host", None):  # the pinned copy _start_rows_read began
            self._rows_event.synchronize()
        return max(int(pending[0]), self.align)

    def _gemm_contiguous(self, a, b, d, m_indices) -> None:
        if self.fp8:
            self.dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, disable_ue8m0_cast=True)
        else:
            self.dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)

    def _act(self, h, valid, rows: int, masked_rows: Optional[int]):
        """act(h) of the valid rows -> (bf16 [rows, I], None) or (e4m3 [rows, I], scales): flat, scales
        [I/128, rows] (MN-major); masked (rows = G * M, masked_rows = M), scales [G, I/128, Mt]."""
        cfg, dev = self.config, self.device
        I = cfg.intermediate_size
        ACT, HAS_LIMIT, alpha, beta, limit = self.act_args
        a = torch.empty(rows, I, dtype=torch.float8_e4m3fn if self.fp8 else torch.bfloat16, device=dev)
        M = masked_rows or 1
        if self.fp8 and masked_rows is not None:
            G, Mt = rows // M, _cdiv(M, 4) * 4  # TMA: 16-byte aligned scale columns
            s = torch.empty(G, I // GROUP, Mt, dtype=torch.float32, device=dev)
            s_strides = (s.stride(0), s.stride(1))
        elif self.fp8:
            s = torch.empty(I // GROUP, rows, dtype=torch.float32, device=dev)
            s_strides = (0, s.stride(0))
        else:
            s, s_strides = a, (0, 0)
        h2 = h.view(rows, h.shape[-1])
        cols = _cdiv(I, NG * GROUP)
        grid = (rows, cols) if masked_rows is None else (rows // M, _cdiv(M, MASKED_ROWS), cols)
        self._launch("dg_act_kernel", grid,
                     (h2, valid, a, s, I, M, h2.stride(0), a.stride(0), *s_strides, alpha, beta, limit),
                     dict(ACT=ACT, HAS_LIMIT=HAS_LIMIT, GATED=cfg.is_gated, MASKED=masked_rows is not None,
                          QUANT=self.fp8, NG=NG, ROWS=MASKED_ROWS, num_warps=4))
        return a, (s if self.fp8 else None)

    def _forward_masked(self, tokens) -> torch.Tensor:
        hidden, counts = tokens.hidden, tokens.expert_counts
        self._check_wire(hidden)
        cfg, dev = self.config, self.device
        E, H, I, R = self.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.w13_rows
        data = hidden.data if isinstance(hidden, QuantizedActivation) else hidden
        if data.dim() != 3 or data.shape[0] != E or data.shape[2] != H:
            raise ValueError(f"masked hidden has shape {list(data.shape)}; expected [{E}, max_rows, {H}]")
        if counts is None or tuple(counts.shape) != (E,):
            got = None if counts is None else list(counts.shape)
            raise ValueError(f"expert_counts has shape {got}; expected [{E}] (valid rows per local expert)")
        M_in = data.shape[1]
        if M_in % MASKED_M_ALIGN:  # pad the rows per expert (see MASKED_M_ALIGN): one copy of the tokens
            hidden = self._pad_masked(hidden, _cdiv(M_in, MASKED_M_ALIGN) * MASKED_M_ALIGN)
            data = hidden.data if isinstance(hidden, QuantizedActivation) else hidden
        M = data.shape[1]
        counts = counts if counts.dtype == torch.int32 else counts.to(torch.int32)
        expected_m = self.options.expected_m or max(1, min(M_in, _cdiv(M_in * cfg.top_k, cfg.num_experts)))
        if isinstance(hidden, QuantizedActivation):
            a = (hidden.data, hidden.scales.to(torch.float32))
        elif self.fp8:
            Mt = _cdiv(M, 4) * 4
            q = torch.empty(E, M, H, dtype=torch.float8_e4m3fn, device=dev)
            s = torch.empty(E, H // GROUP, Mt, dtype=torch.float32, device=dev)
            x = hidden.reshape(E * M, H)
            if x.stride(-1) != 1:
                x = x.contiguous()
            self._launch("dg_quant_masked_kernel", (E, _cdiv(M, MASKED_ROWS), _cdiv(H, NG * GROUP)),
                         (x, counts, q, s, H, M, x.stride(0), H, s.stride(0), s.stride(1)),
                         dict(NG=NG, ROWS=MASKED_ROWS, num_warps=4))
            a = (q, s[:, :, :M].transpose(1, 2))
        else:
            a = hidden.contiguous()
        h = torch.empty(E, M, R, dtype=torch.bfloat16, device=dev)
        self._gemm_masked(a, self._b("w13"), h, counts, expected_m)
        act, act_s = self._act(h, counts, E * M, masked_rows=M)
        act = act.view(E, M, I)
        y = torch.empty(E, M, H, dtype=torch.bfloat16, device=dev)
        self._gemm_masked((act, act_s[:, :, :M].transpose(1, 2)) if self.fp8 else act, self._b("w2"), y, counts,
                          expected_m)
        return y if M == M_in else y[:, :M_in]

    @staticmethod
    def _pad_masked(hidden, Mp: int):
        """Masked tokens [E, M, H] (bf16, or e4m3 + [E, M, H/128] scales of any strides) -> the same in
        [E, Mp, H], rows M.. unset (no valid row reads them; their outputs are discarded)."""
        if isinstance(hidden, QuantizedActivation):
            E, M, H = hidden.data.shape
            q = torch.empty(E, Mp, H, dtype=hidden.data.dtype, device=hidden.data.device)
            q[:, :M].copy_(hidden.data)
            G = hidden.scales.shape[-1]
            s = torch.empty(E, G, Mp, dtype=torch.float32, device=hidden.scales.device)  # MN-major, as DeepEP's
            s[:, :, :M].copy_(hidden.scales.transpose(1, 2))
            return QuantizedActivation(format=hidden.format, data=q, scales=s.transpose(1, 2),
                                       hidden_size=hidden.hidden_size)
        E, M, H = hidden.shape
        x = torch.empty(E, Mp, H, dtype=hidden.dtype, device=hidden.device)
        x[:, :M].copy_(hidden)
        return x

    def _gemm_masked(self, a, b, d, counts, expected_m: int) -> None:
        if self.fp8:
            if self._fp8_masked is None:
                raise RuntimeError("this deep_gemm has no masked FP8 grouped GEMM (m_grouped_fp8_gemm_nt_masked); "
                                   "install sgl-deep-gemm >= 0.1.2 (docs/deepgemm.md)")
            self._fp8_masked(a, b, d, counts, expected_m, disable_ue8m0_cast=True)
        else:
            self.dg.m_grouped_bf16_gemm_nt_masked(a, b, d, counts, expected_m)


def _kernels():
    from epmoe.experts.deepgemm import kernels

    return kernels
