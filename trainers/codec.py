"""Text <-> token ids for the RL loop: the model's own tokenizer, or bytes for tiny test models.

Tasks are text and rewards parse text, so the loop needs one object that renders a task
prompt into the ids the policy sees and decodes a completion back. Real models wrap the
user message in their chat template; tiny random models (tests, the smoke job) have no
tokenizer, so their ids are simply the UTF-8 bytes.
"""
from __future__ import annotations

from typing import Protocol

from rollout.models.loaders import LoadedModel, apply_chat_template


class TextCodec(Protocol):
    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteCodec:
    """ids = UTF-8 bytes; needs a vocabulary of at least 256. Ids >= 256 decode to nothing."""

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"ByteCodec needs vocab_size >= 256 (one id per byte), got {vocab_size}")

    def encode_prompt(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class ChatCodec:
    """The model's tokenizer, with the task as one user turn of its chat template."""

    def __init__(self, loaded: LoadedModel):
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source} ships no tokenizer: the RL loop cannot render task prompts")
        self.loaded = loaded

    def encode_prompt(self, text: str) -> list[int]:
        return apply_chat_template(self.loaded, [{"role": "user", "content": text}])

    def decode(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(list(ids), skip_special_tokens=True)
