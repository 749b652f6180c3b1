"""The root of torpor's errors (:class:`TorporError`) and the errors any part may raise: a value or type refused, a setting refused, an optional dependency missing."""

from __future__ import annotations

__all__ = [
    "BadArgument",
    "BadArgumentType",
    "BadSetting",
    "MissingExtra",
    "TorporError",
]


class TorporError(Exception):
    """Base of every error torpor raises."""


class MissingExtra(TorporError, ImportError):
    """A GPU feature without its optional dependencies: ``feature``, ``module`` (the failed import), ``extra``."""

    def __init__(self, feature: str, module: str, extra: str = "cuda", cause: str = "") -> None:
        self.feature = feature
        self.module = module
        self.extra = extra
        why = f" ({cause})" if cause else ""
        also = " (or '.[vllm]', which brings vLLM's torch)" if extra == "cuda" else ""
        msg = (
            f"{feature} needs {module}, which cannot be imported here{why}; "
            f"install the {extra!r} extra: pip install '.[{extra}]' from a torpor checkout{also}"
        )
        super().__init__(msg, name=module)


class BadArgument(TorporError, ValueError):
    """A value a call does not take (a size, a number of seconds, a name, an option): refused, nothing changed."""


class BadArgumentType(TorporError, TypeError):
    """A value of a type a call does not take (an ``engine`` that is no ``str``, a group without the protocol)."""


class BadSetting(TorporError, ValueError):
    """An environment variable (``name``) whose ``value`` torpor does not read: refused naming it, never guessed."""

    def __init__(self, name: str, value: str, wanted: str) -> None:
        self.name = name
        self.value = value
        super().__init__(f"{name}={value!r} is not {wanted}")
