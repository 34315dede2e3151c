"""Figures, baseline files and the regression gate (pure logic: no torch, no processes).

A `Figure` is one number the nightly measured. Its `kind` says how it may be compared:

    ratio       measured against a yardstick in the same run (our layer / the plain EP MoE run
                alternately in the same processes, a kernel / the matmul ceiling): a slower or faster
                machine moves both sides, so the gate holds across machines of one kind.
    time, throughput
                absolute figures: gated only when the baseline was recorded on the same hardware
                (same `machine.fingerprint`), reported otherwise.
    bytes       deterministic counts (bytes on the wire for a seeded routing): band 0, any growth fails.
    count       how many cases passed (correctness steps): band 0, one fewer than the baseline fails
                (a backend that stopped being runnable here is a regression, not a skip).
    info        reported, never gated.

Its `role` says whose number it is; only our own figures gate:

    ours        our code's figure (the default).
    peer        a peer's own figure (the torch loop of per-expert matmuls, the plain EP MoE's times):
                reported as context. A peer that is host-bound moves 2x between hosts of one kind.
    vs_peer     ours relative to such a peer (`vs_torch_loop`): the peer's noise is in it, so it is
                context too.

A baseline file (`benchmarks/baselines/<machine kind>.json`) holds the figures of one or more good
runs (each figure: the median `value` and the `values` of the runs), the runs' provenance and the
bands. `compare` judges every figure:

    worse = current / baseline     (better == "lower")
            baseline / current     (better == "higher")
    regressed  when worse > 1 + band       improved  when worse < 1 / (1 + band)
    missing    when the baseline has the figure and this run did not measure it (a step that used to
               run no longer does: that fails too)

The band of a figure recorded in two or more runs comes from their spread (`band_from_spread`):
    spread = max(values) / min(values) - 1
    band   = max(floor[kind], factor * spread)         (factor 2: twice the worst run-to-run change seen)
A figure recorded in one run has no measured spread: its band is `bands[kind]`. `bands[kind]` None
means the kind is reported, not gated, on this machine; `band_overrides` (per figure) win over both.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

KINDS = ("ratio", "time", "throughput", "bytes", "count", "info")
GATED_ACROSS_MACHINES = ("ratio", "bytes", "count")
EXACT_KINDS = ("bytes", "count")  # deterministic: no spread, band 0
ROLES = ("ours", "peer", "vs_peer")
FORMAT = 2  # baseline file format: 1 = one run, no `values` / `runs` / `spread_rule` (still read)

# Noise bands (allowed relative worsening) of figures recorded in one run (no measured spread), per
# machine kind, written into a new baseline file.
# GPU: a same-run ratio moves by a few per cent run to run on the H200 (4 ranks sharing the GPU:
# up to ~30 % where the plain EP MoE it is measured against is host-bound); 25 % for one run.
# CPU: the 2-core CI box is shared with other jobs; same-run ratios swing by up to ~1.6x there and
# absolute times by 3-6x between two runs minutes apart, so on CPU absolute figures are reported only
# (band None: not gated).
DEFAULT_BANDS = {
    "gpu": {"ratio": 0.25, "time": 0.5, "throughput": 0.5, "bytes": 0.0, "count": 0.0},
    "cpu": {"ratio": 1.0, "time": None, "throughput": None, "bytes": 0.0, "count": 0.0},
}
# Bands of figures recorded in >= 2 runs: max(floor, factor * spread). GPU ratio floor 0.15: the
# expert-stage ratios of our kernels (`% matmul`) moved by up to 8.9 % over 13 H200 runs on different
# days (docs/nightly.md, "Bands"), and a spread seen in a few runs minutes apart on one host says
# nothing about another host. Absolute figures keep 0.5: H200 hosts of one fingerprint differ in
# their CPUs, and the 4-ranks-per-GPU layer is partly host-bound. CPU: as its single-run bands.
DEFAULT_SPREAD_RULES = {
    "gpu": {"factor": 2.0, "floor": {"ratio": 0.15, "time": 0.5, "throughput": 0.5}},
    "cpu": {"factor": 2.0, "floor": {"ratio": 1.0, "time": None, "throughput": None}},
}

VERDICTS = ("ok", "improved", "regressed", "missing", "new", "not gated", "context")
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
    role: str = "ours"

    def __post_init__(self):
        if self.better not in ("lower", "higher"):
            raise ValueError(f"figure {self.name}: better={self.better!r}; use 'lower' or 'higher'")
        if self.kind not in KINDS:
            raise ValueError(f"figure {self.name}: kind={self.kind!r}; use one of {KINDS}")
        if self.role not in ROLES:
            raise ValueError(f"figure {self.name}: role={self.role!r}; use one of {ROLES}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, name: str, d: Mapping, role: Optional[str] = None) -> "Figure":
        """role: the role when `d` names none (files written before roles existed)."""
        return cls(name=name, value=float(d["value"]), unit=d.get("unit", ""), better=d.get("better", "lower"),
                   kind=d.get("kind", "ratio"), step=d.get("step", ""), role=d.get("role") or role or "ours")


def spread(values: Sequence[float]) -> Optional[float]:
    """max / min - 1 over the runs' values; None with fewer than two, or any value <= 0 or not finite."""
    if len(values) < 2 or not all(math.isfinite(v) and v > 0 for v in values):
        return None
    return max(values) / min(values) - 1


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def band_from_spread(s: float, floor: float, factor: float) -> float:
    """The band of a figure whose recorded runs spread by `s` (see the module docstring)."""
    return max(floor, factor * s)


