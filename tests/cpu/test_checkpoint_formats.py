"""Quantized checkpoints as they ship (FP8 block, ModelOpt / compressed-tensors NVFP4, GPT-OSS MXFP4)
and model configs as they ship: synthetic checkpoints written in each real layout are read back
through the real loader; every rank holds exactly its experts' stored bytes and reads nothing else;
layer outputs match a float64 reference of the dequantized checkpoint; bad inputs are named."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from epmoe import EPMoE, MoEConfig, load_expert_weights, reference_moe
from epmoe.config import hf_routing
from epmoe.launch.synthetic import StreamingSafetensorsWriter, reference_layers, write_checkpoint
from epmoe.quant.checkpoint_formats import CHECKPOINT_FORMATS, shared_gate_up_global_scale
from epmoe.resolve import resolve_quant_plan
from epmoe.quant.weights import dequantize_expert_weights
from tests.cpu.helpers import max_rel_err
from tests.cpu.mp import run_group

E, H, I = 8, 256, 128
QWEN = {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2, "hidden_size": H,
        "moe_intermediate_size": I, "norm_topk_prob": True}
GPT_OSS = {"model_type": "gpt_oss", "num_local_experts": E, "experts_per_token": 2, "hidden_size": H,
           "intermediate_size": I, "swiglu_limit": 7.0}
QUANTIZED = [f for f in CHECKPOINT_FORMATS if f != "bf16"]


def _hf(fmt):
    return GPT_OSS if fmt == "mxfp4-gpt-oss" else QWEN


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One synthetic 2-layer checkpoint per format, written by the launcher's streaming writer."""
    out = {}
    for fmt in CHECKPOINT_FORMATS:
        d = str(tmp_path_factory.mktemp(fmt))
        write_checkpoint(d, MoEConfig.from_hf_config(_hf(fmt), dtype=torch.float32), _hf(fmt), 2, 3, fmt)
        out[fmt] = d
    return out


def _cfg(directory):
    return MoEConfig.from_hf_config(directory, dtype=torch.float32)


# ----------------------------------------------------------------------------- config.json detection
ROUTER_CASES = {
    "mixtral": ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
                 "intermediate_size": 32}, "softmax", "swiglu"),
    "qwen2_moe": ({"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4, "hidden_size": 64,
                   "moe_intermediate_size": 32, "norm_topk_prob": False}, "softmax", "swiglu"),
    "qwen3_moe": ({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 64,
                   "moe_intermediate_size": 32, "norm_topk_prob": True}, "softmax", "swiglu"),
    "deepseek_v3": ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                     "hidden_size": 64, "moe_intermediate_size": 32, "n_group": 8, "topk_group": 4,
                     "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
                     "topk_method": "noaux_tc"}, "sigmoid_grouped", "swiglu"),
    # as transformers writes it: no scoring_func, no topk_method
    "deepseek_v3_transformers": ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                                  "hidden_size": 64, "moe_intermediate_size": 32, "n_group": 8, "topk_group": 4,
                                  "routed_scaling_factor": 2.5, "norm_topk_prob": True}, "sigmoid_grouped", "swiglu"),
    "kimi_k2": ({"model_type": "kimi_k2", "n_routed_experts": 384, "num_experts_per_tok": 8, "hidden_size": 64,
                 "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
                 "norm_topk_prob": True}, "sigmoid_grouped", "swiglu"),
    "glm4_moe": ({"model_type": "glm4_moe", "n_routed_experts": 160, "num_experts_per_tok": 8, "hidden_size": 64,
                  "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
                  "norm_topk_prob": True, "hidden_act": "silu"}, "sigmoid_grouped", "swiglu"),
    "gpt_oss": ({**GPT_OSS, "quantization_config": {"quant_method": "mxfp4"}}, "softmax", "swiglu"),
    "nemotron_h": ({"model_type": "nemotron_h", "n_routed_experts": 128, "num_experts_per_tok": 6,
                    "hidden_size": 64, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "mlp_hidden_act": "relu2"},
                   "sigmoid_grouped", "relu2"),
    "unknown": ({"model_type": "my_new_moe", "num_experts": 16, "num_experts_per_tok": 2, "hidden_size": 64,
                 "moe_intermediate_size": 32}, "softmax", "swiglu"),
}


