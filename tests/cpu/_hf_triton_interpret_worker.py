"""Runs epmoe.integrations.transformers.load_model with the triton experts under the Triton interpreter
(started by test_hf_triton_interpret.py in a subprocess with TRITON_INTERPRET=1). Prints one
`RESULT {json}` line per case "family:seed[:free]" (free: each bf16 model routes on its own, as the
GPU test did before it replayed the float32 routing).

The kernels run for real (interpreter patched to round like the GPU); only the resolver's view of the
machine is replaced: `epmoe.layer.detect_environment` reports an sm90 GPU with triton, so that
`experts="triton"` is accepted for CPU tensors (the backend's own availability check allows the CPU
under TRITON_INTERPRET=1)."""

import json
import os
import sys
import tempfile
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import epmoe.layer  # noqa: E402
from epmoe.resolve import Environment  # noqa: E402
from tests.cpu.hf_models import bf16_logit_errors, write_tiny_model  # noqa: E402
from tests.triton_interpret import match_gpu_rounding  # noqa: E402

match_gpu_rounding()
epmoe.layer.detect_environment = lambda device=None, arch=None: Environment(arch="sm90", packages=frozenset({"triton"}))


def main(cases):
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            family, seed, *rest = case.split(":")
            out = dict(case=case, ok=False)
            try:
                path = write_tiny_model(family, os.path.join(tmp, seed), seed=int(seed), hidden=128, inter=64,
                                        init_std=0.05)
                r, *_ = bf16_logit_errors(path, "cpu", experts="triton", replay_routing=rest != ["free"])
                out.update(r, ok=True)
            except Exception:
                out["error"] = traceback.format_exc()
            print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
