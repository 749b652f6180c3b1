"""Tests of the capture vocabulary: capture observers and capture handles."""

from __future__ import annotations

import pickle

from torpor.graphcapture import CaptureHandle, CaptureObservers


class Graph:
    """A stand-in for a CUDAGraph (weak-referenceable)."""


def test_observers_are_called_and_a_failing_observer_is_contained() -> None:
    """Every observer gets the pool id; one raising does not stop the others; a removed one is not called."""
    seen: list[tuple[int, int]] = []

    def bad(_: tuple[int, int]) -> None:
        raise RuntimeError("boom")

    observers = CaptureObservers([bad])
    remove_seen = observers.add(seen.append)
    observers.add(seen.append)  # added twice: called once
    observers.notify((0, 7))
    observers.remove(bad)
    observers.notify((0, 8))
    remove_seen()
    observers.notify((0, 9))
    assert seen == [(0, 7), (0, 8)]


def test_handle_is_a_pool_id_tuple_that_records_graphs() -> None:
    """A CaptureHandle equals its pool id, prints a name, and track() records the graph under its site."""
    recorded: list[tuple[object, str]] = []
    handle = CaptureHandle((3, 4), "batch=8", lambda graph, site: recorded.append((graph, site)))
    assert handle == (3, 4) and handle.pool == (3, 4) and type(handle.pool) is tuple
    assert str(handle) == "cudagraph-pool-3.4"
    g = Graph()
    handle.track(g)
    assert recorded == [(g, "batch=8")]


def test_a_handle_pickles_as_its_plain_pool_id() -> None:
    """A pickled CaptureHandle comes back as the plain (int, int) pool id, without its recorder."""
    handle = CaptureHandle((5, 6), "s", lambda graph, site: None)
    back = pickle.loads(pickle.dumps(handle))  # noqa: S301  # our own bytes
    assert back == (5, 6) and type(back) is tuple
