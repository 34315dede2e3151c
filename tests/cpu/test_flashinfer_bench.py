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
