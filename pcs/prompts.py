"""Turn a benchmark's user text into model input ids, with or without the chat template."""
from __future__ import annotations

from typing import NamedTuple


class PromptIds(NamedTuple):
    context: list[int]                 # prefilled, then compressed
    question: list[int] | None         # fed on the compressed cache, or None


def encode_prompt(tokenizer, text: str, model_cfg, use_chat: bool = True, question: str = "",
                  special_tokens_after_chat: bool = False, answer_prefix: str = "",
                  completion_cue: str = "") -> PromptIds:
    """The chat template adds its own special tokens; plain text gets the tokenizer's (the BOS).
    ``special_tokens_after_chat`` adds the tokenizer's to the chat-formatted text too, as LongBench's
    ``pred.py`` does (a tokenizer that adds a BOS then starts with two).

    With ``question`` (a tail of ``text``), everything from its last occurrence on, chat suffix
    included, is tokenized separately and returned as ``question``. If the text no longer contains
    it (middle truncation cut into it), the whole prompt is the context. ``answer_prefix`` is put after
    the chat template's assistant header (the start of the answer, as RULER and kvpress prompt);
    ``completion_cue`` goes before it where no chat template applies (a pretrained model's prompt, which must
    end where an answer starts, e.g. "Answer:").
    """
    chat = bool(model_cfg.chat_template and use_chat and tokenizer.chat_template)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    text += ("" if chat else completion_cue) + answer_prefix
    special = special_tokens_after_chat or not chat
    split = text.rfind(question) if question else -1
    if split <= 0:
        return PromptIds(tokenizer(text, add_special_tokens=special).input_ids, None)
    context = tokenizer(text[:split], add_special_tokens=special).input_ids
    tail = tokenizer(text[split:], add_special_tokens=False).input_ids
    return PromptIds(context, tail)
