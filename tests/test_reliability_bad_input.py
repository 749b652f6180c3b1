"""Bad input: every malformed command, log line or payload gets a clear error naming what was wrong, and nothing changes."""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor.errors import (
    EventTooLarge,
    InvalidLevel,
    InvalidTransition,
    LogCorrupted,
    PoolBusy,
    TorporError,
    UnknownSchemaVersion,
    UnknownTag,
    UnsafeLogPath,
)
from torpor.statemachine.core.events import SCHEMA_VERSION, EventKind
from torpor.statemachine.core.states import State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import DEFAULT_MAX_LINE, decode_line, read_events, replay
from torpor.statemachine.machine.controller import SleepController
from torpor.testing import FakeMemory

TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024}


# -- helpers ----------------------------------------------------------------------------


def _memory() -> FakeMemory:
    return FakeMemory(TAGS)


def _controller(tmp_path: Path, memory: FakeMemory | None = None) -> tuple[SleepController, FakeMemory, Path]:
    mem = memory or _memory()
    path = tmp_path / "log" / "engine.jsonl"
    return SleepController(mem, path, fsync=False), mem, path


def _world(ctrl: SleepController, mem: FakeMemory) -> dict[str, Any]:
    """Everything a refused command must leave as it was (refusal bookkeeping aside)."""
    proj = ctrl.projection.to_dict()
    for key in ("last_seq", "last_kind", "last_wall", "last_step", "refusals"):
        proj.pop(key)
    contents = {tag: mem.content(tag) for tag in TAGS}
    backups = {tag: mem._tags[tag].backup for tag in TAGS}
    return {"projection": proj, "usage": dict(mem.usage()), "contents": contents, "backups": backups}


