"""Triton kernel launches for the experts backends and the fused routing, with the host side of each launch
kept small.

    launch = KernelLauncher(device)
    launch("moe_gemm1_kernel", grid, args, kwargs)     # = triton_kernels.moe_gemm1_kernel[grid](*args, **kwargs)

`kernel[grid](...)` costs ~15-30 us of Python per launch in Triton 3.6 (binding the arguments, computing
the specialization key, formatting the options into a string key, launch metadata), several times a
kernel's own time at decode sizes, paid again on every layer call. On a CUDA device the launcher keeps
the compiled kernel Triton returned for the first launch under a key of its own that is at least as fine
as Triton's specialization: per argument, a tensor's dtype and 16-byte alignment of its address, an
int's value class (== 1, multiple of 16, int32 / int64 / uint64 range), the type of anything else; the
constexpr / option keywords by value (a `LaunchOptions` the caller built once: hashed once); the current device (a launch with many arguments computes the
same classes through an `_ArgPlan` of its argument types: tensors' dtypes and one alignment flag when
all are aligned, the ints' classes remembered per tuple of int values). A later launch with the same
key calls that kernel's launcher directly (same stream, launch metadata and launch hooks as Triton's own path; with
no launch hook installed, none is called and no metadata is built). The
first launch of each key goes through Triton (compiling if needed) and checks that Triton binds the
arguments the way the direct path passes them; where it does not (another Triton version, an argument
type the key does not know), that kernel keeps Triton's path. Triton's debug / instrumentation knobs
count as they were at a key's first launch. Env EPMOE_TRITON_FAST_LAUNCH=0 (read at
import) or `KernelLauncher.fast = False` turns the direct path off. The Triton interpreter (CPU) always
takes Triton's path.
"""

from __future__ import annotations

import inspect
import operator
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

FAST_LAUNCH = os.environ.get("EPMOE_TRITON_FAST_LAUNCH", "1") != "0"
_INT32_MIN, _INT32_MAX, _INT64_MAX = -(1 << 31), (1 << 31) - 1, (1 << 63) - 1


def arg_key(a: Any, _tensor=torch.Tensor) -> Any:
    """What Triton specializes a kernel argument on, or finer (TypeError: unknown kind -> Triton's path)."""
    c = a.__class__
    if c is int:
        if _INT32_MIN <= a <= _INT32_MAX:
            return 1 if a == 1 else (16 if a & 15 == 0 else 0)
        return (64 if a <= _INT64_MAX else 65, a & 15 == 0)
    if isinstance(a, _tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if c is float or a is None:
        return c
    if c is bool:
        return ("u1", a)  # never equal to an int's key (True == 1)
    raise TypeError(f"no launch key for a {c.__name__}")


_NONE = type(None)
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_INT_KEYS_MAX = 4096  # int-argument tuples remembered per argument-type signature
_PLAN_MIN_ARGS = 12  # launches with more arguments than this key them through an _ArgPlan


def _getter(positions):
    """args -> tuple of the arguments at these positions (at C speed)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        one = operator.itemgetter(positions[0])
        return lambda args: (one(args),)
    return operator.itemgetter(*positions)


class _ArgPlan:
    """Where the tensors, ints and bools sit in one tuple of argument types (floats and None are
    keyed by their type alone, which the types tuple holds). `key(args)` is `arg_key` of every
    argument in a cheaper form: tensors' dtypes, their 16-byte alignment (one flag when all are
    aligned, the usual case), the ints' value classes (remembered per tuple of int values: strides
    and sizes repeat from call to call), the bools' values."""

    __slots__ = ("tensors", "ints", "bools", "int_keys")

    def __init__(self, types: tuple):
        t, i, b = [], [], []
        for n, c in enumerate(types):
            if c is int:
                i.append(n)
            elif c is bool:
                b.append(n)
            elif issubclass(c, torch.Tensor):
                t.append(n)
            elif c is not float and c is not _NONE:
                raise TypeError(f"no launch key for a {c.__name__}")
        self.tensors, self.ints, self.bools = _getter(t), _getter(i), _getter(b) if b else None
        self.int_keys: Dict[tuple, tuple] = {}

    def key(self, args: tuple) -> tuple:
        ts = self.tensors(args)
        ptrs = tuple(map(_DATA_PTR, ts))
        acc = 0
        for p in ptrs:
            acc |= p
        aligned = True if acc & 15 == 0 else tuple([p & 15 == 0 for p in ptrs])
        ints = self.ints(args)
        ik = self.int_keys.get(ints)
        if ik is None:
            if len(self.int_keys) >= _INT_KEYS_MAX:
                self.int_keys.clear()
            ik = self.int_keys[ints] = tuple(map(arg_key, ints))
        bools = self.bools
        return tuple(map(_DTYPE, ts)), aligned, ik, bools(args) if bools is not None else ()


