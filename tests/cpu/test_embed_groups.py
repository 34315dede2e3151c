"""Embedding EPMoE into an existing process group (what docs/deploy.md describes): 4 ranks split into
2 EP groups of 2 with dist.new_subgroups, next to a world-wide EP=4 layer and the host framework's
own collectives. Each group is checked against the float64 reference; a bad input in one group stops
that group only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe import EPMoE, MoEConfig, reference_moe
from epmoe.core.errors import PeerInputError
from tests.cpu.helpers import fresh_seed, max_rel_err, random_inputs, random_weights
from tests.cpu.mp import run_group

# the two EP groups even run different shapes: agreement is per group, not per world
GROUP_CONFIGS = [dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16),
                 dict(num_experts=4, top_k=2, hidden_size=48, intermediate_size=24, has_bias=True)]
WORLD_CONFIG = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
TOKENS = [5, 0, 7, 3]  # per world rank; rank 1 passes none


def _worker(rank, world, seed):
    sub, _ = dist.new_subgroups(group_size=2)  # ranks {0, 1} and {2, 3}; every rank calls it
    gid = rank // 2
    cfg = MoEConfig(dtype=torch.float32, **GROUP_CONFIGS[gid])
    wcfg = MoEConfig(dtype=torch.float32, **WORLD_CONFIG)
    ep_layer = EPMoE(cfg, group=sub, max_num_tokens_per_rank=4, name=f"EPMoE[group {gid}]")
    world_layer = EPMoE(wcfg, max_num_tokens_per_rank=8, name="EPMoE[world]")  # group=None: the world
    assert (ep_layer.ep_rank, ep_layer.ep_size) == (rank % 2, 2) and world_layer.ep_size == 4
    w = random_weights(cfg, seed + gid)
    ww = random_weights(wcfg, seed + 7)
    ep_layer.load_weights(w)
    world_layer.load_weights(ww)
    x, logits = random_inputs(cfg, TOKENS[rank], seed + 100 + rank)
    wx, wlogits = random_inputs(wcfg, TOKENS[::-1][rank], seed + 200 + rank)

    errors = {}
    for step in range(2):
        out = ep_layer(x, logits, return_stats=True)
        assert out.stats.tokens_per_rank == tuple(TOKENS[2 * gid: 2 * gid + 2])
        errors[f"group step {step}"] = max_rel_err(out.hidden_states, reference_moe(cfg, x, w, logits))
        # the host framework's own traffic on the world group, between MoE calls
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        assert total.item() == 6.0
        wout = world_layer(wx, wlogits)
        errors[f"world step {step}"] = max_rel_err(wout, reference_moe(wcfg, wx, ww, wlogits))

    # a bad input on world rank 3: its group (2, 3) raises on both ranks, group (0, 1) is untouched
    outcome = "ok"
    try:
        ep_layer(x[:, :-1] if rank == 3 else x, logits)
    except PeerInputError as e:
        outcome = f"PeerInputError: {e}"
    except ValueError as e:
        outcome = f"ValueError: {e}"
    # every group is still usable afterwards
    again = ep_layer(x, logits)
    errors["after error"] = max_rel_err(again, reference_moe(cfg, x, w, logits))
    return errors, outcome


def test_two_ep_subgroups_inside_a_world_of_four():
    seed = fresh_seed()
    results = run_group(_worker, 4, seed, timeout=120)
    for rank, (errors, _) in enumerate(results):
        for what, err in errors.items():
            assert err < 1e-5, f"rank {rank} {what}: max rel err {err:.3g} (seed {seed})"
    outcomes = [o for _, o in results]
    assert outcomes[0] == "ok" and outcomes[1] == "ok", outcomes
    assert outcomes[3].startswith("ValueError: hidden_states has shape"), outcomes[3]
    assert outcomes[2].startswith("PeerInputError") and "rank 3" in outcomes[2], outcomes[2]  # names the world rank
