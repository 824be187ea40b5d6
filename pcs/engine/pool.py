"""The decode pool's cache: every sequence in flight in one padded buffer per layer, one attention call per layer
(on CPU one per run of slots reading the same whole key blocks, ``read_spans``).

A layer holds (slots, H_kv, capacity, d) keys and values. Slot s is one sequence (a cell of a sample);
KV head h of slot s holds its entries in ``[:lengths[s, h]]`` whatever the other heads and slots hold, so
per-head lengths (AdaKV, PyramidKV, LaProx) and sequences of any length share the buffer. A mask
(slots, H_kv, rows, capacity) says which entries each query row sees: a head's own, and per query head
where a method chose per query head (``rows`` becomes the group when such a sequence joins; else 1). A
decoding step writes each head's new entry at its own length through flat indices kept on the device,
and attends once per layer for the whole pool: the sequences are the batch (on CPU, once per run of slots that
read fewer keys, ``read_spans``).

Sequences in flight occupy slots ``[0, live)``: one that leaves is replaced by the last (``move``), so a
step's batch is a prefix of the slots. The host mirrors every length (``lengths``), so nothing is read
back from the device to know where entries go, how far attention must look, or when a layer crosses a
recompression trigger. Write indices, masks and the device's lengths (``held``) advance on the device inside
the step (by ``advance``: 1 for a slot in flight, 0 for a free one), which is what lets a CUDA graph replay the
step unchanged.

On CUDA (``EngineOptions.decode_kernel``) attention goes through ``pcs.kernels.decode_attention`` instead: each
(slot, KV head) reads its own first ``held`` entries, so neither the padding of shorter heads nor a longer row
in flight adds to what a row reads; the mask is read only once some row's query heads chose apart (then for
every row). Its full-attention layers are then ``pcs.engine.jagged.JaggedPoolLayer``s, which hold each sequence
at its own capacity rather than every slot at the longest's.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache import CompressibleLayer, HeldKeys
from ..kernels import decode_attention
from ..upload import upload

GROWTH = 256   # entries added beyond what a growing layer needs (it grows by at least half)

# Keys per block of PyTorch's CPU attention kernel (min(512, L): it splits the L keys so). A slot that reads only
# its first whole blocks gets the bits it gets reading all L (the blocks past its entries are masked whole, and
# add exact zeros), so on one thread splitting a step's attention by slot changes no answer (tests/test_pool.py
# checks it). On more threads the kernel's bits already depend on the batch at some head shapes (1 or 3 query
# heads per KV head: outputs differ in their last bits between a call of 7 slots and one of 3), split or not;
# there pooled answers are batch 1's up to near-ties, and a run's answers are reproducible at a fixed thread count.
CPU_KEY_BLOCK = 512


def bucket(live: int, size: int) -> int:
    """Slots for ``live`` sequences: the smallest power of two holding them, or the pool's size (the buffers grow
    so, and the CUDA graphs are captured per such bucket)."""
    return min(1 << (live - 1).bit_length(), size)


def read_spans(needed: np.ndarray, width: int, n_kv_heads: int, threads: int) -> tuple[tuple[int, int, int], ...] | None:
    """On CPU, runs ``(start, stop, w)`` of consecutive slots whose attention reads only their first ``w`` keys,
    ``needed`` (per slot, entries of its longest head after the step) rounded up to whole ``CPU_KEY_BLOCK``s; None
    when one call over all ``width`` keys is as fast. Attention over keys a slot masks is most of a step's work
    once a pool mixes lengths (a full cache among compressed ones). The runs are called one after another, and the
    kernel shares a call's (slot, KV head) pairs among the ``threads``: with many threads and few heads a lone long
    slot would keep one busy while the rest wait, so the split is taken only where it reads fewer keys per thread."""
    widths = np.minimum(-(-needed // CPU_KEY_BLOCK) * CPU_KEY_BLOCK, width)
    if (widths == width).all():
        return None
    starts = [0] + [s for s in range(1, len(widths)) if widths[s] != widths[s - 1]]
    spans = tuple((a, b, int(widths[a])) for a, b in zip(starts, starts[1:] + [len(widths)]))

    def busiest(slots: int, w: int) -> int:       # keys the busiest thread reads in one call
        return -(-slots * n_kv_heads // threads) * w
    if sum(busiest(b - a, w) for a, b, w in spans) >= busiest(len(widths), width):
        return None
    return spans


class PoolLayer(CacheLayerMixin):
    """One decoder layer of the pool (see the module's docstring)."""
    is_sliding = False

    def __init__(self, n_kv_heads: int, head_dim: int, dtype, device, max_slots: int, kernel: bool = False):
        super().__init__()
        self.n_kv_heads, self.head_dim, self.max_slots = n_kv_heads, head_dim, max_slots
        self.dtype, self.device, self.is_initialized = dtype, torch.device(device), True
        # each (slot, KV head) attends over its own entries through the kernel, its lengths kept on the device
        self.kernel = kernel and decode_attention.available(self.device, head_dim)
        self.slots = self.capacity = self.rows = 0
        self.reserve(1, 1, 1)
        self.width = 1          # entries attention reads per head this step
        self.spans = None       # slots reading fewer entries this step (read_spans), on CPU
        self.recorder = None    # called with the step's (batch, H_q, 1, d) queries (decoding-time compression)
        self.apart: set[int] = set()   # slots whose query heads chose apart (a mask row each): never compressed again

    # -- memory ------------------------------------------------------------------------------------------------
    def reserve(self, slots: int, needed: int, rows: int) -> None:
        """Room for ``slots`` sequences of ``needed`` entries per head and ``rows`` mask rows per KV head. Slots
        grow in powers of two up to the pool's size (the CUDA graphs' buckets), capacity by at least half again
        plus ``GROWTH``; the entries held are copied once."""
        slots, capacity, rows = self.grown(slots, needed, rows)
        if (slots, capacity, rows) == (self.slots, self.capacity, self.rows):
            return
        shape = (slots, self.n_kv_heads, capacity, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)   # zeros: masked entries stay finite
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        allowed = torch.zeros(slots, self.n_kv_heads, rows, capacity, dtype=torch.bool, device=self.device)
        allowed[..., 0] = True       # a free slot sees one zero entry, so its rows stay finite if computed
        lengths = np.zeros((slots, self.n_kv_heads), dtype=np.int64)     # host mirror of what each head holds
        advance = torch.zeros(slots, dtype=torch.long, device=self.device)   # 1 for a slot in flight
        held = torch.zeros(slots * self.n_kv_heads, dtype=torch.long, device=self.device)  # lengths, on the device
        if self.slots:
            old, cap = self.slots, self.capacity
            keys[:old, :, :cap] = self.key_buffer
            values[:old, :, :cap] = self.value_buffer
            allowed[:old, ..., :cap] = self.allowed              # one mask row broadcasts to every query head
            lengths[:old] = self.lengths
            advance[:old] = self.advance
            held[:old * self.n_kv_heads] = self.held
        self.key_buffer, self.value_buffer, self.allowed, self.lengths, self.advance, self.held = \
            keys, values, allowed, lengths, advance, held
        self.mask_advance = advance     # how far a step moves each slot's mask index: its entry's, here
        self.slots, self.capacity, self.rows = slots, capacity, rows
        self.next_slot = torch.zeros(slots * self.n_kv_heads, dtype=torch.long, device=self.device)
        self.next_allowed = torch.zeros(slots * self.n_kv_heads * rows, dtype=torch.long, device=self.device)
        self.index(range(slots))

    def grown(self, slots: int, needed: int, rows: int) -> tuple[int, int, int]:
        """The (slots, capacity, rows) ``reserve`` would allocate for these needs."""
        rows = max(rows, self.rows)
        capacity = self.capacity if needed <= self.capacity else max(needed + GROWTH, self.capacity * 3 // 2)
        return self.grown_slots(slots), capacity, rows

    def bytes_for(self, slots: int, capacity: int, rows: int) -> int:
        """Bytes of the buffers of that shape: keys, values and the mask."""
        return slots * self.n_kv_heads * capacity * (2 * self.head_dim * self.key_buffer.element_size() + rows)

    def growth(self, slots: int, needed: int, rows: int) -> int:
        """Bytes a sequence of ``needed`` entries per head (room included) joining as slot ``slots - 1`` with
        ``rows`` mask rows would allocate here (0: it fits in what is held)."""
        shape = self.grown(slots, needed, rows)
        return 0 if shape == (self.slots, self.capacity, self.rows) else self.bytes_for(*shape)

    def grown_slots(self, slots: int) -> int:
        """The slots held once slot ``slots - 1`` is taken."""
        return self.slots if slots <= self.slots else max(slots, bucket(slots, self.max_slots))

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors a step reads or writes (what a captured graph is tied to)."""
        return [self.key_buffer, self.value_buffer, self.allowed, self.next_slot, self.next_allowed, self.held,
                self.advance]

    def index(self, slots: int | range) -> None:
        """The flat write indices into the buffers and the mask of a slot (or a range of them), and its heads'
        lengths on the device, from the host's lengths: computed on the host, one asynchronous copy each."""
        slots = range(slots, slots + 1) if isinstance(slots, int) else slots
        if not len(slots):
            return
        h, r, c = self.n_kv_heads, self.rows, self.capacity
        first, last = slots[0], slots[-1] + 1
        lengths = self.lengths[first:last].reshape(-1)                  # per (slot, KV head)
        self.next_slot[first * h:last * h] = upload(np.arange(first * h, last * h) * c + lengths, self.device)
        rows = np.arange(first * h * r, last * h * r)
        self.next_allowed[first * h * r:last * h * r] = upload(rows * c + np.repeat(lengths, r), self.device)
        self.held[first * h:last * h] = upload(lengths, self.device)

    # -- sequences joining, leaving, recompressed --------------------------------------------------------------
    def load(self, slot: int, layer: CompressibleLayer, room: int) -> None:
        """Slot ``slot`` takes a sequence's batch-1 layer (its heads' entries and what each query row sees),
        with ``room`` entries ahead for the tokens still to come."""
        keys, values, lengths, seen = layer.held()
        longest = keys.shape[1]
        self.reserve(slot + 1, longest + room, seen.shape[1])
        self.key_buffer[slot, :, :longest] = keys
        self.value_buffer[slot, :, :longest] = values
        self.allowed[slot] = False
        self.allowed[slot, :, :, :longest] = seen               # (H_kv, 1 or group, longest)
        self.lengths[slot] = lengths
        self.advance[slot] = 1
        self.index(slot)
        self.apart.discard(slot)
        if seen.shape[1] > 1:
            self.apart.add(slot)

    def move(self, source: int, target: int) -> None:
        """Slot ``target`` takes slot ``source``'s sequence; ``source`` is freed."""
        self.move_entries(source, target)
        self.lengths[target] = self.lengths[source]
        self.advance[target] = 1
        self.mask_advance[target] = self.mask_advance[source]
        self.index(target)
        self.apart.discard(target)
        if source in self.apart:
            self.apart.add(target)
        self.free(source)

    def move_entries(self, source: int, target: int) -> None:
        """Slot ``target``'s entries and mask become slot ``source``'s."""
        longest = int(self.lengths[source].max())
        for buffer in (self.key_buffer, self.value_buffer):
            buffer[target, :, :longest] = buffer[source, :, :longest]
        self.allowed[target] = self.allowed[source]

    def free(self, slot: int) -> None:
        self.apart.discard(slot)
        self.lengths[slot] = 0
        self.advance[slot] = 0
        self.allowed[slot] = False
        self.allowed[slot, ..., 0] = True
        self.index(slot)

    def row_layer(self, slot: int) -> CompressibleLayer:
        """Slot ``slot``'s entries as a batch-1 layer, what decoding-time recompression works on."""
        if slot in self.apart:       # as batch 1 refuses it: the per-query-head masks would be lost
            raise RuntimeError("a layer whose query heads chose apart cannot be compressed again")
        longest = int(self.lengths[slot].max())
        layer = CompressibleLayer(room=0)
        layer.lazy_initialization(self.key_buffer, self.value_buffer)
        layer.fill(self.key_buffer[slot, :, :longest], self.value_buffer[slot, :, :longest],
                   self.lengths[slot].tolist())
        return layer

    # -- the decoding step -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        """Nothing to do: the buffers exist before the first step (``reserve``)."""

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the step's (batch, H_kv, 1, d) entries after each head's own; return what attention reads:
        slots ``[0, batch)``, their first ``width`` entries and the mask over them."""
        b, h, r, d = key_states.shape[0], self.n_kv_heads, self.rows, self.head_dim   # a size, not an attribute:
        slots = self.next_slot[:b * h]          # a compiled step stays one graph as the batch changes
        self.key_buffer.view(-1, d).index_copy_(0, slots, key_states.reshape(-1, d))
        self.value_buffer.view(-1, d).index_copy_(0, slots, value_states.reshape(-1, d))
        self.allowed.view(-1).index_fill_(0, self.next_allowed[:b * h * r], True)
        advance = self.advance[:b, None]          # expand, not repeat_interleave: no size read back from the device
        per_head = advance.expand(b, h).reshape(-1)
        slots += per_head             # in place through views: ``x[:n] += y`` would copy the slice back as well
        self.next_allowed[:b * h * r].add_(self.mask_advance[:b, None].expand(b, h * r).reshape(-1))
        self.held[:b * h].add_(per_head)
        return self.read(b)

    def read(self, b: int) -> tuple[HeldKeys, torch.Tensor]:
        """What the step's attention reads, keys and values: slots ``[0, b)``'s first ``width`` entries and the mask
        over them; where the kernel attends, the whole capacity and each head's length (the kernel reads up to the
        length, and a grid that follows the capacity is compiled once per capacity, not once per step's width)."""
        if self.kernel or self.width == self.capacity:     # no slicing by a number: a compiled step keeps one graph
            keys, values, allowed = self.key_buffer[:b], self.value_buffer[:b], self.allowed[:b]
        else:
            w = self.width
            keys, values, allowed = self.key_buffer[:b, :, :w], self.value_buffer[:b, :, :w], self.allowed[:b, ..., :w]
        held = HeldKeys(keys, allowed, self.recorder, None if self.kernel else self.spans,
                        self.held[:b * self.n_kv_heads] if self.kernel else None)
        return held, values

    def get_seq_length(self) -> int:
        return self.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width, 0

    def get_max_length(self) -> int:
        return -1


class SlidingPoolLayer(PoolLayer):
    """A sliding-window layer of the pool: per slot a ring of ``window`` entries, position p in ring slot
    p % window, as in the batch-1 ``SlidingWindowLayer`` it loads from. A step writes each sequence's entry over
    the one its window no longer covers, so the capacity never grows and attention reads every filled slot;
    ``lengths`` counts the filled slots (at most the window). Never recompressed."""
    is_sliding = True

    def __init__(self, window: int, n_kv_heads: int, head_dim: int, dtype, device, max_slots: int,
                 kernel: bool = False):
        self.window = window
        self.positions = np.zeros(0, dtype=np.int64)   # host mirror: each slot's next position
        super().__init__(n_kv_heads, head_dim, dtype, device, max_slots, kernel)

    def grown(self, slots: int, needed: int, rows: int) -> tuple[int, int, int]:
        return super().grown(slots, 1, 1)[:1] + (self.window, 1)

    def reserve(self, slots: int, needed: int, rows: int) -> None:
        more = self.grown(slots, needed, rows)[0] - len(self.positions)
        if more > 0:
            self.positions = np.concatenate([self.positions, np.zeros(more, dtype=np.int64)])
        super().reserve(slots, needed, rows)

    def index(self, slots: int | range) -> None:
        """The flat write indices of a slot (or a range of them), each ring's slot for its next position, and its
        filled slots on the device."""
        slots = range(slots, slots + 1) if isinstance(slots, int) else slots
        if not len(slots):
            return
        h, w = self.n_kv_heads, self.window
        first, last = slots[0], slots[-1] + 1
        at = upload(np.arange(first * h, last * h) * w + np.repeat(self.positions[first:last] % w, h), self.device)
        self.next_slot[first * h:last * h] = at
        self.next_allowed[first * h:last * h] = at
        self.held[first * h:last * h] = upload(self.lengths[first:last].reshape(-1), self.device)

    def load(self, slot: int, layer, room: int) -> None:
        if not layer.is_sliding or layer.window != self.window:
            raise ValueError(f"a sliding-window pool layer (window {self.window}) loads a sliding-window layer of "
                             f"the same window")
        self.reserve(slot + 1, 1, 1)
        self.positions[slot] = layer.n_positions
        super().load(slot, layer, 0)

    def move(self, source: int, target: int) -> None:
        """As a full layer's: a ring's filled slots are its first ``lengths`` (all of them once it wrapped)."""
        self.positions[target] = self.positions[source]
        super().move(source, target)

    def free(self, slot: int) -> None:
        self.positions[slot] = 0
        super().free(slot)

    def row_layer(self, slot: int):
        raise RuntimeError("a sliding-window layer keeps its window: it is never recompressed")

    def update(self, key_states, value_states, *args, **kwargs):
        """As ``PoolLayer.update``, the write indices wrapping around each ring."""
        b, h, d, w = key_states.shape[0], self.n_kv_heads, self.head_dim, self.window
        slots = self.next_slot[:b * h]
        self.key_buffer.view(-1, d).index_copy_(0, slots, key_states.reshape(-1, d))
        self.value_buffer.view(-1, d).index_copy_(0, slots, value_states.reshape(-1, d))
        self.allowed.view(-1).index_fill_(0, self.next_allowed[:b * h], True)
        rings = slots - slots % w
        slots.copy_(rings + (slots - rings + self.advance[:b, None].expand(b, h).reshape(-1)) % w)
        self.next_allowed[:b * h].copy_(slots)
        self.held[:b * h].add_(self.advance[:b, None].expand(b, h).reshape(-1)).clamp_(max=w)   # filled slots
        return self.read(b)

    def stepped(self, batch: int) -> None:
        self.lengths[:batch] = np.minimum(self.lengths[:batch] + 1, self.window)
        self.positions[:batch] += 1
