"""`python -m epmoe.nightly`: the suite a CI job runs every night.

    python -m epmoe.nightly                              # CPU subset (no GPU visible): gloo, reference experts
    python -m epmoe.nightly --gpus 4                     # 4 GPUs, one rank each (NCCL)
    python -m epmoe.nightly --gpus 1 --ranks-per-gpu 4   # 4 ranks sharing one GPU (gloo control group)
    python -m epmoe.nightly --update-baseline            # record this run as the baseline

Steps (each a subprocess with a time limit; a step past it is killed and reported with the fault report
it printed, and the suite goes on):
  correctness/<dispatcher>/<mode>  multi-rank check against the float64 reference (epmoe.nightly.worker check)
  correctness/launch/<dispatcher>  the launcher's own `--check` (unquantized), as a user runs it
  bench/layer/<dispatcher>         layer vs a plain EP MoE in the same process, dispatch/combine and bytes
  bench/experts                    expert stage vs the matmul ceiling measured in the same run (GPU)
  soak/short                       benchmarks/soak.py: random T per rank, invalid inputs, memory growth
Outputs under --out: junit.xml, nightly.json (every figure, machine, versions, date), layer_vs_tokens.png
(or .svg), logs/. Exit 0 when every step passed and none of our figures is beyond its noise band, else 1
(peers' figures are reported as context).

Baselines from several runs (bands from their spread):
    python -m epmoe.nightly --update-baseline            # the first run
    python -m epmoe.nightly --add-to-baseline            # each further run (another night, another host)
    python -m epmoe.nightly --baseline-from a/nightly.json b/nightly.json ...   # from earlier runs' JSON
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from epmoe.nightly.baseline import (
    Baseline,
    Figure,
    RecordedRun,
    add_run,
    compare,
    load_baseline,
    make_baseline,
    save_baseline,
)
from epmoe.nightly.report import format_table, layer_series, plot_layer, write_json, write_junit
from epmoe.nightly.steps import Runner, Step, StepResult

REPO = Path(__file__).resolve().parents[2]
ALL_DISPATCHERS = ("torch", "flashinfer", "deepep", "deepep_ll")
# expert modes checked by default; "+nvfp4" = unquantized experts with NVFP4 tokens on the wire
GPU_MODES = ("bf16", "fp8_block", "nvfp4_w4a16", "mxfp4_w4a16", "nvfp4_w4a4", "mxfp8", "mxfp4_w4a8", "bf16+nvfp4")
CPU_MODES = ("bf16", "fp8_block", "nvfp4_w4a4")
REFUSED = ("BackendUnavailableError", "unavailable:", "is not supported on", "not runnable")


# ---------------------------------------------------------------------------- machine
def _slug(name: str) -> str:
    s = name.lower().replace("nvidia", "").strip()
    m = re.search(r"\b([a-z]+\d+[a-z]*)\b", s)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001
        return None


def machine_info(gpus: int, ranks_per_gpu: int) -> Dict:
    import torch

    info: Dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu": _cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "triton": _version("triton"), "flashinfer": _version("flashinfer-python"), "deep_ep": _version("deep_ep"),
        "epmoe": _version("epmoe"), "epmoe_commit": _git_commit(), "gpus": gpus, "ranks_per_gpu": ranks_per_gpu,
    }
    if gpus > 0:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, arch=f"sm{p.major}{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, nccl=_nccl_version(), visible_gpus=torch.cuda.device_count())
        kind = f"{_slug(p.name)}x{gpus}" + (f"-{gpus * ranks_per_gpu}ranks" if ranks_per_gpu > 1 else "")
        info["fingerprint"] = f"{p.name} x{gpus}, {ranks_per_gpu} rank(s) per GPU"
    else:
        kind = "cpu"
        info["arch"] = "cpu"
        info["fingerprint"] = f"{info['cpu']} x{info['cpus']}"
    info["machine_kind"] = kind
    return info


def _nccl_version() -> Optional[str]:
    try:
        import torch

        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    except Exception:  # noqa: BLE001
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> Optional[str]:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------- figures from step outputs
# bench_experts backends that are not ours: a Python loop of per-expert matmuls, host-bound (it ran at
# 21-46 ms on the DeepSeek-V3 prefill shape in 11 H200 runs, docs/nightly.md "Bands")
PEER_EXPERTS = ("torch_loop",)


def figure_role(name: str) -> str:
    """Whose figure `name` is (`epmoe.nightly.baseline` ROLES): "peer" for a peer's own figures (the
    torch loop's, the plain EP MoE's times `layer.*.baseline_ms`), "vs_peer" for ours relative to a
    peer (`*.vs_torch_loop`), else "ours". Also reads figures of files written before roles existed."""
    parts = name.split(".")
    if parts[0] == "experts" and len(parts) > 1 and parts[1] in PEER_EXPERTS:
        return "peer"
    if parts[0] == "layer" and parts[-1] == "baseline_ms":
        return "peer"
    if parts[-1].startswith("vs_") and parts[-1][3:] in PEER_EXPERTS:
        return "vs_peer"
    return "ours"


def _fig(name: str, value: float, unit: str, better: str, kind: str, step: str) -> Figure:
    return Figure(name, value, unit, better, kind, step, figure_role(name))


def bench_figures(data: Dict, step: str = "bench/layer/torch") -> List[Figure]:
    out = []
    for r in data.get("rows", []):
        p = f"layer.{r['dispatcher']}.T{r['tokens_per_rank']}"
        out.append(_fig(f"{p}.vs_baseline", r["layer_vs_baseline"], "x", "lower", "ratio", step))
        out.append(_fig(f"{p}.ms", r["layer_ms"], "ms", "lower", "time", step))
        out.append(_fig(f"{p}.baseline_ms", r["baseline_ms"], "ms", "lower", "time", step))
        d = f"dispatch.{r['dispatcher']}.T{r['tokens_per_rank']}"
        out.append(_fig(f"{d}.dispatch_us", r["dispatch_us"], "us", "lower", "time", step))
        out.append(_fig(f"{d}.combine_us", r["combine_us"], "us", "lower", "time", step))
        out.append(_fig(f"{d}.bytes", r["dispatch_bytes_max_rank"], "B", "lower", "bytes", step))
        if r["dispatch_bytes_max_rank"] > 0:
            out.append(_fig(f"{d}.GBps", r["dispatch_gbps"], "GB/s", "higher", "throughput", step))
    return out


def experts_figures(data: Dict, step: str = "bench/experts") -> List[Figure]:
    out = []
    rows = [r for r in data.get("results", []) if r.get("ms") == r.get("ms")]  # NaN: failed run
    loop = {r["run"]["phase"]: r["ms"] for r in rows if r["run"]["backend"] == "torch_loop"}
    for r in rows:
        run = r["run"]
        p = f"experts.{run['backend']}.{run['mode']}.{run['phase']}"
        if run.get("preset", "auto") != "auto":
            p += f".{run['preset']}"
        out.append(_fig(f"{p}.ms", r["ms"], "ms", "lower", "time", step))
        out.append(_fig(f"{p}.pct_matmul", r["pct_matmul"], "%", "higher", "ratio", step))
        if run["backend"] not in PEER_EXPERTS and run["phase"] in loop and loop[run["phase"]] > 0:
            out.append(_fig(f"{p}.vs_torch_loop", r["ms"] / loop[run["phase"]], "x", "lower", "ratio", step))
    return out


def soak_figures(data: Dict, step: str = "soak/short") -> List[Figure]:
    return [_fig("soak.ms_per_step", data["ms_per_step"], "ms", "lower", "time", step)]


def check_figures(data: Dict, step: str) -> List[Figure]:
    return [_fig(f"{step.replace('/', '.')}.max_err", data["max_err"], "", "lower", "info", step)]


def _reader(fn, path: str, step: str):
    def read(res: StepResult) -> List[Figure]:
        with open(path) as f:
            return fn(json.load(f), step)
    return read


# ---------------------------------------------------------------------------- the steps
def _source_has(rel: str, text: str) -> bool:
    try:
        return text in (REPO / rel).read_text()
    except OSError:
        return False


def _torchrun(nproc: int) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def dispatcher_availability(name: str, gpus: int, ranks_per_gpu: int = 1) -> str:
    """'' when the dispatcher can be tried here, else why not (the backend class answers)."""
    import inspect

    import torch

    from epmoe.dispatch import get_dispatcher_class

    try:
        cls = get_dispatcher_class(name)
    except (ValueError, ImportError, KeyError) as e:
        return f"not registered here ({e})"
    device = torch.device("cuda", 0) if gpus > 0 else torch.device("cpu")
    world = max(1, gpus) * ranks_per_gpu
    if ranks_per_gpu > 1 and "shared_gpu" in inspect.signature(cls.availability).parameters:
        avail = cls.availability(device, world, shared_gpu=True)
    else:  # ranks sharing a GPU cross no link: ask about the distinct GPUs only
        avail = cls.availability(device, max(1, gpus))
    return "" if avail else avail.describe()


_ENVIRONMENTS: Dict[str, object] = {}


def mode_refusal(dispatcher: str, mode: str, arch: str, ep_size: int, shape: Dict, experts: str = "auto") -> str:
    """'' when epmoe's resolver accepts (dispatcher, mode[+dispatch dtype]) for this machine (its arch,
    FlashInfer version, installed packages and prebuilt modules) at the step's shape and EP size, else
    the resolver's reason (the backend classes answer: docs/support-matrix.md)."""
    from epmoe.config import MoEConfig
    from epmoe.resolve import detect_environment, resolve_plan

    if arch not in _ENVIRONMENTS:
        _ENVIRONMENTS[arch] = detect_environment(arch=arch)
    quant, dd = (mode.split("+") + ["auto"])[:2]
    cfg = MoEConfig(**shape)
    try:
        resolve_plan(cfg, dispatcher=dispatcher, quant=None if quant == "bf16" else quant, dispatch_dtype=dd,
                     environment=_ENVIRONMENTS[arch], ep_size=ep_size, experts=experts)
    except ValueError as e:
        return str(e)
    return ""


