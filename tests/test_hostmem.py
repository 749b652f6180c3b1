"""Tests of the controller's host-memory policy (pin ahead or at sleep, keep or release after wake, budget) and device reporting."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import RigMaker

from torpor import HostBudgetExceeded, SleepController, State
from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.errors import TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.policy import Action, AfterWake, HostMemoryPolicy, PinWhen, Policy
from torpor.statemachine.core.protocol import Abilities
from torpor.statemachine.log.reader import read_events, replay
from torpor.statemachine.machine.hostmem import HostSide, budget_refusal
from torpor.statemachine.projection.view import Projection
from torpor.testing import FakeMemory
from torpor.testrig import GRANULE as G
from torpor.testrig import fill
from torpor.units import MiB

OVERHEAD = 3 * MiB


def test_default_pins_nothing_until_the_first_sleep_and_keeps_it_after_wake(make_rig: RigMaker) -> None:
    """At-sleep + keep: no pinned bytes while awake before the first sleep, the backup's bytes after it, kept after wake."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy()))
    data = fill(rig.allocator, "weights", [4 * G] * 4)
    assert rig.allocator.wait_host_ready(5) and rig.allocator.pinned_bytes() == 0
    ctl.sleep(1)
    assert ctl.projection.pinned_bytes == rig.allocator.pinned_bytes() == 16 * G
    ctl.wake()
    assert all(rig.allocator.read(a, len(b)) == b for a, b in data.items())
    assert rig.allocator.pinned_bytes() == 16 * G and ctl.projection.pinned_bytes == 16 * G


def test_ahead_pins_before_the_first_sleep(make_rig: RigMaker) -> None:
    """Pin-ahead: the controller turns pinning ahead on, and tagged memory is pinned before any sleep."""
    rig = make_rig("with_context")
    rig.control(policy=Policy(host=HostMemoryPolicy(pin=PinWhen.AHEAD)))
    fill(rig.allocator, "weights", [4 * G] * 4)
    assert rig.allocator.wait_host_ready(10)
    assert rig.allocator.pinned_bytes() == 16 * G == rig.driver.host_used


def test_release_gives_host_memory_back_after_wake(make_rig: RigMaker) -> None:
    """Release after wake: the wake's event says what it gives back, and nothing stays pinned once that is done."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy(after_wake=AfterWake.RELEASE)))
    data = fill(rig.allocator, "weights", [4 * G] * 4)
    for _ in range(2):
        ctl.sleep(1)
        assert rig.allocator.pinned_bytes() == 16 * G
        ctl.wake()
        assert all(rig.allocator.read(a, len(b)) == b for a, b in data.items())
        woke = [e for e in ctl.events() if e.kind is EventKind.WAKE_COMPLETED][-1]
        assert woke.data["host_released"] == 16 * G and woke.data["pinned"] == 0
        assert rig.allocator.wait_host_unpinned(10)
        assert rig.driver.host_used == 0 and rig.driver.host_reserved == 0


def test_over_budget_sleep_is_refused_before_anything_is_touched(tmp_path: Path, make_rig: RigMaker) -> None:
    """A sleep whose backups pass the budget raises HostBudgetExceeded naming bytes and budget; nothing is copied or released."""
    rig = make_rig("with_context")
    ctl = rig.control(log=tmp_path / "events.jsonl", policy=Policy(host=HostMemoryPolicy(budget_bytes=8 * G)))
    data = fill(rig.allocator, "weights", [4 * G] * 4)
    calls = len(rig.driver.calls)
    with pytest.raises(HostBudgetExceeded, match=r"need 1048576 bytes .* host budget is 524288 bytes") as err:
        ctl.sleep(1)
    assert err.value.needed == 16 * G and err.value.budget == 8 * G
    assert "weights to offload: 1048576 bytes" in err.value.holders
    assert ctl.state is State.AWAKE
    assert rig.driver.calls[calls:] == []  # no driver call at all
    assert rig.allocator.usage()["weights"].resident == 16 * G and rig.allocator.pinned_bytes() == 0
    assert all(rig.allocator.read(a, len(b)) == b for a, b in data.items())
    refused = [e for e in ctl.events() if e.kind is EventKind.REFUSED][-1]
    assert refused.data["error"] == "HostBudgetExceeded" and refused.data["holders"]
    assert replay(tmp_path / "events.jsonl").state is State.AWAKE


def test_budget_counts_backups_of_tags_still_asleep(make_rig: RigMaker) -> None:
    """Partially awake, a second sleep's budget includes the backup of the tag left asleep, and the error names it."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy(budget_bytes=20 * G)))
    fill(rig.allocator, "weights", [4 * G] * 4)
    fill(rig.allocator, "runtime", [4 * G])
    ctl.sleep(1)
    ctl.wake(["runtime"])  # weights stay asleep on the host
    assert ctl.state is State.PARTIALLY_AWAKE
    fill(rig.allocator, "runtime", [4 * G])
    with pytest.raises(HostBudgetExceeded, match="backups already hold 1048576") as err:
        ctl.sleep(1)
    assert "backup of weights (asleep): 1048576 bytes" in err.value.holders
    assert ctl.state is State.PARTIALLY_AWAKE


