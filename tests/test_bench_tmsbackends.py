"""torpor.bench.tmsbackends off the GPU: the backend list, row names, region arguments, the disk folder, host bytes."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from torpor.bench import tmsbackends as tb
from torpor.errors import BadArgument
from torpor.tms.saver import TorchMemorySaver
from torpor.units import GiB


def _mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *lines: str) -> None:
    """Make ``lines`` the mount table tmsbackends reads."""
    table = tmp_path / "mounts"
    table.write_text("".join(f"{line} rw 0 0\n" for line in lines))
    monkeypatch.setattr(tb, "MOUNTS", table)


class RecordingSaver:
    """Records set_disk_backup_dir, the one saver call backup_dir makes."""

    def __init__(self) -> None:
        self.dirs: list[str] = []

    def set_disk_backup_dir(self, path: str) -> None:
        self.dirs.append(path)


def test_parse_backends_reads_a_comma_list_in_order_without_repeats() -> None:
    """`pinned,mmap,disk` is the three backends; spaces and a repeated name are dropped, the order kept."""
    assert tb.parse_backends("pinned,mmap,disk") == ("pinned", "mmap", "disk")
    assert tb.parse_backends(" disk , pinned,disk") == ("disk", "pinned")
    assert tb.TMS_BACKENDS == ("pinned", "mmap", "disk")


@pytest.mark.parametrize("text", ["pinned,nvme", "Pinned", "cuda"])
def test_an_unknown_backend_is_refused_naming_the_valid_ones(text: str) -> None:
    """A name that is no backend is refused (BadArgument) with the name and the list of valid backends."""
    with pytest.raises(BadArgument) as refused:
        tb.parse_backends(text)
    assert "pinned, mmap, disk" in str(refused.value)
    assert repr(text.rsplit(",", maxsplit=1)[-1]) in str(refused.value)


def test_an_empty_backend_list_is_refused() -> None:
    """`--tms-backends ,` names no backend: refused, not a run without the rows."""
    with pytest.raises(BadArgument, match="names none"):
        tb.parse_backends(" , ")


def test_pinned_rows_keep_their_names_and_the_others_add_the_backend() -> None:
    """The pinned rows are named as before the backends existed; mmap and disk rows add ' mmap' / ' disk'."""
    assert tb.row_name("torpor.tms", "pinned") == "torpor.tms"
    assert tb.row_name("torch_memory_saver", "pinned") == "torch_memory_saver"
    assert tb.row_name("torpor.tms", "mmap") == "torpor.tms mmap"
    assert tb.row_name("torch_memory_saver", "disk") == "torch_memory_saver disk"
    with pytest.raises(BadArgument):
        tb.row_name("torpor.tms", "nvme")


def test_weights_region_arguments_per_backend_are_keywords_of_the_saver() -> None:
    """pinned and mmap are a CPU backup of that backend, disk a disk backup, each its own tag; all bind to region()."""
    assert tb.weights_region("pinned") == {"tag": "weights", "enable_cpu_backup": True, "cpu_backup_backend": "pinned"}
    assert tb.weights_region("mmap") == {"tag": "weights-mmap", "enable_cpu_backup": True, "cpu_backup_backend": "mmap"}
    assert tb.weights_region("disk") == {"tag": "weights-disk", "enable_disk_backup": True}
    region = inspect.signature(TorchMemorySaver.region)
    for backend in tb.TMS_BACKENDS:
        region.bind(None, **tb.weights_region(backend))  # TypeError on a keyword TMS's region() does not take


def test_filesystem_is_the_deepest_mount_point_holding_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path's filesystem is that of its deepest mount point; a mount point's escaped space is read as a space."""
    _mounts(tmp_path, monkeypatch, "/dev/vda / ext4", "tmpfs /var/run\\040dir tmpfs", "none /var/r proc")
    assert tb.filesystem(Path("/var/run dir/x")) == "tmpfs"
    assert tb.filesystem(Path("/var/rundir/x")) == "ext4"  # /var/run dir is no prefix of it
    assert tb.filesystem(Path("/var/r")) == "proc"


