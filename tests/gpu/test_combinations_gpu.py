"""Every plan the resolver accepts on THIS GPU host (its arch, FlashInfer version, packages and
prebuilt modules), for the torch and FlashInfer dispatchers at ep = 1: built, run with real kernels
and compared with the float64 reference that models the plan (`reference_moe(plan=)`). Prints one
`VERIFIED` / `FAILED` line per combination, the data for docs/verified-runs.json.

    python -m pytest tests/gpu/test_combinations_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.experts import EXPERTS
from epmoe.quant.plan import EXPERT_MODES
from epmoe.resolve import detect_environment, resolve_plan
from tests.cpu.helpers import max_rel_err, random_weights

pytestmark = pytest.mark.gpu

# quantized activations: the kernels round the FC2 input from their own float32 sums, so a few
# elements may round the other way than the float64 oracle's
TOL = {"bf16": 2e-2}
TOL_QUANTIZED = 6e-2


def _accepted(cfg, env):
    out = []
    for mode in EXPERT_MODES:
        for dispatcher in ("torch", "flashinfer"):
            for experts in EXPERTS.names():
                for wire in ("bf16", "nvfp4", "fp8"):
                    try:
                        plan = resolve_plan(cfg, dispatcher=dispatcher, experts=experts, quant=mode,
                                            dispatch_dtype=wire, environment=env, ep_size=1)
                    except ValueError:
                        continue
                    if experts in ("reference", "masked_reference") and mode != "bf16":
                        continue  # the emulation is checked on CPU; keep the GPU run short
                    out.append(plan)
    return out


def test_every_accepted_plan_on_this_host_runs_against_the_reference():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=512, intermediate_size=256, dtype=torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    env = detect_environment(dev)
    plans = _accepted(cfg, env)
    assert plans, "the resolver accepts nothing on this host"
    w = random_weights(cfg, 7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, cfg.hidden_size, generator=g).to(torch.bfloat16)
    logits = torch.randn(64, cfg.num_experts, generator=g)
    failures = []
    for plan in plans:
        key = f"{env.arch} {plan.expert_mode} {plan.dispatcher} {plan.experts_backend} {plan.dispatch_dtype}"
        try:
            # flashinfer at ep = 1: through FlashInfer's all-to-all kernels (the layer's default keeps
            # the tokens in place on one rank)
            opts = {"one_rank_local": False} if plan.dispatcher == "flashinfer" else None
            layer = EPMoE(cfg, dispatcher=plan.dispatcher, device=dev, plan=plan, max_num_tokens_per_rank=64,
                          dispatcher_options=opts)
            layer.load_weights(w)
            y = layer(x.to(dev), logits.to(dev)).cpu()
            err = max_rel_err(y, reference_moe(cfg, x, w, logits, plan=plan))
            layer.close()
        except Exception as e:  # noqa: BLE001 - report every combination, fail at the end
            print(f"FAILED {key}: {type(e).__name__}: {str(e)[:200]}")
            failures.append(key)
            continue
        tol = TOL.get(plan.act_format, TOL_QUANTIZED)
        print(f"{'VERIFIED' if err <= tol else 'FAILED'} {key}: max rel err {err:.3g} (tol {tol:g}), "
              f"flashinfer {env.flashinfer_version}")
        if not err <= tol:
            failures.append(key)
    assert not failures, failures
