"""Expert-parallel generation with a Hugging Face transformers MoE model, on CPU or GPU.

    pip install -e '.[hf]'
    torchrun --nproc-per-node 2 examples/hf_generate.py                 # tiny random Mixtral, CPU (gloo)
    torchrun --nproc-per-node 2 examples/hf_generate.py --dir PATH      # your save_pretrained checkpoint

Each rank holds half of every MoE layer's experts and generates for its own prompts: rank 0 has two
prompts of different lengths, rank 1 none (it still serves its experts to rank 0), further ranks one.
Every rank checks its tokens against the unsharded transformers model.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def write_tiny_mixtral(path: str) -> None:
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, initializer_range=0.2, pad_token_id=0, eos_token_id=3)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/epmoe-hf-example", help="checkpoint directory (written if empty)")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per prompt (greedy)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (bfloat16 on GPUs runs the fast experts kernels; greedy tokens may "
                             "then differ from transformers' own bf16 experts where two logits nearly tie)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if rank == 0 and not os.path.isfile(os.path.join(args.dir, "config.json")):
        write_tiny_mixtral(args.dir)
    dist.barrier()

    from epmoe.integrations.transformers import load_model

    dtype = getattr(torch, args.dtype)
    # float32 on a GPU: the plain-torch experts (the fast kernels take bf16)
    options = {"experts": "reference"} if (cuda and dtype == torch.float32) else {}
    model = load_model(args.dir, dtype=dtype, **options)  # this rank's experts only; the rest as transformers loads it

    g = torch.Generator().manual_seed(rank)
    n_prompts = 2 if rank == 0 else (0 if rank == 1 else 1)
    if n_prompts:
        lengths = [5 + 3 * i for i in range(n_prompts)]
        ids = torch.zeros(n_prompts, max(lengths), dtype=torch.long)  # left-padded
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, -n:] = torch.randint(4, model.config.vocab_size, (n,), generator=g)
            mask[i, -n:] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, do_sample=False)
        print(f"rank {rank}: {n_prompts} prompts -> new tokens {out[:, ids.shape[1]:].tolist()}", flush=True)

        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(args.dir, dtype=model.dtype).to(model.device)
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, do_sample=False)
        print(f"rank {rank}: same tokens as the unsharded model: {torch.equal(out, want)}", flush=True)
    else:
        model.generate(None, max_new_tokens=args.tokens)  # serve the other ranks until they finish
        print(f"rank {rank}: no prompts (served the others' steps)", flush=True)
    dist.barrier()  # leave together: a rank tearing down its group while another still works can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