def plain_jit(fn) -> bool:
    """A plain Triton JITFunction (not an autotuner / heuristics wrapper)?"""
    return isinstance(getattr(fn, "pre_run_hooks", None), list) and hasattr(fn, "device_caches")


class _Direct:
    """A compiled kernel and the constexpr arguments that follow the positional ones."""

    __slots__ = ("kernel", "run", "tail")

    def __init__(self, kernel, run, tail: tuple):
        self.kernel, self.run, self.tail = kernel, run, tail


_TRITON_PATH = object()  # cache value: this key launches through kernel[grid]


class LaunchOptions(dict):
    """The constexpr / option keywords of launches that a caller builds once and passes on every launch:
    read-only, hashed once, so the launcher keys on the object itself instead of a tuple of its items
    rebuilt and rehashed per launch (a plain dict works too, at that cost). Values must be hashable."""

    __slots__ = ("_hash",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hash = hash(tuple(self.items()))

    def __hash__(self) -> int:
        return self._hash

    def _read_only(self, *args, **kwargs):
        raise TypeError("LaunchOptions are read-only: build new ones (LaunchOptions(old, NAME=value))")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _read_only


# --------------------------------------------------------------------------- kernels by name


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_module(device: torch.device):
    """The Triton kernels (imports triton). CPU tensors run only under the Triton interpreter, which
    must be switched on (TRITON_INTERPRET=1) before triton is first imported in the process."""
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"Triton kernels on device {device} need the interpreter: set TRITON_INTERPRET=1 before "
            "importing triton (tests do this in a subprocess)"
        )
    from epmoe.experts.triton import triton_kernels

    return triton_kernels


def kernel_function(device: torch.device, name: str):
    """A kernel by name: the Gluon W4A16 kernels (`gluon_w4a16`, GPU only) or a Triton kernel."""
    if name.startswith("w4a16_"):
        if device.type != "cuda":
            raise RuntimeError(f"Gluon kernel {name} needs a CUDA device (the Triton interpreter cannot run it)")
        from epmoe.experts.triton import gluon_w4a16

        return getattr(gluon_w4a16, name)
    return getattr(kernel_module(device), name)


# --------------------------------------------------------------------------- launcher


