"""Synthetic checkpoints in real formats: config.json + model.safetensors with HF tensor names, written
by one process per node and read back by every rank through the real loader (`EPMoE.load_weights`).

Formats (`--checkpoint-format`, `epmoe.quant.checkpoint_formats.CHECKPOINT_FORMATS`):
    bf16              unquantized, in the model dtype; naming by model type (Mixtral w1/w3/w2, HF
                      gate_proj/up_proj/down_proj, GPT-OSS stacked gate_up_proj)
    fp8               DeepSeek-V3 / Qwen3-FP8: float8_e4m3fn weight + float32 weight_scale_inv (128x128)
    nvfp4-modelopt    ModelOpt NVFP4: weight, weight_scale, weight_scale_2, input_scale (+ hf_quant_config.json)
    nvfp4-compressed  llm-compressor NVFP4: weight_packed, weight_scale, weight_global_scale, input_global_scale
    mxfp4-gpt-oss     GPT-OSS as released: experts.{gate_up,down}_proj_{blocks,scales} (+ biases)

The writer streams: one expert of one layer is generated, quantized and written at its offset in the
file (the safetensors header is computed first), so memory stays at one expert whatever the model size.
The float64 reference for `--check` is built by reading the checkpoint back (`reference_layers`);
`reference_moe` dequantizes it, so it checks the same bytes the layers loaded.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from epmoe.checkpoint import load_expert_weights
from epmoe.config import MoEConfig, dtype_name
from epmoe.launch.presets import CHECKPOINT_STYLE
from epmoe.quant import checkpoint_formats as ckf
from epmoe.quant.weights import ExpertWeights

CHECKPOINT_FILE = "model.safetensors"


@dataclass(frozen=True)
class SyntheticLayer:
    """Global tensors of one layer (the reference for --check: the checkpoint's experts as loaded,
    quantized ones included; `reference_moe` dequantizes them)."""

    experts: ExpertWeights
    gate: torch.Tensor  # [E, H] router weight
    e_score_correction_bias: Optional[torch.Tensor]


def layer_prefix(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.mlp."


def make_layer(config: MoEConfig, seed: int, layer_idx: int) -> SyntheticLayer:
    """A whole layer of random global weights in memory (for in-memory runs such as benchmarks/soak.py;
    checkpoints on disk are written expert by expert by `write_checkpoint`)."""
    g = torch.Generator().manual_seed(seed * 1000 + layer_idx)
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(config.dtype)

    experts = ExpertWeights(
        w1=rnd(E, I, H, scale=H ** -0.5),
        w3=rnd(E, I, H, scale=H ** -0.5) if config.is_gated else None,
        w2=rnd(E, H, I, scale=I ** -0.5),
        b13=rnd(E, config.w13_rows, scale=0.05) if config.has_bias else None,
        b2=rnd(E, H, scale=0.05) if config.has_bias else None,
    )
    gate = rnd(E, H, scale=H ** -0.5)
    corr = torch.randn(E, generator=g) * 0.05 if config.routing == "sigmoid_grouped" else None
    return SyntheticLayer(experts=experts, gate=gate, e_score_correction_bias=corr)


# ----------------------------------------------------------------------------- streaming safetensors
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
}


class StreamingSafetensorsWriter:
    """Writes a safetensors file whose tensors are declared up front (name, dtype, shape) and whose
    bytes arrive later, whole or one leading-dim row at a time, in any order. Written to a temporary
    name and renamed on `close`, so readers never see a partial file."""

    def __init__(self, path: str, entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]], metadata: Dict[str, str]):
        self.path = path
        self._tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}")
        header: Dict[str, object] = {"__metadata__": dict(metadata)}
        self._where: Dict[str, Tuple[int, int, torch.dtype, Tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._where[name] = (offset, nbytes, dtype, tuple(shape))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._base = 8 + len(raw)
        self._written = {name: 0 for name in self._where}
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._base + offset)

    def write(self, name: str, tensor: torch.Tensor, row: Optional[int] = None) -> None:
        """The whole tensor (`row` None), or row `row` of its leading dimension."""
        offset, nbytes, dtype, shape = self._where[name]
        want = shape if row is None else shape[1:]
        if tensor.dtype != dtype or tuple(tensor.shape) != want:
            raise ValueError(f"{name}: got {list(tensor.shape)} {tensor.dtype}, declared {list(want)} {dtype}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        at = offset if row is None else offset + row * len(data)
        self._f.seek(self._base + at)
        self._f.write(data)
        self._written[name] += len(data)

    def close(self) -> None:
        self._f.close()
        short = [n for n, (_, nbytes, _, _) in self._where.items() if self._written[n] != nbytes]
        if short:
            os.unlink(self._tmp)
            raise RuntimeError(f"synthetic checkpoint writer: tensors {short[:4]} were not written completely")
        os.replace(self._tmp, self.path)


# ----------------------------------------------------------------------------- one expert
def _expert_float(config: MoEConfig, seed: int, layer_idx: int, e: int) -> ExpertWeights:
    """Random float weights of one expert (scaled so activations stay O(1) through a stack of layers)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer_idx) * 100_003 + e)
    H, I = config.hidden_size, config.intermediate_size

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(config.dtype)

    return ExpertWeights(
        w1=rnd(1, I, H, scale=H ** -0.5),
        w3=rnd(1, I, H, scale=H ** -0.5) if config.is_gated else None,
        w2=rnd(1, H, I, scale=I ** -0.5),
        b13=rnd(1, config.w13_rows, scale=0.05) if config.has_bias else None,
        b2=rnd(1, H, scale=0.05) if config.has_bias else None,
        first_expert=e,
    )


