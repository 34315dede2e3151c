"""The launcher: `python -m epmoe.launch` (single process), `torchrun --nproc-per-node N -m epmoe.launch`,
`mpirun -np N python -m epmoe.launch`.

It builds synthetic weights, saves them as safetensors with HF names, loads them back through the real
loader, then serves a loop of batches with a progress bar and a summary table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from epmoe.config import MoEConfig, dtype_name, parse_dtype
from epmoe.core import dist as edist
from epmoe.launch.env import (
    available_memory_bytes, detect_launch_env, init_distributed, resolve_device, shutdown,
)
from epmoe.launch.presets import PRESETS
from epmoe.launch.synthetic import SyntheticLayer, read_gate, reference_layers, write_checkpoint
from epmoe.layer import EPMoE
from epmoe.quant.checkpoint_formats import CHECKPOINT_FORMATS, QUANT_METHOD_OF_FORMAT
from epmoe.quant.plan import EXPERT_MODES

CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m epmoe.launch",
        description="Run an expert-parallel MoE layer on synthetic weights (torchrun / mpirun / single process).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model shape (default: tiny)")
    src.add_argument("--config", metavar="PATH", help="a HF config.json (or its directory)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if present, else cpu with gloo")
    p.add_argument("--dispatcher", default="torch", help="torch | flashinfer | deepep | deepep_ll")
    p.add_argument("--experts", default="auto", help="experts backend (auto: the first, in preference order, that can run the plan)")
    p.add_argument("--quant", default=None, choices=list(EXPERT_MODES), help="expert quant mode (default: unquantized)")
    p.add_argument("--dispatch-dtype", default="auto", choices=["auto", "bf16", "nvfp4", "fp8"],
                   help="how tokens travel (auto: what the chosen experts kernel consumes, if the dispatcher moves it)")
    p.add_argument("--checkpoint-format", default=None, choices=list(CHECKPOINT_FORMATS),
                   help="layout of the synthetic checkpoint written and loaded back (default bf16); with --plan: "
                        "the checkpoint's quantization (default: config.json's quantization_config)")
    p.add_argument("--dtype", default=None, help="activation dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    p.add_argument("--tokens-jitter", type=float, default=0.0, metavar="FRAC",
                   help="draw each rank's T per step uniformly in [tokens*(1-FRAC), tokens*(1+FRAC)] (1.0 includes 0)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--layers", type=int, default=1, help="MoE layers per step (each with its own weights)")
    p.add_argument("--max-tokens-per-rank", type=int, default=None,
                   help="dispatch round size (default: --tokens rounded up to 64); larger batches run in rounds")
    p.add_argument("--scale", type=float, default=None, metavar="F",
                   help="scale the preset's expert count by F in (0, 1] (never done silently)")
    p.add_argument("--check", action="store_true",
                   help="compare every step with a dense float64 reference on rank 0; exit 1 on mismatch")
    p.add_argument("--plan", action="store_true", help="print configuration, placement and memory; run nothing")
    p.add_argument("--doctor", action="store_true",
                   help="preflight report of what this host can run (GPUs, NVLink, NCCL, packages, backends); with "
                        "--dispatcher/--experts/--device/--quant/--ep, exit 3 if that configuration cannot run here")
    p.add_argument("--ep", type=int, default=None, help="EP size for --plan / --doctor (default: the launch's world size)")
    p.add_argument("--arch", default=None,
                   help="--plan for another machine: cpu, sm90, sm100, sm120 (assumes every optional package, "
                        "FlashInfer as installed here or 0.7.2.post1); default: this machine")
    p.add_argument("--json", metavar="PATH", help="write per-step latency, tokens/s and per-expert load")
    p.add_argument("--weights-dir", metavar="DIR", help="where the synthetic checkpoint goes (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true", help="bitwise-reproducible reductions")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--ranks-per-gpu", type=int, default=1, metavar="N",
                   help="run N ranks on each GPU (local ranks 0..N-1 on GPU 0, ...) over a gloo group; an explicit "
                        "opt-in for testing on fewer GPUs: results are real, timings measure no link "
                        "(docs/shared-gpu.md)")
    return p


# ---------------------------------------------------------------------------- configuration
def load_config(args: argparse.Namespace, device: torch.device) -> "tuple[MoEConfig, dict]":
    if args.config:
        path = args.config
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            hf = json.load(f)
    else:
        hf = dict(PRESETS[args.preset or "tiny"])
    if args.dtype:
        dtype = parse_dtype(args.dtype)
    elif args.plan:
        dtype = MoEConfig.from_hf_config(hf).dtype  # plan for the model as deployed (its own dtype)
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: float32 keeps --check tight
    cfg = MoEConfig.from_hf_config(args.config or hf, dtype=dtype)
    if args.plan and args.checkpoint_format is None:
        return cfg, hf  # plan for the checkpoint config.json describes
    # the synthetic checkpoint is written in --checkpoint-format: its quantization is the model's
    return cfg.replace(quant_method=QUANT_METHOD_OF_FORMAT[args.checkpoint_format or "bf16"]), hf


def _read_hf(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def apply_scale(cfg: MoEConfig, scale: Optional[float], ep: int) -> MoEConfig:
    if scale is None:
        return cfg
    if not 0 < scale <= 1:
        raise SystemExit(f"--scale {scale}: use a factor in (0, 1]")
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


def weight_bytes_per_rank(cfg: MoEConfig, ep: int, layers: int) -> int:
    elem = torch.tensor([], dtype=cfg.dtype).element_size()
    return (cfg.num_experts // ep) * cfg.expert_param_count() * elem * layers


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_plan(cfg: MoEConfig, args: argparse.Namespace, ep: int, device: torch.device) -> int:
    from epmoe.resolve import detect_environment, resolve_plan

    if cfg.num_experts % ep:
        print(f"error: num_experts={cfg.num_experts} is not divisible by ep={ep}", file=sys.stderr)
        return 2
    # the one resolver, against this host (FlashInfer version, packages, prebuilt modules) as EPMoE does,
    # or against a machine of --arch with every optional package
    from epmoe.quant.plan import installed_flashinfer_version
    from epmoe.resolve import Environment

    try:
        env = (detect_environment(device) if args.arch is None
               else Environment.hypothetical(args.arch, installed_flashinfer_version() or "0.7.2.post1"))
        plan = resolve_plan(cfg, dispatcher=args.dispatcher, experts=args.experts, quant=args.quant,
                            dispatch_dtype=args.dispatch_dtype, environment=env, ep_size=ep)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    max_tokens = args.max_tokens_per_rank or _round_up(args.tokens, 64)
    E_local = cfg.num_experts // ep
    print(f"model: {cfg.model_type}  E={cfg.num_experts} top_k={cfg.top_k} H={cfg.hidden_size} "
          f"I={cfg.intermediate_size} activation={cfg.activation} routing={cfg.routing} "
          f"bias={cfg.has_bias} dtype={dtype_name(cfg.dtype)} layers={cfg.num_layers}")
    from epmoe.config import hf_routing

    if args.config:
        print(f"routing: {hf_routing(_read_hf(args.config)).reason}")
    print(f"checkpoint: quant_method={cfg.quant_method} ({plan.checkpoint_quant} family)"
          + (f", --checkpoint-format {args.checkpoint_format}" if args.checkpoint_format else ""))
    print(f"placement: ep={ep}, {E_local} experts per rank (contiguous)")
    rpg = getattr(args, "ranks_per_gpu", 1)
    if rpg > 1:
        print(f"shared GPU: --ranks-per-gpu {rpg}: {ep} ranks on {-(-ep // rpg)} GPU(s), gloo control group; "
              "real kernels and results, but timings are local cost only (no link is measured)")
    for r in range(ep):
        print(f"  rank {r}: experts [{r * E_local}, {(r + 1) * E_local})")
    from epmoe.quant.workspace import format_plan_report

    print(f"memory per rank (max_tokens_per_rank={max_tokens}, K = hidden_size {cfg.hidden_size}"
          + (f", checkpoint K {cfg.hidden_size_unpadded}" if cfg.hidden_size_unpadded else "") + "):")
    print(format_plan_report(plan, cfg, ep, max_tokens, num_moe_layers=cfg.num_layers))
    return 0


def _round_up(x: int, m: int) -> int:
    return max(m, -(-x // m) * m)


# ---------------------------------------------------------------------------- run
@dataclass
class RunStats:
    step_ms: List[float] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    bytes_sent: List[int] = field(default_factory=list)
    max_err: float = 0.0
    checked: int = 0


def _progress(step: int, total: int, ms: float) -> None:
    width = 30
    done = int(width * step / total)
    line = f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  {ms:7.2f} ms/step"
    if sys.stderr.isatty():
        sys.stderr.write(line)
        sys.stderr.flush()
    elif step == total or step % max(1, total // 10) == 0:
        sys.stderr.write(line.strip() + "\n")


def _tokens_for_step(args, rank: int, step: int) -> int:
    if args.tokens_jitter <= 0:
        return args.tokens
    g = torch.Generator().manual_seed(args.seed * 7919 + rank * 104729 + step)
    lo = max(0, int(round(args.tokens * (1 - args.tokens_jitter))))
    hi = max(lo, int(round(args.tokens * (1 + args.tokens_jitter))))
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. Faults end with one report and a non-zero exit on every rank (torchrun-friendly)."""
    from epmoe.core.errors import BackendUnavailableError, ConfigMismatchError, PeerInputError
    from epmoe.core.fault import CollectiveFailure

    try:
        return _main(argv)
    except CollectiveFailure as e:
        text = e.report.format() if e.report is not None else f"epmoe: {e}"
        _die(text, 1)
    except (PeerInputError, ConfigMismatchError, BackendUnavailableError) as e:
        _die(f"epmoe: rank {detect_launch_env().rank}: {type(e).__name__}: {e}", 1)
    return 1


