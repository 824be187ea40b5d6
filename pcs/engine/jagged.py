"""A full-attention layer of the decode pool that holds each sequence at its own capacity, where attention reads
each head's own entries (``pcs.kernels.decode_attention``, on CUDA): a full-cache row in flight no longer makes
every 128-entry row beside it as long, and admission counts the bytes a sequence itself needs.

Keys and values are one (N, d) buffer per layer. A sequence in slot s holds a region of ``H_kv x cap[s]`` entries
from ``base[s]``, head h's at ``base[s] + h x cap[s]``; ``cap[s]`` is its longest head plus the room it reserved
when it joined, rounded up to ``ALIGN`` entries. The mask of what each query row sees lies entry-major, (N, rows),
so a region's mask is one range too. The first ``H_kv`` entries are a sink: a free slot of a captured step's bucket
writes its (ignored) entries there and reads none.

Regions are placed first-fit in the free ranges (``Regions``). A sequence leaving frees its region, and the last
sequence in flight moving into its slot takes its region along: only offsets change. Where no free range is long
enough, the regions are packed to the front (free space enough) or moved into a buffer half as large again (not
enough): either moves entries on the device once, and the offsets the step reads live on the device, so a
captured graph survives a packing; a new buffer is a new layout, captured again.
"""
from __future__ import annotations

import numpy as np
import torch

from ..cache import CompressibleLayer, HeldKeys
from ..upload import upload
from .pool import PoolLayer

ALIGN = 64     # entries a capacity is rounded up to (the decode kernel's block): fewer, larger free ranges


class Regions:
    """Free ranges of [0, size), placed first-fit; a freed range merges with its free neighbours."""

    def __init__(self, size: int):
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)] if size else []   # (start, length), by start

    def take(self, n: int) -> int | None:
        """The start of ``n`` entries now taken, or None where no free range holds them."""
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i:i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def give(self, start: int, n: int) -> None:
        i = next((i for i, (s, _) in enumerate(self.free) if s > start), len(self.free))
        self.free.insert(i, (start, n))
        if i + 1 < len(self.free) and start + n == self.free[i + 1][0]:           # the next range follows on
            self.free[i:i + 2] = [(start, n + self.free[i + 1][1])]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == start:          # the previous one leads in
            self.free[i - 1:i + 1] = [(self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])]

    def largest(self) -> int:
        return max((length for _, length in self.free), default=0)

    def total(self) -> int:
        return sum(length for _, length in self.free)


