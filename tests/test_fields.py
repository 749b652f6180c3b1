"""Tests for torpor.statemachine.core.fields: the payload base class, typed fields over a read-only mapping."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Mapping
from types import MappingProxyType

import pytest
from support import raw_event

from torpor.statemachine.core.events import PAYLOADS, EventKind, TagReleased, TagRestored
from torpor.statemachine.core.fields import REQUIRED, Payload, freeze, thaw


def test_fields_are_typed_attributes_with_defaults() -> None:
    """A payload reads its declared fields as attributes; an optional field not given reads as its default."""
    data = raw_event(EventKind.TAG_RELEASED, 1, "e", 0, {"tag": "w", "bytes": 3}).data
    assert isinstance(data, TagReleased)
    assert (data.tag, data.bytes, data.action, data.seconds) == ("w", 3, "", 0.0)
    assert dict(data) == {"tag": "w", "bytes": 3}  # only what was given is written
    assert [f.name for f in TagReleased.fields.values() if f.default is REQUIRED] == ["tag", "bytes"]


def test_a_required_field_that_is_missing_raises_key_error() -> None:
    """Reading a required field the payload lacks raises KeyError naming it (readers check before that)."""
    with pytest.raises(KeyError, match="bytes"):
        _ = TagRestored(tag="w").bytes


def test_a_payload_refuses_every_change() -> None:
    """Every mapping method that would change a payload raises TypeError; so does setting an attribute."""
    data = raw_event(EventKind.TAG_RELEASED, 1, "e", 0, {"tag": "w", "bytes": 3}).data
    changes = [
        lambda: data.__setitem__("tag", "x"),
        lambda: data.__delitem__("tag"),
        lambda: data.update(tag="x"),
        lambda: data.pop("tag"),
        data.popitem,
        lambda: data.setdefault("x", 1),
        data.clear,
        lambda: data.__ior__({"x": 1}),
    ]
    for change in changes:
        with pytest.raises(TypeError, match="read-only"):
            change()
    with pytest.raises(AttributeError):
        data.tag = "x"  # type: ignore[misc]
    assert dict(data) == {"tag": "w", "bytes": 3}


def test_nested_values_are_frozen_in_an_event_and_thaw_back() -> None:
    """An event's payload holds read-only mappings and tuples; thaw gives plain dicts and lists back."""
    usage = {"weights": 1, "nested": {"a": [1, {"b": 2}]}}
    event = raw_event(EventKind.USAGE_OBSERVED, 1, "e", 0, {"usage": usage})
    usage["weights"] = 9  # the caller's dict is not shared
    assert event.data["usage"]["weights"] == 1
    assert isinstance(event.data["usage"], MappingProxyType)
    assert event.data["usage"]["nested"]["a"] == (1, {"b": 2})
    assert thaw(event.data) == {"usage": {"weights": 1, "nested": {"a": [1, {"b": 2}]}}}
    assert freeze({1: [2]}) == {"1": (2,)}


def test_a_payload_pickles_and_copies_as_its_class() -> None:
    """pickle and copy rebuild a payload of the same class with the same fields."""
    data = raw_event(EventKind.TAG_RELEASED, 1, "e", 0, {"tag": "w", "bytes": 3, "action": "offload"}).data
    for again in (pickle.loads(pickle.dumps(data)), copy.copy(data), copy.deepcopy(data)):  # noqa: S301  # our own bytes
        assert type(again) is TagReleased and again == data and again.action == "offload"


def test_undeclared_fields_are_kept_and_written() -> None:
    """A field a kind does not declare (a newer writer's) is kept in the mapping and written back."""
    event = raw_event(EventKind.CLOSED, 1, "e", 0, {"state": "awake", "future": [1]})
    assert event.data["future"] == (1,) and event.to_dict()["data"] == {"state": "awake", "future": [1]}


def test_every_kind_has_one_payload_class() -> None:
    """PAYLOADS maps every kind to a Payload subclass that names that kind."""
    assert set(PAYLOADS) == set(EventKind)
    for kind, cls in PAYLOADS.items():
        assert issubclass(cls, Payload) and cls.kind == kind and isinstance(cls(), Mapping)


def test_a_bad_payload_class_is_refused_when_defined() -> None:
    """A payload class without a kind, with a field named like a mapping method, or a mutable default fails."""
    with pytest.raises(TypeError, match="names no event kind"):
        type("NoKind", (Payload,), {})
    with pytest.raises(TypeError, match="mapping method"):
        type("Shadow", (Payload,), {"__annotations__": {"items": int}}, kind="x")
    with pytest.raises(TypeError, match="immutable"):
        type("Mutable", (Payload,), {"__annotations__": {"xs": list}, "xs": []}, kind="x")
    with pytest.raises(TypeError, match="evaluated"):
        type("Lazy", (Payload,), {"__annotations__": {"x": "int"}}, kind="x")
