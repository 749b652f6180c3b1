"""The base of every event payload: typed fields over a read-only mapping of the fields present.

Each event kind declares its payload as a subclass of :class:`Payload` with
annotated fields (``tag: str``; a field with a default is optional)::

    class TagDiscarded(Payload, kind="tag_discarded"):
        tag: str
        bytes: int

The class then reads its fields as attributes (``payload.tag``, typed for
mypy) and lists them in :attr:`Payload.fields`, from which the log's readers
derive their checks (:mod:`torpor.statemachine.log.checks`). A payload is also a
read-only mapping of exactly the fields it was given, which is what the log
writes: an optional field that was not given reads as its default and is not
written. Fields a kind does not declare are kept and written back unchanged
(a newer writer's additions), and never checked.

A payload is a ``dict`` subclass that refuses every change through the mapping
API, so building one and reading a field are C-level dict operations (replay
does millions of them); its nested objects are frozen (read-only mappings,
tuples) when an :class:`~torpor.statemachine.core.events.Event` is built over it
(:func:`freeze`).
"""

from __future__ import annotations

import enum
import inspect
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, NoReturn, dataclass_transform, get_origin

from torpor.errors import ReadOnlyPayload, SchemaDefinitionError

#: The default of a field that must be present.
REQUIRED: Any = object()
#: Values :func:`freeze` leaves as they are.
SCALARS = frozenset({str, int, float, bool, type(None)})


@dataclass(frozen=True, slots=True)
class Field:
    """One declared payload field: its name, its annotated type, its default (or :data:`REQUIRED`)."""

    name: str
    type: Any
    default: Any

    @property
    def required(self) -> bool:
        """True when the field must be present."""
        return self.default is REQUIRED


def freeze(value: Any) -> Any:
    """A read-only copy of a JSON-like value: mappings become read-only mappings (str keys), lists tuples."""
    kind = type(value)
    if kind in SCALARS:
        return value
    if kind is dict or isinstance(value, Mapping):
        scalars = SCALARS
        return MappingProxyType(
            {
                k if type(k) is str else str(k): v if type(v) in scalars else freeze(v)  # JSON's keys are strings
                for k, v in value.items()
            }
        )
    if kind is list or kind is tuple:
        return tuple(v if type(v) in SCALARS else freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Turn a frozen payload back into plain JSON-ready dicts and lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


_DICT_NAMES = frozenset(dir(dict))


@dataclass_transform(kw_only_default=True)  # a kind's class is built with its fields by name, checked by mypy
class Payload(dict[str, Any]):
    """A kind's payload: its declared fields as attributes; a read-only mapping of the fields present.

    A producer builds one by its fields' names (``TagReleased(tag="weights", bytes=n)``): the type
    checker sees each name and type, and a missing required field. At run time that is ``dict``'s own
    constructor, so only the fields given are present; ``Payload(mapping)`` (the readers' form) copies a mapping.
    """

    __slots__ = ()
    kind: ClassVar[str]
    #: Every declared field, by name, in declaration order.
    fields: ClassVar[Mapping[str, Field]] = MappingProxyType({})

    def __init_subclass__(cls, kind: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not kind:
            msg = f"payload class {cls.__name__} names no event kind (class {cls.__name__}(Payload, kind=...))"
            raise SchemaDefinitionError(msg)
        cls.kind = kind
        fields = dict(cls.fields)
        for name, hint in inspect.get_annotations(cls).items():
            origin: object = get_origin(hint)
            if origin is ClassVar:
                continue
            if isinstance(hint, str):
                msg = f"{cls.__name__}.{name}: annotations must be evaluated (no `from __future__ import annotations`)"
                raise SchemaDefinitionError(msg)
            if name in _DICT_NAMES or name in ("kind", "fields"):
                msg = f"{cls.__name__}.{name}: a payload field cannot be named like a mapping method"
                raise SchemaDefinitionError(msg)
            default = cls.__dict__.get(name, REQUIRED)
            if isinstance(default, dict | list | set):
                msg = f"{cls.__name__}.{name}: a default must be immutable (a read-only mapping or a tuple)"
                raise SchemaDefinitionError(msg)
            fields[name] = Field(name, hint, default)
            getter = operator.itemgetter(name) if default is REQUIRED else operator.methodcaller("get", name, default)
            setattr(cls, name, property(getter, doc=f"The ``{name}`` field ({_type_name(hint)})."))
        cls.fields = MappingProxyType(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (thaw(dict(self)),))

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        msg = f"a {self.kind} payload is read-only; build a new event instead"
        raise ReadOnlyPayload(msg)

    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "").replace("collections.abc.", "")
