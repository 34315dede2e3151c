"""Checkpoint loading: every naming style round-trips through safetensors; errors name the tensor."""

import pytest
import torch
from safetensors.torch import save_file

from epmoe import EPMoE, MoEConfig, load_expert_weights, reference_moe
from epmoe.checkpoint import hf_expert_tensors
from tests.cpu.helpers import fresh_seed, max_rel_err, random_inputs, random_weights

GATED = MoEConfig(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32, has_bias=True)
RELU2 = MoEConfig(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32, activation="relu2")
STYLES = [("mixtral", GATED), ("hf", GATED), ("gpt_oss", GATED), ("hf", RELU2), ("mixtral", RELU2)]


def _same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert torch.equal(a, b)


@pytest.mark.parametrize("style, cfg", STYLES, ids=[f"{s}-{c.activation}" for s, c in STYLES])
def test_round_trip_through_safetensors(tmp_path, style, cfg):
    seed = fresh_seed()
    w = random_weights(cfg, seed)
    tensors = hf_expert_tensors(cfg, w, "model.layers.0.mlp.", style)
    tensors.update(hf_expert_tensors(cfg, random_weights(cfg, seed + 1), "model.layers.1.mlp.", style))
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    loaded = load_expert_weights(path, cfg, experts=(2, 5), layer_idx=0).experts
    want = w.slice_experts(2, 5)
    assert loaded.first_expert == 2 and loaded.num_experts == 3
    for name in ("w1", "w2", "w3", "b13", "b2"):
        _same(getattr(loaded, name), getattr(want, name))
    # directory form and explicit prefix give the same
    again = load_expert_weights(tmp_path, cfg, experts=(2, 5), prefix="model.layers.0.mlp.").experts
    assert torch.equal(again.w1, loaded.w1)


def test_several_layers_need_a_choice(tmp_path):
    w = random_weights(GATED, 1)
    t = hf_expert_tensors(GATED, w, "model.layers.0.mlp.", "hf")
    t.update(hf_expert_tensors(GATED, w, "model.layers.1.mlp.", "hf"))
    with pytest.raises(ValueError, match="several layers.*pass layer_idx= or prefix="):
        load_expert_weights(t, GATED)
    with pytest.raises(ValueError, match="layer_idx=5 matches prefixes \\[\\]"):
        load_expert_weights(t, GATED, layer_idx=5)


def test_missing_expert_and_shape_errors():
    w = random_weights(GATED, 2)
    t = hf_expert_tensors(GATED, w, "m.", "hf")
    del t["m.experts.4.up_proj.weight"]
    with pytest.raises(ValueError, match=r"expert 4 lacks its w3 weight .*m.experts.4.up_proj.weight"):
        load_expert_weights(t, GATED)
    load_expert_weights(t, GATED, experts=(0, 4))  # the missing expert is not needed for [0, 4)
    t = hf_expert_tensors(GATED, w, "m.", "hf")
    t["m.experts.1.down_proj.weight"] = torch.zeros(16, 9)
    with pytest.raises((ValueError, RuntimeError)):
        load_expert_weights(t, GATED)
    with pytest.raises(ValueError, match="no expert tensors found"):
        load_expert_weights({"foo": torch.zeros(1)}, GATED)
    with pytest.raises(ValueError, match="does not exist"):
        load_expert_weights("/nonexistent/weights.safetensors", GATED)


def test_canonical_forms_and_correction_bias():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32,
                    routing="sigmoid_grouped", n_group=2, topk_group=1)
    w = random_weights(cfg, 3)
    corr = torch.randn(8)
    canon = {"w1": w.w1, "w3": w.w3, "w2": w.w2, "e_score_correction_bias": corr}
    got = load_expert_weights(canon, cfg, experts=(4, 8))
    assert torch.equal(got.experts.w3, w.w3[4:]) and torch.equal(got.e_score_correction_bias, corr)
    fused = {"w13": torch.cat([w.w1, w.w3], 1), "w2": w.w2}
    assert torch.equal(load_expert_weights(fused, cfg).experts.w1, w.w1)
    with pytest.raises(ValueError, match="'w2' has shape"):
        load_expert_weights({"w1": w.w1, "w3": w.w3, "w2": w.w2[:, :, :4]}, cfg)
    with pytest.raises(ValueError, match="e_score_correction_bias has shape"):
        load_expert_weights({**canon, "e_score_correction_bias": torch.zeros(7)}, cfg)
    hf = hf_expert_tensors(cfg, w, "model.layers.3.mlp.", "hf", e_score_correction_bias=corr)
    assert torch.equal(load_expert_weights(hf, cfg).e_score_correction_bias, corr)


def test_layer_loads_safetensors_and_matches_reference(tmp_path):
    seed = fresh_seed()
    cfg = GATED
    w = random_weights(cfg, seed)
    save_file(hf_expert_tensors(cfg, w, "model.layers.0.mlp.", "gpt_oss"), str(tmp_path / "w.safetensors"))
    layer = EPMoE(cfg)
    layer.load_weights(tmp_path / "w.safetensors")
    x, logits = random_inputs(cfg, 9, seed)
    assert max_rel_err(layer(x, logits), reference_moe(cfg, x, w, logits)) < 1e-5


def test_reload_copies_in_place_and_bad_reload_keeps_old_weights():
    seed = fresh_seed()
    layer = EPMoE(GATED)
    w_a, w_b = random_weights(GATED, seed), random_weights(GATED, seed + 1)
    layer.load_weights(w_a)
    ptrs = {k: v.data_ptr() for k, v in layer.experts.parameters().items()}
    x, logits = random_inputs(GATED, 7, seed)
    layer.load_weights(w_b)
    assert {k: v.data_ptr() for k, v in layer.experts.parameters().items()} == ptrs
    y_b = layer(x, logits)
    assert max_rel_err(y_b, reference_moe(GATED, x, w_b, logits)) < 1e-5
    bad = {"w1": w_a.w1, "w3": w_a.w3, "w2": w_a.w2[:, :, :4], "b13": w_a.b13, "b2": w_a.b2}
    with pytest.raises(ValueError, match="'w2' has shape"):
        layer.load_weights(bad)
    assert torch.equal(layer(x, logits), y_b)
