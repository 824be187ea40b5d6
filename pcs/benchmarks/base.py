"""What every benchmark provides to the runner: samples in, per-sample scores and metrics out."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    id: str
    prompt: str                     # the user turn (the runner applies the chat template if configured)
    max_new_tokens: int
    meta: dict = field(default_factory=dict)   # copied into predictions.jsonl (references, grid cell, ...)


class Benchmark:
    """Interface: ``check()`` fails fast before the model loads; ``samples()`` needs the tokenizer."""
    name: str

    def check(self) -> None:
        """Raise ValueError/FileNotFoundError naming the bad value, before anything heavy runs."""

    def samples(self, tokenizer) -> list[Sample]:
        raise NotImplementedError

    def score(self, sample: Sample, prediction: str) -> float:
        """The sample's score on the benchmark's 0-100 scale."""
        raise NotImplementedError

    def metrics(self, rows: list[dict]) -> dict:
        """Headline ``score`` and details from the predictions.jsonl rows."""
        raise NotImplementedError
