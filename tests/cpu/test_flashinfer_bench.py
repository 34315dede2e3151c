"""benchmarks/bench_dispatch.py --dry-run works on CPU (no FlashInfer, no GPU)."""

import os
import runpy
import sys


def test_bench_dispatch_dry_run(tmp_path, capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "plan.json"
    argv = sys.argv
    sys.argv = ["bench_dispatch.py", "--dry-run", "--tokens", "16", "--json", str(out)]
    try:
        try:
            runpy.run_path(os.path.join(root, "benchmarks", "bench_dispatch.py"), run_name="__main__")
        except SystemExit as e:
            assert e.code == 0
    finally:
        sys.argv = argv
    import json

    rows = json.loads(out.read_text())
    assert {r["format"] for r in rows} == {"bf16", "nvfp4"}
    bf16 = [r for r in rows if r["format"] == "bf16"][0]
    assert bf16["dispatch_bytes_per_token"] == 7168 * 2 + 8 * 8
    assert all(r["rank0_link_bytes"] == 0 for r in rows if r["ep_size"] == 1)
    assert any(r["rank0_link_bytes"] > 0 for r in rows if r["ep_size"] == 8)
    assert "[dry-run]" in capsys.readouterr().out


def test_bench_dispatch_hands_combine_the_layout_it_received():
    """The stand-in expert output of bench_dispatch: one row per received row for the flat layout, the
    masked [E_local, rows, H] shape for the low-latency dispatchers (bf16 or FP8 tokens)."""
    import torch

    from epmoe.dispatch.base import DispatchedTokens
    from epmoe.dispatch.deepep import fp8_block_format
    from epmoe.quant.payload import QuantizedActivation

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bench = runpy.run_path(os.path.join(root, "benchmarks", "bench_dispatch.py"))
    flat = DispatchedTokens(hidden=torch.zeros(5, 256, dtype=torch.bfloat16), topk_ids=None, topk_weights=None)
    assert bench["_expert_output"](flat, 256, torch.device("cpu")).shape == (5, 256)
    masked = DispatchedTokens(hidden=torch.zeros(4, 32, 256, dtype=torch.bfloat16), topk_ids=None, topk_weights=None,
                              layout="masked", expert_counts=torch.zeros(4, dtype=torch.int32))
    y = bench["_expert_output"](masked, 256, torch.device("cpu"))
    assert y.shape == (4, 32, 256) and y.dtype == torch.bfloat16
    q = QuantizedActivation(format=fp8_block_format(), data=torch.zeros(4, 32, 256, dtype=torch.float8_e4m3fn),
                            scales=torch.zeros(4, 32, 2), hidden_size=256)
    masked_q = DispatchedTokens(hidden=q, topk_ids=None, topk_weights=None, layout="masked",
                                expert_counts=torch.zeros(4, dtype=torch.int32))
    assert bench["_expert_output"](masked_q, 256, torch.device("cpu")).shape == (4, 32, 256)
