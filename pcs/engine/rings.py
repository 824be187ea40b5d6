"""The decode pool's newest queries, what decoding-time recompression scores with (its observation window).

Per full-attention layer a ring of (slots, H_q, window, d): a step writes every row's query into one column, the
one its layer's pointer names, and moves the pointer on (both on the device, inside the forward, so a captured
graph replays them). Rows share the column order: every row in flight is written at every step, and a row that
joins takes its newest queries into the columns just before the pointer. The host mirrors the pointer
(``oldest``: all rings advance together), so reading a row's newest queries in order waits for nothing. A step
writes b x H_q x d values per layer, where shifting a ring copied all of it.
"""
from __future__ import annotations

import torch


class QueryRings:
    def __init__(self, layers: list[int], n_q_heads: int, head_dim: int, dtype, device):
        self.layers = layers                       # the full-attention layers (sliding ones are never recompressed)
        self.n_q_heads, self.head_dim, self.dtype, self.device = n_q_heads, head_dim, dtype, device
        self.rings: dict[int, torch.Tensor] = {}   # layer -> (slots, H_q, window, d)
        self.next: dict[int, torch.Tensor] = {}   # layer -> (1,) the column the step writes, from the first reserve
        self.slots = self.window = 0
        self.oldest = 0                            # host mirror of every pointer: the column of the oldest query

    def reserve(self, slots: int, window: int) -> None:
        """At least ``slots`` rows of ``window`` queries; a wider window keeps every row's queries, newest last.
        Every ring is grown before any is replaced: out of memory part way, the rings stay as they were."""
        slots, window = max(slots, self.slots), max(window, self.window)
        if (slots, window) == (self.slots, self.window):
            return
        grown = {i: torch.zeros(slots, self.n_q_heads, window, self.head_dim, dtype=self.dtype, device=self.device)
                 for i in self.layers}
        for i, ring in grown.items():
            if self.slots:
                if window == self.window:          # only rows added: the columns stay where they are
                    ring[:self.slots] = self.rings[i]
                else:
                    ring[:self.slots, :, window - self.window:] = self.rings[i].roll(-self.oldest, dims=2)
        self.rings = grown
        if window != self.window:
            self.oldest = 0
            for i in self.layers:
                if i in self.next:
                    self.next[i].zero_()
                else:
                    self.next[i] = torch.zeros(1, dtype=torch.long, device=self.device)
        self.slots, self.window = slots, window

    def bytes_for(self, slots: int, window: int) -> int:
        """Bytes ``reserve(slots, window)`` would allocate at its peak (0: nothing grows): every new ring, while the
        old ones are still held, and a widening window's rolled copy of one old ring."""
        slots, window = max(slots, self.slots), max(window, self.window)
        if (slots, window) == (self.slots, self.window):
            return 0
        rolled = self.slots * self.window if window != self.window else 0
        return (len(self.layers) * slots * window + rolled) * self.n_q_heads * self.head_dim * \
            torch.empty(0, dtype=self.dtype).element_size()

    def columns(self, n: int) -> torch.Tensor:
        """The columns of the newest ``n`` queries, oldest first."""
        return (self.oldest - n + torch.arange(n, device=self.device)) % self.window

    def remember(self, slot: int, layer: int, recent: torch.Tensor | None) -> int:
        """Row ``slot`` of layer ``layer`` takes a joining sequence's (H_q, n, d) newest queries (None: none);
        returns how many it keeps (at most the window)."""
        ring = self.rings[layer]
        ring[slot] = 0
        n = min(recent.shape[1], self.window) if recent is not None and recent.dim() == 3 else 0
        if n:
            ring[slot][:, self.columns(n)] = recent[:, -n:].to(ring.dtype)
        return n

    def record(self, layer: int, queries: torch.Tensor) -> None:
        """Inside the forward: the step's (batch, H_q, 1, d) queries, at unit scale, into the pointer's column."""
        self.rings[layer][:queries.shape[0]].index_copy_(2, self.next[layer], queries.to(self.dtype))
        self.next[layer].add_(1).remainder_(self.window)

    def stepped(self) -> None:
        """After a forward: the host's pointer follows the device's."""
        self.oldest = (self.oldest + 1) % self.window

    def newest(self, layer: int, slot: int, n: int) -> torch.Tensor:
        """Row ``slot``'s newest ``n`` queries of layer ``layer``, (H_q, n, d), oldest first."""
        return self.rings[layer][slot][:, self.columns(n)]

    def move(self, source: int, target: int) -> None:
        for ring in self.rings.values():
            if ring.shape[0] > source:
                ring[target] = ring[source]

    def tensors(self) -> list[torch.Tensor]:
        """What a captured step writes: the rings and their pointers."""
        return list(self.rings.values()) + list(self.next.values())