def test_level_two_fits_a_budget_level_one_does_not(make_rig: RigMaker) -> None:
    """Level 2 discards weights, so it needs only the small tags' backups and fits where level 1 was refused."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy(budget_bytes=4 * G)))
    fill(rig.allocator, "weights", [4 * G] * 4)
    fill(rig.allocator, "runtime", [4 * G])
    with pytest.raises(HostBudgetExceeded):
        ctl.sleep(1)
    ctl.sleep(2)
    assert ctl.state is State.ASLEEP_L2 and rig.allocator.pinned_bytes() <= 4 * G


def test_sleep_records_what_stays_on_the_device(make_rig: RigMaker) -> None:
    """sleep_completed carries device memory in use while asleep, split into torpor's tags and the rest."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy()))
    fill(rig.allocator, "weights", [4 * G] * 4)
    fill(rig.allocator, "kv_cache", [4 * G] * 2)
    ctl.sleep(1)
    done = [e for e in ctl.events() if e.kind is EventKind.SLEEP_COMPLETED][-1]
    assert done.data["device"] == {"total": 64 * MiB, "in_use": OVERHEAD, "tagged": 0, "untagged": OVERHEAD}
    assert ctl.projection.device_asleep["untagged"] == OVERHEAD
    assert Projection.from_dict(ctl.projection.to_dict()).device_asleep == ctl.projection.device_asleep


def test_workspace_is_discarded_by_default(make_rig: RigMaker) -> None:
    """The workspace tag is discarded at level 1 (not copied to the host) and comes back mapped, fresh."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy()))
    fill(rig.allocator, "workspace", [4 * G] * 2)
    ctl.sleep(1)
    released = [e for e in ctl.events() if e.kind is EventKind.TAG_RELEASED]
    assert [(e.data["tag"], e.data["action"]) for e in released] == [("workspace", "discard")]
    assert rig.allocator.pinned_bytes() == 0
    ctl.wake()
    assert rig.allocator.usage()["workspace"].resident == 8 * G


def test_opened_event_records_the_host_policy(make_rig: RigMaker) -> None:
    """The controller records its host-memory policy when it opens; the projection keeps it."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy(pin=PinWhen.AHEAD, budget_bytes=MiB)))
    assert ctl.projection.host_policy == {"pin": "ahead", "after_wake": "keep", "budget_bytes": MiB}


