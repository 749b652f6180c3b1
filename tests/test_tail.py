"""Tests for torpor.statemachine.log.tail: the one tailer under every log reader, in the cases production meets."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import raw_event

from torpor.errors import LogCorrupted
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.follow import Follower, follow
from torpor.statemachine.log.logsource import LogSource
from torpor.statemachine.log.reader import DEFAULT_MAX_LINE, decode_lines, encode_line, read_events
from torpor.statemachine.log.segments import rotated, segments
from torpor.statemachine.log.tail import Tail
from torpor.statemachine.projection.view import Projection


def _tail(path: Path, after: int = 0) -> Tail:
    return Tail(path, decode_lines, after, max_line=DEFAULT_MAX_LINE)


class Writer:
    """A log writer that rotates like the controller does (a snapshot opens each new file)."""

    def __init__(self, path: Path, **log: int) -> None:
        self.log = EventLog(path, fsync=False, **log)
        self.proj = Projection()

    def append(self, n: int = 1) -> None:
        for _ in range(n):
            event = raw_event(EventKind.USAGE_OBSERVED, self.log.next_seq(), "e", 0, {"usage": {"weights": 1}})
            self.log.append(event)
            self.proj.apply(event)
            if self.log.needs_rotation():
                snap = raw_event(EventKind.SNAPSHOT, self.log.next_seq(), "e", 0, {"projection": self.proj.to_dict()})
                self.log.rotate(snap)
                self.proj.apply(snap)

    @property
    def last(self) -> int:
        return self.log.last_seq


def _seqs(events: list[Event]) -> list[int]:
    return [e.seq for e in events]


# -- rotation while following --------------------------------------------------------------


def test_rotation_while_following_from_another_thread(tmp_path: Path) -> None:
    """A tail polled while a writer thread appends and rotates hands out every event once, in order."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=1500)
    writer.append()
    tail = _tail(path)
    done = threading.Event()

    def write() -> None:
        for _ in range(600):
            writer.append()
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    seen: list[int] = []
    while not done.is_set():
        seen += _seqs(tail.read_available())
    thread.join()
    seen += _seqs(tail.read_available())
    tail.close()
    assert len(rotated(path)) > 10
    assert seen == list(range(1, writer.last + 1))


def test_rotation_with_pruning_while_following_skips_only_to_snapshots(tmp_path: Path) -> None:
    """With old segments pruned under a slow reader, what it hands out is in order, once, resuming at snapshots."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=800, keep=1)
    writer.append()
    tail = _tail(path)
    got = tail.read_available()
    for _ in range(20):
        writer.append(30)  # several rotations between two reads: the middle segments are pruned
        got += tail.read_available()
    tail.close()
    seqs = _seqs(got)
    assert seqs == sorted(set(seqs)) and seqs[-1] == writer.last
    by_seq = {e.seq: e for e in got}
    for before, after in itertools.pairwise(seqs):
        if after != before + 1:
            assert by_seq[after].kind is EventKind.SNAPSHOT  # a gap only ever ends at a snapshot


def test_a_held_file_rotated_and_pruned_is_read_to_its_end(tmp_path: Path) -> None:
    """A tail holding the active file while it is rotated and then deleted reads it to its end, then goes on."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=1000, keep=1)
    writer.append(2)
    tail = _tail(path)
    assert _seqs(tail.read_available()) == [1, 2]
    writer.append(3)  # more in the file the tail holds, which is about to be rotated and pruned
    first_file_end = writer.last
    writer.append(40)
    got = tail.read_available()
    tail.close()
    assert _seqs(got)[: first_file_end - 2] == list(range(3, first_file_end + 1))
    assert got[-1].seq == writer.last


# -- torn lines ----------------------------------------------------------------------------------


