"""Byte-level BPE tokenizers rebuilt from GGUF vocabularies, chat-template rendering, and the check
that text handed to them is UTF-8."""
from __future__ import annotations

import json
import warnings
from datetime import datetime

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4


def _byte_level() -> pre_tokenizers.PreTokenizer:
    # GPT-2's regex split, then bytes -> printable unicode
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm"/"starcoder" pre-tokenizer: every digit on its own, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# tokenizer.ggml.pre -> pre-tokenizer; only the ones whose split rule we reproduce exactly
PRE_TOKENIZERS = {
    "gpt2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
}


def bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int] | None = None,
                  pre: str = "gpt2", bos_token_id: int | None = None, add_bos: bool = False) -> Tokenizer:
    """A byte-level BPE Tokenizer from GGUF's tokenizer.ggml.{tokens,merges,token_type,pre}.

    CONTROL tokens become special added tokens (matched whole, skipped by decode(skip_special_tokens));
    USER_DEFINED ones become plain added tokens.
    """
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZERS)})")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    if add_bos and bos_token_id is not None:
        bos = tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = token_types or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == TOKEN_USER_DEFINED])
    if len(vocab) != len(tokens):
        warnings.warn(f"GGUF vocabulary repeats {len(tokens) - len(vocab)} token strings; "
                      "their later ids are never produced by encode")
    return tok


def check_text(text: str, where: str) -> str:
    """`text` unchanged, or a ValueError naming `where` and the byte offset of the first byte that is
    not UTF-8: invalid bytes on a command line or in a file reach Python as lone surrogates
    (surrogateescape), which the tokenizer refuses with a TypeError that names nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        pos, code = len(text[:e.start].encode("utf-8")), ord(text[e.start])
        shown = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ValueError(f"{where} is not valid UTF-8 text: {shown} at byte position {pos}") from None
    return text


# ---------------------------------------------------------------------------------------------
# Chat templates

# ChatML without a default system prompt: used when a model ships no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise(message: str):
    raise TemplateError(message)


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                **variables) -> str:
    """Render an HF chat template (Jinja2, sandboxed, HF's whitespace settings) to a prompt string."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template or CHATML_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def apply_chat_template(tokenizer_or_loaded, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None) -> list[int]:
    """Prompt token ids for `messages`, rendered with the model's own template (ChatML if it has none).

    Accepts a LoadedModel (uses its tokenizer and chat_template) or a bare tokenizers.Tokenizer.
    Special tokens come from the template text itself, as in HF (no BOS is added on top).
    """
    tokenizer = getattr(tokenizer_or_loaded, "tokenizer", tokenizer_or_loaded)
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError("apply_chat_template needs a tokenizers.Tokenizer or a LoadedModel with one")
    for i, message in enumerate(messages):
        if isinstance(message.get("content"), str):
            check_text(message["content"], f"message {i} ({message.get('role', '?')})")
    template = chat_template or getattr(tokenizer_or_loaded, "chat_template", None)
    config = getattr(tokenizer_or_loaded, "config", None)
    variables = {}
    if config is not None:
        eos = config.eos_token_ids[0] if config.eos_token_ids else None
        variables = {"bos_token": tokenizer.id_to_token(config.bos_token_id) if config.bos_token_id is not None else "",
                     "eos_token": tokenizer.id_to_token(eos) if eos is not None else ""}
    text = render_chat(template, messages, add_generation_prompt, **variables)
    return tokenizer.encode(text, add_special_tokens=False).ids