def _refused(
    ctrl: SleepController,
    mem: FakeMemory,
    path: Path,
    error: type[TorporError],
    command: Callable[[], object],
    *needles: str,
) -> TorporError:
    """Run ``command``; check it raises ``error`` naming ``needles``, logs one refusal and changes nothing."""
    before = _world(ctrl, mem)
    seq = ctrl.last_seq
    with pytest.raises(error) as info:
        command()
    text = str(info.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not named in: {text}"
    assert _world(ctrl, mem) == before
    new = ctrl.events(after=seq)
    assert [e.kind for e in new] == [EventKind.REFUSED]
    assert new[0].data["error"] == type(info.value).__name__
    assert new[0].data["reason"] == text
    assert replay(path).to_dict() == ctrl.projection.to_dict()
    return info.value


@pytest.fixture
def asleep(tmp_path: Path) -> Iterator[tuple[SleepController, FakeMemory, Path]]:
    """A controller asleep at level 1."""
    ctrl, mem, path = _controller(tmp_path)
    ctrl.sleep(1)
    yield ctrl, mem, path
    ctrl.close()


@pytest.fixture
def awake(tmp_path: Path) -> Iterator[tuple[SleepController, FakeMemory, Path]]:
    """A controller awake, fresh."""
    ctrl, mem, path = _controller(tmp_path)
    yield ctrl, mem, path
    ctrl.close()


# -- commands ---------------------------------------------------------------------------


@pytest.mark.parametrize("tags", [["nope"], ["weights", "nope", "also-not"], [""], ["x" * 300]])
def test_wake_unknown_tag_is_refused(asleep: tuple[SleepController, FakeMemory, Path], tags: list[str]) -> None:
    """A wake naming an unknown tag is refused with UnknownTag naming it and the known tags; nothing wakes."""
    ctrl, mem, path = asleep
    unknown = [t for t in tags if t not in TAGS]
    err = _refused(ctrl, mem, path, UnknownTag, lambda: ctrl.wake(tags), *(repr(t) for t in unknown), "weights")
    assert isinstance(err, UnknownTag)
    assert list(err.tags) == unknown
    assert ctrl.state is State.ASLEEP_L1


def test_discard_unknown_tag_is_refused(asleep: tuple[SleepController, FakeMemory, Path]) -> None:
    """Discarding an unknown tag is refused and keeps every backup."""
    ctrl, mem, path = asleep
    _refused(ctrl, mem, path, UnknownTag, lambda: ctrl.discard(["weights", "ghost"]), "'ghost'")


def test_discard_cudagraph_is_refused(tmp_path: Path) -> None:
    """Discarding the graph pool's backup is refused: graphs hold write-once state."""
    mem = FakeMemory({**TAGS, "cudagraph": 2048})
    ctrl, mem, path = _controller(tmp_path, mem)
    ctrl.sleep(1)
    before = mem._tags["cudagraph"].backup
    with pytest.raises(InvalidTransition, match="cudagraph is never discarded"):
        ctrl.discard(["cudagraph"])
    assert mem._tags["cudagraph"].backup == before
    assert ctrl.events()[-1].kind is EventKind.REFUSED
    assert replay(path).to_dict() == ctrl.projection.to_dict()


@pytest.mark.parametrize("level", [0, 3, -1, 2**64, 1.5, "1", None, True, False, [1]])
def test_sleep_level_outside_1_2_is_refused(awake: tuple[SleepController, FakeMemory, Path], level: Any) -> None:
    """A sleep level other than 1 or 2 is refused with InvalidLevel naming the level; nothing is released."""
    ctrl, mem, path = awake
    err = _refused(ctrl, mem, path, InvalidLevel, lambda: ctrl.sleep(level), repr(level))
    assert isinstance(err, InvalidLevel)
    assert err.level == level
    assert ctrl.state is State.AWAKE


def test_wake_while_awake_is_refused(awake: tuple[SleepController, FakeMemory, Path]) -> None:
    """wake while awake names the state, the event since which it holds and the allowed states."""
    ctrl, mem, path = awake
    _refused(ctrl, mem, path, InvalidTransition, ctrl.wake, "cannot wake from 'awake'", "event #1", "asleep_l1")


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_while_asleep_is_refused(tmp_path: Path, level: int) -> None:
    """sleep while asleep (either level) is refused and keeps the backups as they were."""
    ctrl, mem, path = _controller(tmp_path)
    ctrl.sleep(level)
    for again in (1, 2):
        _refused(ctrl, mem, path, InvalidTransition, lambda a=again: ctrl.sleep(a), f"from 'asleep_l{level}'")
    ctrl.wake()
    assert ctrl.state is State.AWAKE


def test_capture_while_asleep_is_refused(asleep: tuple[SleepController, FakeMemory, Path]) -> None:
    """A graph capture while asleep is refused before the pool is touched."""
    ctrl, mem, path = asleep

    def capture() -> None:
        with ctrl.capture("model.forward batch=8"):
            pytest.fail("the capture body ran while asleep")

    _refused(ctrl, mem, path, InvalidTransition, capture, "cannot capture from 'asleep_l1'", "allowed from: awake")
    assert mem.graphs == []
    assert mem.pool is None


def test_release_pool_while_asleep_is_refused(tmp_path: Path) -> None:
    """Releasing the graph pool while asleep is refused: freeing would unmap a second time."""
    ctrl, mem, path = _controller(tmp_path)
    with ctrl.capture("decode batch=1"):
        pass
    mem.drop_graph("decode batch=1")
    ctrl.sleep(1)
    pool = mem.pool
    _refused(ctrl, mem, path, PoolBusy, ctrl.release_cudagraph_pool, "asleep", "wake first")
    assert mem.pool == pool


def test_release_pool_while_referenced_names_every_holder(awake: tuple[SleepController, FakeMemory, Path]) -> None:
    """Releasing a referenced pool is refused and the refusal names each graph and other reference."""
    ctrl, mem, path = awake
    for site in ("decode batch=8", "decode batch=16"):
        with ctrl.capture(site):
            pass
    mem.other_references = 1
    err = _refused(ctrl, mem, path, PoolBusy, ctrl.release_cudagraph_pool, "batch=8", "batch=16", "1 other reference")
    assert isinstance(err, PoolBusy)
    assert len(err.holders) == 3
    assert list(ctrl.events()[-1].data["holders"]) == list(err.holders)


def test_oversized_hook_payload_is_refused(awake: tuple[SleepController, FakeMemory, Path]) -> None:
    """An event over the line limit raises EventTooLarge naming kind, size and limit; the log is unchanged."""
    ctrl, _, path = awake
    size = path.stat().st_size
    seq = ctrl.last_seq
    before = ctrl.projection.to_dict()
    with pytest.raises(EventTooLarge) as info:
        ctrl.record(EventKind.HOOK_DECISION, hook="h", active=True, detail="x" * (DEFAULT_MAX_LINE + 1))
    assert info.value.kind == "hook_decision"
    assert info.value.size > info.value.limit == DEFAULT_MAX_LINE
    assert "hook_decision" in str(info.value)
    assert str(DEFAULT_MAX_LINE) in str(info.value)
    assert path.stat().st_size == size
    assert ctrl.last_seq == seq
    assert ctrl.projection.to_dict() == before
    ctrl.record(EventKind.HOOK_DECISION, hook="h", active=True, detail="small")
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def test_oversized_unknown_tag_is_refused_and_logged(asleep: tuple[SleepController, FakeMemory, Path]) -> None:
    """A tag name too long for one log line is still refused as UnknownTag, and the refusal is logged (bounded)."""
    ctrl, mem, path = asleep
    huge = "t" * (2 * DEFAULT_MAX_LINE)
    before = _world(ctrl, mem)
    with pytest.raises(UnknownTag):
        ctrl.wake([huge])
    assert _world(ctrl, mem) == before
    last = ctrl.events()[-1]
    assert last.kind is EventKind.REFUSED
    assert last.data["error"] == "UnknownTag"
    assert len(last.data["reason"]) < DEFAULT_MAX_LINE
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def test_only_outside_facts_can_be_recorded(awake: tuple[SleepController, FakeMemory, Path]) -> None:
    """record() refuses kinds that only the controller may write (a forged sleep_completed, say)."""
    ctrl, _, path = awake
    seq = ctrl.last_seq
    for kind in (EventKind.SLEEP_COMPLETED, EventKind.RECOVERED, EventKind.TAG_RELEASED):
        with pytest.raises(ValueError, match=kind.value):
            ctrl.record(kind)
    assert ctrl.last_seq == seq
    assert replay(path).to_dict() == ctrl.projection.to_dict()


# -- the log ----------------------------------------------------------------------------


def _write_cycles(path: Path, cycles: int = 2) -> SleepController:
    ctrl = SleepController(_memory(), path, fsync=False)
    for level in [1, 2] * cycles:
        ctrl.sleep(level)
        ctrl.wake(["weights"])
        ctrl.wake()
    with pytest.raises(InvalidTransition):
        ctrl.wake()
    ctrl.close()
    return ctrl


def _line(raw: dict[str, Any]) -> bytes:
    """A log line with a correct checksum around any JSON object."""
    body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
    return f'{{"crc":"{crc:08x}",{body[1:]}\n'.encode()


def _event(seq: int = 1, **changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "seq": seq,
        "kind": "opened",
        "wall": 1.0,
        "mono": 1.0,
        "pid": 1,
        "engine": "e",
        "rank": 0,
        "data": {"usage": {}},
    }
    raw.update(changes)
    return raw


def test_corrupted_middle_line_names_file_and_line(tmp_path: Path) -> None:
    """A flipped byte in the middle of the log raises LogCorrupted naming path and line; opening a controller on it changes nothing."""
    path = tmp_path / "e.jsonl"
    _write_cycles(path)
    data = bytearray(path.read_bytes())
    lines = data.split(b"\n")
    target = 3
    offset = sum(len(line) + 1 for line in lines[: target - 1]) + len(lines[target - 1]) // 2
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupted) as info:
        list(read_events(path))
    assert info.value.line == target
    assert info.value.path == str(path)
    assert f"{path}:{target}" in str(info.value)
    with pytest.raises(LogCorrupted):
        SleepController(_memory(), path, fsync=False)
    assert path.read_bytes() == bytes(data)


