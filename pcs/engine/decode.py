"""Greedy decoding of many sequences at once: the decode pool's step, and the loop that keeps it full.

A ``Sequence`` is one answer: a cell of a sample, from its compressed batch-1 cache (prefill, compression
and the question fed after it are ``pcs.engine.prefill``'s) to its last token. ``DecodePool.step`` is one
forward for every sequence in flight, top to bottom:

1. choose each sequence's token from its logits (greedy; a stop cannot end it before its minimum), the
   step's one read from the device;
2. sequences that stopped, reached their maximum or whose answer is decided (``Sequence.settled``, asked every
   ``SETTLE_EVERY`` tokens) leave (their slots are refilled from the end);
3. one forward feeds every remaining sequence its token at its own position (``PoolCache``: one attention
   call per layer for the whole pool, on CPU one per run of slots of like length), on CUDA as a captured graph
   (``pcs.engine.graphs``); attention records each row's query in its layer's ring (``QueryRings``) while a
   sequence with a trigger is in flight;
4. a layer of a sequence whose heads outgrew its ``compress.trigger`` is compressed again.

``decode`` admits sequences as slots free up, asking for the next sample's only when none wait, so a
sample is prefilled once for all its cells while the others decode. Each sequence gets the tokens batch-1
decoding gives it, up to the rounding of batched kernels (``tests/test_pool.py`` says how near).

Out of device memory, ``decode`` keeps going with fewer answers in flight and loses no finished answer: a
prefill, or a question fed after compression (fed as its answer is about to join), waits for the answers in flight
to finish and is tried again alone; a sequence that cannot join waits and the pool admits no more than it holds; a
step's answers in flight are dropped (their state may be half written), the pool takes half as many from then on,
and their cells are prefilled again. A prompt that does not fit with nothing else in flight and the pool's buffers
at their smallest (``release``) raises ``DoesNotFit``.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from ..cache import CompressedCache
from ..compression import CompressionStats, at_unit_scale, attention_modules, recompress
from ..eviction.base import Method
from ..hybrid import attention_windows, full_attention_layers, head_dim
from ..options import EngineOptions, defaults
from ..upload import upload
from .compiled import compiled_forward
from .pool_cache import PoolCache
from .rings import QueryRings

# How often (in tokens) a sequence with a ``settled`` test is asked it: the test decodes its tokens to text on the
# host, which on a fast device costs more than a step when asked of every sequence at every step. An answer
# decided at token t ends by token t + SETTLE_EVERY - 1; what it decided is unchanged.
SETTLE_EVERY = 4


def clock(device: torch.device) -> float:
    """Seconds, once the device's queued work is done (CUDA runs asynchronously). The pool's step does not call
    it: its one read of the device (the chosen tokens) already waits for the step's work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Generation:
    """One decoded answer and what it cost."""
    token_ids: list[int]
    prompt_tokens: int
    kv_cache_bytes: int        # held right after prefill compression (and the question, if fed after it)
    kv_cache_bytes_full: int   # what the uncompressed cache of the prompt would hold
    prefill_s: float           # the shared prefill (with every cell's compression) plus this cell's question
    decode_s: float            # from joining the pool to leaving it (the pool's other sequences decode meanwhile)
    max_kv_entries: int = 0    # most entries any KV head held after prefill compression and later
    n_compressions: int = 0    # decoding-time recompressions (steps at which some layer recompressed)
    peak_kv_bytes: int = 0     # most bytes the cache held during prefill (a model-wide method: the full cache)
    stage2: object = None      # what stage 2 computed for this prompt (``Stage2Work``; pcs.bench reports it)


