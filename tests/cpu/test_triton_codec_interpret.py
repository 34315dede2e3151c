"""The Triton activation codec (epmoe.quant.triton_codec) under the Triton interpreter: bit-identical
to the torch reference (nvfp4 "rn", fp8_block 1x128, mxfp8 floor; quantize and dequantize) on random
and adversarial inputs (block maxima over 120 binades, zero / -0 / all-equal blocks, subnormal and
huge values, +-inf, ties at every E2M1 / E4M3 midpoint, saturating and zero block scales, given and
per-row global scales, random receiver bytes), with fresh seeds (printed on failure).

The interpreter needs TRITON_INTERPRET=1 before triton is imported, so the cases run in one
subprocess (~5-10 s). The GPU half of the check (inline PTX path) is tests/gpu/test_triton_codec.py.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.cpu.interpret import run_interpret_worker
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.cpu._triton_codec_cases import CASES  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton_codec_interpret_worker.py")


@pytest.fixture(scope="module")
def results():
    return run_interpret_worker(_WORKER, CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_codec_bit_exact(results, case):
    r = results.get(case)
    assert r is not None, f"{case}: no result"
    assert r["ok"], f"{case} (seed {r['seed']}):\n" + "\n".join(r["errors"])


def test_importing_epmoe_does_not_import_triton():
    code = "import sys, epmoe, epmoe.quant.codec, epmoe.dispatch; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_path_selection(monkeypatch):
    from epmoe.quant import codec

    assert codec.triton_codec_for("cpu") is None  # CPU tensors: the torch reference
    assert codec.triton_codec_for("cuda", use_triton=False) is None
    monkeypatch.setenv(codec.TRITON_CODEC_ENV, "0")
    assert codec.triton_codec_for("cuda") is None
    monkeypatch.setenv(codec.TRITON_CODEC_ENV, "1")
    # with triton importable, CUDA tensors get the kernels (imported lazily, here in this process)
    assert codec.triton_codec_for("cuda") is not None
    assert codec.triton_codec_for("cpu", use_triton=True) is not None


def test_cpu_tensor_without_interpreter_is_an_error():
    from epmoe.quant import codec

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        codec.quantize_activation(x, codec.NVFP4, use_triton=True)
    # the default never picks the kernels for CPU tensors
    q = codec.quantize_activation(x, codec.NVFP4)
    assert torch.equal(q.data, codec.quantize_activation(x, codec.NVFP4, use_triton=False).data)