def test_corrupted_last_line_is_not_taken_for_a_torn_one(tmp_path: Path) -> None:
    """A complete last line with a bad checksum is corruption, not a torn write: opening refuses."""
    path = tmp_path / "e.jsonl"
    _write_cycles(path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x20
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupted, match="checksum"):
        EventLog(path, fsync=False)
    assert path.read_bytes() == bytes(data)


def test_truncated_last_line_replays_the_prefix(tmp_path: Path) -> None:
    """A torn last line (crash mid-write) is ignored by replay and cut off by the next writer."""
    path = tmp_path / "e.jsonl"
    _write_cycles(path)
    full = path.read_bytes()
    events = list(read_events(path))
    cut = full[: len(full) - len(encode_last(full)) // 2 - 1]
    path.write_bytes(cut)
    assert [e.seq for e in read_events(path)] == [e.seq for e in events[:-1]]
    assert replay(path).to_dict() == replay(events[:-1]).to_dict()
    ctrl = SleepController(_memory(), path, fsync=False)
    assert ctrl.last_seq == events[-1].seq  # the torn 'closed' is gone, a new 'opened' follows #N-1
    ctrl.close()
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def encode_last(data: bytes) -> bytes:
    """The last complete line of ``data``."""
    return data.rstrip(b"\n").rsplit(b"\n", 1)[-1] + b"\n"


def test_truncated_line_in_rotated_segment_is_corruption(tmp_path: Path) -> None:
    """An unterminated line in a rotated (older) segment is not a torn write: LogCorrupted."""
    path = tmp_path / "e.jsonl"
    log = EventLog(path, fsync=False, max_bytes=600)
    ctrl = SleepController(_memory(), log)
    for _ in range(4):
        ctrl.sleep(1)
        ctrl.wake()
    ctrl.close()
    rotated = sorted(tmp_path.glob("e.jsonl.*"))
    assert rotated, "the log did not rotate"
    seg = rotated[0]
    seg.write_bytes(seg.read_bytes()[:-3])
    with pytest.raises(LogCorrupted, match="rotated segment"):
        list(read_events(path))


@pytest.mark.parametrize("version", [0, 2, 99, "1", None, [1]])
def test_unknown_schema_version_is_named(tmp_path: Path, version: Any) -> None:
    """An event of another schema raises UnknownSchemaVersion naming both versions; no controller opens on it."""
    path = tmp_path / "e.jsonl"
    ctrl = _write_cycles(path, cycles=1)
    raw = _event(ctrl.last_seq + 1, schema=version, kind="usage_observed", data={"usage": {}})
    path.write_bytes(path.read_bytes() + _line(raw))
    with pytest.raises(UnknownSchemaVersion) as info:
        list(read_events(path))
    assert info.value.version == version
    assert repr(version) in str(info.value)
    assert f"version {SCHEMA_VERSION}" in str(info.value)
    data = path.read_bytes()
    with pytest.raises(UnknownSchemaVersion):
        SleepController(_memory(), path, fsync=False)
    assert path.read_bytes() == data


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"kind": "exploded"}, "unknown event kind"),
        ({"kind": ["opened"]}, "unknown event kind"),
        ({"kind": {"k": 1}}, "unknown event kind"),
        ({"kind": None}, "unknown event kind"),
        ({"seq": "1"}, "'seq'"),
        ({"seq": 1.5}, "'seq'"),
        ({"seq": True}, "'seq'"),
        ({"wall": "now"}, "'wall'"),
        ({"engine": 3}, "'engine'"),
        ({"data": [1, 2]}, "'data'"),
        ({"schema": True}, "schema"),
        ({"schema": 1.0}, "schema"),
    ],
)
def test_checksummed_but_invalid_event_is_corruption(tmp_path: Path, changes: dict[str, Any], needle: str) -> None:
    """A line whose checksum is right but whose fields are wrong is LogCorrupted/UnknownSchemaVersion naming the field."""
    path = tmp_path / "e.jsonl"
    path.write_bytes(_line(_event(**changes)))
    with pytest.raises((LogCorrupted, UnknownSchemaVersion)) as info:
        list(read_events(path))
    assert needle in str(info.value)


