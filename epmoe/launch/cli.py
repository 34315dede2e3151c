"""The launcher: `python -m epmoe.launch` (single process), `torchrun --nproc-per-node N -m epmoe.launch`,
`mpirun -np N python -m epmoe.launch`.

It runs MoE layers either on an existing checkpoint (`--checkpoint DIR`, read only) or on synthetic
weights that it writes as safetensors with HF names (into a fresh temp dir, or `--write-synthetic DIR`,
which must be empty or written by us before) and loads back through the real loader; then it serves a
loop of batches with a progress bar and a summary table.

Errors are one line per job (rank 0 prints; every rank exits with the same code): 2 for usage errors,
found before any weights are written or loaded; 1 for faults and failed checks. Under mpirun, errors
found before the ranks have met are printed by every rank (mpirun kills the others when one exits).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from epmoe.config import MoEConfig, dtype_name, parse_dtype
from epmoe.core import dist as edist
from epmoe.launch import eplb as launch_eplb
from epmoe.launch.env import (available_memory_bytes, detect_launch_env, init_distributed, resolve_device, shutdown,
                               sigkill_delay_s)
from epmoe.launch.presets import PRESETS
from epmoe.launch import synthetic as synth
from epmoe.layer import EPMoE
from epmoe.quant.checkpoint_formats import CHECKPOINT_FORMATS, QUANT_METHOD_OF_FORMAT
from epmoe.quant.plan import EXPERT_MODES

# float64 layers compute in float32 (EPMoE warns), so they are held to the float32 tolerance
CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
DTYPES = ("float32", "bfloat16", "float16", "float64")
MARKER = ".epmoe-synthetic"  # written first into every directory the launcher writes synthetic weights to
PROGRESS_EVERY_S = 5.0
RUNTIME_GROWTH = 64 * 2 ** 20  # the process grows after its RSS is measured (imports, gloo buffers, threads)  # without a terminal, a progress line at least this often


class UsageError(Exception):
    """A bad flag, file or combination, found before any work: one line, exit code 2."""


def _backend_names() -> "Tuple[List[str], List[str]]":
    from epmoe.dispatch import DISPATCHERS
    from epmoe.experts import EXPERTS

    return DISPATCHERS.names(), EXPERTS.names()


def _dtype_arg(value: str) -> str:
    v = value.lower().replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64"}.get(v, v)


class _Help(argparse.HelpFormatter):
    """Every flag's default in its help, unless the text already says it (or it is an on/off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or \
                action.default == argparse.SUPPRESS or action.nargs == 0:
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line per job, exit 2 (argparse's own code for usage errors)
        _job_error(self.prog, f"{message} (see --help)", 2)


def build_parser() -> argparse.ArgumentParser:
    dispatchers, experts = _backend_names()
    p = _Parser(
        prog="python -m epmoe.launch",
        description="Run expert-parallel MoE layers on an existing checkpoint (--checkpoint) or on synthetic "
                    "weights, under torchrun / mpirun / a single process. Exit codes: 0 ok, 1 fault or failed "
                    "--check, 2 usage error (nothing was run), 3 --doctor found the configuration cannot run.",
        formatter_class=_Help,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default=None,
                     help="model shape for synthetic weights (default: tiny, unless --config or --checkpoint is given)")
    src.add_argument("--config", metavar="PATH", help="a HF config.json (or its directory) for synthetic weights")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="load an existing HF checkpoint (config.json + *.safetensors); never written to")
    p.add_argument("--write-synthetic", metavar="DIR", default=None,
                   help="write the synthetic checkpoint here (a new or empty directory, or one written by this "
                        f"launcher before, marked by {MARKER}); default: a temp dir removed at exit")
    p.add_argument("--weights-dir", metavar="DIR", default=None, help="deprecated name of --write-synthetic")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if present, else cpu with gloo")
    p.add_argument("--dispatcher", default="torch", metavar="NAME",
                   help=f"token all-to-all backend: {', '.join(dispatchers)}")
    p.add_argument("--experts", default="auto", metavar="NAME",
                   help=f"experts backend: auto (the first, in preference order, that can run the plan; reference on "
                        f"CPU), {', '.join(experts)}")
    p.add_argument("--quant", default=None, choices=list(EXPERT_MODES),
                   help="expert quant mode (default: the checkpoint's, unquantized for synthetic weights)")
    p.add_argument("--dispatch-dtype", default="auto", choices=["auto", "bf16", "nvfp4", "fp8"],
                   help="how tokens travel (auto: what the chosen experts kernel consumes, if the dispatcher moves it)")
    p.add_argument("--checkpoint-format", default=None, choices=list(CHECKPOINT_FORMATS),
                   help="layout of the synthetic checkpoint written and loaded back (default: bf16); with --plan: "
                        "the checkpoint's quantization (default: config.json's quantization_config)")
    p.add_argument("--dtype", default=None, choices=DTYPES, type=_dtype_arg,
                   help="activation and weight dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--tokens", type=int, default=64, metavar="N", help="tokens per rank per step (>= 0)")
    p.add_argument("--tokens-jitter", type=float, default=0.0, metavar="FRAC",
                   help="draw each rank's T per step uniformly in [tokens*(1-FRAC), tokens*(1+FRAC)] "
                        "(>= 0; 1.0 includes 0)")
    p.add_argument("--steps", type=int, default=20, metavar="N", help="timed steps (>= 1)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps first (>= 0)")
    p.add_argument("--layers", type=int, default=1, metavar="N", help="MoE layers per step, each with its own weights (>= 1)")
    p.add_argument("--max-tokens-per-rank", type=int, default=None, metavar="N",
                   help="dispatch round size (>= 1; default: --tokens rounded up to 64); larger batches run in rounds")
    p.add_argument("--scale", type=float, default=None, metavar="F",
                   help="scale the model's expert count by F in (0, 1] (never done silently; too-large runs ask for it)")
    p.add_argument("--check", action="store_true",
                   help="compare every step with a dense float64 reference on rank 0 (read one expert at a time "
                        "from the checkpoint); exit 1 on mismatch")
    p.add_argument("--check-finite", action="store_true",
                   help="raise on every rank when an input or output of a layer holds NaN/Inf (costs a sync per call)")
    p.add_argument("--plan", action="store_true",
                   help="print configuration, placement, quant plan and memory per rank; run nothing")
    p.add_argument("--doctor", action="store_true",
                   help="preflight report of what this host can run (GPUs, NVLink, NCCL, packages, backends); with "
                        "--dispatcher/--experts/--device/--quant/--ep, exit 3 if that configuration cannot run here")
    p.add_argument("--ep", type=int, default=None, metavar="N", help="EP size for --plan / --doctor (default: the launch's world size)")
    p.add_argument("--arch", default=None,
                   help="--plan for another machine: cpu, sm90, sm100, sm120 (assumes every optional package, FlashInfer as installed here "
                        "or 0.7.2.post1); default: this machine")
    p.add_argument("--json", metavar="PATH", help="write per-step latency, tokens/s, per-expert load and memory here")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the synthetic weights and of the inputs")
    p.add_argument("--deterministic", action="store_true", help="bitwise-reproducible reductions")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="collective timeout in seconds: a rank that waits longer ends with a fault report")
    p.add_argument("--ranks-per-gpu", type=int, default=1, metavar="N",
                   help="run N ranks on each GPU (local ranks 0..N-1 on GPU 0, ...) over a gloo group; an explicit "
                        "opt-in for testing on fewer GPUs: results are real, timings measure no link "
                        "(docs/shared-gpu.md)")
    launch_eplb.add_flags(p)
    return p


