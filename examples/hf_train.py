"""Expert-parallel training of a Hugging Face transformers MoE model, then rollouts from the same model.

    pip install -e '.[hf]'
    torchrun --nproc-per-node 2 examples/hf_train.py                 # tiny random Qwen3-MoE, CPU (gloo)
    torchrun --nproc-per-node 2 examples/hf_train.py --dir PATH      # your save_pretrained checkpoint

Each rank holds half of every MoE layer's routed experts (as nn.Parameters) and trains on its own batch:
`loss.backward()` sends the experts' gradients back over the all-to-all to the ranks that own them,
`sync_dense_gradients` sums the other parameters' gradients over the group, and one optimizer steps
every parameter this rank holds. Every rank checks each step's loss against one process training the
unsharded transformers model on all ranks' batches, then generates from the trained model (under
torch.no_grad: the inference path, the same experts and routing).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def write_tiny_qwen3_moe(path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, initializer_range=0.2,
                            pad_token_id=0, eos_token_id=3, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def batch(rank: int, step: int, vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(4, vocab, (2, 12), generator=g).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/epmoe-hf-train-example", help="checkpoint directory (written if empty)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not os.path.isfile(os.path.join(args.dir, "config.json")):
        write_tiny_qwen3_moe(args.dir)
    dist.barrier()

    from transformers import AutoModelForCausalLM

    from epmoe.integrations.transformers import load_model, sync_dense_gradients

    # float32 with the plain-torch experts: the bf16 'grouped_mm' experts train on sm90 / sm100 GPUs
    model = load_model(args.dir, dtype=torch.float32, training=True, timeout_s=120,
                       **({"experts": "reference"} if cuda else {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # the same training in one process, on every rank's batches (the check)
    reference = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).to(model.device)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.9)
    vocab = model.config.vocab_size

    same = True
    for step in range(args.steps):
        ids = batch(rank, step, vocab, model.device)
        loss = model(ids, labels=ids).loss        # this rank's batch; the MoE layers run on every rank
        loss.backward()                           # expert gradients travel back to their owners
        sync_dense_gradients(model)               # dense gradients: the sum over the ranks' losses
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        ref_losses = [reference(batch(r, step, vocab, model.device), labels=batch(r, step, vocab, model.device)).loss
                      for r in range(world)]
        sum(ref_losses).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        got, want = loss.item(), ref_losses[rank].item()
        same = same and abs(got - want) <= 1e-4 * abs(want)
        print(f"rank {rank}: step {step} loss {got:.5f} (one process: {want:.5f})", flush=True)
    print(f"rank {rank}: every step's loss equals one process training the unsharded model: {same}", flush=True)

    with torch.no_grad():  # rollouts from the trained model (the inference path)
        prompt = batch(rank, 99, vocab, model.device)[:1, :5]
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        want = reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    print(f"rank {rank}: rollout after training, same tokens as the unsharded model: {torch.equal(out, want)}",
          flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