def test_deeply_nested_payload_is_corruption(tmp_path: Path) -> None:
    """A checksummed line nesting JSON thousands deep is LogCorrupted, not a RecursionError."""
    path = tmp_path / "e.jsonl"
    for depth in (900, 5000, 20000):
        body = json.dumps(_event(data={"x": 0}), sort_keys=True, separators=(",", ":"))
        body = body.replace('"x":0', '"x":' + "[" * depth + "]" * depth)
        crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
        path.write_bytes(f'{{"crc":"{crc:08x}",{body[1:]}\n'.encode())
        with pytest.raises(LogCorrupted, match="nest"):
            list(read_events(path))


def test_sequence_gap_and_repeat_are_corruption(tmp_path: Path) -> None:
    """A missing or repeated line (sequence gap or repeat) is LogCorrupted naming both numbers."""
    path = tmp_path / "e.jsonl"
    _write_cycles(path, cycles=1)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2] + lines[3:]))
    with pytest.raises(LogCorrupted, match="jumps from #2 to #4"):
        list(read_events(path))
    path.write_bytes(b"".join(lines[:3] + lines[2:]))
    with pytest.raises(LogCorrupted, match="jumps from #3 to #3"):
        list(read_events(path))


def test_overlong_line_is_refused_before_parsing(tmp_path: Path) -> None:
    """A line over the line limit is refused by length, without being parsed."""
    path = tmp_path / "e.jsonl"
    path.write_bytes(b"{" + b" " * (DEFAULT_MAX_LINE + 10) + b"}\n")
    with pytest.raises(LogCorrupted, match="over the"):
        list(read_events(path))


