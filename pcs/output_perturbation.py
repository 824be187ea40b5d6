"""Output perturbation at the first decoding token (the paper's Section 5 and Appendices A and B): the
per-sample step of the perturbation analysis (``benchmark=perturbation``).

One prefill on the full cache records, for every layer, which entries each selection variant (and
budget) would keep. The first decoding token is the full cache's greedy choice; then:

- head-wise: on the full-cache decoding step (every layer fed the full-cache hidden states), each
  query head's output is recomputed over the kept entries only; the perturbation is
  ``||(o_full - o_kept) W^O_h||_1 = ||(A - A') V W^O_h||_1``, with ``W^O_h`` the head's input columns
  of the output projection and ``A'`` the attention renormalised over the kept entries;
- layer-wise: the decoding step really runs on each compressed cache (errors accumulate through the
  layers); the perturbation of layer l is the L1 distance of its output hidden state to the full
  cache's;
- Assumption 1: the share of the first decoding token's attention (over the full cache) held by the
  entries kept before stage 2, i.e. the stage-1 picks and the observation window.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .benchmarks.base import Sample
from .cache import CompressedCache
from .compression import LayerChoices, after_prefill, attention_modules, hooked, reconstructed_for, window_queries
from .eviction.base import Kept, LayerState, Method, window_positions
from .eviction.stage2_search import Stage2Run
from .engine.prefill import full_kv_bytes
from .options import EngineOptions, defaults
from .cell import RunCell
from .models import Loaded
from .prompts import PromptIds, RepeatPrompt, repeat_prompt
from .reconstruction import reconstructor


@dataclass
class Prefill:
    n_tokens: int
    first_token: int
    keys: list[torch.Tensor]           # per layer, (H_kv, n, d): the full cache
    values: list[torch.Tensor]
    kept: dict[object, list[Kept]]     # per variant key, per layer
    stage1: list[Kept]                 # per layer, the two-stage variant's stage-1 picks plus the window
    stage1_prefix: list[Kept]          # per layer, its stage-1 picks alone
    cache: CompressedCache = field(repr=False)


@torch.inference_mode()
def run_prefill(model, input_ids: torch.Tensor, methods: dict, two_stage: Method | None = None,
                options: EngineOptions | None = None, repeat: RepeatPrompt | None = None) -> Prefill:
    """Full-cache prefill; every method of ``methods`` (key -> method) chooses its kept entries, and
    ``two_stage`` (a two-stage method) records its stage-1 picks; ``options``: the engine's (None: the defaults);
    ``repeat``: the request to repeat the context, for a method scored by its reconstruction (KVzip)."""
    n_layers = model.config.num_hidden_layers
    search = (options or defaults()).stage2
    choices = {key: LayerChoices(method, n_layers, Stage2Run(search)) for key, method in methods.items()}
    stage1, stage1_prefix = [None] * n_layers, [None] * n_layers
    windows = sorted({m.window for m in [*methods.values(), *([two_stage] if two_stage else [])]})

    def on_layer(queries, state: LayerState, layer) -> None:
        for key, choice in choices.items():        # each with its own window's queries, as in a run
            choice.add(state.seen_by(queries[methods[key].window]))
        first = (two_stage.for_prompt(state.n_tokens).stage1(state.seen_by(queries[two_stage.window]))
                 if two_stage is not None else None)
        if first is not None:
            stage1_prefix[state.layer_idx] = first
            stage1[state.layer_idx] = [torch.cat([f, window_positions(state.n_tokens, two_stage.window, f.device)])
                                       for f in first]

    cache = CompressedCache.of(model.config)
    device = next(model.parameters()).device
    with after_prefill(model, cache, windows, on_layer, shared=len(methods) > 1, options=options):
        logits = model(input_ids=input_ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    reconstructed = reconstructed_for(list(choices.values()), [cache] * len(choices),
                                      reconstructor(model, input_ids.to(device), repeat))
    dense = [layer.dense() for layer in cache.layers]
    kept = {key: choice.finish(reconstructed) for key, choice in choices.items()}
    return Prefill(input_ids.shape[1], int(logits[0, -1].argmax()), [k for k, _ in dense], [v for _, v in dense],
                   kept, stage1, stage1_prefix, cache)


def compressed_copy(prefill: Prefill, kept: list[Kept]) -> CompressedCache:
    """A cache holding, per layer and KV head, only the kept entries of the full prefill cache."""
    cache = CompressedCache(len(prefill.keys), windows=prefill.cache.windows)
    for layer, keys, values, idx in zip(cache.layers, prefill.keys, prefill.values, kept):
        layer.update(keys[None], values[None])
        if idx is not None:
            layer.compress(idx)
    return cache


@torch.inference_mode()
def decode_step(model, cache: CompressedCache, token: int, position: int, on_attention=None):
    """One decoding step; returns each layer's output hidden state (L, hidden) and the logits.
    ``on_attention(module, hidden_states, position_embeddings)`` runs after each attention module."""
    device = next(model.parameters()).device
    outputs = []

    def record(module, args, out):
        outputs.append((out[0] if isinstance(out, tuple) else out)[0, -1].float())

    def attention_hook(module, args, kwargs, out):
        if on_attention is not None:
            on_attention(module, kwargs["hidden_states"], kwargs["position_embeddings"])

    with hooked(model.model.layers, record, with_kwargs=False), hooked(attention_modules(model), attention_hook):
        logits = model(input_ids=torch.tensor([[token]], device=device), position_ids=torch.tensor([[position]], device=device),
                       past_key_values=cache, use_cache=True).logits[0, -1]
    return torch.stack(outputs), logits


def head_perturbation(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj_weight: torch.Tensor,
                      scaling: float, kept: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head: ``||(o_full - o_kept) W^O_h||_1`` and the full attention (H_q, N).

    ``query`` (H_q, d) of the new token, from ``window_queries``, which scales it for ``scaling = 1 / sqrt(d)``
    whatever the model's own scale; ``keys``/``values`` (H_kv, N, d) end with the new token, which
    every cache holds. ``kept`` lists the kept prompt positions per KV head, or per query head (None: all)."""
    n_q, d = query.shape
    n_kv, n_all = keys.shape[0], keys.shape[1]
    group = n_q // n_kv
    q, k, v = query.float(), keys.float(), values.float()
    attention = torch.empty(n_q, n_all, device=q.device)
    diff = torch.zeros(n_q, d, device=q.device)
    new = torch.tensor([n_all - 1], device=q.device)
    for g in range(n_kv):
        rows = slice(g * group, (g + 1) * group)
        logits = (q[rows] @ k[g].T) * scaling                        # (group, N)
        attention[rows] = logits.softmax(-1)
        if kept is not None:
            for h in range(rows.start, rows.stop):
                idx = torch.cat([kept[h if len(kept) == n_q else g].to(q.device), new])
                partial = logits[h - rows.start, idx].softmax(-1) @ v[g, idx]
                diff[h] = attention[h] @ v[g] - partial
    w = o_proj_weight.float().view(o_proj_weight.shape[0], n_q, d)     # (hidden, H_q, d)
    return torch.einsum("hd,ohd->ho", diff, w).abs().sum(-1), attention


