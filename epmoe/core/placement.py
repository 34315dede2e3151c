"""`Placement`: where the experts of one MoE layer live (core type, imports nothing from epmoe).

    E logical experts (what the router chooses), S = E + R physical slots (R redundant copies of hot
    experts), S divisible by the EP size. Slot s sits on rank s // (S / ep), local slot s % (S / ep),
    and holds logical expert slot_to_expert[s]. Every logical expert has at least one slot (its
    replicas) and never two on one rank.

The default, `Placement.contiguous(E, ep)`, is the fixed layout: rank r holds experts
[r * E / ep, (r + 1) * E / ep) in order, R = 0. Dispatchers and experts backends only ever see slot
ids (global slot ids on the wire, local slot ids in the experts), so they run unchanged under any
placement; the layer maps each (token, logical expert) choice to one replica (`epmoe.eplb`).
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple


def text_digest(text: str) -> int:
    """A 63-bit hash of `text` (fits an int64 all-gather; compared across ranks)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class Placement:
    """num_experts: E logical experts; ep_size: ranks; slot_to_expert: [S] logical expert of each
    physical slot (rank-major: rank r's slots are [r * S / ep, (r + 1) * S / ep)).

    Invalid values raise ValueError naming the field and the fix."""

    num_experts: int
    ep_size: int
    slot_to_expert: Tuple[int, ...]
    expert_to_slots: Tuple[Tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_experts", "ep_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Placement.{name}={v!r}; pass a positive int")
        try:
            slots = tuple(operator.index(e) for e in self.slot_to_expert)  # ints (or 0-dim int tensors), no floats
        except TypeError:
            raise ValueError(f"Placement.slot_to_expert={self.slot_to_expert!r}; pass a sequence of expert ids (ints)") \
                from None
        object.__setattr__(self, "slot_to_expert", slots)
        E, ep, S = self.num_experts, self.ep_size, len(slots)
        if S < E:
            raise ValueError(
                f"Placement.slot_to_expert has {S} slots for {E} experts; every expert needs a slot "
                f"(S = E + redundant experts >= {E})")
        if S % ep:
            raise ValueError(
                f"Placement.slot_to_expert has {S} slots, not divisible by ep_size={ep}; choose a number of "
                f"redundant experts that makes E + R a multiple of {ep}")
        bad = [(s, e) for s, e in enumerate(slots) if not 0 <= e < E]
        if bad:
            s, e = bad[0]
            raise ValueError(f"Placement.slot_to_expert[{s}]={e} is outside [0, {E}); slots hold logical expert ids")
        replicas: List[List[int]] = [[] for _ in range(E)]
        for s, e in enumerate(slots):
            replicas[e].append(s)
        missing = [e for e in range(E) if not replicas[e]]
        if missing:
            raise ValueError(
                f"Placement.slot_to_expert misses experts {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                "every logical expert needs at least one slot")
        per = S // ep
        for e, where in enumerate(replicas):
            ranks = [s // per for s in where]
            if len(set(ranks)) != len(ranks):
                r = next(r for r in ranks if ranks.count(r) > 1)
                raise ValueError(
                    f"Placement.slot_to_expert puts expert {e} twice on rank {r} (slots "
                    f"{[s for s in where if s // per == r]}); replicas of one expert must sit on different ranks")
        object.__setattr__(self, "expert_to_slots", tuple(tuple(w) for w in replicas))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> "Placement":
        """Today's layout: rank r holds experts [r * E / ep, (r + 1) * E / ep), no redundant slots."""
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep_size={ep_size}; a contiguous placement needs "
                "E % ep == 0 (add redundant experts so that E + R is a multiple of ep)")
        return cls(num_experts, ep_size, tuple(range(num_experts)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Placement":
        """The inverse of `to_dict` (e.g. a placement saved as JSON)."""
        missing = [k for k in ("num_experts", "ep_size", "slot_to_expert") if k not in d]
        if missing:
            raise ValueError(f"a placement dict needs {missing}; got keys {sorted(d)}")
        return cls(d["num_experts"], d["ep_size"], tuple(d["slot_to_expert"]))

    def to_dict(self) -> Dict[str, Any]:
        return {"num_experts": self.num_experts, "ep_size": self.ep_size, "slot_to_expert": list(self.slot_to_expert)}

    # ------------------------------------------------------------------ shape
    @property
    def num_slots(self) -> int:
        return len(self.slot_to_expert)

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    @property
    def is_contiguous(self) -> bool:
        """True for `Placement.contiguous(E, ep)` (the layout without EPLB)."""
        return self.num_slots == self.num_experts and all(e == s for s, e in enumerate(self.slot_to_expert))

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def rank_slots(self, rank: int) -> range:
        """Global slot ids of `rank`'s slots, in local-slot order."""
        per = self.slots_per_rank
        return range(rank * per, (rank + 1) * per)

    def local_experts(self, rank: int) -> Tuple[int, ...]:
        """The logical expert of each of `rank`'s slots, in local-slot order."""
        return tuple(self.slot_to_expert[s] for s in self.rank_slots(rank))

    def replicas(self, expert: int) -> Tuple[int, ...]:
        """Global slot ids holding logical `expert`."""
        return self.expert_to_slots[expert]

    def replica_counts(self) -> Tuple[int, ...]:
        return tuple(len(w) for w in self.expert_to_slots)

    # ------------------------------------------------------------------ comparison, load
    def digest(self) -> int:
        """A 63-bit hash of the placement (compared across ranks: every rank must hold the same)."""
        return text_digest(f"{self.num_experts}/{self.ep_size}/" + ",".join(map(str, self.slot_to_expert)))

    def changed_slots(self, other: "Placement") -> Tuple[int, ...]:
        """Slots whose expert differs in `other` (same E, ep and S)."""
        self._check_same_shape(other)
        return tuple(s for s, (a, b) in enumerate(zip(self.slot_to_expert, other.slot_to_expert)) if a != b)

    def _check_same_shape(self, other: "Placement") -> None:
        if (other.num_experts, other.ep_size, other.num_slots) != (self.num_experts, self.ep_size, self.num_slots):
            raise ValueError(
                f"placements differ in shape: E={other.num_experts}, ep={other.ep_size}, S={other.num_slots} vs "
                f"E={self.num_experts}, ep={self.ep_size}, S={self.num_slots}")

    def rank_load(self, expert_load: Sequence[float]) -> List[float]:
        """Load per rank if each expert's load splits evenly over its replicas: [ep] floats."""
        if len(expert_load) != self.num_experts:
            raise ValueError(f"expert_load has {len(expert_load)} entries; expected {self.num_experts}")
        counts = self.replica_counts()
        out = [0.0] * self.ep_size
        for s, e in enumerate(self.slot_to_expert):
            out[s // self.slots_per_rank] += float(expert_load[e]) / counts[e]
        return out

    def imbalance(self, expert_load: Sequence[float]) -> float:
        """max / mean of `rank_load` (1.0 = balanced; 0.0 without load)."""
        loads = self.rank_load(expert_load)
        total = sum(loads)
        return max(loads) * len(loads) / total if total > 0 else 0.0

    def describe(self, ranks: Optional[Sequence[int]] = None) -> str:
        """One line per rank: its slots' logical experts ('*' marks a slot of a replicated expert)."""
        counts = self.replica_counts()
        lines = []
        for r in (range(self.ep_size) if ranks is None else ranks):
            ids = " ".join(f"{e}{'*' if counts[e] > 1 else ''}" for e in self.local_experts(r))
            lines.append(f"rank {r}: {ids}")
        return "\n".join(lines)