def test_log_files_are_private(tmp_path: Path) -> None:
    """The log is created 0600 inside a 0700 directory, whatever the umask."""
    old = os.umask(0)
    try:
        path = tmp_path / "private" / "logs" / "e.jsonl"
        ctrl = SleepController(_memory(), path, fsync=False)
        ctrl.sleep(1)
        ctrl.close()
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


def test_existing_open_directory_or_file_is_refused_not_chmodded(tmp_path: Path) -> None:
    """A log directory others can write, or a log file others can write, is refused and keeps its mode (never chmodded)."""
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o777)
    os.chmod(logs, 0o777)  # noqa: S103 - the test starts from an open directory on purpose
    with pytest.raises(UnsafeLogPath, match="others can write the directory"):
        EventLog(logs / "e.jsonl", fsync=False)
    assert logs.stat().st_mode & 0o777 == 0o777
    os.chmod(logs, 0o755)  # noqa: S103 - a usual home-directory mode
    path = logs / "e.jsonl"
    path.write_bytes(b"")
    os.chmod(path, 0o666)  # noqa: S103 - ditto, an open file
    with pytest.raises(UnsafeLogPath, match="others can write the file"):
        EventLog(path, fsync=False)
    assert path.stat().st_mode & 0o777 == 0o666
    assert logs.stat().st_mode & 0o777 == 0o755


def test_shared_sticky_directory_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A log put in a shared sticky directory (like /tmp) keeps that directory's mode, warns, and is itself 0600."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # noqa: S103 - /tmp's mode, on purpose
    path = shared / "e.jsonl"
    with caplog.at_level("WARNING"):
        ctrl = SleepController(_memory(), path, fsync=False)
        ctrl.close()
    assert shared.stat().st_mode & 0o7777 == 0o1777, "torpor changed the mode of a shared directory"
    assert path.stat().st_mode & 0o777 == 0o600
    assert str(shared) in caplog.text


def test_log_reader_never_executes_or_unpickles(tmp_path: Path) -> None:
    """A checksummed line carrying a pickle or code stays inert data: nothing is imported or run."""
    import pickle

    marker = tmp_path / "pwned"
    payload = pickle.dumps(os.system).hex()
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    raw = _event(kind="hook_decision", data={"hook": code, "active": True, "detail": payload, "__reduce__": code})
    path = tmp_path / "e.jsonl"
    path.write_bytes(_line(raw))
    (event,) = read_events(path)
    assert event.data["hook"] == code
    replay(path)
    assert not marker.exists()


_FORBIDDEN_CALLS = {
    ("pickle", "load"),
    ("pickle", "loads"),
    ("marshal", "load"),
    ("marshal", "loads"),
    ("shelve", "open"),
    ("yaml", "load"),
    ("yaml", "unsafe_load"),
    ("torch", "load"),
    ("os", "system"),
    ("", "eval"),
    ("", "exec"),
    ("", "__import__"),
}


