"""A sample's prefill, shared by its cells: one forward of the prompt, every cell's compression of each layer as
it passes (``pcs.compression``), then each cell's question (when fed after compression) on its own cache, and
each follow-up question on its own copy of that compressed cache. What comes out is one ``Answer`` per cell and
question; asking it feeds its question and gives the ``Sequence`` that joins a decode pool. The decode pool asks
each answer only as it is about to join, so the answers waiting outside it hold one compressed cache per cell,
not one per cell and question."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..cache import CompressedCache
from ..compression import CompressionStats, PrefillStats, compress_each_after_prefill, recompress_when_full
from ..eviction.base import Method
from ..hybrid import attention_windows, head_dim, held_entries
from ..options import EngineOptions, Stage2Search, defaults
from ..prompts import RepeatPrompt
from ..reconstruction import reconstructor
from .decode import Generation, Sequence, clock


@dataclass
class Cell:
    """What one cell decodes with: its method, its decoding-time trigger (None: off), and when each of its answers
    is decided (``Sequence.settled``), per question (the prompt's, then its follow-ups'; none or None: decode to a
    stop or the maximum)."""
    method: Method
    trigger: int | None = None
    settled: tuple[Callable[[list[int]], bool] | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.method.evicts:      # its layers would be rebuilt and kept whole at every step past the trigger
            self.trigger = None


@dataclass
class Arrival:
    """A prompt and the cells that answer it, prefilled when the decode pool asks for it (``decode``), and asked
    again for the answers that were in flight when a decoding step ran out of device memory. Its answers are
    numbered cell by cell, question by question: answer ``i x questions + j`` is cell i's to question j (0: the
    prompt's own, then each follow-up)."""
    model: object
    input_ids: torch.Tensor                  # (1, n) the prompt (the context, when the question comes after)
    cells: list[Cell]
    max_new_tokens: int
    stops: set[int]
    question_ids: torch.Tensor | None = None
    min_new_tokens: int = 0
    owners: list | None = None               # the caller's key of each answer
    name: str = "a prompt"                   # what an out-of-memory error calls it (a sample's id)
    follow_ups: tuple[torch.Tensor, ...] = ()   # (1, q) each: further questions, each on a copy of the cache
    repeat: RepeatPrompt | None = None       # the request to repeat the context, for a method that reconstructs it

    @property
    def questions(self) -> int:
        return 1 + len(self.follow_ups)

    @property
    def tokens(self) -> int:
        asked = [ids.shape[1] for ids in (self.question_ids, *self.follow_ups) if ids is not None]
        return self.input_ids.shape[1] + max(asked, default=0)

    def answers(self, which: list[int] | None = None, options: EngineOptions | None = None) -> list[Answer]:
        """Answers ``which`` (all by default), not yet asked, after one shared prefill of their cells under the
        engine's ``options`` (None: the defaults)."""
        q = self.questions
        which = sorted(range(len(self.cells) * q) if which is None else which)
        cells = sorted({k // q for k in which})
        owners = self.owners or [None] * (len(self.cells) * q)
        # A cell prefilled again for some of its answers: the others were yielded already.
        wanted = set(which)
        asked = [[j for j in range(q) if i * q + j in wanted] for i in cells]
        answers = prefill_answers(self.model, self.input_ids, [self.cells[i] for i in cells], self.max_new_tokens,
                                  self.stops, self.question_ids, self.min_new_tokens,
                                  [owners[i * q + j] for i in cells for j in range(q)], options, self.follow_ups,
                                  self.repeat, asked)
        for k, answer in zip(which, answers):
            answer.source = (self, k)
        return answers


@dataclass
class Answer:
    """One cell's answer to one question before its question is fed: ``ask`` feeds it and gives the ``Sequence``
    to decode (with ``source`` set)."""
    feed: Callable[[], Sequence]
    source: tuple | None = None       # (Arrival, answer index): how to prefill it again

    def ask(self) -> Sequence:
        seq = self.feed()
        seq.source = self.source
        return seq


class Shared:
    """A cell's compressed cache, handed to its answers: a copy to each, the cache itself to the last one asked,
    so every answer starts from the compressed prompt whatever order they are asked in."""

    def __init__(self, cache: CompressedCache, answers: int):
        self.cache, self.left = cache, answers

    def take(self) -> CompressedCache:
        self.left -= 1
        if self.left:
            return self.cache.copy()
        cache, self.cache = self.cache, None
        return cache


def full_kv_bytes(config, n_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of the model's own K and V cache after ``n_tokens``: every entry of a full-attention layer, the
    window's newest W - 1 of a sliding-window layer."""
    per_entry = 2 * config.num_key_value_heads * head_dim(config) * torch.empty(0, dtype=dtype).element_size()
    return per_entry * sum(held_entries(w, n_tokens) for w in attention_windows(config))


def prefill(model, input_ids: torch.Tensor, cells: list[Cell], max_new_tokens: int, stops: set[int],
            question_ids: torch.Tensor | None = None, min_new_tokens: int = 0, owners: list | None = None,
            options: EngineOptions | None = None, follow_ups: tuple[torch.Tensor, ...] = (),
            repeat: RepeatPrompt | None = None) -> list[Sequence]:
    """``prefill_answers``' answers to every question, asked in order: one ``Sequence`` per cell and question."""
    return [answer.ask() for answer in prefill_answers(model, input_ids, cells, max_new_tokens, stops, question_ids,
                                                       min_new_tokens, owners, options, follow_ups, repeat)]


@torch.inference_mode()
def prefill_answers(model, input_ids: torch.Tensor, cells: list[Cell], max_new_tokens: int, stops: set[int],
                    question_ids: torch.Tensor | None = None, min_new_tokens: int = 0, owners: list | None = None,
                    options: EngineOptions | None = None, follow_ups: tuple[torch.Tensor, ...] = (),
                    repeat: RepeatPrompt | None = None, asked: list[Iterable[int]] | None = None) -> list[Answer]:
    """One prompt prefilled once for every cell; each cell's answer to each question (the prompt's, then the
    follow-ups') as an ``Answer`` whose ``Sequence`` holds the cache and first logits a prefill of its own would
    give (``tests/test_shared_prefill.py``), a follow-up's from a copy of the cell's compressed cache with the
    follow-up fed on it. ``asked``: per cell, which questions (all by default); ``owners``: one per cell and
    question, in that order. ``options``: the engine's (None: the defaults). ``repeat``: the request to repeat the
    context, which a method scored by a reconstruction (KVzip) needs; its reconstruction is part of the prefill's
    time."""
    options = options or defaults()
    device = next(model.parameters()).device
    n = input_ids.shape[1]
    questions = [question_ids, *follow_ups]
    asked = [range(len(questions))] * len(cells) if asked is None else [list(a) for a in asked]
    room = max([0] + [ids.shape[1] for ids in questions if ids is not None])   # appended before decoding
    caches = [CompressedCache.of(model.config, room) for _ in cells]
    start = clock(device)
    reconstruct = reconstructor(model, input_ids.to(device), repeat)
    with compress_each_after_prefill(model, [cell.method for cell in cells], caches, options, reconstruct) as compressed:
        logits = model(input_ids=input_ids.to(device), past_key_values=caches[0], use_cache=True,
                       logits_to_keep=1).logits
    prefill_s = clock(device) - start
    del caches
    answers, owners = [], owners or [None] * (len(cells) * len(questions))
    for i, (cell, done, which) in enumerate(zip(cells, compressed, asked)):
        shared = Shared(done.cache, len(which))
        for j in which:
            settled = cell.settled[j] if j < len(cell.settled) else None
            answers.append(Answer(functools.partial(
                with_question, model, shared.take, cell, logits, n, prefill_s, done.stats, questions[j],
                max_new_tokens, min_new_tokens, frozenset(stops), owners[i * len(questions) + j], options.stage2,
                settled)))
    return answers


@torch.inference_mode()
def with_question(model, take: Callable[[], CompressedCache], cell: Cell, logits, n: int, prefill_s: float,
                  prefilled: PrefillStats, question_ids, max_new_tokens: int, min_new_tokens: int, stops: frozenset,
                  owner, search: Stage2Search | None = None, settled: Callable | None = None) -> Sequence:
    """A cell's sequence for one question: the question (if fed after compression) on the compressed cache
    ``take`` gives, then its sizes."""
    device = logits.device
    cache = take()
    stats = CompressionStats(max_kv_entries=cache.most_entries())
    start = clock(device)
    with recompress_when_full(model, cell.method, cache, cell.trigger, stats, search):
        if question_ids is not None:
            q = question_ids.shape[1]
            logits = model(input_ids=question_ids.to(device), position_ids=torch.arange(n, n + q, device=device)[None],
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            n += q
    prefill_s += clock(device) - start
    result = Generation([], n, cache.nbytes(), full_kv_bytes(model.config, n, model.dtype), prefill_s, 0.0,
                        peak_kv_bytes=prefilled.peak_kv_bytes, stage2=prefilled.stage2)
    return Sequence(owner, cache, logits[0, -1], n, max_new_tokens, min_new_tokens, stops, cell.method,
                    cell.trigger, result, stats, settled=settled)
