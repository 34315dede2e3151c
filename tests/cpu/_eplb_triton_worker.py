"""Started by test_eplb_quantized_interpret.py in a subprocess with TRITON_INTERPRET=1 (the triton experts
backend runs on CPU only under the interpreter). For each case "backend:mode" given: 2 gloo ranks build
a layer with EPLB, load float weights (quantized at load into the backend's stored layout), rebalance
to a placement that moves slots between and within ranks, and compare every stored tensor, byte for
byte, with a second layer loaded directly under that placement. Prints one `RESULT {json}` line per
mode.

Only the resolver's view of the machine is replaced (`epmoe.layer.detect_environment` reports an sm90
GPU with triton), so that experts="triton" is accepted for CPU tensors, and grouped_mm's device check
(as tests/cpu/_triton_interpret_worker.py does)."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.cpu.interpret import report_cases  # noqa: E402
from tests.cpu.mp import run_group  # noqa: E402


def _rank(rank, world, case, seed):
    import epmoe.layer
    from epmoe import EPLBConfig, EPMoE, MoEConfig
    from epmoe.resolve import Environment
    from tests.cpu.helpers import random_weights

    epmoe.layer.detect_environment = lambda device=None, arch=None: Environment(arch="sm90",
                                                                                 packages=frozenset({"triton"}))
    backend, mode = case.split(":")
    if backend == "grouped_mm":  # it asks for a CUDA device; its kernels run here under the interpreter
        from epmoe.core.availability import Availability
        from epmoe.experts.triton.grouped_mm import GroupedMMExperts

        GroupedMMExperts.availability = classmethod(lambda c, s: Availability.yes("interpreter test"))
    # grouped_mm keeps its biases with one padding row past the experts: a case with biases
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.bfloat16,
                    has_bias=backend == "grouped_mm")
    w = random_weights(cfg, seed)
    eplb = EPLBConfig(num_redundant_experts=2)
    moved = EPMoE(cfg, experts=backend, quant=mode, eplb=eplb, device="cpu")
    moved.load_weights(w)
    old = moved.placement
    per = old.slots_per_rank
    s = old.slot_to_expert  # the ranks exchange their slots, each in reverse: moves between and within ranks
    new = list(s[per:][::-1] + s[:per][::-1])
    report = moved.rebalance(placement=new)
    loaded = EPMoE(cfg, experts=backend, quant=mode, eplb=eplb, placement=new, device="cpu")
    loaded.load_weights(w)
    a, b = moved.experts.parameters(), loaded.experts.parameters()
    differ = [n for n in a if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype
              or not torch.equal(a[n].contiguous().view(torch.uint8), b[n].contiguous().view(torch.uint8))]
    return dict(names=sorted(a), dtypes=sorted({str(t.dtype) for t in a.values()}), differ=differ,
                moved=report.moved_slots, bytes=report.bytes_moved, layout=moved.experts.stored_layout())


def run(case, seed):
    res = run_group(_rank, 2, case, seed, timeout=150)
    return dict(ranks=res)


if __name__ == "__main__":
    report_cases(sys.argv[1:], run)
