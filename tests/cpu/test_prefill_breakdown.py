"""benchmarks/prefill_breakdown.py (a GPU benchmark): what runs without a GPU. Its variants name real
knobs of the triton backend, set for a variant and restored after; an unknown variant is refused before
anything touches a GPU."""

import pytest

from tests.cpu.helpers import load_benchmark


def test_unknown_variant_is_refused_with_the_known_ones(capsys):
    pb = load_benchmark("prefill_breakdown")
    with pytest.raises(SystemExit) as e:
        pb.main(["--variants", "base,nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown variant 'nope'" in err and all(n in err for n in pb.VARIANTS)


def test_variant_knobs_exist_and_are_restored():
    from epmoe.experts.triton import triton_experts as TE

    pb = load_benchmark("prefill_breakdown")

    class Backend:
        pass

    for name, values in pb.VARIANTS.items():
        before = {k: getattr(TE, k) for k in values if not k.startswith("_")}
        ex = Backend()
        with pb.knobs(values, ex):
            for k, v in values.items():
                if k.startswith("_"):
                    assert "_permute_k" in ex.__dict__, name
                else:
                    assert getattr(TE, k) == v, (name, k)
        assert {k: getattr(TE, k) for k in before} == before, name
        assert "_permute_k" not in ex.__dict__, name
