"""EPMoE across real gloo process groups (ep = 1, 2, 4) against the dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.core.errors import ConfigMismatchError, PeerInputError
from tests.cpu.helpers import fresh_seed, max_rel_err, random_correction_bias, random_inputs, random_weights
from tests.cpu.mp import run_group

F32_TOL = 1e-5

CONFIGS = {
    "softmax_swiglu": dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24),
    "softmax_swiglu_bias_norenorm": dict(
        num_experts=8, top_k=3, hidden_size=32, intermediate_size=16, has_bias=True, renormalize=False
    ),
    "grouped_sigmoid_relu2": dict(
        num_experts=16, top_k=4, hidden_size=48, intermediate_size=16, activation="relu2",
        routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
    ),
    "grouped_sigmoid_swiglu_bias": dict(
        num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, has_bias=True,
        routing="sigmoid_grouped", n_group=2, topk_group=1,
    ),
    "gpt_oss_swiglu": dict(
        num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, has_bias=True,
        swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
    ),
}


def _config(name: str) -> MoEConfig:
    return MoEConfig(dtype=torch.float32, **CONFIGS[name])


def _layer_worker(rank, world, cfg_name, seed, tokens_per_rank, max_tokens):
    cfg = _config(cfg_name)
    layer = EPMoE(cfg, max_num_tokens_per_rank=max_tokens)
    w = random_weights(cfg, seed)
    corr = random_correction_bias(cfg, seed) if cfg.routing == "sigmoid_grouped" else None
    layer.load_weights(w, e_score_correction_bias=corr)
    x, logits = random_inputs(cfg, tokens_per_rank[rank], seed + 1000 + rank)
    out = layer(x, logits, return_stats=True)
    assert out.hidden_states.shape == x.shape and out.hidden_states.dtype == cfg.dtype
    assert out.stats.tokens_per_rank == tuple(tokens_per_rank)
    return x, logits, out.hidden_states, out.stats.rounds


def _check_against_reference(cfg_name, seed, results):
    cfg = _config(cfg_name)
    w = random_weights(cfg, seed)
    corr = random_correction_bias(cfg, seed) if cfg.routing == "sigmoid_grouped" else None
    for rank, (x, logits, y, _) in enumerate(results):
        ref = reference_moe(cfg, x, w, logits, e_score_correction_bias=corr)
        err = max_rel_err(y, ref)
        assert err < F32_TOL, f"{cfg_name} rank {rank} seed {seed}: max rel err {err:.3g}"


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_layer_matches_reference(ep, cfg_name):
    seed = fresh_seed()
    tokens = [13, 0, 5, 21][:ep] if ep > 1 else [17]  # uneven, one rank idle
    results = run_group(_layer_worker, ep, cfg_name, seed, tokens, 4096)
    _check_against_reference(cfg_name, seed, results)


def test_chunked_rounds_match_reference():
    """T above max_num_tokens_per_rank runs in rounds all ranks agree on (one rank needs 4 rounds)."""
    seed = fresh_seed()
    tokens = [11, 0, 2, 5]
    results = run_group(_layer_worker, 4, "softmax_swiglu", seed, tokens, 3)
    assert all(r[3] == 4 for r in results), [r[3] for r in results]
    _check_against_reference("softmax_swiglu", seed, results)


def _experts_without_tokens_worker(rank, world, seed):
    """Routing replay that sends every token to expert 1 or nothing: most experts get no token."""
    cfg = _config("softmax_swiglu")
    layer = EPMoE(cfg)
    w = random_weights(cfg, seed)
    layer.load_weights(w)
    x, _ = random_inputs(cfg, 6, seed + rank)
    ids = torch.full((6, 2), -1, dtype=torch.int32)
    ids[::2, 0] = 1
    weights = torch.rand(6, 2)
    y = layer(x, topk_ids=ids, topk_weights=weights)
    return x, ids, weights, y


def test_experts_without_tokens_and_padding_ids():
    seed = fresh_seed()
    cfg = _config("softmax_swiglu")
    w = random_weights(cfg, seed)
    from epmoe.routing import Routing

    for x, ids, weights, y in run_group(_experts_without_tokens_worker, 4, seed):
        ref = reference_moe(cfg, x, w, routing=Routing(ids, weights))
        assert max_rel_err(y, ref) < F32_TOL
        assert torch.all(y[1::2] == 0), "tokens with no expert must come back as zeros"


def _bad_input_worker(rank, world, seed, case):
    cfg = _config("softmax_swiglu")
    layer = EPMoE(cfg, max_num_tokens_per_rank=4, strict=(case == "strict"))
    w = random_weights(cfg, seed)
    layer.load_weights(w)
    x, logits = random_inputs(cfg, 3, seed + rank)
    bx, blogits = x, logits
    if rank == 1:
        if case == "hidden_size":
            bx = torch.randn(3, cfg.hidden_size + 1)
        elif case == "dtype":
            bx = x.to(torch.float64)
        elif case == "logits_width":
            blogits = torch.randn(3, cfg.num_experts - 1)
        elif case == "strict":
            bx, blogits = random_inputs(cfg, 9, seed)
        elif case == "replay_ids":
            blogits = None
    errors = []
    try:
        if case == "replay_ids" and rank == 1:
            ids = torch.tensor([[0, 9], [1, 2], [3, 4]], dtype=torch.int32)
            layer(bx, topk_ids=ids, topk_weights=torch.rand(3, 2))
        else:
            layer(bx, blogits)
    except (ValueError, TypeError) as e:
        errors.append(f"{type(e).__name__}|{isinstance(e, PeerInputError)}|{e}")
    # the process group must still be usable: a valid forward afterwards matches the reference
    y = layer(x, logits)
    return errors, x, logits, y


@pytest.mark.parametrize(
    "case, needle",
    [
        ("hidden_size", "expected [num_tokens, 32]"),
        ("dtype", "float64"),
        ("logits_width", "router_logits has shape [3, 7]"),
        ("strict", "9 tokens exceed max_num_tokens_per_rank=4"),
        ("replay_ids", "outside [-1, 8)"),
    ],
)
def test_bad_input_fails_every_rank_and_group_survives(case, needle):
    seed = fresh_seed()
    results = run_group(_bad_input_worker, 2, seed, case)
    cfg = _config("softmax_swiglu")
    w = random_weights(cfg, seed)
    (err0, x0, l0, y0), (err1, x1, l1, y1) = results
    assert len(err0) == 1 and len(err1) == 1, (err0, err1)
    kind1, peer1, msg1 = err1[0].split("|", 2)
    assert peer1 == "False" and kind1 in ("ValueError", "TypeError") and needle in msg1, err1
    kind0, peer0, msg0 = err0[0].split("|", 2)
    assert peer0 == "True" and needle in msg0, err0  # rank 0 names rank 1's problem
    for x, l, y in ((x0, l0, y0), (x1, l1, y1)):
        assert max_rel_err(y, reference_moe(cfg, x, w, l)) < F32_TOL


def _dispatcher_bad_ids_worker(rank, world):
    from epmoe.dispatch.base import DispatchSpec
    from epmoe.dispatch.torch_a2a import TorchA2ADispatcher
    from epmoe.quant.payload import PayloadFormat

    spec = DispatchSpec(
        group=None, ep_rank=rank, ep_size=world, num_experts=8, top_k=2, hidden_size=16,
        max_tokens_per_rank=8, payload=PayloadFormat.unquantized(torch.float32),
        combine_dtype=torch.float32, device=torch.device("cpu"),
    )
    d = TorchA2ADispatcher(spec)
    ids = torch.tensor([[0, 5], [7, -1]], dtype=torch.int32)
    if rank == 0:
        ids[1, 0] = 8
    out = []
    try:
        d.dispatch(torch.randn(2, 16), ids, torch.rand(2, 2))
    except ValueError as e:
        out.append(f"{type(e).__name__}: {e}")
    ids[1, 0] = 7
    tokens, handle = d.dispatch(torch.randn(2, 16), ids, torch.rand(2, 2))  # group still usable
    return out


def test_dispatcher_rejects_expert_id_out_of_range():
    r0, r1 = run_group(_dispatcher_bad_ids_worker, 2)
    assert "expert id 8 outside [0, 8)" in r0[0], r0
    assert r1 and r1[0].startswith("PeerInputError") and "rank 0" in r1[0], r1


def _construct_worker(rank, world, case):
    kwargs = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype=torch.float32)
    dispatcher = "torch"
    if case == "hidden" and rank == 1:
        kwargs["hidden_size"] = 64
    if case == "topk" and rank == 2:
        kwargs["top_k"] = 3
    if case == "experts_div":
        kwargs["num_experts"] = 6
    if case == "dispatcher" and rank == 0:
        dispatcher = "flashinfer"
    if case == "max_tokens":
        return EPMoE(MoEConfig(**kwargs), max_num_tokens_per_rank=16 * (rank + 1)) and "built"
    EPMoE(MoEConfig(**kwargs), dispatcher=dispatcher)
    return "built"


@pytest.mark.parametrize(
    "case, needles",
    [
        ("hidden", ["hidden_size differs", "ranks [1]: 64", "ranks [0, 2, 3]: 32"]),
        ("topk", ["top_k differs", "ranks [2]: 3"]),
        ("dispatcher", ["dispatcher differs", "ranks [0]: flashinfer"]),
        ("max_tokens", ["max_num_tokens_per_rank differs"]),
        ("experts_div", ["num_experts=6 is not divisible by the EP size 4"]),
    ],
)
def test_construction_mismatch_fails_every_rank(case, needles):
    results = run_group(_construct_worker, 4, case, expect_errors=True, timeout=90)
    for r, res in enumerate(results):
        assert isinstance(res, str) and res.startswith(("ConfigMismatchError", "ValueError")), (r, res)
        for n in needles:
            assert n in res, (r, n, res.splitlines()[0])
