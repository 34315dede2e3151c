"""A typed answer to "can this backend run here, and if not why"."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""
    hint: str = ""

    @classmethod
    def yes(cls, reason: str = "") -> "Availability":
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str, hint: str = "") -> "Availability":
        return cls(False, reason, hint)

    def __bool__(self) -> bool:  # `if backend.availability(): ...`
        return self.ok

    def describe(self) -> str:
        if self.ok:
            return "available" + (f" ({self.reason})" if self.reason else "")
        return f"unavailable: {self.reason}" + (f"; {self.hint}" if self.hint else "")
