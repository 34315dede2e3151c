"""The launcher as a new user meets it: data safety, one-line usage errors (exit 2, before any work),
memory estimate vs measured peak RSS, faults under a multi-process launch, progress, --help, --plan.
Multi-process cases run real gloo groups (torchrun, or processes started with torchrun's variables)."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epmoe.launch import cli
from tests.cpu.procs import gone, kill_job, rank_of, start_job, wait_for_text

REPO = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


def _cpu(args):
    """These are CPU tests: on a GPU machine `--device auto` would pick CUDA (and NCCL on one GPU)."""
    return list(args) if "--device" in args else [*args, "--device", "cpu"]


def _launch(args, nproc=None, timeout=180):
    args = _cpu(args)
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "epmoe.launch", *args]
    else:
        cmd = [sys.executable, "-m", "epmoe.launch", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)


class _Exit(Exception):
    def __init__(self, text, code):
        super().__init__(text)
        self.text, self.code = text, code


@pytest.fixture
def run_main(monkeypatch, capsys):
    """main() in this process; returns (exit code, stdout, stderr) like a single-process launch."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)

    def die(text, code):
        raise _Exit(text, code)

    monkeypatch.setattr(cli, "_die", die)

    def run(argv):
        argv = _cpu(argv)
        try:
            code = cli.main(argv)
            text = ""
        except _Exit as e:
            code, text = e.code, e.text
        except SystemExit as e:  # argparse
            code, text = e.code, ""
        out = capsys.readouterr()
        return code, out.out, out.err + (text + "\n" if text else "")

    return run


# ------------------------------------------------------------------------------------------- 1. data safety
def test_write_synthetic_never_overwrites_foreign_files(tmp_path, run_main):
    d = tmp_path / "real-checkpoint"
    d.mkdir()
    (d / "config.json").write_text('{"my": "real config"}')
    (d / "model.safetensors").write_bytes(b"precious")
    for flag in ("--write-synthetic", "--weights-dir"):
        code, out, err = run_main([flag, str(d), "--steps", "1"])
        assert code == 2, err
        assert "holds files epmoe did not write" in err and f"--checkpoint {d}" in err, err
    assert (d / "config.json").read_text() == '{"my": "real config"}'
    assert (d / "model.safetensors").read_bytes() == b"precious"
    code, out, err = run_main(["--checkpoint", str(d), "--steps", "1"])  # not a MoE config: refused, untouched
    assert code == 2 and "config.json" in err and "not a MoE config" in err, err
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]


def test_synthetic_dir_is_marked_rewritable_and_loadable_read_only(tmp_path, run_main):
    w = tmp_path / "synthetic"
    for _ in range(2):  # the second run rewrites its own directory (marked)
        code, out, err = run_main(["--write-synthetic", str(w), "--steps", "1", "--tokens", "8", "--layers", "2"])
        assert code == 0, err
    assert sorted(os.listdir(w)) == [cli.MARKER, "config.json", "model.safetensors"]
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in w.iterdir()}
    code, out, err = run_main(["--checkpoint", str(w), "--check", "--steps", "2", "--tokens", "8", "--layers", "2"])
    assert code == 0 and "check | passed" in out, out + err
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in w.iterdir()} == before
    code, out, err = run_main(["--checkpoint", str(w), "--layers", "3", "--steps", "1"])
    assert code == 2 and "experts of 2 layer(s)" in err, err


