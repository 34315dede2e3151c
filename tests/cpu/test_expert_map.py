"""Global <-> local expert ids and per-expert tensor slicing."""

import dataclasses
import random

import pytest
import torch

from epmoe.quant.expert_map import ExpertPlacement


@pytest.fixture
def seed():
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    return s


def test_contiguous_ranges():
    ps = ExpertPlacement.all_ranks(16, 4)
    assert [(p.first_local_expert, p.end_local_expert) for p in ps] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert all(p.num_local_experts == 4 for p in ps)
    assert list(ps[2].local_range) == [8, 9, 10, 11]
    assert ps[0].owner_of_expert(13) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        ps[0].ep_rank = 1


def test_validation_messages():
    with pytest.raises(ValueError, match=r"num_experts=10 is not divisible by ep_size=4; choose an EP size.*\[1, 2, 5, 10\]"):
        ExpertPlacement(10, 4, 0)
    with pytest.raises(ValueError, match=r"ep_rank=4 is outside \[0, ep_size=4\)"):
        ExpertPlacement(8, 4, 4)
    with pytest.raises(ValueError, match="ep_size must be a positive int"):
        ExpertPlacement(8, 0, 0)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        ExpertPlacement(True, 1, 0)
    with pytest.raises(ValueError, match=r"expert id -1 is outside \[0, num_experts=8\)"):
        ExpertPlacement(8, 2, 0).owner_of_expert(-1)


def test_global_to_local_hand_vectors():
    p = ExpertPlacement(8, 4, 1)  # owns 2, 3
    ids = torch.tensor([[2, 3], [-1, 5], [0, 7], [3, -1]], dtype=torch.int32)
    assert p.global_to_local(ids).tolist() == [[0, 1], [-1, -1], [-1, -1], [1, -1]]
    assert p.global_to_local(ids).dtype == torch.int32
    assert p.global_to_local(ids.long()).dtype == torch.int32
    assert p.is_local(ids).tolist() == [[True, True], [False, False], [False, False], [True, False]]
    assert p.owner_of(ids).tolist() == [[1, 1], [-1, 2], [0, 3], [1, -1]]
    assert p.local_to_global(torch.tensor([0, 1, -1], dtype=torch.int32)).tolist() == [2, 3, -1]


def test_round_trip_all_ranks(seed):
    E, ep = 24, 6
    ids = torch.randint(-1, E, (50, 4), dtype=torch.int32)
    seen = torch.zeros_like(ids, dtype=torch.int32)
    for p in ExpertPlacement.all_ranks(E, ep):
        loc = p.global_to_local(ids)
        mine = loc >= 0
        assert torch.equal(mine, p.is_local(ids)), f"seed={seed}"
        assert torch.equal(p.local_to_global(loc)[mine], ids[mine]), f"seed={seed}"
        assert bool((p.owner_of(ids)[mine] == p.ep_rank).all()), f"seed={seed}"
        seen += mine.int()
    assert torch.equal(seen, (ids >= 0).int()), f"seed={seed}"  # every valid id owned exactly once


def test_id_checks():
    p = ExpertPlacement(8, 2, 0)
    with pytest.raises(ValueError, match=r"outside \[-1, 8\) \(e.g. \[8, -2\]\)"):
        p.global_to_local(torch.tensor([1, 8, -2]))
    with pytest.raises(ValueError, match=r"local expert ids contains ids outside \[-1, 4\)"):
        p.local_to_global(torch.tensor([4]))
    with pytest.raises(TypeError, match="integer tensor"):
        p.global_to_local(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        p.owner_of([1, 2])
    # check=False skips the host sync; valid ids map the same
    assert p.global_to_local(torch.tensor([1, 5]), check=False).tolist() == [1, -1]


def test_slice_per_expert_tensors(seed):
    E, ep = 8, 4
    p = ExpertPlacement(E, ep, 2)  # owns 4, 5
    w13 = torch.randn(E, 6, 4)
    w2_t = torch.randn(4, E, 3)  # expert dim 1
    gs = torch.arange(E, dtype=torch.float32)  # per-expert global scale [E]
    gs2 = torch.randn(E, 2)  # [E, 2] (w13 / w2 global scales)
    residual = torch.arange(E, dtype=torch.float32) * 64  # Humming x64 residual, per expert
    assert torch.equal(p.slice_per_expert(w13), w13[4:6])
    assert torch.equal(p.slice_per_expert(w2_t, dim=1), w2_t[:, 4:6])
    assert torch.equal(p.slice_per_expert(w2_t, dim=-2), w2_t[:, 4:6])
    assert p.slice_per_expert(gs).tolist() == [4.0, 5.0]
    assert torch.equal(p.slice_per_expert(gs2), gs2[4:6])
    assert p.slice_per_expert(residual).tolist() == [256.0, 320.0]
    assert p.slice_per_expert(w13).data_ptr() == w13[4].data_ptr()  # a view, no copy
    out = p.slice_tensors({"w13": w13, "w2": w2_t, "gs": gs}, dims={"w2": 1})
    assert torch.equal(out["w2"], w2_t[:, 4:6]) and out["gs"].tolist() == [4.0, 5.0]
    with pytest.raises(ValueError, match=r"w2 has 4 entries along dim 0 \(shape \[4, 8, 3\]\); .*num_experts=8"):
        p.slice_per_expert(w2_t, name="w2")
    with pytest.raises(ValueError, match="scalar"):
        p.slice_per_expert(torch.tensor(1.0))
    with pytest.raises(ValueError, match="dim=3 is out of range"):
        p.slice_per_expert(w13, dim=3)


def test_inverse_for_reporting(seed):
    E, ep = 12, 3
    full = torch.randn(E, 5)
    locals_ = [p.slice_per_expert(full) for p in ExpertPlacement.all_ranks(E, ep)]
    assert torch.equal(ExpertPlacement.gather_global(locals_), full)
    p = ExpertPlacement(E, ep, 1)
    g = p.scatter_to_global(p.slice_per_expert(full), fill_value=float("nan"))
    assert torch.equal(g[4:8], full[4:8]) and torch.isnan(g[:4]).all() and torch.isnan(g[8:]).all()
    counts = torch.tensor([3, 1, 0, 2])
    assert p.scatter_to_global(counts).tolist() == [0, 0, 0, 0, 3, 1, 0, 2, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="expected 4 \\(num_local_experts\\)"):
        p.scatter_to_global(torch.zeros(5))
    with pytest.raises(ValueError, match="differ in size"):
        ExpertPlacement.gather_global([torch.zeros(2), torch.zeros(3)])