@dataclass(frozen=True)
class Baseline:
    """figures: the median of each figure over the recorded runs; samples: each figure's values in
    those runs (a figure missing from some runs has fewer); runs: where each run came from (date,
    commit, host, fingerprint, source file)."""

    machine_kind: str
    machine: Mapping
    created: str
    bands: Mapping[str, Optional[float]]  # one-run band per kind; None: that kind is reported, not gated
    figures: Mapping[str, Figure]
    band_overrides: Mapping[str, float] = field(default_factory=dict)  # per figure name
    samples: Mapping[str, Tuple[float, ...]] = field(default_factory=dict)
    runs: Tuple[Mapping, ...] = ()
    spread_rule: Mapping = field(default_factory=lambda: DEFAULT_SPREAD_RULES["gpu"])

    def values(self, name: str) -> Tuple[float, ...]:
        return tuple(self.samples.get(name) or (self.figures[name].value,))

    def band_for(self, fig: Figure) -> Optional[float]:
        return self.band_and_basis(fig)[0]

    def band_and_basis(self, fig: Figure) -> Tuple[Optional[float], str]:
        """(band, how it was set) for a figure of this name and kind."""
        if fig.name in self.band_overrides:
            return self.band_overrides[fig.name], "override"
        one_run = self.bands.get(fig.kind, 0.0)
        if one_run is None or fig.kind in EXACT_KINDS or fig.kind == "info" or fig.name not in self.figures:
            return one_run, ""
        values = self.values(fig.name)
        s = spread(values)
        if s is None:
            return one_run, "one run" if len(values) < 2 else ""
        floor = self.spread_rule.get("floor", {}).get(fig.kind, one_run)
        if floor is None:
            return None, ""
        factor = float(self.spread_rule.get("factor", 2.0))
        band = band_from_spread(s, floor, factor)
        how = f"{factor:g} x spread {s * 100:.1f}%" if band > floor else f"floor; spread {s * 100:.1f}%"
        return band, f"{how} over {len(values)} runs"

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "machine_kind": self.machine_kind,
            "machine": dict(self.machine),
            "created": self.created,
            "runs": [dict(r) for r in self.runs],
            "bands": dict(self.bands),
            "spread_rule": {"factor": self.spread_rule.get("factor", 2.0), "floor": dict(self.spread_rule.get("floor", {}))},
            "band_overrides": dict(self.band_overrides),
            "figures": {n: dict({k: v for k, v in f.to_json().items() if k != "name"}, values=list(self.values(n)))
                        for n, f in sorted(self.figures.items())},
        }

    @classmethod
    def from_json(cls, d: Mapping, source: str = "baseline") -> "Baseline":
        for key in ("machine_kind", "figures", "bands"):
            if key not in d:
                raise ValueError(f"{source}: no {key!r} key; write a new one with --update-baseline")
        if int(d.get("format", 1)) > FORMAT:
            raise ValueError(f"{source}: baseline format {d['format']} is newer than this epmoe reads ({FORMAT}); "
                             "update epmoe or record a new baseline with --update-baseline")
        bad = [k for k in d["bands"] if k not in KINDS]
        if bad:
            raise ValueError(f"{source}: bands has unknown kinds {bad}; use {list(KINDS)}")
        rule = d.get("spread_rule") or DEFAULT_SPREAD_RULES["cpu" if d["machine_kind"].startswith("cpu") else "gpu"]
        bad = [k for k in rule.get("floor", {}) if k not in KINDS]
        if bad:
            raise ValueError(f"{source}: spread_rule.floor has unknown kinds {bad}; use {list(KINDS)}")
        factor = _band(rule.get("factor", 2.0))
        if factor is None:
            raise ValueError(f"{source}: spread_rule.factor is null; use a number >= 0 (2: twice the spread)")
        samples = {}
        for n, f in d["figures"].items():
            vals = f.get("values")
            if vals is not None:
                if not isinstance(vals, list) or not vals:
                    raise ValueError(f"{source}: figure {n}: values {vals!r}; use a non-empty list of numbers")
                samples[n] = tuple(float(v) for v in vals)
        return cls(machine_kind=d["machine_kind"], machine=d.get("machine", {}), created=d.get("created", ""),
                   bands={k: _band(v) for k, v in d["bands"].items()},
                   figures={n: Figure.from_json(n, f) for n, f in d["figures"].items()},
                   band_overrides={k: _band(v) for k, v in d.get("band_overrides", {}).items()},
                   samples=samples, runs=tuple(d.get("runs", ())),
                   spread_rule={"factor": factor, "floor": {k: _band(v) for k, v in rule.get("floor", {}).items()}})