def _die(text: str, code: int) -> None:
    """Print once and leave without tearing down process groups (a peer may be gone)."""
    if os.environ.get("EPMOE_DEBUG"):
        raise
    sys.stderr.write(text.rstrip() + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def _main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("tokens", "steps", "layers"):
        if getattr(args, name) < (0 if name == "tokens" else 1):
            raise SystemExit(f"--{name} {getattr(args, name)}: must be {'>= 0' if name == 'tokens' else '>= 1'}")
    if args.ep is not None and args.ep < 1:
        raise SystemExit(f"--ep {args.ep}: must be >= 1")
    if args.doctor:
        from epmoe.launch.doctor import run as run_doctor

        return run_doctor(args)
    device = resolve_device(args.device)
    le = detect_launch_env()
    cfg, hf = load_config(args, device)

    if args.plan:
        ep = args.ep or le.world_size
        cfg = apply_scale(cfg, args.scale, ep)
        return print_plan(cfg, args, ep, device) if le.rank == 0 else 0

    le = init_distributed(device.type, args.timeout, args.ranks_per_gpu)
    shared_gpu = args.ranks_per_gpu > 1
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    ep = le.world_size
    rank0 = le.rank == 0
    unscaled = cfg
    cfg = apply_scale(cfg, args.scale, ep)
    if rank0 and args.scale is not None:
        print(f"--scale {args.scale}: experts {unscaled.num_experts} -> {cfg.num_experts} "
              f"(top_k {cfg.top_k}, expert shape H={cfg.hidden_size} I={cfg.intermediate_size} unchanged)")
    num_layers = args.layers
    from epmoe.launch.synthetic import check_format_fits

    try:
        check_format_fits(cfg, args.checkpoint_format or "bf16")
    except ValueError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        shutdown()
        return 2
    need = weight_bytes_per_rank(cfg, ep, num_layers)
    have = available_memory_bytes(device)
    if have is not None and need > 0.8 * have and args.scale is None:
        if rank0:
            print(f"error: {num_layers} layer(s) of {cfg.model_type} need {_fmt_bytes(need)} of expert weights per "
                  f"rank on {device}, but only {_fmt_bytes(have)} is free; pass --scale F (e.g. --scale "
                  f"{max(0.01, round(0.5 * have / need, 2))}) to run fewer experts, or use more ranks", file=sys.stderr)
        shutdown()
        return 2

    max_tokens = args.max_tokens_per_rank or _round_up(args.tokens, 64)
    # local rank 0 of each node writes the checkpoint; everyone reads it back through the loader
    tmp = None
    wdir = args.weights_dir
    # A node is (host name, node rank): torchrun numbers its agents (GROUP_RANK), even two on one host;
    # mpirun sets no node rank, so there the host name tells the nodes apart.
    node_key = (socket.gethostname(), le.node_rank)
    if wdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="epmoe-synthetic-") if le.local_rank == 0 else None
        shared = edist.all_gather_objects((node_key, tmp.name if tmp else None))
        wdir = next((d for k, d in shared if k == node_key and d), None)
    synthetic: dict = {}
    if le.local_rank == 0 and wdir is not None:
        try:
            write_checkpoint(wdir, cfg, hf, num_layers, args.seed, args.checkpoint_format or "bf16", device=device)
        except (OSError, ValueError) as e:  # reported below through the agreement, not by leaving the others waiting
            print(f"error: rank {le.rank} could not write the synthetic checkpoint to {wdir}: {e}; "
                  "pass --weights-dir DIR on a writable filesystem", file=sys.stderr)
    edist.barrier()  # the files exist (or their writer failed) before anyone looks
    # every rank says whether it sees the files, so a rank that cannot read them makes all ranks
    # stop with the reason instead of some of them waiting in a collective
    seen = edist.all_gather_objects(wdir is not None and os.path.isfile(os.path.join(wdir, "model.safetensors")))
    if not all(seen):
        if rank0:
            blind = [r for r, ok in enumerate(seen) if not ok]
            print(f"error: ranks {blind} cannot see the synthetic checkpoint written by local rank 0 of their node "
                  f"({'no local rank 0 on that node' if wdir is None else wdir}); pass --weights-dir DIR on a "
                  "filesystem every node shares, or launch so each node has a LOCAL_RANK 0", file=sys.stderr)
        shutdown()
        if tmp is not None:
            tmp.cleanup()
        return 2
    if rank0 and args.check:  # the reference: the checkpoint's own (dequantized) values
        synthetic = reference_layers(wdir, cfg, num_layers)

    layers, gates = [], []
    for L in range(num_layers):
        layer = EPMoE(cfg, dispatcher=args.dispatcher, device=device, max_num_tokens_per_rank=max_tokens,
                      experts=args.experts, quant=args.quant, dispatch_dtype=args.dispatch_dtype,
                      deterministic=args.deterministic, timeout_s=args.timeout, shared_gpu=shared_gpu,
                      name=f"EPMoE[layer {L}]")
        layer.load_weights(wdir, layer_idx=L)
        layers.append(layer)
        gates.append(read_gate(wdir, L).to(device))
    if rank0:
        comm = "nccl" if device.type == "cuda" and not shared_gpu else "gloo"
        where = f"{device}, {args.ranks_per_gpu} ranks per GPU: shared-GPU mode, no link measured" if shared_gpu \
            else str(device)
        print(f"epmoe launch: {cfg.model_type} ep={ep} ({le.launcher}, {comm} "
              f"on {where}) layers={num_layers} tokens/rank={args.tokens} jitter={args.tokens_jitter} "
              f"max_tokens_per_rank={max_tokens} dtype={dtype_name(cfg.dtype)}")
        print(layers[0].plan.describe())

    stats = RunStats()
    per_expert = torch.zeros(num_layers, cfg.num_experts // ep, dtype=torch.int64)
    tol = CHECK_TOL[cfg.dtype]
    failed_check = False
    total = args.warmup + args.steps
    for step in range(total):
        timed = step >= args.warmup
        T = _tokens_for_step(args, le.rank, step)
        g = torch.Generator().manual_seed(args.seed * 31 + le.rank * 1009 + step)
        x = torch.randn(T, cfg.hidden_size, generator=g).to(device=device, dtype=cfg.dtype)
        records = []
        if device.type == "cuda":
            torch.cuda.synchronize()
        edist.barrier()  # steps start together, so one rank's --check work is not timed on the others
        t0 = time.perf_counter()
        step_bytes = 0
        for L, layer in enumerate(layers):
            logits = x.float() @ gates[L].float().t()
            out = layer(x, logits, return_stats=True)
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
        if args.check:
            err = _check_step(cfg, synthetic, records, rank0, layers[0].plan, layers[0].max_num_tokens_per_rank)
            if rank0:
                stats.max_err = max(stats.max_err, err)
                stats.checked += len(layers) * ep
                if not err <= tol:
                    failed_check = True
                    print(f"\ncheck FAILED at step {step}: max rel err {err:.3g} > {tol:g}", file=sys.stderr)
        if rank0:
            _progress(step + 1, total, ms)
    if rank0 and sys.stderr.isatty():
        sys.stderr.write("\n")

    gathered = edist.all_gather_objects((stats.step_ms, stats.tokens, stats.bytes_sent, per_expert))
    failed_check = bool(edist.all_gather_objects(failed_check)[0])
    if rank0:
        _summary(args, cfg, ep, layers[0], gathered, stats, tol, failed_check)
    elif args.check and le.local_rank == 0:  # one verdict line per node, so each node's log says how it went
        print(f"node {le.node_rank} ({socket.gethostname()}, rank {le.rank}): check | "
              f"{'FAILED' if failed_check else 'passed'} (details on rank 0)")
    for layer in layers:
        layer.dispatcher.close()
    shutdown()
    if tmp is not None:
        tmp.cleanup()
    return 1 if failed_check else 0


def _check_step(cfg: MoEConfig, synthetic: dict, records, rank0: bool, plan=None,
                round_tokens: Optional[int] = None) -> float:
    """Gather every rank's (input, logits, output) per layer; rank 0 compares with the reference,
    which models the plan's path (lossy wire, weight and activation quantization). With a quantized
    wire each rank quantizes each dispatch round of `round_tokens` rows with its own dynamic scale,
    so the reference runs per rank and round."""
    from epmoe.reference import reference_moe

    everything = edist.all_gather_objects(records)
    if not rank0:
        return 0.0
    worst = 0.0
    per_round = plan is not None and plan.dispatch_dtype != "bf16" and round_tokens
    for L, layer in synthetic.items():
        xs = torch.cat([r[L][0] for r in everything])
        if xs.shape[0] == 0:
            continue
        logits = torch.cat([r[L][1] for r in everything])
        ys = torch.cat([r[L][2] for r in everything])
        chunks = [(xs, logits)]
        if per_round:
            chunks = [(r[L][0][i:i + round_tokens], r[L][1][i:i + round_tokens])
                      for r in everything for i in range(0, r[L][0].shape[0], round_tokens)]
        ref = torch.cat([reference_moe(cfg, x, layer.experts, lg, e_score_correction_bias=layer.e_score_correction_bias,
                                       plan=plan) for x, lg in chunks])
        err = float((ys.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not torch.isfinite(ys).all():
            err = float("inf")
        worst = max(worst, err)
    return worst


def _pct(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(args, cfg, ep, layer, gathered, stats: RunStats, tol: float, failed_check: bool) -> None:
    step_ms = [max(ms) for ms in zip(*[g[0] for g in gathered])]  # a step ends when the slowest rank ends
    tokens = [sum(ts) for ts in zip(*[g[1] for g in gathered])]
    sent = [sum(bs) for bs in zip(*[g[2] for g in gathered])]
    load = torch.cat([g[3] for g in gathered], dim=1)  # [layers, E]
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
        ("expert load", f"max/mean {imbalance:.2f} over {cfg.num_experts} experts"),
    ]
    if args.check:
        verdict = "FAILED" if failed_check else "passed"
        rows.append(("check", f"{verdict}: max rel err {stats.max_err:.3g} (tolerance {tol:g}) over "
                              f"{stats.checked} rank-layer-steps vs float64 reference"))
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k.rjust(width)} | {v}" for k, v in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "config": cfg.to_dict(), "ep_size": ep, "dispatcher": layer.dispatcher.name,
                "experts": layer.experts.name, "plan": layer.plan.fingerprint(),
                "step_ms": step_ms, "tokens_per_step": tokens, "tokens_per_s": tps,
                "dispatch_bytes_per_step": sent, "tokens_per_expert": load.tolist(),
                "check": {"enabled": args.check, "passed": not failed_check, "max_rel_err": stats.max_err},
            }, f, indent=1)
        print(f"wrote {args.json}")
