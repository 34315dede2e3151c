"""DeepEP backends without DeepEP: availability probing (missing, broken, importable), no import at
module import, construction errors, and the support rules the plan relies on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from epmoe.core.availability import Availability
from epmoe.core.errors import BackendUnavailableError
from epmoe.dispatch import DISPATCHERS, DispatchSpec
from epmoe.dispatch import deepep as dd
from epmoe.quant.payload import PayloadFormat

BF16 = PayloadFormat.unquantized(torch.bfloat16)
FP8 = dd.fp8_block_format()
CLASSES = (dd.DeepEPDispatcher, dd.DeepEPLowLatencyDispatcher)


def _spec(ep_size=2, **kw):
    base = dict(
        group=None, ep_rank=0, ep_size=ep_size, num_experts=16, top_k=4, hidden_size=2048,
        max_tokens_per_rank=64, payload=BF16, combine_dtype=torch.bfloat16, device=torch.device("cuda", 0),
    )
    base.update(kw)
    return DispatchSpec(**base)


def test_registry_names_resolve_to_the_classes():
    assert DISPATCHERS.get("deepep") is dd.DeepEPDispatcher
    assert DISPATCHERS.get("deepep_ll") is dd.DeepEPLowLatencyDispatcher
    assert dd.DeepEPDispatcher.layout == "flat" and dd.DeepEPLowLatencyDispatcher.layout == "masked"


def test_importing_the_module_does_not_import_deep_ep():
    # a fresh interpreter whose deep_ep would blow up if anyone imported it
    code = textwrap.dedent(
        """
        import sys, types
        class Finder:
            def find_spec(self, name, path=None, target=None):
                if name == "deep_ep":
                    raise AssertionError("deep_ep imported at module import")
        sys.meta_path.insert(0, Finder())
        import epmoe, epmoe.dispatch, epmoe.dispatch.deepep, epmoe.experts.masked
        from epmoe.dispatch import DISPATCHERS
        DISPATCHERS.get("deepep"); DISPATCHERS.get("deepep_ll")
        assert "deep_ep" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("cls", CLASSES)
