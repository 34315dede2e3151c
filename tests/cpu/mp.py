"""Run a function on N processes joined by a real gloo process group (CPU).

    results = run_group(fn, world_size, *args)   # fn(rank, world_size, *args) on every rank

Workers are forked from a forkserver that preloaded torch (fast, and safe with OpenMP). A worker's
exception is re-raised in the test with its traceback; a hung group is killed after `timeout` s.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

_CTX = None
_HF_PRELOAD = [
    "transformers", "transformers.generation.utils", "epmoe.integrations.transformers",
    *(f"transformers.models.{m}.modeling_{m}" for m in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")),
]


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # transformers (when installed) for the HF-integration tests: imported once by the forkserver
        # instead of by every worker; a module that fails to import is skipped by the forkserver
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "epmoe"] + _HF_PRELOAD)
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, init_file, queue, args, kwargs, pg_timeout):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        # gloo's connectFullMesh can return on rank j (its side of pair (0, j) written) before rank 0
        # has read it; a fn without collectives then lets rank j exit and rank 0's connect fails with
        # "Connection closed by peer" (seen once in CI on a loaded 2-core VM). The barrier holds every
        # rank until all have connected.
        dist.barrier()
        result = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()  # plain bytes: tensors sent through the queue would share fds with a dying process
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


class WorkerError(AssertionError):
    pass


def run_group(fn: Callable, world_size: int, *args: Any, timeout: float = 120, pg_timeout: float = 60,
              expect_errors: bool = False, **kwargs: Any) -> List[Any]:
    """Returns the per-rank results (rank order). With expect_errors=True, returns per rank either
    the result or the error text (str starting with the exception type) instead of raising."""
    ctx = _ctx()
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="epmoe-pg-")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, init_file, queue, args, kwargs, pg_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                import torch

                value = torch.load(io.BytesIO(value), weights_only=False)
            results[rank] = (status, value)
    except Exception as e:
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
        for p in procs:
            p.kill()
        raise WorkerError(
            f"process group of {world_size} did not finish within {timeout}s ({type(e).__name__}); "
            f"finished ranks {sorted(results)}, ranks that died without a result {dead}"
        ) from e
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if expect_errors:
        return [results[r][1] for r in range(world_size)]
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    if errors:
        raise WorkerError("\n".join(errors))
    return [results[r][1] for r in range(world_size)]


class SkipCheck(Exception):
    """Raised by a check that cannot run here (a package or the GPU it needs is missing): reported as
    skipped with the reason, never as passed."""


def run_checks(tag: str, checks: Iterable[Tuple[str, Callable[[], Any]]]) -> Dict[str, Tuple[Optional[bool], str]]:
    """Inside a worker: run every (name, fn) check, keep going after a failure, print one line each.
    -> name -> (ok, message: fn's return value and the time, or the exception with its traceback);
    ok is None for a check that raised SkipCheck (the message is the reason)."""
    out = {}
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            msg = fn() or ""
            out[name] = (True, f"{msg} [{time.perf_counter() - t0:.1f}s]")
        except SkipCheck as e:
            out[name] = (None, str(e))
        except BaseException as e:  # noqa: BLE001 - reported per check
            out[name] = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        word = {True: "ok", False: "FAILED", None: "skipped:"}[out[name][0]]
        print(f"[{tag}] {name}: {word} {out[name][1].splitlines()[0] if out[name][1] else ''}", flush=True)
    return out


def assert_checks(per_rank: List[Dict[str, Tuple[Optional[bool], str]]], names: Iterable[str], seed: int) -> List[str]:
    """In the test: every rank's `run_checks` result passed for each of `names`, or skipped on every
    rank. -> "name: reason" of the skipped ones (the caller skips or says so)."""
    skipped = []
    names = list(names)
    for rank, res in enumerate(per_rank):
        for name in names:
            ok, msg = res[name]
            assert ok is not False, f"seed {seed} rank {rank} {name}: {msg}"
    for name in names:
        states = {res[name][0] for res in per_rank}
        assert states != {True, None}, f"seed {seed} {name}: skipped on some ranks only: " + \
            "; ".join(f"rank {r}: {res[name][1]}" for r, res in enumerate(per_rank))
        if states == {None}:
            skipped.append(f"{name}: {per_rank[0][name][1]}")
    return skipped
