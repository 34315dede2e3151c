"""Checkpoint loading: expert tensors from HF-named dicts / safetensors, or the canonical stacked form,
into `ExpertWeights` (only the requested expert range is read from disk).

Recognised names (any prefix such as `model.layers.3.mlp.`):
  per expert   experts.{e}.{w1|gate_proj}.weight [I, H]   (gate; for relu2 configs also `up_proj`)
               experts.{e}.{w3|up_proj}.weight   [I, H]   (up, gated configs)
               experts.{e}.{w2|down_proj}.weight [H, I]   (+ matching `.bias` tensors)
  GPT-OSS      experts.gate_up_proj [E, H, 2I] (gate/up interleaved on the last dim),
               experts.gate_up_proj_bias [E, 2I], experts.down_proj [E, I, H], experts.down_proj_bias [E, H]
  canonical    w1 [E, I, H], w3 [E, I, H], w2 [E, H, I], optional w13 [E, 2I, H], b13, b2 (no prefix)
  routing      *gate.e_score_correction_bias [E] (DeepSeek-V3), or canonical `e_score_correction_bias`
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from epmoe.config import MoEConfig
from epmoe.quant.weights import ExpertWeights

Source = Union[str, os.PathLike, Mapping[str, torch.Tensor]]

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*?)experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)$"
)
_STACKED = re.compile(
    r"^(?P<prefix>.*?)experts\.(?P<name>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$"
)
_CORRECTION = re.compile(r"^(?P<prefix>.*?)(gate\.)?e_score_correction_bias$")
_CANONICAL = ("w1", "w2", "w3", "w13", "b13", "b2", "e_score_correction_bias")


class CheckpointReadError(OSError):
    """A checkpoint file could not be read (corrupt, truncated, unreadable); names the file."""


@dataclass(frozen=True)
class LoadedExperts:
    """experts: ExpertWeights of global experts [first_expert, first_expert + n);
    e_score_correction_bias: [E] float32 or None."""

    experts: ExpertWeights
    e_score_correction_bias: Optional[torch.Tensor]


class _Reader:
    """Uniform access to a dict or to safetensors files, reading tensors lazily (and slices of them)."""

    def __init__(self, source: Source):
        self._dict: Optional[Mapping[str, torch.Tensor]] = None
        self._files: Dict[str, str] = {}
        if isinstance(source, Mapping):
            self._dict = source
            return
        path = os.fspath(source)
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise ValueError(f"no *.safetensors files in directory {path!r}")
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ValueError(f"weights path {path!r} does not exist; pass a safetensors file, a directory or a dict")
        from safetensors import safe_open

        for f in files:
            try:
                with safe_open(f, framework="pt") as h:
                    for k in h.keys():
                        self._files[k] = f
            except Exception as e:  # noqa: BLE001 - SafetensorError and friends: name the file
                raise CheckpointReadError(f"cannot read {f}: {type(e).__name__}: {e}") from e

    def keys(self) -> Iterable[str]:
        return self._dict.keys() if self._dict is not None else self._files.keys()

    def get(self, key: str, rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        if self._dict is not None:
            t = self._dict[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weights[{key!r}] is a {type(t).__name__}; expected a torch.Tensor")
            return t if rows is None else t[rows[0] : rows[1]]
        from safetensors import safe_open

        try:
            with safe_open(self._files[key], framework="pt") as h:
                if rows is None:
                    return h.get_tensor(key)
                return h.get_slice(key)[rows[0] : rows[1]]
        except Exception as e:  # noqa: BLE001 - name the file and the tensor
            raise CheckpointReadError(f"cannot read {key!r} from {self._files[key]}: {type(e).__name__}: {e}") from e


def _choose_prefix(prefixes: List[str], prefix: Optional[str], layer_idx: Optional[int]) -> str:
    found = sorted(set(prefixes))
    if prefix is not None:
        if prefix not in found:
            raise ValueError(f"no expert tensors under prefix {prefix!r}; found prefixes {found}")
        return prefix
    if layer_idx is not None:
        hits = [p for p in found if re.search(rf"(^|\.)layers\.{layer_idx}\.", p)]
        if len(hits) != 1:
            raise ValueError(f"layer_idx={layer_idx} matches prefixes {hits} among {found}; pass prefix=")
        return hits[0]
    if len(found) > 1:
        raise ValueError(
            f"the weights hold experts of several layers {found}; pass layer_idx= or prefix= to choose one"
        )
    return found[0]


def load_expert_weights(
    source: Source,
    config: MoEConfig,
    *,
    experts: Optional[Tuple[int, int]] = None,
    prefix: Optional[str] = None,
    layer_idx: Optional[int] = None,
) -> LoadedExperts:
    """Read global experts `experts=(start, end)` (default: all) of one layer from `source`.

    Raises ValueError naming the missing/misshaped tensor and the fix."""
    E = config.num_experts
    lo, hi = experts if experts is not None else (0, E)
    if not (0 <= lo < hi <= E):
        raise ValueError(f"expert range [{lo}, {hi}) is outside [0, {E})")
    reader = _Reader(source)
    keys = list(reader.keys())

    canonical = [k for k in keys if k in _CANONICAL]
    per_expert: Dict[str, Dict[Tuple[int, str, str], str]] = {}
    stacked: Dict[str, Dict[str, str]] = {}
    correction: Dict[str, str] = {}
    for k in keys:
        m = _PER_EXPERT.match(k)
        if m:
            per_expert.setdefault(m["prefix"], {})[(int(m["e"]), m["proj"], m["kind"])] = k
            continue
        m = _STACKED.match(k)
        if m:
            stacked.setdefault(m["prefix"], {})[m["name"]] = k
            continue
        m = _CORRECTION.match(k)
        if m and k != "e_score_correction_bias":
            correction[m["prefix"]] = k

    if canonical and not per_expert and not stacked:
        loaded = _load_canonical(reader, canonical, config, lo, hi)
        corr = reader.get("e_score_correction_bias") if "e_score_correction_bias" in canonical else None
    elif per_expert or stacked:
        p = _choose_prefix(list(per_expert) + list(stacked), prefix, layer_idx)
        if p in per_expert:
            loaded = _load_per_expert(reader, per_expert[p], config, lo, hi, p)
        else:
            loaded = _load_gpt_oss(reader, stacked[p], config, lo, hi, p)
        ck = correction.get(p)
        if ck is None:  # the router gate usually sits beside `experts.` under the same prefix
            ck = next((v for q, v in correction.items() if q == p or q.startswith(p)), None)
        corr = reader.get(ck) if ck is not None else None
    else:
        raise ValueError(
            "no expert tensors found: expected HF names like '...experts.0.gate_proj.weight', GPT-OSS "
            "'...experts.gate_up_proj', or canonical keys w1/w2/w3 (got keys "
            f"{sorted(keys)[:8]}{' ...' if len(keys) > 8 else ''})"
        )
    if corr is not None:
        if tuple(corr.shape) != (E,):
            raise ValueError(f"e_score_correction_bias has shape {list(corr.shape)}; expected [{E}]")
        corr = corr.float()
    if config.routing == "sigmoid_grouped" and corr is None:
        pass  # allowed: DeepSeek-V2 style grouped routing without correction bias
    loaded.validate(config, hi - lo)
    return LoadedExperts(experts=loaded, e_score_correction_bias=corr)


def _load_canonical(reader: _Reader, keys: List[str], config: MoEConfig, lo: int, hi: int) -> ExpertWeights:
    get: Callable[[str], Optional[torch.Tensor]] = lambda k: reader.get(k, (lo, hi)) if k in keys else None
    w1, w3 = get("w1"), get("w3")
    w13 = get("w13")
    if w13 is not None:
        if w1 is not None:
            raise ValueError("weights give both 'w13' and 'w1'; pass one form")
        if config.is_gated:
            w1, w3 = w13.chunk(2, dim=1)
        else:
            w1 = w13
    if w1 is None:
        raise ValueError("canonical weights need 'w1' [E, I, H] (or 'w13' [E, 2I, H]) and 'w2' [E, H, I]")
    if "w2" not in keys:
        raise ValueError("canonical weights lack 'w2' [E, H, I]")
    return ExpertWeights(w1=w1, w2=get("w2"), w3=w3, b13=get("b13"), b2=get("b2"), first_expert=lo)


def _load_per_expert(
    reader: _Reader, names: Dict[Tuple[int, str, str], str], config: MoEConfig, lo: int, hi: int, prefix: str
) -> ExpertWeights:
    if config.is_gated:
        roles = {"w1": ("w1", "gate_proj"), "w3": ("w3", "up_proj"), "w2": ("w2", "down_proj")}
    else:  # non-gated (relu2): the single first projection is called up_proj (Nemotron) or w1
        roles = {"w1": ("w1", "up_proj", "gate_proj"), "w2": ("w2", "down_proj")}

    def one(e: int, role: str, kind: str) -> Optional[torch.Tensor]:
        for proj in roles[role]:
            k = names.get((e, proj, kind))
            if k is not None:
                return reader.get(k)
        if kind == "bias" and not config.has_bias:
            return None
        raise ValueError(
            f"expert {e} lacks its {role} {kind} (looked for "
            f"{[f'{prefix}experts.{e}.{p}.{kind}' for p in roles[role]]}); the checkpoint is incomplete "
            "or the config's activation/has_bias does not match it"
        )

    out: Dict[str, Optional[torch.Tensor]] = {}
    for role in roles:
        out[role] = torch.stack([one(e, role, "weight") for e in range(lo, hi)])
    if config.has_bias:
        b = {role: torch.stack([one(e, role, "bias") for e in range(lo, hi)]) for role in roles}
        out["b13"] = torch.cat([b["w1"], b["w3"]], dim=1) if config.is_gated else b["w1"]
        out["b2"] = b["w2"]
    return ExpertWeights(
        w1=out["w1"], w2=out["w2"], w3=out.get("w3"), b13=out.get("b13"), b2=out.get("b2"), first_expert=lo
    )


def _load_gpt_oss(
    reader: _Reader, names: Dict[str, str], config: MoEConfig, lo: int, hi: int, prefix: str
) -> ExpertWeights:
    for need in ("gate_up_proj", "down_proj"):
        if need not in names:
            raise ValueError(f"GPT-OSS style weights lack '{prefix}experts.{need}'")
    gu = reader.get(names["gate_up_proj"], (lo, hi))  # [e, H, 2I] interleaved g0,u0,g1,u1,...
    w1 = gu[..., 0::2].transpose(1, 2).contiguous()
    w3 = gu[..., 1::2].transpose(1, 2).contiguous()
    w2 = reader.get(names["down_proj"], (lo, hi)).transpose(1, 2).contiguous()  # [e, I, H] -> [e, H, I]
    b13 = b2 = None
    if "gate_up_proj_bias" in names:
        gub = reader.get(names["gate_up_proj_bias"], (lo, hi))
        b13 = torch.cat([gub[..., 0::2], gub[..., 1::2]], dim=-1)
    if "down_proj_bias" in names:
        b2 = reader.get(names["down_proj_bias"], (lo, hi))
    return ExpertWeights(w1=w1, w2=w2, w3=w3, b13=b13, b2=b2, first_expert=lo)


def hf_expert_tensors(
    config: MoEConfig, weights: ExpertWeights, prefix: str, style: str,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> Dict[str, torch.Tensor]:
    """The inverse of loading: canonical weights -> HF-named tensors, for writing checkpoints.

    style: "mixtral" (w1/w3/w2), "hf" (gate_proj/up_proj/down_proj; relu2: up_proj/down_proj),
           "gpt_oss" (stacked interleaved gate_up_proj)."""
    out: Dict[str, torch.Tensor] = {}
    n = weights.num_experts
    if style == "gpt_oss":
        if not config.is_gated:
            raise ValueError("GPT-OSS style needs a gated (swiglu) config")
        gu = torch.empty(n, config.hidden_size, 2 * config.intermediate_size, dtype=weights.w1.dtype)
        gu[..., 0::2] = weights.w1.transpose(1, 2)
        gu[..., 1::2] = weights.w3.transpose(1, 2)
        out[f"{prefix}experts.gate_up_proj"] = gu
        out[f"{prefix}experts.down_proj"] = weights.w2.transpose(1, 2).contiguous()
        if weights.b13 is not None:
            bg, bu = weights.b13.chunk(2, dim=-1)
            gub = torch.empty(n, 2 * config.intermediate_size, dtype=weights.b13.dtype)
            gub[:, 0::2], gub[:, 1::2] = bg, bu
            out[f"{prefix}experts.gate_up_proj_bias"] = gub
            out[f"{prefix}experts.down_proj_bias"] = weights.b2.contiguous()
    else:
        if style == "mixtral":
            names = {"w1": "w1", "w3": "w3", "w2": "w2"}
        elif style == "hf":
            names = {"w1": "gate_proj" if config.is_gated else "up_proj", "w3": "up_proj", "w2": "down_proj"}
        else:
            raise ValueError(f"unknown checkpoint style {style!r}; use 'mixtral', 'hf' or 'gpt_oss'")
        b1 = b3 = None
        if weights.b13 is not None:
            b1, b3 = weights.b13.chunk(2, dim=-1) if config.is_gated else (weights.b13, None)
        for i in range(n):
            e = weights.first_expert + i
            out[f"{prefix}experts.{e}.{names['w1']}.weight"] = weights.w1[i].contiguous()
            out[f"{prefix}experts.{e}.{names['w2']}.weight"] = weights.w2[i].contiguous()
            if config.is_gated:
                out[f"{prefix}experts.{e}.{names['w3']}.weight"] = weights.w3[i].contiguous()
            if b1 is not None:
                out[f"{prefix}experts.{e}.{names['w1']}.bias"] = b1[i].contiguous()
                out[f"{prefix}experts.{e}.{names['w2']}.bias"] = weights.b2[i].contiguous()
                if config.is_gated:
                    out[f"{prefix}experts.{e}.{names['w3']}.bias"] = b3[i].contiguous()
    if e_score_correction_bias is not None:
        out[f"{prefix}gate.e_score_correction_bias"] = e_score_correction_bias.float().contiguous()
    return out
