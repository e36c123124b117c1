"""Tasks: deterministic sampling and rewards on hand-written completions."""
import pytest

from trainers.codec import ByteCodec
from trainers.tasks import DOMAINS, Task, TaskConfig, TaskSampler, first_integer, score


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_every_registered_domain_rewards_its_own_answer_and_only_that(name):
    """A domain whose generator and scorer disagree gives RL no signal (or a wrong one)."""
    cfg = TaskConfig(domains=(name,), operations="+-*")
    tasks = TaskSampler(cfg).sample(40, step=0)
    for task, other in zip(tasks, tasks[1:] + tasks[:1]):
        assert task.domain == name
        assert score(task, task.answer) == 1.0, task
        assert score(task, f"My answer: {task.answer}") == 1.0, task
        if other.answer != task.answer:
            assert score(task, other.answer) == 0.0, (task, other.answer)
    assert len({t.answer for t in tasks}) > 5          # the generator varies its tasks


def test_sampling_is_deterministic_per_seed_and_step():
    s = TaskSampler(TaskConfig(seed=3))
    assert s.sample(8, step=5) == s.sample(8, step=5)
    assert s.sample(8, step=5) != s.sample(8, step=6)
    assert TaskSampler(TaskConfig(seed=4)).sample(8, 5) != s.sample(8, 5)


def test_sampling_covers_domains_and_respects_weights():
    tasks = TaskSampler(TaskConfig()).sample(300, step=0)
    assert {t.domain for t in tasks} == {"arithmetic", "reverse", "uppercase"}
    only = TaskSampler(TaskConfig(domains=("arithmetic", "reverse"), weights=(1.0, 0.0))).sample(50, 0)
    assert {t.domain for t in only} == {"arithmetic"}


def test_generated_answers_are_correct():
    for t in TaskSampler(TaskConfig(operations="+-*")).sample(60, step=1):
        if t.domain == "arithmetic":
            expr = t.prompt.removeprefix("What is ").split("?")[0]
            assert str(eval(expr)) == t.answer  # noqa: S307 - our own generated expression
        word = t.prompt.split("'")[1] if t.domain != "arithmetic" else None
        if t.domain == "reverse":
            assert t.answer == word[::-1]
        if t.domain == "uppercase":
            assert t.answer == word.upper()


@pytest.mark.parametrize("text,expected", [
    ("42", 1.0), ("The answer is 42.", 1.0), ("17+25 = 42", 1.0), ("17 + 25 is 42.", 1.0), ("17+25 = 43", 0.0),
    ("117+25 = 42", 0.0), ("1. Well, 42", 0.0), ("forty-two", 0.0), ("4,2", 1.0), ("", 0.0),
])
def test_arithmetic_reward(text, expected):
    assert score(Task("arithmetic", "What is 17+25? Answer with a number.", "42"), text) == expected


def test_arithmetic_reward_negative_numbers():
    assert score(Task("arithmetic", "What is 3-10?", "-7"), "-7") == 1.0
    assert score(Task("arithmetic", "What is 3-10?", "-7"), "7") == 0.0
    assert score(Task("arithmetic", "What is 3-10?", "-7"), "3 - 10 = -7") == 1.0


@pytest.mark.parametrize("text,expected", [
    ("elbat", 1.0), ("The reversed word is 'Elbat'.", 1.0), ("table", 0.0), ("elbats", 0.0), ("e l b a t", 0.0),
])
def test_reverse_reward(text, expected):
    assert score(Task("reverse", "Reverse the letters of the word 'table'.", "elbat"), text) == expected


@pytest.mark.parametrize("text,expected", [("TABLE", 1.0), ("Sure: TABLE!", 1.0), ("Table", 0.0), ("TABLES", 0.0)])
def test_uppercase_reward(text, expected):
    assert score(Task("uppercase", "Write the word 'table' in uppercase letters.", "TABLE"), text) == expected


def test_first_integer():
    assert first_integer("x -12 and 5") == -12
    assert first_integer("none") is None


@pytest.mark.parametrize("kwargs,word", [
    (dict(domains=("algebra",)), "algebra"), (dict(domains=()), "domains"),
    (dict(weights=(1.0,)), "weights"), (dict(operations="/"), "operations"), (dict(max_operand=0), "max_operand"),
])
def test_bad_task_config_names_the_problem(kwargs, word):
    with pytest.raises(ValueError, match=word):
        TaskConfig(**kwargs)


def test_byte_codec_roundtrip_and_bad_vocab():
    c = ByteCodec(288)
    ids = c.encode_prompt("Reverse 'café'")
    assert max(ids) < 256 and c.decode(ids) == "Reverse 'café'"
    assert c.decode(ids + [270]) == "Reverse 'café'"
    with pytest.raises(ValueError, match="vocab_size"):
        ByteCodec(64)
