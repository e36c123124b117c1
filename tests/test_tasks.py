"""The task source: reasoning-gym prompt sets, answer extraction and scoring, deterministic
epochs, the held-out split, custom `module:function` sources and named config errors."""
import pytest

from trainers.tasks import (TaskConfig, TaskSource, extract_answer, largest_remainder, num_rl_steps)

DEFAULT_MIX = TaskConfig().datasets
SMALL = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def source(**kw) -> TaskSource:
    return TaskSource(TaskConfig(**{"num_prompts": 12, "heldout_prompts": 8, **kw}))


@pytest.fixture(scope="module")
def default_source() -> TaskSource:
    return TaskSource(TaskConfig(num_prompts=16, heldout_prompts=8))


@pytest.mark.parametrize("name", DEFAULT_MIX)
def test_each_default_dataset_scores_right_wrong_and_missing_answers(default_source, name):
    tasks = [t for t in default_source.train if t.domain == name]
    assert len(tasks) == 4
    for t in tasks:
        assert default_source.score(t, f"Let me think.\nSome steps.\nAnswer: {t.answer}") == 1.0
        assert default_source.score(t, f"Answer: {t.answer}0x") < 1.0          # wrong: at most partial credit
        assert default_source.score(t, "I will not say, sorry.") == 0.0          # the right answer nowhere
        assert default_source.score(t, "") == 0.0


