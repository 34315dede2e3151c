"""Checkpoint loading: expert tensors from HF-named dicts / safetensors, or the canonical stacked form,
into `ExpertWeights` (only the requested expert range is read from disk).

Recognised names (any prefix such as `model.layers.3.mlp.`):
  per expert   experts.{e}.{w1|gate_proj}.weight [I, H]   (gate; for relu2 configs also `up_proj`)
               experts.{e}.{w3|up_proj}.weight   [I, H]   (up, gated configs)
               experts.{e}.{w2|down_proj}.weight [H, I]   (+ matching `.bias` tensors)
               quantized as they ship: FP8 128x128 blocks (`weight` e4m3 + `weight_scale_inv`), ModelOpt
               NVFP4 (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`), compressed-tensors NVFP4
               (`weight_packed`, `weight_scale`, `weight_global_scale`, `input_global_scale`); see
               `epmoe.quant.checkpoint_formats` for shapes, dtypes and scale conventions
  GPT-OSS      experts.gate_up_proj [E, H, 2I] (gate/up interleaved on the last dim),
               experts.gate_up_proj_bias [E, 2I], experts.down_proj [E, I, H], experts.down_proj_bias [E, H];
               MXFP4 as released: experts.{gate_up,down}_proj_{blocks,scales} (+ the biases)
  canonical    w1 [E, I, H], w3 [E, I, H], w2 [E, H, I], optional w13 [E, 2I, H], b13, b2 (no prefix)
  routing      *gate.e_score_correction_bias [E] (DeepSeek-V3), or canonical `e_score_correction_bias`

Quantized tensors are kept as stored (no dequantize -> requantize); the experts backend dequantizes
them only when the quant plan runs bf16. Only the requested experts' tensors are read (stacked GPT-OSS
tensors through safetensors slices); `LoadedExperts.tensors_read` lists what was read.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from epmoe.config import MoEConfig
from epmoe.quant import checkpoint_formats as ckf
from epmoe.quant.weights import ExpertWeights

Source = Union[str, os.PathLike, Mapping[str, torch.Tensor]]

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*?)experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\."
    r"(?P<kind>" + "|".join(ckf.PER_EXPERT_SUFFIXES) + r")$"
)
_STACKED = re.compile(
    r"^(?P<prefix>.*?)experts\.(?P<name>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias"
    r"|gate_up_proj_blocks|gate_up_proj_scales|down_proj_blocks|down_proj_scales)$"
)
_CORRECTION = re.compile(r"^(?P<prefix>.*?)(gate\.)?e_score_correction_bias$")
_CANONICAL = ("w1", "w2", "w3", "w13", "b13", "b2", "e_score_correction_bias")


class CheckpointReadError(OSError):
    """A checkpoint file could not be read (corrupt, truncated, unreadable); names the file."""


@dataclass(frozen=True)
class LoadedExperts:
    """experts: ExpertWeights of global experts [first_expert, first_expert + n) (with `expert_ids=`:
    row i holds expert expert_ids[i]); e_score_correction_bias: [E] float32 or None."""

    experts: ExpertWeights
    e_score_correction_bias: Optional[torch.Tensor]
    checkpoint_format: str = "bf16"  # one of quant.checkpoint_formats.CHECKPOINT_FORMATS, or "canonical"
    tensors_read: Tuple[str, ...] = ()  # names read, with "[lo:hi]" for row slices of stacked tensors
    expert_ids: Tuple[int, ...] = ()  # the global expert of each row


class _Reader:
    """Uniform access to a dict or to safetensors files, reading tensors lazily (and slices of them)."""

    def __init__(self, source: Source):
        self._dict: Optional[Mapping[str, torch.Tensor]] = None
        self._files: Dict[str, str] = {}
        self.reads: List[str] = []
        self._open: Dict[str, object] = {}
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

    def shape(self, key: str) -> Tuple[int, ...]:
        """The stored shape (safetensors header only, no data read)."""
        if self._dict is not None:
            return tuple(self._dict[key].shape)
        return tuple(self._handle(key).get_slice(key).get_shape())

    def get(self, key: str, rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        self.reads.append(key if rows is None else f"{key}[{rows[0]}:{rows[1]}]")
        if self._dict is not None:
            t = self._dict[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weights[{key!r}] is a {type(t).__name__}; expected a torch.Tensor")
            return t if rows is None else t[rows[0] : rows[1]]
        try:
            h = self._handle(key)
            if rows is None:
                return h.get_tensor(key)
            return h.get_slice(key)[rows[0] : rows[1]]
        except Exception as e:  # noqa: BLE001 - SafetensorError and friends: name the file and the tensor
            raise CheckpointReadError(f"cannot read {key!r} from {self._files[key]}: {type(e).__name__}: {e}") from e

    def _handle(self, key: str):
        """One open safetensors handle per file for the whole load (the header is parsed once)."""
        f = self._files[key]
        if f not in self._open:
            from safetensors import safe_open

            self._open[f] = safe_open(f, framework="pt")
        return self._open[f]

    def close(self) -> None:
        self._open.clear()


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
    expert_ids: Optional[Sequence[int]] = None,
    prefix: Optional[str] = None,
    layer_idx: Optional[int] = None,
) -> LoadedExperts:
    """Read global experts `experts=(start, end)` (default: all) of one layer from `source`, or the
    experts `expert_ids` in that order (any order, repeats allowed: row i holds expert expert_ids[i];
    each is read once, consecutive ids as one slice), as a rank holding the slots of a placement does.

    Raises ValueError naming the missing/misshaped tensor and the fix."""
    E = config.num_experts
    if expert_ids is not None:
        if experts is not None:
            raise ValueError("pass experts=(start, end) or expert_ids=[...], not both")
        ids = list(expert_ids)
        if not ids or any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < E for e in ids):
            raise ValueError(f"expert_ids={ids!r}; pass a non-empty list of expert ids in [0, {E})")
        runs: List[Tuple[int, int]] = []
        for e in sorted(set(ids)):
            if runs and runs[-1][1] == e:
                runs[-1] = (runs[-1][0], e + 1)
            else:
                runs.append((e, e + 1))
    else:
        lo, hi = experts if experts is not None else (0, E)
        if not (0 <= lo < hi <= E):
            raise ValueError(f"expert range [{lo}, {hi}) is outside [0, {E})")
        ids, runs = list(range(lo, hi)), [(lo, hi)]
    reader = _Reader(source)
    try:
        return _load(reader, config, runs, ids, prefix, layer_idx)
    finally:
        reader.close()


def _gather_runs(read: Callable[[int, int], ExpertWeights], runs: List[Tuple[int, int]], ids: List[int]
                 ) -> ExpertWeights:
    """Read each run of consecutive experts once, then the rows of `ids` in order."""
    parts = [read(lo, hi) for lo, hi in runs]
    if len(parts) == 1 and ids == list(range(*runs[0])):
        return parts[0]
    row_of = {}
    for (lo, hi), start in zip(runs, itertools.accumulate([0] + [hi - lo for lo, hi in runs])):
        for e in range(lo, hi):
            row_of[e] = start + e - lo
    return ExpertWeights.concat(parts).take([row_of[e] for e in ids], first_expert=ids[0])


def _load(reader: "_Reader", config: MoEConfig, runs: List[Tuple[int, int]], ids: List[int], prefix: Optional[str],
          layer_idx: Optional[int]) -> LoadedExperts:
    E = config.num_experts
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
        loaded = _gather_runs(lambda lo, hi: _load_canonical(reader, canonical, config, lo, hi), runs, ids)
        fmt = "canonical"
        corr = reader.get("e_score_correction_bias") if "e_score_correction_bias" in canonical else None
    elif per_expert or stacked:
        p = _choose_prefix(list(per_expert) + list(stacked), prefix, layer_idx)
        if p in per_expert and p in stacked:
            raise ValueError(
                f"experts under {p!r} are stored both per expert ('{p}experts.0....') and stacked "
                f"({sorted(stacked[p])}); a layer's experts must use one format"
            )
        found = []  # the format the loader found (the same for every run)
        if p in per_expert:
            def read(lo, hi):
                fmt, part = _load_per_expert(reader, per_expert[p], config, lo, hi, p)
                found.append(fmt)
                return part
        else:
            stored = "mxfp4-gpt-oss" if any(n.endswith(("_blocks", "_scales")) for n in stacked[p]) else "bf16"
            _check_declared_method(config, stored, f"{p}experts.{sorted(stacked[p])[0]}")

            def read(lo, hi):
                fmt, part = _load_gpt_oss(reader, stacked[p], config, lo, hi, p)
                found.append(fmt)
                return part
        loaded = _gather_runs(read, runs, ids)
        fmt = found[0]
        ck = correction.get(p)
        if ck is None:  # the router gate usually sits beside `experts.` under the same prefix
            ck = next((v for q, v in correction.items() if q == p or q.startswith(p)), None)
        if ck is not None and config.routing != "sigmoid_grouped":
            raise ValueError(
                f"the checkpoint holds {ck!r} (DeepSeek-style sigmoid routing with a correction bias), but "
                f"the config routes with {config.routing!r} (model_type={config.model_type!r}: config.json "
                "has no 'scoring_func' and the model type is not a known DeepSeek-style router); add "
                "\"scoring_func\": \"sigmoid\" (with n_group / topk_group / routed_scaling_factor) to "
                "config.json, or build MoEConfig(routing='sigmoid_grouped', ...)"
            )
        corr = reader.get(ck) if ck is not None else None
    else:
        raise ValueError(
            "no expert tensors found: expected HF names like '...experts.0.gate_proj.weight', GPT-OSS "
            "'...experts.gate_up_proj' / '...experts.gate_up_proj_blocks', or canonical keys w1/w2/w3 (got keys "
            f"{sorted(keys)[:8]}{' ...' if len(keys) > 8 else ''})"
        )
    if corr is not None:
        if tuple(corr.shape) != (E,):
            raise ValueError(f"e_score_correction_bias has shape {list(corr.shape)}; expected [{E}]")
        corr = corr.float()
    if config.routing == "sigmoid_grouped" and corr is None:
        pass  # allowed: DeepSeek-V2 style grouped routing without correction bias
    loaded.validate(config, len(ids))
    return LoadedExperts(experts=loaded, e_score_correction_bias=corr, checkpoint_format=fmt,
                         tensors_read=tuple(reader.reads), expert_ids=tuple(ids))


def _check_declared_method(config: MoEConfig, fmt: str, example: str) -> None:
    """The tensors' format must be the one config.json declares (when it declares one)."""
    if config.quant_method is None:
        return  # undeclared: the stored format is used as found (the plan check at load decides)
    from epmoe.quant.plan import checkpoint_family

    declared = checkpoint_family(config.quant_method)
    found = ckf.family_of_format(fmt)
    if declared != found:
        what = "unquantized (no scale tensors)" if found == "none" else f"{fmt}"
        raise ValueError(
            f"config.json declares quant_method={config.quant_method!r} ({declared} checkpoint), but the "
            f"expert tensors are {what} (e.g. {example}); "
            + {"fp8": "FP8 block checkpoints store '<proj>.weight' (float8_e4m3fn) with '<proj>.weight_scale_inv'",
               "nvfp4": "NVFP4 checkpoints store '<proj>.weight' + 'weight_scale' + 'weight_scale_2' (ModelOpt) "
                        "or '<proj>.weight_packed' + 'weight_scale' + 'weight_global_scale' (compressed-tensors)",
               "mxfp4": "GPT-OSS MXFP4 checkpoints store 'experts.gate_up_proj_blocks' / '_scales' and "
                        "'experts.down_proj_blocks' / '_scales'",
               "mxfp8": "MXFP8 checkpoints are not loadable from files yet",
               "none": "fix quantization_config in config.json or MoEConfig.quant_method"}[declared]
        )


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
) -> Tuple[str, ExpertWeights]:
    if config.is_gated:
        roles = {"w1": ("w1", "gate_proj"), "w3": ("w3", "up_proj"), "w2": ("w2", "down_proj")}
    else:  # non-gated (relu2): the single first projection is called up_proj (Nemotron) or w1
        roles = {"w1": ("w1", "up_proj", "gate_proj"), "w2": ("w2", "down_proj")}
    H, I = config.hidden_size, config.intermediate_size
    dims = {"w1": (I, H), "w3": (I, H), "w2": (H, I)}

    # The format of every stored projection of the layer, from the names alone (nothing read): one
    # format for all experts, so a partly converted checkpoint is refused before any tensor is read.
    suffixes: Dict[Tuple[int, str], set] = {}
    for (e, proj, kind) in names:
        suffixes.setdefault((e, proj), set()).add(kind)
    by_format: Dict[str, List[str]] = {}
    for (e, proj), kinds in sorted(suffixes.items()):
        if kinds <= {"bias"}:
            continue
        by_format.setdefault(ckf.classify_projection(kinds), []).append(f"{prefix}experts.{e}.{proj}")
    if len(by_format) > 1:
        detail = "; ".join(f"{f}: {v[0]}{f' (+{len(v) - 1} more)' if len(v) > 1 else ''}"
                           for f, v in sorted(by_format.items()))
        quantized = [f for f in by_format if f in ckf.PER_EXPERT_FORMATS and f != "bf16"]
        if "bf16" in by_format and len(quantized) == 1:
            # most likely scale tensors are missing: name the first one
            f = quantized[0]
            base = by_format["bf16"][0]
            need = [sp for sp in ckf.PER_EXPERT_FORMATS[f][1:] if not sp.optional]
            raise ValueError(
                f"{f} checkpoint lacks {base}.{need[0].suffix} (every {f} projection stores "
                f"{[sp.suffix for sp in ckf.PER_EXPERT_FORMATS[f]]}); experts under {prefix!r} mix formats ({detail})"
            )
        raise ValueError(
            f"experts under {prefix!r} mix checkpoint formats ({detail}); every expert of a layer must be "
            "stored in one format"
        )
    fmt = next(iter(by_format), "bf16")
    ckf.check_supported(fmt)
    example = next(iter(by_format.get(fmt, [])), f"{prefix}experts.0.gate_proj")
    _check_declared_method(config, fmt, example)
    specs = ckf.PER_EXPERT_FORMATS[fmt]

    def proj_of(e: int, role: str) -> Optional[str]:
        for proj in roles[role]:
            if (e, proj, specs[0].suffix) in names or (e, proj, "weight") in names:
                return proj
        return None

    def one(e: int, role: str) -> Dict[str, Optional[torch.Tensor]]:
        proj = proj_of(e, role)
        out_f, in_f = dims[role]
        if proj is None:
            raise ValueError(
                f"expert {e} lacks its {role} weight (looked for "
                f"{[f'{prefix}experts.{e}.{p}.{specs[0].suffix}' for p in roles[role]]}); the checkpoint is "
                "incomplete or the config's activation/has_bias does not match it"
            )
        parts: Dict[str, torch.Tensor] = {}
        for spec in specs:
            key = names.get((e, proj, spec.suffix))
            if key is None:
                if spec.optional:
                    continue
                raise ValueError(
                    f"{fmt} checkpoint lacks {prefix}experts.{e}.{proj}.{spec.suffix} (expected "
                    f"{spec.describe(out_f, in_f)}) next to {prefix}experts.{e}.{proj}.{specs[0].suffix}"
                )
            t = reader.get(key)
            spec.check(t, key, out_f, in_f, fmt)
            parts[spec.suffix] = t
        return ckf.projection_to_canonical(fmt, parts)

    def bias(e: int, role: str) -> torch.Tensor:
        for proj in roles[role]:
            k = names.get((e, proj, "bias"))
            if k is not None:
                return reader.get(k)
        raise ValueError(
            f"expert {e} lacks its {role} bias (looked for "
            f"{[f'{prefix}experts.{e}.{p}.bias' for p in roles[role]]}); the checkpoint is "
            "incomplete or the config's activation/has_bias does not match it"
        )

    got = {role: [one(e, role) for e in range(lo, hi)] for role in roles}
    fields: Dict[str, Optional[torch.Tensor]] = {}
    for role, pieces in got.items():
        fields[role] = torch.stack([p["data"] for p in pieces])
        if fmt != "bf16":
            fields[role + "_scale"] = torch.stack([p["scale"] for p in pieces])
        if fmt.startswith("nvfp4"):
            fields[role + "_global_scale"] = torch.stack([p["global_scale"] for p in pieces]).float()
    if fmt.startswith("nvfp4"):
        inputs = {role: [p["input_scale"] for p in pieces] for role, pieces in got.items()}
        have = {role: sum(x is not None for x in v) for role, v in inputs.items()}
        if any(have.values()):
            short = [r for r, n in have.items() if n != hi - lo]
            if short:
                sfx = "input_scale" if fmt == "nvfp4-modelopt" else "input_global_scale"
                raise ValueError(
                    f"{fmt} checkpoint has '{sfx}' for some local experts' projections but not for "
                    f"{short} of all experts [{lo}, {hi}); every projection needs it, or none"
                )
            first = torch.stack(inputs["w1"]).float()
            if "w3" in inputs:  # gate and up read the same activation: one scale, the larger
                first = torch.maximum(first, torch.stack(inputs["w3"]).float())
            fields["w13_input_scale"] = first
            fields["w2_input_scale"] = torch.stack(inputs["w2"]).float()
    if config.has_bias:
        b = {role: torch.stack([bias(e, role) for e in range(lo, hi)]) for role in roles}
        fields["b13"] = torch.cat([b["w1"], b["w3"]], dim=1) if config.is_gated else b["w1"]
        fields["b2"] = b["w2"]
    weight_format = ckf.WEIGHT_FORMAT_OF_FORMAT[fmt]
    return fmt, ExpertWeights(format=weight_format, first_expert=lo, **fields)


