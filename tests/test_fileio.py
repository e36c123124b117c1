"""rollout.fileio.atomic_write: readers see the old file or the new one, never a torn one."""
import os

import pytest

from rollout.fileio import atomic_write


def test_writes_bytes_and_text_and_creates_parents(tmp_path):
    path = atomic_write(tmp_path / "a" / "b" / "x.bin", b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    atomic_write(path, "héllo\n")
    assert path.read_bytes() == "héllo\n".encode("utf-8")
    assert sorted(os.listdir(path.parent)) == ["x.bin"]          # no temporary file left behind


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    atomic_write(path, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_the_new_content_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """The rename must not be able to overtake the data (a crash would leave an empty file)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    atomic_write(tmp_path / "f", "x")
    assert events[:2] == ["fsync", "replace"]


def test_files_honour_the_umask_not_private(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
