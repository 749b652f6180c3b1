"""TmsEngine: one controller per TMS tag, pause/resume as logged sleeps and wakes, all checks before anything moves."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import RigMaker

from torpor import State
from torpor.errors import TagStateError, TmsUsageError, TorporError
from torpor.statemachine.core.policy import Action
from torpor.tms.envsettings import TmsSettings
from torpor.tms.pausing import DISABLED_TAG, TmsEngine, check_alloc_conf
from torpor.tms.tagview import TagView
from torpor.units import MiB


def engine(make_rig: RigMaker, log: str | None = None, settings: TmsSettings | None = None) -> TmsEngine:
    """An engine on a simulated device, telemetry off."""
    alloc = make_rig("cuda_like", capacity=64 * MiB).allocator
    return TmsEngine("torch", allocator=alloc, log=log, settings=settings or TmsSettings(), telemetry=False)


def one_in_each_tag(e: TmsEngine) -> dict[str, int]:
    """kv_cache (no backup), weights (pinned backup), cuda_graph (no backup): one 2 MiB allocation each."""
    out = {}
    for tag, cpu in (("kv_cache", False), ("weights", True), ("cuda_graph", False)):
        with e.region(tag, cpu, False, None):
            out[tag] = e.allocator.allocate(2 * MiB)
        e.allocator.write(out[tag], tag.encode() * 4)
    return out


def test_each_tag_pauses_alone_in_sglangs_order(make_rig: RigMaker) -> None:
    """kv_cache, weights, cuda_graph paused one by one, resumed in reverse: weights kept, the others discarded."""
    e = engine(make_rig)
    addr = one_in_each_tag(e)
    for tag in ("kv_cache", "weights", "cuda_graph"):
        e.pause(tag)
        assert e.allocator.usage()[tag].resident == 0
        assert e.controllers[tag].state is State.ASLEEP_L1
    for tag in ("cuda_graph", "weights", "kv_cache"):
        e.resume(tag)
        assert e.controllers[tag].state is State.AWAKE
    assert e.allocator.read(addr["weights"], 28) == b"weights" * 4
    assert all(u.resident == 2 * MiB for u in e.allocator.usage().values())


def test_the_policy_follows_the_regions_settings(make_rig: RigMaker) -> None:
    """A region with a CPU (or disk) backup is offloaded, one without is discarded: the plan the sleep records."""
    e = engine(make_rig)
    one_in_each_tag(e)
    e.pause(None)
    plans = {t: ev.data["plan"] for t, c in e.controllers.items() for ev in c.events() if ev.kind == "sleep_requested"}
    assert plans == {
        "kv_cache": {"kv_cache": "discard"},
        "weights": {"weights": "offload"},
        "cuda_graph": {"cuda_graph": "discard"},
    }
    assert e.tags["weights"].policy().plan(1, ["weights"]) == {"weights": Action.OFFLOAD}


def test_double_pause_names_the_tag_and_its_state(make_rig: RigMaker) -> None:
    """Pausing a paused tag raises TagStateError (TMS exits), naming the tag and its state."""
    e = engine(make_rig)
    one_in_each_tag(e)
    e.pause("kv_cache")
    with pytest.raises(TagStateError, match=r"'kv_cache' is 'asleep_l1'") as info:
        e.pause("kv_cache")
    assert (info.value.tag, info.value.state, info.value.command) == ("kv_cache", "asleep_l1", "pause")
    assert isinstance(info.value, TorporError)


def test_resume_of_an_awake_tag_is_refused(make_rig: RigMaker) -> None:
    """Resuming a tag that is not paused raises TagStateError naming it."""
    e = engine(make_rig)
    one_in_each_tag(e)
    with pytest.raises(TagStateError, match=r"'weights' is 'awake'"):
        e.resume("weights")


def test_pause_all_checks_every_tag_first(make_rig: RigMaker) -> None:
    """pause(None) with one tag paused refuses and leaves every other tag awake."""
    e = engine(make_rig)
    one_in_each_tag(e)
    e.pause("weights")
    with pytest.raises(TagStateError, match="'weights'"):
        e.pause(None)
    assert e.controllers["kv_cache"].state is State.AWAKE
    with pytest.raises(TagStateError, match="'cuda_graph' is 'awake'"):
        e.resume(None)
    assert e.controllers["weights"].state is State.ASLEEP_L1


def test_pause_all_and_resume_all(make_rig: RigMaker) -> None:
    """pause(None) and resume(None) (and the empty tag, as TMS reads it) cover every tag."""
    e = engine(make_rig)
    one_in_each_tag(e)
    e.pause("")
    assert all(u.resident == 0 for u in e.allocator.usage().values())
    e.resume(None)
    assert all(c.state is State.AWAKE for c in e.controllers.values())


def test_a_failed_pause_wakes_what_it_paused(monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker) -> None:
    """When one tag's sleep fails, the tags paused before it in the same call are resumed, then the error raised."""
    e = engine(make_rig)
    one_in_each_tag(e)

    def boom(level: int = 1, *, idempotent: bool = False) -> object:
        raise RuntimeError("injected")

    monkeypatch.setattr(e.controllers["weights"], "sleep", boom)
    with pytest.raises(RuntimeError, match="injected"):
        e.pause(None)
    assert e.controllers["cuda_graph"].state is State.AWAKE  # sorted: cuda_graph went first, and came back


