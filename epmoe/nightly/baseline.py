"""Figures, baseline files and the regression gate (pure logic: no torch, no processes).

A `Figure` is one number the nightly measured. Its `kind` says how it may be compared:

    ratio       measured against a peer in the same run (our layer / the plain baseline, a kernel /
                the matmul ceiling): a slower or faster machine moves both sides, so the gate holds
                across machines of one kind. Always gated.
    time, throughput
                absolute figures: gated only when the baseline was recorded on the same hardware
                (same `machine.fingerprint`), reported otherwise.
    bytes       deterministic counts (bytes on the wire for a seeded routing): band 0, any growth fails.
    count       how many cases passed (correctness steps): band 0, one fewer than the baseline fails
                (a backend that stopped being runnable here is a regression, not a skip).
    info        reported, never gated.

A baseline file (`benchmarks/baselines/<machine kind>.json`) holds the figures of one good run, the
machine they came from and the noise band per kind. `compare` judges every figure:

    worse = current / baseline     (better == "lower")
            baseline / current     (better == "higher")
    regressed  when worse > 1 + band       improved  when worse < 1 / (1 + band)
    missing    when the baseline has the figure and this run did not measure it (a step that used to
               run no longer does: that fails too)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional

KINDS = ("ratio", "time", "throughput", "bytes", "count", "info")
GATED_ACROSS_MACHINES = ("ratio", "bytes", "count")

# Noise bands (allowed relative worsening) per machine kind, written into a new baseline file.
# GPU: a same-run ratio moves by a few per cent run to run on the H200 (4 ranks sharing the GPU:
# up to ~10 %); 25 % leaves room and still catches a backend that got a third slower.
# CPU: the 2-core CI box is shared with other jobs; same-run ratios swing by up to ~1.6x there and
# absolute times by 3-6x between two runs minutes apart, so on CPU absolute figures are reported only
# (band None: not gated).
DEFAULT_BANDS = {
    "gpu": {"ratio": 0.25, "time": 0.5, "throughput": 0.5, "bytes": 0.0, "count": 0.0},
    "cpu": {"ratio": 1.0, "time": None, "throughput": None, "bytes": 0.0, "count": 0.0},
}

VERDICTS = ("ok", "improved", "regressed", "missing", "new", "not gated")
FAILING = ("regressed", "missing")


@dataclass(frozen=True)
class Figure:
    """name: dotted path (`layer.torch.T256.vs_baseline`); better: "lower" | "higher"."""

    name: str
    value: float
    unit: str = ""
    better: str = "lower"
    kind: str = "ratio"
    step: str = ""

    def __post_init__(self):
        if self.better not in ("lower", "higher"):
            raise ValueError(f"figure {self.name}: better={self.better!r}; use 'lower' or 'higher'")
        if self.kind not in KINDS:
            raise ValueError(f"figure {self.name}: kind={self.kind!r}; use one of {KINDS}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, name: str, d: Mapping) -> "Figure":
        return cls(name=name, value=float(d["value"]), unit=d.get("unit", ""), better=d.get("better", "lower"),
                   kind=d.get("kind", "ratio"), step=d.get("step", ""))


@dataclass(frozen=True)
class Baseline:
    machine_kind: str
    machine: Mapping
    created: str
    bands: Mapping[str, Optional[float]]  # None: figures of that kind are reported, not gated
    figures: Mapping[str, Figure]
    band_overrides: Mapping[str, float] = field(default_factory=dict)  # per figure name

    def band_for(self, fig: Figure) -> Optional[float]:
        if fig.name in self.band_overrides:
            return self.band_overrides[fig.name]
        return self.bands.get(fig.kind, 0.0)

    def to_json(self) -> dict:
        return {
            "machine_kind": self.machine_kind,
            "machine": dict(self.machine),
            "created": self.created,
            "bands": dict(self.bands),
            "band_overrides": dict(self.band_overrides),
            "figures": {n: {k: v for k, v in f.to_json().items() if k != "name"}
                        for n, f in sorted(self.figures.items())},
        }

    @classmethod
    def from_json(cls, d: Mapping, source: str = "baseline") -> "Baseline":
        for key in ("machine_kind", "figures", "bands"):
            if key not in d:
                raise ValueError(f"{source}: no {key!r} key; write a new one with --update-baseline")
        bad = [k for k in d["bands"] if k not in KINDS]
        if bad:
            raise ValueError(f"{source}: bands has unknown kinds {bad}; use {list(KINDS)}")
        return cls(machine_kind=d["machine_kind"], machine=d.get("machine", {}), created=d.get("created", ""),
                   bands={k: _band(v) for k, v in d["bands"].items()},
                   figures={n: Figure.from_json(n, f) for n, f in d["figures"].items()},
                   band_overrides={k: _band(v) for k, v in d.get("band_overrides", {}).items()})


def _band(v) -> Optional[float]:
    if v is None:
        return None
    v = float(v)
    if not v >= 0:
        raise ValueError(f"a noise band of {v} makes no sense; use a fraction >= 0 (0.25: 25% worse allowed) or null")
    return v


def make_baseline(figures: Iterable[Figure], machine_kind: str, machine: Mapping, created: str,
                  bands: Optional[Mapping[str, float]] = None, previous: Optional[Baseline] = None) -> Baseline:
    """A new baseline from this run's figures. Bands: given, else the previous file's (a person may
    have tuned them), else the defaults for CPU or GPU machines. Figures that are not finite are left out."""
    if bands is None:
        bands = previous.bands if previous is not None else DEFAULT_BANDS["cpu" if machine_kind.startswith("cpu") else "gpu"]
    figs = {f.name: f for f in figures if math.isfinite(f.value)}
    return Baseline(machine_kind=machine_kind, machine=dict(machine), created=created, bands=dict(bands),
                    figures=figs, band_overrides=dict(previous.band_overrides) if previous is not None else {})


def load_baseline(path: str) -> Optional[Baseline]:
    """None when the file does not exist; ValueError (naming the file) when it is not a baseline."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the baseline ({e}); fix it or write a new one with --update-baseline") from e
    return Baseline.from_json(data, source=path)