def _proj_names(config: MoEConfig, style: str) -> Dict[str, str]:
    if style == "mixtral":
        return {"w1": "w1", "w3": "w3", "w2": "w2"}
    return {"w1": "gate_proj" if config.is_gated else "up_proj", "w3": "up_proj", "w2": "down_proj"}


def _quantized_projection(fmt: str, w: torch.Tensor, role: str, e: int) -> Dict[str, torch.Tensor]:
    """One projection [out, in] -> its stored tensors (suffix -> tensor), the way its producer writes them."""
    if fmt == "fp8":
        from epmoe.experts.triton.kernel_formats import quantize_fp8_block

        q, s = quantize_fp8_block(w)
        return ckf.canonical_to_projection(fmt, q, s, None, None)
    if fmt in ("nvfp4-modelopt", "nvfp4-compressed"):
        from epmoe.quant import nvfp4

        gs = nvfp4.compute_global_scale(w)  # 448 * 6 / amax: the quantization multiplier
        t = nvfp4.quantize(w, gs)
        # a calibrated activation amax per expert (gate and up see the same input)
        amax = (4.0 if role != "w2" else 2.0) * (1.0 + 0.125 * (e % 4))
        if fmt == "nvfp4-modelopt":  # dequantization factors amax / (448 * 6)
            return ckf.canonical_to_projection(fmt, t.packed, t.scales, 1.0 / gs,
                                               torch.tensor(amax / nvfp4.GLOBAL_AMAX, dtype=torch.float32, device=w.device))
        # llm-compressor: quantization multipliers 448 * 6 / amax, stored as [1]
        return {"weight_packed": t.packed, "weight_scale": t.scales, "weight_global_scale": gs.reshape(1).float(),
                "input_global_scale": torch.tensor([nvfp4.GLOBAL_AMAX / amax], dtype=torch.float32, device=w.device)}
    raise ValueError(fmt)


def _gpt_oss_biases(config: MoEConfig, prefix: str, w: ExpertWeights, rows: Dict[str, torch.Tensor]) -> None:
    """GPT-OSS bias rows of one expert: gate/up interleaved (2j gate, 2j+1 up), as the checkpoint has them."""
    if not config.has_bias:
        return
    bg, bu = w.b13[0].chunk(2)
    gub = torch.empty(2 * config.intermediate_size, dtype=config.dtype, device=w.w1.device)
    gub[0::2], gub[1::2] = bg, bu
    rows[f"{prefix}experts.gate_up_proj_bias"] = gub
    rows[f"{prefix}experts.down_proj_bias"] = w.b2[0]