def test_disk_parent_on_tmpfs_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk backup folder on tmpfs or ramfs is refused naming the filesystem and the option; nothing is created."""
    _mounts(tmp_path, monkeypatch, "/dev/vda / ext4", f"tmpfs {tmp_path} tmpfs")
    with pytest.raises(BadArgument, match=r"tmpfs.*--tms-disk-dir"):
        tb.disk_parent(tmp_path / "bench")
    assert not (tmp_path / "bench").exists()


def test_disk_parent_on_a_disk_is_made_when_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder on a disk is accepted and made; no folder named means /var/tmp."""
    _mounts(tmp_path, monkeypatch, "/dev/vda / ext4")
    assert tb.disk_parent(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()
    assert Path("/var/tmp") == tb.DEFAULT_DISK_PARENT


def test_backup_dir_is_fresh_set_on_the_saver_and_removed_even_after_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk backend gets a new folder under the parent, named to the saver, removed when the run ends or fails."""
    _mounts(tmp_path, monkeypatch, "/dev/vda / ext4")
    saver = RecordingSaver()
    with tb.backup_dir(saver, "disk", tmp_path) as first:
        assert first is not None and first.is_dir() and first.parent == tmp_path
        (first / "backup-0").write_bytes(b"x")
    with pytest.raises(RuntimeError), tb.backup_dir(saver, "disk", tmp_path) as second:
        raise RuntimeError("the run failed")
    assert saver.dirs == [str(first), str(second)] and first != second
    assert not first.exists() and second is not None and not second.exists()


@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_backup_dir_of_a_cpu_backend_calls_nothing(backend: str, tmp_path: Path) -> None:
    """pinned and mmap make no folder and do not call set_disk_backup_dir."""
    saver = RecordingSaver()
    with tb.backup_dir(saver, backend, tmp_path) as path:
        assert path is None
    assert saver.dirs == [] and list(tmp_path.iterdir()) == []


def test_host_watch_reports_the_rss_it_read_and_the_disk_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """held() is the most RSS growth while paused; the note gives it, the growth after resume and the backup files."""
    _mounts(tmp_path, monkeypatch, "/dev/vda / ext4")
    readings = iter([10 * GiB, 13 * GiB, 10 * GiB, 10 * GiB, 12 * GiB, 11 * GiB])
    monkeypatch.setattr(tb, "rss_bytes", lambda: next(readings))
    disk = tmp_path / "disk"
    disk.mkdir()
    watch = tb.HostWatch(disk)
    for size in (3, 5):
        watch.before_pause()
        (disk / "backup").write_bytes(b"x" * size)
        watch.while_paused()
        (disk / "backup").unlink()
        watch.after_resume()
    assert watch.paused == [3 * GiB, 2 * GiB] and watch.resumed == [0, GiB]
    assert watch.disk_paused == [(1, 3), (1, 5)] and watch.disk_left == 0
    assert watch.held() == 3 * GiB
    note = watch.note()
    assert "+3.00 GiB paused, +1.00 GiB after resume" in note
    assert "disk backup 0.00 GiB in 1 file(s) while paused (ext4), 0 left after resume" in note


def test_host_watch_without_cycles_says_nothing_was_measured() -> None:
    """No cycle, no reading: held() is 0 and the note says so rather than a figure."""
    watch = tb.HostWatch()
    assert watch.held() == 0 and watch.note() == "host: not measured (no cycle)"


def test_rss_bytes_is_this_process_resident_set() -> None:
    """rss_bytes reads a positive size that grows when the process touches memory."""
    before = tb.rss_bytes()
    block = b"\x01" * (64 << 20)  # written: resident
    assert tb.rss_bytes() - before >= 32 << 20
    del block
