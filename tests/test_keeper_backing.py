"""An engine's keeper backing: backups written straight into keeper memory, published and retracted, and every fallback."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from keeper_process import NOBODY, needs_root, running_keeper, shared_tmp, squatter
from prometheus_client import CollectorRegistry
from support import RigMaker

from torpor import EventKind
from torpor.allocator.host.offload import HostPolicy
from torpor.keeper import KeeperBacking, KeeperLink, ModelIdentity, TensorSpec, attach
from torpor.keeper.collector import KeeperCollector
from torpor.statemachine.core.events import Event
from torpor.units import MiB


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A keeper process (1 GiB budget) and its socket."""
    sock = tmp_path / "k" / "keeper.sock"
    with running_keeper(sock) as proc:
        yield sock, proc


class Engine:
    """Tensors on the simulated device, a controller, and a keeper backing tracking them."""

    def __init__(
        self, make_rig: RigMaker, sock: Path, engine: str = "e", *, reuse_host: bool = False, keep: bool = True
    ) -> None:
        host = HostPolicy(chunk_bytes=2 * MiB, keep_after_wake=keep)
        rig = make_rig("cuda_like", capacity=512 * MiB, reuse_host=reuse_host, host=host)
        self.alloc = rig.allocator
        self.ctl = rig.control()
        self.backing: KeeperBacking = attach(self.alloc, self.ctl, keeper=sock, engine=engine)
        self.data: dict[str, tuple[int, bytes]] = {}
        self.rng = random.Random(1)

    def add(self, name: str, nbytes: int) -> None:
        data = self.rng.randbytes(nbytes)
        address = self.alloc.allocate(nbytes, tag="weights")
        self.alloc.write(address, data)
        self.data[name] = (address, data)
        specs = [TensorSpec(n, (len(d),), "uint8", len(d)) for n, (_, d) in self.data.items()]
        self.backing.track(ModelIdentity.of("m", specs), {n: a for n, (a, _) in self.data.items()})

    def check(self) -> None:
        for name, (address, data) in self.data.items():
            assert self.alloc.read(address, len(data)) == data, name


def test_a_sleep_backs_up_into_keeper_memory_and_a_wake_retracts(
    keeper: tuple[Path, subprocess.Popen[str]], make_rig: RigMaker
) -> None:
    """Every host byte the sleep holds is a keeper region (no copy beside it); the wake retracts the backup."""
    sock, _ = keeper
    e = Engine(make_rig, sock)
    e.add("a", 3 * MiB + 5)
    e.add("b", 6 * MiB)
    e.ctl.sleep(1)
    assert e.backing.backup is not None and e.backing.fallbacks == 0
    assert e.backing.kept_bytes == e.alloc.pinned_bytes() > 0
    with KeeperLink(sock) as link:
        state = link.status()
        assert [b["backup"] for b in state["backups"]] == [e.backing.backup]
        assert state["backups"][0]["tags"] == ["weights"] and state["used"] == e.backing.kept_bytes
        e.ctl.wake()
        e.check()
        assert link.status()["backups"] == []
        e.ctl.sleep(1)  # the chunks kept after the wake are keeper memory still: published again
        assert len(link.status()["backups"]) == 1
    e.ctl.wake()
    e.check()


def test_the_keeper_killed_mid_sleep_leaves_the_engine_correct(
    keeper: tuple[Path, subprocess.Popen[str]], caplog: pytest.LogCaptureFixture, make_rig: RigMaker
) -> None:
    """SIGKILL to the keeper as a sleep begins: old regions stay mapped, new backups use the engine's memory; no byte lost."""
    sock, proc = keeper
    e = Engine(make_rig, sock)
    e.add("a", 4 * MiB)
    e.ctl.sleep(1)
    e.ctl.wake()
    e.add("b", 8 * MiB)  # the next sleep needs more host memory than the keeper's regions hold

    def kill(event: Event) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    unsubscribe = e.ctl.subscribe(kill, [EventKind.SLEEP_REQUESTED])
    with caplog.at_level(logging.WARNING, logger="torpor.keeper"):
        e.ctl.sleep(1)
    unsubscribe()
    e.ctl.wake()
    e.check()
    assert e.backing.gone is not None and e.backing.fallbacks >= 1 and e.backing.backup is None
    assert "the keeper is gone" in caplog.text and "the backups already written are intact" in caplog.text
    for _ in range(2):  # later cycles go on without a keeper
        e.ctl.sleep(1)
        e.ctl.wake()
        e.check()


def test_a_keeper_over_budget_leaves_the_backup_in_the_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_rig: RigMaker
) -> None:
    """A sleep the keeper's budget cannot hold completes in the engine's own memory, and says the backup is not kept."""
    sock = tmp_path / "k" / "keeper.sock"
    with running_keeper(sock, budget="4M"):
        e = Engine(make_rig, sock)
        e.add("a", 6 * MiB)
        with caplog.at_level(logging.WARNING, logger="torpor.keeper"):
            e.ctl.sleep(1)
        assert e.backing.fallbacks >= 1 and e.backing.backup is None and e.backing.gone is None
        assert "the keeper's budget is 4.00 MiB, 0 B are held and" in caplog.text
        assert "not kept across a crash" in caplog.text and "backup is not kept by the keeper" in caplog.text
        e.ctl.wake()
        e.check()


