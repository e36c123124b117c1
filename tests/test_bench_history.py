"""The history-backend benchmark on a small stream: both backends (when arctic is installed) give the same
drafts, and bad settings are refused naming the key."""
import pytest

from experiments import bench_history
from rollout.engine.history import arctic_available


def test_small_streams_run_and_the_backends_draft_alike(capsys):
    assert bench_history.main(["prompts=2", "group=2", "tokens=24", "repeats=1"]) == 0
    out = capsys.readouterr().out
    assert "python  append" in out
    if arctic_available():
        assert "arctic  append" in out and "drafts equal between the backends: 1.000" in out
    with pytest.raises(ValueError, match="tokens"):
        bench_history.main(["tokens=0"])
