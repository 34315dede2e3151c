"""epmoe.integrations.transformers on quantized checkpoints as they ship, on real gloo groups: tiny
random GPT-OSS (MXFP4 experts) and DeepSeek-V3 (FP8 128x128 blocks in every linear but lm_head)
checkpoints written in the released formats (tests/cpu/hf_models.write_quantized_model, config.json
`quantization_config` as the real ones carry it), loaded expert-parallel on 2 and 3 ranks (one rank
without prompts), against transformers' own model of the same checkpoint.

What transformers itself does with these checkpoints on a CPU machine (transformers 5.17; both need
`accelerate`, as its quantizers check):
  * GPT-OSS MXFP4: without the `kernels` package (and always on CPU without use_kernels) its
    Mxfp4HfQuantizer sets dequantize=True and dequantizes the experts to bfloat16 parameters, whatever
    the model dtype; its experts then compute in bfloat16. The MXFP4 values are exact in bfloat16, so
    the test's reference is that same model with its (dequantized) expert parameters cast to float32:
    the checkpoint's exact weights in float32 arithmetic, as epmoe's mxfp4_w4a16 reference experts
    compute. Tokens must be equal, logits within 1e-5; the bfloat16 experts' own error is reported.
  * DeepSeek-V3 FP8: without a GPU its FineGrainedFP8HfQuantizer sets dequantize=True and dequantizes
    every FP8 linear (attention, dense and shared MLPs, routed experts) to the model dtype (float32
    here): exact. epmoe with quant="bf16" (dequantize the experts at load, the same arithmetic) must give
    equal tokens and logits within 1e-5. With the plan the resolver picks on CPU (fp8_block: activations
    quantized to e4m3 per 1x128 block as the Hopper kernels do) the experts differ from transformers'
    dequantized model by that rounding: logits with both models on transformers' routing (replayed)
    stay within 2^-3 of the logit scale, and generated tokens equal those of the same plan on one
    process (the sharding changes nothing).
update_weights from a bf16-style trainer (transformers' unquantized model of the same weights, changed)
quantizes on the way in with the checkpoint's recipe; the reference applies that recipe to the trainer's
experts with epmoe.quant's codecs directly. A corrupt quantized tensor read by one rank only is one error
on every rank. Skipped without transformers or accelerate."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")
pytest.importorskip("accelerate")

from tests.cpu.hf_models import routing, write_quantized_model  # noqa: E402
from tests.cpu.mp import run_group  # noqa: E402

NUM_PROMPTS = (2, 0, 1)  # per rank: rank 1 has none
MAX_NEW = (12, 12, 5)  # rank 2 stops early
SHAPES = {"gpt_oss": dict(hidden=64, inter=32), "deepseek_v3": dict(hidden=256, inter=128)}
# (case name, family, load_model options)
CASES = (("gpt_oss", "gpt_oss", {}), ("deepseek_v3_dequantized", "deepseek_v3", {"quant": "bf16"}),
         ("deepseek_v3_fp8", "deepseek_v3", {}))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hfq"))
    return {f: write_quantized_model(f, os.path.join(d, f), **SHAPES[f]) for f in SHAPES}


def _prompts(rank: int):
    n = NUM_PROMPTS[rank % 3]
    if n == 0:
        return None, None
    g = torch.Generator().manual_seed(200 + rank)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    L = max(lengths)
    ids = torch.zeros(n, L, dtype=torch.long)
    mask = torch.zeros(n, L, dtype=torch.long)
    for i, l in enumerate(lengths):
        ids[i, L - l:] = torch.randint(4, 96, (l,), generator=g)
        mask[i, L - l:] = 1
    return ids, mask


def _transformers_model(path: str, family: str, exact: bool = True):
    """transformers' own model of the checkpoint (from_pretrained; it dequantizes on CPU). exact: GPT-OSS's
    bfloat16 dequantized experts cast to float32 (same values, float32 arithmetic; module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if family == "gpt_oss" and exact:
        with torch.no_grad():
            for layer in model.model.layers:
                for n in ("gate_up_proj", "down_proj"):
                    p = getattr(layer.mlp.experts, n)
                    assert p.dtype == torch.bfloat16  # what transformers 5.17 does on CPU
                    p.data = p.data.float()
    return model


GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def _generate_worker(rank, world_size, paths):
    from epmoe.integrations.transformers import describe, expert_memory, load_model

    out = {}
    for case, family, options in CASES:
        model = load_model(paths[family], dtype=torch.float32, **options)
        ids, mask = _prompts(rank)
        kw = dict(GEN, max_new_tokens=MAX_NEW[rank % 3])
        r = dict(describe=describe(model), mem=expert_memory(model),
                 plan=model.model.layers[-1].mlp.experts.ep_moe.plan.expert_mode)
        if ids is None:
            r["none"] = tuple(model.generate(None, **kw).shape)
        else:
            got = model.generate(ids, attention_mask=mask, **kw)
            r.update(ids=ids, mask=mask, sequences=got.sequences, logits=[t.clone() for t in got.logits])
            if case != "deepseek_v3_fp8":
                want = _transformers_model(paths[family], family).generate(ids, attention_mask=mask, **kw)
                r["same_tokens"] = bool(torch.equal(got.sequences, want.sequences))
                r["logits_diff"] = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
                r["logits_scale"] = max(float(b.abs().max()) for b in want.logits)
        out[case] = r
    return out


def _check(results, world_size, single):
    for rank, per_case in enumerate(results):
        for case, family, _ in CASES:
            r = per_case[case]
            assert r["mem"].local_bytes > 0
            assert f"on {world_size} rank(s)" in r["describe"], r["describe"]
            assert r["plan"] == {"gpt_oss": "mxfp4_w4a16", "deepseek_v3_dequantized": "bf16",
                                 "deepseek_v3_fp8": "fp8_block"}[case], (case, r["plan"])
            if NUM_PROMPTS[rank % 3] == 0:
                assert r["none"] == (0, 0)
                continue
            assert r["sequences"].shape[1] > r["ids"].shape[1]
            if case == "deepseek_v3_fp8":
                # the same plan on one process: the expert-parallel run changes nothing
                want = single(r["ids"], r["mask"], MAX_NEW[rank % 3])
                assert torch.equal(r["sequences"], want.sequences), (rank, r["sequences"], want.sequences)
                diff = max(float((a - b).abs().max()) for a, b in zip(r["logits"], want.logits))
                assert diff <= 1e-5, (rank, diff)
                continue
            assert r["same_tokens"], (case, rank)
            assert r["logits_diff"] <= 1e-5, (case, rank, r["logits_diff"])
            assert r["logits_scale"] > 0.1, (case, rank)


@pytest.fixture(scope="module")
def single_fp8(ckpts):
    """The fp8_block plan on one process (no group), generating a rank's prompts."""
    from epmoe.integrations.transformers import load_model

    model = load_model(ckpts["deepseek_v3"], dtype=torch.float32)

    def run(ids, mask, max_new):
        return model.generate(ids, attention_mask=mask, **dict(GEN, max_new_tokens=max_new))
    return run


@pytest.mark.parametrize("world_size", [2, 3])
def test_generate_matches_transformers(ckpts, single_fp8, world_size):
    """2 ranks hold 4 experts each, 3 ranks are refused for 8 experts (the EP size must divide them), so
    the 3-rank run uses 6-expert checkpoints."""
    paths = ckpts
    if world_size == 3:
        d = os.path.join(os.path.dirname(os.path.dirname(ckpts["gpt_oss"])), "e6")
        paths = {f: write_quantized_model(f, os.path.join(d, f), num_experts=6, **SHAPES[f]) for f in SHAPES}
        from epmoe.integrations.transformers import load_model

        model = load_model(paths["deepseek_v3"], dtype=torch.float32)
        single = lambda ids, mask, n: model.generate(ids, attention_mask=mask, **dict(GEN, max_new_tokens=n))  # noqa: E731
    else:
        single = single_fp8
    results = run_group(_generate_worker, world_size, paths, timeout=400, pg_timeout=120)
    _check(results, world_size, single)


def test_fp8_plan_against_transformers_dequantized(ckpts):
    """The fp8_block plan (e4m3 activations per 1x128 block) vs transformers' dequantized float32 model,
    both on transformers' routing: within 2^-3 of the logit scale (two activation roundings of <= 2^-4
    relative each per expert); the quant="bf16" run on the same routing agrees to 1e-5."""
    from epmoe.integrations.transformers import load_model

    path = ckpts["deepseek_v3"]
    ids = torch.randint(4, 96, (3, 10), generator=torch.Generator().manual_seed(5))
    log = {}
    with torch.no_grad():
        hf = _transformers_model(path, "deepseek_v3")
        with routing(hf, log, replay=False):
            truth = hf(ids).logits
        errs = {}
        for name, opts in (("fp8", {}), ("dequantized", {"quant": "bf16"})):
            ep = load_model(path, dtype=torch.float32, **opts)
            with routing(ep, {k: list(v) for k, v in log.items()}, replay=True):
                errs[name] = float((ep(ids).logits - truth).abs().max())
    scale = float(truth.abs().max())
    print(f"fp8_block plan vs transformers dequantized: {errs['fp8']:.4f} of {scale:.3f}")
    assert errs["dequantized"] <= 1e-5, errs
    assert 0 < errs["fp8"] <= 2 ** -3 * scale, (errs, scale)


def test_gpt_oss_transformers_bf16_experts_error(ckpts):
    """Reported, not a bound on epmoe: transformers' own CPU model of the MXFP4 checkpoint (bfloat16 experts)
    against the same weights in float32 arithmetic, which epmoe matches to 1e-5."""
    ids = torch.randint(4, 96, (3, 10), generator=torch.Generator().manual_seed(6))
    path = ckpts["gpt_oss"]
    with torch.no_grad():
        as_loaded = _transformers_model(path, "gpt_oss", exact=False)(ids).logits
        exact = _transformers_model(path, "gpt_oss")(ids).logits
    err = float((as_loaded - exact).abs().max())
    print(f"transformers bf16 experts vs exact: {err:.4f} of {float(exact.abs().max()):.3f}")
    assert 0 < err < 0.1 * float(exact.abs().max())


# ------------------------------------------------------------------------------- update_weights
def _fake_quantize_experts(trainer, family):
    """The checkpoint's recipe applied to the trainer's experts with epmoe.quant's codecs directly
    (quantize, dequantize): MXFP4 along K with E8M0 scales rounded up; FP8 per 128x128 block of each of
    gate / up / down (the checkpoint stores them separately)."""
    from epmoe.quant import fp8_block, mxfp4

    with torch.no_grad():
        for layer in trainer.model.layers:
            ex = getattr(layer.mlp, "experts", None)
            if ex is None:
                continue
            if family == "gpt_oss":  # in memory [E, in, out]
                for n in ("gate_up_proj", "down_proj"):
                    w = getattr(ex, n).data.transpose(1, 2).contiguous()
                    t = mxfp4.quantize(w, scale_rounding="ceil")
                    getattr(ex, n).data.copy_(mxfp4.dequantize(t.packed, t.scales, torch.float32).transpose(1, 2))
            else:  # [E, 2I, H] = [gate; up], [E, H, I]
                I = ex.gate_up_proj.shape[1] // 2
                for n, rows in (("gate_up_proj", slice(0, I)), ("gate_up_proj", slice(I, 2 * I)), ("down_proj", slice(None))):
                    w = getattr(ex, n).data[:, rows].contiguous()
                    q = fp8_block.quantize_weight(w, pad_edges=True)
                    getattr(ex, n).data[:, rows] = fp8_block.dequantize_weight(q.data, q.scales, torch.float32)


def _update_worker(rank, world_size, paths):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from epmoe.integrations.transformers import ep_layers, load_model, update_weights

    out = {}
    for case, family, options in CASES[:2]:
        ep = load_model(paths[family], dtype=torch.float32, **options)
        src = os.path.join(os.path.dirname(paths[family]), "unquantized", family)
        trainer = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)  # the unquantized weights
        torch.manual_seed(11)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        held = lambda: [(t.data_ptr(), t.dtype) for l in ep_layers(ep) for t in l.experts.parameters().values()]  # noqa: E731
        before = held()
        update_weights(ep, trainer.state_dict())
        after = held()
        reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        reference.load_state_dict(trainer.state_dict())
        _fake_quantize_experts(reference, family)
        ids = torch.randint(4, 96, (1 + rank, 7), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            diff = float((ep(ids).logits - reference(ids).logits).abs().max())
            unquantized = float((ep(ids).logits - trainer(ids).logits).abs().max())
        r = dict(diff=diff, unquantized=unquantized, in_place=before == after)
        if family == "deepseek_v3":  # per-expert checkpoint names, unquantized, go in too
            original = load_file(os.path.join(src, "model.safetensors"))
            update_weights(ep, {k: v for k, v in original.items() if ".experts." in k})
            reference.load_state_dict({k: v for k, v in AutoModelForCausalLM.from_pretrained(
                src, dtype=torch.float32).state_dict().items() if ".experts." in k}, strict=False)
            _fake_quantize_experts(reference, family)
            with torch.no_grad():
                r["diff_per_expert_names"] = float((ep(ids).logits - reference(ids).logits).abs().max())
        out[case] = r
    return out


def test_update_weights_quantizes_on_the_way_in(ckpts):
    for rank, per_case in enumerate(run_group(_update_worker, 2, ckpts, timeout=300, pg_timeout=120)):
        for case, r in per_case.items():
            assert r["in_place"], (case, rank)
            assert r["diff"] <= 1e-5, (case, rank, r)
            assert r["unquantized"] > 1e-3, (case, rank, r)  # the quantization is real
            assert r.get("diff_per_expert_names", 0.0) <= 1e-5, (case, rank, r)


# ------------------------------------------------------------------------------- errors
def _corrupt(src: str, dst: str, key_of, bad) -> str:
    """A copy of the checkpoint at src with one tensor replaced (`bad(t)`)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(os.path.join(src, "model.safetensors"))
    key = key_of(t)
    t[key] = bad(t[key])
    save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load_error_worker(rank, world_size, paths):
    from epmoe.integrations.transformers import load_model

    out = {}
    for name, path in paths.items():
        try:
            load_model(path, dtype=torch.float32)
            out[name] = "loaded"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_corrupt_quantized_tensor_is_one_error_on_every_rank(ckpts, tmp_path):
    """Expert 5 (rank 1's) of layer 1: a scale tensor of the wrong shape, a NaN block scale. Only rank 1
    reads it; every rank raises (rank 1 the error naming the tensor, rank 0 naming rank 1's error)."""
    fp8_key = "model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"
    paths = {
        "fp8_shape": _corrupt(ckpts["deepseek_v3"], str(tmp_path / "a"), lambda t: fp8_key, lambda x: x[:, :1].clone()),
        "fp8_nan": _corrupt(ckpts["deepseek_v3"], str(tmp_path / "b"), lambda t: fp8_key,
                            lambda x: torch.full_like(x, float("nan"))),
        "mxfp4_scales": _corrupt(ckpts["gpt_oss"], str(tmp_path / "c"),
                                 lambda t: "model.layers.1.mlp.experts.down_proj_scales",
                                 lambda x: x.to(torch.int16)),
    }
    results = run_group(_load_error_worker, 2, paths, timeout=300, pg_timeout=120)
    for name in paths:
        errs = [r[name] for r in results]
        assert all(e != "loaded" for e in errs), (name, errs)
    assert "weight_scale_inv" in results[1]["fp8_shape"] and "[1, 1]" in results[1]["fp8_shape"], results[1]
    assert results[0]["fp8_shape"].startswith("PeerInputError") and "rank 1" in results[0]["fp8_shape"]
    assert "finite" in results[1]["fp8_nan"].lower() or "nan" in results[1]["fp8_nan"].lower(), results[1]
    assert results[0]["fp8_nan"].startswith("PeerInputError"), results[0]
    for e in (r["mxfp4_scales"] for r in results):  # every rank reads its rows of the stacked tensor
        assert "down_proj_scales" in e and "int16" in e, e


def test_refusals_before_loading(ckpts, tmp_path, monkeypatch):
    from transformers import FineGrainedFP8Config, Mxfp4Config

    from epmoe.integrations.transformers import load_model

    # a quantized checkpoint of a family / method pair this integration does not load
    q = tmp_path / "qwen_fp8"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
        "moe_intermediate_size": 32, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                             "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    with pytest.raises(ValueError, match=r"quant_method='fp8'.*'qwen3_moe'.*deepseek_v3 fp8.*gpt_oss mxfp4"):
        load_model(str(q))
    with pytest.raises(ValueError, match="quantization_config= is not used for a GPT-OSS MXFP4"):
        load_model(ckpts["gpt_oss"], quantization_config=Mxfp4Config(dequantize=True))
    # transformers' own loading options for the FP8 part are taken (dequantize is what it does here anyway)
    model = load_model(ckpts["deepseek_v3"], quantization_config=FineGrainedFP8Config(dequantize=True))
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float32
    # transformers' FP8 quantizer needs accelerate: its check, surfaced with the fix
    import transformers.quantizers.quantizer_finegrained_fp8 as qfp8

    monkeypatch.setattr(qfp8, "is_accelerate_available", lambda: False)
    with pytest.raises(ImportError, match="cannot load this fp8 checkpoint.*accelerate"):
        load_model(ckpts["deepseek_v3"])


# ------------------------------------------------------------------------------- what each rank reads
def _reads_worker(rank, world_size, paths):
    """Loads each checkpoint logging (a) every checkpoint tensor transformers' loader materializes
    (`WeightTransform.add_tensor`, which receives each one read) and (b) every tensor epmoe's expert loader
    reads through safetensors (whole or row-sliced)."""
    import safetensors
    from transformers import core_model_loading

    from epmoe.integrations.transformers import load_model
    from tests.cpu.test_checkpoint_formats import _counting_safe_open

    out = {}
    for family, path in paths.items():
        hf_keys, ep_reads = [], []
        real_add = core_model_loading.WeightTransform.add_tensor

        def add_tensor(self, target_key, source_key, *a, **k):
            hf_keys.append(source_key)
            return real_add(self, target_key, source_key, *a, **k)

        core_model_loading.WeightTransform.add_tensor = add_tensor
        real_open = _counting_safe_open(ep_reads)
        try:
            model = load_model(path, dtype=torch.float32)
        finally:
            core_model_loading.WeightTransform.add_tensor = real_add
            safetensors.safe_open = real_open
        layer = model.model.layers[-1].mlp.experts.ep_moe
        out[family] = dict(hf=hf_keys, ep=ep_reads, lo=layer.first_local_expert,
                           hi=layer.first_local_expert + layer.num_local_experts)
    return out


def test_each_rank_reads_only_its_experts(ckpts):
    import re

    for rank, per_family in enumerate(run_group(_reads_worker, 2, ckpts, timeout=300, pg_timeout=120)):
        for family, r in per_family.items():
            assert r["hf"] and not [k for k in r["hf"] if ".mlp.experts." in k], (family, rank)
            expert_reads = [(k, rows) for k, rows in r["ep"] if ".mlp.experts." in k]
            assert expert_reads, (family, rank)
            for key, rows in expert_reads:
                m = re.search(r"experts\.(\d+)\.", key)
                if m:  # per-expert tensors (FP8): this rank's experts only
                    assert r["lo"] <= int(m[1]) < r["hi"], (family, rank, key)
                else:  # stacked MXFP4 tensors: this rank's rows only
                    assert rows == (r["lo"], r["hi"]), (family, rank, key, rows)
