"""docs/support-matrix.md is generated from the backend classes (scripts/support_matrix.py) and must be
current; every verified entry names a real backend and mode."""

from __future__ import annotations

import importlib.util
import os

from epmoe.dispatch import DISPATCHERS
from epmoe.experts import EXPERTS
from epmoe.quant.plan import EXPERT_MODES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("support_matrix", os.path.join(ROOT, "scripts", "support_matrix.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_support_matrix_is_current():
    m = _script()
    with open(m.DOC) as f:
        assert f.read() == m.generate(), "docs/support-matrix.md is stale: run python scripts/support_matrix.py"


def test_verified_runs_name_real_backends():
    v = _script().load_verified()
    for e in v["experts"]:
        assert e["name"] in EXPERTS and e["mode"] in EXPERT_MODES + ("*",), e
    for d in v["dispatchers"]:
        assert d["name"] in DISPATCHERS and d["wire"] in ("bf16", "nvfp4", "fp8", "*"), d
    for entry in v["layers"]:
        assert entry["dispatcher"] in DISPATCHERS and entry["experts"] in EXPERTS, entry
    assert set(v["stand_in_only"]["experts"]) <= set(EXPERTS.names())