@pytest.mark.parametrize("text,expected", [
    ("no answer here", None), ("Answer: 1\nmore\nAnswer: 42", "42"), ("**Answer:** 42.", "42"),
    ("answer:   -7  ", "-7"), ("The Answer: **elbat**", "elbat"), ("Answer: **", None), ("Answer:\n", None),
    ("So the answer is 12.", "12"), ("The final answer is: 7", "7"), ("To answer this, add 3 and 4", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_a_numeric_answer_falls_back_to_the_last_number_and_a_word_answer_does_not():
    s = source(datasets=("chain_sum", "spell_backward"), params=SMALL)
    num = next(t for t in s.train if t.domain == "chain_sum")
    word = next(t for t in s.train if t.domain == "spell_backward")
    assert s.score(num, f"3 + 4 = 99999, no wait, it is {num.answer}.") == 1.0
    assert s.score(num, f"{num.answer} is tempting, but it is 99999.") < 1.0
    assert s.score(word, f"Backwards it reads {word.answer}") == 0.0    # words need a stated answer


def test_last_answer_line_wins_and_bold_answers_score(default_source):
    t = next(t for t in default_source.train if t.domain == "chain_sum")
    assert default_source.score(t, f"Answer: {t.answer}\nAnswer: 99999") < 1.0
    assert default_source.score(t, f"Answer: 99999\n**Answer:** {t.answer}.") == 1.0


def test_format_reward_is_added_for_an_answer_line():
    s = source(datasets=("chain_sum",), params=SMALL, format_reward=0.1)
    t = s.train[0]
    assert s.score(t, "Answer: 99999") == pytest.approx(0.1)
    assert s.score(t, f"Answer: {t.answer}") == pytest.approx(1.1)
    assert s.score(t, "99999") == 0.0


def test_prompts_carry_question_instruction_and_item():
    s = source(instruction="Reply with Answer: <x>")
    for t in s.train:
        assert t.prompt.endswith("\n\nReply with Answer: <x>") and t.item["question"] in t.prompt
        assert t.answer == t.item["answer"] and t.domain == t.item["dataset"]


def test_same_seed_and_step_give_the_same_prompts_also_in_a_fresh_source():
    a, b = source(seed=3), source(seed=3)
    assert [a.sample(4, s) for s in range(8)] == [b.sample(4, s) for s in range(8)]   # a resumed run
    assert source(seed=4).sample(4, 0) != a.sample(4, 0)


def test_epochs_revisit_exactly_the_training_set_in_a_new_order():
    s = source()
    per_step = 4
    epoch = lambda e: [t for k in range(3) for t in s.sample(per_step, e * 3 + k)]     # noqa: E731  12 prompts
    first, second = epoch(0), epoch(1)
    key = lambda t: (t.domain, t.prompt)                                                # noqa: E731
    assert sorted(map(key, first)) == sorted(map(key, second)) == sorted(map(key, s.train))
    assert list(map(key, first)) != list(map(key, second))


def test_steps_straddling_an_epoch_boundary():
    s = source(num_prompts=5)
    flat = [t for k in range(5) for t in s.sample(3, k)]                                # 15 positions = 3 epochs
    for e in range(3):
        assert flat[5 * e:5 * e + 5] == [s.train[i] for i in s.epoch_order(e)]


def test_heldout_never_in_the_training_set_and_distinct():
    s = TaskSource(TaskConfig(datasets=("chain_sum",), params=SMALL, num_prompts=64, heldout_prompts=32))
    train = {t.item["question"] for t in s.train}
    held = [t.item["question"] for t in s.heldout]
    assert len(held) == len(set(held)) == 32 and not train & set(held)


def test_heldout_too_large_for_the_parameter_space_is_named():
    tiny = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    with pytest.raises(ValueError, match="tasks.heldout_prompts"):
        TaskSource(TaskConfig(datasets=("chain_sum",), params=tiny, num_prompts=10, heldout_prompts=500))


def test_weights_allocate_prompts_by_largest_remainder():
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]
    assert largest_remainder(64, [3, 1]) == [48, 16]
    assert largest_remainder(5, [0, 1]) == [0, 5]
    s = source(datasets=("chain_sum", "spell_backward"), weights=(3.0, 1.0), num_prompts=12, heldout_prompts=4)
    assert [t.domain for t in s.train].count("chain_sum") == 9 and len(s.train) == 12
    assert [t.domain for t in s.heldout].count("chain_sum") == 3
    only = source(datasets=("chain_sum", "spell_backward"), weights=(1.0, 0.0))
    assert {t.domain for t in only.train} == {"chain_sum"}


def test_params_reach_reasoning_gym():
    s = source(datasets=("chain_sum",), params=SMALL)
    assert all(t.item["metadata"]["num_terms"] == 2 and abs(int(t.answer)) <= 18 for t in s.train)


def test_num_rl_steps_from_prompts_and_epochs_unless_given():
    cfg = TaskConfig(num_prompts=64, epochs=2)
    assert num_rl_steps(cfg, 3) == 43 and num_rl_steps(cfg, 4) == 32 and num_rl_steps(cfg, 4, steps=20) == 20


# ------------------------------------------------------------------ custom sources

def test_custom_module_function_source():
    s = source(source="tests.custom_tasks:make_tasks", num_prompts=6, heldout_prompts=3, format_reward=0.5)
    assert len(s.train) == 6 and len(s.heldout) == 3 and {t.domain for t in s.train} <= {"echo", "custom"}
    assert not {t.prompt for t in s.train} & {t.prompt for t in s.heldout}
    t = s.train[0]
    assert s.score(t, f"Answer: {t.answer}") == 1.5 and s.score(t, "nothing") == 0.0


@pytest.mark.parametrize("spec,says", [
    ("tests.custom_tasks", "module.path:function"), ("tests.no_such_module:f", "cannot import"),
    ("tests.custom_tasks:missing", "has no 'missing'"), ("tests.custom_tasks:bad_shape", "must return"),
    ("tests.custom_tasks:no_answer", "must return"),
])
def test_bad_custom_source_is_named(spec, says):
    with pytest.raises(ValueError, match="tasks.source") as e:
        TaskSource(TaskConfig(source=spec, num_prompts=2, heldout_prompts=1))
    assert says in str(e.value) and spec in str(e.value) and "\n" not in str(e.value)


def test_custom_source_with_too_few_items_is_named():
    with pytest.raises(ValueError, match="too few"):
        TaskSource(TaskConfig(source="tests.custom_tasks:make_tasks", num_prompts=100, heldout_prompts=1))


# ------------------------------------------------------------------ config errors

@pytest.mark.parametrize("kwargs,says", [
    (dict(datasets=("chain_summ",)), "closest: chain_sum"),
    (dict(datasets=()), "tasks.datasets"),
    (dict(datasets=("chain_sum", "chain_sum")), "twice"),
    (dict(datasets=("chain_sum",), params={"chain_sum": {"min_terms": 5, "max_terms": 2}}),
     "tasks.params.chain_sum.*max_terms must be >= min_terms"),
    (dict(datasets=("chain_sum",), params={"chain_sum": {"bogus": 1}}), "tasks.params.chain_sum.*bogus"),
    (dict(weights=(1.0,)), "tasks.weights"), (dict(weights=(1.0, -1.0, 1.0, 1.0)), "tasks.weights"),
    (dict(weights=(0.0, 0.0, 0.0, 0.0)), "tasks.weights"),
    (dict(num_prompts=0), "tasks.num_prompts"), (dict(epochs=0), "tasks.epochs"),
    (dict(heldout_prompts=-1), "tasks.heldout_prompts"), (dict(eval_every=-1), "tasks.eval_every"),
    (dict(source="nocolon"), "tasks.source"),
])
def test_bad_task_config_is_named(kwargs, says):
    with pytest.raises(ValueError, match=says):
        TaskConfig(**kwargs)
