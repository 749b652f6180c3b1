"""vLLM's Executor retrying sleep and wake on two simulated ranks, one failing once: the retry succeeds on both.

vLLM's ``Executor.sleep``/``wake_up`` send the call to every rank and mark the
engine asleep (or awake) only when every rank succeeded; ``EngineCore.wake_up``
resumes the scheduler when the executor says nothing sleeps. So after one rank
fails the orchestrator repeats the call on all ranks, and a rank where it had
succeeded must accept the repeat. This drives vLLM's own ``Executor``,
``Worker.sleep``/``Worker.wake_up`` and ``EngineCore.wake_up`` code, with each
rank's torpor backend on its own simulated device.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

import test_vllm_backend  # noqa: E402
from support import model_less_worker  # noqa: E402
from test_vllm_backend import torpor_model_config, write_pattern  # noqa: E402

from torpor.allocator import SimDriver, TaggedAllocator  # noqa: E402
from torpor.errors import OutOfMemory  # noqa: E402
from torpor.hooks.vllm import facade  # noqa: E402
from torpor.statemachine import EventKind, read_events, replay  # noqa: E402
from torpor.units import MiB  # noqa: E402

gpu_worker = pytest.importorskip("vllm.v1.worker.gpu_worker")
engine = test_vllm_backend.engine  # the fixture: torpor active on a simulated device, vLLM's platform as CUDA

RANKS = 2


class Rank(SimpleNamespace):
    """One simulated rank: its device, torpor allocator, vLLM Worker, and the bytes written to each tag."""

    driver: SimDriver
    allocator: facade.TorporMemAllocator
    worker: Any
    content: dict[str, tuple[int, bytes]]
    current: list[int]  # shared by all ranks: the rank whose call runs now (what the device calls answer for)


@pytest.fixture
def ranks(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Rank]]:
    """Two ranks, each a vLLM Worker whose torpor backend runs on its own simulated device."""
    import torch

    model_config = torpor_model_config(engine.tmp)
    model_config.enable_cumem_allocator = True
    out: list[Rank] = []
    current = [0]
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)

    def memory_info(*args: Any) -> tuple[int, int]:  # vLLM's Worker.sleep checks that free memory did not drop
        driver = out[current[0]].driver
        return driver.capacity - driver.used, driver.capacity

    monkeypatch.setattr(torch.accelerator, "get_memory_info", memory_info)
    try:
        for rank in range(RANKS):
            driver = SimDriver(capacity=256 * MiB)
            allocator = facade.TorporMemAllocator(
                TaggedAllocator(driver), log_dir=engine.logs, engine="vllm", rank=rank, fsync=False
            )
            facade.configure(allocator)  # what get_instance() answers in this rank's process
            worker = model_less_worker(model_config, monkeypatch)
            worker.sleep_mode_backend  # noqa: B018 - the backend binds to this rank's controller now
            content = {}
            for seed, (tag, size) in enumerate((("weights", 8 * MiB), ("kv_cache", 16 * MiB), ("runtime", 2 * MiB))):
                with allocator.use_memory_pool(tag):
                    address = allocator.memory.allocate(size)
                content[tag] = (address, write_pattern(allocator.memory, address, size, seed + 10 * rank))
            out.append(Rank(driver=driver, allocator=allocator, worker=worker, content=content, current=current))
        facade.configure(engine.allocator)
        yield out
    finally:
        for rank_ in out:
            rank_.allocator.release_pools()


def _executor(ranks: list[Rank]) -> Any:
    """vLLM's Executor (its sleep/wake_up/is_sleeping), with a collective_rpc that calls each rank in turn."""
    from vllm.v1.executor.abstract import Executor

    class TwoRanks(Executor):
        def _init_executor(self) -> None:
            self.calls: list[str] = []

        def collective_rpc(  # type: ignore[override]
            self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None, **_: Any
        ) -> list[Any]:
            """Every rank runs the call; a rank's failure fails the call after all ranks ran (as vLLM's executors)."""
            results, errors = [], []
            for rank in ranks:
                rank.current[0] = ranks.index(rank)
                try:
                    results.append(getattr(rank.worker, method)(*args, **(kwargs or {})))
                except Exception as exc:  # a rank's error comes back to the caller
                    errors.append(exc)
            if errors:
                raise errors[0]
            return results

        def check_health(self) -> None:
            """Healthy."""

    config = SimpleNamespace(
        model_config=ranks[0].worker.model_config,
        cache_config=None,
        lora_config=None,
        load_config=None,
        parallel_config=None,
        scheduler_config=None,
        device_config=None,
        speculative_config=None,
        observability_config=None,
    )
    return TwoRanks(config)  # type: ignore[arg-type]


