"""Runs the Triton codec kernels under the Triton interpreter against the torch reference (started by
test_triton_codec_interpret.py in a subprocess with TRITON_INTERPRET=1 set before triton is
imported). Prints one `RESULT {json}` line per case: ok, seed, the first mismatches.

No interpreter patch is needed (unlike _triton_interpret_worker.py): the kernels round with integer
ops and IEEE numpy multiplies / divides, and avoid the interpreter's truncating float downcasts.
"""

import json
import os
import random
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.cpu._triton_codec_cases import run_case  # noqa: E402


def main() -> None:
    for name in sys.argv[1:]:
        seed = random.SystemRandom().randrange(2**31)
        try:
            errs = run_case(name, seed, "cpu")
            r = dict(case=name, seed=seed, ok=not errs, errors=errs[:5])
        except Exception:  # noqa: BLE001 - reported to the test
            r = dict(case=name, seed=seed, ok=False, errors=[traceback.format_exc()[-3000:]])
        print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