def test_policy_from_the_environment_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a host policy the controller reads TORPOR_HOST_*; a malformed value is refused when it starts."""
    monkeypatch.setenv("TORPOR_HOST_BUDGET", "2MiB")
    ctl = SleepController(FakeMemory({"weights": 1 << 20}))
    assert ctl.host_policy.budget_bytes == 2 * MiB
    monkeypatch.setenv("TORPOR_HOST_AFTER_WAKE", "sometimes")
    with pytest.raises(ValueError, match="TORPOR_HOST_AFTER_WAKE"):
        SleepController(FakeMemory({"weights": 1 << 20}))


@pytest.mark.parametrize("budget", ["11111111111111111111T", "9" * 400, "9223372036854775808", "8388608.5T"])
def test_a_budget_the_log_cannot_record_is_refused_at_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, budget: str
) -> None:
    """A budget over 2**63-1 bytes (what the log records and reads) is a ValueError when the controller starts, never later."""
    monkeypatch.setenv("TORPOR_HOST_BUDGET", budget)
    with pytest.raises(ValueError, match=r"TORPOR_HOST_BUDGET.*2\*\*63-1"):
        SleepController(FakeMemory({"weights": 1 << 20}), tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match=r"2\*\*63-1"):
        HostMemoryPolicy(budget_bytes=2**63)


def test_the_largest_budget_is_written_and_read_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A budget of exactly 2**63-1 bytes is accepted, recorded in every sleep_completed, and replayed by a restarted engine."""
    monkeypatch.setenv("TORPOR_HOST_BUDGET", str(2**63 - 1))
    path = tmp_path / "e.jsonl"
    ctl = SleepController(FakeMemory({"weights": 1 << 20}), path)
    ctl.sleep(1)
    ctl.close()
    assert replay(path).state is State.ASLEEP_L1
    restarted = SleepController(FakeMemory({"weights": 1 << 20}), path)  # reads the log back
    assert restarted.last_seq == replay(path).last_seq >= 5
    assert [e.data["host_budget"] for e in read_events(path) if e.kind is EventKind.SLEEP_COMPLETED] == [2**63 - 1]
    restarted.close()


def test_memory_without_host_backups_or_reporting_is_left_alone() -> None:
    """A memory without host or device reporting gets no budget refusal below budget and a null device field."""
    memory = FakeMemory({"weights": 1 << 20})
    ctl = SleepController(memory, policy=Policy(host=HostMemoryPolicy(budget_bytes=2 << 20)))
    ctl.sleep(1)
    assert HostSide(Abilities.of(memory), HostMemoryPolicy()).device_report() is None
    done = [e for e in ctl.events() if e.kind is EventKind.SLEEP_COMPLETED][-1]
    assert done.data["device"] is None


def test_no_budget_never_refuses() -> None:
    """With no budget the check passes whatever the bytes."""
    assert budget_refusal(HostMemoryPolicy(), Projection(), {"weights": 1 << 50}) is None


# -- on the GPU (scripts/gpu-suite) --------------------------------------------------------------


