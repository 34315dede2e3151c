"""epmoe.integrations.transformers on a GPU, bf16: tiny random models of every supported family, loaded
through the integration (experts="auto": Triton on SM90) and compared with transformers' own model.

The bound (docs/hf.md): with the float32 transformers model as the truth, the bf16 epmoe model's
logits are at most twice as far from it as transformers' own bf16 model is, plus one bf16 step
(2^-8) of the logit scale:

    max|logits_epmoe_bf16 - logits_fp32| <= 2 * max|logits_hf_bf16 - logits_fp32| + 2^-8 * max|logits_fp32|

Both bf16 models replay the float32 model's routing (`tests.cpu.hf_models.routing`): a token whose
router scores nearly tie picks another expert under bf16 noise (GPT-OSS, seed 0: experts 5 and 4 for
a layer-1 token, 0.0054 apart in float32), a jump of up to 0.9 in the logits that says nothing about
the experts' numerics. Generation runs on each model's own routing.

One rank on one GPU, and 2 ranks sharing one GPU (shared-GPU mode, docs/shared-gpu.md: gloo group,
`shared_gpu=True`), each rank with its own batch and, in generate, rank 1 with no prompts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from tests.cpu.hf_models import FAMILIES, bf16_logit_errors, write_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu


def bf16_errors(path: str, device: str, experts: str = "auto", rank: int = 0, generate_none: bool = False,
                **options) -> dict:
    """Logits of one padded batch (`bf16_logit_errors`, routing replayed) and a 16-token generate."""
    r, ids, mask, hf, ep = bf16_logit_errors(path, device, experts, rank, **options)
    with torch.no_grad():
        if generate_none:  # this rank has no prompts: it serves the others' steps
            gen = ep.generate(None, max_new_tokens=16)
            gen_hf = gen
            ids = ids[:0]
        else:
            gen = ep.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
            gen_hf = hf.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    return dict(
        **r,
        same_tokens_as_hf_bf16=bool(torch.equal(gen, gen_hf)),
        new_tokens=gen.shape[1] - ids.shape[1] if gen.shape[0] else 16,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_within_bound_of_unsharded(tmp_path, family):
    path = write_tiny_model(family, str(tmp_path), hidden=128, inter=64, init_std=0.05)
    r = bf16_errors(path, "cuda")
    bound = 2 * r["hf"] + 2 ** -8 * r["scale"]
    print(f"{family}: {r} bound={bound:.4g}")
    assert r["new_tokens"] == 16
    assert r["ep"] <= bound, (family, r, bound)


def _shared_gpu_worker(rank, world_size, paths):
    torch.cuda.set_device(0)
    return {f: bf16_errors(p, "cuda:0", rank=rank, generate_none=(rank == 1), shared_gpu=True)
            for f, p in paths.items()}


def test_bf16_two_ranks_sharing_one_gpu(tmp_path):
    """2 ranks on cuda:0 (gloo, shared_gpu=True); the same bound on every rank's own batch."""
    from tests.cpu.mp import run_group

    paths = {f: write_tiny_model(f, str(tmp_path), hidden=128, inter=64, init_std=0.05) for f in FAMILIES}
    results = run_group(_shared_gpu_worker, 2, paths, timeout=500, pg_timeout=300)
    for rank, per_family in enumerate(results):
        for family, r in per_family.items():
            bound = 2 * r["hf"] + 2 ** -8 * r["scale"]
            print(f"rank {rank} {family}: {r} bound={bound:.4g}")
            assert r["ep"] <= bound, (rank, family, r, bound)
