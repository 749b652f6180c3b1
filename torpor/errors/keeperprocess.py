"""The keeper's errors (``torpor keeper``): each one carries what it names (a path, a budget, a reason) and says what to do next."""

from __future__ import annotations

from typing import Any

from torpor.errors.base import TorporError
from torpor.units import byte_size

__all__ = [
    "AdoptionRefused",
    "BadMessage",
    "KeeperBudgetExceeded",
    "KeeperDenied",
    "KeeperError",
    "KeeperPathRefused",
    "KeeperUnavailable",
    "KeeperUntrusted",
    "PinningUnavailable",
    "RegionMapFailed",
    "RequestRefused",
    "WireClosed",
]


class KeeperError(TorporError, RuntimeError):
    """Base of every error about a keeper process (``torpor keeper``)."""


class KeeperUnavailable(KeeperError):
    """No keeper answers at ``path`` (none started, or it died): ``reason`` says which."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        msg = f"no keeper answers at {path} ({reason}); start one with `torpor keeper serve --socket {path}`"
        super().__init__(msg)


class KeeperDenied(KeeperError, PermissionError):
    """The keeper serves only its own user: a process of ``uid`` was refused by a keeper of ``keeper_uid``."""

    def __init__(self, path: str, uid: int, keeper_uid: int, reason: str = "") -> None:
        self.path = path
        self.uid = uid
        self.keeper_uid = keeper_uid
        why = f": {reason}" if reason else ""
        msg = f"the keeper at {path} serves only uid {keeper_uid}; uid {uid} gets nothing{why}"
        super().__init__(msg)


class KeeperUntrusted(KeeperError, PermissionError):
    """This process refused the keeper at ``path``: ``reason`` (its directory, its socket or the process listening
    there is not this user's), the owner ``found`` and the owner ``expected`` (this process's uid). Nothing was sent."""

    def __init__(self, path: str, reason: str, found: int, expected: int) -> None:
        self.path = path
        self.reason = reason
        self.found = found
        self.expected = expected
        msg = (
            f"refused the keeper at {path}: {reason} (owner found: uid {found}; expected: uid {expected}, this "
            f"process's user); nothing was sent to it or taken from it. Run `torpor keeper serve` as this user, or "
            f"name a socket in a directory only this user can write (--socket, $TORPOR_KEEPER_SOCKET)"
        )
        super().__init__(msg)


class KeeperPathRefused(KeeperError):
    """A keeper will not serve at ``path``: ``reason`` (what is there, its directory, another keeper serving there)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"the keeper will not serve at {path}: {reason}")


class KeeperBudgetExceeded(KeeperError):
    """A region would pass the keeper's byte budget: ``budget``, ``used`` (held now) and ``asked`` bytes."""

    def __init__(self, budget: int, used: int, asked: int) -> None:
        self.budget = budget
        self.used = used
        self.asked = asked
        msg = (
            f"the keeper's budget is {byte_size(budget)}, {byte_size(used)} are held and {byte_size(asked)} more were "
            f"asked ({byte_size(used + asked - budget)} over); start the keeper with a larger --budget or drop a dead "
            "engine's backup"
        )
        super().__init__(msg)


class AdoptionRefused(KeeperError):
    """A backup cannot be adopted by this process: ``engine`` and the ``reason`` (none kept, alive, mismatch)."""

    def __init__(self, engine: str, reason: str) -> None:
        self.engine = engine
        self.reason = reason
        msg = f"cannot adopt engine {engine!r}'s backup: {reason}"
        super().__init__(msg)


class PinningUnavailable(KeeperError):
    """The CUDA driver cannot be opened or gives no context for the GPU: kept regions are not pinned (copied pageable)."""


class BadMessage(KeeperError, ValueError):
    """A frame on the keeper's wire that is no message (``reason``); ``in_step``: the next frame can still be read."""

    def __init__(self, reason: str, *, in_step: bool) -> None:
        self.reason = reason
        self.in_step = in_step
        super().__init__(reason)


class WireClosed(KeeperError, ConnectionError):
    """The other end closed the connection (between messages or inside one)."""


class RequestRefused(KeeperError):
    """The keeper refused a request: the error's ``kind`` and its fields go back to the client as ``reply``."""

    def __init__(self, kind: str, message: str, **data: Any) -> None:
        super().__init__(message)
        self.reply = {"error": kind, "message": message, **data}


class RegionMapFailed(KeeperError, OSError):
    """A keeper region could not be mapped or unmapped where it was asked (``errno`` when the system gave one)."""