def plan_steps(args, machine: Dict, out_dir: str) -> List[Step]:
    """The suite for this machine (pure: probes nothing itself but availability/plan callbacks)."""
    gpu = args.gpus > 0
    rpg = args.ranks_per_gpu
    world = args.gpus * rpg if gpu else args.cpu_ranks
    dev = "cuda" if gpu else "cpu"
    scale = args.limit_scale
    res = os.path.join(out_dir, "results")
    os.makedirs(res, exist_ok=True)
    env = (("OMP_NUM_THREADS", "1"), ("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)))
    if gpu:
        env += (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                ("FLASHINFER_DISABLE_JIT", os.environ.get("FLASHINFER_DISABLE_JIT", "1")))
    import torch

    # GPU: a hidden size DeepEP's low-latency kernels are built for, so every dispatcher can be asked
    hidden, inter, per_rank, top_k = (2048, 512, 8, 4) if gpu else (256, 128, 4, 4)
    shape = ["--hidden", str(hidden), "--inter", str(inter), "--experts-per-rank", str(per_rank), "--top-k", str(top_k)]
    check_shape = dict(num_experts=per_rank * world, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                       dtype=torch.bfloat16 if gpu else torch.float32)
    common = ["--device", dev, "--ranks-per-gpu", str(rpg), "--timeout", str(args.collective_timeout)]
    groups = set(args.only.split(",")) if args.only else set(GROUPS)
    dispatchers = [d for d in (args.dispatchers.split(",") if args.dispatchers else (ALL_DISPATCHERS if gpu else ("torch",))) if d]
    modes = [m for m in (args.modes.split(",") if args.modes else (GPU_MODES if gpu else CPU_MODES)) if m]
    arch = machine.get("arch", "cpu")
    avail = {d: args.availability(d, args.gpus, rpg) for d in dispatchers}
    steps: List[Step] = []

    if "correctness" in groups:
        # the experts auto picks, every mode; then FlashInfer's CUTLASS fused MoE in every mode it runs (GPU),
        # skipped with the resolver's reason where its fused-MoE module is not prebuilt
        for experts, prefix, group_modes in (("auto", "", modes), ("flashinfer_cutlass", "cutlass/", CUTLASS_MODES if gpu else ())):
            for d in dispatchers:
                for m in group_modes:
                    name = f"correctness/{prefix}{d}/{m}"
                    quant, dd = (m.split("+") + ["auto"])[:2]
                    why = avail[d] or args.mode_refusal(d, m, arch, world, check_shape, experts)
                    path = os.path.join(res, name.replace("/", "__") + ".json")
                    argv = _torchrun(world) + ["-m", "epmoe.nightly.worker", "check", "--dispatcher", d] + (
                        ["--experts", experts] if experts != "auto" else []) + [
                        "--quant", "none" if quant == "bf16" else quant, "--dispatch-dtype", dd,
                        "--steps", "4", "--json", path] + common + shape
                    steps.append(Step(name, tuple(argv), (180 if gpu else 60) * scale, env,
                                      _reader(check_figures, path, name), skip=why, parallel=True, json_path=path,
                                      skip_if_output=REFUSED))
    if "launch" in groups:
        launcher_rpg = _source_has("epmoe/launch/cli.py", "--ranks-per-gpu")
        for d in dispatchers:
            why = avail[d]
            if rpg > 1 and not launcher_rpg and not why:
                why = "this launcher has no --ranks-per-gpu (ranks sharing a GPU)"
            argv = _torchrun(world) + ["-m", "epmoe.launch", "--device", dev, "--preset", "tiny", "--dispatcher", d,
                                       "--check", "--steps", "6", "--tokens", "48", "--tokens-jitter", "1.0",
                                       "--max-tokens-per-rank", "64", "--timeout", str(args.collective_timeout)]
            if rpg > 1:
                argv += ["--ranks-per-gpu", str(rpg)]
            steps.append(Step(f"correctness/launch/{d}", tuple(argv), (180 if gpu else 60) * scale, env, skip=why,
                              parallel=True, skip_if_output=REFUSED))
    if "bench" in groups:
        # one step per dispatcher: a dispatcher that hangs loses its own figures only
        runnable = [d for d in dispatchers if not avail[d]]
        tokens = args.bench_tokens or ("64,256,1024" if gpu else "16,64,256")
        bshape = (["--hidden", "2048", "--inter", "768", "--experts-per-rank", "16", "--top-k", "8"] if gpu else shape)
        target = args.plant_dispatcher or (runnable[0] if runnable else "")
        for d in dispatchers:
            name = f"bench/layer/{d}"
            path = os.path.join(res, name.replace("/", "__") + ".json")
            argv = _torchrun(world) + ["-m", "epmoe.nightly.worker", "bench", "--dispatchers", d,
                                       "--tokens", tokens, "--iters", str(args.iters or (20 if gpu else 10)),
                                       "--warmup", "3", "--json", path] + common + bshape
            benv = env
            if args.plant_sleep_ms and d == target:
                benv = env + (("EPMOE_NIGHTLY_PLANT_SLEEP_MS", str(args.plant_sleep_ms)), ("EPMOE_NIGHTLY_PLANT_DISPATCHER", d))
            steps.append(Step(name, tuple(argv), (240 if gpu else 90) * scale, benv, _reader(bench_figures, path, name),
                              skip=avail[d], json_path=path, skip_if_output=REFUSED))
    if "experts" in groups:
        path = os.path.join(res, "bench_experts.json")
        script = REPO / "benchmarks" / "bench_experts.py"
        why = ("the expert-stage benchmark needs a CUDA GPU" if not gpu
               else "" if script.exists() else f"{script} not found (needs a source checkout)")
        from epmoe.core.imports import is_installed  # found, not imported (DeepGEMM's import sets up its JIT)

        backends = "triton,grouped_mm,torch_loop" + (",deepgemm" if is_installed("deep_gemm") else "")
        argv = [sys.executable, str(script), "--quick", "--backends", backends,
                "--modes", "bf16,fp8_block", "--experts", "32", "--decode-tokens", "128", "--prefill-tokens", "2048",
                "--json", path]
        steps.append(Step("bench/experts", tuple(argv), 300 * scale, env, _reader(experts_figures, path, "bench/experts"),
                          skip=why, json_path=path))
    if "soak" in groups:
        path = os.path.join(res, "soak.json")
        script = REPO / "benchmarks" / "soak.py"
        soak_rpg = _source_has("benchmarks/soak.py", "--ranks-per-gpu")
        nproc = world if (not gpu or rpg == 1 or soak_rpg) else args.gpus  # without shared mode: a rank per GPU
        soak_steps = args.soak_steps or (500 if gpu else 200)
        argv = _torchrun(nproc) + [str(script), "--device", dev, "--steps", str(soak_steps),
                                   "--warmup", str(min(50, soak_steps // 2)), "--bad-every", "100", "--check-every", "100",
                                   "--sample-every", "25",
                                   "--timeout", str(args.collective_timeout), "--json", path]
        if gpu and rpg > 1 and soak_rpg:
            argv += ["--ranks-per-gpu", str(rpg)]
        steps.append(Step("soak/short", tuple(argv), (180 if gpu else 60) * scale, env, _reader(soak_figures, path, "soak/short"),
                          skip="" if script.exists() else f"{script} not found (needs a source checkout)", json_path=path))
    return steps


def count_figures(results: Sequence[StepResult]) -> List[Figure]:
    """1 per correctness case that passed, 0 otherwise: a case that passed in the baseline and is
    skipped now (its backend stopped being runnable here) fails the gate."""
    return [_fig(r.name.replace("/", ".") + ".passed", 1.0 if r.status == "passed" else 0.0, "", "higher", "count", r.name)
            for r in results if r.step.group == "correctness"]


# ---------------------------------------------------------------------------- recording baselines
def run_info(machine: Dict, source: str) -> Dict:
    """Where a recorded run came from, as the baseline file lists it."""
    return {"date": machine.get("date"), "commit": machine.get("epmoe_commit"), "host": machine.get("host"),
            "fingerprint": machine.get("fingerprint"), "source": source}


def _planted_steps(data: Dict) -> List[str]:
    """The steps of a nightly.json that ran with a planted slowdown (files written before nightly.json
    named them: the plant's dispatcher, else the first layer benchmark that ran, as plan_steps picks)."""
    if "planted" in data:
        return list(data["planted"])
    args = data.get("args", {})
    if not args.get("plant_sleep_ms"):
        return []
    if args.get("plant_dispatcher"):
        return [f"bench/layer/{args['plant_dispatcher']}"]
    ran = [st["name"] for st in data.get("steps", []) if st["name"].startswith("bench/layer/") and st.get("status") != "skipped"]
    return ran[:1]


def recorded_run(data: Dict, source: str) -> RecordedRun:
    """A run to record from its nightly.json: every figure but those of planted steps. ValueError
    (naming the file and the steps) when a step failed in it."""
    if not isinstance(data, dict) or not isinstance(data.get("figures"), dict) or "machine" not in data:
        raise ValueError(f"{source}: not a nightly.json (no 'figures' / 'machine'); pass the nightly.json of a run")
    bad = [st["name"] for st in data.get("steps", []) if st.get("status") in ("failed", "timed out")]
    if bad:
        raise ValueError(f"{source}: steps {bad} failed in that run; record only runs whose steps passed")
    planted = set(_planted_steps(data))
    figs = tuple(Figure.from_json(n, f, role=figure_role(n)) for n, f in data["figures"].items()
                 if f.get("value") is not None and f.get("step") not in planted)
    return RecordedRun(figs, run_info(data["machine"], source))


def baseline_from_files(paths: Sequence[str], out_path: Optional[str]) -> int:
    """--baseline-from: write the baseline of these runs' machine kind from their nightly.json."""
    runs, machines = [], []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            runs.append(recorded_run(data, path))
        except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
            print(f"error: --baseline-from {path}: {e}", file=sys.stderr)
            return 2
        machines.append(data["machine"])
    kinds = sorted({str(m.get("machine_kind")) for m in machines})
    if len(kinds) != 1:
        print(f"error: --baseline-from: runs of machine kinds {kinds}; a baseline is per machine kind: pass runs of one",
              file=sys.stderr)
        return 2
    kind = kinds[0]
    path = out_path or str(REPO / "benchmarks" / "baselines" / f"{kind}.json")
    try:
        previous = load_baseline(path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if previous is not None and previous.machine_kind != kind:
        print(f"error: {path} is the baseline of machine kind {previous.machine_kind}, these runs are {kind}; "
              "pass --baseline for a file of their kind", file=sys.stderr)
        return 2
    latest = max(machines, key=lambda m: str(m.get("date", "")))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = make_baseline(runs, kind, latest, now, previous=previous)
    save_baseline(new, path)
    print(f"wrote {path}: {len(new.figures)} figures from {len(runs)} runs")
    print(describe_bands(new))
    return 0


def describe_bands(baseline: Baseline, widest: int = 10) -> str:
    """How the bands of our gated ratio / time / throughput figures were set, and the widest of those
    set by their spread."""
    rows = []
    for f in baseline.figures.values():
        band, basis = baseline.band_and_basis(f)
        if f.role == "ours" and band is not None and f.kind in ("ratio", "time", "throughput"):
            rows.append((band, f.name, basis))
    floor = [r for r in rows if r[2].startswith("floor")]
    wide = sorted((r for r in rows if " x spread " in r[2]), reverse=True)
    lines = [f"bands of {len(rows)} gated ratio / time / throughput figures: {len(floor)} at their floor, "
             f"{len(wide)} wider from their spread, {len(rows) - len(floor) - len(wide)} from one run or an override"]
    lines += [f"  {band * 100:5.0f}%  {name} ({basis})" for band, name, basis in wide[:widest]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.nightly", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; 0: the CPU subset)")
    p.add_argument("--ranks-per-gpu", type=int, default=1, help="ranks sharing each GPU (gloo control group)")
    p.add_argument("--cpu-ranks", type=int, default=2, help="ranks of the CPU subset (gloo)")
    p.add_argument("--out", default="nightly_results", help="directory for junit.xml, nightly.json, the plot, logs")
    p.add_argument("--baseline", default=None,
                   help="baseline file (default: benchmarks/baselines/<machine kind>.json in this checkout)")
    p.add_argument("--update-baseline", action="store_true", help="write this run's figures as the new baseline")
    p.add_argument("--add-to-baseline", action="store_true",
                   help="add this run's figures to the baseline as one more run (bands follow the runs' spread)")
    p.add_argument("--baseline-from", nargs="+", default=None, metavar="NIGHTLY_JSON",
                   help="write the baseline from the nightly.json of earlier good runs of one machine kind; runs no steps")
    p.add_argument("--only", default=None, help="comma list of step groups: correctness,launch,bench,experts,soak")
    p.add_argument("--dispatchers", default=None, help="comma list (default: every registered one on GPU, torch on CPU)")
    p.add_argument("--modes", default=None, help="comma list of expert modes, '+nvfp4' for NVFP4 dispatch "
                                                 f"(default GPU: {','.join(GPU_MODES)}; CPU: {','.join(CPU_MODES)})")
    p.add_argument("--jobs", type=int, default=1, help="correctness steps run this many at a time (benchmarks alone)")
    p.add_argument("--bench-tokens", default=None, help="tokens per rank for the layer benchmark (comma list)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per benchmark point")
    p.add_argument("--soak-steps", type=int, default=None)
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every step's time limit")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="the suite's time budget: a step that would start after it is not run, one still running "
                        "then is killed; either fails the run")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="collective timeout inside the steps (s)")
    p.add_argument("--plant-sleep-ms", default=None, metavar="MS",
                   help="planted slowdown for the gate (same as EPMOE_NIGHTLY_PLANT_SLEEP_MS)")
    p.add_argument("--plant-dispatcher", default=None, help="the dispatcher the planted sleep slows (default: the first)")
    p.add_argument("--list", action="store_true", help="print the steps (and why some cannot run here); run nothing")
    return p


GROUPS = ("correctness", "launch", "bench", "experts", "soak")
CUTLASS_MODES = ("bf16", "fp8_block", "mxfp4_w4a16", "mxfp4_w4a8")  # flashinfer_cutlass modes on sm90


def validate_selection(dispatchers: Optional[str], modes: Optional[str], only: Optional[str]) -> str:
    """'' when --dispatchers / --modes / --only name known things, else the message (a typo must not
    turn into a silently skipped step)."""
    from epmoe.dispatch import DISPATCHERS
    from epmoe.quant.plan import DISPATCH_DTYPES, EXPERT_MODES

    for d in (dispatchers or "").split(","):
        if d and d not in DISPATCHERS.names():
            return f"--dispatchers: unknown dispatcher {d!r}; choose from {sorted(DISPATCHERS.names())}"
    for m in (modes or "").split(","):
        quant, _, dd = m.partition("+")
        if m and (quant not in EXPERT_MODES or (dd and dd not in DISPATCH_DTYPES)):
            return (f"--modes: unknown mode {m!r}; use an expert mode {list(EXPERT_MODES)}, optionally with "
                    f"'+<dispatch dtype>' ({'/'.join(DISPATCH_DTYPES[1:])}), e.g. bf16+nvfp4")
    for g in (only or "").split(","):
        if g and g not in GROUPS:
            return f"--only: unknown step group {g!r}; choose from {list(GROUPS)}"
    return ""


def _stop(signum, frame) -> None:
    """The suite was told to stop (a CI job cancelled): take the running steps down with it."""
    from epmoe.nightly.steps import stop_all

    names = stop_all()
    sys.stderr.write(f"epmoe nightly: stopped by signal {signum}; killed running steps {names}\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    if args.baseline_from:
        if args.update_baseline or args.add_to_baseline:
            print("error: --baseline-from writes the baseline from earlier runs; leave out --update-baseline / "
                  "--add-to-baseline", file=sys.stderr)
            return 2
        return baseline_from_files(args.baseline_from, args.baseline)
    if args.update_baseline and args.add_to_baseline:
        print("error: --update-baseline starts a new baseline, --add-to-baseline adds to one; pass one of them",
              file=sys.stderr)
        return 2
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.gpus is None:
        args.gpus = visible
    if args.gpus < 0 or args.gpus > visible:
        print(f"error: --gpus {args.gpus}: {visible} GPU(s) visible here; pass --gpus 0..{visible}", file=sys.stderr)
        return 2
    if args.ranks_per_gpu < 1 or args.cpu_ranks < 1 or args.jobs < 1:
        print("error: --ranks-per-gpu, --cpu-ranks and --jobs must be >= 1", file=sys.stderr)
        return 2
    bad = validate_selection(args.dispatchers, args.modes, args.only)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if args.plant_sleep_ms is None:
        args.plant_sleep_ms = os.environ.get("EPMOE_NIGHTLY_PLANT_SLEEP_MS") or None
    if args.plant_dispatcher is None:
        args.plant_dispatcher = os.environ.get("EPMOE_NIGHTLY_PLANT_DISPATCHER") or None
    if args.plant_sleep_ms and (args.update_baseline or args.add_to_baseline):
        print(f"error: a planted slowdown ({args.plant_sleep_ms} ms) would be recorded into the baseline; "
              "run --update-baseline / --add-to-baseline without --plant-sleep-ms and EPMOE_NIGHTLY_PLANT_SLEEP_MS",
              file=sys.stderr)
        return 2
    args.availability = dispatcher_availability
    args.mode_refusal = mode_refusal
    machine = machine_info(args.gpus, args.ranks_per_gpu)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    baseline_path = args.baseline or str(REPO / "benchmarks" / "baselines" / f"{machine['machine_kind']}.json")
    try:
        baseline = load_baseline(baseline_path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.add_to_baseline and baseline is not None and baseline.machine_kind != machine["machine_kind"]:
        print(f"error: {baseline_path} is the baseline of machine kind {baseline.machine_kind}, this machine is "
              f"{machine['machine_kind']}; pass --baseline for a file of this kind", file=sys.stderr)
        return 2

    steps = plan_steps(args, machine, out_dir)
    print(f"epmoe nightly: {machine['fingerprint']} | torch {machine['torch']} | triton {machine['triton']} | "
          f"flashinfer {machine['flashinfer']} | epmoe {machine['epmoe']} ({machine['epmoe_commit']}) | {machine['date']}")
    print(f"machine kind {machine['machine_kind']}; baseline {baseline_path} "
          f"({f'{max(1, len(baseline.runs))} run(s), recorded ' + baseline.created if baseline else 'none yet'}); "
          f"{len(steps)} steps "
          f"({sum(bool(s.skip) for s in steps)} not runnable here); output in {out_dir}")
    if args.list:
        for i, st in enumerate(steps, 1):
            print(f"{i:3d}. {st.name:36s} " + (f"skip: {st.skip}" if st.skip else f"limit {st.limit_s:g} s: {' '.join(st.argv[1:])}"))
        return 0
    if args.plant_sleep_ms:
        slowed = [dict(st.env).get("EPMOE_NIGHTLY_PLANT_DISPATCHER") for st in steps
                  if "EPMOE_NIGHTLY_PLANT_SLEEP_MS" in dict(st.env)]
        print(f"PLANTED slowdown: {args.plant_sleep_ms} ms per layer call of {slowed or 'no benchmarked dispatcher'} "
              "(the gate must fail)")
    sys.stdout.flush()
    deadline = t0 + args.max_minutes * 60 if args.max_minutes else None
    runner = Runner(os.path.join(out_dir, "logs"), jobs=args.jobs, cwd=str(REPO), deadline=deadline,
                    budget=f"--max-minutes {args.max_minutes:g}" if args.max_minutes else "--max-minutes")
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        results = runner.run(steps)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    figures = [f for r in results for f in r.figures] + count_figures(results)
    same_machine = bool(baseline) and baseline.machine.get("fingerprint") == machine["fingerprint"]
    full_baseline = baseline
    if baseline is not None:  # judge only what this run set out to measure (--only, --dispatchers, --modes)
        planned = {s.name for s in steps} | {s.group for s in steps}
        baseline = replace(baseline, figures={n: f for n, f in baseline.figures.items() if f.step in planned})
    comparisons = compare(figures, baseline, same_machine) if baseline is not None else []
    steps_ok = all(r.status in ("passed", "skipped") for r in results)
    gate_ok = not any(c.failed for c in comparisons)
    baseline_note = ""
    if args.update_baseline or args.add_to_baseline:
        run = RecordedRun(tuple(figures), run_info(machine, os.path.join(out_dir, "nightly.json")))
        adding = args.add_to_baseline and full_baseline is not None
        if not steps_ok:
            baseline_note = "NOT updating the baseline: some steps failed (fix them first)"
        elif adding and not gate_ok:  # a regression must not widen the bands that should catch it
            baseline_note = (f"NOT adding this run to {baseline_path}: {sum(c.failed for c in comparisons)} figures "
                             "beyond their band (fix them, or start a new baseline with --update-baseline)")
        elif adding:
            new = add_run(full_baseline, run, machine, machine["date"])
            save_baseline(new, baseline_path)
            baseline_note = (f"added this run to {baseline_path}: {len(new.runs)} runs, {len(new.figures)} "
                             "figures; bands follow the runs' spread")
        else:
            new = make_baseline([run], machine["machine_kind"], machine, machine["date"], previous=full_baseline)
            save_baseline(new, baseline_path)
            baseline_note = f"wrote a new baseline ({len(new.figures)} figures, 1 run) to {baseline_path}"
            comparisons = []
            gate_ok = True
    elif baseline is None:
        baseline_note = f"no baseline at {baseline_path}: nothing compared; record one with --update-baseline"
    else:
        baseline_note = (f"compared with {baseline_path} ({max(1, len(baseline.runs))} run(s), recorded {baseline.created} "
                         f"on {baseline.machine.get('fingerprint')}"
                         f"{'' if same_machine else '; other hardware: absolute figures not gated'}); "
                         "peers' figures are context, not gated")
    verdict = "passed" if steps_ok and gate_ok else "failed"

    bench_rows = []
    for r in results:
        if r.name.startswith("bench/layer/") and r.status == "passed":
            with open(r.step.json_path) as f:
                bench_rows += json.load(f).get("rows", [])
    plot_path, plot_note = plot_layer(os.path.join(out_dir, "layer_vs_tokens"), layer_series(bench_rows),
                                      f"MoE layer vs plain EP baseline, {machine['fingerprint']}, {machine['date'][:10]}")
    props = {k: machine[k] for k in ("machine_kind", "fingerprint", "date", "torch", "epmoe_commit")}
    write_junit(os.path.join(out_dir, "junit.xml"), results, comparisons, properties=props)
    vargs = {k: v for k, v in vars(args).items() if not callable(v)}
    write_json(os.path.join(out_dir, "nightly.json"), machine=machine, args=vargs, results=results, figures=figures,
               comparisons=comparisons, baseline_path=baseline_path, baseline_note=baseline_note, verdict=verdict,
               extra={"plot": plot_path, "plot_note": plot_note, "elapsed_s": round(time.monotonic() - t0, 1),
                      "planted": [st.name for st in steps if st.planted]})
    print()
    print(format_table(results, comparisons, verdict, time.monotonic() - t0))
    print(baseline_note)
    if plot_note:
        print(f"plot: {plot_note}")
    print(f"wrote {out_dir}/junit.xml, {out_dir}/nightly.json" + (f", {plot_path}" if plot_path else ""))
    return 0 if verdict == "passed" else 1
