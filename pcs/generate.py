"""Prefill -> compress -> greedy decode on the compressed cache (batch size 1), and the generation
step of a run: one benchmark sample in, its predictions.jsonl fields out, for one run or for several
runs (cells) that share the sample's prefill."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .benchmarks.base import Sample
from .cache import CompressedCache
from .compression import CompressionStats, compress_each_after_prefill, recompress_when_full
from .eviction.base import Method
from .prompts import PromptIds


@dataclass
class RunContext:
    """The loaded pieces a run's per-sample step works with, built once by the runner (model and
    tokenizer shared by every cell of a group)."""
    model: object
    tokenizer: object
    methods: dict                   # variant key -> Method (one for a generation benchmark)
    stop_token_ids: set[int]
    cfg: object                     # the run's whole config

    @property
    def method(self) -> Method:
        """A generation benchmark's one method."""
        (method,) = self.methods.values()
        return method


@dataclass
class Generation:
    token_ids: list[int]
    prompt_tokens: int
    kv_cache_bytes: int        # held right after prefill compression
    kv_cache_bytes_full: int   # what the uncompressed cache of the prompt would hold
    prefill_s: float
    decode_s: float
    max_kv_entries: int = 0    # most entries any KV head held after prefill compression and later
    n_compressions: int = 0    # decoding-time recompressions (steps at which some layer recompressed)
    peak_kv_bytes: int = 0     # most bytes the cache held during prefill (a model-wide method: the full cache)


def full_kv_bytes(config, n_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of an uncompressed K and V cache for ``n_tokens`` over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * n_tokens * torch.empty(0, dtype=dtype).element_size()


def clock(device: torch.device) -> float:
    """Seconds, once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def greedy_generate_each(model, input_ids: torch.Tensor, methods: list[Method], max_new_tokens: int,
                         stop_token_ids: set[int], question_ids: torch.Tensor | None = None, min_new_tokens: int = 0,
                         triggers: list[int | None] | None = None) -> list[Generation]:
    """Greedy decoding of one prompt for each of ``methods``, on one shared prefill: every method
    compresses its own copy layer by layer (``compress_each_after_prefill``), then each decodes on its
    cache in turn, and its cache is released. Each ``Generation`` is what ``greedy_generate`` with that
    method alone gives; ``prefill_s`` is the shared prefill's time (with every method's compression)."""
    device = next(model.parameters()).device
    n = input_ids.shape[1]
    room = max_new_tokens + (0 if question_ids is None else question_ids.shape[1])
    caches = [CompressedCache(model.config.num_hidden_layers, room) for _ in methods]
    start = clock(device)
    with compress_each_after_prefill(model, methods, caches) as cells:
        logits = model(input_ids=input_ids.to(device), past_key_values=caches[0], use_cache=True,
                       logits_to_keep=1).logits
    prefill_s = clock(device) - start
    del caches
    generations = []
    for i, trigger in enumerate(triggers or [None] * len(methods)):
        cell, cells[i] = cells[i], None        # the cell's cache goes once it has decoded
        generations.append(generate_on(model, cell.cache, cell.method, logits, n, prefill_s, max_new_tokens,
                                       stop_token_ids, question_ids, min_new_tokens, trigger,
                                       cell.stats.peak_kv_bytes))
    return generations


def greedy_generate(model, input_ids: torch.Tensor, method: Method, max_new_tokens: int, stop_token_ids: set[int],
                    question_ids: torch.Tensor | None = None, min_new_tokens: int = 0,
                    trigger: int | None = None) -> Generation:
    """Greedy decoding; stops at any of ``stop_token_ids`` (not included in the output), never
    before ``min_new_tokens``. ``question_ids``, if given, are fed after the prompt is compressed.
    With ``trigger``, a layer is compressed again whenever one of its heads exceeds it."""
    return greedy_generate_each(model, input_ids, [method], max_new_tokens, stop_token_ids, question_ids,
                                min_new_tokens, [trigger])[0]


def generate_on(model, cache: CompressedCache, method: Method, logits, n: int, prefill_s: float,
                max_new_tokens: int, stop_token_ids: set[int], question_ids, min_new_tokens: int,
                trigger: int | None, peak_kv_bytes: int) -> Generation:
    """The question (if fed after compression) and the greedy answer on one method's compressed cache."""
    device = logits.device
    stats = CompressionStats(max_kv_entries=max(max(h) for h in cache.entries_per_head()))
    start = clock(device)
    with recompress_when_full(model, method, cache, trigger, stats):
        if question_ids is not None:
            q = question_ids.shape[1]
            logits = model(input_ids=question_ids.to(device), position_ids=torch.arange(n, n + q, device=device)[None],
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            n += q
        kv_bytes = cache.nbytes()
        prefill_s += clock(device) - start
        start = clock(device)
        tokens = decode(model, cache, logits, n, max_new_tokens, stop_token_ids, min_new_tokens)
    decode_s = clock(device) - start
    return Generation(tokens, n, kv_bytes, full_kv_bytes(model.config, n, model.dtype), prefill_s, decode_s,
                      stats.max_kv_entries, stats.n_compressions, peak_kv_bytes)


def decode(model, cache, logits, n: int, max_new_tokens: int, stop_token_ids: set[int], min_new_tokens: int) -> list[int]:
    """Greedy tokens after a prompt of ``n`` tokens whose last logits are ``logits``."""
    device = logits.device
    stops = torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=device)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        last = logits[0, -1]
        if len(tokens) < min_new_tokens and len(stops):
            last = last.index_fill(0, stops, float("-inf"))
        next_id = int(last.argmax())
        if next_id in stop_token_ids:
            break
        tokens.append(next_id)
        if len(tokens) == max_new_tokens:
            break
        position = torch.tensor([[n + len(tokens) - 1]], device=device)
        logits = model(input_ids=torch.tensor([[next_id]], device=device), position_ids=position,
                       past_key_values=cache, use_cache=True).logits
    return tokens


def generate_rows(sample: Sample, prompt: PromptIds, cells: list[RunContext]) -> list[dict]:
    """Greedy answers to one sample, one per cell, on one shared prefill: each row's prediction, sizes and
    timings (``prefill_s`` is the shared prefill's)."""
    model, tokenizer = cells[0].model, cells[0].tokenizer
    stops = cells[0].stop_token_ids | {tokenizer.encode(t, add_special_tokens=False)[-1] for t in sample.stop_texts}
    question = None if prompt.question is None else torch.tensor([prompt.question])
    generations = greedy_generate_each(model, torch.tensor([prompt.context]), [cell.method for cell in cells],
                                       sample.max_new_tokens, stops, question_ids=question,
                                       min_new_tokens=sample.min_new_tokens,
                                       triggers=[cell.cfg.compress.trigger for cell in cells])
    return [{"prediction": tokenizer.decode(gen.token_ids, skip_special_tokens=True),
             "prompt_tokens": gen.prompt_tokens,
             "question_tokens": 0 if prompt.question is None else len(prompt.question),
             "new_tokens": len(gen.token_ids),
             "kv_cache_bytes": gen.kv_cache_bytes, "kv_cache_bytes_full": gen.kv_cache_bytes_full,
             "peak_kv_bytes": gen.peak_kv_bytes,
             "max_kv_entries": gen.max_kv_entries, "n_compressions": gen.n_compressions,
             "prefill_s": round(gen.prefill_s, 4), "decode_s": round(gen.decode_s, 4)} for gen in generations]
