"""The torpor sleep backend in a multi-rank vLLM engine: it joins a group, and vLLM's executor and torpor agree after a group failure.

vLLM's own ``Executor.sleep`` / ``wake_up`` (from the installed vLLM) drive
two workers (threads here, each with its own controller and FakeMemory),
through a ``collective_rpc`` that calls every worker at once and raises the
first error, as vLLM's executors do.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.executor.abstract import Executor  # noqa: E402

from torpor.errors import GroupFailed  # noqa: E402
from torpor.hooks.vllm import backend  # noqa: E402
from torpor.statemachine import SleepController, State  # noqa: E402
from torpor.statemachine.machine.localgroup import LocalGroup  # noqa: E402
from torpor.testing import FakeMemory  # noqa: E402

TAGS = {"weights": 100, "kv_cache": 50, "cudagraph": 10}


class _Executor:
    """vLLM's executor logic (its own functions) over torpor backends, one per worker."""

    sleep = Executor.sleep
    wake_up = Executor.wake_up
    is_sleeping = Executor.is_sleeping

    def __init__(self, workers: list[Any]) -> None:
        self.sleeping_tags: set[str] = set()
        self.workers = workers

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        calls = {"sleep": "suspend", "wake_up": "resume"}
        errors: list[BaseException | None] = [None] * len(self.workers)

        def run(rank: int) -> None:
            try:
                getattr(self.workers[rank], calls[method])(*args, **(kwargs or {}))
            except Exception as exc:
                errors[rank] = exc

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for error in errors:
            if error is not None:
                raise error


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Two workers' backends, each joined (through join_engine_group) to a two-rank group."""
    members = LocalGroup.make(2, name="vllm")
    mems = [FakeMemory(TAGS) for _ in range(2)]
    ctls = [SleepController(m, engine="vllm", rank=r) for r, m in enumerate(mems)]
    made = iter(range(2))
    current: dict[str, int] = {}

    def require(what: str) -> SleepController:
        current["rank"] = next(made)
        return ctls[current["rank"]]

    monkeypatch.setattr(backend, "require_controller", require)
    monkeypatch.setattr(
        backend, "engine_group", lambda: SimpleNamespace(world_size=2, cpu_group=members[current["rank"]])
    )
    monkeypatch.delenv(backend.ENV_GROUP, raising=False)
    monkeypatch.setenv(backend.ENV_GROUP_TIMEOUT, "10")
    workers = [backend.TorporSleepBackend(), backend.TorporSleepBackend()]
    return SimpleNamespace(ctls=ctls, mems=mems, executor=_Executor(workers))


def test_the_backend_joins_a_group_when_the_engine_has_more_than_one_rank(engine: Any) -> None:
    """Each worker's controller is in the engine's group, with the timeout from TORPOR_GROUP_TIMEOUT."""
    for rank, ctl in enumerate(engine.ctls):
        assert ctl.group is not None
        assert (ctl.group.agreement.rank, ctl.group.agreement.size) == (rank, 2)
        assert ctl.group.timeout == 10.0


def test_one_rank_the_backend_stays_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one rank, or TORPOR_GROUP=0, the controller joins no group."""
    ctl = SleepController(FakeMemory(TAGS))
    monkeypatch.setattr(backend, "engine_group", lambda: SimpleNamespace(world_size=1, cpu_group=None))
    assert not backend.join_engine_group(ctl)
    monkeypatch.setattr(backend, "engine_group", lambda: SimpleNamespace(world_size=2, cpu_group=LocalGroup.make(2)[0]))
    monkeypatch.setenv(backend.ENV_GROUP, "0")
    assert not backend.join_engine_group(ctl)
    assert ctl.group is None


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "ten"])
def test_an_invalid_group_timeout_in_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """TORPOR_GROUP_TIMEOUT that is not a usable number of seconds is a ValueError naming it when the group is joined."""
    ctl = SleepController(FakeMemory(TAGS))
    monkeypatch.setattr(backend, "engine_group", lambda: SimpleNamespace(world_size=2, cpu_group=LocalGroup.make(2)[0]))
    monkeypatch.delenv(backend.ENV_GROUP, raising=False)
    monkeypatch.setenv(backend.ENV_GROUP_TIMEOUT, value)
    with pytest.raises(ValueError, match="TORPOR_GROUP_TIMEOUT"):
        backend.join_engine_group(ctl)
    assert ctl.group is None


def test_executor_and_torpor_agree_after_a_failed_sleep_and_the_retry_succeeds(engine: Any) -> None:
    """Rank 1's backup fails: vLLM's executor is not sleeping and every rank is awake; vLLM's retry puts all to sleep."""
    ex = engine.executor
    engine.mems[1].fail_once("backup")
    with pytest.raises(GroupFailed) as info:
        ex.sleep(1)
    assert list(info.value.ranks) == [1]
    assert not ex.is_sleeping
    assert [c.state for c in engine.ctls] == [State.AWAKE] * 2
    ex.sleep(1)
    assert ex.is_sleeping
    assert [c.state for c in engine.ctls] == [State.ASLEEP_L1] * 2


def test_executor_and_torpor_agree_after_a_failed_wake_and_the_retry_succeeds(engine: Any) -> None:
    """Rank 0's restore fails: vLLM still counts every tag asleep and so does every rank; vLLM's retry wakes all."""
    ex = engine.executor
    ex.sleep(1)
    engine.mems[0].fail_once("restore", "weights")
    with pytest.raises(GroupFailed):
        ex.wake_up(["weights"])
    assert ex.sleeping_tags == {"weights", "kv_cache"}
    assert [c.state for c in engine.ctls] == [State.ASLEEP_L1] * 2
    ex.wake_up(["weights"])
    assert ex.sleeping_tags == {"kv_cache"}
    assert [c.state for c in engine.ctls] == [State.PARTIALLY_AWAKE] * 2
    ex.wake_up(["kv_cache"])
    assert not ex.is_sleeping
    assert [c.state for c in engine.ctls] == [State.AWAKE] * 2


@pytest.mark.parametrize("value", ["off", "false", " OFF "])
def test_torpor_group_off_reads_as_every_switch(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """TORPOR_GROUP=off or false keeps the controller out of the group as 0 does (only 0 did; off read as on)."""
    ctl = SleepController(FakeMemory(TAGS))
    monkeypatch.setattr(backend, "engine_group", lambda: SimpleNamespace(world_size=2, cpu_group=LocalGroup.make(2)[0]))
    monkeypatch.setenv(backend.ENV_GROUP, value)
    assert not backend.join_engine_group(ctl)
    assert ctl.group is None


def test_a_torpor_group_typo_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORPOR_GROUP=maybe is a BadSetting naming the variable, not read as on; no group is joined."""
    from torpor.errors import BadSetting

    ctl = SleepController(FakeMemory(TAGS))
    monkeypatch.setattr(backend, "engine_group", lambda: SimpleNamespace(world_size=2, cpu_group=LocalGroup.make(2)[0]))
    monkeypatch.setenv(backend.ENV_GROUP, "maybe")
    with pytest.raises(BadSetting, match="TORPOR_GROUP='maybe' is not a switch"):
        backend.join_engine_group(ctl)
    assert ctl.group is None
