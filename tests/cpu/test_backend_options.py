"""Typed backend options: a typo is a TypeError naming the valid keys; options are part of the
cross-rank fingerprint, so ranks built with different options fail at construction (every rank,
naming the field and the ranks) instead of hanging in the first dispatch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe import EPMoE, MoEConfig
from epmoe.core.errors import ConfigMismatchError
from epmoe.dispatch import DISPATCHERS
from epmoe.experts import EXPERTS
from epmoe.quant.plan import QuantPlan
from tests.cpu.mp import WorkerError, run_group

CFG = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, dtype=torch.float32)


@pytest.mark.parametrize("registry", [DISPATCHERS, EXPERTS])
def test_every_backend_has_frozen_typed_options_that_reject_unknown_keys(registry):
    for name in registry.names():
        opts_cls = registry.get(name).Options
        o = opts_cls()
        assert dataclasses.is_dataclass(o) and opts_cls.__dataclass_params__.frozen, name
        valid = [f.name for f in dataclasses.fields(opts_cls)]
        with pytest.raises(TypeError) as e:
            opts_cls.parse({"no_such_option_xyz": 1}, name)
        assert "no_such_option_xyz" in str(e.value) and str(valid or "none") in str(e.value), str(e.value)
        assert opts_cls.parse(None) == o and opts_cls.parse({}) == o
        assert all(isinstance(v, str) for v in o.fingerprint("x").values())


def test_flashinfer_typo_names_the_valid_keys():
    from epmoe.dispatch.flashinfer_a2a import FlashInferA2AOptions

    with pytest.raises(TypeError, match=r"\['runtim_max_tokens'\]; valid options: \['runtime_max_tokens'"):
        FlashInferA2AOptions.parse({"runtim_max_tokens": "uniform"}, "dispatcher 'flashinfer'")
    with pytest.raises(ValueError, match="runtime_max_tokens='sometimes'"):
        FlashInferA2AOptions.parse({"runtime_max_tokens": "sometimes"})
    assert FlashInferA2AOptions.parse({"runtime_max_tokens": "uniform"}).runtime_max_tokens == "uniform"


def test_layer_rejects_a_typo_in_options():
    with pytest.raises(TypeError, match=r"experts backend 'reference' option\(s\) \['bogus'\]; valid options: \['mode'\]"):
        EPMoE(CFG, device="cpu", experts_options={"bogus": 1})
    with pytest.raises(TypeError, match=r"dispatcher 'torch' option\(s\) \['runtim_max_tokens'\]; valid options: none"):
        EPMoE(CFG, device="cpu", dispatcher_options={"runtim_max_tokens": "uniform"})


def _mismatch_worker(rank, world):
    # the plan names the FlashInfer dispatcher; the options disagree, so construction fails in the
    # fingerprint agreement, before any backend is built (nothing FlashInfer is needed on CPU)
    plan = QuantPlan(dispatcher="flashinfer", experts_backend="reference")
    try:
        EPMoE(CFG, device="cpu", plan=plan,
              dispatcher_options={"runtime_max_tokens": "uniform" if rank == 0 else "allreduce"})
    except ConfigMismatchError as e:
        return str(e)
    return "built"


def test_mismatched_options_fail_at_construction_on_every_rank():
    msgs = run_group(_mismatch_worker, 2, timeout=120)
    for m in msgs:
        assert "dispatcher_options.runtime_max_tokens differs" in m, m
        assert "ranks [0]: 'uniform'" in m and "ranks [1]: 'allreduce'" in m, m


def test_close_frees_what_the_layer_and_its_runners_built():
    from tests.cpu.helpers import random_weights

    layer = EPMoE(CFG, device="cpu")
    layer.load_weights(random_weights(CFG, 3))
    a, b, c = layer.decode_runner(8, cuda_graph=False), layer.decode_runner(8, cuda_graph=False), layer.decode_runner(4, cuda_graph=False)
    assert a.dispatcher is b.dispatcher and a.dispatcher is not c.dispatcher  # one static dispatcher per size
    x = torch.randn(3, CFG.hidden_size)
    logits = torch.randn(3, CFG.num_experts)
    assert torch.allclose(a(x, logits), layer(x, logits), rtol=1e-5, atol=1e-6)
    closed = []
    for d in (layer.dispatcher, a.dispatcher, c.dispatcher):
        d.close = (lambda d=d: closed.append(d))
    layer.close()
    assert len(closed) == 3 and layer.dispatcher is None and a.dispatcher is None
