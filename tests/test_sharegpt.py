"""ShareGPT parsing, the held-out split and the assistant mask (no network, no real model)."""
import json
from types import SimpleNamespace

import numpy as np
from tokenizers import pre_tokenizers

from mtp_heads.data.onpolicy import mix_prompts, sharegpt_prompts, task_prompts
from mtp_heads.data.sharegpt import (ChatEncoder, Conversation, iter_complete_records, load_conversations,
                                     loss_mask_of, parse_conversation, split_conversations)
from mtp_heads.data.splits import split_of
from rollout.models.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, bpe_tokenizer
from tests.conftest import tiny_config


def record(i: int, turns: int = 2) -> dict:
    roles = ["human", "gpt"]
    return {"id": f"conv{i}_0", "conversations": [{"from": roles[t % 2], "value": f"turn {t} of {i}"}
                                                 for t in range(turns)]}


def truncated_json(n: int) -> str:
    """A ShareGPT-like array of n records cut off in the middle of record n+1."""
    full = json.dumps([record(i) for i in range(n + 1)], indent=2)
    return full[:full.rindex('"value"')]


def test_parser_keeps_complete_records_and_drops_the_truncated_tail(tmp_path):
    text = truncated_json(5)
    with __import__("pytest").raises(json.JSONDecodeError):
        json.loads(text)
    records = list(iter_complete_records(text))
    assert [r["id"] for r in records] == [f"conv{i}_0" for i in range(5)]
    path = tmp_path / "sg.json"
    path.write_text(text)
    convs = load_conversations(path)
    assert [c.id for c in convs] == [f"conv{i}_0" for i in range(5)]
    assert convs[0].messages == ({"role": "user", "content": "turn 0 of 0"},
                                 {"role": "assistant", "content": "turn 1 of 0"})


def test_complete_array_and_malformed_records():
    text = json.dumps([record(0), {"id": "x", "conversations": [{"from": "alien", "value": "?"}]},
                       {"id": "y", "conversations": [{"from": "human", "value": "only a question"}]},
                       record(0), record(1)])
    assert len(list(iter_complete_records(text))) == 5
    parsed = [parse_conversation(r) for r in iter_complete_records(text)]
    assert [p.id if p else None for p in parsed] == ["conv0_0", None, None, "conv0_0", "conv1_0"]


def test_heldout_and_train_never_share_a_conversation():
    # pieces "<id>_0", "<id>_1" of one chat share a key and so a side
    convs = [Conversation(f"c{i}_{p}", ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}))
             for i in range(400) for p in range(2)]
    split = split_conversations(convs, 0.1, seed=3)
    train_keys = {c.key for c in split["train"]}
    held_keys = {c.key for c in split["heldout"]}
    assert held_keys and train_keys and not train_keys & held_keys
    assert 10 <= len(held_keys) <= 80
    assert len(split["train"]) + len(split["heldout"]) == len(convs)
    again = split_conversations(list(reversed(convs)), 0.1, seed=3)   # order of reading does not matter
    assert {c.key for c in again["heldout"]} == held_keys


def tiny_loaded():
    """A byte-level tokenizer with ChatML specials and a config whose EOS is <|im_end|>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet
    types = [TOKEN_CONTROL] * 3 + [TOKEN_NORMAL] * len(alphabet)
    tok = bpe_tokenizer(tokens, [], types)
    cfg = tiny_config(vocab_size=len(tokens), eos_token_ids=(2,), bos_token_id=None)
    return SimpleNamespace(tokenizer=tok, chat_template=None, config=cfg)


def test_assistant_mask_covers_assistant_text_and_its_eos_only():
    loaded = tiny_loaded()
    enc = ChatEncoder(loaded)
    msgs = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"})
    ids, assistant = enc.encode(msgs, max_len=1000)
    text = "".join(loaded.tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids[assistant])
    assert text == "yo!<|im_end|>ok<|im_end|>"
    assert loaded.tokenizer.decode(ids.tolist(), skip_special_tokens=False).startswith("<|im_start|>user\nhi")
    cut_ids, cut_mask = enc.encode(msgs, max_len=7)
    assert len(cut_ids) == 7 and (cut_ids == ids[:7]).all() and (cut_mask == assistant[:7]).all()
    mask = loss_mask_of(assistant)
    assert not mask[-1] and (mask[:-1] == assistant[1:]).all()


def test_onpolicy_prompts_follow_the_conversation_split():
    loaded = tiny_loaded()
    enc = ChatEncoder(loaded)
    convs = [Conversation(f"c{i}_0", ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}))
             for i in range(200)]
    chat = sharegpt_prompts(convs, enc, max_prompt_tokens=64)
    tasks = task_prompts([f"What is {i}+1?" for i in range(100)] * 2, enc)
    assert len(chat) == 200 and len(tasks) == 100
    held_convs = {c.key for c in split_conversations(convs, 0.1)["heldout"]}
    train = mix_prompts(chat, tasks, 0.2, "train", 0.1)
    held = mix_prompts(chat, tasks, 0.2, "heldout", 0.1)
    assert not {p.key for p in train} & {p.key for p in held}
    assert {p.key for p in held if not p.key.startswith("task:")} == held_convs
    assert all(split_of(p.key, 0.1) == "train" for p in train)
    assert 0.1 < np.mean([p.key.startswith("task:") for p in train]) < 0.3
