"""Tests of torpor.hooks.capture: routing captures to the cuMem graph pool or the plain pool."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from support import RigMaker

from torpor.errors import InvalidTransition
from torpor.hooks import (
    CaptureRoutingError,
    add_graph_pool_hook,
    capture_pool,
    cudagraph_pool_decision,
    in_plain_capture,
    nccl_graph_pool_hook,
    plain_capture,
    remove_graph_pool_hook,
    reset_warnings,
    routes_to_cumem,
    set_nccl_graph_pool_hook,
)
from torpor.statemachine import EventKind, SleepController, State
from torpor.testing import FakeMemory, capture_events

ACTIVE = cudagraph_pool_decision(True, True, "torpor", True, "cuda")
INACTIVE = cudagraph_pool_decision(True, True, "torpor", False, "cuda")
PLAIN = ("plain-pool", 7)


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[list[object]]:
    reset_warnings()
    seen: list[object] = []
    previous = set_nccl_graph_pool_hook(seen.append)
    yield seen
    set_nccl_graph_pool_hook(previous)


@pytest.fixture
def nccl(_no_hook: list[object]) -> list[object]:
    return _no_hook


@pytest.fixture
def controller() -> SleepController:
    return SleepController(FakeMemory({"weights": 1 << 20, "kv_cache": 1 << 20}))


def test_active_routes_into_the_cumem_pool(controller: SleepController, nccl: list[object]) -> None:
    """Active: the capture goes through controller.capture, yields its pool and points NCCL at it."""
    with (
        capture_events(controller) as events,
        capture_pool(ACTIVE, "decode bs=8", controller=controller, plain_pool=PLAIN) as pool,
    ):
        assert pool == controller.memory.pool  # type: ignore[attr-defined]
        assert nccl == [pool]
    kinds = [e.kind for e in events]
    assert EventKind.GRAPH_CAPTURED in kinds
    assert controller.projection.graphs == ["decode bs=8"]


def test_inactive_yields_the_plain_pool(controller: SleepController, nccl: list[object]) -> None:
    """Inactive: the plain pool is yielded, NCCL is pointed at it, and the controller records no capture."""
    with (
        capture_events(controller) as events,
        capture_pool(INACTIVE, "decode", controller=controller, plain_pool=PLAIN) as pool,
    ):
        assert pool is PLAIN
    assert nccl == [PLAIN]
    assert events == []
    assert controller.projection.graphs == []


def test_plain_capture_escapes_the_cumem_pool(controller: SleepController, nccl: list[object]) -> None:
    """Inside plain_capture an active route yields the throwaway plain pool instead."""
    throwaway = object()
    with plain_capture():
        assert in_plain_capture()
        assert not routes_to_cumem(ACTIVE)
        with capture_pool(ACTIVE, "profile", controller=controller, plain_pool=throwaway) as pool:
            assert pool is throwaway
    assert not in_plain_capture()
    assert routes_to_cumem(ACTIVE)
    assert nccl == [throwaway]
    assert controller.projection.graphs == []


def test_plain_capture_nests_and_resets_on_error() -> None:
    """plain_capture nests, and its flag is reset even when the block raises."""
    with pytest.raises(RuntimeError), plain_capture():
        with plain_capture():
            pass
        assert in_plain_capture()
        raise RuntimeError("boom")
    assert not in_plain_capture()


def test_plain_capture_is_per_thread() -> None:
    """plain_capture in one thread does not affect captures in another."""
    seen: list[bool] = []
    entered, done = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait(5)
        seen.append(in_plain_capture())
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with plain_capture():
        entered.set()
        done.wait(5)
    thread.join(5)
    assert seen == [False]


def test_plain_capture_is_per_asyncio_task() -> None:
    """plain_capture in one task does not leak into a task running beside it."""

    async def profiler(gate: asyncio.Event) -> bool:
        with plain_capture():
            gate.set()
            await asyncio.sleep(0.01)
            return in_plain_capture()

    async def capturer(gate: asyncio.Event) -> bool:
        await gate.wait()
        return in_plain_capture()

    async def main() -> tuple[bool, bool]:
        gate = asyncio.Event()
        a, b = await asyncio.gather(profiler(gate), capturer(gate))
        return a, b

    assert asyncio.run(main()) == (True, False)


def test_capture_is_refused_while_asleep(controller: SleepController, nccl: list[object]) -> None:
    """An active route goes through the controller's guard: refused while asleep, NCCL not repointed."""
    controller.sleep(1)
    with pytest.raises(InvalidTransition, match="asleep_l1"), capture_pool(ACTIVE, "decode", controller=controller):
        pass
    assert nccl == []
    assert controller.state is State.ASLEEP_L1
    assert controller.projection.refusals == 1


def test_active_without_controller_is_refused() -> None:
    """An active route without a controller raises CaptureRoutingError naming the site."""
    with pytest.raises(CaptureRoutingError, match="'decode bs=1'"), capture_pool(ACTIVE, "decode bs=1"):
        pass


def test_inactive_needs_no_controller(nccl: list[object]) -> None:
    """An inactive route works without a controller (plain PyTorch with sleep mode off)."""
    with capture_pool(INACTIVE, "decode") as pool:
        assert pool is None
    assert nccl == [None]


