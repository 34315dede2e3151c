"""What the nightly writes: JUnit XML (one test case per step and per gated figure), one JSON of every
figure with the machine, versions and date, a table a person reads at a glance, and a plot of layer
time vs tokens per rank per dispatcher (matplotlib when installed, else a plain SVG)."""

from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from epmoe.nightly.baseline import Comparison, Figure
from epmoe.nightly.steps import StepResult


def _clean(text: str) -> str:
    """XML 1.0 cannot carry most control characters (progress bars, colour codes)."""
    return "".join(ch for ch in text if ch in "\t\n\r" or ord(ch) >= 32)


def write_junit(path: str, results: Sequence[StepResult], comparisons: Sequence[Comparison],
                suite: str = "epmoe-nightly", properties: Optional[Mapping[str, str]] = None) -> None:
    cases = ET.Element("testsuite", name=suite)
    if properties:
        props = ET.SubElement(cases, "properties")
        for k, v in properties.items():
            ET.SubElement(props, "property", name=str(k), value=_clean(str(v)))
    n_fail = n_skip = 0
    total_s = 0.0
    for r in results:
        tc = ET.SubElement(cases, "testcase", classname=f"nightly.{r.step.group}", name=r.name, time=f"{r.seconds:.3f}")
        total_s += r.seconds
        if r.status == "skipped":
            n_skip += 1
            ET.SubElement(tc, "skipped", message=_clean(r.message))
        elif r.status in ("failed", "timed out"):
            n_fail += 1
            body = (r.fault_report + "\n\n" if r.fault_report else "") + r.output_tail[-3000:]
            el = ET.SubElement(tc, "failure", message=_clean(f"{r.status}: {r.message}"),
                               type="timeout" if r.status == "timed out" else "failure")
            el.text = _clean(body)
        if r.log_path:
            ET.SubElement(tc, "system-out").text = _clean(f"log: {r.log_path}\n" + r.output_tail[-2000:])
    for c in comparisons:
        tc = ET.SubElement(cases, "testcase", classname="nightly.gate", name=c.name, time="0")
        if c.failed:
            n_fail += 1
            ET.SubElement(tc, "failure", message=_clean(c.describe()), type=c.verdict)
        elif c.verdict in ("not gated", "context"):
            n_skip += 1
            ET.SubElement(tc, "skipped", message=_clean(c.describe()))
        else:
            ET.SubElement(tc, "system-out").text = _clean(c.describe())
    cases.set("tests", str(len(results) + len(comparisons)))
    cases.set("failures", str(n_fail))
    cases.set("errors", "0")
    cases.set("skipped", str(n_skip))
    cases.set("time", f"{total_s:.3f}")
    ET.ElementTree(cases).write(path, encoding="utf-8", xml_declaration=True)


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def write_json(path: str, *, machine: Mapping, args: Mapping, results: Sequence[StepResult],
               figures: Sequence[Figure], comparisons: Sequence[Comparison], baseline_path: str,
               baseline_note: str, verdict: str, extra: Optional[Mapping] = None) -> None:
    data = {
        "verdict": verdict,
        "machine": dict(machine),
        "args": dict(args),
        "baseline": {"path": baseline_path, "note": baseline_note},
        "steps": [{"name": r.name, "status": r.status, "seconds": round(r.seconds, 3), "returncode": r.returncode,
                   "message": r.message, "fault_report": r.fault_report, "log": r.log_path,
                   "figures": len(r.figures)} for r in results],
        "figures": {f.name: {"value": _finite(f.value), "unit": f.unit, "better": f.better, "kind": f.kind,
                             "step": f.step, "role": f.role} for f in figures},
        "comparison": [{"name": c.name, "verdict": c.verdict, "current": _finite(c.current),
                        "baseline": _finite(c.baseline), "band": c.band, "band_basis": c.basis,
                        "worse": _finite(c.worse), "kind": c.kind, "role": c.role, "note": c.note}
                       for c in comparisons],
    }
    if extra:
        data.update(extra)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def format_table(results: Sequence[StepResult], comparisons: Sequence[Comparison], verdict: str,
                 elapsed_s: float, max_gate_lines: int = 12) -> str:
    lines = []
    w = max([len(r.name) for r in results] + [4])
    lines.append(f"{'step'.ljust(w)}  {'status':>9}  {'time':>7}  note")
    lines.append("-" * (w + 40))
    for r in results:
        note = r.message if r.status != "passed" else (f"{len(r.figures)} figures" if r.figures else "")
        lines.append(f"{r.name.ljust(w)}  {r.status.upper() if r.status in ('failed', 'timed out') else r.status:>9}  "
                     f"{r.seconds:6.1f}s  {note[:160]}")
    counts: Dict[str, int] = {}
    for c in comparisons:
        counts[c.verdict] = counts.get(c.verdict, 0) + 1
    if comparisons:
        lines.append("")
        lines.append("gate: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
        bad = [c for c in comparisons if c.failed]
        # then peers' figures that moved beyond their band (context: why a ratio against them moved), then
        # our improvements
        moved = [c for c in comparisons if c.verdict == "context" and c.beyond_band]
        shown = bad + (moved + [c for c in comparisons if c.verdict == "improved"])[: max(0, max_gate_lines - len(bad))]
        for c in shown:
            lines.append(("  FAIL " if c.failed else "  peer " if c.verdict == "context" else "  note ") + c.describe())
    lines.append("")
    n_steps_bad = sum(r.status in ("failed", "timed out") for r in results)
    lines.append(f"NIGHTLY {verdict.upper()} in {elapsed_s:.0f} s: {sum(r.status == 'passed' for r in results)} steps "
                 f"passed, {n_steps_bad} failed, {sum(r.status == 'skipped' for r in results)} skipped; "
                 f"{sum(c.failed for c in comparisons)} figures beyond their band")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plot
def layer_series(bench_rows: Sequence[Mapping]) -> Dict[str, List[Tuple[int, float]]]:
    """{label: [(tokens per rank, ms)]}: one line per dispatcher's layer, one per plain baseline."""
    series: Dict[str, List[Tuple[int, float]]] = {}
    for r in bench_rows:
        series.setdefault(f"epmoe layer, {r['dispatcher']}", []).append((r["tokens_per_rank"], r["layer_ms"]))
        series.setdefault(f"plain baseline ({r['dispatcher']} run)", []).append((r["tokens_per_rank"], r["baseline_ms"]))
    return {k: sorted(v) for k, v in series.items()}


def plot_layer(path_stem: str, series: Mapping[str, List[Tuple[int, float]]], title: str) -> Tuple[Optional[str], str]:
    """Writes path_stem.png with matplotlib, else path_stem.svg. Returns (path or None, note)."""
    pts = [p for s in series.values() for p in s if p[0] > 0 and p[1] > 0]
    if not pts:
        return None, "no layer timings to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = path_stem + ".svg"
        _svg_plot(path, series, title)
        return path, "matplotlib is not installed: wrote a plain SVG plot instead (pip install matplotlib for PNG)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, s in series.items():
        s = [p for p in s if p[0] > 0 and p[1] > 0]
        if s:
            ax.plot(*zip(*s), "--o" if label.startswith("plain") else "-s", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("layer time (ms, slowest rank, median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = path_stem + ".png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, ""


def _svg_plot(path: str, series: Mapping[str, List[Tuple[int, float]]], title: str) -> None:
    W, H, L, R, T, B = 760, 420, 70, 230, 40, 50
    pts = [p for s in series.values() for p in s if p[0] > 0 and p[1] > 0]
    lx = [math.log2(p[0]) for p in pts]
    ly = [math.log10(p[1]) for p in pts]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1
    y0, y1 = min(ly), max(ly) if max(ly) > min(ly) else min(ly) + 1
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad

    def X(t):
        return L + (math.log2(t) - x0) / (x1 - x0) * (W - L - R)

    def Y(ms):
        return H - B - (math.log10(ms) - y0) / (y1 - y0) * (H - T - B)

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="12">{_esc(title)}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">tokens per rank</text>',
           f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" text-anchor="middle">'
           'layer time (ms, log)</text>']
    for t in sorted({p[0] for p in pts}):
        out.append(f'<text x="{X(t):.1f}" y="{H - B + 15}" text-anchor="middle">{t}</text>')
    for k in range(5):
        v = 10 ** (y0 + (y1 - y0) * k / 4)
        out.append(f'<text x="{L - 5}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        out.append(f'<line x1="{L}" y1="{Y(v):.1f}" x2="{W - R}" y2="{Y(v):.1f}" stroke="#ddd"/>')
    for i, (label, s) in enumerate(series.items()):
        s = [p for p in s if p[0] > 0 and p[1] > 0]
        if not s:
            continue
        c = colors[i % len(colors)]
        dash = ' stroke-dasharray="5,3"' if label.startswith("plain") else ""
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="'
                   + " ".join(f"{X(t):.1f},{Y(ms):.1f}" for t, ms in s) + '"/>')
        out += [f'<circle cx="{X(t):.1f}" cy="{Y(ms):.1f}" r="3" fill="{c}"/>' for t, ms in s]
        out.append(f'<text x="{W - R + 10}" y="{T + 15 * i + 10}" fill="{c}">{_esc(label)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