@dataclass
class Sequence:
    """One answer to decode: where it comes from, its limits, and its state while it decodes."""
    owner: object                    # the caller's key (which sample and cell the answer is for)
    cache: CompressedCache | None    # its batch-1 cache, until it joins a pool
    logits: torch.Tensor | None      # (vocab,) what its first token is chosen from
    position: int                    # position id of the next token fed (= tokens seen)
    max_new_tokens: int
    min_new_tokens: int
    stops: frozenset[int]
    method: Method
    trigger: int | None              # decoding-time compression: recompress a layer whose head holds more
    result: Generation               # sizes and prefill time filled in; tokens and decode time as it goes
    stats: CompressionStats = field(default_factory=CompressionStats)
    n_queries: int = 0               # its newest queries each layer remembers (decoding-time compression)
    held: int = 0                    # in a pool: entries of its longest head of a full-attention layer
    joined_at: float = 0.0
    joined_fresh: bool = False       # it joined a released pool (smallest buffers): out of memory, it fits nowhere
    source: tuple | None = None      # (Arrival, cell index): how to prefill it again
    # Whether the tokens so far already decide what is measured of the answer, whatever follows (a score that
    # can only rise as the answer grows, at its maximum): the answer may end there. None: never.
    settled: Callable[[list[int]], bool] | None = None

    def decided(self) -> bool:
        n = len(self.result.token_ids)
        return self.settled is not None and n % SETTLE_EVERY == 0 and self.settled(self.result.token_ids)

    def room(self) -> int:
        """Entries each head may still add: one per token fed, and with a trigger no more than it lets a head
        hold (a head past it is compressed again after the step)."""
        left = max(self.max_new_tokens - len(self.result.token_ids), 1)
        return left if self.trigger is None else min(left, self.trigger + 1)

    def finished(self) -> Sequence:
        self.result.max_kv_entries = self.stats.max_kv_entries
        self.result.n_compressions = self.stats.n_compressions
        return self


class DoesNotFit(RuntimeError):
    """A prompt that ran out of device memory with no other answer in flight and the pool's buffers freed."""

    def __init__(self, arrival, stage: str, device: torch.device, err: BaseException):
        self.name, self.tokens, self.stage, self.device = arrival.name, arrival.tokens, stage, device
        super().__init__(f"{arrival.name} ({arrival.tokens:,} tokens) does not fit in {device} memory alone "
                         f"(out of memory {stage}): {str(err).splitlines()[0] if str(err) else type(err).__name__}")


class StepOutOfMemory(Exception):
    """A step ran out of device memory: the answers it finished before, and the sequences that were in flight
    (dropped from the pool, whose buffers may be half written until ``release``)."""

    def __init__(self, finished: list[Sequence], in_flight: list[Sequence]):
        super().__init__(f"out of memory decoding {len(in_flight)} answers")
        self.finished, self.in_flight = finished, in_flight