def test_a_line_written_a_few_bytes_at_a_time_comes_out_once_whole(tmp_path: Path) -> None:
    """A line appended in pieces across many reads comes out once, when its newline arrives."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(encode_line(raw_event(EventKind.OPENED, 1, "e", 0, {})))
    line = encode_line(raw_event(EventKind.USAGE_OBSERVED, 2, "e", 0, {"usage": {"weights": 7}}))
    tail = _tail(path)
    assert _seqs(tail.read_available()) == [1]
    got: list[Event] = []
    with open(path, "ab") as fh:
        for start in range(0, len(line), 7):
            fh.write(line[start : start + 7])
            fh.flush()
            got += tail.read_available()
            if start + 7 < len(line):
                assert got == []
    assert _seqs(got) == [2] and got[0].data["usage"] == {"weights": 7}
    tail.close()


def test_a_torn_line_in_a_rotated_segment_is_an_error_for_read_events(tmp_path: Path) -> None:
    """read_events refuses a rotated segment that ends in half a line, naming the segment and line."""
    path = tmp_path / "t.jsonl"
    writer = Writer(path, max_bytes=600)
    writer.append(8)
    writer.log.close()
    segment = rotated(path)[0][1]
    segment.write_bytes(segment.read_bytes() + b'{"crc":"0000')
    lines = segment.read_bytes().count(b"\n")
    with pytest.raises(LogCorrupted, match=rf"{segment.name}:{lines + 1}: .*unterminated"):
        list(read_events(path))


# -- a truncated or replaced file ------------------------------------------------------------


def test_a_file_truncated_and_rewritten_is_read_again_without_repeats(tmp_path: Path) -> None:
    """A file cut back below what was read is read again from its start; the events already handed out are skipped."""
    path = tmp_path / "t.jsonl"
    with EventLog(path, fsync=False) as log:
        for seq in range(1, 6):
            log.append(raw_event(EventKind.USAGE_OBSERVED, seq, "e", 0, {"usage": {"weights": seq}}))
    text = path.read_bytes()
    tail = _tail(path)
    assert _seqs(tail.read_available()) == [1, 2, 3, 4, 5]
    with open(path, "r+b") as fh:  # cut to three lines in place (same file), then two more appended
        fh.truncate(sum(len(x) + 1 for x in text.split(b"\n")[:3]))
    with open(path, "ab") as fh:
        for seq in (4, 5, 6):  # longer lines than before: the old end of line 5 falls inside the new line 5
            fh.write(encode_line(raw_event(EventKind.USAGE_OBSERVED, seq, "e", 0, {"usage": {"weights": 10**9}})))
    assert os.path.getsize(path) > len(text)  # the size alone does not show the cut
    got = tail.read_available()
    tail.close()
    assert _seqs(got) == [6]


def test_a_shrunk_file_is_read_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file that became shorter than what was read is read from its start, with a warning."""
    path = tmp_path / "t.jsonl"
    lines = [encode_line(raw_event(EventKind.USAGE_OBSERVED, s, "e", 0, {"usage": {"w": s}})) for s in range(1, 5)]
    path.write_bytes(b"".join(lines))
    tail = _tail(path)
    assert _seqs(tail.read_available()) == [1, 2, 3, 4]
    with open(path, "r+b") as fh:
        fh.truncate(len(lines[0]))
    with caplog.at_level(logging.WARNING):
        assert tail.read_available() == []
    assert "shrank" in caplog.text
    with open(path, "ab") as fh:
        fh.write(b"".join(lines[1:]))
        fh.write(encode_line(raw_event(EventKind.CLOSED, 5, "e", 0, {})))
    assert _seqs(tail.read_available()) == [5]
    tail.close()


def test_a_log_replaced_by_a_new_one_is_followed_from_its_start(tmp_path: Path) -> None:
    """A log file replaced (a new file renamed over it) by a new log is followed from its event #1."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        b"".join(encode_line(raw_event(EventKind.USAGE_OBSERVED, s, "e", 0, {"usage": {"w": s}})) for s in (1, 2, 3))
    )
    tail = _tail(path)
    assert _seqs(tail.read_available()) == [1, 2, 3]
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_bytes(b"".join(encode_line(raw_event(EventKind.OPENED, s, "e", 0, {})) for s in (1, 2)))
    os.replace(fresh, path)
    got = tail.read_available()
    tail.close()
    assert _seqs(got) == [1, 2] and got[0].kind is EventKind.OPENED


# -- resume after a sequence number --------------------------------------------------------------


def test_resume_after_every_sequence_number_across_segments(tmp_path: Path) -> None:
    """Tail(after=N) hands out exactly N+1..last for every N, wherever N falls among the segments."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=700)
    writer.append(40)
    writer.log.close()
    assert len(segments(path)) > 4
    for after in range(writer.last + 2):
        with _tail(path, after) as tail:
            assert _seqs(tail.read_available()) == list(range(after + 1, writer.last + 1)), after