def test_a_tag_with_two_settings_pauses_as_one(make_rig: RigMaker) -> None:
    """A tag used with and without a CPU backup gets two torpor tags; pause(tag) pauses both, each by its own action."""
    e = engine(make_rig)
    with e.region("w", True, False, None):
        kept = e.allocator.allocate(2 * MiB)
    with e.region("w", False, False, None):
        e.allocator.allocate(2 * MiB)
    e.allocator.write(kept, b"keep")
    assert e.tags["w"].actions == {"w": Action.OFFLOAD, "w#discard": Action.DISCARD}
    e.pause("w")
    usage = TagView(e.allocator, e.tags["w"]).usage()  # the CPU backup is the tag's own (torpor.tms.shadows)
    assert (usage["w"].host, usage["w#discard"].discarded) == (2 * MiB, 2 * MiB)
    e.resume("w")
    assert e.allocator.read(kept, 4) == b"keep"


def test_nested_regions_inner_wins(make_rig: RigMaker) -> None:
    """Inside a nested region allocations are the inner tag's; after it, the outer's again."""
    e = engine(make_rig)
    with e.region("outer", True, False, None):
        with e.region("inner", False, False, None):
            inner = e.allocator.allocate(2 * MiB)
            assert e.current().tag == "inner"
        outer = e.allocator.allocate(2 * MiB)
    usage = e.allocator.usage()
    assert usage["inner"].allocations == usage["outer"].allocations == 1
    assert inner != outer


def test_disable_needs_an_active_region(make_rig: RigMaker) -> None:
    """disable() outside any region (and without TMS_INIT_ENABLE) is refused, as TMS's assert; inside it works."""
    e = engine(make_rig)
    with pytest.raises(TmsUsageError, match="only when tms is active"), e.disable():
        pass
    with e.region("w", False, False, None), e.disable():
        assert e.current().interesting is False
        e.allocator.allocate(2 * MiB)
    e.pause(None)
    assert e.allocator.usage()[DISABLED_TAG].resident == 2 * MiB  # never paused
    init = engine(make_rig, settings=TmsSettings(init_enable=True, init_enable_cpu_backup=True))
    assert init.current().mode == "pinned"
    with init.disable():
        pass


def test_allocating_in_a_paused_region_is_refused(make_rig: RigMaker) -> None:
    """A region of a paused tag cannot start (torpor's TagNotAwake), instead of handing out unmapped memory."""
    e = engine(make_rig)
    one_in_each_tag(e)
    e.pause("kv_cache")
    with pytest.raises(TorporError, match="kv_cache"), e.region("kv_cache", False, False, None):
        pass


def test_each_tag_logs_its_own_transitions(tmp_path: Path, make_rig: RigMaker) -> None:
    """With a log directory every TMS tag writes ENGINE.TAG.rankN.jsonl holding its pause and resume."""
    e = engine(make_rig, log=str(tmp_path))
    one_in_each_tag(e)
    e.pause("kv_cache")
    e.resume("kv_cache")
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "tms.kv_cache.rank0.jsonl").read_text().splitlines()]
    assert kinds[-2:] == ["tag_restored", "wake_completed"]
    assert "sleep_completed" in kinds


def test_expandable_segments_are_refused(monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker) -> None:
    """PYTORCH_CUDA_ALLOC_CONF with expandable_segments:True is refused with TMS's words and the reason."""
    check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    with pytest.raises(TmsUsageError, match="expandable_segments is not supported"):
        check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(TmsUsageError):
        engine(make_rig)


def test_cuda_graph_pool_belongs_to_one_tag(make_rig: RigMaker) -> None:
    """The graph pool joins the first cuda_graph() tag; another tag is refused with both names."""
    e = engine(make_rig)
    e.adopt_graph_pool("cuda_graph")
    assert e.tags["cuda_graph"].actions["cudagraph"] is Action.OFFLOAD
    with pytest.raises(TmsUsageError, match="'cuda_graph'"):
        e.adopt_graph_pool("other")


def test_a_pause_inside_its_own_region_is_refused(make_rig: RigMaker) -> None:
    """Pausing a tag from inside one of its regions is refused with nothing touched (the region is open)."""
    e = engine(make_rig)
    one_in_each_tag(e)
    with e.region("kv_cache", False, False, None), pytest.raises(TorporError, match="kv_cache"):
        e.pause("kv_cache")
    assert e.controllers["kv_cache"].state is State.AWAKE
    e.pause("kv_cache")


