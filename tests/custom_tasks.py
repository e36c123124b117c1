"""A user's own task source for `tasks.source=tests.custom_tasks:make_tasks` (tests only)."""
from trainers.tasks import extract_answer


def reward(completion: str, item: dict) -> float:
    """1 when the extracted answer is the item's answer, else 0."""
    return float(extract_answer(completion) == item["answer"])


def make_tasks():
    """(items, reward_fn): 'repeat the number' questions."""
    items = [{"question": f"Repeat the number {i}.", "answer": str(i), "dataset": "echo" if i % 2 else ""}
             for i in range(12)]
    return items, reward


def bad_shape():
    return [{"question": "q", "answer": "a"}]


def no_answer():
    return [{"question": "q"}], reward
