"""epmoe.experts.triton.launch.KernelLauncher against a STAND-IN Triton kernel (a recording fake: this proves
the cache keys and the argument assembly of the direct launch only; tests/gpu/test_host_overhead_gpu.py
checks the direct launches against Triton's own path on a GPU, bit for bit)."""

import types

import pytest
import torch

from epmoe.experts.triton import launch as L


def kern(x, y, n, stride, alpha, BLOCK=16, FLAG=False):  # the fake kernel's signature
    pass


class FakeCompiled:
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.direct = []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)

    @property
    def run(self):
        return self._run

    def _run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
        self.direct.append(((g0, g1, g2), stream, metadata, args))
        if enter is not None:
            enter(metadata)


def kern_many(x, y, n, stride, alpha, t2, t3, t4, i5, i6, i7, i8, flag, none, BLOCK=16, FLAG=False):
    pass  # more arguments than _PLAN_MIN_ARGS: keyed through an _ArgPlan


class FakeJIT:
    """Binds like Triton (params in signature order, defaults filled, options left over)."""

    def __init__(self, bind_ok=True, signature_of=kern):
        import inspect

        self.signature = inspect.signature(signature_of)
        self.pre_run_hooks = []
        self.compiled = FakeCompiled()
        self.triton_path = []
        self.bind_ok = bind_ok
        self.device_caches = {0: (None, None, None, None, self._binder)}

    def _binder(self, *args, **kwargs):
        params = {k: v for k, v in kwargs.items() if k in self.signature.parameters}
        b = self.signature.bind(*args, **params)
        b.apply_defaults()
        bound = dict(b.arguments)
        if not self.bind_ok:
            bound["n"] = int(str(bound["n"]))  # another object: the direct path must not be used
        return bound, [], {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.triton_path.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def launcher(monkeypatch):
    import sys

    import triton.runtime.driver  # noqa: F401 - the module (the package re-exports a `driver` object)

    drv = sys.modules["triton.runtime.driver"]
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda dev: 1234)
    monkeypatch.setattr(drv, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    lau = L.KernelLauncher(torch.device("cuda"))
    lau.fast = True

    def use(fn):  # as KernelLauncher._resolve would find it in triton_kernels
        lau._kernels = {"kern": (fn, L.plain_jit(fn))}
        return lau
    return use


def _args(x, n=4096):
    return (x, x, n, 7168, 1.5)


def test_second_launch_with_the_same_key_is_direct(launcher):
    fn = FakeJIT()
    lau = launcher(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    kw = dict(BLOCK=64, num_warps=4)
    lau("kern", (3,), _args(x), kw)
    assert len(fn.triton_path) == 1 and not fn.compiled.direct
    lau("kern", (5, 2), _args(x), kw)
    assert len(fn.triton_path) == 1
    grid, stream, metadata, args = fn.compiled.direct[0]
    # positional args, then BLOCK from the keywords and FLAG's default; num_warps is an option
    assert grid == (5, 2, 1) and stream == 1234 and metadata is None  # no launch hooks: no metadata
    assert args == _args(x) + (64, False)
    assert len(L.launch_keys(lau)) == 1


def test_launch_hooks_get_their_metadata(launcher, monkeypatch):
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [seen.append])
    fn = FakeJIT()
    lau = launcher(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    lau("kern", (3,), _args(x), {})
    lau("kern", (3,), _args(x), {})
    assert fn.compiled.direct[0][2] == ("metadata", (3,)) and seen == [("metadata", (3,))]


def _many(x, n=4095, first=None, last=None, flag=True, none=None, i8=64):
    return (first if first is not None else x, x, n, 7168, 1.5, x, x, last if last is not None else x,
            64, 64, 64, i8, flag, none)


@pytest.mark.parametrize("many", [False, True], ids=["few_args", "many_args"])
@pytest.mark.parametrize("change", ["misaligned", "dtype", "one", "multiple_of_16", "int64", "keyword", "option",
                                    "misaligned_last", "dtype_last", "bool", "none_to_float", "int_to_float"])
def test_what_triton_specializes_on_gets_its_own_key(launcher, change, many):
    if not many and change in ("misaligned_last", "dtype_last", "bool", "none_to_float", "int_to_float"):
        pytest.skip("a many-argument change")
    fn = FakeJIT(signature_of=kern_many if many else kern)
    lau = launcher(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    base_args = _many(x) if many else _args(x, n=4095)
    kw = dict(BLOCK=64, num_warps=4)
    lau("kern", (1,), base_args, kw)
    lau("kern", (1,), base_args, kw)
    assert len(fn.triton_path) == 1
    if many:  # other values of the same classes: the same key
        lau("kern", (1,), _many(x[8:], n=4093, i8=48), kw)
        assert len(fn.triton_path) == 1 and len(fn.compiled.direct) == 2
    args, kw2 = base_args, kw
    if many:
        args = {"misaligned": _many(x, first=x[1:]), "dtype": _many(x, first=x.float()), "one": _many(x, n=1),
                "multiple_of_16": _many(x, n=4096), "int64": _many(x, n=1 << 33 | 1),
                "misaligned_last": _many(x, last=x[1:]), "dtype_last": _many(x, last=x.half()),
                "bool": _many(x, flag=False), "none_to_float": _many(x, none=2.0),
                "int_to_float": _many(x, i8=64.0)}.get(change, base_args)
    elif change == "misaligned":
        args = (x[1:], x, 4095, 7168, 1.5)
    elif change == "dtype":
        args = (x.float(), x, 4095, 7168, 1.5)
    elif change == "one":
        args = (x, x, 1, 7168, 1.5)
    elif change == "multiple_of_16":
        args = (x, x, 4096, 7168, 1.5)
    elif change == "int64":
        args = (x, x, 1 << 33 | 1, 7168, 1.5)
    if change == "keyword":
        kw2 = dict(BLOCK=128, num_warps=4)
    elif change == "option":
        kw2 = dict(BLOCK=64, num_warps=8)
    direct = len(fn.compiled.direct)
    lau("kern", (1,), args, kw2)
    assert len(fn.triton_path) == 2  # a new key: Triton's path first
    lau("kern", (1,), args, kw2)
    assert len(fn.triton_path) == 2 and len(fn.compiled.direct) == direct + 1
    assert fn.compiled.direct[-1][3][:len(args)] == args


def test_unbindable_kernels_and_unknown_arguments_keep_tritons_path(launcher):
    fn = FakeJIT(bind_ok=False)
    lau = launcher(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    for _ in range(3):
        lau("kern", (1,), _args(x), {})
    assert len(fn.triton_path) == 3 and not fn.compiled.direct
    fn2 = FakeJIT()
    lau = launcher(fn2)
    for _ in range(3):
        lau("kern", (1,), (x, x, "a string", 7168, 1.5), {})
    assert len(fn2.triton_path) == 3 and not fn2.compiled.direct
    fn3 = FakeJIT(signature_of=kern_many)
    lau = launcher(fn3)
    for _ in range(3):  # the same through an _ArgPlan (many arguments)
        lau("kern", (1,), _many(x, none="a string"), {})
    assert len(fn3.triton_path) == 3 and not fn3.compiled.direct
    lau = launcher(fn2)
    for _ in range(2):  # an unhashable keyword value
        lau("kern", (1,), _args(x), {"BLOCK": [16]})
    assert len(fn2.triton_path) == 5 and not fn2.compiled.direct
    lau.fast = False
    for _ in range(2):
        lau("kern", (1,), _args(x), {})
    assert len(fn2.triton_path) == 7 and not fn2.compiled.direct


def test_arg_key_classes():
    k = L.arg_key
    assert k(1) != k(2) != k(32) and k(16) == k(32) and k(3) == k(5)
    assert k(1 << 40) != k(3) and k((1 << 40) + 1) != k(1 << 40) and k(1 << 63) != k((1 << 63) - 16)
    assert k(-16) == k(16) and k(-3) == k(3)
    x = torch.zeros(16, dtype=torch.bfloat16)
    assert k(x) == k(torch.zeros(8, dtype=torch.bfloat16)) and k(x[1:]) != k(x) and k(x[8:]) == k(x)
    assert k(1.0) == k(2.5) and k(None) != k(1.0) and k(True) != k(False)
    assert k(True) != k(1) and k(False) != k(0) and k(1.0) != k(1)
    with pytest.raises(TypeError):
        k("text")


def test_wrapped_kernels_keep_tritons_path(launcher):
    """An autotuner / heuristics wrapper (no pre_run_hooks list) is launched through Triton every time."""
    fn = FakeJIT()
    del fn.pre_run_hooks
    lau = launcher(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    for _ in range(3):
        lau("kern", (1,), _args(x), {})
    assert len(fn.triton_path) == 3 and not fn.compiled.direct


@pytest.mark.parametrize("many", [False, True], ids=["few_args", "many_args"])
def test_launch_options_key_by_value_and_stay_read_only(launcher, many):
    """LaunchOptions (keywords built once by the caller) key the launch like a dict of the same items:
    the second launch is direct with the keywords bound as before; other values get their own key
    (Triton's path first); the object cannot be changed behind the cache's back."""
    fn = FakeJIT(signature_of=kern_many if many else kern)
    lau = launcher(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    args = _many(x) if many else _args(x)
    opts = L.LaunchOptions(BLOCK=64, num_warps=4)
    lau("kern", (3,), args, opts)
    lau("kern", (3,), args, L.LaunchOptions(BLOCK=64, num_warps=4))  # equal options: the same key
    assert len(fn.triton_path) == 1 and len(fn.compiled.direct) == 1
    assert fn.compiled.direct[0][3] == args + (64, False)
    lau("kern", (3,), args, L.LaunchOptions(opts, BLOCK=32))
    assert len(fn.triton_path) == 2  # another value: its own key
    lau("kern", (3,), args, dict(BLOCK=64, num_warps=4))  # a plain dict of the same items: keyed apart, works
    lau("kern", (3,), args, dict(BLOCK=64, num_warps=4))
    assert len(fn.triton_path) == 3 and fn.compiled.direct[-1][3] == args + (64, False)
    for change in (lambda o: o.__setitem__("BLOCK", 1), lambda o: o.update(BLOCK=1), lambda o: o.pop("BLOCK"),
                   lambda o: o.setdefault("X", 1), lambda o: o.clear()):
        with pytest.raises(TypeError):
            change(opts)
    assert opts == {"BLOCK": 64, "num_warps": 4}
    with pytest.raises(TypeError):
        L.LaunchOptions(BLOCK=[16])  # unhashable values: refused when built