# ---------------------------------------------------------------------------- flags and files
def check_flags(args: argparse.Namespace) -> None:
    """Everything that can be checked from the flags alone (identical on every rank)."""
    if not args.doctor:  # the doctor reports unknown names itself, with what this host can run
        dispatchers, experts = _backend_names()
        if args.dispatcher not in dispatchers:
            raise UsageError(f"--dispatcher {args.dispatcher!r} is not a dispatcher; choose one of {dispatchers}")
        if args.experts != "auto" and args.experts not in experts:
            raise UsageError(f"--experts {args.experts!r} is not an experts backend; choose 'auto' or one of {experts}")
    for name, lo in (("tokens", 0), ("steps", 1), ("layers", 1), ("warmup", 0)):
        v = getattr(args, name)
        if v < lo:
            raise UsageError(f"--{name} {v}: must be >= {lo}")
    if not (math.isfinite(args.tokens_jitter) and args.tokens_jitter >= 0):
        raise UsageError(f"--tokens-jitter {args.tokens_jitter:g}: must be a fraction >= 0 (1.0 includes T=0)")
    if args.max_tokens_per_rank is not None and args.max_tokens_per_rank < 1:
        raise UsageError(f"--max-tokens-per-rank {args.max_tokens_per_rank}: must be >= 1")
    if args.ep is not None and args.ep < 1:
        raise UsageError(f"--ep {args.ep}: must be >= 1")
    if args.scale is not None and not 0 < args.scale <= 1:
        raise UsageError(f"--scale {args.scale}: use a factor in (0, 1]")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    if args.weights_dir is not None:
        if args.write_synthetic is not None:
            raise UsageError("--weights-dir is the old name of --write-synthetic; pass only --write-synthetic")
        args.write_synthetic = args.weights_dir
    if args.checkpoint is not None and args.write_synthetic is not None:
        raise UsageError("--checkpoint loads an existing checkpoint and --write-synthetic writes synthetic weights; "
                         "pass one of them")
    if args.arch is not None and not args.plan:
        raise UsageError(f"--arch {args.arch} plans for another machine; use it with --plan")
    if args.ranks_per_gpu < 1:
        raise UsageError(f"--ranks-per-gpu {args.ranks_per_gpu}: must be an integer >= 1")
    if args.checkpoint is not None and args.checkpoint_format is not None and not args.plan:
        raise UsageError("--checkpoint-format is the layout of synthetic weights; --checkpoint DIR is loaded as it is")
    if launch_eplb.flag_error(args):
        raise UsageError(launch_eplb.flag_error(args))
    if args.check and args.tokens == 0:
        raise UsageError("--check with --tokens 0 compares nothing; pass --tokens N >= 1")
    if args.json and not args.doctor:
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d):
            raise UsageError(f"--json {args.json}: directory {d} does not exist; create it or pass another path")
        if not os.access(d, os.W_OK):
            raise UsageError(f"--json {args.json}: directory {d} is not writable")


def _read_json(path: str, flag: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: {path} does not exist; pass a HF config.json or a directory holding one")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag}: {path} is not valid JSON ({e})") from None
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {path} ({e.strerror})") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{flag}: {path} holds a JSON {type(hf).__name__}; expected an object (a HF config)")
    return hf


def default_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    if args.dtype:
        return parse_dtype(args.dtype)
    if getattr(args, "arch", None) not in (None, "cpu"):  # --plan for a GPU machine: its run's default
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: float32 keeps --check tight


def load_config(args: argparse.Namespace, device: torch.device) -> "tuple[MoEConfig, dict]":
    """The model config (a preset, --config or --checkpoint's config.json) in the run's dtype."""
    if args.checkpoint:
        if not os.path.isdir(args.checkpoint):
            raise UsageError(f"--checkpoint {args.checkpoint}: not a directory; pass a HF checkpoint directory")
        hf = _read_json(args.checkpoint, "--checkpoint")
        if not glob.glob(os.path.join(args.checkpoint, "*.safetensors")):
            raise UsageError(f"--checkpoint {args.checkpoint}: no *.safetensors files there")
    elif args.config:
        hf = _read_json(args.config, "--config")
    else:
        hf = dict(PRESETS[args.preset or "tiny"])
    where = args.checkpoint or args.config
    if where is None:
        where = f"preset {args.preset or 'tiny'}"
    elif os.path.isdir(where):
        where = os.path.join(where, "config.json")
    try:
        # a path lets the config detection read what sits beside config.json (e.g. hf_quant_config.json)
        cfg = MoEConfig.from_hf_config(args.checkpoint or args.config or hf, dtype=default_dtype(args, device))
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"{where}: not a MoE config epmoe can run ({type(e).__name__}: {e})") from None
    if args.checkpoint is not None or (args.plan and args.checkpoint_format is None):
        return cfg, hf  # the checkpoint as it is (or, for --plan, as config.json describes it)
    # the synthetic checkpoint is written in --checkpoint-format: its quantization is the model's
    return cfg.replace(quant_method=QUANT_METHOD_OF_FORMAT[args.checkpoint_format or "bf16"]), hf


