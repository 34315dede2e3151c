"""epmoe.integrations.transformers on real gloo groups: tiny random models of every supported family,
written with save_pretrained, loaded expert-parallel; greedy generate against the unsharded
transformers model (token ids equal, logits to 1e-5), lockstep with different prompts per rank (some
none, different lengths and step counts), measured expert memory per rank, update_weights, and the
errors raised before anything is loaded. Skipped without transformers."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from tests.cpu.hf_models import FAMILIES, MORE_FAMILIES, write_all, write_tiny_model  # noqa: E402
from tests.cpu.mp import run_group  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_PROMPTS = (2, 0, 1, 3)  # per rank (rank % 4): rank 1 has none
MAX_NEW = (16, 16, 7, 16)  # rank 2 stops early: the others run steps it must serve


def _prompts(rank: int):
    n = NUM_PROMPTS[rank % 4]
    if n == 0:
        return None, None
    g = torch.Generator().manual_seed(100 + rank)
    lengths = torch.randint(3, 10, (n,), generator=g).tolist()
    L = max(lengths)
    ids = torch.zeros(n, L, dtype=torch.long)  # left padding with pad_token_id 0
    mask = torch.zeros(n, L, dtype=torch.long)
    for i, l in enumerate(lengths):
        ids[i, L - l:] = torch.randint(4, 96, (l,), generator=g)
        mask[i, L - l:] = 1
    return ids, mask


def _generate_worker(rank, world_size, paths):
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.transformers import expert_memory, load_model

    torch.manual_seed(0)
    out = {}
    for family, path in paths.items():
        model = load_model(path, dtype=torch.float32)
        mem = expert_memory(model)
        ids, mask = _prompts(rank)
        kw = dict(max_new_tokens=MAX_NEW[rank % 4], do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
        if ids is None:
            got = model.generate(None, **kw)
            out[family] = dict(none=tuple(got.shape), mem=mem)
            continue
        got = model.generate(ids, attention_mask=mask, **kw)
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        want = ref_model.generate(ids, attention_mask=mask, **kw)
        assert len(got.logits) == len(want.logits)
        diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
        scale = max(float(b.abs().max()) for b in want.logits)
        out[family] = dict(
            same_tokens=bool(torch.equal(got.sequences, want.sequences)), new=got.sequences.shape[1] - ids.shape[1],
            logits_diff=diff, logits_scale=scale, mem=mem,
        )
    return out


def _check_generate(results, world_size, families=FAMILIES):
    for rank, per_family in enumerate(results):
        assert sorted(per_family) == sorted(families)
        for family in families:
            r = per_family[family]
            mem = r["mem"]
            assert mem.local_bytes * world_size == mem.model_bytes, (family, rank, mem)
            if NUM_PROMPTS[rank % 4] == 0:
                assert r["none"] == (0, 0)
                continue
            assert r["same_tokens"], (family, rank, r)
            assert r["logits_diff"] <= 1e-5, (family, rank, r)
            assert r["logits_scale"] > 0.1, (family, rank, r)  # the check is not vacuous
            assert r["new"] >= 1


def test_generate_matches_unsharded_transformers_2_ranks(two_ranks):
    """The five families plus MORE_FAMILIES."""
    _check_generate([r["generate"] for r in two_ranks], 2, FAMILIES + MORE_FAMILIES)


def test_generate_matches_unsharded_transformers_4_ranks(tmp_path):
    paths = write_all(str(tmp_path))
    _check_generate(run_group(_generate_worker, 4, paths, timeout=420, pg_timeout=120), 4)


# ------------------------------------------------------------------------------- memory, updates, errors
def _peak_cpu_bytes(fn, mapped_file_bytes):
    """Peak of live CPU tensor bytes allocated while fn runs, from torch profiler's memory events.

    safetensors exposes each opened checkpoint file as one storage over its read-only mapping (the
    profiler sees an "allocation" of the file's size; only the pages of tensors read are touched):
    those events, exactly the file's size, are not allocations and are left out."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # frees of earlier tensors during fn would count against it
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        if e.name == "[memory]" and abs(e.self_cpu_memory_usage) == mapped_file_bytes:
            continue
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak


def _memory_and_update_worker(rank, world_size, mem_path, upd_path):
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.transformers import expert_memory, load_model, update_weights

    # peak memory while loading: everything but the experts is the same on every rank
    file_bytes = os.path.getsize(os.path.join(mem_path, "model.safetensors"))
    model, peak = _peak_cpu_bytes(lambda: load_model(mem_path, dtype=torch.float32), file_bytes)
    mem = expert_memory(model)
    del model

    # update_weights: a "trainer" (the unsharded transformers model) changes its weights; the EP model
    # takes its state_dict (transformers 5 names) and must then match it
    ep = load_model(upd_path, dtype=torch.float32)
    trainer = AutoModelForCausalLM.from_pretrained(upd_path, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    storage = [t.data_ptr() for layer in ep.model.layers for t in layer.mlp.experts.ep_moe.experts.parameters().values()]
    update_weights(ep, trainer.state_dict())
    storage_after = [t.data_ptr() for layer in ep.model.layers for t in layer.mlp.experts.ep_moe.experts.parameters().values()]
    ids = torch.randint(4, 96, (1 + rank, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        diff = float((ep(ids).logits - trainer(ids).logits).abs().max())
    # per-expert checkpoint names (the original weights, as save_pretrained wrote them) go back in too
    from safetensors.torch import load_file

    original = load_file(os.path.join(upd_path, "model.safetensors"))
    update_weights(ep, {k: v for k, v in original.items() if ".experts." in k})
    reference = AutoModelForCausalLM.from_pretrained(upd_path, dtype=torch.float32)
    with torch.no_grad():
        reference.load_state_dict(  # the trainer's non-expert weights, the checkpoint's experts
            {k: v for k, v in trainer.state_dict().items() if ".experts." not in k}, strict=False)
        diff_per_expert_names = float((ep(ids).logits - reference(ids).logits).abs().max())
    # a bad name fails on every rank before anything changes
    sd = dict(trainer.state_dict())
    if rank == 0:
        sd["model.layers.0.not_a_weight"] = torch.zeros(1)
    try:
        update_weights(ep, sd)
        bad = "no error"
    except Exception as e:  # noqa: BLE001
        bad = f"{type(e).__name__}: {e}"
    # a rank whose generate fails before its first step still serves the others, then raises
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    try:
        gen = ep.generate(ids, synced_gpus=True, **kw) if rank == 0 else ep.generate(ids, **kw)
        gen = tuple(gen.shape)
    except ValueError as e:
        gen = f"ValueError: {e}"
    return dict(peak=peak, mem=mem, diff=diff, diff_per_expert_names=diff_per_expert_names, gen=gen, in_place=storage == storage_after, bad=bad)


def test_memory_per_rank_and_update_weights(two_ranks):
    results = [r["memory"] for r in two_ranks]
    for rank, r in enumerate(results):
        mem = r["mem"]
        per_layer_local = mem.local_bytes // mem.num_layers
        assert mem.local_bytes * 2 == mem.model_bytes
        # measured: everything the load allocated (non-expert weights too, all counted against the
        # experts) never exceeded this rank's experts plus one layer's transient copy of them, and
        # stayed well under the model's experts (what an unsharded load holds)
        assert mem.local_bytes <= r["peak"] <= mem.local_bytes + per_layer_local, (rank, r)
        assert r["peak"] < 0.7 * mem.model_bytes, (rank, r)
        assert r["diff"] < 1e-5, r
        assert r["diff_per_expert_names"] < 1e-5, r
        assert r["in_place"]
        assert ("ValueError" if rank == 0 else "PeerInputError") in r["bad"], r["bad"]
        assert "not_a_weight" in results[0]["bad"]
        if rank == 0:
            assert "synced_gpus" in r["gen"], r["gen"]
        else:
            assert r["gen"] == (1 + rank, 6 + 4), r["gen"]


def _error_worker(rank, world_size, paths):
    from epmoe.integrations.transformers import load_model

    out = {}
    for name, path in paths.items():
        try:
            load_model(path)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _write_error_cases(tmp_path) -> dict:
    import transformers as tf

    torch.manual_seed(0)
    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    dense.save_pretrained(str(tmp_path / "llama"))
    granite = tf.AutoModelForCausalLM.from_config(tf.GraniteMoeConfig(  # MoE, other experts layout
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_local_experts=4, num_experts_per_tok=2))
    granite.save_pretrained(str(tmp_path / "granitemoe"))
    odd = write_tiny_model("mixtral", str(tmp_path / "odd"), num_experts=3)
    quantized = write_tiny_model("qwen3_moe", str(tmp_path / "fp8"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(os.path.join(quantized, "config.json"), "w") as f:
        json.dump(config, f)
    # the weights are unreadable: an error raised after reading would say so instead
    for path in (tmp_path / "llama", tmp_path / "granitemoe", odd, quantized):
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"not safetensors")
    return {"dense": str(tmp_path / "llama"), "family": str(tmp_path / "granitemoe"), "ep": odd, "quantized": quantized,
            "missing": str(tmp_path / "nothing")}


def test_errors_before_anything_is_loaded(two_ranks):
    for r in two_ranks:
        results = r["errors"]
        assert "not a Mixture-of-Experts model" in results["dense"], results["dense"]
        assert "model_type='granitemoe' is not supported" in results["family"], results["family"]
        assert "does not divide the model's 3 experts" in results["ep"], results["ep"]
        assert "not a checkpoint directory" in results["missing"], results["missing"]
        assert "quant_method='fp8'" in results["quantized"], results["quantized"]


# ------------------------------------------------------------------------------- EPLB
def _eplb_worker(rank, world_size, path, odd_path):
    """load_model(eplb=...): generate rebalances between steps (every 2 calls of each layer, serve steps
    included) and still matches the unsharded model; update_weights afterwards updates every replica;
    3 experts on 2 ranks load with one redundant slot."""
    from transformers import AutoModelForCausalLM

    from epmoe import EPLBConfig
    from epmoe.integrations.transformers import ep_layers, load_model, update_weights

    model = load_model(path, dtype=torch.float32,
                       eplb=EPLBConfig(num_redundant_experts=2, rebalance_every=2, min_improvement=0.0))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask = _prompts(rank)
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    out = {}
    if ids is None:
        model.generate(None, **kw)
    else:
        got, want = model.generate(ids, attention_mask=mask, **kw), ref.generate(ids, attention_mask=mask, **kw)
        out["same_tokens"] = bool(torch.equal(got.sequences, want.sequences))
        out["logits_diff"] = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
    layers = ep_layers(model)
    out["moved"] = sum(1 for layer in layers if layer.last_rebalance is not None and not layer.last_rebalance.skipped
                       and not layer.placement.is_contiguous)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    update_weights(model, ref.state_dict())
    x = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out["update_diff"] = float((model(x).logits - ref(x).logits).abs().max())
        odd = load_model(odd_path, dtype=torch.float32, eplb=EPLBConfig(num_redundant_experts=1))
        out["odd_diff"] = float((odd(x).logits - AutoModelForCausalLM.from_pretrained(odd_path, dtype=torch.float32)(x)
                                 .logits).abs().max())
    return out


def test_eplb_generate_update_and_redundant_slots(two_ranks):
    for rank, r in enumerate(r["eplb"] for r in two_ranks):
        if NUM_PROMPTS[rank] > 0:
            assert r["same_tokens"] and r["logits_diff"] <= 1e-5, (rank, r)
        assert r["moved"] >= 1, r  # at least one layer runs on a rebalanced placement
        assert r["update_diff"] < 1e-5 and r["odd_diff"] < 1e-5, r


# ------------------------------------------------------------------------------- one 2-rank job
def _two_rank_worker(rank, world_size, paths, mem_path, upd_path, error_paths, odd_path):
    memory = _memory_and_update_worker(rank, world_size, mem_path, upd_path)  # first: nothing else freed meanwhile
    return dict(memory=memory, generate=_generate_worker(rank, world_size, paths),
                errors=_error_worker(rank, world_size, error_paths),
                eplb=_eplb_worker(rank, world_size, paths["mixtral"], odd_path))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank check in one spawned job (the workers import transformers once)."""
    tmp = tmp_path_factory.mktemp("hf2")
    paths = write_all(str(tmp / "families"), FAMILIES + MORE_FAMILIES)
    mem_path = write_tiny_model("mixtral", str(tmp / "mem"), num_experts=8, layers=4, hidden=64, inter=256)
    upd_path = write_tiny_model("qwen3_moe", str(tmp / "upd"))
    odd_path = write_tiny_model("mixtral", str(tmp / "odd_eplb"), num_experts=3)
    return run_group(_two_rank_worker, 2, paths, mem_path, upd_path, _write_error_cases(tmp), odd_path, timeout=420,
                     pg_timeout=120)


def test_example_runs_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "hf_generate.py"), "--dir", str(tmp_path / "model")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0: 2 prompts" in proc.stdout and "rank 1: no prompts" in proc.stdout, proc.stdout
    assert "same tokens as the unsharded model: True" in proc.stdout, proc.stdout


def test_epmoe_import_does_not_import_transformers():
    code = "import sys, epmoe, epmoe.integrations; assert 'transformers' not in sys.modules, 'imported'"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