def _bytes_intact(rank: Rank, tags: tuple[str, ...]) -> bool:
    memory = rank.allocator.memory
    return all(memory.read(address, len(data)) == data for address, data in (rank.content[t] for t in tags))


def _engine_core(executor: Any, ranks: list[Rank], resumed: list[bool]) -> Any:
    """What vLLM's EngineCore.wake_up reads and calls; resuming checks that every rank's weights are mapped."""

    def resume_scheduler() -> None:
        for rank in ranks:
            assert rank.allocator.controller.state.value == "awake", "scheduler resumed with a rank asleep"
            assert _bytes_intact(rank, ("weights",)), "scheduler resumed on unmapped weights"
        resumed.append(True)

    return SimpleNamespace(
        model_executor=executor, resume_scheduler=resume_scheduler, _set_kv_connector_handshake_metadata=lambda: None
    )


def test_sleep_retried_after_one_rank_failed(ranks: list[Rank]) -> None:
    """Rank 1's sleep fails once: the executor's retry is a no-op on rank 0 and a sleep on rank 1; then a wake resumes."""
    from vllm.v1.engine.core import EngineCore

    executor = _executor(ranks)
    ranks[1].driver.fail("unmap", nth=2)  # releasing rank 1's second tag fails: its sleep rolls back
    with pytest.raises(Exception, match="unmap"):
        executor.sleep(1)
    assert not executor.is_sleeping  # vLLM counts the sleep as not done
    assert ranks[0].allocator.controller.state.value == "asleep_l1"
    assert ranks[1].allocator.controller.state.value == "awake"
    executor.sleep(1)  # the orchestrator retries on every rank
    assert executor.is_sleeping
    assert [r.allocator.controller.state.value for r in ranks] == ["asleep_l1", "asleep_l1"]
    assert all(r.driver.used == 0 for r in ranks)
    repeated = [e for e in ranks[0].allocator.controller.events() if e.kind is EventKind.COMMAND_REPEATED]
    assert [(e.data["command"], e.data["args"]["level"]) for e in repeated] == [("sleep", 1)]
    resumed: list[bool] = []
    assert EngineCore.wake_up(_engine_core(executor, ranks, resumed), None) is True
    assert resumed == [True]
    for rank in ranks:
        assert _bytes_intact(rank, ("weights", "runtime"))
        path = rank.allocator.controller.log.path  # type: ignore[union-attr]
        assert replay(path).to_dict() == rank.allocator.controller.projection.to_dict()


def test_wake_retried_after_one_rank_ran_out_of_memory(ranks: list[Rank]) -> None:
    """RL wake: rank 1 runs out of memory mapping kv_cache once; the retry is a no-op on rank 0 and maps rank 1."""
    from vllm.v1.engine.core import EngineCore

    executor = _executor(ranks)
    executor.sleep(1)
    resumed: list[bool] = []
    core = _engine_core(executor, ranks, resumed)
    assert EngineCore.wake_up(core, ["weights"]) is False  # weights first (new weights are pushed here)
    ranks[1].driver.fail("create", oom=True, reason="a trainer still holds the GPU")
    with pytest.raises(OutOfMemory, match="trainer"):
        EngineCore.wake_up(core, ["kv_cache"])
    assert executor.is_sleeping and resumed == []  # vLLM does not resume: kv_cache still sleeps somewhere
    assert ranks[0].allocator.controller.state.value == "awake"
    assert ranks[1].allocator.controller.state.value == "partially_awake"
    assert EngineCore.wake_up(core, ["kv_cache"]) is True  # the retry, on every rank
    assert resumed == [True]
    assert [r.allocator.controller.state.value for r in ranks] == ["awake", "awake"]
    for rank in ranks:
        assert _bytes_intact(rank, ("weights", "runtime"))
        events = list(read_events(rank.allocator.controller.log.path))  # type: ignore[union-attr]
        assert [e.data["command"] for e in events if e.kind is EventKind.COMMAND_REPEATED] == (
            ["wake"] if rank is ranks[0] else []
        )
        assert EventKind.REFUSED not in {e.kind for e in events}
