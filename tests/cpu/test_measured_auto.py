"""experts="auto" follows the measured table (epmoe.resolve.MEASURED_AUTO) per arch, mode and batch."""

import pytest
import torch

from epmoe import MoEConfig
from epmoe.experts import EXPERTS
from epmoe.resolve import MEASURED_AUTO, Environment, measured_choice, resolve_plan

CFG = MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, dtype=torch.bfloat16)


def _env(**drop):
    env = Environment.hypothetical("sm90", "0.7.2.post1")
    return Environment(env.arch, env.flashinfer_version, frozenset(p for p in env.packages if p not in drop))


@pytest.mark.parametrize("key", sorted(MEASURED_AUTO))
def test_every_row_names_a_backend_that_runs_the_mode(key):
    arch, mode = key
    rows = MEASURED_AUTO[key]
    assert rows[-1].max_tokens is None, "the last row covers every larger batch"
    sizes = [r.max_tokens for r in rows[:-1]]
    assert sizes == sorted(sizes)
    for row in rows:
        assert row.backend in EXPERTS.names() and row.evidence
        plan = resolve_plan(CFG, experts=row.backend, quant=mode, environment=_env())
        assert plan.experts_backend == row.backend


@pytest.mark.parametrize("mode, want", [("bf16", "triton"), ("fp8_block", "triton"), ("mxfp4_w4a16", "triton"),
                                        ("mxfp4_w4a8", "flashinfer_cutlass")])
@pytest.mark.parametrize("tokens", [None, 1, 128, 4096])
def test_auto_picks_the_measured_backend_and_says_why(mode, want, tokens):
    if mode == "fp8_block" and (tokens is None or tokens > 128):
        want = "deepgemm"  # prefill: DeepGEMM's contiguous grouped GEMMs, measured 2026-12-07
    plan = resolve_plan(CFG, quant=mode, environment=_env(), max_tokens_per_rank=tokens)
    assert plan.experts_backend == want
    note = [n for n in plan.notes if n.startswith("experts auto")]
    day = "H200 2026-12-07" if want == "deepgemm" else "H200 2026-12-04"
    assert note and "measured fastest" in note[0] and day in note[0], plan.notes
    assert measured_choice("sm90", mode, tokens).backend == want


def test_fp8_block_prefill_without_deepgemm_falls_back_to_triton_with_the_reason():
    plan = resolve_plan(CFG, quant="fp8_block", environment=_env(deep_gemm="x"), max_tokens_per_rank=4096)
    assert plan.experts_backend == "triton"
    assert any("not the measured deepgemm" in n for n in plan.notes), plan.notes


def test_batch_size_picks_the_row():
    assert measured_choice("sm90", "bf16", 64).max_tokens == 128
    assert measured_choice("sm90", "bf16", 129).max_tokens is None
    assert measured_choice("sm90", "bf16", None).max_tokens is None
    assert measured_choice("sm90", "nvfp4_w4a4", 64) is None and measured_choice("cpu", "bf16", 1) is None


def test_measured_backend_missing_falls_back_with_the_reason():
    plan = resolve_plan(CFG, quant="bf16", environment=_env(triton="x"), max_tokens_per_rank=4096)
    assert plan.experts_backend != "triton"
    assert any("not the measured triton" in n for n in plan.notes), plan.notes


def test_the_masked_layout_does_not_quote_the_flat_table():
    plan = resolve_plan(CFG, quant="fp8_block", dispatcher="deepep_ll", environment=_env(), max_tokens_per_rank=64)
    assert plan.experts_backend == "deepgemm" and plan.layout == "masked"
    assert not any("measured" in n for n in plan.notes), plan.notes
