"""Search the bit layouts of the fp4 "words" conversion (`triton_kernels._E2M1_BF16_WORDS_ASM`).

A 4-byte word of fp4 weights holds 8 nibbles; the conversion makes 4 output words, each a bf16 pair
whose 8 meaningful bits sit at the mask P = 0x81C081C0 (bits T = 6, 7, 8, 15 and + 16). The weights'
bits are permuted at load (`kernel_formats.permute_fp4_words`) so that the outputs are cheap:

    out0 = w & P                                   1 instruction
    out1 = rotr(w, r1) & P, out2 = rotr(w, r2) & P  2 each (a funnel shift of w with itself, then and)
    out3 = ((w & R) * C) & P                        3 (and, one integer multiply, and)

where R holds the 8 bits left over and C = 2^a + 2^b + ... makes shifted copies of them. The multiply is
exact only if no two copies share a bit position (no carries), and each bit of T must receive exactly
one copy, of a distinct source bit. Four shifts of P cannot tile 32 bits, so out3 needs more than one
shift: this is the cheapest form found (8 instructions per 8 values; the earlier layout took 11).

    python scripts/fp4_word_layouts.py       # print every layout of this form (the shipped one marked)
"""

from __future__ import annotations

import itertools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

T = (6, 7, 8, 15, 22, 23, 24, 31)


def rotation_sources(r: int) -> frozenset:
    """Bits of w that `rotr(w, r) & P` puts on T."""
    return frozenset((p + r) % 32 for p in T)


def multiply_ok(rest: frozenset, shifts) -> bool:
    """((w & rest) * sum(2^a for a in shifts)) & P: no two copies overlap, every bit of T hit exactly once,
    by distinct source bits."""
    seen, sources = set(), set()
    for a in shifts:
        copy = {q + a for q in rest if q + a < 32}
        if copy & seen:
            return False
        seen |= copy
    for p in T:
        hits = [p - a for a in shifts if p - a in rest]
        if len(hits) != 1:
            return False
        sources.add(hits[0])
    return len(sources) == len(T)


def layouts(max_terms: int = 3):
    """Every (r1, r2, rest, shifts) of the form above with at most `max_terms` copies in the multiply."""
    rots = [r for r in range(1, 32) if not rotation_sources(r) & set(T)]
    for r1, r2 in itertools.combinations(rots, 2):
        s1, s2 = rotation_sources(r1), rotation_sources(r2)
        if s1 & s2:
            continue
        rest = frozenset(range(32)) - set(T) - s1 - s2
        for k in range(2, max_terms + 1):
            for shifts in itertools.combinations(range(32), k):
                if multiply_ok(rest, shifts):
                    yield r1, r2, rest, shifts


def main() -> int:
    from epmoe.experts.triton import kernel_formats as kf

    shipped_rest = frozenset(s + 16 * h for s in kf.FP4_WORD_SOURCE[3] for h in (0, 1))
    found = list(layouts())
    for r1, r2, rest, shifts in found:
        mask = sum(1 << b for b in rest)
        mul = sum(1 << a for a in shifts)
        mark = "  <- shipped" if {r1, r2} == {22, 19} and rest == shipped_rest and mul == 0x1084 else ""
        print(f"rotr {r1:2d}, {r2:2d}; rest 0x{mask:08X} * 0x{mul:X}{mark}")
    print(f"{len(found)} layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