class KernelLauncher:
    """Launches the kernels of `epmoe.experts.triton.triton_kernels` by name (see the module docstring)."""

    def __init__(self, device: torch.device, kernels: Optional[Callable[[], Any]] = None):
        """kernels: returns the module whose plain Triton kernels this launcher launches by name
        (default: `kernel_function`: the experts backends' kernels, Gluon kernels included)."""
        self.device = torch.device(device)
        self._module = kernels
        self.fast = FAST_LAUNCH and self.device.type == "cuda"
        self._kernels: Dict[str, tuple] = {}  # name -> (kernel, may launch directly)
        self._cache: Dict[tuple, Any] = {}
        self._plans: Dict[tuple, _ArgPlan] = {}  # argument types -> where tensors / ints / bools sit
        # the current CUDA device, without torch.cuda's lazy-init check once CUDA runs (a launch through
        # Triton came first)
        self._device_index = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        self._stream = None
        self._knobs = None

    def __call__(self, kernel_name: str, grid: tuple, args: tuple, kwargs: dict) -> None:
        found = self._kernels.get(kernel_name)
        if found is None:
            found = self._kernels[kernel_name] = self._resolve(kernel_name)
        fn, direct_ok = found
        # not a plain Triton kernel of triton_kernels (Gluon, an autotuner / heuristics wrapper), or
        # pre-run hooks: Triton's path
        if not (self.fast and direct_ok) or fn.pre_run_hooks:
            fn[grid](*args, **kwargs)
            return
        try:
            if len(args) > _PLAN_MIN_ARGS:
                types = tuple(map(type, args))
                plan = self._plans.get(types)
                if plan is None:
                    plan = self._plans[types] = _ArgPlan(types)
                # the plan stands for the types (one plan per types tuple, kept: hashed by identity)
                options = kwargs if kwargs.__class__ is LaunchOptions else tuple(kwargs.items())
                key = (kernel_name, self._device_index(), options, plan, *plan.key(args))
            else:  # few arguments: arg_key of each is cheaper than the plan's steps
                options = kwargs if kwargs.__class__ is LaunchOptions else tuple(kwargs.items())
                key = (kernel_name, self._device_index(), options, tuple(map(arg_key, args)))
            entry = self._cache.get(key)
        except TypeError:  # an argument kind the key does not know, or an unhashable keyword value
            fn[grid](*args, **kwargs)
            return
        if entry is None:
            kernel = fn[grid](*args, **kwargs)  # Triton's path: compiles or finds the kernel, launches it
            self._cache[key] = self._direct(fn, kernel, args, kwargs) or _TRITON_PATH
            return
        if entry is _TRITON_PATH:
            fn[grid](*args, **kwargs)
            return
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        stream = self._stream(key[1])
        every = args + entry.tail
        kernel, runtime = entry.kernel, self._knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if getattr(enter, "calls", True) or getattr(leave, "calls", True):
            metadata = kernel.launch_metadata(grid, stream, *every)
        else:  # empty hook chains (the usual case): nothing to call, no metadata to build
            enter = leave = metadata = None
        entry.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *every)

    def _resolve(self, kernel_name: str) -> tuple:
        """(kernel, direct launch allowed): `kernel_function`'s kernel; only plain JITFunctions of
        `epmoe.experts.triton.triton_kernels` launch directly (Gluon kernels keep Triton's path)."""
        if self._module is not None:
            fn = getattr(self._module(), kernel_name)
            if interpreter_enabled():
                self.fast = False
                return fn, False
            return fn, plain_jit(fn)
        fn = kernel_function(self.device, kernel_name)
        if interpreter_enabled():
            self.fast = False
            return fn, False
        return fn, getattr(kernel_module(self.device), kernel_name, None) is fn and plain_jit(fn)

    def _direct(self, fn, kernel, args: tuple, kwargs: dict) -> Optional[_Direct]:
        """The direct launch of `kernel`, or None where this Triton does not bind as expected."""
        try:
            from triton import knobs
            from triton.runtime.driver import driver

            if kernel is None or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
                return None
            params = list(fn.signature.parameters.values())
            if len(args) > len(params) or any(p.name in kwargs for p in params[: len(args)]):
                return None
            tail = []
            for p in params[len(args):]:
                if p.name in kwargs:
                    tail.append(kwargs[p.name])
                elif p.default is not inspect.Parameter.empty:
                    tail.append(p.default)
                else:
                    return None
            tail = tuple(tail)
            # Triton's own binding of these arguments must be exactly what the direct launch passes
            device = driver.active.get_current_device()
            binder = fn.device_caches[device][4]
            bound, _, _ = binder(*args, **kwargs)
            if len(bound) != len(args) + len(tail) or any(
                    a is not b for a, b in zip(bound.values(), args + tail)):  # fmt: skip
                return None
            run = kernel.run
            if self._stream is None:
                self._stream = driver.active.get_current_stream
                self._knobs = knobs
            return _Direct(kernel, run, tail)
        except Exception:  # noqa: BLE001 - any difference in Triton's internals: keep Triton's path
            return None


def launch(owner, kernel_name: str, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Launch through `owner`'s KernelLauncher (`owner._launcher`, made on first use for `owner.device`):
    the experts backends' `_launch`."""
    launcher = owner.__dict__.get("_launcher")
    if launcher is None:
        launcher = owner._launcher = KernelLauncher(owner.device)
    launcher(kernel_name, grid, args, kwargs)


def launch_keys(launcher: KernelLauncher) -> Tuple[tuple, ...]:
    """The keys launched directly so far (tests and benchmarks)."""
    return tuple(k for k, v in launcher._cache.items() if v is not _TRITON_PATH)