def test_each_tag_is_an_engine_in_the_metrics(make_rig: RigMaker) -> None:
    """With telemetry on, every TMS tag's controller shows in torpor's Prometheus metrics; close() removes them."""
    prometheus = pytest.importorskip("prometheus_client")
    alloc = make_rig("cuda_like", capacity=64 * MiB).allocator
    e = TmsEngine("torch", allocator=alloc, settings=TmsSettings(), telemetry=True)
    try:
        one_in_each_tag(e)
        e.pause("weights")
        text = prometheus.generate_latest(prometheus.REGISTRY).decode()
        assert 'torpor_state{state="asleep_l1",torpor_engine="tms.weights",torpor_rank="0"} 1.0' in text
        assert 'torpor_engine="tms.kv_cache"' in text
        e.resume("weights")
    finally:
        e.close()
    assert 'torpor_engine="tms.weights"' not in prometheus.generate_latest(prometheus.REGISTRY).decode()


def simulated(make_rig: RigMaker, telemetry: bool | None = False) -> TmsEngine:
    """An engine on a simulated device, reading the rest of its settings from the environment."""
    return TmsEngine(
        "torch",
        allocator=make_rig("cuda_like", capacity=64 * MiB).allocator,
        settings=TmsSettings(),
        telemetry=telemetry,
    )


@pytest.mark.parametrize(("value", "expected"), [(" 1", 1), ("1 ", 1), ("+1", 1), ("3", 3), ("", 0)])
def test_rank_reads_as_the_vllm_side_reads_it(
    value: str, expected: int, monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker
) -> None:
    """RANK with spaces around or a plus sign is that rank (as int() and torpor's vLLM side read it), not rank 0."""
    monkeypatch.setenv("RANK", value)
    assert simulated(make_rig).rank == expected


@pytest.mark.parametrize("value", ["-1", "²", "two"])
def test_a_rank_that_is_no_whole_number_is_refused_naming_rank(
    value: str, monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker
) -> None:
    """A negative or non-decimal RANK is refused with the variable's name, not read as rank 0 nor a bare int() error."""
    monkeypatch.setenv("RANK", value)
    with pytest.raises(ValueError, match=r"^RANK=.* is not a rank"):
        simulated(make_rig)


@pytest.mark.parametrize(
    ("value", "expected"), [("false", False), ("off", False), ("0", False), ("on", True), ("", True)]
)
def test_telemetry_switch_reads_as_every_torpor_switch(
    value: str, expected: bool, monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker
) -> None:
    """TORPOR_TMS_TELEMETRY=false or off turns telemetry off, as 0 does; unset or empty leaves it on."""
    monkeypatch.setenv("TORPOR_TMS_TELEMETRY", value)
    assert simulated(make_rig, telemetry=None).telemetry is expected


def test_a_telemetry_switch_typo_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker
) -> None:
    """TORPOR_TMS_TELEMETRY=of is refused with its name, not read as on."""
    monkeypatch.setenv("TORPOR_TMS_TELEMETRY", "of")
    with pytest.raises(ValueError, match="TORPOR_TMS_TELEMETRY='of' is not a switch"):
        simulated(make_rig, telemetry=None)


def cuda_driver_loads() -> bool:
    """Whether CUDA's driver library opens on this machine."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_without_cuda_the_engine_says_what_is_missing_and_what_to_do() -> None:
    """Without CUDA's driver, the saver's first use says no GPU driver (and no torch, where missing) and names the simulated device."""
    if cuda_driver_loads():
        pytest.skip("this machine has CUDA's driver library")
    with pytest.raises(TmsUsageError) as refused:
        TmsEngine("torch", settings=TmsSettings(), telemetry=False)
    msg = str(refused.value)
    assert msg.startswith("torch_memory_saver (torpor.tms) needs a CUDA GPU: CUDA's driver library libcuda.so.1")
    assert "SimDriver" in msg
    assert ("torch is not installed either" in msg) is (importlib.util.find_spec("torch") is None)
    assert "allocate failed" not in msg


def test_the_switch_without_cuda_is_one_sentence(tmp_path: Path) -> None:
    """TORPOR_TMS=1 without CUDA: region() ends in the saver's refusal saying the GPU is missing, not 'allocate failed (dlopen)'."""
    if cuda_driver_loads():
        pytest.skip("this machine has CUDA's driver library")
    (tmp_path / "probe_region.py").write_text(
        "import torch_memory_saver\nwith torch_memory_saver.torch_memory_saver.region():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORPOR_TMS")}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "torpor.tms.tmsrun", "-m", "probe_region"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    last = out.stderr.splitlines()[-1]
    assert last.startswith("torpor.errors.tmsapi.TmsUsageError: torch_memory_saver (torpor.tms) needs a CUDA GPU")
    assert "allocate failed (dlopen)" not in out.stderr