def test_missing_deep_ep_is_reported_with_the_install_hint(cls, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` -> ModuleNotFoundError
    a = cls.availability(torch.device("cuda", 0), 2)
    assert a == Availability.no("deep_ep is not installed", dd.INSTALL_HINT)
    assert "pip install 'epmoe[deepep]'" in dd.INSTALL_HINT and "docs/deepep.md" in dd.INSTALL_HINT
    assert not a and "unavailable: deep_ep is not installed" in a.describe()
    with pytest.raises(BackendUnavailableError, match="deep_ep is not installed.*docs/deepep.md"):
        cls(_spec())


def _plant_deep_ep(tmp_path, monkeypatch, init_text: str) -> None:
    """A `deep_ep` package whose __init__.py is `init_text`, first on sys.path, on a host judged as a GPU one."""
    pkg = tmp_path / "deep_ep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(init_text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.setattr(dd, "_device_problem", lambda device: None)  # as on a GPU machine


@pytest.mark.parametrize("cls", CLASSES)
def test_deep_ep_that_raises_on_import_is_unavailable_not_a_crash(cls, monkeypatch, tmp_path):
    _plant_deep_ep(tmp_path, monkeypatch, "raise RuntimeError('NCCL version check failed')\n")
    a = cls.availability(torch.device("cuda", 0), 2)
    assert not a
    assert "failed to import" in a.reason and "RuntimeError: NCCL version check failed" in a.reason
    assert "docs/deepep.md" in a.hint
    with pytest.raises(BackendUnavailableError, match="NCCL version check failed"):
        cls(_spec())


def test_deep_ep_with_a_missing_native_library_is_reported_as_broken(monkeypatch, tmp_path):
    _plant_deep_ep(tmp_path, monkeypatch, "import deep_ep_cpp_missing_native_part\n")
    a = dd.DeepEPLowLatencyDispatcher.availability(torch.device("cuda", 0), 1)
    assert not a and "installed but failed to import" in a.reason and "deep_ep_cpp_missing_native_part" in a.reason


def test_deep_ep_without_the_v1_buffer_api_is_unavailable(monkeypatch, tmp_path):
    """A DeepEP whose deep_ep.Buffer lacks what the dispatchers call (a V2-only build): unavailable,
    naming the missing methods, instead of an AttributeError in the first call."""
    _plant_deep_ep(tmp_path, monkeypatch, "class ElasticBuffer:\n    pass\n")
    a = dd.DeepEPDispatcher.availability(torch.device("cuda", 0), 2)
    assert not a and "has no V1 API (deep_ep.Buffer lacks ['get_dispatch_layout'" in a.reason, a.reason


@pytest.mark.parametrize("cls", CLASSES)
def test_importable_deep_ep_on_cpu_names_the_device(cls, monkeypatch):
    from tests.cpu import fake_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    a = cls.availability(torch.device("cpu"), 2)
    assert not a and "CUDA" in a.reason and "cpu" in a.reason


def test_normal_mode_ep_sizes():
    for ep in (2, 4, 8):
        assert dd.normal_mode_ep_support(ep)
    one = dd.normal_mode_ep_support(1)
    assert not one and "one rank" in one.reason and "Unsupported ranks" in one.reason
    assert "deepep_ll" in one.hint
    for ep in (3, 6, 16):
        a = dd.normal_mode_ep_support(ep)
        assert not a and f"got {ep}" in a.reason


def test_normal_mode_one_rank_is_rejected_before_touching_deep_ep(monkeypatch):
    from tests.cpu import fake_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    monkeypatch.setattr(dd, "_device_problem", lambda device: None)
    assert not dd.DeepEPDispatcher.availability(torch.device("cuda", 0), 1)
    assert dd.DeepEPLowLatencyDispatcher.availability(torch.device("cuda", 0), 1)
    n = len(fake_deep_ep.Buffer.instances)
    with pytest.raises(BackendUnavailableError, match="cannot run with one rank"):
        dd.DeepEPDispatcher(_spec(ep_size=1))
    assert len(fake_deep_ep.Buffer.instances) == n


def test_wire_support_rules():
    ok = dd.deepep_wire_support
    assert ok(BF16, BF16, torch.bfloat16, low_latency=False)
    assert ok(FP8, FP8, torch.bfloat16, low_latency=False)
    assert ok(FP8, BF16, torch.bfloat16, low_latency=True)  # dequantized on arrival
    nvfp4 = PayloadFormat("nvfp4", torch.uint8, 2, 16, torch.float8_e4m3fn, "linear", True)
    a = ok(nvfp4, nvfp4, torch.bfloat16, low_latency=False)
    assert not a and "nvfp4" in a.reason and "NVFP4" in a.reason and "bf16 or fp8" in a.hint
    a = ok(nvfp4, BF16, torch.bfloat16, low_latency=True)
    assert not a and "nvfp4" in a.reason
    a = ok(BF16, FP8, torch.bfloat16, low_latency=False)  # experts want FP8, wire is BF16
    assert not a and "experts take" in a.reason
    a = ok(PayloadFormat.unquantized(torch.float16), PayloadFormat.unquantized(torch.float16), torch.float16,
           low_latency=False)
    assert not a and "BF16 only" in a.reason
    a = ok(BF16, BF16, torch.float32, low_latency=True)
    assert not a and "float32" in a.reason


def test_unsupported_wire_is_a_construction_error(monkeypatch):
    from tests.cpu import fake_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    monkeypatch.setattr(dd, "_device_problem", lambda device: None)
    nvfp4 = PayloadFormat("nvfp4", torch.uint8, 2, 16, torch.float8_e4m3fn, "linear", True)
    with pytest.raises(ValueError, match="'deepep_ll'.*cannot move nvfp4"):
        dd.DeepEPLowLatencyDispatcher(_spec(ep_size=1, wire=nvfp4))


def test_low_latency_shape_problems():
    good = dict(hidden_size=7168, top_k=8, num_experts=256, ep_size=8, max_tokens_per_rank=128, fp8=True)
    assert dd.low_latency_shape_problems(**good) == []
    p = dd.low_latency_shape_problems(**{**good, "hidden_size": 1024})
    assert len(p) == 1 and "hidden_size=1024" in p[0]
    p = dd.low_latency_shape_problems(**{**good, "hidden_size": 2560, "fp8": True})
    assert p == []  # 2560 % 512 == 0
    p = dd.low_latency_shape_problems(**{**good, "top_k": 12})
    assert len(p) == 1 and "top_k=12" in p[0]
    p = dd.low_latency_shape_problems(**{**good, "ep_size": 1, "max_tokens_per_rank": 6})
    assert len(p) == 1 and "multiple of 4" in p[0]
    p = dd.low_latency_shape_problems(**{**good, "num_experts": 100})
    assert any("not divisible" in m for m in p)


def test_required_qp_depth():
    assert dd.required_qp_depth(128) == 1024
    assert dd.required_qp_depth(511) == 1024  # 2 * 512 = 1024 fits the default
    assert dd.required_qp_depth(512) == 2048
    assert dd.required_qp_depth(4096) == 16384


def test_too_small_qp_depth_env_is_an_error_naming_the_fix(monkeypatch):
    from tests.cpu import fake_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "256")
    with pytest.raises(ValueError, match="NVSHMEM_QP_DEPTH=256.*NVSHMEM_QP_DEPTH=1024"):
        dd.DeepEPBuffer(object(), low_latency=True, sizes=dd.DeepEPBufferSizes(num_rdma_bytes=128),
                        device=torch.device("cpu"), ll_layout=(128, 2048, 16))


def test_deepep_config_validation():
    dd.DeepEPConfig()
    with pytest.raises(ValueError, match="num_sms=21"):
        dd.DeepEPConfig(num_sms=21)
    with pytest.raises(ValueError, match="send=256"):
        dd.DeepEPConfig(num_max_nvl_chunked_send_tokens=256, num_max_nvl_chunked_recv_tokens=256)
    d, c = dd.default_configs(2)
    assert (d.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_send_tokens) == (24, 10)
    with pytest.raises(ValueError, match="one rank"):
        dd.default_configs(1)


def test_fp8_block_roundtrip_is_within_the_e4m3_bound():
    seed = int(torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(7, 512, generator=g) * torch.logspace(-3, 2, 512)).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero block: amax floor, exact zeros back
    data, scales = dd.fp8_block_quantize(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (7, 512)
    assert scales.dtype == torch.float32 and scales.shape == (7, 4)
    back = dd.fp8_block_dequantize(data, scales)
    xf = x.float()
    # e4m3: 3 mantissa bits -> relative half-ulp 2^-4; subnormal step 2^-9 of the block scale
    bound = xf.abs() * 2.0**-4 + scales.repeat_interleave(128, dim=1) * 2.0**-9 + 1e-12
    assert ((back - xf).abs() <= bound * 1.001).all(), f"seed {seed}"
    assert (back[0, :128] == 0).all()
    with pytest.raises(ValueError, match="% 128"):
        dd.fp8_block_quantize(torch.zeros(2, 100))
