"""Prefill compression: forward hooks on every attention module that shrink its cache layer.

The hook runs right after a layer's prefill forward, so the full cache of a layer lives only while
that layer is being computed (peak memory of one layer's full KV, as in SnapKV's and kvpress's
pipelines). It rebuilds the last ``w`` queries from the layer input, because the attention module
does not expose them, and asks the method which entries each KV head keeps. The prefill runs with full
attention whatever is evicted, so several methods can share it: each takes its own compressed copy of
every layer (``compress_each_after_prefill``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .cache import CompressedCache
from .eviction.base import LayerState, Method
from .eviction.scores import SharedScores
from .eviction.stage2_search import Stage2Run, Stage2Work
from .options import EngineOptions, Stage2Search, defaults
from .hybrid import full_attention_layers


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def query_states(attn: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """(H_q, t, d) queries of the tokens of ``hidden_states`` (1, t, hidden) before rotary, as the attention module
    computes them (its query norm, where it has one: per head in Gemma 3 and Qwen3, over all heads in OLMo 3)."""
    d = attn.head_dim
    q = attn.q_proj(hidden_states)
    norm = getattr(attn, "q_norm", None)
    if norm is not None and norm.weight.shape[-1] != d:     # over every head's dimensions at once (OLMo 3)
        q = norm(q)
    q = q.view(1, hidden_states.shape[1], -1, d).transpose(1, 2)        # (1, H_q, t, d)
    if norm is not None and norm.weight.shape[-1] == d:     # per head (Gemma 3, Qwen3)
        q = norm(q)
    return q[0]


def window_queries(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings,
                   window: int) -> torch.Tensor:
    """Rotary-embedded queries of the last ``window`` tokens, (H_q, w, d), recomputed from the layer input as
    the attention module computes them (``query_states``). Scaled so that
    ``q k / sqrt(d)``, which the methods' window attention computes, is the model's own logit where its scale
    is not ``1 / sqrt(d)`` (Gemma's ``query_pre_attn_scalar``)."""
    q = query_states(attn, hidden_states[:, -window:])
    cos, sin = position_embeddings
    cos, sin = cos[0, -window:], sin[0, -window:]
    return at_unit_scale(q * cos + rotate_half(q) * sin, getattr(attn, "scaling", None))


class PromptQueries:
    """Every query of one layer's prompt, computed only when a method reads them (a scorer of the whole prompt:
    ``pcs.eviction.scorers``), then once for every method sharing the prefill; and the model's rotary embedding
    at any position of this layer (Expected Attention's future positions)."""

    def __init__(self, attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, rotary):
        self.attn, self.hidden, self.position_embeddings, self.rotary = attn, hidden_states, position_embeddings, rotary

    @property
    def n_tokens(self) -> int:
        return self.hidden.shape[1]

    @functools.cached_property
    def unrotated(self) -> torch.Tensor:
        """(H_q, n, d) before rotary and unscaled, as the module computes them."""
        return query_states(self.attn, self.hidden)

    @functools.cached_property
    def rotated(self) -> torch.Tensor:
        """(H_q, n, d) at their positions, at the methods' unit scale (``window_queries``)."""
        return window_queries(self.attn, self.hidden, self.position_embeddings, self.n_tokens)

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary (cos, sin), each (len(positions), d), of this layer at ``positions``."""
        cos, sin = self.rotary(self.hidden, positions[None])
        return cos[0], sin[0]


def rotary_of(model, attn: torch.nn.Module):
    """The model's rotary embedding as ``attn``'s layer applies it, ``(x, positions) -> (cos, sin)`` (a hybrid
    model's rotary takes the layer's type: Gemma 3's full-attention layers rotate at their own base)."""
    rotary = model.model.rotary_emb
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return functools.partial(rotary, layer_type=model.config.layer_types[attn.layer_idx])
    return rotary


def at_unit_scale(queries: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """(..., d) queries of a model whose logits are ``q k * scaling``, scaled so that ``q k / sqrt(d)`` (what the
    methods' window attention computes) is that logit."""
    d = queries.shape[-1]
    if scaling is None or math.isclose(scaling * math.sqrt(d), 1.0):
        return queries
    return queries * (scaling * math.sqrt(d))


def attention_modules(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


@contextmanager
def hooked(modules, hook, with_kwargs: bool = True):
    """``hook`` runs after every forward of each of ``modules`` while the context is active."""
    handles = [m.register_forward_hook(hook, with_kwargs=with_kwargs) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def compressed_layers(cache: CompressedCache) -> tuple[int, ...]:
    """The layers methods choose in: every layer but a hybrid model's sliding-window ones."""
    return tuple(full_attention_layers(cache.windows))


def layers_behind(device: torch.device, options: EngineOptions) -> int:
    """How many layers behind the forward a prefill on ``device`` compresses, on a stream of its own
    (``EngineOptions.layers_behind`` on CUDA; on a CPU each layer right after its own forward)."""
    return options.layers_behind if device.type == "cuda" else 0


@functools.cache
def compression_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's one stream for compressions (the allocator caches memory per stream, so a new stream per
    prefill would strand what the earlier ones freed), of high priority: its small kernels, which the host waits
    for, take the next free multiprocessors instead of queueing behind the forward's large products."""
    return torch.cuda.Stream(device, priority=-1)


class LaggedCompression:
    """Each layer's compression, in layer order, ``layers_behind`` layers behind the forward on a second CUDA
    stream. Layer l's is queued once layer l + behind's attention is queued; it waits (an event) only for its own
    layer's forward, so the host's reads inside it (budgets, stage 2's bounds) wait for the selection alone while
    the GPU still has ``behind`` layers of forward to run, and the host's launches for the selection overlap them.
    The forward's stream then waits for the selection before its next work, so every tensor either stream
    allocates is ordered after the other's use of it. At 0 layers behind each layer's work runs at once, as if
    this were not here."""

    def __init__(self, device: torch.device, behind: int):
        self.behind = behind
        self.stream = compression_stream(device) if self.behind and device.type == "cuda" else None
        self.pending: collections.deque = collections.deque()

    def push(self, work) -> None:
        if not self.behind:
            work()
            return
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()                   # the layer's forward and its window's queries, on the forward's stream
        self.pending.append((work, ready))
        if len(self.pending) > self.behind:
            self.run(*self.pending.popleft())

    def run(self, work, ready) -> None:
        if self.stream is None:              # behind without a second stream: only a test's reordering on a CPU
            work()
            return
        forward = torch.cuda.current_stream()
        self.stream.wait_event(ready)
        try:
            with torch.cuda.stream(self.stream):
                work()
        finally:       # also when the work fails (out of memory): what it queued is done before the forward reuses
            forward.wait_stream(self.stream)        # the memory it freed

    def flush(self) -> None:
        """The last layers' work: the forward is over."""
        while self.pending:
            self.run(*self.pending.popleft())


@contextmanager
def after_prefill(model, cache: CompressedCache, windows: list[int], on_layer, on_sliding=None, shared=False,
                  options: EngineOptions | None = None):
    """While active, ``on_layer(queries, state, cache_layer)`` runs right after each full-attention module's
    multi-token forward, with the layer's full keys and values (``state``, whose ``window_queries`` are the
    longest window's) and ``queries[w]``, its last ``w`` queries for each ``w`` of ``windows``. Each window's
    queries are computed on their own, as a lone prefill with that window would. ``shared``: the state carries
    a ``SharedScores`` for the methods that all compress the layer (a group of runs). After a sliding-window
    layer's forward, ``on_sliding(layer_idx, cache_layer)`` runs instead (None: the layer stays as it is). On CUDA
    both run a few layers late, beside the forward of the next (``LaggedCompression``); all have run when the
    context exits without an error. ``options``: the engine's (None: the defaults), for how far behind and the
    shared scores' value-norm kernel."""
    options = options or defaults()
    modules = attention_modules(model)
    compressed = compressed_layers(cache)
    device = next(model.parameters()).device
    late = LaggedCompression(device, layers_behind(device, options))
    kernel = options.stage2.value_norm_kernel
    rotaries = [rotary_of(model, module) for module in modules]

    def hook(module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden.shape[1] <= 1:
            return
        layer = cache.layers[module.layer_idx]
        if layer.is_sliding:
            if on_sliding is not None:
                late.push(lambda: on_sliding(module.layer_idx, layer))
            return
        keys, values = layer.dense()
        queries = {w: window_queries(module, hidden, kwargs["position_embeddings"], w) if w else keys.new_empty(0)
                   for w in windows}
        prompt = PromptQueries(module, hidden, kwargs["position_embeddings"], rotaries[module.layer_idx])
        state = LayerState(module.layer_idx, len(modules), keys, values, queries[max(windows, default=0)],
                           module.o_proj.weight, compressed=compressed, prompt=prompt,
                           shared=SharedScores(values, module.o_proj.weight, kernel) if shared else None)
        late.push(lambda: on_layer(queries, state, layer))

    with hooked(modules, hook):
        yield cache
        late.flush()


class LayerChoices:
    """One method's kept entries, layer by layer during a prefill. A model-wide method only scores each
    layer as it passes and chooses for all layers in ``finish``, once all are seen; one scored by a reconstruction
    (``Method.reconstruction``) only notes the layers it chooses in, its scores coming to ``finish``. ``stage2``:
    the method's stage 2 for this prompt (the engine's search, and the tally it counts in)."""

    def __init__(self, method: Method, n_layers: int, stage2: Stage2Run):
        self.stage2 = stage2
        self.given = self.method = method   # ``method`` as configured; ``self.method``: for the prompt at hand
        self.kept, self.scores, self.n_tokens = [None] * n_layers, {}, 0
        self.layers: list[int] = []         # the layers it chooses in (a reconstruction's)
        self.states: dict[int, LayerState] = {}   # the layers a ``choice_reads_layers`` method's choice reads

    def add(self, state: LayerState):
        """The layer's kept entries if they are known now (None: kept whole, or chosen in ``finish``)."""
        self.method = self.given.for_prompt(state.n_tokens)   # a share-of-prompt budget, in entries
        if not self.method.model_wide:
            self.kept[state.layer_idx] = self.method.keep(state, self.stage2)
            return self.kept[state.layer_idx]
        if self.method.choice_reads_layers:     # its tensors, not the prompt's queries (a prefill's, held until then)
            self.states[state.layer_idx] = dataclasses.replace(state, prompt=None)
        if self.method.reconstruction is not None:
            self.layers.append(state.layer_idx)
            self.n_tokens = state.n_tokens
            return None
        scores = self.method.score(state)
        if scores is not None:
            self.scores[state.layer_idx], self.n_tokens = scores, state.n_tokens
        return None

    @property
    def reconstruction(self):
        """The reconstruction this method's choice waits for (None: none)."""
        return self.method.reconstruction if self.layers else None

    def finish(self, reconstructed: dict | None = None) -> list:
        """Per layer: None (kept whole) or one LongTensor of kept positions per KV head. ``reconstructed``: each
        reconstruction's scores per layer (``pcs.reconstruction.reconstruct``), for a method that reads one."""
        if self.reconstruction is not None:
            scores = reconstructed[self.reconstruction]
            self.scores, self.layers = {l: scores[l] for l in self.layers}, []
        if self.scores:
            reads = (self.states, self.stage2) if self.method.choice_reads_layers else ()
            for layer_idx, kept in self.method.choose(self.scores, self.n_tokens, *reads).items():
                self.kept[layer_idx] = kept
            self.scores, self.states = {}, {}
        return self.kept


def reconstructed_for(choices: list[LayerChoices], caches: list[CompressedCache], reconstruct) -> dict:
    """The reconstructions ``choices`` wait for, computed by ``reconstruct(cache, requests, layers)`` on the cache of
    the first that waits (a model-wide method's: its full-attention layers still whole)."""
    requests = {choice.reconstruction for choice in choices} - {None}
    if not requests:
        return {}
    if reconstruct is None:
        raise ValueError("a method scored by a reconstruction (KVzip) needs the prompt's repeat request: "
                         "pass reconstruct= (pcs.reconstruction)")
    cache = next(cache for choice, cache in zip(choices, caches) if choice.reconstruction is not None)
    return reconstruct(cache, requests, compressed_layers(cache))


@dataclass
class PrefillStats:
    peak_kv_bytes: int = 0      # most bytes the cache held at once during the prefill
    stage2: Stage2Work = field(default_factory=Stage2Work)   # what stage 2 computed for this prompt (pcs.bench)


@dataclass
class CellCache:
    """One method's share of a prefill: its own cache, filled layer by layer with what it keeps."""
    method: Method
    cache: CompressedCache
    stats: PrefillStats = field(default_factory=PrefillStats)


@contextmanager
def compress_each_after_prefill(model, methods: list[Method], caches: list[CompressedCache],
                                options: EngineOptions | None = None, reconstruct=None):
    """One prefill for several methods. The forward writes to ``caches[0]``; right after each attention
    module's forward, every method chooses from that layer's full keys and values and its cache takes
    its kept entries (copied out), then the full layer is released unless a method keeps it whole. So
    the peak is one full layer (more where the compression runs behind the forward, on CUDA) plus
    every method's compressed layers, and each method ends with the
    cache a prefill of its own would give. A model-wide method keeps its full layers until the context
    closes, then compresses every layer at once (``PrefillStats.peak_kv_bytes`` records it); one scored by a
    reconstruction first has it computed by ``reconstruct(cache, requests, layers)`` (``reconstructed_for``), on a
    copy of its full cache per chunk. ``options``: the engine's (None: the defaults)."""
    n_layers = model.config.num_hidden_layers
    cells = [CellCache(method, cache) for method, cache in zip(methods, caches)]
    search = (options or defaults()).stage2
    choices = [LayerChoices(cell.method, n_layers, Stage2Run(search, cell.stats.stage2)) for cell in cells]
    prefill = caches[0]

    def held_whole(layer_idx: int, layer) -> int:
        """Bytes of full layers the prefill holds while layer ``layer_idx`` is compressed: that layer, and the next
        ones whose forward ran first (``LaggedCompression``)."""
        return layer.nbytes() + sum(later.nbytes() for later in prefill.layers[layer_idx + 1:])

    def compress(queries: dict[int, torch.Tensor], state: LayerState, layer) -> None:
        full_bytes = held_whole(state.layer_idx, layer)
        # The others first, while the layer is still whole; the cache the forward writes to last.
        for cell, choice in reversed(list(zip(cells, choices))):
            own = cell.cache.layers[state.layer_idx]
            earlier = sum(done.nbytes() for done in cell.cache.layers[:state.layer_idx])
            cell.stats.peak_kv_bytes = max(cell.stats.peak_kv_bytes, earlier + full_bytes)
            mine = state.seen_by(queries[cell.method.window])
            if own is not layer:
                own.take(layer)
            own.recent_queries = mine.window_queries    # the window, should decoding recompress later
            with torch.profiler.record_function("pcs.compress"):   # a label in profiles (python -m pcs.bench --profile)
                kept = choice.add(mine)
                if kept is not None:
                    own.compress(kept)

    def keep_window(layer_idx: int, layer) -> None:
        """A sliding-window layer: every cell keeps the model's window, whatever its method."""
        full_bytes = held_whole(layer_idx, layer)
        for cell in reversed(cells):      # the cache the forward writes to last, as above
            own = cell.cache.layers[layer_idx]
            earlier = sum(done.nbytes() for done in cell.cache.layers[:layer_idx])
            cell.stats.peak_kv_bytes = max(cell.stats.peak_kv_bytes, earlier + full_bytes)
            if own is not layer:
                own.take(layer)
            own.settle()

    with after_prefill(model, prefill, sorted({m.window for m in methods}), compress, keep_window,
                       shared=len(methods) > 1, options=options):
        yield cells
    reconstructed = reconstructed_for(choices, caches, reconstruct)
    for cell, choice in zip(cells, choices):
        if cell.method.model_wide:
            held = cell.cache.nbytes() * (2 if choice.reconstruction is not None else 1)   # and a chunk's copy
            cell.stats.peak_kv_bytes = max(cell.stats.peak_kv_bytes, held)
            with torch.profiler.record_function("pcs.compress"):
                for layer, kept in zip(cell.cache.layers, choice.finish(reconstructed)):
                    if kept is not None:
                        layer.compress(kept)


@contextmanager
def compress_after_prefill(model, method: Method, cache: CompressedCache, options: EngineOptions | None = None,
                           reconstruct=None):
    """While active, each attention module compresses its layer of ``cache`` after a multi-token
    forward (see ``compress_each_after_prefill``, of which this is the one-method case)."""
    with compress_each_after_prefill(model, [method], [cache], options, reconstruct) as (cell,):
        yield cell.stats


@dataclass
class CompressionStats:
    max_kv_entries: int = 0                               # most entries any head held after a forward
    compressed_at: set = field(default_factory=set)      # positions at which some layer recompressed

    @property
    def n_compressions(self) -> int:
        return len(self.compressed_at)


def recompress(layer, method: Method, layer_idx: int, n_layers: int, o_proj_weight: torch.Tensor,
               compressed: tuple[int, ...] | None = None, search: Stage2Search | None = None) -> bool:
    """Compress a layer again with ``method``, its newest queries as the observation window (``compressed``: the
    layers methods choose in, for ``LayerState.depth``; ``search``: stage 2's, None for the default). Returns
    whether anything was evicted."""
    keys, values, pad = layer.left_padded()
    state = LayerState(layer_idx, n_layers, keys, values, layer.recent_queries, o_proj_weight, pad, compressed)
    kept = method.keep(state, Stage2Run(search or defaults().stage2))
    if kept is None:
        return False
    layer.compress([idx - p for idx, p in zip(kept, pad.tolist())])
    return True


@contextmanager
def recompress_when_full(model, method: Method, cache: CompressedCache, trigger: int | None, stats: CompressionStats,
                         search: Stage2Search | None = None):
    """Decoding-time compression: after every forward while active, each layer remembers its newest
    ``window`` queries and, once one of its heads holds more than ``trigger`` entries, is compressed
    again by ``method`` to its budget, the newest queries being the observation window. So no head
    ever holds more than ``trigger + 1`` entries. Heads of different lengths (AdaKV) are scored
    together, padded at the front so that their newest entries line up. ``trigger=None`` only counts."""
    modules = attention_modules(model)
    window = method.window if trigger is not None else 0
    compressed = compressed_layers(cache)

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        if layer.is_sliding:        # it keeps its window, never more: nothing to count or recompress
            return
        if window:
            hidden = kwargs["hidden_states"]
            new = window_queries(module, hidden, kwargs["position_embeddings"], min(window, hidden.shape[1]))
            old = layer.recent_queries
            layer.recent_queries = new if old is None or old.numel() == 0 else torch.cat([old, new], dim=1)[:, -window:]
        held = max(layer.entries_per_head())
        stats.max_kv_entries = max(stats.max_kv_entries, held)
        if trigger is not None and held > trigger and recompress(layer, method, module.layer_idx, len(modules),
                                                                 module.o_proj.weight, compressed, search):
            stats.compressed_at.add(layer.n_positions)

    with hooked(modules, hook):
        yield stats