def _gpu_weights(alloc: TaggedAllocator, mib: int) -> tuple[object, object]:
    """``mib`` MiB of random weights in 2 MiB and 64 MiB tensors under the weights tag; (tensors, their clones)."""
    import torch

    with alloc.use_memory_pool("weights"):
        ts = [
            torch.randint(0, 255, ((2 if i % 2 else 64) * MiB,), dtype=torch.uint8, device="cuda")
            for i in range(mib // 33)
        ]
    return ts, [t.clone() for t in ts]


@pytest.mark.gpu
def test_cold_first_sleep_on_the_gpu_is_bit_exact_with_and_without_huge_pages() -> None:
    """A first sleep with nothing pinned (staged, pinned after) wakes bit-exact; also with no huge pages nor MADV_POPULATE_WRITE."""
    import torch

    from torpor.allocator.native.cuda_driver import host_page_methods

    methods = host_page_methods()
    try:
        for fallback in (False, True):
            if fallback:  # as on a kernel without THP and before 5.14: 4 KiB pages, faulted in by writing zeros
                host_page_methods(huge_pages=False, populate=False)
            alloc = TaggedAllocator()
            ctl = SleepController(alloc, policy=Policy(host=HostMemoryPolicy()))
            ts, refs = _gpu_weights(alloc, 1024)
            torch.cuda.synchronize()
            assert alloc.pinned_bytes() == 0
            ctl.sleep(1)
            assert alloc.pinned_bytes() >= sum(t.numel() for t in ts)
            ctl.wake()
            assert all(bool(torch.equal(t, r)) for t, r in zip(ts, refs, strict=True)), f"fallback={fallback}"
            del ts, refs
            alloc.close()
    finally:
        host_page_methods(*methods)


@pytest.mark.gpu
def test_release_after_wake_on_the_gpu_unpins_and_sleeps_again_cold() -> None:
    """Release mode on the GPU: nothing pinned after a wake, and the next (cold again) sleep and wake stay bit-exact."""
    import torch

    alloc = TaggedAllocator()
    ctl = SleepController(alloc, policy=Policy(host=HostMemoryPolicy(after_wake=AfterWake.RELEASE)))
    ts, refs = _gpu_weights(alloc, 512)
    for _ in range(3):
        ctl.sleep(1)
        ctl.wake()
        assert alloc.wait_host_unpinned(60)
        assert alloc.pinned_bytes() == 0
        assert all(bool(torch.equal(t, r)) for t, r in zip(ts, refs, strict=True))
    del ts, refs
    alloc.close()


@pytest.mark.gpu
def test_over_budget_on_the_gpu_touches_nothing_and_level_two_fits() -> None:
    """Over the budget a sleep is refused with tensors intact and nothing pinned; a level-2 sleep (weights discarded) goes through."""
    import torch

    alloc = TaggedAllocator()
    ctl = SleepController(alloc, policy=Policy(host=HostMemoryPolicy(budget_bytes=256 * MiB)))
    ts, refs = _gpu_weights(alloc, 512)
    with alloc.use_memory_pool("runtime"):
        rt = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(HostBudgetExceeded, match="host budget is 268435456 bytes"):
        ctl.sleep(1)
    assert ctl.state is State.AWAKE and alloc.pinned_bytes() == 0
    assert all(bool(torch.equal(t, r)) for t, r in zip(ts, refs, strict=True))
    ctl.sleep(2)
    ctl.wake()
    assert bool((rt == 1).all())
    del ts, refs, rt
    alloc.close()


@pytest.mark.gpu
def test_sleep_on_the_gpu_reports_the_untagged_memory_that_stays() -> None:
    """Asleep on a GPU, the sleep event's device field shows no tagged bytes and the untagged rest (context, torch's pool)."""
    import torch

    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    ts, _ = _gpu_weights(alloc, 512)
    default_pool = torch.ones(256 * MiB, dtype=torch.uint8, device="cuda")  # torch's own allocator, untagged
    ctl.sleep(1)
    device = [e for e in ctl.events() if e.kind is EventKind.SLEEP_COMPLETED][-1].data["device"]
    assert device["tagged"] == 0
    assert device["untagged"] == device["in_use"] >= 256 * MiB  # at least torch's pool; plus the CUDA context
    free, total = torch.cuda.mem_get_info()
    assert device["total"] == total and abs(device["in_use"] - (total - free)) < 64 * MiB
    ctl.wake()
    del ts, default_pool
    alloc.close()


def test_release_mode_unpins_after_an_aborted_sleep_and_a_discard(make_rig: RigMaker) -> None:
    """In release mode, host memory pinned for a sleep that aborted, or for backups a discard dropped, is given back."""
    rig = make_rig("with_context")
    ctl = rig.control(policy=Policy(host=HostMemoryPolicy(after_wake=AfterWake.RELEASE)))
    fill(rig.allocator, "weights", [4 * G] * 4)
    rig.driver.fail("unmap")  # phase 2 fails: the sleep rolls back after the backup was made
    with pytest.raises(Exception, match="unmap"):
        ctl.sleep(1)
    assert ctl.state is State.AWAKE  # the staged chunks may still be pinning in the background: wait for them
    assert (
        rig.allocator._host.wait_ready(10)
        and rig.allocator.wait_host_unpinned(10)
        and rig.allocator.pinned_bytes() == 0 == rig.driver.host_used
    )
    ctl.sleep(1)
    assert rig.allocator.pinned_bytes() == 16 * G
    ctl.discard(["weights"])  # the staged sleep's chunks may still be pinning in the background: wait for them
    assert (
        rig.allocator._host.wait_ready(10)
        and rig.allocator.wait_host_unpinned(10)
        and rig.allocator.pinned_bytes() == 0 == rig.driver.host_used
    )


class SettlingSim(SimDriver):
    """A SimDriver reusing host addresses whose reservations first wait for the pins in flight to finish (a slow mmap)."""

    alloc: TaggedAllocator | None = None

    def host_reserve(self, nbytes: int) -> int:
        if self.alloc is not None:
            self.alloc._host.wait_ready(10)
        return super().host_reserve(nbytes)


def test_a_failed_pin_never_lets_two_backups_share_host_memory(make_rig: RigMaker) -> None:
    """A chunk whose pin failed keeps its address until its backup lets go: the sleep fails, no bytes are mixed."""
    sim = SettlingSim(64 * MiB, granularity=G, reuse_host=True)
    # pinned as the sleep copies (not staged): the first host_alloc is the first tag's chunk
    rig = make_rig(driver=sim, host=HostPolicy(chunk_bytes=4 * G, threads=1, staged=False), slab_bytes=0)
    alloc = sim.alloc = rig.allocator
    ctl = rig.control()
    data = {**fill(alloc, "cudagraph", [4 * G]), **fill(alloc, "weights", [4 * G])}  # two tags: two takes in one backup
    sim.fail("host_alloc")  # the first tag's chunk; the second tag's reservation comes after it failed
    failed = None
    try:
        ctl.sleep(1)
    except TorporError as exc:
        failed = exc
        ctl.sleep(1)
    ctl.wake()
    assert all(alloc.read(a, len(b)) == b for a, b in data.items()), "a wake lost bytes: two backups shared memory"
    assert failed is not None and "host_alloc" in str(failed)
    alloc.close()
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_pinning_ahead_leaves_out_the_tags_the_policy_never_backs_up(make_rig: RigMaker) -> None:
    """The allocator excludes nothing itself; the controller passes the tags every level discards (kv_cache, workspace)."""
    assert HostPolicy().prepin_exclude == frozenset()
    rig = make_rig("with_context")
    rig.control(policy=Policy(host=HostMemoryPolicy(pin=PinWhen.AHEAD)))
    assert rig.allocator._host.policy.prepin_exclude == {"kv_cache", "workspace"}
    fill(rig.allocator, "weights", [4 * G] * 2)
    fill(rig.allocator, "kv_cache", [4 * G] * 4)
    fill(rig.allocator, "workspace", [4 * G])
    assert rig.allocator.wait_host_ready(10)
    assert rig.allocator.pinned_bytes() == 8 * G


def test_a_policy_that_offloads_kv_cache_pins_ahead_for_it(make_rig: RigMaker) -> None:
    """With kv_cache offloaded at level 1, its growth pins ahead too (the exclusion follows the policy)."""
    rig = make_rig("with_context", overhead=0)
    levels = {1: {"kv_cache": Action.OFFLOAD}, 2: {"kv_cache": Action.DISCARD}}
    rig.control(policy=Policy(levels=levels, host=HostMemoryPolicy(pin=PinWhen.AHEAD)))
    fill(rig.allocator, "kv_cache", [4 * G] * 2)
    assert rig.allocator.wait_host_ready(10)
    assert rig.allocator.pinned_bytes() == 8 * G
