"""What every benchmark provides to the runner: samples in, per-sample scores and metrics out."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..prompts import PromptIds, encode_prompt


@dataclass
class Sample:
    id: str
    prompt: str                     # the user turn, before the chat template
    max_new_tokens: int
    meta: dict = field(default_factory=dict)   # copied into predictions.jsonl (references, grid cell, ...)
    chat: bool = True               # wrap in the model's chat template (if the model config asks for it)
    question: str = ""              # the prompt's tail to feed after compression ("" = compress it all)
    stop_texts: tuple[str, ...] = ()   # extra stops: the last token of each string ends generation
    min_new_tokens: int = 0         # stops cannot end generation before this many tokens


class Benchmark:
    """Interface: ``check()`` fails fast before the model loads; ``samples()`` may need the tokenizer."""
    name: str

    def check(self) -> None:
        """Raise ValueError/FileNotFoundError naming the bad value, before anything heavy runs."""

    def samples(self, tokenizer) -> list[Sample]:
        raise NotImplementedError

    def encode(self, sample: Sample, tokenizer, model_cfg) -> PromptIds:
        """Token ids of a sample's prompt (a benchmark may truncate it first)."""
        return encode_prompt(tokenizer, sample.prompt, model_cfg, use_chat=sample.chat, question=sample.question)

    def score(self, meta: dict, prediction: str) -> float:
        """A sample's score on the benchmark's 0-100 scale, from its ``meta`` (or its saved row)."""
        raise NotImplementedError

    def metrics(self, rows: list[dict]) -> dict:
        """Headline ``score`` and details from the predictions.jsonl rows."""
        raise NotImplementedError