def test_no_torpor_code_unpickles_or_evaluates() -> None:
    """No module of torpor calls pickle/marshal/yaml/torch loaders, eval, exec or os.system (static check of the source)."""
    import ast

    import torpor

    found = []
    for file in sorted(Path(torpor.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                key = ("", func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                key = (func.value.id, func.attr)
            else:
                continue
            if key in _FORBIDDEN_CALLS:
                found.append(f"{file.name}:{node.lineno} {'.'.join(k for k in key if k)}")
    assert not found, found


# -- fuzzing the log reader -----------------------------------------------------------

_ALLOWED = (LogCorrupted, UnknownSchemaVersion)
_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _read_all(path: Path) -> None:
    """Read every event; only the log's own errors may escape."""
    try:
        events = list(read_events(path))
    except _ALLOWED:
        return
    for event in events:
        assert isinstance(event.kind, EventKind)
        assert isinstance(event.seq, int)


@pytest.fixture(scope="module")
def good_log(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of a real log: two sleep/wake cycles at both levels, a refusal, a close."""
    path = tmp_path_factory.mktemp("good") / "e.jsonl"
    _write_cycles(path)
    return path.read_bytes()


@_FUZZ
@given(data=st.binary(max_size=4096))
def test_fuzz_arbitrary_bytes(tmp_path: Path, data: bytes) -> None:
    """Arbitrary bytes as a log give LogCorrupted/UnknownSchemaVersion or valid events, nothing else."""
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    _read_all(path)


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.integers(0, 300)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("dup_line"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("drop_line"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("swap_lines"), st.integers(0, 10**6), st.integers(0, 10**6)),
)


def _mutate(data: bytes, op: tuple[str, int, Any]) -> bytes:
    name, at, arg = op
    if not data:
        return arg if name == "insert" else data
    at %= len(data)
    lines = data.splitlines(keepends=True)
    if name == "flip":
        out = bytearray(data)
        out[at] ^= arg
        return bytes(out)
    if name == "cut":
        return data[:at] + data[at + arg :]
    if name == "insert":
        return data[:at] + arg + data[at:]
    if name == "truncate":
        return data[:at]
    index = at % len(lines)
    if name == "dup_line":
        return b"".join([*lines[: index + 1], *lines[index:]])
    if name == "drop_line":
        return b"".join(lines[:index] + lines[index + 1 :])
    other = arg % len(lines)
    lines[index], lines[other] = lines[other], lines[index]
    return b"".join(lines)


@_FUZZ
@given(ops=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_mutated_log(tmp_path: Path, good_log: bytes, ops: list[tuple[str, int, Any]]) -> None:
    """A real log mutated (bytes flipped, cut, inserted, lines duplicated, dropped, swapped) reads or fails cleanly."""
    data = good_log
    for op in ops:
        data = _mutate(data, op)
    path = tmp_path / "mutated.jsonl"
    path.write_bytes(data)
    _read_all(path)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_field = st.sampled_from(["schema", "seq", "kind", "wall", "mono", "pid", "engine", "rank", "data", "extra"])


@_FUZZ
@given(
    fields=st.dictionaries(_field, _json, min_size=1, max_size=4), kind=st.sampled_from([k.value for k in EventKind])
)
def test_fuzz_checksummed_fields(tmp_path: Path, fields: dict[str, Any], kind: str) -> None:
    """Lines with a correct checksum but arbitrary field values still give only the log's own errors."""
    path = tmp_path / "fields.jsonl"
    path.write_bytes(_line(_event(kind=kind) | fields))
    _read_all(path)


@_FUZZ
@given(raw=_json)
def test_fuzz_checksummed_json(tmp_path: Path, raw: Any) -> None:
    """Any JSON value behind a correct checksum gives only the log's own errors."""
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    body = "{" + text[1:]  # what the reader checks the checksum of
    crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
    line = f'{{"crc":"{crc:08x}",{text[1:]}'.encode()
    with contextlib.suppress(*_ALLOWED):
        decode_line(line, "fuzz", 1)


# -- the HTTP endpoint ------------------------------------------------------------------

ROUTES = ("/events", "/state", "/metrics")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SleepController, Any]]:
    """A controller with some history, served on loopback with short long-polls and a small event limit."""
    from torpor.telemetry import serve

    path = tmp_path_factory.mktemp("http") / "e.jsonl"
    ctrl = SleepController(_memory(), path, fsync=False)
    for level in (1, 2):
        ctrl.sleep(level)
        ctrl.wake()
    server = serve(ctrl, port=0, max_wait=0.05, max_events=5)
    try:
        yield ctrl, server
    finally:
        server.close()
        ctrl.close()


def _get(server: Any, target: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request(method, target)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _check_response(ctrl: SleepController, before: dict[str, Any], route: str, query: str, server: Any) -> None:
    status, _, body = _get(server, f"{route}?{query}" if query else route)
    assert status in (200, 400), f"{route}?{query} -> {status}: {body[:200]!r}"
    if status == 400:
        reason = json.loads(body)["error"]
        assert reason, "a 400 must say why"
        assert len(body) < 1024
    elif route == "/events":
        lines = [json.loads(line) for line in body.splitlines()]
        assert len(lines) <= 5
        assert all(isinstance(line["seq"], int) for line in lines)
    assert ctrl.projection.to_dict() == before, f"GET {route}?{query} changed the controller"


_query_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_param_value = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "nan", "inf", "-0", "1e309", "0x10", "1_000", " 1", "1 ", "+1", "٣", "²", "0.01", "00001"]),
    _query_text,
)
_pair = st.tuples(
    st.sampled_from(["after", "timeout", "limit", "AFTER", "after[]", "", "x"]) | _query_text, _param_value
)