@pytest.mark.parametrize("name", sorted(ROUTER_CASES))
def test_router_from_config_json(name):
    hf, routing, activation = ROUTER_CASES[name]
    cfg = MoEConfig.from_hf_config(hf)
    assert (cfg.routing, cfg.activation) == (routing, activation)
    why = hf_routing(hf).reason
    if routing == "sigmoid_grouped":
        assert cfg.n_group == hf["n_group"] and cfg.routed_scaling_factor == hf["routed_scaling_factor"]
    if name == "unknown":
        assert "not a known MoE family" in why and "scoring_func" in why
    if name == "gpt_oss":
        assert cfg.quant_method == "mxfp4" and cfg.has_bias and cfg.swiglu_limit == 7.0


def test_grouped_softmax_router_is_refused():
    v2 = {"model_type": "deepseek_v2", "n_routed_experts": 160, "num_experts_per_tok": 6, "hidden_size": 64,
          "moe_intermediate_size": 32, "n_group": 8, "topk_group": 3, "topk_method": "group_limited_greedy"}
    with pytest.raises(ValueError, match="group_limited_greedy.*not supported"):
        MoEConfig.from_hf_config(v2)
    assert MoEConfig.from_hf_config({**v2, "topk_method": "greedy"}).routing == "softmax"


def test_unknown_model_with_correction_bias_is_refused():
    hf = ROUTER_CASES["unknown"][0]
    cfg = MoEConfig.from_hf_config({**hf, "moe_intermediate_size": 8, "hidden_size": 16}, dtype=torch.float32)
    t = {f"m.experts.{e}.{p}.weight": torch.zeros(8 if p != "down_proj" else 16, 16 if p != "down_proj" else 8)
         for e in range(16) for p in ("gate_proj", "up_proj", "down_proj")}
    t["m.gate.e_score_correction_bias"] = torch.zeros(16)
    with pytest.raises(ValueError, match=r"m.gate.e_score_correction_bias.*'softmax'.*my_new_moe.*scoring_func"):
        load_expert_weights(t, cfg)


def test_quantization_config_detection(tmp_path):
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert MoEConfig.from_hf_config({**QWEN, "quantization_config": fp8}).quant_method == "fp8"
    with pytest.raises(ValueError, match=r"weight_block_size=\[64, 64\] is not supported.*128x128"):
        MoEConfig.from_hf_config({**QWEN, "quantization_config": {**fp8, "weight_block_size": [64, 64]}})
    with pytest.raises(ValueError, match="activation_scheme='static' is not supported"):
        MoEConfig.from_hf_config({**QWEN, "quantization_config": {**fp8, "activation_scheme": "static"}})
    per_tensor = MoEConfig.from_hf_config({**QWEN, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="fp8_per_tensor.*not supported: per-tensor / per-channel FP8"):
        resolve_quant_plan(per_tensor)
    mo = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    assert MoEConfig.from_hf_config({**QWEN, "quantization_config": mo}).quant_method == "modelopt_fp4"
    mo8 = MoEConfig.from_hf_config({**QWEN, "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}})
    with pytest.raises(ValueError, match="modelopt_fp8.*not supported"):
        resolve_quant_plan(mo8)
    # ModelOpt's hf_quant_config.json beside a config.json without quantization_config
    (tmp_path / "config.json").write_text(json.dumps(QWEN))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    assert MoEConfig.from_hf_config(tmp_path).quant_method == "modelopt_fp4"
    ct = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "float", "group_size": 16}, "format": "nvfp4-pack-quantized"}}}
    cfg = MoEConfig.from_hf_config({**QWEN, "quantization_config": ct})
    assert cfg.quant_method == "compressed_tensors_nvfp4"
    assert resolve_quant_plan(cfg, arch="sm90").expert_mode == "nvfp4_w4a16"