def test_resume_inside_a_segment_reads_no_older_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming after N opens only the segment holding N+1 and those after it, not the older ones."""
    import torpor.statemachine.log.tail as tail_module

    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=700)
    writer.append(40)
    writer.log.close()
    found = rotated(path)
    opened: list[Path] = []
    real = tail_module.batches

    def spy(file: Path, max_line: int, torn: list[int]) -> Iterator[list[bytes]]:
        opened.append(file)
        return real(file, max_line, torn)

    monkeypatch.setattr(tail_module, "batches", spy)
    first, segment = found[2]
    with _tail(path, first) as tail:
        assert _seqs(tail.read_available()) == list(range(first + 1, writer.last + 1))
    assert opened == [p for _, p in found[2:]]
    assert segment in opened


# -- a reader that hangs up ----------------------------------------------------------------------


def test_a_reader_that_stops_midway_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A consumer that stops iterating partway (hangs up) gets the rest, once each, on its next read."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=900)
    writer.append(30)
    tail = _tail(path)
    got: list[int] = []
    for event in tail.events():
        got.append(event.seq)
        if len(got) == 11:
            break  # the generator is dropped mid-file
    writer.append(5)
    got += _seqs(tail.read_available())
    tail.close()
    assert got == list(range(1, writer.last + 1))


def test_follow_closed_early_releases_the_file(tmp_path: Path) -> None:
    """A follow() whose consumer stops early closes the log file it held; the writer goes on unharmed."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=900, keep=1)
    writer.append(3)
    before = len(os.listdir("/proc/self/fd"))
    stream = follow(path, poll=0.01)
    assert next(stream).seq == 1
    assert len(os.listdir("/proc/self/fd")) == before + 1  # it holds the log open
    stream.close()
    assert len(os.listdir("/proc/self/fd")) == before
    writer.append(50)  # rotations and pruning after the reader left
    assert read_events(path)  # readable


def test_a_tail_left_open_never_stops_rotation_or_pruning(tmp_path: Path) -> None:
    """A reader that holds the log open and never reads again does not stop the writer rotating and pruning."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=600, keep=1)
    writer.append(2)
    idle = _tail(path)
    idle.read_available()  # now holds the active file
    writer.append(200)
    assert len(rotated(path)) == 1
    assert [e.seq for e in read_events(path)][-1] == writer.last
    idle.close()


# -- errors name the real file and line ------------------------------------------------------------


def test_a_bad_line_after_incremental_reads_names_its_real_line(tmp_path: Path) -> None:
    """A bad line met after several reads is reported at its line in the file, by the Follower and by LogSource."""
    path = tmp_path / "e.rank0.jsonl"
    writer = Writer(path)
    writer.append(4)
    source = LogSource(path, poll=60)
    follower = Follower(path)
    try:
        assert _seqs(follower.read_available()) == [1, 2, 3, 4]
        writer.append(3)
        assert source.refresh() == 3 and len(follower.read_available()) == 3
        with open(path, "ab") as fh:
            fh.write(b'{"crc":"00000000","schema":1}\n')
        with pytest.raises(LogCorrupted, match=rf"{path.name}:8: "):
            follower.read_available()
        assert source.refresh() == 0
        assert isinstance(source.error, LogCorrupted)
        assert (source.error.path, source.error.line) == (str(path), 8)
    finally:
        source.close()
        follower.close()


def test_a_bad_line_in_a_rotated_segment_names_the_segment(tmp_path: Path) -> None:
    """A bad line in a rotated segment is reported with the segment's name and its line there, by every reader."""
    path = tmp_path / "e.rank0.jsonl"
    writer = Writer(path, max_bytes=900)
    writer.append(20)
    writer.log.close()
    segment = rotated(path)[1][1]
    lines = segment.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"weights", b"weightz")
    segment.write_bytes(b"\n".join(lines))
    follower = Follower(path)
    readers = (
        lambda: list(read_events(path)),
        lambda: [follower.read_available() for _ in range(2)],  # the events before it, then the error
        lambda: LogSource(path),
    )
    for read in readers:
        with pytest.raises(LogCorrupted) as caught:
            read()
        assert (caught.value.path, caught.value.line) == (str(segment), 3)
    follower.close()


def test_an_empty_active_file_after_a_crash_mid_rotation_reads_the_segments(tmp_path: Path) -> None:
    """A crash right after a rotation renamed the active file leaves it empty: a follower reads the segments."""
    path = tmp_path / "r.jsonl"
    writer = Writer(path, max_bytes=700)
    writer.append(12)
    writer.log.close()
    last_file = path.read_bytes()
    first = int(last_file.split(b'"seq":')[1].split(b",")[0].rstrip(b"}"))
    os.replace(path, path.with_name(f"{path.name}.{first:012d}"))
    path.write_bytes(b"")  # the new active file got no line before the crash
    with Follower(path) as follower:
        assert _seqs(follower.read_available()) == list(range(1, writer.last + 1))
    assert _seqs(list(read_events(path))) == list(range(1, writer.last + 1))