# ------------------------------------------------------------------------------------------- 5. usage errors
@pytest.mark.parametrize("args, needle", [
    (["--config", "/nonexistent/config.json"], "--config: /nonexistent/config.json does not exist"),
    (["--dispatcher", "nosuch"], "--dispatcher 'nosuch' is not a dispatcher; choose one of ["),
    (["--plan", "--dispatcher", "reference"], "--dispatcher 'reference' is not a dispatcher"),
    (["--experts", "nosuch"], "--experts 'nosuch' is not an experts backend; choose 'auto' or one of"),
    (["--quant", "nvfp4_w4a16", "--dispatch-dtype", "nvfp4"], "nvfp4"),
    (["--experts", "triton"], "experts backend 'triton' cannot run"),
    (["--tokens-jitter", "-3"], "--tokens-jitter -3: must be a fraction >= 0"),
    (["--max-tokens-per-rank", "0"], "--max-tokens-per-rank 0: must be >= 1"),
    (["--json", "/nonexistent-dir/run.json"], "directory /nonexistent-dir does not exist"),
    (["--tokens", "0", "--check"], "--check with --tokens 0 compares nothing"),
    (["--tokens", "-1"], "--tokens -1: must be >= 0"),
    (["--scale", "2"], "--scale 2.0: use a factor in (0, 1]"),
    (["--timeout", "0"], "--timeout 0: must be a positive number"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: not a directory"),
])
def test_usage_errors_are_one_line_exit_2(args, needle, run_main):
    code, out, err = run_main(args + ["--steps", "1"])
    assert code == 2, (code, out, err)
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_malformed_json_names_the_file(tmp_path, run_main):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "mixtral",')
    code, out, err = run_main(["--config", str(tmp_path), "--steps", "1"])
    assert code == 2 and f"{p} is not valid JSON" in err and len(err.strip().splitlines()) == 1, err


def test_usage_errors_one_line_per_job_under_torchrun(tmp_path):
    """3 ranks, 16 experts: refused before any weights are written, one line for the whole job."""
    w = tmp_path / "never-written"
    r = _launch(["--preset", "tiny", "--write-synthetic", str(w), "--steps", "1"], nproc=3)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("epmoe:")]
    assert len(lines) == 1 and "num_experts=16 is not divisible by 3 ranks" in lines[0], r.stderr
    assert "/epmoe/" not in r.stderr, r.stderr  # no worker traceback (torchrun's own summary follows)
    assert not w.exists()
    r = _launch(["--experts", "triton", "--steps", "1"], nproc=2)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("epmoe:")]
    assert len(lines) == 1 and "'triton' cannot run" in lines[0], r.stderr


