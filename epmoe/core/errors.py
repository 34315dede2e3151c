"""Exception types. Messages name the bad value and say how to fix it."""

from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """A backend cannot run here (missing package, wrong GPU arch, ...).

    ``reason`` says why, ``hint`` how to fix it (usually an install command).
    """

    def __init__(self, backend: str, reason: str, hint: str = ""):
        self.backend = backend
        self.reason = reason
        self.hint = hint
        msg = f"backend {backend!r} is unavailable: {reason}"
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)


class ConfigMismatchError(ValueError):
    """Ranks of one EP group were constructed with different settings."""


class RemoteRankError(RuntimeError):
    """Another rank of the group failed; this rank stops too instead of hanging."""


class PeerInputError(ValueError):
    """Another rank of the group was given invalid input in the same call; every rank raises
    (the bad rank its own ValueError/TypeError, the others this), so none waits in a collective."""


class NonFiniteError(ValueError):
    """NaN/Inf found by the opt-in finite check (EPMoE(check_finite=True)); raised on every rank,
    naming the ranks and the tensor."""


class RebalanceError(RuntimeError):
    """A rebalance of a layer's experts failed or was refused; raised on every rank with the same
    message (naming the failing ranks), and the placement in force stays valid."""
