"""Steps of the nightly suite: each one a subprocess with a time limit, its output in a log file.

A step that runs past its limit is stopped (SIGTERM, then SIGKILL after a grace period) together with
every process it started (torchrun puts its workers in sessions of their own, so the whole tree is
collected from /proc first), and reported with the fault report it printed, if any; the suite then
goes on with the next step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from epmoe.nightly.baseline import Figure

STATUSES = ("passed", "failed", "timed out", "skipped")
KILL_GRACE_S = 5.0
# planted slowdowns reach only the step the suite gives them to (Step.env), never every step
_SET_BY_THE_SUITE = ("EPMOE_NIGHTLY_PLANT_SLEEP_MS", "EPMOE_NIGHTLY_PLANT_DISPATCHER")
_RUNNING: Dict[int, str] = {}  # pid -> step name, for stop_all()
_RUNNING_LOCK = threading.Lock()


@dataclass(frozen=True)
class Step:
    """name: unique, `group/what` (`correctness/torch/bf16`); argv: the command; limit_s: wall-clock limit.
    figures: reads this step's figures after it ran (from the files it wrote under out_dir);
    skip: the reason this step cannot run here (it is reported as skipped, never run);
    parallel: may run beside other parallel steps (correctness); benchmarks run alone."""

    name: str
    argv: Tuple[str, ...] = ()
    limit_s: float = 120.0
    env: Tuple[Tuple[str, str], ...] = ()
    figures: Optional[Callable[["StepResult"], List[Figure]]] = None
    skip: str = ""
    parallel: bool = False
    json_path: str = ""  # the file the step writes its results to (if any)
    skip_if_output: Tuple[str, ...] = ()  # output substrings that mean "refused here", not "failed"
    limit_reason: str = ""  # why limit_s is shorter than the step's own limit (the suite's time budget)

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def planted(self) -> bool:
        """Does this step run with a planted slowdown (its figures are wrong on purpose)?"""
        return any(k == "EPMOE_NIGHTLY_PLANT_SLEEP_MS" for k, _ in self.env)


@dataclass
class StepResult:
    step: Step
    status: str
    seconds: float = 0.0
    returncode: Optional[int] = None
    log_path: str = ""
    message: str = ""
    fault_report: str = ""
    output_tail: str = ""
    figures: List[Figure] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.step.name


_REPORT_HEAD = "epmoe fault report:"


def extract_fault_reports(text: str) -> List[str]:
    """The distinct `epmoe fault report:` blocks (head line + indented `  rank N:` lines) in `text`,
    in order of appearance. Every rank prints its own; they differ in the head line."""
    blocks: List[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        k = lines[i].find(_REPORT_HEAD)
        if k < 0:
            i += 1
            continue
        block = [lines[i][k:]]
        i += 1
        while i < len(lines) and re.match(r"^\s+rank \d+:", lines[i]):
            block.append(lines[i].rstrip())
            i += 1
        text_block = "\n".join(block)
        if text_block not in blocks:
            blocks.append(text_block)
    return blocks


def _error_line(text: str) -> str:
    """The most telling one-line error in a failed step's output (torchrun's own summary skipped)."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and "ChildFailedError" not in ln and re.search(r"[A-Za-z]", ln)
             and not ln.lstrip().startswith(("File \"", "raise ", "return ", "torch.distributed.elastic"))]
    for pat in (r"^epmoe fault report: .*$", r"^epmoe: .*$", r"^error: .*$", r"^check FAILED.*$",
                r"^([\w.]+)?(Error|Exception|Failure|Interrupt)\b.*$"):
        hits = [ln for ln in lines if re.match(pat, ln)]
        if hits:
            return hits[-1][:400]
    return lines[-1][:400] if lines else ""


def _children_map() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return kids
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(e))
    return kids


