"""The nightly's baseline/compare logic, reports and step runner (fast, no process groups): the gate
judges every figure by its kind and band; a step past its limit is killed with everything it started
and reported with the fault report it printed; JUnit XML is well formed and counts right."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from epmoe.nightly import baseline as B
from epmoe.nightly.cli import bench_figures, count_figures, experts_figures, plan_steps
from epmoe.nightly.report import format_table, layer_series, plot_layer, write_junit
from epmoe.nightly.steps import Runner, Step, StepResult, _alive, extract_fault_reports, run_step


def _base(figs, bands=None, fingerprint="m1", overrides=None):
    return B.Baseline("cpu", {"fingerprint": fingerprint}, "2026-12-01", bands or B.DEFAULT_BANDS["gpu"],
                      {f.name: f for f in figs}, overrides or {})


def _verdicts(comps):
    return {c.name: c.verdict for c in comps}


def test_ratio_band_lower_is_better():
    base = _base([B.Figure("r", 2.0, kind="ratio")])  # band 0.25
    assert _verdicts(B.compare([B.Figure("r", 2.49, kind="ratio")], base, True)) == {"r": "ok"}
    assert _verdicts(B.compare([B.Figure("r", 2.51, kind="ratio")], base, True)) == {"r": "regressed"}
    assert _verdicts(B.compare([B.Figure("r", 1.59, kind="ratio")], base, True)) == {"r": "improved"}
    assert _verdicts(B.compare([B.Figure("r", 1.61, kind="ratio")], base, True)) == {"r": "ok"}


def test_higher_is_better_and_worse_factor():
    base = _base([B.Figure("g", 100.0, better="higher", kind="ratio")])
    c = B.compare([B.Figure("g", 79.0, better="higher", kind="ratio")], base, False)[0]
    assert c.verdict == "regressed" and c.failed and math.isclose(c.worse, 100 / 79)
    assert "worse" in c.describe() and "band 25%" in c.describe()
    assert B.compare([B.Figure("g", 81.0, better="higher", kind="ratio")], base, False)[0].verdict == "ok"
    assert B.worse_factor(0.0, 0.0, "lower") == 1.0 and B.worse_factor(1.0, 0.0, "lower") == math.inf
    assert B.worse_factor(float("nan"), 1.0, "lower") is None


def test_absolute_figures_gated_only_on_the_same_hardware():
    base = _base([B.Figure("t", 1.0, unit="ms", kind="time")])  # band 0.5
    slow = [B.Figure("t", 10.0, unit="ms", kind="time")]
    assert B.compare(slow, base, same_machine=True)[0].verdict == "regressed"
    c = B.compare(slow, base, same_machine=False)[0]
    assert c.verdict == "not gated" and not c.failed and "other hardware" in c.note


def test_bytes_and_count_have_no_band():
    base = _base([B.Figure("b", 1000, kind="bytes"), B.Figure("c.passed", 1, better="higher", kind="count")])
    v = _verdicts(B.compare([B.Figure("b", 1001, kind="bytes"), B.Figure("c.passed", 0, better="higher", kind="count")],
                            base, False))
    assert v == {"b": "regressed", "c.passed": "regressed"}
    v = _verdicts(B.compare([B.Figure("b", 1000, kind="bytes"), B.Figure("c.passed", 1, better="higher", kind="count")],
                            base, False))
    assert v == {"b": "ok", "c.passed": "ok"}


def test_missing_new_info_nonfinite_and_overrides():
    base = _base([B.Figure("gone", 1.0), B.Figure("abs_gone", 1.0, kind="time"), B.Figure("i", 1.0, kind="info"),
                  B.Figure("nan", 1.0), B.Figure("loose", 1.0)], overrides={"loose": 3.0})
    cur = [B.Figure("i", 50.0, kind="info"), B.Figure("fresh", 2.0), B.Figure("nan", float("nan")),
           B.Figure("loose", 3.9)]
    v = _verdicts(B.compare(cur, base, same_machine=False))
    assert v == {"gone": "missing", "abs_gone": "not gated", "i": "not gated", "fresh": "new", "nan": "regressed",
                 "loose": "ok"}


def test_baseline_round_trip_and_bad_files(tmp_path):
    figs = [B.Figure("a", 1.5, "x", "lower", "ratio", "bench/layer"), B.Figure("z", float("inf")),
            B.Figure("b", 7.0, "GB/s", "higher", "throughput", "bench/layer")]
    base = B.make_baseline([B.RecordedRun(tuple(figs))], "cpu", {"fingerprint": "m"}, "2026-12-01")
    assert set(base.figures) == {"a", "b"} and base.bands == B.DEFAULT_BANDS["cpu"]  # non-finite left out
    path = str(tmp_path / "sub" / "cpu.json")
    B.save_baseline(base, path)
    again = B.load_baseline(path)
    assert again == base
    # bands a person tuned survive an update
    tuned = B.Baseline.from_json(dict(base.to_json(), bands={"ratio": 0.1}))
    assert B.make_baseline([B.RecordedRun(tuple(figs))], "cpu", {}, "d", previous=tuned).bands == {"ratio": 0.1}
    assert B.load_baseline(str(tmp_path / "none.json")) is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*--update-baseline"):
        B.load_baseline(str(tmp_path / "bad.json"))
    (tmp_path / "nokind.json").write_text(json.dumps({"figures": {}, "bands": {}}))
    with pytest.raises(ValueError, match="machine_kind"):
        B.load_baseline(str(tmp_path / "nokind.json"))
    with pytest.raises(ValueError, match="unknown kinds"):
        B.Baseline.from_json({"machine_kind": "x", "figures": {}, "bands": {"speed": 1}})
    with pytest.raises(ValueError, match="better"):
        B.Figure("f", 1.0, better="up")


def test_bench_and_experts_figures():
    rows = {"rows": [{"dispatcher": "torch", "tokens_per_rank": 64, "baseline_ms": 2.0, "layer_ms": 1.0,
                      "layer_vs_baseline": 0.5, "dispatch_us": 10.0, "combine_us": 5.0,
                      "dispatch_bytes_max_rank": 4096, "dispatch_gbps": 0.4}]}
    figs = {f.name: f for f in bench_figures(rows)}
    assert figs["layer.torch.T64.vs_baseline"].kind == "ratio" and figs["layer.torch.T64.vs_baseline"].value == 0.5
    assert figs["dispatch.torch.T64.bytes"].kind == "bytes" and figs["dispatch.torch.T64.GBps"].better == "higher"
    ex = {"results": [
        {"run": {"backend": "torch_loop", "mode": "bf16", "phase": "decode", "preset": "auto"}, "ms": 10.0, "pct_matmul": 5.0},
        {"run": {"backend": "triton", "mode": "bf16", "phase": "decode", "preset": "auto"}, "ms": 2.0, "pct_matmul": 40.0},
        {"run": {"backend": "triton", "mode": "fp8_block", "phase": "decode", "preset": "auto"}, "ms": float("nan"),
         "pct_matmul": float("nan")}]}
    figs = {f.name: f for f in experts_figures(ex)}
    assert figs["experts.triton.bf16.decode.vs_torch_loop"].value == 0.2
    assert figs["experts.triton.bf16.decode.pct_matmul"].better == "higher"
    assert not any("fp8_block" in n for n in figs)  # a failed run gives no figure (the gate calls it missing)


def test_fault_report_extraction():
    text = textwrap.dedent("""\
        noise
        [rank0]: epmoe fault report: layer 'EPMoE[x]#1', call 3, phase 'dispatch': rank 0 timed out after 3 s waiting on ranks [1]
          rank 0: timed out in call 3, phase 'dispatch': ...
          rank 1: no report: alive elsewhere or gone
        more noise
        epmoe fault report: layer 'EPMoE[x]#1', call 3, phase 'dispatch': rank 0 timed out after 3 s waiting on ranks [1]
          rank 0: timed out in call 3, phase 'dispatch': ...
          rank 1: no report: alive elsewhere or gone
        """)
    blocks = extract_fault_reports(text)
    assert len(blocks) == 1 and blocks[0].startswith("epmoe fault report:") and blocks[0].count("\n") == 2


def test_hung_step_is_killed_with_its_children_and_reported(tmp_path):
    """A step that prints a fault report and then hangs (with a child of its own in another session, as
    torchrun's workers are) is stopped at its limit; nothing it started survives."""
    pidfile = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("epmoe fault report: layer 'L', call 1, phase 'combine': rank 0 timed out after 1 s waiting on ranks [1]")
        print("  rank 1: no report: alive elsewhere or gone", flush=True)
        time.sleep(600)
    """)
    t0 = time.monotonic()
    r = run_step(Step("bench/hang", (sys.executable, "-c", code), limit_s=3.0), str(tmp_path))
    assert time.monotonic() - t0 < 15
    assert r.status == "timed out" and "limit of 3 s" in r.message
    assert r.fault_report.startswith("epmoe fault report: layer 'L'") and "rank 1: no report" in r.fault_report
    child = int(pidfile.read_text())
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "the hung step's child survived"


def test_step_statuses(tmp_path):
    py = sys.executable
    ok = run_step(Step("a/ok", (py, "-c", "print('hi')")), str(tmp_path))
    bad = run_step(Step("a/bad", (py, "-c", "import sys; print('error: bad value 3; use 4'); sys.exit(2)")), str(tmp_path))
    refused = run_step(Step("a/refused", (py, "-c", "import sys; print('BackendUnavailableError: x'); sys.exit(1)"),
                            skip_if_output=("BackendUnavailableError",)), str(tmp_path))
    skipped = run_step(Step("a/skip", (py, "-c", ""), skip="needs a GPU"), str(tmp_path))
    unreadable = run_step(Step("a/figs", (py, "-c", ""), figures=lambda res: json.load(open("/nonexistent"))), str(tmp_path))
    assert ok.status == "passed" and os.path.exists(ok.log_path)
    assert bad.status == "failed" and bad.returncode == 2 and "error: bad value 3; use 4" in bad.message
    assert refused.status == "skipped" and "refused here" in refused.message
    assert skipped.status == "skipped" and skipped.message == "needs a GPU"
    assert unreadable.status == "failed" and "could not be read" in unreadable.message


def test_runner_progress_order_and_budget(tmp_path):
    import io

    out = io.StringIO()
    py = sys.executable
    steps = [Step(f"correctness/{i}", (py, "-c", "import time; time.sleep(0.3)"), parallel=True) for i in range(3)]
    steps.append(Step("bench/x", (py, "-c", "")))
    results = Runner(str(tmp_path), jobs=2, out=out).run(steps)
    assert [r.name for r in results] == [s.name for s in steps] and all(r.status == "passed" for r in results)
    log = out.getvalue()
    assert "step 4/4 start  bench/x" in log and log.count("passed") == 4 and "[4/4 done]" in log
    # the suite's budget spent: the step is not run and fails (a run cut short must not pass, nor record
    # a baseline without its figures); a step the budget cuts short is killed and says why
    late = Runner(str(tmp_path), deadline=time.monotonic() - 1, out=io.StringIO(), budget="--max-minutes 3").run(
        [Step("soak/x", (py, "-c", "")), Step("bench/y", (py, "-c", ""), skip="needs a GPU")])
    assert late[0].status == "timed out" and late[0].seconds == 0
    assert late[0].message == "not started: the suite's time budget (--max-minutes 3) was spent; raise --max-minutes"
    assert late[1].status == "skipped" and late[1].message == "needs a GPU"  # not runnable here stays skipped
    cut = Runner(str(tmp_path), deadline=time.monotonic() + 2, out=io.StringIO(), budget="--max-minutes 0.5").run(
        [Step("bench/z", (py, "-c", "import time; time.sleep(30)"), limit_s=240)])
    assert cut[0].status == "timed out" and cut[0].seconds < 15, cut[0]
    assert cut[0].message.startswith("killed when the suite's time budget (--max-minutes 0.5) ran out, 2 s after it "
                                     "started (its own limit: 240 s); raise --max-minutes; it printed no fault report")


def test_junit_table_and_plot(tmp_path):
    results = [
        StepResult(Step("correctness/torch/bf16"), "passed", 1.0, 0, "", "", "", "", []),
        StepResult(Step("bench/layer"), "timed out", 9.0, None, "/x.log", "killed after its limit of 9 s",
                   "epmoe fault report: layer 'L'\n  rank 1: no report", "tail\x1b[0m\x07"),
        StepResult(Step("bench/experts"), "skipped", 0.0, message="needs a CUDA GPU"),
    ]
    base = _base([B.Figure("r", 1.0), B.Figure("t", 1.0, kind="time")])
    comps = B.compare([B.Figure("r", 2.0), B.Figure("t", 1.0, kind="time")], base, False)
    path = str(tmp_path / "junit.xml")
    write_junit(path, results, comps, properties={"machine_kind": "cpu"})
    suite = ET.parse(path).getroot()
    assert suite.get("tests") == "5" and suite.get("failures") == "2" and suite.get("skipped") == "2"
    fail = suite.find("testcase[@name='bench/layer']/failure")
    assert fail.get("type") == "timeout" and "rank 1: no report" in fail.text
    assert suite.find("testcase[@name='r']/failure").get("type") == "regressed"
    table = format_table(results, comps, "failed", 10.0)
    assert "TIMED OUT" in table and "FAIL r:" in table and table.rstrip().splitlines()[-1].startswith("NIGHTLY FAILED")
    series = layer_series([{"dispatcher": "torch", "tokens_per_rank": t, "layer_ms": t / 10, "baseline_ms": t / 5}
                           for t in (16, 64, 256)])
    p, note = plot_layer(str(tmp_path / "plot"), series, "title <x>")
    assert p and os.path.getsize(p) > 0
    if p.endswith(".svg"):
        ET.parse(p)  # well-formed
        assert "matplotlib" in note
    assert plot_layer(str(tmp_path / "empty"), {}, "t") == (None, "no layer timings to plot")


def _args(**kw):
    d = dict(gpus=0, ranks_per_gpu=1, cpu_ranks=2, limit_scale=1.0, collective_timeout=60.0, only=None,
             dispatchers=None, modes=None, bench_tokens=None, iters=None, soak_steps=None, plant_sleep_ms=None,
             plant_dispatcher=None, availability=lambda d, g, r: "", mode_refusal=lambda d, m, a, w, shape, experts="auto": "")
    d.update(kw)
    return SimpleNamespace(**d)


def test_plan_steps_cpu_and_shared_gpu(tmp_path):
    steps = plan_steps(_args(), {"arch": "cpu"}, str(tmp_path))
    names = [s.name for s in steps]
    assert names == ["correctness/torch/bf16", "correctness/torch/fp8_block", "correctness/torch/nvfp4_w4a4",
                     "correctness/launch/torch", "bench/layer/torch", "bench/experts", "soak/short"]
    assert "--nproc-per-node" in steps[0].argv and steps[0].argv[steps[0].argv.index("--nproc-per-node") + 1] == "2"
    assert steps[5].skip  # expert stage: GPU only
    # 4 ranks on one GPU: world 4 everywhere; unavailable dispatchers and refused modes skipped with the reason
    avail = {"torch": "", "flashinfer": "", "deepep": "unavailable: deep_ep is not installed", "deepep_ll": "unavailable: x"}
    steps = plan_steps(_args(gpus=1, ranks_per_gpu=4, plant_sleep_ms="7", availability=lambda d, g, r: avail[d],
                             mode_refusal=lambda d, m, a, w, shape, experts="auto": (
                                 "needs sm100" if m == "mxfp8" else "module not prebuilt"
                                 if experts == "flashinfer_cutlass" and m == "fp8_block" else "")),
                       {"arch": "sm90"}, str(tmp_path))
    by = {s.name: s for s in steps}
    w = by["correctness/flashinfer/bf16+nvfp4"].argv
    assert w[w.index("--nproc-per-node") + 1] == "4" and w[w.index("--ranks-per-gpu") + 1] == "4"
    assert w[w.index("--dispatch-dtype") + 1] == "nvfp4" and w[w.index("--quant") + 1] == "none"
    assert by["correctness/torch/mxfp8"].skip == "needs sm100"
    assert by["correctness/deepep/bf16"].skip.startswith("unavailable")
    b, f = by["bench/layer/torch"], by["bench/layer/flashinfer"]
    assert b.argv[b.argv.index("--dispatchers") + 1] == "torch" and f.argv[f.argv.index("--dispatchers") + 1] == "flashinfer"
    assert ("EPMOE_NIGHTLY_PLANT_SLEEP_MS", "7") in b.env  # the plant slows the first runnable dispatcher only
    assert not any(k.startswith("EPMOE_NIGHTLY_PLANT") for k, _ in f.env)
    assert by["bench/layer/deepep"].skip.startswith("unavailable")
    assert not by["bench/experts"].skip or "not found" in by["bench/experts"].skip
    # FlashInfer CUTLASS: every sm90 mode per dispatcher, the experts backend named, refusals skipped
    c = by["correctness/cutlass/torch/mxfp4_w4a8"].argv
    assert c[c.index("--experts") + 1] == "flashinfer_cutlass" and c[c.index("--quant") + 1] == "mxfp4_w4a8"
    assert not by["correctness/cutlass/flashinfer/bf16"].skip
    assert by["correctness/cutlass/torch/fp8_block"].skip == "module not prebuilt"
    assert by["correctness/cutlass/deepep/bf16"].skip.startswith("unavailable")


def test_count_figures_per_case():
    rs = [StepResult(Step("correctness/torch/bf16"), "passed"), StepResult(Step("correctness/deepep/bf16"), "skipped"),
          StepResult(Step("bench/layer"), "passed")]
    assert {f.name: f.value for f in count_figures(rs)} == {"correctness.torch.bf16.passed": 1.0,
                                                            "correctness.deepep.bf16.passed": 0.0}


def test_cpu_bands_leave_absolute_figures_ungated():
    base = _base([B.Figure("t", 1.0, kind="time"), B.Figure("r", 1.0)], bands=B.DEFAULT_BANDS["cpu"])
    v = _verdicts(B.compare([B.Figure("t", 9.0, kind="time"), B.Figure("r", 2.1)], base, same_machine=True))
    assert v == {"t": "not gated", "r": "regressed"}
    assert _verdicts(B.compare([], base, same_machine=True)) == {"t": "not gated", "r": "missing"}
    with pytest.raises(ValueError, match="noise band"):
        B.Baseline.from_json({"machine_kind": "x", "figures": {}, "bands": {"ratio": -1}})


def test_selection_typos_are_errors_not_skips():
    from epmoe.nightly.cli import validate_selection

    assert validate_selection("torch,flashinfer", "bf16,fp8_block,bf16+nvfp4", "bench,soak") == ""
    assert "unknown dispatcher 'nccl'" in validate_selection("nccl", None, None)
    assert "unknown mode 'fp8'" in validate_selection(None, "fp8", None)
    assert "unknown mode 'bf16+int4'" in validate_selection(None, "bf16+int4", None)
    assert "unknown step group 'benchmarks'" in validate_selection(None, None, "benchmarks")


def test_committed_cpu_baseline_matches_the_cpu_plan(tmp_path):
    """Every figure of benchmarks/baselines/cpu.json belongs to a step the CPU subset still runs (a
    renamed step would silently drop its figures from the gate)."""
    from epmoe.nightly.cli import REPO

    base = B.load_baseline(str(REPO / "benchmarks" / "baselines" / "cpu.json"))
    names = {s.name for s in plan_steps(_args(), {"arch": "cpu"}, str(tmp_path)) if not s.skip}
    assert base is not None and base.machine_kind == "cpu" and base.bands == B.DEFAULT_BANDS["cpu"]
    assert {f.step for f in base.figures.values()} == names
    assert any(f.kind == "ratio" for f in base.figures.values())


# ---------------------------------------------------------------------------- bands from runs, peers
def _run(*figs, **info):
    return B.RecordedRun(tuple(figs), info)


def _verdict(base, fig, same_machine=True):
    return next(c.verdict for c in B.compare([fig], base, same_machine) if c.name == fig.name)


def test_band_from_the_spread_of_recorded_runs(tmp_path):
    """A figure recorded in several runs gets max(floor, 2 x spread) around the runs' median; one recorded
    once keeps its kind's band; bytes and counts stay exact; an override wins; the file keeps it all."""
    runs = [_run(B.Figure("r", r), B.Figure("tight", t), B.Figure("b", 100.0, kind="bytes"),
                 B.Figure("t", ms, unit="ms", kind="time"), date=f"d{i}")
            for i, (r, t, ms) in enumerate(((1.0, 1.0, 1.0), (1.2, 1.01, 3.0), (1.1, 1.005, 2.0)))]
    runs[0] = _run(*runs[0].figures, B.Figure("once", 1.0), date="d0")
    base = B.make_baseline(runs, "h200x1", {"fingerprint": "m"}, "2026-12-04")
    assert base.values("r") == (1.0, 1.2, 1.1) and base.figures["r"].value == 1.1 and len(base.runs) == 3
    band, basis = base.band_and_basis(base.figures["r"])
    assert math.isclose(band, 0.4) and basis == "2 x spread 20.0% over 3 runs"
    assert _verdict(base, B.Figure("r", 1.1 * 1.39), True) == "ok"
    assert _verdict(base, B.Figure("r", 1.1 * 1.41), True) == "regressed"
    # 1 % apart: the floor (GPU ratio 0.15)
    band, basis = base.band_and_basis(base.figures["tight"])
    assert band == B.DEFAULT_SPREAD_RULES["gpu"]["floor"]["ratio"] == 0.15 and basis.startswith("floor; spread 1.0%")
    assert _verdict(base, B.Figure("tight", 1.005 * 1.14), True) == "ok"
    assert _verdict(base, B.Figure("tight", 1.005 * 1.16), True) == "regressed"
    # time 1 / 2 / 3 ms: spread 2.0 -> band 4.0 on the same machine, not gated on other hardware
    assert math.isclose(base.band_for(base.figures["t"]), 4.0)
    assert _verdict(base, B.Figure("t", 9.9, kind="time"), True) == "ok"
    assert _verdict(base, B.Figure("t", 10.1, kind="time"), True) == "regressed"
    assert _verdict(base, B.Figure("t", 10.1, kind="time"), False) == "not gated"
    assert base.band_and_basis(base.figures["once"]) == (0.25, "one run")  # no spread: the one-run band
    assert base.band_for(base.figures["b"]) == 0.0
    loose = B.Baseline.from_json(dict(base.to_json(), band_overrides={"r": 0.05}))
    assert loose.band_and_basis(loose.figures["r"]) == (0.05, "override")
    # a run added later widens what it moves
    wider = B.add_run(base, _run(B.Figure("tight", 1.3), date="d3"), {"fingerprint": "m"}, "2026-12-05")
    assert wider.values("tight") == (1.0, 1.01, 1.005, 1.3) and len(wider.runs) == 4 and wider.values("r") == base.values("r")
    assert math.isclose(wider.band_for(wider.figures["tight"]), 0.6)
    path = str(tmp_path / "b.json")
    B.save_baseline(wider, path)
    again = B.load_baseline(path)
    assert again == wider and json.loads(open(path).read())["format"] == B.FORMAT
    # spreads need positive finite values; a bad spread rule in a file is refused
    assert B.spread([1.0]) is None and B.spread([0.0, 1.0]) is None and B.spread([2.0, 1.0]) == 1.0
    with pytest.raises(ValueError, match="spread_rule.floor has unknown kinds"):
        B.Baseline.from_json(dict(base.to_json(), spread_rule={"factor": 2, "floor": {"speed": 0.1}}))
    with pytest.raises(ValueError, match="noise band of -1"):
        B.Baseline.from_json(dict(base.to_json(), spread_rule={"factor": -1, "floor": {}}))
    with pytest.raises(ValueError, match="values"):
        B.Baseline.from_json(dict(base.to_json(), figures={"r": {"value": 1.0, "values": []}}))
    with pytest.raises(ValueError, match="newer than this epmoe"):
        B.Baseline.from_json(dict(base.to_json(), format=B.FORMAT + 1))


def test_one_run_baseline_files_still_read(tmp_path):
    """A baseline file of the first format (one run: no values, runs or spread rule) reads as one run:
    the kind's bands, as before."""
    from epmoe.nightly.cli import REPO

    old = B.load_baseline(str(REPO / "benchmarks" / "baselines" / "cpu.json"))
    assert "format" not in json.loads((REPO / "benchmarks" / "baselines" / "cpu.json").read_text())
    f = old.figures["layer.torch.T64.vs_baseline"]
    assert old.values(f.name) == (f.value,) and old.band_and_basis(f) == (1.0, "one run")
    assert old.spread_rule == B.DEFAULT_SPREAD_RULES["cpu"] and old.runs == ()


def _experts_json(loop_scale=1.0, triton_scale=1.0):
    """A bench_experts.json of the nightly's backends: triton and the torch loop, decode and prefill."""
    rows = []
    for backend, scale in (("triton", triton_scale), ("torch_loop", loop_scale)):
        for phase, ms, pct in (("decode", 1.0, 14.0), ("prefill", 3.0, 66.0)):
            if backend == "torch_loop":
                ms, pct = ms * 6, pct / 6
            rows.append({"run": {"backend": backend, "mode": "bf16", "phase": phase, "preset": "auto"},
                         "ms": ms * scale, "pct_matmul": pct / scale})
    return {"results": rows}


def test_a_peers_slowdown_alone_does_not_fail_the_gate():
    """The torch loop (a peer, host-bound) 31% slower or 2x faster, and so our figures relative to it 2x
    worse: reported as context, the gate passes. Our own figure 30% slower fails it."""
    base = B.make_baseline([_run(*experts_figures(_experts_json())), _run(*experts_figures(_experts_json(1.02)))],
                           "h200x1", {"fingerprint": "m"}, "d")
    roles = {f.name: f.role for f in base.figures.values()}
    assert roles["experts.torch_loop.bf16.prefill.pct_matmul"] == "peer"
    assert roles["experts.triton.bf16.prefill.vs_torch_loop"] == "vs_peer"
    assert roles["experts.triton.bf16.prefill.pct_matmul"] == "ours"
    # the loop 31% slower: its own figures move; 2x faster: ours relative to it look 2x worse
    for loop_scale, moved in ((1.31, "experts.torch_loop.bf16.prefill.pct_matmul"),
                              (0.5, "experts.triton.bf16.prefill.vs_torch_loop")):
        comps = B.compare(experts_figures(_experts_json(loop_scale=loop_scale)), base, True)
        assert not any(c.failed for c in comps), [c.describe() for c in comps if c.failed]
        ctx = {c.name: c for c in comps if c.verdict == "context"}
        assert set(ctx) == {n for n, r in roles.items() if r != "ours"}
        assert ctx[moved].beyond_band and "beyond its band, not gated" in ctx[moved].note
        table = format_table([], comps, "passed", 1.0)
        assert f"  peer {moved}" in table and table.rstrip().endswith("0 figures beyond their band")
    # a peer's figure that this run did not measure is context, not missing
    ours_only = [f for f in experts_figures(_experts_json()) if f.role == "ours"]
    assert {c.verdict for c in B.compare(ours_only, base, True) if c.role != "ours"} == {"context"}
    comps = B.compare(experts_figures(_experts_json(loop_scale=1.31, triton_scale=1.3)), base, True)
    assert {c.name for c in comps if c.failed} == {"experts.triton.bf16.decode.pct_matmul",
                                                   "experts.triton.bf16.prefill.pct_matmul"}  # times: band 50%
    # the plain EP MoE's own times are a peer's too; our layer against it gates
    rows = {"rows": [{"dispatcher": "torch", "tokens_per_rank": 64, "baseline_ms": 2.0, "layer_ms": 1.0,
                      "layer_vs_baseline": 0.5, "dispatch_us": 10.0, "combine_us": 5.0,
                      "dispatch_bytes_max_rank": 4096, "dispatch_gbps": 0.4}]}
    assert {f.name: f.role for f in bench_figures(rows)}["layer.torch.T64.baseline_ms"] == "peer"
    assert {f.name: f.role for f in bench_figures(rows)}["layer.torch.T64.vs_baseline"] == "ours"


def _nightly_figures(path):
    from epmoe.nightly.cli import figure_role

    data = json.loads(path.read_text())
    return [B.Figure.from_json(n, f, role=figure_role(n)) for n, f in data["figures"].items() if f["value"] is not None]


def test_committed_h200_baseline_catches_the_planted_slowdown_and_passes_clean_runs():
    """benchmarks/baselines/h200x1-4ranks.json (three H200 runs, docs/nightly.md): the recorded run
    with a 50 ms planted sleep in the torch dispatcher's layer fails it; a clean later run passes, also
    with the torch loop's prefill at 21.07 % of matmul (the 2026-12-04 figure that failed the
    one-run baseline)."""
    from epmoe.nightly.cli import REPO

    base = B.load_baseline(str(REPO / "benchmarks" / "baselines" / "h200x1-4ranks.json"))
    assert len(base.runs) == 3 and all((REPO / r["source"]).exists() for r in base.runs)
    results = REPO / "docs" / "results"

    def judge(figs):
        steps = {f.step for f in figs}
        b = dataclasses.replace(base, figures={n: f for n, f in base.figures.items() if f.step in steps})
        return B.compare(figs, b, same_machine=True)

    planted = judge(_nightly_figures(results / "h200-2026-12-01" / "nightly" / "plant_nightly.json"))
    assert {c.name for c in planted if c.failed} == {f"layer.torch.T{t}.{k}" for t in (64, 256, 1024)
                                                     for k in ("ms", "vs_baseline")}
    later = _nightly_figures(results / "h200-2026-12-01b" / "nightly" / "nightly.json")
    assert not [c.describe() for c in judge(later) if c.failed]
    dec4 = [dataclasses.replace(f, value=21.07) if f.name == "experts.torch_loop.bf16.prefill.pct_matmul" else f
            for f in later]
    comps = judge(dec4)
    assert not [c.describe() for c in comps if c.failed]
    c = next(c for c in comps if c.name == "experts.torch_loop.bf16.prefill.pct_matmul")
    assert c.verdict == "context" and c.beyond_band and c.role == "peer"


def test_committed_h100_baseline_gates_the_deepgemm_rows():
    """benchmarks/baselines/h100x1-4ranks.json (three H100 runs of one commit, docs/nightly.md): each
    recorded run passes it; the deepgemm fp8_block prefill 1.5x slower in the last run fails it; the
    run of another H100 host (h100-2026-12-07c) fails only the four host-bound torch-dispatcher
    figures at 64 tokens per rank."""
    from epmoe.nightly.cli import REPO

    base = B.load_baseline(str(REPO / "benchmarks" / "baselines" / "h100x1-4ranks.json"))
    assert base.machine_kind == "h100x1-4ranks" and len(base.runs) == 3
    assert all((REPO / r["source"]).exists() for r in base.runs)
    results = REPO / "docs" / "results"
    runs = [_nightly_figures(results / "h100-2026-12-07d" / "nightly" / f"r{i}" / "nightly.json") for i in (1, 2, 3)]
    for figs in runs:
        assert not [c.describe() for c in B.compare(figs, base, same_machine=True) if c.failed]
    gated = {c.name for c in B.compare(runs[-1], base, same_machine=True) if c.verdict == "ok"}
    assert {f"experts.deepgemm.{m}.{p}.{k}" for m in ("fp8_block", "bf16") for p in ("prefill", "decode", "decode.masked")
            for k in ("ms", "pct_matmul")} <= gated

    def slower(f):
        if f.name == "experts.deepgemm.fp8_block.prefill.ms":
            return dataclasses.replace(f, value=f.value * 1.5)
        if f.name == "experts.deepgemm.fp8_block.prefill.pct_matmul":
            return dataclasses.replace(f, value=f.value / 1.5)
        return f

    failed = {c.name for c in B.compare([slower(f) for f in runs[-1]], base, same_machine=True) if c.failed}
    assert failed == {"experts.deepgemm.fp8_block.prefill.ms", "experts.deepgemm.fp8_block.prefill.pct_matmul"}
    other_host = _nightly_figures(results / "h100-2026-12-07c" / "nightly" / "nightly.json")
    failed = {c.name for c in B.compare(other_host, base, same_machine=True) if c.failed}
    assert failed == {"layer.torch.T64.ms", "dispatch.torch.T64.dispatch_us", "dispatch.torch.T64.combine_us",
                      "dispatch.torch.T64.GBps"}


def _nightly_json(path, kind="h200x1", figures=None, steps=(), planted=None, args=None):
    data = {"machine": {"machine_kind": kind, "date": path.stem, "epmoe_commit": "abc", "host": "h", "fingerprint": "m"},
            "figures": figures or {}, "steps": [{"name": n, "status": st} for n, st in steps], "args": args or {}}
    if planted is not None:
        data["planted"] = planted
    path.write_text(json.dumps(data))
    return str(path)


def test_baseline_from_earlier_runs(tmp_path, capsys):
    """--baseline-from: the baseline of N runs' nightly.json, without the figures of planted steps;
    runs with failed steps, of several machine kinds, or files that are not a nightly.json are refused
    with the file named, and nothing is written."""
    from epmoe.nightly.cli import main

    def figs(v, torch_ms=1.0):
        return {"layer.torch.T64.vs_baseline": {"value": v, "unit": "x", "kind": "ratio", "step": "bench/layer/torch"},
                "layer.flashinfer.T64.vs_baseline": {"value": v, "unit": "x", "kind": "ratio", "step": "bench/layer/flashinfer"},
                "layer.torch.T64.baseline_ms": {"value": torch_ms, "unit": "ms", "kind": "time", "step": "bench/layer/torch"},
                "dispatch.torch.T64.GBps": {"value": None, "unit": "GB/s", "better": "higher", "kind": "throughput",
                                            "step": "bench/layer/torch"}}

    bench = [("bench/layer/torch", "passed"), ("bench/layer/flashinfer", "passed")]
    a = _nightly_json(tmp_path / "2026-12-01T1", figures=figs(1.0), steps=bench)
    b = _nightly_json(tmp_path / "2026-12-01T2", figures=figs(1.2), steps=bench)
    # a planted run written before nightly.json named its planted steps: the first layer benchmark
    p = _nightly_json(tmp_path / "2026-12-01T3", figures=figs(9.0), steps=bench, args={"plant_sleep_ms": "50"})
    out = tmp_path / "base.json"
    assert main(["--baseline-from", a, b, p, "--baseline", str(out)]) == 0
    assert "from 3 runs" in capsys.readouterr().out
    base = B.load_baseline(str(out))
    assert base.values("layer.torch.T64.vs_baseline") == (1.0, 1.2)
    assert base.values("layer.flashinfer.T64.vs_baseline") == (1.0, 1.2, 9.0)
    assert base.figures["layer.torch.T64.baseline_ms"].role == "peer"  # roles of files written before roles
    assert "dispatch.torch.T64.GBps" not in base.figures  # no finite value
    assert [r["source"] for r in base.runs] == [a, b, p] and base.machine["date"] == "2026-12-01T3"
    named = _nightly_json(tmp_path / "2026-12-01T4", figures=figs(9.0), steps=bench, planted=["bench/layer/flashinfer"],
                          args={"plant_sleep_ms": "50"})
    assert main(["--baseline-from", a, named, "--baseline", str(out)]) == 0
    assert B.load_baseline(str(out)).values("layer.torch.T64.vs_baseline") == (1.0, 9.0)
    assert B.load_baseline(str(out)).values("layer.flashinfer.T64.vs_baseline") == (1.0,)

    before = out.read_text()
    failed = _nightly_json(tmp_path / "f", figures=figs(1.0), steps=[("bench/layer/torch", "timed out")])
    other = _nightly_json(tmp_path / "o", kind="cpu", figures=figs(1.0), steps=bench)
    (tmp_path / "junk.json").write_text(json.dumps({"verdict": "passed"}))
    for argv, msg in (([a, failed], r"f: steps \['bench/layer/torch'\] failed in that run"),
                      ([a, other], r"machine kinds \['cpu', 'h200x1'\]"),
                      ([a, str(tmp_path / "junk.json")], "junk.json: not a nightly.json"),
                      ([a, str(tmp_path / "absent.json")], "absent.json")):
        assert main(["--baseline-from", *argv, "--baseline", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --baseline-from") and re.search(msg, err), err
    assert out.read_text() == before  # nothing written
    assert main(["--baseline-from", a, "--update-baseline"]) == 2
    assert "leave out --update-baseline" in capsys.readouterr().err


def test_recording_a_planted_run_or_both_record_flags_is_refused(tmp_path, capsys):
    from epmoe.nightly.cli import main

    out = str(tmp_path / "out")
    assert main(["--gpus", "0", "--update-baseline", "--plant-sleep-ms", "5", "--out", out]) == 2
    assert "planted slowdown (5 ms) would be recorded" in capsys.readouterr().err
    assert main(["--gpus", "0", "--add-to-baseline", "--plant-sleep-ms", "5", "--out", out]) == 2
    assert main(["--gpus", "0", "--update-baseline", "--add-to-baseline", "--out", out]) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_add_to_baseline_adds_a_clean_run_and_refuses_one_beyond_its_bands(tmp_path, capsys):
    """--add-to-baseline compares first: a run whose figures regressed (here: a figure of the planned
    expert step that this CPU run cannot measure, so it is missing) is not added; a clean one is."""
    from epmoe.nightly.cli import main

    path = tmp_path / "cpu.json"
    seeded = B.make_baseline([_run(B.Figure("experts.triton.bf16.decode.pct_matmul", 10.0, "%", "higher", "ratio",
                                            "bench/experts"), date="d0")], "cpu", {"fingerprint": "m"}, "d0")
    B.save_baseline(seeded, str(path))
    argv = ["--gpus", "0", "--only", "experts", "--baseline", str(path), "--add-to-baseline"]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 1
    out = capsys.readouterr().out
    assert "NOT adding this run" in out and "1 figures beyond their band" in out
    assert B.load_baseline(str(path)) == seeded
    clean = dataclasses.replace(seeded, figures={}, samples={})
    B.save_baseline(clean, str(path))
    assert main(argv + ["--out", str(tmp_path / "b")]) == 0
    assert "added this run to" in capsys.readouterr().out
    assert [r.get("source") for r in B.load_baseline(str(path)).runs][-1] == str(tmp_path / "b" / "nightly.json")
    other = dataclasses.replace(clean, machine_kind="h200x1")
    B.save_baseline(other, str(path))
    assert main(argv + ["--out", str(tmp_path / "c")]) == 2
    assert "baseline of machine kind h200x1, this machine is cpu" in capsys.readouterr().err