class DecodePool:
    """Up to ``size`` sequences decoding together (see the module's docstring)."""

    def __init__(self, model, size: int, graphs: bool = False, options: EngineOptions | None = None,
                 compiled: bool | str | None = None):
        self.model, self.size = model, size
        self.options = options or defaults()     # how its prompts are prefilled and compressed
        self.limit = size          # answers admitted in flight: lowered when the device runs out of memory
        self.device = next(model.parameters()).device
        # The step's forward, compiled where ``compiled`` says (None: ``EngineOptions.compile_step``, on CUDA; a
        # string: torch.compile's backend): it then reads every layer's whole capacity, as a captured graph does.
        if compiled is None:
            compiled = self.options.compile_step and self.device.type == "cuda"
        self.compiled = bool(compiled)
        self.forward_step = model if not compiled else compiled_forward(
            model, *([compiled] if isinstance(compiled, str) else []))
        self.use_graphs = graphs
        self.tokens = 0            # tokens decoded by the pool
        self.busy_s = 0.0          # seconds spent in its steps
        self.o_proj = [m.o_proj.weight for m in attention_modules(model)]
        self.compressed = tuple(full_attention_layers(attention_windows(model.config)))   # where methods choose
        self.sequences: list[Sequence] = []            # slot order
        self.release()

    @torch.inference_mode()          # as the step: a compiled step then sees one kind of tensor in every buffer
    def release(self) -> None:
        """Fresh, smallest buffers (the empty pool's grown ones, and their captured graphs, are freed)."""
        assert not self.sequences, "release() with sequences in flight"
        self.cache = PoolCache(self.model.config, self.model.dtype, self.device, max(self.size, 1),
                               self.options.decode_kernel)
        self.layers = self.cache.layers
        self.logits = self.stop_mask = None            # (slots, vocab), allocated with the first sequence
        self.rings: QueryRings | None = None       # the newest queries per layer, while a trigger is in flight
        self.graphs = None
        if self.use_graphs:
            from .graphs import StepGraphs
            self.graphs = StepGraphs(self)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.released = True       # the smallest buffers: releasing again frees nothing (until a join grows them)

    @property
    def free(self) -> int:
        return min(self.size, self.limit) - len(self.sequences)

    def admits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may join now: a slot is free and the buffers it would grow (with their old copies, alive
        while the history moves over) fit in the device's free memory. An empty pool always admits: a sequence
        that cannot fit alone fails loudly."""
        if not self.free:
            return False
        if not self.sequences:
            return True
        return self.growth(seq) * 1.1 < free_memory(self.device)

    def growth(self, seq: Sequence) -> int:
        """Bytes of the buffers ``seq`` joining would allocate: each layer's that grows (slots, capacity, or mask
        rows where its query heads chose apart), the logits' and stop masks' rows, and the query rings' (a
        sequence with a trigger, or any while they exist: they follow the slots)."""
        slots, room = len(self.sequences) + 1, seq.room()
        grown, rows_of_logits = 0, self.layers[0].grown_slots(slots)
        for layer, held in zip(self.layers, seq.cache.layers):
            rows = max(layer.rows, held.allowed.shape[1] if held.is_buffered and held.allowed is not None else 1)
            grown += layer.growth(slots, max(held.entries_per_head()) + room, rows)
        if self.logits is None or self.logits.shape[0] < slots:
            vocab = seq.logits.shape[-1]
            grown += rows_of_logits * vocab * (torch.empty(0, dtype=self.model.dtype).element_size() + 1)
        if seq.trigger is not None or self.rings is not None:
            grown += (self.rings or self.new_rings()).bytes_for(rows_of_logits, self.window_for(seq))
        return grown

    # -- joining and leaving ---------------------------------------------------------------------------------
    @torch.inference_mode()          # as the step: buffers the step grew are inference tensors
    def join(self, seq: Sequence) -> None:
        """The sequence takes the next slot: its cache's entries, its logits, its stop tokens. Out of memory, the
        slot is left free and the sequence keeps its batch-1 cache."""
        slot = len(self.sequences)
        room = seq.room()
        if self.graphs is not None:
            self.graphs.changed()
        seq.joined_fresh, self.released = self.released, False      # the join may grow them, even if it fails
        try:
            for layer, held in zip(self.layers, seq.cache.layers):
                layer.load(slot, held, room)
            self.reserve_rows(slot + 1, seq.logits.shape[-1])
            self.logits[slot] = seq.logits
            self.stop_mask[slot] = False
            if seq.stops:
                self.stop_mask[slot, list(seq.stops)] = True
            if seq.trigger is not None:
                self.remember_window(slot, seq)
        except torch.OutOfMemoryError:
            for layer in self.layers:
                if slot < layer.slots:
                    layer.free(slot)
            raise
        seq.cache = seq.logits = None
        seq.held = self.cache.longest(slot)
        seq.stats.max_kv_entries = max(seq.stats.max_kv_entries, seq.held)
        seq.joined_at = time.perf_counter()
        self.sequences.append(seq)

    def reserve_rows(self, slots: int, vocab: int) -> None:
        if self.logits is not None and self.logits.shape[0] >= slots:
            return
        logits = torch.zeros(max(slots, self.layers[0].slots), vocab, dtype=self.model.dtype, device=self.device)
        stop_mask = torch.zeros(logits.shape, dtype=torch.bool, device=self.device)
        if self.logits is not None:
            logits[:self.logits.shape[0]] = self.logits
            stop_mask[:self.logits.shape[0]] = self.stop_mask
        self.logits, self.stop_mask = logits, stop_mask

    def remember_window(self, slot: int, seq: Sequence) -> None:
        """The newest queries of each full-attention layer, which decoding-time recompression scores with
        (``QueryRings``), fed by attention at every step (the layers' ``recorder``)."""
        if self.rings is None:
            self.rings = self.new_rings()
        # never narrower than they are: sequences in flight may read windows wider than the newcomers need
        self.rings.reserve(max(slot + 1, self.layers[0].slots), self.window_for(seq))
        seq.n_queries = min([self.rings.remember(slot, i, seq.cache.layers[i].recent_queries)
                             for i in self.rings.layers], default=0)
        for i in self.rings.layers:
            self.layers[i].recorder = self.recorder(i)

    def new_rings(self) -> QueryRings:
        return QueryRings(list(self.compressed), self.model.config.num_attention_heads, head_dim(self.model.config),
                          self.model.dtype, self.device)

    def window_for(self, seq: Sequence) -> int:
        """The queries the rings keep once ``seq`` joins: the widest window of a sequence with a trigger."""
        return max([1] + [s.method.window for s in self.sequences + [seq] if s.trigger is not None])

    def recorder(self, i: int):
        def record(query: torch.Tensor, scaling: float | None) -> None:   # (batch, H_q, 1, d), rotary applied
            self.rings.record(i, at_unit_scale(query, scaling))
        return record

    def leave(self, slot: int) -> None:
        """The sequence at ``slot`` leaves; the last one in flight moves into its slot."""
        if self.graphs is not None:
            self.graphs.changed()
        last = len(self.sequences) - 1
        for layer in self.layers:
            layer.move(last, slot) if slot != last else layer.free(slot)
        if slot != last:
            self.logits[slot] = self.logits[last]
            self.stop_mask[slot] = self.stop_mask[last]
            if self.rings is not None:
                self.rings.move(last, slot)
            self.sequences[slot] = self.sequences[last]
        self.sequences.pop()
        if self.rings is not None and all(s.trigger is None for s in self.sequences):
            self.forget_windows()

    def forget_windows(self) -> None:
        """No sequence in flight is compressed again: the rings and their recorders go (every step fed them for
        every row); the next sequence with a trigger builds them anew."""
        for layer in self.layers:
            layer.recorder = None
        self.rings = None

    # -- the step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One token for every sequence in flight; returns those that finished (their results complete)."""
        start = time.perf_counter()
        live = len(self.sequences)
        early = [len(s.result.token_ids) < s.min_new_tokens for s in self.sequences]
        logits = self.logits[:live]
        if any(early):       # a stop cannot end these yet (a (live, vocab) copy, so only when one is that young)
            logits = logits.masked_fill(self.stop_mask[:live] & self.upload(early)[:, None], float("-inf"))
        chosen = logits.argmax(-1).tolist()
        done = []
        for slot, (seq, token) in enumerate(zip(self.sequences, chosen)):
            if token in seq.stops:
                done.append(slot)
                continue
            seq.result.token_ids.append(token)
            if len(seq.result.token_ids) == seq.max_new_tokens or seq.decided():
                done.append(slot)
        now = time.perf_counter()
        finished = [self.sequences[slot] for slot in done]
        for seq in finished:
            seq.result.decode_s = now - seq.joined_at
        for slot in reversed(done):
            self.leave(slot)
        if self.sequences:
            try:
                self.forward()
                self.recompress_full_layers()
            except torch.OutOfMemoryError as err:
                in_flight, self.sequences = self.sequences, []       # the caller frees the buffers (release)
                raise StepOutOfMemory([seq.finished() for seq in finished], in_flight) from err
        self.tokens += live
        self.busy_s += time.perf_counter() - start
        return [seq.finished() for seq in finished]

    def upload(self, values: list) -> torch.Tensor:
        return upload(values, self.device)

    def forward(self) -> None:
        """Every sequence in flight fed its last token at its own position; their next logits."""
        live = len(self.sequences)
        ids = self.upload([[s.result.token_ids[-1]] for s in self.sequences])
        positions = self.upload([[s.position] for s in self.sequences])
        if self.rings is not None:      # rows for slots joined without a trigger; never inside a captured forward
            self.rings.reserve(self.layers[0].slots if self.graphs is not None else live, 1)
        if self.graphs is not None:
            self.logits[:live] = self.graphs.run(ids, positions)
        else:
            self.cache.prepare_step(live, whole_capacity=self.compiled)
            out = self.forward_step(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
            self.logits[:live] = out.logits[:, -1]
        self.cache.stepped(live)
        if self.rings is not None:
            self.rings.stepped()
        grown = 1 if self.compressed else 0     # every head of a full-attention layer holds one entry more
        for seq in self.sequences:
            seq.position += 1
            seq.n_queries += 1
            seq.held += grown
            seq.stats.max_kv_entries = max(seq.stats.max_kv_entries, seq.held)

    def recompress_full_layers(self) -> None:
        """Decoding-time compression: a layer of a sequence whose longest head exceeds the sequence's trigger
        is compressed again by its method, its newest queries as the observation window (as batch 1 does
        right after that layer's forward: the layer is not read again before the next step)."""
        n_layers, live = len(self.layers), len(self.sequences)
        triggered = [(slot, seq) for slot, seq in enumerate(self.sequences)
                     if seq.trigger is not None and seq.held > seq.trigger]    # a layer of each is past its trigger
        for i, layer in enumerate(self.layers):
            if layer.is_sliding or not triggered:
                continue
            longest = layer.lengths[:live].max(axis=1)        # one host pass per layer, not one per sequence
            for slot, seq in triggered:
                if longest[slot] <= seq.trigger:
                    continue
                row = layer.row_layer(slot)
                row.recent_queries = self.rings.newest(i, slot, min(seq.n_queries, seq.method.window,
                                                                     self.rings.window))
                if recompress(row, seq.method, i, n_layers, self.o_proj[i], self.compressed, self.options.stage2):
                    seq.stats.compressed_at.add(seq.position)
                    layer.load(slot, row, seq.room())
                    if self.graphs is not None:
                        self.graphs.changed()
        for slot, seq in triggered:
            seq.held = self.cache.longest(slot)


def decode(pool: DecodePool, arrivals: Iterable) -> Iterator[Sequence]:
    """Every cell of every ``Arrival`` decoded, yielded as it finishes. An arrival is prefilled only when no
    sequence waits and a slot is free, so prefills interleave with decoding and at most one sample's cells wait
    outside the pool. Out of device memory, fewer answers go on in flight (the module's docstring)."""
    arrivals = iter(arrivals)
    again: deque[tuple] = deque()    # (arrival, answers) to prefill again before new arrivals
    waiting: deque = deque()         # one arrival's answers: the first asked (its question fed) as it comes up
    more, drain = True, False        # drain: a prefill waits for the answers in flight to finish

    def out_of_memory(arrival, which, stage: str, err) -> None:
        nonlocal drain
        if pool.sequences:
            say(f"{arrival.name} ({arrival.tokens:,} tokens) ran out of memory {stage} with {len(pool.sequences)} "
                f"answers in flight: it is prefilled alone once they finish")
            drain = True
        elif pool.released:
            raise DoesNotFit(arrival, stage, pool.device, err) from err
        else:
            pool.release()
        again.appendleft((arrival, which))

    while True:
        while pool.free and not drain:
            if waiting:
                if not isinstance(waiting[0], Sequence):
                    try:
                        waiting[0] = waiting[0].ask()
                    except torch.OutOfMemoryError as err:
                        # Its cell's cache may be half fed: the sample's waiting answers are prefilled again.
                        ((arrival, which),) = cells_of(list(waiting))
                        waiting.clear()
                        out_of_memory(arrival, which, "feeding its question", err)
                        continue
                seq = waiting[0]
                if seq.max_new_tokens == 0:
                    yield waiting.popleft().finished()
                    continue
                if not pool.admits(seq):
                    break
                try:
                    pool.join(seq)
                except torch.OutOfMemoryError as err:
                    if pool.sequences:
                        pool.limit = len(pool.sequences)
                        say(f"out of memory admitting {seq.source[0].name}: at most {pool.limit} answers in flight "
                            f"from now on")
                        break
                    if seq.joined_fresh:
                        raise DoesNotFit(seq.source[0], "joining the decode pool", pool.device, err) from err
                    pool.release()
                    continue
                waiting.popleft()
                continue
            if again:
                arrival, which = again.popleft()
            else:
                arrival, which = next(arrivals, None), None
                if arrival is None:
                    more = False
                    break
            try:
                waiting.extend(arrival.answers(which, pool.options))
            except torch.OutOfMemoryError as err:
                out_of_memory(arrival, which, "in its prefill", err)
        if not pool.sequences:
            if drain:
                pool.release()
                drain = False
                continue
            if not waiting and not again and not more:
                return
            continue
        try:
            yield from pool.step()
        except StepOutOfMemory as oom:
            pool.release()
            yield from oom.finished
            if len(oom.in_flight) == 1 and oom.in_flight[0].joined_fresh:
                (seq,) = oom.in_flight
                raise DoesNotFit(seq.source[0], "decoding", pool.device, oom.__cause__) from oom.__cause__
            pool.limit = max(1, len(oom.in_flight) // 2)
            say(f"out of memory decoding {len(oom.in_flight)} answers: they start again from their prefills, at "
                f"most {pool.limit} in flight from now on")
            again.extend(cells_of(oom.in_flight))


def cells_of(sequences: list) -> list[tuple]:
    """(arrival, its answers) of each arrival among ``sequences`` (or answers not yet asked), in order."""
    grouped: dict[int, tuple] = {}
    for seq in sequences:
        arrival, index = seq.source
        grouped.setdefault(id(arrival), (arrival, []))[1].append(index)
    return list(grouped.values())


def say(text: str) -> None:
    print(f"[pcs] {text}", flush=True)


CPU_POOL = 32          # engine.pool=null on a CPU: the fastest size in the CPU pool bench (results/bench/README.md)
CUDA_POOL = 256        # engine.pool=null on CUDA: at most this many, as free memory allows (``admits``)


def free_memory(device: torch.device) -> float:
    """Bytes the device can still allocate: CUDA's free memory and what torch's caching allocator holds unused
    (it serves or frees that before running out), or the host's available memory (Linux)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return float("inf")


def open_pool(model, options: EngineOptions) -> DecodePool:
    """The decode pool for the engine's options (``pool``, ``cuda_graphs``) on the model's device, its size
    printed."""
    device = next(model.parameters()).device
    graphs = options.cuda_graphs and device.type == "cuda"
    size = options.pool
    if size is None:
        size = CUDA_POOL if device.type == "cuda" else CPU_POOL
        why = f"engine.pool=null on {device.type.upper()}: up to {size}, as the {free_memory(device) / 2**30:.1f} GiB free allow"
    else:
        why = f"engine.pool={size}; {free_memory(device) / 2**30:.1f} GiB free"
    pool = DecodePool(model, size, graphs, options)
    steps = ("compiled, " if pool.compiled else "") + ("CUDA graphs" if graphs else "eager")
    print(f"[pcs] decode pool: {size} sequence(s) in flight ({why}); {steps} decoding steps", flush=True)
    return pool