# ------------------------------------------------------------------------------------------- 3. memory
def test_peak_rss_within_estimate_and_check_holds_one_expert(tmp_path):
    """A model whose experts dominate the process (16 x 24 MiB): every rank's peak RSS stays under the
    launcher's estimate; with --check on an existing checkpoint rank 0 holds no more than rank 1
    (the float64 reference reads one expert at a time)."""
    cfg = {"model_type": "mixtral", "num_local_experts": 16, "num_experts_per_tok": 2, "hidden_size": 1024,
           "intermediate_size": 2048, "num_hidden_layers": 1}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    w = tmp_path / "weights"
    j1, j2 = tmp_path / "write.json", tmp_path / "check.json"
    r = _launch(["--config", str(tmp_path / "cfg.json"), "--write-synthetic", str(w), "--steps", "2", "--tokens",
                 "8", "--json", str(j1)], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "memory per rank (estimate)" in r.stderr, r.stderr
    mem = json.loads(j1.read_text())["memory"]
    for est, peak in zip(mem["estimate_bytes_per_rank"], mem["peak_rss_bytes_per_rank"]):
        assert peak <= est, mem
        assert est <= 2 * peak, mem  # an estimate, not a blanket
    r = _launch(["--checkpoint", str(w), "--check", "--steps", "2", "--tokens", "8", "--json", str(j2)], nproc=2)
    assert r.returncode == 0 and "check | passed" in r.stdout, r.stdout + r.stderr[-3000:]
    mem = json.loads(j2.read_text())["memory"]
    for est, peak in zip(mem["estimate_bytes_per_rank"], mem["peak_rss_bytes_per_rank"]):
        assert peak <= est, mem
    rank0, rank1 = mem["peak_rss_bytes_per_rank"]
    assert rank0 - rank1 < 96 * 2 ** 20, mem  # all 16 experts would be 384 MiB (768 MiB in float64)


def test_too_large_run_advice_fits(run_main):
    code, out, err = run_main(["--preset", "dsv3", "--steps", "1"])
    assert code == 2 and "pass --scale" in err and "available" in err and "writer" in err, err
    scale = float(err.split("pass --scale ")[1].split()[0])
    assert 0.01 <= scale < 0.5


# ------------------------------------------------------------------------------------------- 4. faults
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("victim", [0], ids=["store-host-rank-0-killed"])  # rank 1: the torchrun test below
def test_sigkill_one_rank_survivor_prints_fault_report(victim):
    port = _free_port()
    procs = []
    for r in range(2):
        env = _env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if os.path.isdir("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        # --check: rank 0 computes the reference while rank 1 waits in the launcher's step barrier
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "epmoe.launch", "--steps", "100000", "--tokens", "64", "--check", "--timeout",
             "30", "--device", "cpu"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # wait for the step loop (rank 0 prints the plan then)
            time.sleep(0.5)
            if procs[0].poll() is not None or procs[1].poll() is not None:
                break
            if os.path.exists(f"/proc/{procs[0].pid}") and _stepping(procs):
                break
        time.sleep(2)
        procs[victim].send_signal(signal.SIGKILL)
        out, err = procs[1 - victim].communicate(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1 - victim].returncode == 1, err[-3000:]
    assert "epmoe fault report:" in err and "lost a peer" in err, err[-3000:]
    assert "Traceback" not in err and "frame #" not in err and "TCPStore" not in err, err[-3000:]


def _stepping(procs) -> bool:
    """True once rank 0 reached the step loop (its stdout got the plan line)."""
    import select

    ready, _, _ = select.select([procs[0].stdout], [], [], 0)
    if ready:
        line = procs[0].stdout.readline()
        return line.startswith("epmoe launch:")
    return False


def test_launcher_barrier_reports_lost_peer(tmp_path):
    """The launcher's per-step barrier (rank 1 waits there while rank 0 checks) classifies a dead peer
    like every collective of a layer, instead of a raw gloo 'Connection reset by peer'."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = str(tmp_path / "pg")
    procs = [ctx.Process(target=_barrier_with_dead_peer, args=(r, init, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = q.get(timeout=90)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert result.startswith("PeerLostError") or result.startswith("CollectiveTimeoutError"), result


def _barrier_with_dead_peer(rank, init, q):
    import datetime

    import torch.distributed as dist

    from epmoe.core import dist as edist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    edist.barrier(None, 20)
    if rank == 1:
        os._exit(0)
    try:
        edist.barrier(None, 20)
        q.put("passed")
    except Exception as e:  # noqa: BLE001
        q.put(f"{type(e).__name__}: {e}")


# ------------------------------------------------------------------------------------------- 6/7. output
def test_help_documents_every_flag_defaults_backends_and_dtypes():
    text = cli.build_parser().format_help()
    for needle in ("--steps", "timed steps", "--seed", "seed of the synthetic weights", "(default: 20)",
                   "reference", "triton", "flashinfer_cutlass", "float32", "bfloat16", "float64", "deepep_ll"):
        assert needle in text, needle
    parser = cli.build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings


def test_plan_sized_in_the_run_dtype_without_dangling_header(run_main):
    code, out, err = run_main(["--plan", "--preset", "mixtral", "--ep", "2", "--device", "cpu"])
    assert code == 0, err
    lines = out.splitlines()
    assert "dtype=float32" in out and "experts=unquantized (weights float32, activations float32)" in out, out
    assert "weights bf16" not in out, out
    for i, line in enumerate(lines):
        if line.rstrip().endswith(":"):  # a header is followed by its indented table
            assert i + 1 < len(lines) and lines[i + 1].startswith(" "), (line, out)


def test_run_output_progress_check_timing_and_json(tmp_path, run_main):
    j = tmp_path / "run.json"
    code, out, err = run_main(["--steps", "3", "--tokens", "8", "--json", str(j)])
    assert code == 0, err
    assert "writing synthetic weights" in err and "loading layer 1/1" in err and "ETA" in err, err
    assert "experts=unquantized (weights float32, activations float32)" in out and "weights bf16" not in out, out
    data = json.loads(j.read_text())
    assert data["check"] == {"enabled": False, "passed": None, "max_rel_err": None, "compared": 0, "seconds": 0.0}
    code, out, err = run_main(["--steps", "2", "--tokens", "8", "--check"])
    assert code == 0 and "s checking (not in the latencies)" in out and "check " in err, out + err


def test_progress_without_terminal_prints_every_few_seconds(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    buf = io.StringIO()
    bar = cli.Progress(100000, "step", True, stream=buf)
    for step in range(1, 2001):
        clock[0] += 0.01  # 10 ms per step: 20 s in all
        bar.update(step)
    lines = buf.getvalue().splitlines()
    assert 3 <= len(lines) <= 5, lines  # every 5 s, not every 10 % of 100000 steps
    assert "ETA" in lines[0] and "/100000  5s elapsed" in lines[0], lines


# ------------------------------------------------------------------------------------------- 2/6. loading
def test_nan_in_one_ranks_experts_fails_the_job_in_one_line(tmp_path, run_main):
    """Expert 15 (rank 1 of 2) holds a NaN: every rank stops before running; rank 0 says which rank,
    expert and tensor, once."""
    from safetensors.torch import load_file, save_file

    src, bad = tmp_path / "src", tmp_path / "bad"
    code, out, err = run_main(["--write-synthetic", str(src), "--steps", "1", "--tokens", "4"])
    assert code == 0, err
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.experts.15.down_proj.weight"
    tensors[name][3, 4] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"))
    r = _launch(["--checkpoint", str(bad), "--steps", "1", "--tokens", "4"], nproc=2)
    assert r.returncode != 0, r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("epmoe:")]
    assert len(lines) == 1, r.stderr
    assert "rank 1" in lines[0] and "'w2' of expert 15" in lines[0] and "NaN/Inf" in lines[0], lines
    assert "/epmoe/" not in r.stderr and "step 1/" not in r.stderr, r.stderr  # no traceback, nothing ran


def _torchrun_two_ranks(timeout_s: int, stdout, stderr):
    """(torchrun process, its two launcher workers' pids) of a long CPU run (its own process group)."""
    return start_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "-m", "epmoe.launch", "--steps", "100000", "--tokens", "8", "--timeout", str(timeout_s),
                      "--device", "cpu"], _env(), REPO, stdout, stderr)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
def test_sigkill_under_torchrun_survivor_reports_before_torchrun_stops_it():
    """torchrun SIGTERMs the survivors at once; they still print the fault report (not silence or a
    raw gloo traceback) before leaving."""
    p, kids = _torchrun_two_ranks(30, subprocess.PIPE, subprocess.PIPE)
    try:
        time.sleep(8)  # into the step loop
        os.kill(kids[1], signal.SIGKILL)
        out, err = p.communicate(timeout=90)
    finally:
        kill_job(p, kids)
    assert p.returncode != 0
    # Mostly the survivor's collective fails on the closed connection ("lost a peer"); a survivor still
    # blocked when the grace period ends reports the phase it is in ("stopped by SIGTERM": next test).
    assert "epmoe fault report:" in err and ("lost a peer" in err or "stopped by SIGTERM" in err), err[-4000:]
    assert "/epmoe/" not in err and "frame #" not in err, err[-4000:]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
def test_sigterm_while_blocked_on_a_stuck_peer_reports_the_phase(tmp_path):
    """A rank blocked in a collective whose peer is stuck (alive, so no connection error ends the wait)
    when torchrun SIGTERMs it: a Python signal handler would never run there. It still prints the fault
    report of the phase it is in, naming the peer it waits on, within the grace period, and exits 143."""
    from epmoe.launch.cli import SIGTERM_GRACE_S

    err_path = tmp_path / "err"
    with open(err_path, "w") as err_file:
        p, kids = _torchrun_two_ranks(120, subprocess.DEVNULL, err_file)
    try:
        wait_for_text(err_path, "] step ")  # in the step loop
        by_rank = {rank_of(k): k for k in kids}
        os.kill(by_rank[1], signal.SIGSTOP)  # stuck, not gone: rank 0 blocks in its next collective
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(by_rank[0], signal.SIGTERM)
        while not gone(by_rank[0]) and time.monotonic() - t0 < SIGTERM_GRACE_S + 15:
            time.sleep(0.2)
        waited = time.monotonic() - t0
    finally:
        kill_job(p, kids)
    err = err_path.read_text()
    assert waited < SIGTERM_GRACE_S + 10, (waited, err[-4000:])
    report = [l for l in err.splitlines() if l.startswith("epmoe fault report:")]
    assert len(report) == 1, err[-4000:]
    assert "rank 0 was stopped by SIGTERM" in report[0] and "waiting on ranks [1]" in report[0] \
        and ", phase '" in report[0], report  # the phase it blocks in: a layer's or the launcher's barrier
    assert "rank 0: stopped by SIGTERM in call" in err and "rank 1: no report" in err, err[-4000:]
    assert "/epmoe/" not in err and "frame #" not in err, err[-4000:]


def test_writer_failure_is_one_line(tmp_path, run_main, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.synth, "write_checkpoint", full)
    code, out, err = run_main(["--write-synthetic", str(tmp_path / "w"), "--steps", "1"])
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.startswith("epmoe:")]
    assert len(lines) == 1 and "could not write the synthetic checkpoint" in lines[0] \
        and "No space left on device" in lines[0], err