def _expert_tensors(config: MoEConfig, fmt: str, style: str, prefix: str, w: ExpertWeights, e: int
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(per-expert tensors by full name, rows of stacked tensors by name) of expert e."""
    per: Dict[str, torch.Tensor] = {}
    rows: Dict[str, torch.Tensor] = {}
    I = config.intermediate_size
    if fmt == "mxfp4-gpt-oss":
        from epmoe.quant import mxfp4

        gu = torch.empty(2 * I, config.hidden_size, dtype=torch.float32, device=w.w1.device)
        gu[0::2], gu[1::2] = w.w1[0].float(), w.w3[0].float()  # interleaved rows: 2j gate, 2j+1 up
        for name, mat in (("gate_up_proj", gu), ("down_proj", w.w2[0].float())):
            t = mxfp4.quantize(mat)
            rows[f"{prefix}experts.{name}_blocks"] = t.packed.reshape(mat.shape[0], -1, 16)
            rows[f"{prefix}experts.{name}_scales"] = t.scales
        _gpt_oss_biases(config, prefix, w, rows)
        return per, rows
    if fmt == "bf16" and style == "gpt_oss":
        gu = torch.empty(config.hidden_size, 2 * I, dtype=config.dtype, device=w.w1.device)
        gu[:, 0::2], gu[:, 1::2] = w.w1[0].t(), w.w3[0].t()
        rows[f"{prefix}experts.gate_up_proj"] = gu
        rows[f"{prefix}experts.down_proj"] = w.w2[0].t().contiguous()
        _gpt_oss_biases(config, prefix, w, rows)
        return per, rows
    names = _proj_names(config, style)
    roles = ("w1", "w3", "w2") if config.is_gated else ("w1", "w2")
    biases = {}
    if config.has_bias:
        b1, b3 = w.b13[0].chunk(2) if config.is_gated else (w.b13[0], None)
        biases = {"w1": b1, "w3": b3, "w2": w.b2[0]}
    for role in roles:
        base = f"{prefix}experts.{e}.{names[role]}."
        mat = getattr(w, role)[0]
        parts = {"weight": mat.contiguous()} if fmt == "bf16" else _quantized_projection(fmt, mat, role, e)
        for suffix, t in parts.items():
            per[base + suffix] = t.contiguous()
        if role in biases:
            per[base + "bias"] = biases[role].contiguous()
    return per, rows


# ----------------------------------------------------------------------------- the checkpoint
def checkpoint_config(config: MoEConfig, checkpoint_format: str) -> MoEConfig:
    """The config the layers load a synthetic checkpoint of `checkpoint_format` with (its quant_method)."""
    if checkpoint_format not in ckf.CHECKPOINT_FORMATS:
        raise ValueError(f"--checkpoint-format {checkpoint_format!r}; use one of {ckf.CHECKPOINT_FORMATS}")
    return config.replace(quant_method=ckf.QUANT_METHOD_OF_FORMAT[checkpoint_format])


def check_format_fits(config: MoEConfig, checkpoint_format: str) -> None:
    """ValueError when the model shape cannot be stored in `checkpoint_format`."""
    H, I = config.hidden_size, config.intermediate_size
    need = {"nvfp4-modelopt": 16, "nvfp4-compressed": 16, "mxfp4-gpt-oss": 32}.get(checkpoint_format)
    if need and (H % need or I % need):
        raise ValueError(
            f"--checkpoint-format {checkpoint_format} needs hidden_size ({H}) and intermediate_size ({I}) to be "
            f"multiples of {need}"
        )
    if checkpoint_format == "mxfp4-gpt-oss" and not config.is_gated:
        raise ValueError("--checkpoint-format mxfp4-gpt-oss stores interleaved gate/up: it needs a gated (swiglu) model")


def write_checkpoint(directory: str, config: MoEConfig, hf_config: dict, num_layers: int, seed: int,
                     checkpoint_format: str = "bf16", device: Optional[torch.device] = None) -> str:
    """Write config.json (with the format's quantization_config) and model.safetensors for `num_layers`
    layers, streaming one expert at a time. Returns the safetensors path.

    device: where each expert is quantized (the reference codecs give the same bytes on CPU and GPU;
    a GPU is much faster for NVFP4 / MXFP4). Weights are drawn on the CPU either way."""
    check_format_fits(config, checkpoint_format)
    os.makedirs(directory, exist_ok=True)
    style = CHECKPOINT_STYLE.get(config.model_type, "hf")
    E = config.num_experts

    # Declare every tensor first (shapes from expert 0 of layer 0; every expert has the same shapes).
    probe = _expert_float(config, seed, 0, 0)
    per0, rows0 = _expert_tensors(config, checkpoint_format, style, "{p}", probe, 0)
    entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    for L in range(num_layers):
        p = layer_prefix(L)
        for e in range(E):
            for name, t in per0.items():
                entries.append((name.replace("{p}", p).replace("experts.0.", f"experts.{e}.", 1), t.dtype, tuple(t.shape)))
        for name, t in rows0.items():
            entries.append((name.replace("{p}", p), t.dtype, (E, *t.shape)))
        entries.append((f"{p}gate.weight", config.dtype, (E, config.hidden_size)))
        if config.routing == "sigmoid_grouped":
            entries.append((f"{p}gate.e_score_correction_bias", torch.float32, (E,)))
    path = os.path.join(directory, CHECKPOINT_FILE)
    writer = StreamingSafetensorsWriter(
        path, entries, {"format": "pt", "epmoe_synthetic_seed": str(seed), "epmoe_checkpoint_format": checkpoint_format}
    )
    try:
        for L in range(num_layers):
            p = layer_prefix(L)
            for e in range(E):
                w = _expert_float(config, seed, L, e)
                if device is not None:
                    w = w.to(device)
                per, rows = _expert_tensors(config, checkpoint_format, style, p, w, e)
                for name, t in per.items():
                    writer.write(name, t.cpu())
                for name, t in rows.items():
                    writer.write(name, t.cpu(), row=e)
            g = torch.Generator().manual_seed(seed * 1000 + L)
            writer.write(f"{p}gate.weight", (torch.randn(E, config.hidden_size, generator=g)
                                              * config.hidden_size ** -0.5).to(config.dtype))
            if config.routing == "sigmoid_grouped":
                writer.write(f"{p}gate.e_score_correction_bias", torch.randn(E, generator=g) * 0.05)
    finally:
        writer.close()
    cfg = dict(hf_config)
    cfg.update(num_hidden_layers=num_layers, torch_dtype=dtype_name(config.dtype))
    qc = ckf.QUANTIZATION_CONFIGS[checkpoint_format]
    if qc is None:
        cfg.pop("quantization_config", None)  # the synthetic weights are unquantized
    else:
        cfg["quantization_config"] = qc
    _write_json(os.path.join(directory, "config.json"), cfg)
    if checkpoint_format == "nvfp4-modelopt":  # ModelOpt also writes its own quantization file
        _write_json(os.path.join(directory, "hf_quant_config.json"), {
            "producer": {"name": "modelopt", "version": "synthetic"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": ["lm_head"]},
        })
    return path


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def reference_layers(directory: str, config: MoEConfig, num_layers: int) -> Dict[int, SyntheticLayer]:
    """Every layer's global experts read back through the loader (quantized ones as stored), with the
    router: what `--check` compares with. `reference_moe` dequantizes quantized experts to float64, so
    the reference uses the same bytes the layers loaded (with `plan=`, it also models the plan's
    activation and wire quantization on top of those exact weights)."""
    out = {}
    for L in range(num_layers):
        loaded = load_expert_weights(directory, config, layer_idx=L)
        out[L] = SyntheticLayer(experts=loaded.experts, gate=read_gate(directory, L),
                                e_score_correction_bias=loaded.e_score_correction_bias)
    return out


def read_gate(directory: str, layer_idx: int) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(os.path.join(directory, CHECKPOINT_FILE), framework="pt") as h:
        return h.get_tensor(f"{layer_prefix(layer_idx)}gate.weight")
