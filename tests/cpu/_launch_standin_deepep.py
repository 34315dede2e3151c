"""The launcher with tests/cpu/fake_deep_ep standing in for DeepEP on CPU (started by
test_launch_deepep_standin.py under torchrun). A stand-in: it checks what the launcher assembles (the
dispatcher, one DeepEP buffer shared by every layer, closing it), never DeepEP's kernels
(tests/gpu/test_deepep.py). Prints how many DeepEP buffers this rank created and destroyed."""

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.cpu import fake_deep_ep  # noqa: E402

fake_deep_ep.install()
made, destroyed = [], []
_init, _destroy = fake_deep_ep.Buffer.__init__, fake_deep_ep.Buffer.destroy


def _counting_init(self, *a, **k):
    made.append(k.get("low_latency_mode", False))
    _init(self, *a, **k)


def _counting_destroy(self):
    destroyed.append(1)
    return _destroy(self)


fake_deep_ep.Buffer.__init__, fake_deep_ep.Buffer.destroy = _counting_init, _counting_destroy
atexit.register(lambda: print(f"standin deep_ep buffers: made {len(made)}, destroyed {len(destroyed)}", flush=True))

import epmoe.layer as layer_module  # noqa: E402
from epmoe.resolve import Environment  # noqa: E402

# the plan as on an sm90 host with DeepEP installed (the stand-in runs on CPU)
layer_module.detect_environment = lambda device=None, arch=None: Environment.hypothetical("sm90")

from epmoe.launch.cli import main  # noqa: E402

if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.exit(code)