def test_no_keeper_changes_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_rig: RigMaker
) -> None:
    """attach() to a socket nobody serves: backups in the engine's own memory, each range counted, the log says why."""
    with caplog.at_level(logging.WARNING, logger="torpor.keeper"):
        e = Engine(make_rig, tmp_path / "nobody" / "keeper.sock")
    assert e.backing.gone is not None and "no keeper answers" in e.backing.gone
    assert "host backups stay in this process's memory" in caplog.text
    assert e.alloc.host_provider is e.backing  # backing nothing, so that telemetry sees the keeper down
    e.add("a", 3 * MiB)
    e.ctl.sleep(1)
    assert e.backing.fallbacks >= 1 and e.backing.kept_bytes == 0 and e.backing.backup is None
    e.ctl.wake()
    e.check()


@needs_root
def test_a_sleep_never_writes_into_another_users_keeper(caplog: pytest.LogCaptureFixture, make_rig: RigMaker) -> None:
    """Another user listens where the engine looks for its keeper: attach() refuses it, the sleep stays in-process."""
    with shared_tmp() as base, squatter(base / f"torpor-keeper-{os.getuid()}") as squat:
        with caplog.at_level(logging.WARNING, logger="torpor.keeper"):
            e = Engine(make_rig, squat.path)
        e.add("a", 3 * MiB)
        e.ctl.sleep(1)
        e.ctl.wake()
    assert squat.heard == [], f"the other user's keeper heard {squat.heard}"
    assert e.backing.gone is not None and f"refused the keeper at {squat.path}" in e.backing.gone
    assert f"owner found: uid {NOBODY}; expected: uid {os.getuid()}" in caplog.text
    assert e.backing.kept_bytes == 0 and e.backing.fallbacks >= 1
    e.check()


def test_ranges_given_back_are_cut_out_even_where_addresses_are_reused(
    keeper: tuple[Path, subprocess.Popen[str]],
    make_rig: RigMaker,
) -> None:
    """Chunks unpinned after each wake leave the keeper's records at once; reused addresses never confuse a region."""
    sock, _ = keeper
    e = Engine(make_rig, sock, reuse_host=True, keep=False)
    e.add("a", 5 * MiB)
    e.add("b", 3 * MiB)
    with KeeperLink(sock) as link:
        for i in range(4):
            e.ctl.sleep(1)
            assert e.backing.backup is not None and e.backing.kept_bytes == e.alloc.pinned_bytes()
            e.ctl.wake()
            e.check()
            e.alloc.wait_host_unpinned(10)
            assert e.backing.kept_bytes == e.alloc.pinned_bytes(), i
            e.add(f"c{i}", MiB)
        deadline = time.monotonic() + 10
        while link.status()["used"] != e.backing.kept_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.status()["used"] == e.backing.kept_bytes


def test_metrics_count_keeper_bytes(keeper: tuple[Path, subprocess.Popen[str]], make_rig: RigMaker) -> None:
    """KeeperCollector exports the bytes in keeper regions, the backup published, and that the keeper is up."""
    sock, _ = keeper
    e = Engine(make_rig, sock, engine="m")
    e.add("a", 3 * MiB)
    registry = CollectorRegistry()
    registry.register(KeeperCollector(e.backing))
    e.ctl.sleep(1)
    assert registry.get_sample_value("torpor_keeper_host_bytes", {"engine": "m"}) == e.backing.kept_bytes > 0
    assert registry.get_sample_value("torpor_keeper_backup_bytes", {"engine": "m"}) == 3 * MiB
    assert registry.get_sample_value("torpor_keeper_up", {"engine": "m"}) == 1
    assert registry.get_sample_value("torpor_keeper_fallbacks_total", {"engine": "m"}) == 0
    e.ctl.wake()
    assert registry.get_sample_value("torpor_keeper_backup_bytes", {"engine": "m"}) == 0


def test_keeper_collector_beside_torpors_telemetry_is_refused(
    keeper: tuple[Path, subprocess.Popen[str]], make_rig: RigMaker
) -> None:
    """KeeperCollector on a registry where torpor's telemetry exposes the controller is refused: one source per series."""
    from torpor.telemetry import attach as expose

    sock, _ = keeper
    e = Engine(make_rig, sock, engine="dup")
    registry = CollectorRegistry()
    expose(e.ctl, registry=registry, otel=False, multiprocess=False)
    with pytest.raises(ValueError, match="torpor_keeper_host_bytes"):
        registry.register(KeeperCollector(e.backing))