def _band(v) -> Optional[float]:
    if v is None:
        return None
    v = float(v)
    if not v >= 0:
        raise ValueError(f"a noise band of {v} makes no sense; use a fraction >= 0 (0.25: 25% worse allowed) or null")
    return v


@dataclass(frozen=True)
class RecordedRun:
    """One good run to record: its figures and where it came from (date, commit, host, fingerprint,
    source)."""

    figures: Tuple[Figure, ...]
    info: Mapping = field(default_factory=dict)


def make_baseline(runs: Sequence[RecordedRun], machine_kind: str, machine: Mapping, created: str,
                  bands: Optional[Mapping[str, float]] = None, previous: Optional[Baseline] = None) -> Baseline:
    """A new baseline from these runs (one or more, of one machine kind): each figure's value is the
    median of its finite values in the runs; its unit, kind and role are the latest run's. Bands, the
    spread rule and per-figure overrides: given, else the previous file's (a person may have tuned
    them), else the defaults for CPU or GPU machines. Figures with no finite value are left out."""
    cls = "cpu" if machine_kind.startswith("cpu") else "gpu"
    if bands is None:
        bands = previous.bands if previous is not None else DEFAULT_BANDS[cls]
    empty = Baseline(machine_kind=machine_kind, machine=dict(machine), created=created, bands=dict(bands), figures={},
                     band_overrides=dict(previous.band_overrides) if previous is not None else {},
                     spread_rule=previous.spread_rule if previous is not None else DEFAULT_SPREAD_RULES[cls])
    for run in runs:
        empty = add_run(empty, run, machine, created)
    return empty


def add_run(baseline: Baseline, run: RecordedRun, machine: Mapping, created: str) -> Baseline:
    """`baseline` with one more recorded run: each figure measured in it gets this run's value (and
    this run's unit, kind and role), medians follow; the bands, rule and overrides stay."""
    latest = dict(baseline.figures)
    samples = {n: list(baseline.values(n)) for n in baseline.figures}
    for f in run.figures:
        if math.isfinite(f.value):
            latest[f.name] = f
            samples.setdefault(f.name, []).append(float(f.value))
    return replace(baseline, machine=dict(machine), created=created,
                   figures={n: replace(f, value=median(samples[n])) for n, f in latest.items()},
                   samples={n: tuple(v) for n, v in samples.items()}, runs=tuple(baseline.runs) + (dict(run.info),))


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