class JaggedPoolLayer(PoolLayer):
    """A full-attention layer of the pool, each sequence at its own capacity (see the module's docstring)."""

    def __init__(self, n_kv_heads: int, head_dim: int, dtype, device, max_slots: int):
        self.total = 0
        super().__init__(n_kv_heads, head_dim, dtype, device, max_slots, kernel=True)

    # -- memory ------------------------------------------------------------------------------------------------
    def reserve(self, slots: int, needed: int, rows: int) -> None:
        """Per-slot offsets for ``slots`` sequences and ``rows`` mask rows per entry; the entries' own room is
        placed when a sequence joins (``load``)."""
        if not self.total:                           # the first call: the sink, and nothing held
            self.key_buffer = torch.zeros(self.n_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
            self.value_buffer = torch.zeros_like(self.key_buffer)
            self.allowed = torch.zeros(self.n_kv_heads, 1, dtype=torch.bool, device=self.device)
            self.total, self.regions, self.rows = self.n_kv_heads, Regions(0), 1
            self.base, self.cap = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        slots, rows = self.grown_slots(slots), max(rows, self.rows)
        if (slots, rows) == (self.slots, self.rows) and self.slots:
            return
        if rows != self.rows:                        # one mask row stands for every query head until then
            self.allowed = self.allowed[:, :1].expand(self.total, rows).contiguous()
        old, h = self.slots, self.n_kv_heads
        grow = slots - old
        self.base = np.concatenate([self.base, np.full(grow, -1, dtype=np.int64)])      # -1: no region
        self.cap = np.concatenate([self.cap, np.zeros(grow, dtype=np.int64)])
        self.lengths = np.concatenate([getattr(self, "lengths", np.zeros((0, h), dtype=np.int64)),
                                       np.zeros((grow, h), dtype=np.int64)])
        advance = torch.zeros(slots, dtype=torch.long, device=self.device)
        if old:
            advance[:old] = self.advance
        self.advance, self.mask_advance = advance, advance * rows   # a step moves a mask index one entry: rows
        self.held = torch.zeros(slots * h, dtype=torch.long, device=self.device)
        self.bases = torch.zeros(slots * h, dtype=torch.long, device=self.device)
        self.next_slot = torch.zeros(slots * h, dtype=torch.long, device=self.device)
        self.next_allowed = torch.zeros(slots * h * rows, dtype=torch.long, device=self.device)
        self.slots, self.rows, self.capacity = slots, rows, self.total
        self.index(range(slots))

    def growth(self, slots: int, needed: int, rows: int) -> int:
        """Bytes a sequence of ``needed`` entries per head joining would allocate: a buffer half as large again
        where the free entries cannot hold its region, and the mask's rows where they grow."""
        n = self.n_kv_heads * -(-needed // ALIGN) * ALIGN
        rows = max(rows, self.rows)
        total = self.total if self.regions.total() >= n else max(self.total - self.regions.total() + n,
                                                                  self.total * 3 // 2)
        if total == self.total and rows == self.rows:
            return 0
        return total * (2 * self.head_dim * self.key_buffer.element_size() + rows)

    def place(self, n: int) -> int:
        """The start of a region of ``n`` entries: in a free range, else after packing the regions, else in a
        larger buffer."""
        start = self.regions.take(n)
        if start is None:
            held = self.total - self.regions.total()
            self.repack(self.total if self.regions.total() >= n else max(held + n, self.total * 3 // 2))
            start = self.regions.take(n)
        return start

    def repack(self, total: int) -> None:
        """Every region moved to the front of a buffer of ``total`` entries (this one where it stays the size), in
        the order they lie; the rest free."""
        if total != self.total:      # allocated before anything changes: out of memory leaves the layer as it was
            buffers = (torch.zeros(total, self.head_dim, dtype=self.dtype, device=self.device),
                       torch.zeros(total, self.head_dim, dtype=self.dtype, device=self.device),
                       torch.zeros(total, self.rows, dtype=torch.bool, device=self.device))
        else:
            buffers = (self.key_buffer, self.value_buffer, self.allowed)
        at = self.n_kv_heads                          # after the sink
        for slot in sorted(np.flatnonzero(self.base >= 0), key=lambda s: self.base[s]):
            n, start = self.n_kv_heads * int(self.cap[slot]), int(self.base[slot])
            for new, old in zip(buffers, (self.key_buffer, self.value_buffer, self.allowed)):
                new[at:at + n] = old[start:start + n].clone() if new is old else old[start:start + n]
            self.base[slot], at = at, at + n
        self.key_buffer, self.value_buffer, self.allowed = buffers
        self.total = self.capacity = total
        self.regions = Regions(total)
        self.regions.free = [(at, total - at)] if total > at else []
        self.index(range(self.slots))

    def release(self, slot: int) -> None:
        """Slot ``slot``'s region back to the free ranges."""
        if self.base[slot] >= 0:
            self.regions.give(int(self.base[slot]), self.n_kv_heads * int(self.cap[slot]))
            self.base[slot], self.cap[slot] = -1, 0

    def region(self, slot: int, buffer: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s region of ``buffer`` as (H_kv, cap, ...)."""
        start, cap = int(self.base[slot]), int(self.cap[slot])
        return buffer[start:start + self.n_kv_heads * cap].view(self.n_kv_heads, cap, *buffer.shape[1:])

    def index(self, slots: int | range) -> None:
        """Each head's offset, next write indices (entries and mask) and length on the device, from the host's;
        a slot without a region points at the sink."""
        slots = range(slots, slots + 1) if isinstance(slots, int) else slots
        if not len(slots):
            return
        h, r = self.n_kv_heads, self.rows
        first, last = slots[0], slots[-1] + 1
        base, cap = self.base[first:last], self.cap[first:last]
        bases = np.where(base[:, None] >= 0, base[:, None] + np.arange(h) * cap[:, None], np.arange(h)).reshape(-1)
        lengths = self.lengths[first:last].reshape(-1)
        self.bases[first * h:last * h] = upload(bases, self.device)
        self.next_slot[first * h:last * h] = upload(bases + lengths, self.device)
        masks = (np.repeat(bases + lengths, r) * r + np.tile(np.arange(r), len(bases)))
        self.next_allowed[first * h * r:last * h * r] = upload(masks, self.device)
        self.held[first * h:last * h] = upload(lengths, self.device)

    # -- sequences joining, leaving, recompressed --------------------------------------------------------------
    def load(self, slot: int, layer: CompressibleLayer, room: int) -> None:
        keys, values, lengths, seen = layer.held()
        longest = keys.shape[1]
        self.reserve(slot + 1, longest + room, seen.shape[1])
        cap = -(-(longest + room) // ALIGN) * ALIGN
        self.release(slot)
        start = self.place(self.n_kv_heads * cap)
        self.base[slot], self.cap[slot] = start, cap
        self.region(slot, self.key_buffer)[:, :longest] = keys
        self.region(slot, self.value_buffer)[:, :longest] = values
        mask = self.region(slot, self.allowed)                 # (H_kv, cap, rows)
        mask[:] = False
        mask[:, :longest] = seen.transpose(1, 2)                # (H_kv, longest, 1 or group)
        self.lengths[slot] = lengths
        self.advance[slot], self.mask_advance[slot] = 1, self.rows
        self.index(slot)
        self.apart.discard(slot)
        if seen.shape[1] > 1:
            self.apart.add(slot)

    def move_entries(self, source: int, target: int) -> None:
        """Slot ``target`` takes slot ``source``'s region (``target``'s is freed): no entry moves."""
        self.release(target)
        self.base[target], self.cap[target] = self.base[source], self.cap[source]
        self.base[source], self.cap[source] = -1, 0

    def free(self, slot: int) -> None:
        self.apart.discard(slot)
        self.release(slot)
        self.lengths[slot] = 0
        self.advance[slot] = self.mask_advance[slot] = 0
        self.index(slot)

    def row_layer(self, slot: int) -> CompressibleLayer:
        if slot in self.apart:       # as batch 1 refuses it: the per-query-head masks would be lost
            raise RuntimeError("a layer whose query heads chose apart cannot be compressed again")
        longest = int(self.lengths[slot].max())
        layer = CompressibleLayer(room=0)
        layer.lazy_initialization(self.key_buffer, self.value_buffer)
        layer.fill(self.region(slot, self.key_buffer)[:, :longest], self.region(slot, self.value_buffer)[:, :longest],
                   self.lengths[slot].tolist())
        return layer

    # -- the decoding step -------------------------------------------------------------------------------------
    def read(self, b: int) -> tuple[HeldKeys, torch.Tensor]:
        held = HeldKeys(self.key_buffer, self.allowed if self.rows > 1 else None, self.recorder, None,
                        self.held[:b * self.n_kv_heads], self.bases[:b * self.n_kv_heads])
        return held, self.value_buffer

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [self.bases, self.mask_advance]