@_FUZZ
@given(route=st.sampled_from(ROUTES), pairs=st.lists(_pair, max_size=4), sep=st.sampled_from(["&", ";", "&&"]))
def test_fuzz_http_query_parameters(
    endpoint: tuple[SleepController, Any], route: str, pairs: list[tuple[str, str]], sep: str
) -> None:
    """Any query parameters (unknown, repeated, malformed, huge, non-ASCII) get 200 or a 400 with a reason, never 500, and change nothing."""
    from urllib.parse import quote

    ctrl, server = endpoint
    before = ctrl.projection.to_dict()
    query = sep.join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)
    _check_response(ctrl, before, route, query, server)


@_FUZZ
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=200))
def test_fuzz_http_raw_query_bytes(endpoint: tuple[SleepController, Any], route: str, raw: bytes) -> None:
    """Arbitrary percent-encoded bytes as the query string: 200 or 400 with a reason, never 500."""
    from urllib.parse import quote_from_bytes

    ctrl, server = endpoint
    before = ctrl.projection.to_dict()
    _check_response(ctrl, before, route, quote_from_bytes(raw, safe="=&;+%"), server)


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("after=-1", "after"),
        ("after=abc", "after"),
        ("limit=0", "limit"),
        ("limit=6", "limit"),
        ("timeout=nan", "timeout"),
        ("timeout=1", "timeout"),
        ("after=1&after=2", "more than once"),
        ("bogus=1", "unknown query parameter 'bogus'"),
        ("after", "malformed"),
    ],
)
def test_http_bad_parameter_names_what_was_wrong(
    endpoint: tuple[SleepController, Any], query: str, needle: str
) -> None:
    """Each malformed /events parameter gets a 400 whose reason names the parameter."""
    ctrl, server = endpoint
    before = ctrl.projection.to_dict()
    status, _, body = _get(server, f"/events?{query}")
    assert status == 400, body
    assert needle in json.loads(body)["error"]
    assert ctrl.projection.to_dict() == before


def test_http_endpoint_is_loopback_read_only_and_bounded(endpoint: tuple[SleepController, Any]) -> None:
    """The endpoint binds loopback by default, refuses writes (405), bounds the URL (414) and the events per response."""
    ctrl, server = endpoint
    assert server.host == "127.0.0.1"
    before = ctrl.projection.to_dict()
    seq = ctrl.last_seq
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, _ = _get(server, "/state", method)
        assert status == 405
        assert "GET" in headers["Allow"]
    status, _, _ = _get(server, "/events?after=" + "1" * 5000)
    assert status == 414
    status, _, body = _get(server, "/events?after=0")
    assert status == 200
    assert len(body.splitlines()) == 5  # max_events, though the controller holds more
    assert ctrl.last_seq == seq
    assert ctrl.projection.to_dict() == before


@_FUZZ
@given(
    kind=st.sampled_from([k.value for k in EventKind]),
    data=st.dictionaries(
        st.sampled_from(["tag", "bytes", "action", "level", "usage", "pool", "site", "projection", "tags", "x"]),
        _json,
        max_size=4,
    ),
)
def test_fuzz_replay_of_checksummed_payloads(tmp_path: Path, kind: str, data: dict[str, Any]) -> None:
    """A checksummed event with a malformed payload makes replay raise LogCorrupted naming the line, never a KeyError or TypeError."""
    path = tmp_path / "payload.jsonl"
    opened = _event(1, data={"usage": {"weights": 4096}})
    path.write_bytes(_line(opened) + _line(_event(2, kind=kind, data=data)))
    try:
        proj = replay(path)
    except _ALLOWED as exc:
        assert str(path) in str(exc)
        return
    assert proj.last_seq == 2
