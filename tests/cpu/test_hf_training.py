"""Training an expert-parallel transformers model (docs/training.md) on 2 real gloo ranks: after
`loss.backward()` and `sync_dense_gradients`, every dense gradient equals the unsharded transformers
model's (the sum of both ranks' losses) on every rank and each expert's gradient equals it on the rank
that owns the expert (Mixtral, Qwen3-MoE, DeepSeek-V3 routed experts with its shared experts and grouped
router, GPT-OSS biases); a tiny model trained for a few SGD steps on 2 ranks matches the same model
trained in one process, step for step. Skipped without transformers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from tests.cpu.hf_models import write_tiny_model  # noqa: E402
from tests.cpu.mp import run_group  # noqa: E402

GRAD_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")


def _batch(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows, length = (2, 7) if rank == 0 else (1, 5)
    return torch.randint(4, 96, (rows, length), generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _grads_worker(rank, world, paths):
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.transformers import ep_layers, expert_gradients, load_model, sync_dense_gradients

    out = {}
    for family, path in paths.items():
        model = load_model(path, dtype=torch.float32, training=True, timeout_s=60)
        ids = _batch(rank)
        loss = model(ids, labels=ids).loss
        loss.backward()
        sync_dense_gradients(model)
        got_experts = expert_gradients(model)
        got_dense = {n: p.grad for n, p in model.named_parameters() if ".ep_moe." not in n}

        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        total = sum(ref(_batch(r), labels=_batch(r)).loss for r in range(world))
        total.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        dense = {}
        for n, g in got_dense.items():
            assert g is not None, (family, n)
            dense[n] = _rel(g, ref_grads[n])
        experts = {}
        layers = ep_layers(model)
        for name, g in got_experts.items():
            site = name.rsplit(".", 1)[0]
            layer = next(l for l in layers if l.name == f"EPMoE[{site}]")
            lo, hi = layer.first_local_expert, layer.first_local_expert + layer.num_local_experts
            experts[name] = _rel(g, ref_grads[name][lo:hi])
        missing = [n for n in ref_grads if ".experts." in n and n not in got_experts]
        out[family] = dict(dense=dense, experts=experts, missing=missing, n_dense=len(got_dense),
                           n_ref_dense=sum(1 for n in ref_grads if ".experts." not in n))
    return out


def test_gradients_match_unsharded_transformers_2_ranks(tmp_path):
    paths = {f: write_tiny_model(f, str(tmp_path)) for f in GRAD_FAMILIES}
    for rank, res in enumerate(run_group(_grads_worker, 2, paths, timeout=400, pg_timeout=120)):
        for family, r in res.items():
            assert not r["missing"], (family, rank, r["missing"])
            assert r["n_dense"] == r["n_ref_dense"], (family, rank)
            bad = {n: e for n, e in {**r["dense"], **r["experts"]}.items() if e > 2e-5}
            assert not bad, (family, rank, bad)
            assert len(r["experts"]) >= 4, (family, rank, r["experts"])


def _train_worker(rank, world, path, steps):
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.transformers import _local_from_fused, _state, load_model, sync_dense_gradients

    model = load_model(path, dtype=torch.float32, training=True, timeout_s=60)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    st = _state(model)
    log = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        ids = _batch(rank, step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        sync_dense_gradients(model)
        opt.step()
        ref_losses = [ref(_batch(r, step), labels=_batch(r, step)).loss for r in range(world)]
        sum(ref_losses).backward()
        ref_opt.step()
        ref_params = dict(ref.named_parameters())
        dense = max(_rel(p, ref_params[n]) for n, p in model.named_parameters() if ".ep_moe." not in n)
        experts = 0.0
        for site, layer in zip(st.sites, st.layers):
            lo, hi = layer.first_local_expert, layer.first_local_expert + layer.num_local_experts
            fused = {k.rsplit(".", 1)[1]: v.detach() for k, v in ref_params.items() if k.startswith(site.name + ".")}
            want = _local_from_fused(site, fused, st.moe_config, lo, hi)
            experts = max(experts, _rel(layer.w13.detach(), torch.cat([want.w1, want.w3], dim=1)),
                          _rel(layer.w2.detach(), want.w2))
        log.append(dict(loss=float(loss), ref_loss=float(ref_losses[rank]), dense=dense, experts=experts))
    with torch.no_grad():  # rollouts after training: the inference path with the trained experts
        gen = model.generate(_batch(rank), max_new_tokens=3, do_sample=False, pad_token_id=0)
        ref_gen = ref.generate(_batch(rank), max_new_tokens=3, do_sample=False, pad_token_id=0)
    return log, bool(torch.equal(gen, ref_gen))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sgd_steps_match_one_process(tmp_path, family):
    path = write_tiny_model(family, str(tmp_path))
    for rank, (log, same_gen) in enumerate(run_group(_train_worker, 2, path, 4, timeout=400, pg_timeout=120)):
        for step, s in enumerate(log):
            assert abs(s["loss"] - s["ref_loss"]) <= 1e-5 * abs(s["ref_loss"]), (family, rank, step, s)
            assert s["dense"] < 1e-5 and s["experts"] < 1e-5, (family, rank, step, s)
        assert log[-1]["loss"] != log[0]["loss"], log  # the steps moved the weights
        assert same_gen, (family, rank)


def test_training_example_runs_on_cpu(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(root, "examples", "hf_train.py"), "--dir", str(tmp_path / "model"), "--steps", "3"]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: every step's loss equals one process training the unsharded model: True" in proc.stdout, \
            proc.stdout
        assert f"rank {rank}: rollout after training, same tokens as the unsharded model: True" in proc.stdout
