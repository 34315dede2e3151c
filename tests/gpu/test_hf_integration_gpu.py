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


# ------------------------------------------------------------------------------- quantized checkpoints
def _quantized_errors(family: str, path: str, rank: int, generate_none: bool, device: str = "cuda:0") -> dict:
    """One rank of the shared-GPU run on a quantized checkpoint (bf16 model, experts="auto": the Hopper
    experts of the checkpoint's format). The truth is transformers' model of the same checkpoint
    dequantized (its own `dequantize=True` loading option) in float32 arithmetic; transformers' own bf16
    model is dequantized the same way (GPT-OSS: transformers dequantizes MXFP4 on this machine unless the
    `kernels` package is installed; FP8: it would run FP8Linear through `kernels`, see the refusal)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    from epmoe.integrations.transformers import describe, load_model
    from tests.cpu.hf_models import routing

    fp8 = family == "deepseek_v3"
    qc = (lambda: FineGrainedFP8Config(dequantize=True)) if fp8 else (lambda: Mxfp4Config(dequantize=True))
    out = {}
    shared = device.startswith("cuda")
    if fp8:  # without the `kernels` package transformers cannot run the FP8 linears here: refused, with the fix
        try:
            load_model(path, dtype=torch.bfloat16, device=device, shared_gpu=shared)
            out["refusal"] = "loaded"
        except ValueError as e:
            out["refusal"] = str(e)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(4, 96, (3 + rank, 12), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    log: dict = {}
    with torch.no_grad():
        truth_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=qc()).to(device)
        for p in truth_model.parameters():
            p.data = p.data.float()  # GPT-OSS: transformers' dequantized experts are bf16 (exact values)
        with routing(truth_model, log, replay=False):
            truth = truth_model(ids, attention_mask=mask).logits.float()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=qc()).to(device)
        with routing(hf, {k: list(v) for k, v in log.items()}, replay=True):
            hf_logits = hf(ids, attention_mask=mask).logits.float()
        ep = load_model(path, dtype=torch.bfloat16, device=device, shared_gpu=shared, experts="auto",
                        **({"quantization_config": qc()} if fp8 else {}))
        with routing(ep, {k: list(v) for k, v in log.items()}, replay=True):
            ep_logits = ep(ids, attention_mask=mask).logits.float()
        if generate_none:
            gen = ep.generate(None, max_new_tokens=16)
        else:
            gen = ep.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    valid = mask.bool()
    err = lambda a: float((a - truth)[valid].abs().max())  # noqa: E731
    layer = ep.model.layers[-1].mlp.experts.ep_moe
    out.update(ep=err(ep_logits), hf=err(hf_logits), scale=float(truth[valid].abs().max()),
               mode=layer.plan.expert_mode, backend=layer.experts.name, describe=describe(ep),
               new_tokens=16 if generate_none else gen.shape[1] - ids.shape[1])
    return out


def _quantized_worker(rank, world_size, paths):
    torch.cuda.set_device(0)
    return {f: _quantized_errors(f, p, rank, generate_none=(rank == 1)) for f, p in paths.items()}


def test_quantized_checkpoints_two_ranks_sharing_one_gpu(tmp_path):
    """GPT-OSS MXFP4 (experts mxfp4_w4a16) and DeepSeek-V3 FP8 (experts fp8_block) as shipped, 2 ranks on
    cuda:0 (gloo, shared_gpu=True), rank 1 generating for no prompts. Bound, on the truth's routing:
    max|ep_bf16 - truth| <= 2 * max|hf_bf16 - truth| + 2^-8 * scale (MXFP4 W4A16: bf16 activations, the
    weights exact), + 2^-3 * scale for FP8 (e4m3 activations per 1x128 block, the CPU test's bound)."""
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():  # transformers' quantizers check for the package (metadata only)
        pytest.skip("transformers' quantizers need accelerate: pip install accelerate")
    from tests.cpu.hf_models import write_quantized_model
    from tests.cpu.mp import run_group

    paths = {f: write_quantized_model(f, str(tmp_path / f), hidden=256, inter=128, init_std=0.05)
             for f in ("gpt_oss", "deepseek_v3")}
    results = run_group(_quantized_worker, 2, paths, timeout=500, pg_timeout=300)
    try:
        import kernels  # noqa: F401
        has_kernels = True
    except ImportError:
        has_kernels = False
    for rank, per_family in enumerate(results):
        for family, r in per_family.items():
            fp8 = family == "deepseek_v3"
            bound = 2 * r["hf"] + (2 ** -3 if fp8 else 2 ** -8) * r["scale"]
            print(f"rank {rank} {family}: ep={r['ep']:.4g} hf_bf16={r['hf']:.4g} scale={r['scale']:.4g} "
                  f"bound={bound:.4g} mode={r['mode']} backend={r['backend']}")
            if rank == 0:
                print(r["describe"])
                print("refusal without quantization_config:", r.get("refusal"))
            assert r["mode"] == ("fp8_block" if fp8 else "mxfp4_w4a16"), r
            assert r["backend"] == "triton", r  # the Hopper experts of the format
            assert r["ep"] <= bound, (rank, family, r, bound)
            assert r["new_tokens"] == 16
            if fp8 and not has_kernels:
                assert "kernels" in r["refusal"] and "FineGrainedFP8Config(dequantize=True)" in r["refusal"], r