def apply_scale(cfg: MoEConfig, scale: Optional[float], ep: int) -> MoEConfig:
    if scale is None:
        return cfg
    if not 0 < scale <= 1:
        raise UsageError(f"--scale {scale}: use a factor in (0, 1]")
    unit = ep
    if cfg.routing == "sigmoid_grouped":
        unit = math.lcm(ep, cfg.n_group)
    smallest = max(cfg.top_k, 2 * cfg.n_group if cfg.routing == "sigmoid_grouped" else 1)
    E = max(unit, int(cfg.num_experts * scale) // unit * unit)
    while E < smallest:
        E += unit
    kwargs = dict(num_experts=E, num_layers=max(1, round(cfg.num_layers * scale)))
    if cfg.routing == "sigmoid_grouped" and cfg.top_k > cfg.topk_group * (E // cfg.n_group):
        kwargs["topk_group"] = cfg.n_group
    return cfg.replace(**kwargs)


def check_placement(cfg: MoEConfig, ep: int, args: argparse.Namespace) -> None:
    if launch_eplb.enabled(args):
        if launch_eplb.slot_error(cfg, ep, args):
            raise UsageError(launch_eplb.slot_error(cfg, ep, args))
        return
    if cfg.num_experts % ep:
        fits = [n for n in range(1, cfg.num_experts + 1) if cfg.num_experts % n == 0 and n <= max(ep * 2, 8)]
        raise UsageError(
            f"num_experts={cfg.num_experts} is not divisible by {ep} ranks; launch a rank count that divides it "
            f"(e.g. {fits[-3:]})" + (" or pass --scale F" if args.checkpoint is None else ""))


def check_write_dir(path: str) -> None:
    """Synthetic weights go only into a new/empty directory or one this launcher wrote before."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--write-synthetic {path}: exists and is not a directory")
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        if entries and MARKER not in entries:
            shown = ", ".join(entries[:4]) + (" ..." if len(entries) > 4 else "")
            raise UsageError(
                f"--write-synthetic {path}: the directory holds files epmoe did not write ({shown}); nothing was "
                f"overwritten. To run on that checkpoint pass --checkpoint {path}; to write synthetic weights pass "
                "a new or empty directory")
        if not os.access(path, os.W_OK):
            raise UsageError(f"--write-synthetic {path}: directory is not writable")
    else:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise UsageError(f"--write-synthetic {path}: parent directory {parent} does not exist")


# ---------------------------------------------------------------------------- memory
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def synthetic_writer_bytes(cfg: MoEConfig, num_layers: int) -> int:
    """Peak memory of the synthetic writer (on the one process per node that writes). The writer may
    say it itself (`synthetic.writer_peak_bytes`); otherwise: what it holds while streaming one expert."""
    own = getattr(synth, "writer_peak_bytes", None)
    if own is not None:
        return int(own(cfg, num_layers))
    # it streams one expert at a time: drawn in float32, cast, quantized, serialised (+ one router)
    return 4 * cfg.expert_param_count() * 4 + 2 * cfg.num_experts * cfg.hidden_size * 4


@dataclass
class MemoryEstimate:
    """What one rank allocates, by item, in two phases: writing the synthetic checkpoint (`writer`,
    on the one writing process per node; freed before anyone loads) and loading + running (`expert
    weights` when they live in host RAM, plus the loader's transient copy of one layer, `loading`).
    `host` items live in this machine's RAM for the whole run (all ranks of a node share it);
    `device` items on the rank's GPU (on CPU runs the weights and workspace are host items)."""

    host: Dict[str, int]
    device: Dict[str, int]
    writer: int
    host_weights: int
    loading: int

    @property
    def phase_bytes(self) -> int:
        return max(self.writer, self.host_weights + self.loading)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values()) + self.phase_bytes

    @property
    def total_bytes(self) -> int:
        return self.host_bytes + sum(self.device.values())

    def format(self) -> str:
        """"device: a + b = X; host RAM: c + max(writer, loading) = Y" (the device part only on GPU runs)."""
        parts = [f"{k} {_fmt_bytes(v)}" for k, v in self.host.items() if v]
        run = (f"expert weights {_fmt_bytes(self.host_weights)} + " if self.host_weights else "") + \
            f"loading {_fmt_bytes(self.loading)}"
        parts.append(f"max(writer {_fmt_bytes(self.writer)}, {run})" if self.writer else run)
        host = "host RAM: " + " + ".join(parts) + f" = {_fmt_bytes(self.host_bytes)}"
        dev = [f"{k} {_fmt_bytes(v)}" for k, v in self.device.items() if v]
        if not dev:
            return host
        return "device: " + " + ".join(dev) + f" = {_fmt_bytes(sum(self.device.values()))}; " + host


def estimate_memory(cfg: MoEConfig, plan, ep: int, num_layers: int, max_tokens: int, max_T: int, *,
                    check: bool, writer: bool, runtime_bytes: int, device: torch.device,
                    slots: Optional[MoEConfig] = None) -> MemoryEstimate:
    """Everything the run allocates on one rank: expert weights and workspace (memory_required), the
    loader's transient copies of one layer's local slice (read per expert, then stacked and converted:
    at most twice the slice), rank 0's --check buffers (every rank's inputs/outputs of a step and one
    expert in float64), the synthetic writer (on the writing process, before loading) and the process
    itself (`runtime_bytes`: Python, torch, gloo, measured). slots: the config the experts see under EPLB
    (one expert per slot)."""
    from epmoe.quant.workspace import memory_required

    mem = memory_required(plan, slots or cfg, ep, max_tokens, num_moe_layers=num_layers)
    elem = torch.tensor([], dtype=cfg.dtype).element_size()
    E_local = (slots or cfg).num_experts // ep
    H, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    per_expert = cfg.expert_param_count()
    host = {"runtime": runtime_bytes + RUNTIME_GROWTH, "workspace": mem.workspace.total_bytes}
    device_items: Dict[str, int] = {}
    weights = mem.weights_bytes
    if getattr(plan, "experts_backend", None) in ("reference", "masked_reference") and \
            getattr(plan, "weight_format", "bf16") not in ("bf16", None):
        # the emulating backends keep quantized experts dequantized to float32 (what they compute with)
        weights = num_layers * E_local * per_expert * 4
    host_weights = weights
    if device.type != "cpu":
        device_items = {"expert weights": weights, "workspace": host.pop("workspace")}
        host_weights = 0
    if check:
        rows = ep * max_T
        records = rows * num_layers * (2 * H * elem + E * 4)
        host["check"] = 2 * records + 2 * per_expert * 8 + rows * (3 * H + 2 * I + E) * 8
    return MemoryEstimate(host=host, device=device_items,
                          writer=synthetic_writer_bytes(cfg, num_layers) if writer else 0,
                          host_weights=host_weights, loading=2 * E_local * per_expert * max(elem, 2))


def check_memory(est: MemoryEstimate, cfg: MoEConfig, args, device: torch.device, le, watch) -> Optional[str]:
    """Agreed on every rank: None if the node's RAM and each device fit the estimate, else the error."""
    node_key = (socket.gethostname(), le.node_rank)
    dev_key = (node_key, str(device))
    have_host = available_memory_bytes(torch.device("cpu"))
    have_dev = available_memory_bytes(device) if device.type == "cuda" else None
    mine = (node_key, dev_key, sum(est.host.values()) - est.host["runtime"], sum(est.device.values()),
            have_host, have_dev, est.writer, est.host_weights + est.loading, est.device.get("expert weights", 0))
    with watch.phase("memory check"):
        everyone = edist.all_gather_objects(mine, None, watch.collective_timeout)
    problems = []  # (need, have, the part that grows with the expert count, text)
    for key in sorted({e[0] for e in everyone}):
        on_node = [e for e in everyone if e[0] == key]
        # the writer finishes (every rank waits for it) before the ranks of the node load together
        phase = max(sum(e[6] for e in on_node), sum(e[7] for e in on_node))
        need, have = sum(e[2] for e in on_node) + phase, on_node[0][4]
        if have is not None and need > 0.9 * have:
            problems.append((need, have, phase, f"node {key[0]} ({len(on_node)} rank(s)) needs {_fmt_bytes(need)} "
                                                f"more RAM but {_fmt_bytes(have)} is available"))
    for key in sorted({e[1] for e in everyone}):
        on_dev = [e for e in everyone if e[1] == key]
        need, have = sum(e[3] for e in on_dev), on_dev[0][5]
        if have is not None and need > 0.9 * have:
            problems.append((need, have, sum(e[8] for e in on_dev), f"{key[1]} on {key[0][0]} ({len(on_dev)} "
                             f"rank(s)) needs {_fmt_bytes(need)} but {_fmt_bytes(have)} is free"))
    if not problems:
        return None
    # that part grows about linearly with the expert count; the process, workspace and activations do not
    frac = min(max(0.0, (0.8 * have - (need - grow)) / max(grow, 1)) for need, have, grow, _ in problems)
    suggestion = math.floor(100 * frac * (args.scale or 1.0)) / 100
    what = "; ".join(p[3] for p in problems)
    fix = (f"pass --scale {suggestion} to run fewer experts" if suggestion >= 0.01 and args.checkpoint is None
           else "use fewer --layers")
    return (f"{args.layers} layer(s) of {cfg.model_type} with {cfg.num_experts} experts on {len(everyone)} rank(s): "
            f"{what} (estimate per rank: {est.format()}); {fix}, or use more ranks or nodes")


# ---------------------------------------------------------------------------- plan
def _plan_text(plan, cfg: MoEConfig) -> str:
    """The plan's description; unquantized modes are named by the run's dtype (the plan calls them bf16)."""
    text = plan.describe()
    if cfg.dtype != torch.bfloat16:
        dt = dtype_name(cfg.dtype)
        text = text.replace("experts=bf16 (weights bf16, activations bf16)",
                            f"experts=unquantized (weights {dt}, activations {dt})")
        text = re.sub(r"\b(dispatch|combine)=bf16\b", rf"\1={dt}", text)
    return text


def print_plan(cfg: MoEConfig, args: argparse.Namespace, ep: int, device: torch.device) -> int:
    from epmoe.quant.workspace import memory_required, workspace_breakdown
    from epmoe.resolve import detect_environment, resolve_plan

    check_placement(cfg, ep, args)
    # the one resolver, against this host (FlashInfer version, packages, prebuilt modules), as EPMoE does
    # or against a machine of --arch with every optional package
    from epmoe.quant.plan import installed_flashinfer_version
    from epmoe.resolve import Environment

    slots = launch_eplb.slot_config(cfg, args)  # what the backends see: one expert per slot
    try:
        env = (detect_environment(device) if args.arch is None
               else Environment.hypothetical(args.arch, installed_flashinfer_version() or "0.7.2.post1"))
        max_tokens = args.max_tokens_per_rank or _round_up(args.tokens, 64)
        plan = resolve_plan(slots, dispatcher=args.dispatcher, experts=args.experts, quant=args.quant,
                            dispatch_dtype=args.dispatch_dtype, environment=env, ep_size=ep,
                            max_tokens_per_rank=max_tokens)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    print(f"model: {cfg.model_type}  E={cfg.num_experts} top_k={cfg.top_k} H={cfg.hidden_size} "
          f"I={cfg.intermediate_size} activation={cfg.activation} routing={cfg.routing} "
          f"bias={cfg.has_bias} dtype={dtype_name(cfg.dtype)} layers={cfg.num_layers}"
          + ("" if args.dtype else f" (the run's default dtype on {args.arch or device.type}; --dtype changes it)"))
    from epmoe.config import hf_routing

    if args.config or args.checkpoint:
        print(f"routing: {hf_routing(_read_json(args.config or args.checkpoint, '--config')).reason}")
    print(f"checkpoint: quant_method={cfg.quant_method} ({plan.checkpoint_quant} family)"
          + (f", --checkpoint-format {args.checkpoint_format}" if args.checkpoint_format else ""))
    print("\n".join(launch_eplb.plan_lines(cfg, args, ep)))
    rpg = getattr(args, "ranks_per_gpu", 1)
    if rpg > 1:
        print(f"shared GPU: --ranks-per-gpu {rpg}: {ep} ranks on {-(-ep // rpg)} GPU(s), gloo control group; "
              "real kernels and results, but timings are local cost only (no link is measured)")
    print(_plan_text(plan, cfg))
    ws = workspace_breakdown(plan, slots, ep, max_tokens)
    print(ws.format_table())
    if cfg.hidden_size_unpadded:
        print(f"  (K = hidden_size {cfg.hidden_size} as the kernels pad it; the checkpoint's is "
              f"{cfg.hidden_size_unpadded})")
    mem = memory_required(plan, slots, ep, max_tokens, num_moe_layers=cfg.num_layers)
    print(mem.format_table())
    move = launch_eplb.move_memory_line(args, mem.expert_weight_bytes, mem.num_local_experts)
    if move:
        print(move)
    return 0


def _round_up(x: int, m: int) -> int:
    return max(m, -(-x // m) * m)


# ---------------------------------------------------------------------------- progress
class Progress:
    """A bar with rate and ETA on a terminal; otherwise a line at least every PROGRESS_EVERY_S seconds
    (and at the end)."""

    def __init__(self, total: int, what: str, enabled: bool, stream=None):
        self.total, self.what, self.enabled = total, what, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.monotonic()

    def update(self, done: int, extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and done < self.total and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        elapsed = now - self.t0
        eta = elapsed / done * (self.total - done) if done else float("nan")
        width = 30
        bar = "#" * int(width * done / max(1, self.total))
        line = (f"[{bar.ljust(width, '.')}] {self.what} {done}/{self.total}  {elapsed:.0f}s elapsed, "
                f"ETA {_fmt_s(eta)}" + (f"  {extra}" if extra else ""))
        if self.tty:
            self.stream.write("\r" + line)
            if done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}min"


class _Heartbeat:
    """While a long step runs (writing, loading a layer): a line every PROGRESS_EVERY_S seconds."""

    def __init__(self, what: str, enabled: bool):
        import threading

        self.what, self.enabled, self.t0 = what, enabled, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if enabled else None

    def _run(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY_S):
            _say(f"  ... {self.what}: {time.monotonic() - self.t0:.0f}s so far")

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------- checkpoints
def _checkpoint_keys(directory: str) -> Dict[str, str]:
    """tensor name -> file of every *.safetensors file of `directory` (headers only)."""
    from safetensors import safe_open

    out: Dict[str, str] = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        try:
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    out[k] = f
        except Exception as e:  # noqa: BLE001 - any reader failure names the file
            raise UsageError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    return out


def moe_layer_indices(keys: Dict[str, str]) -> List[int]:
    found = {int(m.group(1)) for k in keys for m in [re.search(r"(?:^|\.)layers\.(\d+)\..*experts\.", k)] if m}
    return sorted(found)


def read_gate(keys: Dict[str, str], layer_idx: int) -> Optional[torch.Tensor]:
    """The router weight [E, H] of a layer (`...layers.L.<block>.gate.weight` or `.router.weight`)."""
    from safetensors import safe_open

    pat = re.compile(rf"(?:^|\.)layers\.{layer_idx}\.[^.]+\.(?:gate|router)\.weight$")
    hits = [k for k in keys if pat.search(k)]
    if not hits:
        return None
    with safe_open(keys[hits[0]], framework="pt") as h:
        return h.get_tensor(hits[0])


def write_synthetic(directory: str, cfg: MoEConfig, hf: dict, num_layers: int, seed: int,
                    checkpoint_format: str = "bf16", device: Optional[torch.device] = None) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, MARKER), "w") as f:  # ours: a later run may overwrite it
        f.write("synthetic weights written by python -m epmoe.launch; safe to delete\n")
    synth.write_checkpoint(directory, cfg, hf, num_layers, seed, checkpoint_format, device=device)


# ---------------------------------------------------------------------------- run
@dataclass
class RunStats:
    step_ms: List[float] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    bytes_sent: List[int] = field(default_factory=list)
    max_err: float = 0.0
    checked: int = 0
    check_s: float = 0.0


def _tokens_for_step(args, rank: int, step: int) -> int:
    if args.tokens_jitter <= 0:
        return args.tokens
    g = torch.Generator().manual_seed(args.seed * 7919 + rank * 104729 + step)
    lo = max(0, int(round(args.tokens * (1 - args.tokens_jitter))))
    hi = max(lo, int(round(args.tokens * (1 + args.tokens_jitter))))
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. Usage errors: one line (rank 0), exit 2 on every rank. Faults: one report per rank,
    exit 1 (torchrun-friendly)."""
    from epmoe.core.errors import (BackendUnavailableError, ConfigMismatchError, NonFiniteError, PeerInputError,
                                   RebalanceError)
    from epmoe.core.fault import CollectiveFailure

    rank = detect_launch_env().rank
    try:
        return _main(argv)
    except UsageError as e:
        _job_error("epmoe", str(e), 2)
    except CollectiveFailure as e:
        _die(e.report.format() if e.report is not None else f"epmoe: rank {rank}: {e}", 1)
    except (ConfigMismatchError, BackendUnavailableError) as e:  # agreed at construction: usage
        _die(f"epmoe: error: {e}" if rank == 0 else "", 2)
    except PeerInputError as e:  # another rank failed; rank 0 says it once (its own error or this)
        _die(f"epmoe: error: {e}" if rank == 0 else "", 1)
    except NonFiniteError as e:  # --check-finite: every rank raised the same
        _die(f"epmoe: error: {e}" if rank == 0 else "", 1)
    except RebalanceError as e:  # every rank raised the same; the run stopped at that step
        _die(f"epmoe: error: {e}" if rank == 0 else "", 1)
    except LoadError as e:  # every rank raised (this or PeerInputError): rank 0 says it once
        _die(f"epmoe: error: rank {rank}: {e}" if rank == 0 else "", 1)
    except KeyboardInterrupt:
        _die(f"epmoe: rank {rank}: interrupted", 130)
    except BrokenPipeError:  # output piped into `head`
        _die("", 0)
    return 1


class LoadError(Exception):
    """Loading weights failed on this rank (every rank raises: this one or PeerInputError)."""


SIGTERM_GRACE_S = 10.0  # > the fault report's wait for the peers' states (at most 5 s); torchrun waits 30 s
MPI_EXIT_DELAY_S = 2.0  # how long a rank that found an error before the group exists stays, under mpirun
_DYING = threading.Lock()  # one message and one exit code, whichever thread gets there first


def _sigterm_grace(rank: int) -> None:
    """torchrun SIGTERMs every rank as soon as one fails. Without a handler the survivors die silently
    before they notice the lost peer; with this one they get SIGTERM_GRACE_S seconds to reach their
    next collective and print the fault report (then exit 1). A rank still blocked then (in a collective
    whose peer is stuck rather than gone, which no error ends) prints the report of the phase it is in,
    "stopped by SIGTERM", and exits 143. Open MPI's mpirun SIGKILLs 1 s after its SIGTERM (unless
    odls_base_sigkill_timeout says otherwise): there both waits shrink to fit in half of that.

    Why a wakeup fd: a Python signal handler runs only when the main thread returns to the interpreter,
    never while it blocks in a collective's wait; the interpreter's C handler writes the signal's number
    to the wakeup fd at once, and a thread waiting on it starts the grace period."""
    import signal

    from epmoe.core.fault import stopped_report

    if threading.current_thread() is not threading.main_thread():  # embedded use: keep the default
        return
    grace_s, report_grace_s = SIGTERM_GRACE_S, 1.0
    kill_s = sigkill_delay_s(detect_launch_env())
    if kill_s is not None and kill_s < SIGTERM_GRACE_S + 2:
        # Open MPI SIGKILLs kill_s after its SIGTERM (1 s by default): report within half of it
        grace_s, report_grace_s = 0.3 * kill_s, 0.2 * kill_s
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # handled (not fatal); the thread acts
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch_for_sigterm(keep=writer) -> None:  # `keep`: the wakeup fd's socket lives as long as the thread
        while True:
            got = reader.recv(64)  # the numbers of the signals caught since (SIGINT wakes it too)
            if not got:  # closed: the interpreter is shutting down
                return
            if signal.SIGTERM in got:
                break
        time.sleep(grace_s)
        report = stopped_report(report_grace_s)
        _die(report or f"epmoe: rank {rank}: stopped by SIGTERM (the launcher stops every rank when one fails)", 143)

    threading.Thread(target=watch_for_sigterm, name="epmoe-sigterm", daemon=True).start()


def _job_error(prog: str, message: str, code: int) -> None:
    """Leave with an error that every rank found alike: rank 0 prints `prog: error: message` once.
    Under mpirun before the process group exists every rank prints it, naming its rank, and stays
    MPI_EXIT_DELAY_S before leaving: mpirun kills all ranks as soon as one exits with an error, so a
    rank 0 a little behind would otherwise die before printing anything. (Once the group exists the
    ranks have agreed on the error first, and rank 0's SIGTERM grace lets it print.)"""
    import torch.distributed as dist

    le = detect_launch_env()
    if le.launcher == "mpirun" and le.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        _die(f"{prog}: error: rank {le.rank}: {message}", code, linger_s=MPI_EXIT_DELAY_S)
    _die(f"{prog}: error: {message}" if le.rank == 0 else "", code)


def _die(text: str, code: int, linger_s: float = 0.0) -> None:
    """Print once and leave without tearing down process groups (a peer may be gone), after linger_s
    seconds. The first thread to call it prints and exits; a later one waits here for that exit."""
    if os.environ.get("EPMOE_DEBUG"):
        raise
    _DYING.acquire()
    if text:
        sys.stderr.write(text.rstrip() + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(linger_s)
    os._exit(code)


def _agree(error: Optional[str], watch, what: str) -> None:
    """Every rank learns whether any rank hit a usage error; all raise UsageError (rank 0 prints)."""
    with watch.phase(what):
        errors = edist.all_gather_objects(error, None, watch.collective_timeout)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not bad:
        return
    if len({e for _, e in bad}) == 1 and len(bad) == len(errors):
        raise UsageError(bad[0][1])
    raise UsageError("; ".join(f"rank {r}: {e}" for r, e in bad))


def _main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    if args.doctor:
        from epmoe.launch.doctor import run as run_doctor

        return run_doctor(args)
    try:
        device = resolve_device(args.device)
    except SystemExit as e:
        raise UsageError(str(e.code)) from None
    le = detect_launch_env()
    if args.plan:
        cfg, _ = load_config(args, device)
        ep = args.ep or le.world_size
        cfg = apply_scale(cfg, args.scale, ep)
        return print_plan(cfg, args, ep, device) if le.rank == 0 else 0

    from epmoe.core.errors import PeerInputError
    from epmoe.core.fault import FaultWatch

    try:
        le = init_distributed(device.type, args.timeout, args.ranks_per_gpu)
    except SystemExit as e:  # --ranks-per-gpu that does not fit: the same on every rank of a node
        raise UsageError(str(e.code)) from None
    shared_gpu = args.ranks_per_gpu > 1
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    watch = FaultWatch("launcher", None, args.timeout)  # the launcher's own collectives: same fault reports
    if le.world_size > 1:
        _sigterm_grace(le.rank)
    ep = le.world_size
    rank0 = le.rank == 0
    say = _say if rank0 else (lambda text: None)

    # ---- everything checkable, before any weights are written or loaded (agreed across ranks)
    error = None
    cfg = hf = None
    try:
        cfg, hf = load_config(args, device)
        unscaled = cfg
        cfg = apply_scale(cfg, args.scale, ep)
        check_placement(cfg, ep, args)
        if args.checkpoint is None:
            try:
                synth.check_format_fits(cfg, args.checkpoint_format or "bf16")
            except ValueError as e:
                raise UsageError(str(e)) from None
        if le.local_rank == 0 and args.write_synthetic is not None:
            check_write_dir(args.write_synthetic)
    except UsageError as e:
        error = str(e)
    _agree(error, watch, "checking flags")
    if args.scale is not None:
        say(f"--scale {args.scale}: experts {unscaled.num_experts} -> {cfg.num_experts} "
            f"(top_k {cfg.top_k}, expert shape H={cfg.hidden_size} I={cfg.intermediate_size} unchanged)")
    num_layers = args.layers
    layer_idx = list(range(num_layers))
    keys: Dict[str, str] = {}
    if args.checkpoint:
        error = None
        try:
            keys = _checkpoint_keys(args.checkpoint)
            found = moe_layer_indices(keys)
            if len(found) < num_layers:
                raise UsageError(f"--checkpoint {args.checkpoint}: --layers {num_layers} but the checkpoint holds "
                                 f"experts of {len(found)} layer(s) {found[:8]}")
            layer_idx = found[:num_layers]
        except UsageError as e:
            error = str(e)
        _agree(error, watch, "reading the checkpoint index")
    max_tokens = args.max_tokens_per_rank or _round_up(args.tokens, 64)

    # building the layers checks the dispatcher, experts backend and quant plan on every rank
    layers = []
    eplb = None
    if launch_eplb.enabled(args):
        with watch.phase("placing the nodes"):
            nodes = edist.all_gather_objects((socket.gethostname(), le.node_rank), None, watch.collective_timeout)
        eplb = launch_eplb.eplb_config(args, launch_eplb.nodes_for(cfg, ep, nodes, args))
    options = None
    try:
        for L in layer_idx:
            layers.append(EPMoE(cfg, dispatcher=args.dispatcher, device=device, max_num_tokens_per_rank=max_tokens,
                                experts=args.experts, quant=args.quant, dispatch_dtype=args.dispatch_dtype,
                                deterministic=args.deterministic, timeout_s=args.timeout,
                                check_finite=args.check_finite, shared_gpu=shared_gpu, eplb=eplb,
                                name=f"EPMoE[layer {L}]", dispatcher_options=options))
            if options is None and hasattr(layers[0].dispatcher.Options, "deepep_buffer"):
                # one DeepEP buffer for every layer, as serving frameworks hold it (one NVSHMEM
                # allocation per process); the first layer's dispatcher owns it and closes last
                options = {"deepep_buffer": layers[0].dispatcher.buffer}
    except (ValueError, TypeError) as e:  # agreed by the layer: every rank raises the same
        raise UsageError(str(e)) from None
    plan = layers[0].plan

    writes = args.checkpoint is None and le.local_rank == 0
    max_T = args.tokens if args.tokens_jitter <= 0 else int(round(args.tokens * (1 + args.tokens_jitter)))
    est = estimate_memory(cfg, plan, ep, num_layers, max_tokens, max_T, check=args.check and rank0,
                          writer=writes, runtime_bytes=_rss_bytes(), device=device, slots=layers[0].slot_config)
    problem = check_memory(est, cfg, args, device, le, watch)
    if problem:
        raise UsageError(problem)
    with watch.phase("gathering estimates"):
        estimates = edist.all_gather_objects(est.total_bytes, None, watch.collective_timeout)
    say(f"memory per rank (estimate): {est.format()}"
        + (" on rank 0" if ep > 1 else ""))

    # ---- weights: an existing checkpoint, or synthetic ones written by local rank 0 of each node
    tmp = None
    wdir = args.checkpoint
    node_key = (socket.gethostname(), le.node_rank)
    if wdir is None:
        wdir = args.write_synthetic
        if wdir is None:
            # A node is (host name, node rank): torchrun numbers its agents (GROUP_RANK), even two on one host;
            # mpirun sets no node rank, so there the host name tells the nodes apart.
            tmp = tempfile.TemporaryDirectory(prefix="epmoe-synthetic-") if le.local_rank == 0 else None
            with watch.phase("sharing the weights directory"):
                shared = edist.all_gather_objects((node_key, tmp.name if tmp else None), None, watch.collective_timeout)
            wdir = next((d for k, d in shared if k == node_key and d), None)
        _write_and_wait(wdir if writes else None, cfg, hf, num_layers, args.seed, le, watch,
                        args.checkpoint_format or "bf16", device)
        # every rank says whether it sees the files, so a rank that cannot read them makes all ranks
        # stop with the reason instead of some of them waiting in a collective
        with watch.phase("checking the synthetic weights"):
            seen = edist.all_gather_objects(
                wdir is not None and os.path.isfile(os.path.join(wdir, "model.safetensors")), None,
                watch.collective_timeout)
        if not all(seen):
            blind = [r for r, ok in enumerate(seen) if not ok]
            if tmp is not None:
                tmp.cleanup()
            raise UsageError(
                f"ranks {blind} cannot see the synthetic checkpoint written by local rank 0 of their node "
                f"({'no local rank 0 on that node' if wdir is None else wdir}); pass --write-synthetic DIR on a "
                "filesystem every node shares, or launch so each node has a LOCAL_RANK 0")
        error = None
        try:
            keys = _checkpoint_keys(wdir)
        except UsageError as e:
            error = str(e)
        _agree(error, watch, "reading the synthetic checkpoint")

    load_bar = Progress(len(layers), "loading layer", rank0)
    load_bar.update(0)
    gates = []
    for i, (L, layer) in enumerate(zip(layer_idx, layers)):
        try:
            with _Heartbeat(f"loading layer {L}", rank0):
                layer.load_weights(wdir, layer_idx=L)
        except PeerInputError:
            raise
        except Exception as e:  # noqa: BLE001 - the layer agreed on it: every rank raises
            raise LoadError(f"loading layer {L} from {wdir}: {type(e).__name__}: {e}") from e
        gate, error = None, None
        try:
            gate = read_gate(keys, L)
        except Exception as e:  # noqa: BLE001 - agreed below, so no rank waits on another
            error = f"reading the router weight of layer {L} from {wdir}: {type(e).__name__}: {e}"
        _agree(error, watch, "reading the router weights")
        if gate is None:
            if i == 0:
                say(f"note: the checkpoint has no router weight for layer {L}; using a random one (seed {args.seed})")
            g = torch.Generator().manual_seed(args.seed * 1000 + L)
            gate = torch.randn(cfg.num_experts, cfg.hidden_size, generator=g) * cfg.hidden_size ** -0.5
        gates.append(gate.to(device))
        load_bar.update(i + 1)
    corr = {}
    if args.check and rank0:
        from epmoe.checkpoint import load_expert_weights

        for L in layer_idx:
            corr[L] = load_expert_weights(wdir, cfg, experts=(0, 1), layer_idx=L).e_score_correction_bias
    if rank0:
        comm = "nccl" if device.type == "cuda" and not shared_gpu else "gloo"
        where = f"{device}, {args.ranks_per_gpu} ranks per GPU: shared-GPU mode, no link measured" if shared_gpu \
            else str(device)
        print(f"epmoe launch: {cfg.model_type} ep={ep} ({le.launcher}, {comm} "
              f"on {where}) layers={num_layers} tokens/rank={args.tokens} jitter={args.tokens_jitter} "
              f"max_tokens_per_rank={max_tokens} dtype={dtype_name(cfg.dtype)}"
              + (" routing=skewed" if args.routing == "skewed" else ""))
        print(_plan_text(layers[0].plan, cfg))
        sys.stdout.flush()

    stats = RunStats()
    per_expert = torch.zeros(num_layers, layers[0].num_local_experts, dtype=torch.int64)  # per local slot
    tracker = launch_eplb.LoadTracker(num_layers) if eplb is not None else None
    tol = CHECK_TOL[cfg.dtype]
    failed_check = False
    total = args.warmup + args.steps
    bar = Progress(total, "step", rank0)
    for step in range(total):
        timed = step >= args.warmup
        T = _tokens_for_step(args, le.rank, step)
        g = torch.Generator().manual_seed(args.seed * 31 + le.rank * 1009 + step)
        x = torch.randn(T, cfg.hidden_size, generator=g).to(device=device, dtype=cfg.dtype)
        records = []
        if device.type == "cuda":
            torch.cuda.synchronize()
        watch.next_call()
        with watch.phase(f"step {step} start barrier"):  # steps start together: one rank's --check is not timed
            edist.barrier(None, watch.collective_timeout)
        t0 = time.perf_counter()
        step_bytes = 0
        for L, layer in enumerate(layers):
            logits = x.float() @ gates[L].float().t()
            bias = launch_eplb.routing_bias(args, cfg.num_experts, layer_idx[L], step)
            if bias is not None:
                logits = logits + bias.to(logits.device)
            out = layer(x, logits, return_stats=True)
            if tracker is not None:
                line = tracker.record(step, L, layer, out.stats)
                if line:
                    say(("\n" if bar.tty else "") + line)
            step_bytes += out.stats.bytes_sent
            if timed:
                per_expert[L] += out.stats.tokens_per_local_expert
            if args.check:
                records.append((x.cpu(), logits.cpu(), out.hidden_states.cpu()))
            x = x + out.hidden_states
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        if timed:
            stats.step_ms.append(ms)
            stats.tokens.append(T)
            stats.bytes_sent.append(step_bytes)
        extra = f"{ms:7.2f} ms/step"
        if args.check:
            c0 = time.perf_counter()
            with watch.phase(f"step {step} check"):
                err, n = _check_step(cfg, wdir, layer_idx, corr, records, rank0, watch, layers[0].plan,
                                     layers[0].max_num_tokens_per_rank)
            stats.check_s += time.perf_counter() - c0
            if rank0:
                stats.max_err = max(stats.max_err, err)
                stats.checked += n
                if not err <= tol:
                    failed_check = True
                    _say(f"\ncheck FAILED at step {step}: max rel err {err:.3g} > {tol:g}")
            extra += f", check {stats.check_s / (step + 1):.2f} s/step"
        bar.update(step + 1, extra)

    with watch.phase("summary"):
        gathered = edist.all_gather_objects(
            (stats.step_ms, stats.tokens, stats.bytes_sent, per_expert, _peak_rss_bytes(),
             tracker.load if tracker is not None else None), None, watch.collective_timeout)
        failed_check = bool(edist.all_gather_objects(failed_check, None, watch.collective_timeout)[0])
    nothing_checked = args.check and stats.checked == 0
    if rank0:
        _summary(args, cfg, ep, layers[0], gathered, stats, tol, failed_check, estimates, tracker)
    elif args.check and le.local_rank == 0:  # one verdict line per node, so each node's log says how it went
        print(f"node {le.node_rank} ({socket.gethostname()}, rank {le.rank}): check | "
              f"{'FAILED' if failed_check else 'passed'} (details on rank 0)")
    for layer in reversed(layers):  # the owner of a shared buffer last
        layer.dispatcher.close()
    shutdown()
    if tmp is not None:
        tmp.cleanup()
    return 1 if failed_check or (nothing_checked and rank0) else 0


def _write_and_wait(wdir: Optional[str], cfg: MoEConfig, hf: dict, num_layers: int, seed: int, le, watch,
                    checkpoint_format: str = "bf16", device: Optional[torch.device] = None) -> None:
    """The writing process of each node (wdir given) writes in a thread while every rank polls, every
    half second, whether all writers are done: a long write never runs into the collective timeout,
    rank 0 reports progress, and a writer's error (disk full, ...) stops every rank with its message."""
    import threading

    state: Dict[str, object] = {}
    size = _fmt_bytes(num_layers * cfg.num_experts * cfg.expert_param_count() * est_elem(cfg))

    def work() -> None:
        try:
            write_synthetic(wdir, cfg, hf, num_layers, seed, checkpoint_format, device)
        except BaseException as e:  # noqa: BLE001 - every rank learns it below
            state["error"] = (f"rank {le.rank} could not write the synthetic checkpoint to {wdir}: "
                              f"{type(e).__name__}: {e}; pass --write-synthetic DIR on a writable filesystem "
                              "with room for it")

    thread = None
    if wdir is not None:
        _say(f"rank {le.rank}: writing synthetic weights ({num_layers} layer(s), {cfg.num_experts} experts, "
             f"{size}) to {wdir} ...")
        thread = threading.Thread(target=work, name="epmoe-synthetic-writer", daemon=True)
        thread.start()
    t0 = last = time.monotonic()
    while True:
        if thread is not None:
            thread.join(timeout=0.5)
        else:
            time.sleep(0.5)
        done = thread is None or not thread.is_alive()
        with watch.phase("waiting for the synthetic weights"):
            flags = edist.all_gather_objects((done, state.get("error")), None, watch.collective_timeout)
        errors = [e for _, e in flags if e]
        if errors:
            raise UsageError("; ".join(errors))
        if all(d for d, _ in flags):
            break
        if le.rank == 0 and time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            _say(f"  ... writing synthetic weights ({size}): {last - t0:.0f}s so far")
    if le.rank == 0:
        _say(f"rank 0: synthetic weights written in {time.monotonic() - t0:.1f}s")


def est_elem(cfg: MoEConfig) -> int:
    return torch.tensor([], dtype=cfg.dtype).element_size()


def _check_step(cfg: MoEConfig, wdir: str, layer_idx: List[int], corr: dict, records, rank0: bool,
                watch, plan=None, round_tokens: Optional[int] = None) -> "Tuple[float, int]":
    """Gather every rank's (input, logits, output) per layer; rank 0 compares with the float64
    reference, which models the plan's path (lossy wire, weight and activation quantization), reading
    one expert at a time from the checkpoint (never the whole model at once).
    With a quantized wire each rank quantizes each dispatch round of `round_tokens` rows with its own
    dynamic scale, so the reference runs per rank and round.
    Returns (worst relative error, rank-layer pairs compared)."""
    from epmoe.checkpoint import load_expert_weights
    from epmoe.reference import reference_moe_streamed

    everything = edist.all_gather_objects(records, None, watch.collective_timeout)
    if not rank0:
        return 0.0, 0
    worst, compared = 0.0, 0
    per_round = plan is not None and plan.dispatch_dtype != "bf16" and round_tokens
    for i, L in enumerate(layer_idx):
        xs = torch.cat([r[i][0] for r in everything])
        if xs.shape[0] == 0:
            continue
        logits = torch.cat([r[i][1] for r in everything])
        ys = torch.cat([r[i][2] for r in everything])
        chunks = [(xs, logits)]
        if per_round:
            chunks = [(r[i][0][a:a + round_tokens], r[i][1][a:a + round_tokens])
                      for r in everything for a in range(0, r[i][0].shape[0], round_tokens)]
        ref = torch.cat([reference_moe_streamed(
            cfg, x, lambda e: load_expert_weights(wdir, cfg, experts=(e, e + 1), layer_idx=L).experts,
            lg, e_score_correction_bias=corr.get(L), plan=plan) for x, lg in chunks])
        err = float((ys.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not torch.isfinite(ys).all():
            err = float("inf")
        worst = max(worst, err)
        compared += sum(1 for r in everything if r[i][0].shape[0] > 0)
    return worst, compared


def _pct(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(args, cfg, ep, layer, gathered, stats: RunStats, tol: float, failed_check: bool, estimates,
             tracker=None) -> None:
    step_ms = [max(ms) for ms in zip(*[g[0] for g in gathered])]  # a step ends when the slowest rank ends
    tokens = [sum(ts) for ts in zip(*[g[1] for g in gathered])]
    sent = [sum(bs) for bs in zip(*[g[2] for g in gathered])]
    load = torch.cat([g[3] for g in gathered], dim=1)  # [layers, E]
    peak = [g[4] for g in gathered]
    total_s = sum(step_ms) / 1e3
    tps = sum(tokens) / total_s if total_s > 0 else 0.0
    mean_load = load.double().mean(dim=1, keepdim=True).clamp_min(1e-9)
    imbalance = float((load.double() / mean_load).max()) if load.sum() > 0 else 0.0
    rows = [
        ("ranks", f"{ep} ({dtype_name(cfg.dtype)}, dispatcher {layer.dispatcher.name}, experts {layer.experts.name})"),
        ("steps timed", f"{len(step_ms)} x {args.layers} layer(s), tokens/step (all ranks) mean "
                        f"{sum(tokens) / max(1, len(tokens)):.1f}"),
        ("latency ms/step", f"p50 {_pct(step_ms, .5):.3f}  p90 {_pct(step_ms, .9):.3f}  max {max(step_ms, default=0):.3f}"),
        ("throughput", f"{tps:,.0f} tokens/s (all ranks)"),
        ("dispatched", f"{_fmt_bytes(sum(sent) / max(1, len(sent)))} per step to other ranks"),
        ("expert load", f"max/mean {imbalance:.2f} over {load.shape[1]} " + ("slots" if tracker else "experts")),
        ("memory", f"peak RSS per rank {', '.join(_fmt_bytes(p) for p in peak)} (estimate "
                   f"{', '.join(_fmt_bytes(e) for e in estimates)})"),
    ]
    eplb_json = None
    if tracker is not None:
        eplb_rows, eplb_json = tracker.summary([g[5] for g in gathered], args.routing)
        rows.extend(eplb_rows)
    passed: Optional[bool] = None
    if args.check:
        if stats.checked == 0:
            rows.append(("check", "FAILED: nothing was compared (every step had 0 tokens on every rank)"))
            passed = False
        else:
            passed = not failed_check
            rows.append(("check", f"{'passed' if passed else 'FAILED'}: max rel err {stats.max_err:.3g} (tolerance "
                                  f"{tol:g}) over {stats.checked} rank-layer-steps vs float64 reference; "
                                  f"{stats.check_s:.1f}s checking (not in the latencies)"))
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k.rjust(width)} | {v}" for k, v in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "config": cfg.to_dict(), "ep_size": ep, "dispatcher": layer.dispatcher.name,
                "experts": layer.experts.name, "plan": layer.plan.fingerprint(),
                "step_ms": step_ms, "tokens_per_step": tokens, "tokens_per_s": tps,
                "dispatch_bytes_per_step": sent, "tokens_per_expert": load.tolist(),
                "check": {"enabled": args.check, "passed": passed,
                          "max_rel_err": stats.max_err if args.check else None,
                          "compared": stats.checked, "seconds": stats.check_s},
                "memory": {"estimate_bytes_per_rank": estimates, "peak_rss_bytes_per_rank": peak},
                "eplb": eplb_json,
            }, f, indent=1)
        print(f"wrote {args.json}")
