"""The generation step of a run: samples in, predictions.jsonl fields out, for one run or for several runs
(cells) that share each sample's prefill, every answer decoded in a pool with the others in flight
(``pcs.engine``). ``greedy_generate`` is the same path for one prompt and one method."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .benchmarks.base import Sample
from .cell import RunCell
from .engine import Arrival, Cell, DecodePool, Generation, decode
from .options import EngineOptions
from .eviction.base import Method
from .models import Loaded
from .prompts import PromptIds, RepeatPrompt, repeat_prompt


def greedy_generate_each(model, input_ids: torch.Tensor, methods: list[Method], max_new_tokens: int,
                         stop_token_ids: set[int], question_ids: torch.Tensor | None = None, min_new_tokens: int = 0,
                         triggers: list[int | None] | None = None, pool: int = 1,
                         options: EngineOptions | None = None, repeat: RepeatPrompt | None = None) -> list[Generation]:
    """Greedy answers to one prompt, one per method, on one shared prefill, decoded ``pool`` at a time, under the
    engine's ``options`` (None: the defaults); ``repeat``: the request to repeat the context (KVzip's)."""
    cells = [Cell(method, trigger) for method, trigger in zip(methods, triggers or [None] * len(methods))]
    arrival = Arrival(model, input_ids, cells, max_new_tokens, stop_token_ids, question_ids, min_new_tokens,
                      owners=list(range(len(cells))), repeat=repeat)
    done = {seq.owner: seq.result for seq in decode(DecodePool(model, pool, options=options), [arrival])}
    return [done[i] for i in range(len(cells))]


def greedy_generate(model, input_ids: torch.Tensor, method: Method, max_new_tokens: int, stop_token_ids: set[int],
                    question_ids: torch.Tensor | None = None, min_new_tokens: int = 0,
                    trigger: int | None = None, options: EngineOptions | None = None,
                    repeat: RepeatPrompt | None = None) -> Generation:
    """Greedy decoding; stops at any of ``stop_token_ids`` (not included in the output), never
    before ``min_new_tokens``. ``question_ids``, if given, are fed after the prompt is compressed.
    With ``trigger``, a layer is compressed again whenever one of its heads exceeds it."""
    return greedy_generate_each(model, input_ids, [method], max_new_tokens, stop_token_ids, question_ids,
                                min_new_tokens, [trigger], options=options, repeat=repeat)[0]


Request = tuple[Sample, PromptIds, list[RunCell]]   # a sample, its encoded prompt, the cells still to answer it


def settled_test(cell: RunCell, sample: Sample, tokenizer, question: int = 0):
    """With ``engine.stop_when_scored``, the test that ends the cell's answer to ``question`` (0: the sample's own,
    j: its j-th follow-up) once its benchmark's score of it is decided (``Benchmark.settled``), on the tokens
    decoded as the prediction is; otherwise None."""
    if not (cell.cfg.get("engine") or {}).get("stop_when_scored"):
        return None
    test = cell.benchmark.settled(sample, question)
    if test is None:
        return None
    return lambda ids: test(tokenizer.decode(ids, skip_special_tokens=True))


def generate_rows(requests: Iterable[Request], pool: DecodePool, loaded: Loaded) -> Iterator[tuple[Sample, int, dict]]:
    """Greedy answers to every request's cells, each yielded as ``(sample, index of the cell in its request,
    row fields)`` once the cell has answered the sample's question and each follow-up: the prediction, sizes
    and timings (``prefill_s`` is the shared prefill's plus the cell's question; ``decode_s`` the answer's time
    in the pool), and per follow-up (``follow_ups``, in order, each with the sample's references of it) its own."""
    def arrivals():
        for sample, prompt, cells in requests:
            model, tokenizer = loaded.model, loaded.tokenizer
            stops = loaded.stops | {tokenizer.encode(t, add_special_tokens=False)[-1]
                                               for t in sample.stop_texts}
            question = None if prompt.question is None else torch.tensor([prompt.question])
            asked = range(1 + len(prompt.follow_ups))
            yield Arrival(model, torch.tensor([prompt.context]),
                          [Cell(c.method, c.cfg.compress.trigger, tuple(settled_test(c, sample, tokenizer, j) for j in asked))
                           for c in cells],
                          sample.max_new_tokens, stops, question, sample.min_new_tokens,
                          owners=[(sample, prompt, tokenizer, i, j) for i in range(len(cells)) for j in asked],
                          name=sample.id, follow_ups=tuple(torch.tensor([ids]) for ids in prompt.follow_ups),
                          repeat=(repeat_prompt(tokenizer, cells[0].cfg.model, sample.chat)
                                  if any(c.method.reconstruction for c in cells) else None))

    answered: dict[tuple[str, int], dict[int, dict]] = {}   # a cell's answers to a sample's questions so far
    for seq in decode(pool, arrivals()):
        sample, prompt, tokenizer, index, j = seq.owner
        gen = seq.result
        asked = prompt.question if j == 0 else prompt.follow_ups[j - 1]
        fields = {
            "prediction": tokenizer.decode(gen.token_ids, skip_special_tokens=True),
            "prompt_tokens": gen.prompt_tokens,
            "question_tokens": 0 if asked is None else len(asked),
            "new_tokens": len(gen.token_ids),
            "kv_cache_bytes": gen.kv_cache_bytes, "kv_cache_bytes_full": gen.kv_cache_bytes_full,
            "peak_kv_bytes": gen.peak_kv_bytes,
            "max_kv_entries": gen.max_kv_entries, "n_compressions": gen.n_compressions,
            "prefill_s": round(gen.prefill_s, 4), "decode_s": round(gen.decode_s, 4)}
        if not prompt.follow_ups:
            yield sample, index, fields
            continue
        mine = answered.setdefault((sample.id, index), {})
        mine[j] = fields
        if len(mine) == 1 + len(prompt.follow_ups):
            del answered[(sample.id, index)]
            ups = [{**up.meta, **mine[k + 1]} for k, up in enumerate(sample.follow_ups)]
            yield sample, index, {**mine[0], "follow_ups": ups}