def attention_mass(attention: torch.Tensor, positions: list[torch.Tensor] | None) -> torch.Tensor:
    """Per query head, the attention held by its KV head's ``positions`` (NaN if the layer was kept whole)."""
    if positions is None:
        return torch.full((attention.shape[0],), float("nan"))
    group = attention.shape[0] // len(positions)   # 1 where query heads chose apart
    return torch.stack([attention[h, positions[h // group].to(attention.device)].sum()
                        for h in range(attention.shape[0])]).cpu()


@dataclass
class Measurement:
    headwise: dict         # key -> (L, H_q) perturbation
    layerwise: dict        # key -> (L,) L1 distance of each layer's output hidden state
    next_tokens: dict      # key -> greedy token after the first one, on the compressed cache
    next_token_full: int   # the same on the full cache
    kv_bytes: dict         # key -> bytes the compressed cache holds before the decoding step
    assumption1: torch.Tensor          # (L, H_q) mass of stage-1 picks plus window
    assumption1_prefix: torch.Tensor   # (L, H_q) mass of stage-1 picks alone


@torch.inference_mode()
def measure(model, prefill: Prefill, headwise_keys: list, layerwise_keys: list) -> Measurement:
    """Head-wise perturbation for ``headwise_keys``, layer-wise for ``layerwise_keys`` (variant keys)."""
    n = prefill.n_tokens
    layerwise, next_tokens, kv_bytes = {}, {}, {}
    for key in layerwise_keys:   # compressed caches first, so the full cache is extended only once, last
        cache = compressed_copy(prefill, prefill.kept[key])
        kv_bytes[key] = cache.nbytes()
        hidden, logits = decode_step(model, cache, prefill.first_token, n)
        layerwise[key], next_tokens[key] = hidden, int(logits.argmax())
    headwise = {key: [] for key in headwise_keys}
    mass, mass_prefix = [], []

    def on_attention(module, hidden_states, position_embeddings):
        l = module.layer_idx
        query = window_queries(module, hidden_states, position_embeddings, 1)[:, 0]
        if prefill.cache.layers[l].is_sliding:      # every cache keeps the model's window here: no perturbation
            for key in headwise_keys:
                headwise[key].append(torch.zeros(query.shape[0]))
            mass.append(torch.full((query.shape[0],), float("nan")))
            mass_prefix.append(torch.full((query.shape[0],), float("nan")))
            return
        keys, values = prefill.cache.layers[l].dense()
        attention = None
        for key in headwise_keys:
            perturbation, attention = head_perturbation(query, keys, values, module.o_proj.weight, module.head_dim ** -0.5,
                                                        prefill.kept[key][l])
            headwise[key].append(perturbation.cpu())
        if attention is None:
            attention = head_perturbation(query, keys, values, module.o_proj.weight, module.head_dim ** -0.5, None)[1]
        mass.append(attention_mass(attention, prefill.stage1[l]))
        mass_prefix.append(attention_mass(attention, prefill.stage1_prefix[l]))

    full_hidden, full_logits = decode_step(model, prefill.cache, prefill.first_token, n, on_attention)
    return Measurement({k: torch.stack(v) for k, v in headwise.items()},
                       {k: (h - full_hidden).abs().sum(-1).cpu() for k, h in layerwise.items()},
                       next_tokens, int(full_logits.argmax()), kv_bytes, torch.stack(mass), torch.stack(mass_prefix))


def perturbation_row(sample: Sample, prompt: PromptIds, cell: RunCell, loaded: Loaded) -> dict:
    """One context's measurements for every variant (``cell.methods``: (label, budget) -> method): head-wise
    and the next token at the run's budget, layer-wise at every budget, Assumption 1 for the first
    two-stage variant at the run's budget."""
    main = cell.cfg.budget
    labels = list(dict.fromkeys(label for label, _ in cell.methods))
    budgets = sorted({budget for _, budget in cell.methods})
    two_stage = next((m for (label, b), m in cell.methods.items() if b == main and m.two_stage), None)
    ids = torch.tensor([prompt.context])
    start = time.perf_counter()
    repeat = (repeat_prompt(loaded.tokenizer, cell.cfg.model, sample.chat)
              if any(m.reconstruction for m in cell.methods.values()) else None)
    prefill = run_prefill(loaded.model, ids, cell.methods, two_stage, EngineOptions.from_config(cell.cfg.get("engine")),
                          repeat)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    result = measure(loaded.model, prefill, [(label, main) for label in labels], list(cell.methods))
    decode_s = time.perf_counter() - start
    decode = loaded.tokenizer.decode
    return {
        "prediction": decode([prefill.first_token]),
        "prompt_tokens": prefill.n_tokens, "new_tokens": 1,
        "kv_cache_bytes": result.kv_bytes[(labels[1], main)],
        "kv_cache_bytes_full": full_kv_bytes(loaded.model.config, prefill.n_tokens, loaded.model.dtype),
        "prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
        # The first token comes from the (uncompressed) prefill; the next is the first the cache can change.
        "next_token_full": decode([result.next_token_full]),
        "next_tokens": {label: decode([result.next_tokens[(label, main)]]) for label in labels},
        "headwise": {label: result.headwise[(label, main)].tolist() for label in labels},
        "layerwise": {label: result.layerwise[(label, main)].tolist() for label in labels},
        "final_layer": {label: {str(b): float(result.layerwise[(label, b)][-1]) for b in budgets} for label in labels},
        "assumption1": nan_to_none(result.assumption1),
        "assumption1_without_window": nan_to_none(result.assumption1_prefix),
    }


def nan_to_none(t: torch.Tensor) -> list:
    return [[None if v != v else round(float(v), 6) for v in row] for row in t.tolist()]
