"""Turn a benchmark's user text into model input ids, with or without the chat template."""
from __future__ import annotations

from typing import NamedTuple


class PromptIds(NamedTuple):
    context: list[int]                 # prefilled, then compressed
    question: list[int] | None         # fed on the compressed cache, or None
    follow_ups: tuple[list[int], ...] = ()   # each fed on its own copy of the compressed cache instead


def chat_kwargs(model_cfg) -> dict:
    """The model's own arguments to its chat template (``model.chat_template_kwargs``: Qwen3's
    ``enable_thinking``)."""
    return dict(model_cfg.get("chat_template_kwargs") or {})


def encode_prompt(tokenizer, text: str, model_cfg, use_chat: bool = True, question: str = "",
                  special_tokens_after_chat: bool = False, answer_prefix: str = "",
                  completion_cue: str = "", tail_after: bool = False) -> PromptIds:
    """The chat template adds its own special tokens; plain text gets the tokenizer's (the BOS).
    ``special_tokens_after_chat`` adds the tokenizer's to the chat-formatted text too, as LongBench's
    ``pred.py`` does (a tokenizer that adds a BOS then starts with two).

    With ``question`` (a tail of ``text``), everything from its last occurrence on, chat suffix
    included, is tokenized separately and returned as ``question``. If the text no longer contains
    it (middle truncation cut into it), the whole prompt is the context. ``answer_prefix`` is put after
    the chat template's assistant header (the start of the answer, as RULER and kvpress prompt);
    ``completion_cue`` goes before it where no chat template applies (a pretrained model's prompt, which must
    end where an answer starts, e.g. "Answer:"). ``tail_after`` with no ``question``: the user's text is compressed
    and what follows it (the chat template's tail, the answer prefix) is fed after compression, as kvpress's
    pipeline feeds it with ``--query_aware`` (its ``preprocess`` splits the rendered template where the user's
    text ends).
    """
    chat = bool(model_cfg.chat_template and use_chat and tokenizer.chat_template)
    user = text
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, **chat_kwargs(model_cfg))
    user_end = text.rfind(user) + len(user) if tail_after and not question else None
    if user_end is not None and user_end < len(user):
        raise ValueError("the model's chat template rewrites the user's text: its tail cannot be fed apart")
    text += ("" if chat else completion_cue) + answer_prefix
    special = special_tokens_after_chat or not chat
    split = text.rfind(question) if question else user_end if user_end is not None and user_end < len(text) else -1
    if split <= 0:
        return PromptIds(tokenizer(text, add_special_tokens=special).input_ids, None)
    context = tokenizer(text[:split], add_special_tokens=special).input_ids
    tail = tokenizer(text[split:], add_special_tokens=False).input_ids
    return PromptIds(context, tail)


def follow_up_ids(tokenizer, prompt: PromptIds, text: str, model_cfg, follow_ups, use_chat: bool = True,
                  question: str = "", answer_prefix: str = "", completion_cue: str = "",
                  reply: str = "") -> tuple[list[int], ...]:
    """The ids fed after compression for each follow-up ``(question, answer_prefix)`` of a prompt, on a copy of the
    cache of ``prompt`` (``encode_prompt(text, ...)``'s) compresses. With the prompt's own ``question`` kept out of compression,
    a follow-up takes its place: the prompt with its question replaced, less the compressed context (which must
    tokenize alike). With the question inside, a follow-up is the conversation's next turn: the assistant's
    ``reply`` to the first question (its reference answer, after ``answer_prefix``), then the follow-up as the
    next user turn (without a chat template: a new paragraph), each follow-up with the same history."""
    chat = bool(model_cfg.chat_template and use_chat and tokenizer.chat_template)
    if question and prompt.question is None:
        raise ValueError("the prompt no longer holds its question: it has no follow-ups")
    out = []
    for asked, prefix in follow_ups:
        if question:
            own = encode_prompt(tokenizer, text[:text.rfind(question)] + asked, model_cfg, use_chat, asked,
                                answer_prefix=prefix, completion_cue=completion_cue)
            if own.context != prompt.context:
                raise ValueError(f"a follow-up question changes how the context before it tokenizes: {asked!r}")
            out.append(own.question)
            continue
        if chat:
            turns = [{"role": "user", "content": text}, {"role": "assistant", "content": answer_prefix + reply},
                     {"role": "user", "content": asked}]
            render = lambda t: tokenizer.apply_chat_template(t, tokenize=False, add_generation_prompt=True,
                                                             **chat_kwargs(model_cfg))
            compressed, whole = render(turns[:1]) + answer_prefix, render(turns) + prefix
        else:
            compressed = text + completion_cue + answer_prefix
            whole = compressed + reply + "\n\n" + asked + completion_cue + prefix
        if not whole.startswith(compressed):
            raise ValueError("the model's chat template rewrites the first answer when a turn follows it, so a "
                             "follow-up cannot continue the compressed prompt: use benchmark.query_aware=false")
        out.append(tokenizer(whole[len(compressed):], add_special_tokens=False).input_ids)
    return tuple(out)


# KVzip's requests to repeat the context (its paper's, as kvpress 0.5.5's KVzipPress.prepare writes them), and how
# many of the previous chunk's last tokens a later chunk's request quotes.
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_LATER = "\n\nRepeat the part of the previous context exactly, starting with"
REPEAT_QUOTED = 8


class RepeatPrompt(NamedTuple):
    """What a reconstruction (KVzip's scoring) feeds after a prompt: the request to repeat the context, the chat
    template's tail that opens the answer, and how many of the prompt's first tokens are the template's head (not
    context: never repeated). From the tokenizer alone, whatever the prompt: kvpress's KVzipPress renders the
    template around a dummy context (``__call__``), which this does; a run without a chat template has no head
    and ``"\\n"`` as its tail."""
    head: int
    first: list[int]          # the first chunk's request
    later: list[int]          # a later chunk's, before the quoted tokens
    tail: list[int]

    def request(self, chunks: list[list[int]], i: int) -> list[int]:
        """The ids fed to have chunk ``i`` of ``chunks`` repeated: its request, the tail, then the chunk."""
        if i == 0:
            return self.first + self.tail + chunks[0]
        return self.later + chunks[i - 1][-REPEAT_QUOTED:] + self.tail + chunks[i]


def repeat_prompt(tokenizer, model_cfg, use_chat: bool = True) -> RepeatPrompt:
    """The ``RepeatPrompt`` of a model's tokenizer (``use_chat``: whether its runs use the chat template)."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    head, tail = "", "\n"
    if model_cfg.chat_template and use_chat and tokenizer.chat_template:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], tokenize=False,
                                                 add_generation_prompt=True, **chat_kwargs(model_cfg))
        before, tail = rendered.split(separator)
        head = before.split(dummy)[0]
    return RepeatPrompt(len(encode(head)), encode(REPEAT_FIRST), encode(REPEAT_LATER), encode(tail))
