"""What DeepEP's normal-mode dispatch does to FP8 tokens, printed exactly (docs/deepep.md, "FP8 in normal
mode"). Ranks share GPU 0 (gloo group) and call `deep_ep.Buffer.dispatch` with (data, scales) made
three ways:

  old             the former dispatcher's expression, on the GPU: scales amax / 448.0, data x * (448.0 / amax)
  codec           epmoe.quant.codec.quantize_for_wire, what `DeepEPDispatcher` sends now
  codec-colmajor  the same, scales handed over as a column-major view (strides (1, T))

For each it prints the shapes, strides and dtypes that went in and came out, and compares
  A  what arrived with what the senders passed (gathered from every rank, put in DeepEP's row order
     through its handle): does DeepEP move data and scales bit for bit, whatever the scales' strides?
  B  the senders' GPU result with the same expression evaluated on the CPU (what the old check
     compared against): do the two devices agree?
then one verdict line per rank. Exit code 0 when every A is exact.

    python tests/gpu/deepep_fp8_diag.py [--ranks 2] [--seed N]     # GPU, deep_ep importable
    python tests/gpu/deepep_fp8_diag.py --fake                      # CPU stand-in: this script's plumbing only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def _fmt(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} stride {tuple(t.stride())} on {t.device}"


def fp8_diag_worker(rank: int, world: int, seed: int, fake: bool = False):
    import torch.distributed as dist

    from epmoe.quant import codec
    from tests.gpu.test_deepep import NM, NM_M, _bits_report, _routing, _spec

    if fake:
        from tests.cpu import fake_deep_ep

        dd = fake_deep_ep.install()
        dev = torch.device("cpu")
    else:
        from epmoe.dispatch import deepep as dd

        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    E, K, H = NM["num_experts"], NM["top_k"], NM["hidden_size"]
    fp8 = dd.fp8_block_format()
    T = 200 + 17 * rank
    g = torch.Generator().manual_seed(seed + rank)
    x_cpu = torch.randn(T, H, generator=g).to(torch.bfloat16)
    x = x_cpu.to(dev)
    ids, w = _routing(seed + 10 + rank, T, E, K, dev)
    from dataclasses import replace

    d = dd.DeepEPDispatcher(replace(_spec(rank, world, NM, NM_M, dev, fp8, wire=fp8), shared_gpu=not fake))
    buf, config = d.buffer.raw, d._dispatch_config
    idx = ids.to(d._deep_ep.topk_idx_t)

    def old(t):
        b = t.float().view(t.shape[0], H // 128, 128)
        amax = b.abs().amax(dim=2).clamp(min=1e-4)
        return (b * (448.0 / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(t.shape), amax / 448.0

    def new(t, on_cpu=False):
        q = codec.quantize_for_wire(t, fp8, use_triton=False if on_cpu else None)
        return q.data, q.scales

    where = "stand-in deep_ep on CPU" if fake else f"{torch.cuda.get_device_name(0)}, deep_ep {d._deep_ep.__file__}"
    lines = [f"rank {rank}/{world}: T={T}, H={H}, torch {torch.__version__}, {where}"]
    moved_exactly = True
    for name in ("old", "codec", "codec-colmajor"):
        data, scales = old(x) if name == "old" else new(x)
        if name == "codec-colmajor":
            scales = scales.t().contiguous().t()
        n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, _, _, handle, _ = buf.dispatch(
            (data, scales), num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
            topk_idx=idx, topk_weights=w.float(), config=config)
        got_d, got_s = recv_x
        lines.append(f"  {name}: sent data {_fmt(data)}, scales {_fmt(scales)}")
        lines.append(f"  {name}: received data {_fmt(got_d)}, scales {_fmt(got_s)}")
        sent = [None] * world
        dist.all_gather_object(sent, (data.view(torch.uint8).cpu(), scales.cpu().contiguous()))
        bounds = [0] + handle[0].cpu().long()[:, rank].tolist()  # rank_prefix_matrix: rows from ranks 0..s
        src_idx = handle[3].cpu().long()  # each received row's token index on its source rank
        want_d = torch.cat([sent[s][0][src_idx[bounds[s]:bounds[s + 1]]] for s in range(world)])
        want_s = torch.cat([sent[s][1][src_idx[bounds[s]:bounds[s + 1]]] for s in range(world)])
        a = [_bits_report("data", got_d.view(torch.uint8).cpu(), want_d), _bits_report("scales", got_s.cpu(), want_s)]
        moved_exactly &= not any(a)
        lines.append(f"  {name}: A (arrived vs sent): " + ("; ".join(p for p in a if p) or
                                                          f"bit for bit ({got_d.shape[0]} rows from {world} ranks)"))
        cpu_d, cpu_s = old(x_cpu) if name == "old" else new(x_cpu, on_cpu=True)
        b = [_bits_report("data", data.view(torch.uint8).cpu(), cpu_d.view(torch.uint8)),
             _bits_report("scales", scales.cpu().contiguous(), cpu_s)]
        lines.append(f"  {name}: B (this device vs the CPU, same expression): " + ("; ".join(p for p in b if p) or
                                                                                 "bit for bit"))
    lines.append(f"rank {rank}: verdict: DeepEP moved FP8 data and scales {'exactly' if moved_exactly else 'NOT exactly'}"
                 " (see A); a mismatch in B alone is the devices' arithmetic, not DeepEP")
    d.close()
    return moved_exactly, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks sharing GPU 0 (2, 4 or 8)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fake", action="store_true", help="the CPU stand-in for deep_ep (this script's plumbing only)")
    args = p.parse_args(argv)
    from tests.cpu.mp import run_group
    from tests.gpu.deepep_fp8_diag import fp8_diag_worker  # by its module name: the workers import it so

    res = run_group(fp8_diag_worker, args.ranks, args.seed, args.fake, timeout=240, pg_timeout=200)
    for _, lines in res:
        print("\n".join(lines))
    return 0 if all(ok for ok, _ in res) else 1


if __name__ == "__main__":
    sys.exit(main())