def test_hook_registry_returns_the_previous_hook() -> None:
    """set_nccl_graph_pool_hook returns the previous hook; None restores the no-op."""
    first: list[object] = []
    old = set_nccl_graph_pool_hook(first.append)
    assert nccl_graph_pool_hook() == first.append
    assert set_nccl_graph_pool_hook(None) == first.append
    assert nccl_graph_pool_hook() is None
    with capture_pool(INACTIVE, "x", plain_pool=1):
        pass
    assert first == []
    set_nccl_graph_pool_hook(old)


def test_pool_is_shared_by_every_routed_capture(controller: SleepController) -> None:
    """Every routed capture uses the process's one graph pool, and a sleep/wake keeps it."""
    pools = []
    for site in ("full bs=1", "full bs=8", "piecewise"):
        with capture_pool(ACTIVE, site, controller=controller) as pool:
            pools.append(pool)
    controller.sleep(1)
    controller.wake()
    with capture_pool(ACTIVE, "after wake", controller=controller) as pool:
        pools.append(pool)
    assert len(set(pools)) == 1
    assert controller.projection.graphs == ["full bs=1", "full bs=8", "piecewise", "after wake"]


def test_routing_with_the_real_allocator_on_the_simulated_device(nccl: list[object], make_rig: RigMaker) -> None:
    """With TaggedAllocator (simulated driver) the route yields its capture handle, NCCL gets it, and a graph holds it."""
    from torpor.errors import PoolBusy

    allocator = make_rig("cuda_like", capacity=64 << 20).allocator
    with allocator.use_memory_pool("weights"):
        allocator.allocate(4 << 20)
    ctl = SleepController(allocator)

    class Graph:
        """Stands in for a CUDAGraph (held weakly by the pool)."""

    graph = Graph()
    with capture_pool(ACTIVE, "decode bs=4", controller=ctl, plain_pool=PLAIN) as pool:
        pool.track(graph)  # type: ignore[attr-defined]
        allocator.allocate(2 << 20)  # what the capture allocates lands in the graph pool
    assert nccl == [pool]
    assert str(pool) == ctl.projection.pool
    assert ctl.projection.residency["cudagraph"].resident == 2 << 20
    with pytest.raises(PoolBusy, match="decode bs=4"):
        ctl.release_cudagraph_pool()
    ctl.sleep(1)
    assert ctl.projection.residency["cudagraph"].host == 2 << 20
    ctl.wake()
    del graph
    assert ctl.release_cudagraph_pool() == 2 << 20


def test_a_tagged_allocator_capture_points_nccl_once_at_the_plain_pool_id(
    nccl: list[object], make_rig: RigMaker
) -> None:
    """Routed into a TaggedAllocator, the NCCL hook gets the pool id once, as a plain tuple (what NCCL takes)."""
    alloc = make_rig(capacity=16 << 20).allocator
    observed: list[tuple[int, int]] = []
    alloc.on_capture(observed.append)
    controller = SleepController(alloc)
    with capture_pool(ACTIVE, "decode bs=8", controller=controller) as pool:
        assert pool == alloc.cudagraph_pool_id()
    assert nccl == observed == [alloc.cudagraph_pool_id()]
    assert type(nccl[0]) is tuple and str(nccl[0]) == str(alloc.cudagraph_pool_id())
    alloc.close()


def test_further_hooks_run_for_every_route_and_a_failing_one_is_contained(
    controller: SleepController, nccl: list[object], caplog: pytest.LogCaptureFixture
) -> None:
    """add_graph_pool_hook hooks see cuMem and plain pools beside the NCCL slot; one that raises is logged, breaks nothing."""
    seen: list[object] = []

    def bad(_: object) -> None:
        raise RuntimeError("boom")

    remove_seen = add_graph_pool_hook(seen.append)
    add_graph_pool_hook(bad)
    try:
        with capture_pool(ACTIVE, "decode", controller=controller) as pool:
            pass
        with capture_pool(INACTIVE, "decode", plain_pool=PLAIN):
            pass
    finally:
        remove_seen()
        remove_graph_pool_hook(bad)
    with capture_pool(INACTIVE, "decode", plain_pool=PLAIN):
        pass
    assert seen == [pool, PLAIN]
    assert nccl == [pool, PLAIN, PLAIN]
    assert controller.projection.graphs == ["decode"]
    failed = [r for r in caplog.records if r.exc_info and "boom" in str(r.exc_info[1])]
    assert len(failed) == 2 and {r.name for r in failed} == {"torpor.hooks"}


def test_a_direct_allocator_capture_tells_only_its_own_observers(nccl: list[object], make_rig: RigMaker) -> None:
    """The NCCL hook is the integration's: capturing into an allocator directly calls that allocator's observers only."""
    first = make_rig(capacity=16 << 20).allocator
    second = make_rig(capacity=16 << 20).allocator
    told: list[tuple[int, int]] = []
    first.on_capture(told.append)
    with second.capture_into_pool("other"):
        pass
    with first.capture_into_pool("mine"):
        pass
    assert told == [first.cudagraph_pool_id()] and nccl == []
    first.close()
    second.close()
