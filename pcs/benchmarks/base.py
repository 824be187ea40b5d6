"""What every benchmark provides to the runner: samples in, scores and metrics out.

A benchmark has no model code. It says what to ask (``samples``, ``encode``), which per-sample
``step`` answers it (``generate``: greedy decoding on the compressed cache; ``output_perturbation``:
the first decoding step measured on each variant's cache), which method configs that step runs
(``variants``: the run's own, unless the benchmark compares several), and how rows are scored
(``score``, ``metrics``) and presented (``finish``). Its class is named by its config file
(``pcs/conf/benchmark/<name>.yaml``, ``_target_``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from ..config import declared, load_class
from ..validation import validate
from ..errors import ConfigError
from ..prompts import PromptIds, encode_prompt, follow_up_ids


@dataclass(frozen=True)
class FollowUp:
    """A further question about the same context, answered from its own copy of the sample's compressed cache."""
    question: str                   # the question's text (a user turn of its own, or the prompt's question replaced)
    answer_prefix: str = ""         # its answer's start
    meta: dict = field(default_factory=dict)   # its references, scored as the sample's are (``Benchmark.score``)


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
    answer_prefix: str = ""         # the answer's start, after the chat template's assistant header
    completion_cue: str = ""        # before it, where no chat template applies (a pretrained model)
    follow_ups: tuple[FollowUp, ...] = ()   # further questions (``benchmark.follow_up``)
    reply: str = ""                 # the first question's reference answer: a follow-up's history when the
                                    # question is inside the compressed prompt
    tail_after: bool = False        # with no question apart, the prompt's tail after the user's text (the chat
                                    # template's, the answer prefix) fed after compression (kvpress's --query_aware)

    @cached_property
    def fingerprint(self) -> str:
        """Every field as the benchmark built it, hashed: stored with each answer, so that another run finds the
        answers to the very samples it asks (``pcs.run_folder.RunFolder.adopt``) without building this run's."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=False, default=repr)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class Benchmark:
    """Interface: ``check()`` fails fast before the model loads; ``samples()`` may need the tokenizer."""
    step = "generate"
    prompt_length_knob: str | None = None   # the option that shortens its prompts (named when one does not fit)

    def __init__(self, cfg: DictConfig):
        self.run_cfg = cfg              # the whole config
        self.cfg = cfg.benchmark        # this benchmark's group

    def check(self) -> None:
        """Raise ValueError/FileNotFoundError naming the bad value, before anything heavy runs."""

    def variants(self) -> dict:
        """Variant key -> the run config whose method the step runs (a generation benchmark: the run's)."""
        return {"run": self.run_cfg}

    def samples(self, tokenizer) -> list[Sample]:
        raise NotImplementedError

    def encode(self, sample: Sample, tokenizer, model_cfg) -> PromptIds:
        """Token ids of a sample's prompt and its follow-ups (a benchmark may truncate the prompt first)."""
        prompt = encode_prompt(tokenizer, sample.prompt, model_cfg, use_chat=sample.chat, question=sample.question,
                               answer_prefix=sample.answer_prefix, completion_cue=sample.completion_cue,
                               tail_after=sample.tail_after)
        if not sample.follow_ups:
            return prompt
        return prompt._replace(follow_ups=follow_up_ids(
            tokenizer, prompt, sample.prompt, model_cfg, [(f.question, f.answer_prefix) for f in sample.follow_ups],
            sample.chat, sample.question, sample.answer_prefix, sample.completion_cue, sample.reply))

    def scored(self, row: dict) -> dict:
        """A row (a sample's meta and answers) with its ``score`` and, where it has follow-ups, each one's score and
        their mean ``follow_up_score``: what predictions.jsonl holds."""
        row = {**row, "score": self.score(row)}
        if row.get("follow_ups"):
            ups = [{**up, "score": self.score({**without_follow_ups(row), **up})} for up in row["follow_ups"]]
            row.update(follow_ups=ups, follow_up_score=sum(up["score"] for up in ups) / len(ups))
        return row

    def score(self, row: dict) -> float | None:
        """A row's score on the benchmark's 0-100 scale, from the step's fields and the sample's meta
        (so saved rows can be scored again)."""
        raise NotImplementedError

    def metrics(self, rows: list[dict]) -> dict:
        """Headline ``score`` and details from the predictions.jsonl rows."""
        raise NotImplementedError

    def settled(self, sample: Sample, question: int = 0) -> Callable[[str], bool] | None:
        """Whether an answer's text so far already decides its score, for a benchmark that declares ``_settles_``
        (a score that can only rise as the answer grows): once it is 100, no later token can change it. None:
        the score may still change (F1, ROUGE: more words can lower it). ``question``: 0 for the sample's own,
        j for its j-th follow-up (scored on its own references)."""
        if not self.settles:
            return None
        meta = sample.meta if not question else {**sample.meta, **sample.follow_ups[question - 1].meta}
        return lambda text: self.score({"prediction": text, **meta}) == 100.0

    @cached_property
    def settles(self) -> bool:
        """The option file's ``_settles_`` declaration, read once (``settled`` is asked for every sample)."""
        return bool(declared("benchmark", self.cfg.name, "settles", False))

    def data_hashes(self) -> dict:
        """SHA-256 of the data and prompt templates the samples come from (provenance)."""
        return {}

    def finish(self, rows: list[dict], metrics: dict, run_dir: Path) -> None:
        """Once every sample is done, before ``metrics.json`` is written: write extra files next to
        it (plots, outputs in another tool's format) and add what they yield to ``metrics``."""


def without_follow_ups(row: dict) -> dict:
    return {key: value for key, value in row.items() if key not in ("follow_ups", "follow_up_score")}


def follow_up_rows(rows: list[dict]) -> list[dict]:
    """One row per follow-up answer: its sample's fields, its own prediction, references and score (what a
    benchmark's ``metrics`` reads for the follow-ups as it reads the first questions' rows)."""
    return [{**without_follow_ups(row), **up} for row in rows for up in row.get("follow_ups") or ()]


def build_benchmark(cfg: DictConfig) -> Benchmark:
    """The benchmark of a run's whole config (its class: the option file's ``_target_``)."""
    return load_class("benchmark", cfg.benchmark.name)(cfg)


def checked_benchmark(cfg: DictConfig, validated: bool = False) -> Benchmark:
    """The run's config validated (unless ``validated``: a sweep's plan did it), its benchmark with its knobs and
    data checked, and the run config of each of its other variants validated: torch-free, so a missing file or a
    bad knob is reported in a second, before any model loads or any job is submitted (``ConfigError``, saying
    what to do). The one check a run's config passes; the runner takes the benchmark it returns."""
    if not validated:
        validate(cfg)
    benchmark = build_benchmark(cfg)
    try:
        benchmark.check()
        for variant in benchmark.variants().values():
            if variant is not cfg:
                validate(variant)
    except (ValueError, FileNotFoundError) as err:   # missing data, a malformed line, a bad option
        raise ConfigError(str(err)) from err
    return benchmark