def _load_gpt_oss(
    reader: _Reader, names: Dict[str, str], config: MoEConfig, lo: int, hi: int, prefix: str
) -> Tuple[str, ExpertWeights]:
    mx = [n for n in names if n.endswith(("_blocks", "_scales"))]
    if mx:
        plain = [n for n in ("gate_up_proj", "down_proj") if n in names]
        if plain:
            raise ValueError(
                f"experts under {prefix!r} mix MXFP4 tensors {sorted(mx)} and unquantized {plain}; a layer's "
                "experts must use one format"
            )
        return "mxfp4-gpt-oss", _load_gpt_oss_mxfp4(reader, names, config, lo, hi, prefix)
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
    return "bf16", ExpertWeights(w1=w1, w2=w2, w3=w3, b13=b13, b2=b2, first_expert=lo)


def _load_gpt_oss_mxfp4(
    reader: _Reader, names: Dict[str, str], config: MoEConfig, lo: int, hi: int, prefix: str
) -> ExpertWeights:
    """GPT-OSS MXFP4 as released: blocks [E, R, K/32, 16] -> packed [e, R, K/2] (same nibble order),
    scales [E, R, K/32] E8M0; gate/up rows interleaved (2j gate, 2j+1 up)."""
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    if not config.is_gated:
        raise ValueError("GPT-OSS MXFP4 experts are gated (interleaved gate/up); the config says activation='relu2'")
    if H % ckf.MXFP4_BLOCK or I % ckf.MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs hidden_size ({H}) and intermediate_size ({I}) to be multiples of 32")
    want = dict(ckf.GPT_OSS_MXFP4)
    if not config.has_bias:
        want.pop("gate_up_proj_bias"), want.pop("down_proj_bias")
    got: Dict[str, torch.Tensor] = {}
    for name, (dtypes, shape_of) in want.items():
        key = f"{prefix}experts.{name}"
        full = shape_of(E, H, I)
        if name not in names:
            raise ValueError(
                f"GPT-OSS MXFP4 checkpoint lacks {key!r} (expected {list(full)} "
                f"{' / '.join(str(d).replace('torch.', '') for d in dtypes)})"
            )
        stored = reader.shape(names[name])
        if stored != full:
            raise ValueError(
                f"GPT-OSS MXFP4 tensor {key!r} has shape {list(stored)}; expected {list(full)} "
                f"(E={E}, H={H}, I={I})"
            )
        t = reader.get(names[name], (lo, hi))
        if t.dtype not in dtypes:
            raise ValueError(
                f"GPT-OSS MXFP4 tensor {key!r} has dtype {str(t.dtype).replace('torch.', '')}; expected "
                f"{' / '.join(str(d).replace('torch.', '') for d in dtypes)}"
            )
        got[name] = t
    n = hi - lo
    gu = got["gate_up_proj_blocks"].reshape(n, 2 * I, H // 2)
    gus = got["gate_up_proj_scales"]
    fields = dict(
        w1=gu[:, 0::2].contiguous(), w3=gu[:, 1::2].contiguous(),
        w1_scale=gus[:, 0::2].contiguous(), w3_scale=gus[:, 1::2].contiguous(),
        w2=got["down_proj_blocks"].reshape(n, H, I // 2), w2_scale=got["down_proj_scales"],
    )
    if config.has_bias:
        gub = got["gate_up_proj_bias"]
        fields["b13"] = torch.cat([gub[:, 0::2], gub[:, 1::2]], dim=-1)
        fields["b2"] = got["down_proj_bias"]
    return ExpertWeights(format="mxfp4", first_expert=lo, **fields)


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
