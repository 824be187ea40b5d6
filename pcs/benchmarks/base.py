"""What every benchmark provides to the runner: samples in, per-sample scores and metrics out."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..generate import greedy_generate
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


@dataclass
class RunContext:
    """The loaded pieces a benchmark works with, built once per run by the runner."""
    model: object
    tokenizer: object
    method: object
    stop_token_ids: set[int]
    cfg: object                     # the run's whole config


class Benchmark:
    """Interface: ``check()`` fails fast before the model loads; ``samples()`` may need the tokenizer;
    ``run_sample`` turns one sample into its predictions.jsonl row (greedy generation by default)."""
    name: str
    uses_selection = True           # False: the benchmark compares selections itself
    annotation_keys: tuple[str, ...] = ()   # benchmark knobs that judge outputs without changing them

    def __init__(self, cfg):
        self.run_cfg = cfg              # the whole config
        self.cfg = cfg.benchmark        # this benchmark's group

    def check(self) -> None:
        """Raise ValueError/FileNotFoundError naming the bad value, before anything heavy runs."""

    def samples(self, tokenizer) -> list[Sample]:
        raise NotImplementedError

    def encode(self, sample: Sample, tokenizer, model_cfg) -> PromptIds:
        """Token ids of a sample's prompt (a benchmark may truncate it first)."""
        return encode_prompt(tokenizer, sample.prompt, model_cfg, use_chat=sample.chat, question=sample.question)

    def run_sample(self, sample: Sample, ctx: RunContext) -> dict:
        """Generate an answer; the row's timing and size fields (DESIGN.md) plus ``prediction`` and ``score``."""
        tokenizer = ctx.tokenizer
        prompt = self.encode(sample, tokenizer, ctx.cfg.model)
        stops = ctx.stop_token_ids | {tokenizer.encode(t, add_special_tokens=False)[-1] for t in sample.stop_texts}
        gen = greedy_generate(ctx.model, prompt.context, ctx.method, sample.max_new_tokens, stops,
                              question_ids=prompt.question, min_new_tokens=sample.min_new_tokens,
                              trigger=ctx.cfg.compress.trigger)
        prediction = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        return {"prediction": prediction, "score": self.score(sample.meta, prediction),
                "prompt_tokens": gen.prompt_tokens,
                "question_tokens": 0 if prompt.question is None else prompt.question.shape[1],
                "new_tokens": len(gen.token_ids),
                "kv_cache_bytes": gen.kv_cache_bytes, "kv_cache_bytes_full": gen.kv_cache_bytes_full,
                "peak_kv_bytes": gen.peak_kv_bytes,
                "max_kv_entries": gen.max_kv_entries, "n_compressions": gen.n_compressions,
                "prefill_s": round(gen.prefill_s, 4), "decode_s": round(gen.decode_s, 4)}

    def score(self, meta: dict, prediction: str) -> float:
        """A sample's score on the benchmark's 0-100 scale, from its ``meta`` (or its saved row)."""
        raise NotImplementedError

    def metrics(self, rows: list[dict]) -> dict:
        """Headline ``score`` and details from the predictions.jsonl rows."""
        raise NotImplementedError

    def data_hashes(self) -> dict:
        """SHA-256 of the data and prompt templates the samples come from (provenance)."""
        return {}

    def finish(self, rows: list[dict], metrics: dict, run_dir: Path) -> None:
        """Once every sample is done, before ``metrics.json`` is written: write extra files next to
        it (plots, outputs in another tool's format) and add what they yield to ``metrics``."""