ROLE_NOTES = {"peer": "a peer's figure", "vs_peer": "ours relative to a peer"}


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
    role: str = "ours"
    basis: str = ""  # how the band was set ("2 x spread 29.0% over 3 runs", "one run", "override")

    @property
    def failed(self) -> bool:
        return self.verdict in FAILING

    @property
    def beyond_band(self) -> bool:
        return self.band is not None and self.worse is not None and self.worse > 1 + self.band + 1e-12

    def describe(self) -> str:
        if self.verdict == "missing":
            return f"{self.name}: in the baseline ({_fmt(self.baseline)} {self.unit}) but not measured in this run"
        if self.verdict == "new":
            return f"{self.name}: {_fmt(self.current)} {self.unit} (new, not in the baseline)"
        if self.current is None:
            return f"{self.name}: not measured in this run (baseline {_fmt(self.baseline)} {self.unit}) {self.verdict} ({self.note})"
        change = f"{(self.worse - 1) * 100:+.1f}% worse" if self.worse is not None and self.worse >= 1 else (
            f"{(1 / self.worse - 1) * 100:.1f}% better" if self.worse else "")
        band = f", band {self.band * 100:.0f}%" if self.band is not None else ""
        basis = f" ({self.basis})" if self.basis and band else ""
        note = f" ({self.note})" if self.note else ""
        return (f"{self.name}: {_fmt(self.current)} vs baseline {_fmt(self.baseline)} {self.unit} "
                f"[{change}{band}{basis}] {self.verdict}{note}")


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
    figures (time, throughput) are gated too. Figures whose role is not "ours" (this run's role, else
    the baseline's) are context: compared and reported, never failing."""
    current: Dict[str, Figure] = {}
    for f in figures:
        current[f.name] = f
    out: List[Comparison] = []
    for name in sorted(set(current) | set(baseline.figures)):
        cur, base = current.get(name), baseline.figures.get(name)
        role = (cur or base).role
        if cur is None:
            if role != "ours":
                out.append(Comparison(name, "context", None, base.value, None, None, base.unit, base.kind,
                                      ROLE_NOTES[role], role))
                continue
            gated = baseline.band_for(base) is not None and (
                base.kind in GATED_ACROSS_MACHINES or (same_machine and base.kind != "info"))
            out.append(Comparison(name, "missing" if gated else "not gated", None, base.value, None, None, base.unit,
                                  base.kind, "" if gated else "absolute figure from other hardware", role))
            continue
        if base is None:
            out.append(Comparison(name, "new", cur.value, None, None, None, cur.unit, cur.kind, role=role))
            continue
        band, basis = baseline.band_and_basis(cur)
        worse = worse_factor(cur.value, base.value, cur.better)
        judged = Comparison(name, "ok", cur.value, base.value, band, worse, cur.unit, cur.kind, "", role, basis)
        if role != "ours":
            beyond = ": beyond its band, not gated" if judged.beyond_band and cur.kind != "info" else ""
            out.append(replace(judged, verdict="context", note=ROLE_NOTES[role] + beyond))
            continue
        if cur.kind != "info" and band is None:
            out.append(replace(judged, verdict="not gated", note=f"no band for {cur.kind} figures in the baseline"))
            continue
        if cur.kind == "info":
            out.append(replace(judged, verdict="not gated", band=None, basis="", note="info"))
            continue
        if cur.kind not in GATED_ACROSS_MACHINES and not same_machine:
            out.append(replace(judged, verdict="not gated", note="absolute figure, baseline from other hardware"))
            continue
        if worse is None:
            out.append(replace(judged, verdict="regressed", note="not a finite number"))
        elif judged.beyond_band:
            out.append(replace(judged, verdict="regressed"))
        elif worse < 1 / (1 + band) - 1e-12:
            out.append(replace(judged, verdict="improved", note="consider recording a new baseline"))
        else:
            out.append(judged)
    return out
