"""A prompt's reconstruction after its prefill: the scores KVzip ranks entries by (Kim et al., "KVzip: Query-Agnostic
KV Cache Compression with Context Reconstruction", NeurIPS 2025; kvpress 0.5.5's ``KVzipPress``).

The model is asked to repeat the context it has just read, one chunk at a time: each chunk's request
(``pcs.prompts.RepeatPrompt``), the chat template's tail and the chunk itself are fed on the full prefill cache, as a
question would be, and each layer's queries of that repetition score the entries they read. An entry's score is the
most attention any query head of its KV head and any token of the repetition pays it, the attention taken over the
first ``sinks`` entries, the chunk being repeated and the repetition itself (kvpress's ``score_kvzip``); the
repetition's own entries are then dropped, so each chunk is fed on the prefill cache as it was. The template's head
is never repeated: its entries score 0 (the sinks among them are kept by the method). The scores depend on no
question, so one reconstruction serves every cell that asks the same (``Reconstruction``), whatever its budget.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from .cache import CompressedCache
from .compression import attention_modules, hooked, window_queries
from .eviction.base import Reconstruction
from .prompts import RepeatPrompt


def chunks_of(ids: list[int], size: int) -> list[list[int]]:
    """The context's tokens in chunks of ``size`` (the last may be shorter)."""
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def output_norms(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """(H_kv, group, t) ``||v W^O_h||_2`` of each of the (H_kv, t, d) entries through each query head of its KV
    head: the size of what the entry writes to the residual stream (KVzip+'s column weight). LaProx's
    ``value_output_norms`` gives the same norms through Gram matrices, faster but rounded otherwise: here the product
    itself, as KVzipPress takes it, so that KVzip+'s scores keep its bits at near-ties."""
    n_kv, _, d = values.shape
    hidden = o_proj_weight.shape[0]
    weights = o_proj_weight.view(hidden, n_kv, -1, d)                             # (hidden, H_kv, group, d)
    return torch.einsum("jhgi,hti->hgtj", weights, values).norm(dim=-1)


def repetition_scores(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                      o_proj_weight: torch.Tensor, start: int, end: int, sinks: int,
                      normalised: tuple[bool, ...]) -> dict[bool, torch.Tensor]:
    """(H_kv, end - start) scores of the chunk ``start:end`` read by the q tokens repeating it, per ``normalised``
    flag. ``queries`` (H_q, q, d) the repetition's at the methods' unit scale; ``keys`` and ``values`` (H_kv, m, d)
    the layer's entries, the repetition's own the last q; ``hidden`` (q, hidden) the attention's input."""
    q, d = queries.shape[1], queries.shape[-1]
    n_kv = keys.shape[0]
    sink = min(sinks, start)
    read = lambda t: torch.cat([t[:, :sink], t[:, start:end], t[:, -q:]], dim=1)          # (H_kv, s, d)
    logits = torch.matmul(queries.view(n_kv, -1, q, d), read(keys)[:, None].transpose(-2, -1)) / math.sqrt(d)
    future = torch.ones(q, q, dtype=torch.bool, device=keys.device).triu(1)
    logits[..., -q:].masked_fill_(future, torch.finfo(logits.dtype).min)
    attention = logits.softmax(dim=-1)                                               # (H_kv, group, q, s)
    out = {}
    for flag in normalised:
        weights = attention
        if flag:
            weights = weights / hidden.norm(dim=-1)[None, None, :, None]
            weights = weights * output_norms(read(values), o_proj_weight)[:, :, None, :]
        out[flag] = weights[..., sink:sink + end - start].amax(dim=(1, 2))
    return out


@torch.inference_mode()
def reconstruct(model, cache: CompressedCache, input_ids: torch.Tensor, repeat: RepeatPrompt,
                requests: set[Reconstruction], layers: tuple[int, ...]) -> dict[Reconstruction, dict[int, torch.Tensor]]:
    """Each request's (H_kv, n) scores per layer of ``layers`` for the (1, n) prompt ``input_ids`` whose full
    prefill ``cache`` holds (its full-attention layers dense, as a model-wide method keeps them until it chooses;
    it is left as it was). One forward per chunk for the requests that share a chunk size and sinks."""
    device = next(model.parameters()).device
    n = input_ids.shape[1]
    context = input_ids[0, repeat.head:].tolist()
    modules = attention_modules(model)
    out = {}
    by_reading = defaultdict(set)
    for request in requests:
        by_reading[(request.chunk, request.sinks)].add(request.normalised)
    for (size, sinks), flags in by_reading.items():
        flags = tuple(sorted(flags))
        scores = {flag: {l: torch.zeros(model.config.num_key_value_heads, n, dtype=model.dtype, device=device)
                         for l in layers} for flag in flags}
        chunks, start = chunks_of(context, size), repeat.head
        for i, chunk in enumerate(chunks):
            end = start + len(chunk)
            fed = torch.tensor([repeat.request(chunks, i)], device=device)
            copy = cache.copy()

            def hook(module, args, kwargs, output, start=start, end=end, copy=copy):
                layer_idx = module.layer_idx
                if layer_idx not in scores[flags[0]]:
                    return
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                keys, values = copy.layers[layer_idx].dense()
                queries = window_queries(module, hidden, kwargs["position_embeddings"], hidden.shape[1])
                got = repetition_scores(queries, keys, values, hidden[0], module.o_proj.weight, start, end, sinks,
                                        flags)
                for flag, chunk_scores in got.items():
                    scores[flag][layer_idx][:, start:end] = chunk_scores

            positions = torch.arange(n, n + fed.shape[1], device=device)[None]
            with hooked(modules, hook):
                model.model(input_ids=fed, position_ids=positions, past_key_values=copy, use_cache=True)
            del copy
            start = end
        for flag in flags:
            out[Reconstruction(size, sinks, flag)] = scores[flag]
    return {request: out[request] for request in requests}


def reconstructor(model, input_ids: torch.Tensor, repeat: RepeatPrompt | None):
    """``reconstruct`` for one prompt, as ``pcs.compression.compress_each_after_prefill`` calls it (None without a
    repeat request: a method that needs one then fails there)."""
    if repeat is None:
        return None
    return lambda cache, requests, layers: reconstruct(model, cache, input_ids, repeat, requests, layers)