def process_tree(pid: int) -> List[int]:
    """pid and all its descendants (Linux /proc; elsewhere just pid)."""
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def kill_tree(pid: int, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the process and everything it started, SIGKILL whatever is left after grace_s."""
    pids = process_tree(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        time.sleep(0.1)
    for p in pids + process_tree(pid):  # children may have appeared during the grace period
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def run_step(step: Step, log_dir: str, cwd: Optional[str] = None) -> StepResult:
    """Run one step to completion or to its limit. Never raises for what the step does."""
    if step.skip:
        return StepResult(step, "skipped", message=step.skip)
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, step.name.replace("/", "__") + ".log")
    env = {k: v for k, v in os.environ.items() if k not in _SET_BY_THE_SUITE}
    env.update(dict(step.env))
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(step.argv) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(list(step.argv), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)
        except OSError as e:
            return StepResult(step, "failed", time.monotonic() - t0, None, log_path, f"cannot start: {e}")
        with _RUNNING_LOCK:
            _RUNNING[proc.pid] = step.name
        try:
            rc = proc.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(proc.pid)
            try:
                rc = proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                rc = None
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(proc.pid, None)
    seconds = time.monotonic() - t0
    with open(log_path, errors="replace") as f:
        text = f.read()
    reports = extract_fault_reports(text)
    res = StepResult(step, "passed", seconds, rc, log_path, "", "\n".join(reports), text[-4000:])
    if timed_out:
        res.status = "timed out"
        res.message = ((f"killed when {step.limit_reason}" if step.limit_reason
                        else f"killed after its limit of {step.limit_s:g} s")
                       + (" (fault report below)" if reports else "; it printed no fault report")
                       + (f"; last error: {_error_line(text)}" if _error_line(text) else ""))
        return res
    if rc != 0:
        refused = next((s for s in step.skip_if_output if s in text), None)
        if refused:
            res.status = "skipped"
            res.message = f"refused here: {_error_line(text) or refused}"
            return res
        res.status = "failed"
        res.message = f"exit code {rc}: {_error_line(text)}"
        return res
    if step.figures is not None:
        try:
            res.figures = list(step.figures(res))
        except Exception as e:  # noqa: BLE001 - a step whose output cannot be read failed
            res.status = "failed"
            res.message = f"ran, but its results could not be read: {type(e).__name__}: {e}"
    return res


def stop_all(grace_s: float = 2.0) -> List[str]:
    """Kill every step still running, with all it started (the suite itself was told to stop: a CI
    job cancelled). Returns the names of the steps stopped."""
    with _RUNNING_LOCK:
        running = dict(_RUNNING)
    for pid in running:
        kill_tree(pid, grace_s)
    return list(running.values())


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


class Runner:
    """Runs steps in order (consecutive `parallel` steps up to `jobs` at a time), printing progress:
    `[n/m mm:ss] name ...` at start and end, and a line every `heartbeat_s` for steps still running."""

    def __init__(self, log_dir: str, jobs: int = 1, out=None, heartbeat_s: float = 30.0, cwd: Optional[str] = None,
                 run_one: Callable[[Step, str], StepResult] = None, deadline: Optional[float] = None,
                 budget: str = "--max-minutes"):
        self.log_dir = log_dir
        self.jobs = max(1, jobs)
        self.out = out or sys.stdout
        self.heartbeat_s = heartbeat_s
        self.cwd = cwd
        self.t0 = time.monotonic()
        self.deadline = deadline  # time.monotonic() after which no step starts (and none runs past it)
        self.budget = budget  # how the user set the deadline, for the messages ("--max-minutes 20")
        self._lock = threading.Lock()
        self._run_one = run_one or (lambda step, log_dir: run_step(step, log_dir, cwd=self.cwd))

    def _say(self, line: str) -> None:
        with self._lock:
            self.out.write(f"[{_fmt_s(time.monotonic() - self.t0)}] {line}\n")
            self.out.flush()

    def run(self, steps: Sequence[Step]) -> List[StepResult]:
        total = len(steps)
        results: Dict[int, StepResult] = {}
        done = [0]
        started: Dict[int, float] = {}

        def one(i: int) -> StepResult:
            st = steps[i]
            r = None
            if self.deadline is not None and not st.skip:
                # a step the budget leaves out or cuts short fails: the run did not check what it set out
                # to, and its figures must not go missing from a baseline recorded from it
                left = self.deadline - time.monotonic()
                if left <= 1:
                    r = StepResult(st, "timed out", message=f"not started: the suite's time budget ({self.budget}) "
                                                            "was spent; raise --max-minutes")
                elif left < st.limit_s:
                    st = replace(st, limit_s=left, limit_reason=f"the suite's time budget ({self.budget}) ran out, "
                                 f"{left:.0f} s after it started (its own limit: {st.limit_s:g} s); raise --max-minutes")
            if r is None:
                if not st.skip:
                    started[i] = time.monotonic()
                    self._say(f"step {i + 1}/{total} start  {st.name} (limit {st.limit_s:g} s)")
                try:
                    r = self._run_one(st, self.log_dir)
                except Exception as e:  # noqa: BLE001 - one broken step must not end the suite
                    r = StepResult(st, "failed", message=f"the nightly could not run this step: {type(e).__name__}: {e}")
            started.pop(i, None)
            with self._lock:
                done[0] += 1
            extra = f": {r.message}" if r.message and r.status != "passed" else ""
            figs = f", {len(r.figures)} figures" if r.figures else ""
            self._say(f"step {i + 1}/{total} {r.status:>9}  {st.name} ({r.seconds:.1f} s{figs}){extra}  "
                      f"[{done[0]}/{total} done]")
            if r.fault_report:
                for ln in r.fault_report.splitlines():
                    self._say("    " + ln)
            return r

        i = 0
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            while i < total:
                if steps[i].parallel and self.jobs > 1:
                    j = i
                    while j < total and steps[j].parallel:
                        j += 1
                    futures = {pool.submit(one, k): k for k in range(i, j)}
                    pending = set(futures)
                    while pending:
                        finished, pending = wait(pending, timeout=self.heartbeat_s, return_when=FIRST_COMPLETED)
                        for f in finished:
                            results[futures[f]] = f.result()
                        if not finished:
                            self._heartbeat(steps, started)
                    i = j
                else:
                    f = pool.submit(one, i)
                    while True:
                        finished, _ = wait([f], timeout=self.heartbeat_s)
                        if finished:
                            results[i] = f.result()
                            break
                        self._heartbeat(steps, started)
                    i += 1
        return [results[k] for k in range(total)]

    def _heartbeat(self, steps: Sequence[Step], started: Dict[int, float]) -> None:
        now = time.monotonic()
        running = ", ".join(f"{steps[k].name} ({now - t:.0f}/{steps[k].limit_s:g} s)" for k, t in sorted(started.items()))
        if running:
            self._say(f"running: {running}")