def save_baseline(baseline: Baseline, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(baseline.to_json(), f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Comparison:
    name: str
    verdict: str  # one of VERDICTS
    current: Optional[float]
    baseline: Optional[float]
    band: Optional[float]
    worse: Optional[float]  # > 1: worse than the baseline by this factor
    unit: str = ""
    kind: str = ""
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict in FAILING

    def describe(self) -> str:
        if self.verdict == "missing":
            return f"{self.name}: in the baseline ({_fmt(self.baseline)} {self.unit}) but not measured in this run"
        if self.verdict == "new":
            return f"{self.name}: {_fmt(self.current)} {self.unit} (new, not in the baseline)"
        change = f"{(self.worse - 1) * 100:+.1f}% worse" if self.worse is not None and self.worse >= 1 else (
            f"{(1 / self.worse - 1) * 100:.1f}% better" if self.worse else "")
        band = f", band {self.band * 100:.0f}%" if self.band is not None else ""
        note = f" ({self.note})" if self.note else ""
        return (f"{self.name}: {_fmt(self.current)} vs baseline {_fmt(self.baseline)} {self.unit} "
                f"[{change}{band}] {self.verdict}{note}")


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if v == 0 or 1e-3 <= abs(v) < 1e6:
        return f"{v:.4g}"
    return f"{v:.3e}"


def worse_factor(current: float, base: float, better: str) -> Optional[float]:
    """How many times worse `current` is than `base` (1.0: equal); None when not comparable."""
    if not (math.isfinite(current) and math.isfinite(base)):
        return None
    num, den = (current, base) if better == "lower" else (base, current)
    if den == 0:
        return 1.0 if num == 0 else math.inf
    if num == 0:
        return 0.0
    return num / den


def compare(figures: Iterable[Figure], baseline: Baseline, same_machine: bool) -> List[Comparison]:
    """Judge every figure of this run against the baseline (and list the baseline's figures this run
    did not measure). `same_machine`: the baseline was recorded on this hardware, so absolute
    figures (time, throughput) are gated too."""
    current: Dict[str, Figure] = {}
    for f in figures:
        current[f.name] = f
    out: List[Comparison] = []
    for name in sorted(set(current) | set(baseline.figures)):
        cur, base = current.get(name), baseline.figures.get(name)
        if cur is None:
            gated = baseline.band_for(base) is not None and (
                base.kind in GATED_ACROSS_MACHINES or (same_machine and base.kind != "info"))
            out.append(Comparison(name, "missing" if gated else "not gated", None, base.value, None, None, base.unit,
                                  base.kind, "" if gated else "absolute figure from other hardware"))
            continue
        if base is None:
            out.append(Comparison(name, "new", cur.value, None, None, None, cur.unit, cur.kind))
            continue
        band = baseline.band_for(cur)
        worse = worse_factor(cur.value, base.value, cur.better)
        if cur.kind != "info" and band is None:
            out.append(Comparison(name, "not gated", cur.value, base.value, None, worse, cur.unit, cur.kind,
                                  f"no band for {cur.kind} figures in the baseline"))
            continue
        if cur.kind == "info":
            out.append(Comparison(name, "not gated", cur.value, base.value, None, worse, cur.unit, cur.kind, "info"))
            continue
        if cur.kind not in GATED_ACROSS_MACHINES and not same_machine:
            out.append(Comparison(name, "not gated", cur.value, base.value, band, worse, cur.unit, cur.kind,
                                  "absolute figure, baseline from other hardware"))
            continue
        if worse is None:
            verdict, note = "regressed", "not a finite number"
        elif worse > 1 + band + 1e-12:
            verdict, note = "regressed", ""
        elif worse < 1 / (1 + band) - 1e-12:
            verdict, note = "improved", "consider --update-baseline"
        else:
            verdict, note = "ok", ""
        out.append(Comparison(name, verdict, cur.value, base.value, band, worse, cur.unit, cur.kind, note))
    return out