# ----------------------------------------------------------------------------- bytes and reads per rank
def _expected(fmt, f, prefix, lo, hi, w):
    """The checkpoint's own tensors for experts [lo, hi), as the rank must hold them (an independent
    statement of the mapping in docs/quant-plan.md)."""
    if fmt == "mxfp4-gpt-oss":
        gu = f.get_slice(prefix + "experts.gate_up_proj_blocks")[lo:hi]
        gs = f.get_slice(prefix + "experts.gate_up_proj_scales")[lo:hi]
        n = hi - lo
        return {"w1": gu[:, 0::2].reshape(n, I, H // 2), "w3": gu[:, 1::2].reshape(n, I, H // 2),
                "w1_scale": gs[:, 0::2], "w3_scale": gs[:, 1::2],
                "w2": f.get_slice(prefix + "experts.down_proj_blocks")[lo:hi].reshape(n, H, I // 2),
                "w2_scale": f.get_slice(prefix + "experts.down_proj_scales")[lo:hi]}
    out = {}
    for role, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        get = lambda sfx: torch.stack([f.get_tensor(f"{prefix}experts.{e}.{proj}.{sfx}") for e in range(lo, hi)])  # noqa: E731
        if fmt == "bf16":
            out[role] = get("weight")
        elif fmt == "fp8":
            out[role], out[role + "_scale"] = get("weight"), get("weight_scale_inv")
        elif fmt == "nvfp4-modelopt":
            out[role], out[role + "_scale"] = get("weight"), get("weight_scale")
            out[role + "_global_scale"] = get("weight_scale_2")
        else:
            out[role], out[role + "_scale"] = get("weight_packed"), get("weight_scale")
            out[role + "_global_scale"] = 1.0 / get("weight_global_scale").reshape(-1)
    if fmt == "nvfp4-modelopt":
        s = lambda proj: torch.stack([f.get_tensor(f"{prefix}experts.{e}.{proj}.input_scale") for e in range(lo, hi)])  # noqa: E731
        out["w13_input_scale"] = torch.maximum(s("gate_proj"), s("up_proj"))
        out["w2_input_scale"] = s("down_proj")
    return out


def _counting_safe_open(log):
    """Wrap safetensors.safe_open so every tensor read (whole or sliced) is logged with its rows."""
    import safetensors

    real = safetensors.safe_open

    class Slice:
        def __init__(self, s, key):
            self._s, self._key = s, key

        def get_shape(self):
            return self._s.get_shape()

        def __getitem__(self, idx):
            rows = idx if isinstance(idx, slice) else idx[0]
            log.append((self._key, (rows.start, rows.stop)))
            return self._s[idx]

    class Handle:
        def __init__(self, *a, **k):
            self._h = real(*a, **k)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, key):
            log.append((key, None))
            return self._h.get_tensor(key)

        def get_slice(self, key):
            return Slice(self._h.get_slice(key), key)

    safetensors.safe_open = Handle
    return real


def _load_on_rank(rank, world, directory, fmt):
    import safetensors
    from safetensors import safe_open

    log = []
    real = _counting_safe_open(log)
    cfg = _cfg(directory)
    n = cfg.num_experts // world
    lo, hi = rank * n, (rank + 1) * n
    try:
        loaded = load_expert_weights(directory, cfg, experts=(lo, hi), layer_idx=1)
    finally:
        safetensors.safe_open = real
    with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
        want = _expected(fmt, f, "model.layers.1.mlp.", lo, hi, loaded.experts)
    held = loaded.experts.tensors()
    mismatched = [k for k, t in want.items()
                  if not (held[k].dtype == t.dtype and held[k].shape == t.shape
                          and torch.equal(held[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)))]
    return {"lo": lo, "hi": hi, "log": log, "mismatched": mismatched, "format": loaded.experts.format,
            "checkpoint_format": loaded.checkpoint_format, "names": sorted(held)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_each_rank_holds_the_checkpoint_bytes_of_its_experts_only(checkpoints, fmt, world):
    results = run_group(_load_on_rank, world, checkpoints[fmt], fmt)
    for r in results:
        assert r["checkpoint_format"] == fmt and not r["mismatched"], r
        assert r["log"], "nothing was read"
        for key, rows in r["log"]:
            m = re.search(r"experts\.(\d+)\.", key)
            if m:  # per-expert tensors: only this rank's experts
                assert r["lo"] <= int(m[1]) < r["hi"], (key, r["lo"], r["hi"])
            elif "experts." in key:  # stacked tensors: only this rank's rows
                assert rows == (r["lo"], r["hi"]), (key, rows)
            assert "layers.0." not in key, key  # nor another layer's
    if fmt != "bf16":
        assert "w1_scale" in results[0]["names"]
    if fmt == "nvfp4-modelopt":
        assert {"w13_input_scale", "w2_input_scale", "w1_global_scale"} <= set(results[0]["names"])


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_a_placements_slots_read_their_experts_only(checkpoints, fmt):
    """Loading under an EPLB placement: the experts of a rank's slots in slot order (a replica, i.e. a
    repeated id, read once), the checkpoint's bytes as stored, nothing else read."""
    import safetensors
    from safetensors import safe_open

    ids = [6, 1, 2, 6, 3]  # any order; runs [1, 4) and [6, 7) as slices
    log = []
    real = _counting_safe_open(log)
    try:
        loaded = load_expert_weights(checkpoints[fmt], _cfg(checkpoints[fmt]), expert_ids=ids, layer_idx=1)
    finally:
        safetensors.safe_open = real
    assert loaded.expert_ids == tuple(ids) and loaded.experts.num_experts == len(ids)
    held = loaded.experts.tensors()
    with safe_open(os.path.join(checkpoints[fmt], "model.safetensors"), framework="pt") as f:
        for i, e in enumerate(ids):
            want = _expected(fmt, f, "model.layers.1.mlp.", e, e + 1, loaded.experts)
            for k, t in want.items():
                assert torch.equal(held[k][i:i + 1].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                    (fmt, e, k)
    per_key = {}
    for key, rows in log:
        m = re.search(r"experts\.(\d+)\.", key)
        if m:
            assert int(m[1]) in ids, key
            per_key[key] = per_key.get(key, 0) + 1
        elif "experts." in key:
            assert rows in ((1, 4), (6, 7)), (key, rows)
    assert all(n == 1 for n in per_key.values()), per_key  # each expert's tensors once, the replica too


# ----------------------------------------------------------------------------- layer vs float64 reference
# The layer against float64 math on the dequantized checkpoint with UNquantized activations: modes
# that quantize activations add that error (measured: fp8_block ~0.04, nvfp4_w4a4 ~0.14); W4A16 and
# bf16 runs have exact weights, so only float32 arithmetic remains.
MODE_TOL = {"bf16": 1e-5, "nvfp4_w4a16": 1e-5, "mxfp4_w4a16": 1e-5, "fp8_block": 0.1, "nvfp4_w4a4": 0.3}


def _layer_on_rank(rank, world, directory, mode):
    cfg = _cfg(directory)
    layer = EPMoE(cfg, quant=mode)
    layer.load_weights(directory, layer_idx=0)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(12, cfg.hidden_size, generator=g)
    gate = reference_layers(directory, cfg, 1)[0]
    logits = x @ gate.gate.float().t()
    y = layer(x, logits)
    ref = reference_moe(cfg, x, gate.experts, logits, e_score_correction_bias=gate.e_score_correction_bias)
    # and with the plan modelled (activation / wire quantization on the checkpoint's exact weights)
    ref_plan = reference_moe(cfg, x, gate.experts, logits, e_score_correction_bias=gate.e_score_correction_bias,
                             plan=layer.plan)
    return {"err": max_rel_err(y, ref), "err_plan": max_rel_err(y, ref_plan), "mode": layer.plan.expert_mode}


LAYER_CASES = [("bf16", None), ("fp8", None), ("fp8", "bf16"), ("nvfp4-modelopt", None),
               ("nvfp4-modelopt", "nvfp4_w4a16"), ("nvfp4-compressed", "nvfp4_w4a16"), ("mxfp4-gpt-oss", None)]


@pytest.mark.parametrize("fmt, mode", LAYER_CASES, ids=[f"{f}-{m or 'auto'}" for f, m in LAYER_CASES])
def test_layer_matches_dequantized_checkpoint_reference(checkpoints, fmt, mode):
    results = run_group(_layer_on_rank, 2, checkpoints[fmt], mode)
    for r in results:
        assert r["err"] <= MODE_TOL[r["mode"]] and r["err_plan"] < 1e-4, r


# ----------------------------------------------------------------------------- wrong inputs
def _tensors(directory):
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def test_missing_or_misshaped_scales_are_named(checkpoints):
    t = _tensors(checkpoints["fp8"])
    cfg = _cfg(checkpoints["fp8"])
    p = "model.layers.0.mlp.experts."
    bad = dict(t)
    del bad[p + "5.up_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"fp8 checkpoint lacks model.layers.0.mlp.experts.5.up_proj.weight_scale_inv"):
        load_expert_weights(bad, cfg, layer_idx=0)
    bad = {k: v for k, v in t.items() if not k.endswith("weight_scale_inv")}
    with pytest.raises(ValueError, match=r"declares quant_method='fp8'.*unquantized.*weight_scale_inv"):
        load_expert_weights(bad, cfg, layer_idx=0)
    bad = dict(t)  # 64x64 blocks instead of 128x128
    bad[p + "2.gate_proj.weight_scale_inv"] = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"experts.2.gate_proj.weight_scale_inv' is \[2, 4\] float32; expected \[1, 2\] "
                                         r"float32 / bfloat16.*weight_block_size must be \[128, 128\]"):
        load_expert_weights(bad, cfg, layer_idx=0)
    nv = _tensors(checkpoints["nvfp4-modelopt"])
    nv[p + "1.down_proj.weight_scale"] = nv[p + "1.down_proj.weight_scale"][:, :4].contiguous()
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight_scale' is \[256, 4\] float8_e4m3fn; expected \[256, 8\]"):
        load_expert_weights(nv, _cfg(checkpoints["nvfp4-modelopt"]), layer_idx=0)
    mx = _tensors(checkpoints["mxfp4-gpt-oss"])
    mx["model.layers.0.mlp.experts.down_proj_scales"] = mx["model.layers.0.mlp.experts.down_proj_scales"][:, :, :2]
    with pytest.raises(ValueError, match=r"experts.down_proj_scales' has shape \[8, 256, 2\]; expected \[8, 256, 4\]"):
        load_expert_weights(mx, _cfg(checkpoints["mxfp4-gpt-oss"]), layer_idx=0)


def test_mixed_and_unsupported_formats(checkpoints):
    p = "model.layers.0.mlp.experts."
    fp8, nv = _tensors(checkpoints["fp8"]), _tensors(checkpoints["nvfp4-modelopt"])
    mixed = {k: v for k, v in fp8.items() if not k.startswith(p + "3.")}
    mixed.update({k: v for k, v in nv.items() if k.startswith(p + "3.")})
    with pytest.raises(ValueError, match=r"mix checkpoint formats \(fp8: .*; nvfp4-modelopt: .*experts.3"):
        load_expert_weights(mixed, _cfg(checkpoints["fp8"]).replace(quant_method=None), layer_idx=0)
    # per-tensor FP8 (weight_scale + input_scale): recognised and refused with the reason
    cfg = _cfg(checkpoints["fp8"]).replace(quant_method=None)
    pt = {}
    for k, v in fp8.items():
        if k.endswith("weight_scale_inv"):
            pt[k.replace("weight_scale_inv", "weight_scale")] = torch.ones(())
            pt[k.replace("weight_scale_inv", "input_scale")] = torch.ones(())
        else:
            pt[k] = v
    with pytest.raises(ValueError, match="per-tensor / per-channel FP8 experts .* are not supported"):
        load_expert_weights(pt, cfg, layer_idx=0)


def test_checkpoint_the_plan_cannot_read_is_refused_and_old_weights_stay(checkpoints):
    d = checkpoints["fp8"]
    cfg = _cfg(d).replace(quant_method=None)  # undeclared FP8 tensors, a plan for NVFP4
    layer = EPMoE(cfg, quant="nvfp4_w4a4")
    with pytest.raises(ValueError, match="stored as fp8_block, but the quant plan runs nvfp4_w4a4"):
        layer.load_weights(d, layer_idx=0)
    layer = EPMoE(_cfg(d))
    layer.load_weights(d, layer_idx=0)
    x = torch.randn(5, H)
    logits = torch.randn(5, E)
    before = layer(x, logits)
    bad = _tensors(d)
    bad["model.layers.0.mlp.experts.7.down_proj.weight_scale_inv"] = torch.ones(3, 3)
    with pytest.raises(ValueError, match="experts.7.down_proj.weight_scale_inv"):
        layer.load_weights(bad, layer_idx=0)
    assert torch.equal(layer(x, logits), before)  # nothing half-loaded


# ----------------------------------------------------------------------------- pieces
def test_shared_gate_up_global_scale_keeps_values():
    from epmoe.experts.triton.kernel_formats import quantize_expert_weights
    from tests.cpu.helpers import random_weights

    cfg = MoEConfig(num_experts=4, top_k=1, hidden_size=64, intermediate_size=32, dtype=torch.float32)
    w = quantize_expert_weights(random_weights(cfg, 5), "nvfp4_w4a16")
    assert not torch.equal(w.w1_global_scale, w.w3_global_scale)
    s = shared_gate_up_global_scale(w)
    assert torch.equal(s.w1_global_scale, s.w3_global_scale)
    assert torch.equal(s.w1_global_scale, torch.maximum(w.w1_global_scale, w.w3_global_scale))
    a, b = dequantize_expert_weights(w), dequantize_expert_weights(s)
    for name in ("w1", "w3"):  # only E4M3 re-rounding of the rescaled block scales
        assert max_rel_err(getattr(b, name), getattr(a, name)) < 0.07
    assert shared_gate_up_global_scale(s) is s


def test_streaming_writer_refuses_incomplete_files(tmp_path):
    w = StreamingSafetensorsWriter(str(tmp_path / "x.safetensors"), [("a", torch.float32, (2, 3))], {"format": "pt"})
    w.write("a", torch.ones(3), row=0)
    with pytest.raises(RuntimeError, match="not written completely"):
        w.close()
    assert not os.path.exists(tmp_path / "x.safetensors")


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_launcher_checks_a_quantized_checkpoint_and_plans_from_config_json(tmp_path, checkpoints):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "-m", "epmoe.launch", "--preset", "tiny", "--check", "--steps", "2", "--tokens", "8",
                        "--checkpoint-format", "nvfp4-compressed", "--quant", "nvfp4_w4a16"],
                       capture_output=True, text=True, timeout=180, env=ENV)
    assert r.returncode == 0 and "check | passed" in r.stdout, r.stdout + r.stderr
    assert "checkpoint=nvfp4" in r.stdout
    r = subprocess.run([sys.executable, "-m", "epmoe.launch", "--plan", "--config", checkpoints["fp8"], "--ep", "2"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checkpoint: quant_method=fp8 (fp8 family)" in r.stdout and "experts=fp8_block" in r.stdout, r.stdout
    assert "routing: model_type 'qwen3_moe' routes with softmax top-k" in r.stdout


def test_triton_experts_read_each_checkpoint_format_interpreter():
    """The Triton kernels (interpreter) on weights loaded from each quantized checkpoint format, against
    float64 math on the dequantized checkpoint (fp8: the same 1x128 activation round trips)."""
    from tests.cpu.interpret import run_interpret_worker

    worker = os.path.join(os.path.dirname(__file__), "_triton_checkpoint_worker.py")
    res = run_interpret_worker(worker, QUANTIZED)
    for fmt in QUANTIZED:
        assert "error" not in res[fmt] and res[fmt]["err"] < 1e-2, res[fmt]
    assert res["nvfp4-modelopt"]["global_scales_differ"]  # gate and up keep their own weight_scale_2
