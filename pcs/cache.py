"""A KV cache that holds only the kept entries, with heads of different lengths decoded in one attention call.

During the prefill a layer is dense, (1, H_kv, n, d), like transformers' ``DynamicLayer``. Once compressed
(or at its first decoding step, for a layer kept whole) it moves into a *buffer*: (H_kv, capacity, d) keys
and values where head h's entries fill ``[:lengths[h]]`` and the rest is room reserved for the tokens to
come. Heads may hold different numbers of entries (AdaKV, PyramidKV); a decoding step writes each head's
new entry at its own length (no copy of any history) and attends with one ``scaled_dot_product_attention``
call per layer, the query heads of a KV head stacked as rows and a mask hiding each head's unused slots.
One sequence per cache; the decode pool (``pcs.engine``) takes many such caches' entries into one buffer.

A method may also choose per query head (official AdaKV's default GQA mode): a KV head then stores the
union of its query heads' entries once, and its mask hides from each query head the entries that head did
not choose.

``nbytes`` counts the entries a layer holds (what the method kept); ``buffer_bytes`` counts what is
allocated, room and the padding of shorter heads included.
"""
from __future__ import annotations

import copy

from contextlib import nullcontext
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .hybrid import attention_windows
from .kernels.decode_attention import decode_attention
from .tensor_rows import rows_at

ATTN_IMPLEMENTATION = "pcs"
ROOM = 256   # entries reserved ahead per head when a layer moves into its buffer (it grows by half when full)
# Decoding attends over a key length that grows by one every step. cuDNN's attention builds an execution
# plan per new shape (tens of milliseconds of host time per call, about a second per token for 32 layers),
# so decoding on CUDA uses the kernels that take any length as it comes.
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class HeldKeys(NamedTuple):
    """What attention reads from a buffered layer: the (batch, H_kv, L, d) keys, the mask of the slots each
    query row sees (None: all L), shaped (H_kv, 1 or group, q_len, L) for one sequence or (batch, H_kv,
    1 or group, L) for a decode pool's one-token step, and who wants the step's queries (None: nobody).
    ``spans``: a pool's (start, stop, width) runs of slots that read only their first ``width`` of the L keys
    (None: every slot reads all L in one call). ``lengths``: a pool's (batch x H_kv,) entries per head on the
    device, where its step attends through ``pcs.kernels.decode_attention`` (None: masked SDPA). ``bases``: where
    the pool holds each sequence at its own capacity, the (batch x H_kv,) offsets of each head's entries in (N, d)
    keys and values, the mask (N, group) or None (``pcs.engine.jagged``)."""
    keys: torch.Tensor
    mask: torch.Tensor | None
    record: Callable[[torch.Tensor, float | None], None] | None = None
    spans: tuple[tuple[int, int, int], ...] | None = None
    lengths: torch.Tensor | None = None
    bases: torch.Tensor | None = None


class CompressibleLayer(CacheLayerMixin):
    """One layer's cache: dense during the prefill, then a buffer of per-head entries with room ahead."""
    is_sliding = False

    def __init__(self, room: int = ROOM):
        super().__init__()
        self.room = room
        self.key_buffer: torch.Tensor | None = None     # (H_kv, capacity, d)
        self.value_buffer: torch.Tensor | None = None
        self.lengths: list[int] = []                     # entries held per KV head
        self.chose_apart = False                         # query heads of a KV head see different entries
        # Where heads differ (lengths, or per query head): (H_kv, 1 or group, capacity), True at the slots a
        # query row sees, kept up to date as entries arrive, and the flat indices of each head's next slot
        # in the buffers and in it. None where every head holds the same entries: nothing to mask.
        self.allowed: torch.Tensor | None = None
        self.next_slot: torch.Tensor | None = None       # (H_kv,) into key_buffer.view(-1, d)
        self.next_allowed: torch.Tensor | None = None    # (H_kv x rows,) into allowed.view(-1)
        self.n_positions = 0   # tokens seen, i.e. the next position id (not the number held)
        self.recent_queries: torch.Tensor | None = None   # (H_q, <=w, d), kept for recompression

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    @property
    def is_buffered(self) -> bool:
        return self.key_buffer is not None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError("the compressed cache supports batch size 1")
        self.n_positions += key_states.shape[-2]
        if not self.is_buffered:
            if self.keys is None:          # the prefill: attention runs on the dense tensors as they are
                self.keys, self.values = key_states, value_states
                return self.keys, self.values
            self.fill(self.keys[0], self.values[0], [self.keys.shape[-2]] * self.keys.shape[1])
        return self.append(key_states[0], value_states[0])

    def copy(self) -> CompressibleLayer:
        """A layer holding the same entries that later writes do not share: its buffers and masks cloned (dense
        prefill tensors are shared, as ``take`` shares them: no layer writes into them)."""
        twin = copy.copy(self)
        twin.lengths = list(self.lengths)
        for name in ("key_buffer", "value_buffer", "allowed", "next_slot", "next_allowed"):
            tensor = getattr(self, name)
            setattr(twin, name, None if tensor is None else tensor.clone())
        return twin

    def take(self, other: CompressibleLayer) -> None:
        """Hold ``other``'s dense prefill entries, shared rather than copied: no layer writes into dense
        tensors (an append or a compression moves the entries into a buffer of its own)."""
        self.lazy_initialization(other.keys, other.values)
        self.keys, self.values, self.n_positions = other.keys, other.values, other.n_positions

    def fill(self, keys: torch.Tensor, values: torch.Tensor, lengths: list[int],
             seen: list[torch.Tensor | None] | None = None) -> None:
        """Move (H_kv, L, d) entries into a fresh buffer with room ahead; head h holds its first ``lengths[h]``.
        ``seen``: per KV head None or the (group, lengths[h]) mask of the entries each of its query heads sees."""
        n_heads, n, d = keys.shape
        capacity = n + self.room
        self.key_buffer = keys.new_zeros(n_heads, capacity, d)   # zeros, not garbage: masked slots stay finite
        self.value_buffer = values.new_zeros(n_heads, capacity, d)
        self.key_buffer[:, :n] = keys
        self.value_buffer[:, :n] = values
        self.lengths = list(lengths)
        self.chose_apart = seen is not None and any(m is not None for m in seen)
        self.allowed = None
        if self.chose_apart or len(set(lengths)) > 1:
            rows = next(m for m in seen if m is not None).shape[0] if self.chose_apart else 1
            slots = torch.arange(capacity, device=keys.device)
            held = slots < torch.tensor(lengths, device=keys.device)[:, None]                  # (H_kv, capacity)
            self.allowed = held[:, None].repeat(1, rows, 1)
            for h, mask in enumerate(seen if self.chose_apart else []):
                if mask is not None:
                    self.allowed[h, :, :mask.shape[1]] = mask
            self.index_next_slots()
        self.keys = self.values = None

    def index_next_slots(self) -> None:
        """Flat indices of each head's next free slot, in the buffers and in ``allowed``."""
        n_heads, capacity, rows = self.key_buffer.shape[0], self.key_buffer.shape[1], self.allowed.shape[1]
        lengths = torch.tensor(self.lengths, device=self.key_buffer.device)
        self.next_slot = torch.arange(n_heads, device=lengths.device) * capacity + lengths
        self.next_allowed = (torch.arange(n_heads * rows, device=lengths.device) * capacity
                             + lengths.repeat_interleave(rows))

    def grow(self, needed: int) -> None:
        """Enlarge the buffer to hold ``needed`` entries per head (copies once; amortised over the steps)."""
        old = self.key_buffer.shape[1]
        capacity = max(needed + self.room, old + old // 2)
        pad = (0, 0, 0, capacity - old)
        self.key_buffer = F.pad(self.key_buffer, pad)
        self.value_buffer = F.pad(self.value_buffer, pad)
        if self.allowed is not None:
            self.allowed = F.pad(self.allowed, (0, capacity - old), value=False)
            self.index_next_slots()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[HeldKeys, torch.Tensor]:
        """Write (H_kv, q, d) new entries after each head's own; return what attention reads."""
        q, old = keys.shape[1], self.lengths
        longest = max(old) + q
        if longest > self.key_buffer.shape[1]:
            self.grow(longest)
        if self.allowed is None:           # heads of one length: a slice
            self.key_buffer[:, old[0]:longest] = keys
            self.value_buffer[:, old[0]:longest] = values
            mask = None if q == 1 else self.causal(old, q, longest)
        else:                              # each head at its own length: one indexed copy, no history moved
            slots = self.next_slot if q == 1 else (self.next_slot[:, None] + torch.arange(q, device=keys.device))
            d = keys.shape[-1]
            self.key_buffer.view(-1, d).index_copy_(0, slots.reshape(-1), keys.reshape(-1, d))
            self.value_buffer.view(-1, d).index_copy_(0, slots.reshape(-1), values.reshape(-1, d))
            mask = None if q == 1 else self.allowed[:, :, None, :longest] | self.causal(old, q, longest, only_new=True)
            for t in range(q):             # the new entries are seen by every query head
                self.allowed.view(-1).index_fill_(0, self.next_allowed + t, True)
            self.next_slot += q
            self.next_allowed += q
            if q == 1:                     # a view: the step's new entry is already in it
                mask = self.allowed[:, :, None, :longest]
        self.lengths = [n + q for n in old]
        return HeldKeys(self.key_buffer[None, :, :longest], mask), self.value_buffer[None, :, :longest]

    def causal(self, old: list[int], q: int, longest: int, only_new: bool = False) -> torch.Tensor:
        """(H_kv, 1, q, longest): new token t of head h sees the head's ``old[h]`` entries (unless ``only_new``)
        and the new ones up to itself."""
        device = self.key_buffer.device
        first = torch.tensor(old, device=device)[:, None, None]                       # (H_kv, 1, 1)
        last = first + torch.arange(q, device=device)[None, :, None]                   # (H_kv, q, 1)
        slots = torch.arange(longest, device=device)
        mask = (slots <= last) & (slots >= first) if only_new else slots <= last
        return mask[:, None]

    def compress(self, kept: list[torch.Tensor]) -> None:
        """Keep, for KV head h, the entries at ``kept[h]`` (indices into what the head holds now);
        everything else is released. Works on a dense layer and again on a buffered one. With one
        list per query head (more lists than KV heads), each KV head keeps the union of its query heads'
        entries and masks, per query head, the ones that head did not choose."""
        if self.chose_apart:
            raise RuntimeError("a layer whose query heads chose apart cannot be compressed again")
        keys, values = (self.key_buffer, self.value_buffer) if self.is_buffered else self.dense()
        n_kv_heads, seen = keys.shape[0], None
        if len(kept) > n_kv_heads:
            group = len(kept) // n_kv_heads
            per_query_head, kept, seen = kept, [], []
            for g in range(n_kv_heads):
                mine = per_query_head[g * group:(g + 1) * group]
                union = torch.unique(torch.cat(mine))                    # sorted
                seen.append(torch.stack([torch.isin(union, idx) for idx in mine]))
                kept.append(union)
        index = torch.nn.utils.rnn.pad_sequence(list(kept), batch_first=True)   # (H_kv, L), padded with 0
        self.fill(rows_at(keys, index), rows_at(values, index), [len(idx) for idx in kept], seen)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(H_kv, n, d) keys and values of a layer whose heads all hold the same entries: in its prefill
        form, or buffered but never compressed (a full cache that has decoded)."""
        if not self.is_buffered:
            return self.keys[0], self.values[0]
        if len(set(self.lengths)) > 1 or self.chose_apart:
            raise RuntimeError("the layer's heads hold different entries")
        return self.key_buffer[:, :self.lengths[0]], self.value_buffer[:, :self.lengths[0]]

    def heads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per KV head, views of the (n_h, d) keys and values it holds."""
        if not self.is_buffered:
            keys, values = self.dense()
            return list(zip(keys, values))
        return [(self.key_buffer[h, :n], self.value_buffer[h, :n]) for h, n in enumerate(self.lengths)]

    def left_padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(H_kv, n_max, d) keys and values with shorter heads padded with zeros at the front, and
        each head's padding length. Every head's most recent entries line up at the end."""
        if not self.is_buffered:
            keys, values = self.dense()
            return keys, values, torch.zeros(keys.shape[0], dtype=torch.long, device=keys.device)
        n_max = max(self.lengths)
        pad = torch.tensor([n_max - n for n in self.lengths], device=self.key_buffer.device)
        stack = lambda ts: torch.stack([F.pad(t, (0, 0, n_max - t.shape[0], 0)) for t in ts])
        heads = self.heads()
        return stack([k for k, _ in heads]), stack([v for _, v in heads]), pad

    def held(self) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
        """(H_kv, n_max, d) keys and values (head h's first ``lengths[h]`` rows are its entries), the lengths,
        and the (H_kv, 1 or group, n_max) mask of the entries each query row sees: what a decode pool's slot
        takes over."""
        if not self.is_buffered:
            keys, values = self.dense()
            seen = torch.ones(keys.shape[0], 1, keys.shape[1], dtype=torch.bool, device=keys.device)
            return keys, values, [keys.shape[1]] * keys.shape[0], seen
        n_max = max(self.lengths)
        if self.allowed is not None:
            seen = self.allowed[:, :, :n_max]
        else:
            seen = torch.ones(len(self.lengths), 1, n_max, dtype=torch.bool, device=self.key_buffer.device)
        return self.key_buffer[:, :n_max], self.value_buffer[:, :n_max], list(self.lengths), seen

    def entries_per_head(self) -> list[int]:
        if self.is_buffered:
            return list(self.lengths)
        return [self.keys.shape[-2]] * self.keys.shape[1] if self.keys is not None else []

    def nbytes(self) -> int:
        """Bytes of the key and value entries this layer holds right now."""
        if self.is_buffered:
            row = self.key_buffer.shape[-1] * self.key_buffer.element_size()
            return 2 * row * sum(self.lengths)
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def buffer_bytes(self) -> int:
        """Bytes allocated for the layer: ``nbytes`` plus reserved room and the padding of shorter heads."""
        if not self.is_buffered:
            return self.nbytes()
        tensors = [self.key_buffer, self.value_buffer] + ([self.allowed] if self.allowed is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def get_seq_length(self) -> int:
        return self.n_positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_positions + query_length, 0

    def get_max_length(self) -> int:
        return -1


class SlidingWindowLayer(CompressibleLayer):
    """A layer whose queries see only the ``window`` newest positions (themselves included): dense during the
    prefill (transformers' sliding mask applies), then a ring of ``window`` slots where position p lives in slot
    p % window. A one-token step overwrites the one entry no query needs any more, so attention reads the whole
    ring (its filled slots) with no mask; between steps the layer holds the window - 1 newest entries, as
    transformers' own sliding cache does. Eviction methods never choose here (``settle`` keeps the window)."""
    is_sliding = True

    def __init__(self, window: int):
        super().__init__(room=0)
        self.window = window

    def settle(self) -> None:
        """Move the newest ``window - 1`` entries of the dense prefill into the ring."""
        keys, values = self.dense()
        n = self.n_positions
        kept = min(n, self.window - 1)
        self.key_buffer = keys.new_zeros(keys.shape[0], self.window, keys.shape[-1])
        self.value_buffer = values.new_zeros(self.key_buffer.shape)
        self.write(keys[:, n - kept:], values[:, n - kept:], n - kept)
        self.lengths = [kept] * keys.shape[0]
        self.keys = self.values = None

    def write(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """(H_kv, q, d) entries of positions ``first ..`` into their slots: only the last ``window`` survive, so only
        they are written (indices repeated in one write leave the slot's winner undefined on CUDA)."""
        skip = max(0, keys.shape[1] - self.window)
        slots = torch.arange(first + skip, first + keys.shape[1], device=keys.device) % self.window
        self.key_buffer[:, slots] = keys[:, skip:]
        self.value_buffer[:, slots] = values[:, skip:]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError("the compressed cache supports batch size 1")
        if not self.is_buffered and self.keys is None:      # the prefill: dense, under the model's sliding mask
            self.n_positions += key_states.shape[-2]
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        if not self.is_buffered:
            self.settle()
        first = self.n_positions
        self.n_positions += key_states.shape[-2]
        return self.append_at(key_states[0], value_states[0], first)

    def append_at(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> tuple[HeldKeys, torch.Tensor]:
        """New entries of positions ``first ..``; what attention reads. One token: the ring after the write. More:
        the held entries in order and the new ones, each new token seeing the ``window`` positions up to itself."""
        q, held = keys.shape[1], min(first, self.window - 1)
        if q == 1:
            self.write(keys, values, first)
            self.lengths = [min(first + 1, self.window - 1)] * len(self.lengths)
            filled = min(first + 1, self.window)
            return HeldKeys(self.key_buffer[None, :, :filled], None), self.value_buffer[None, :, :filled]
        order = torch.arange(first - held, first, device=keys.device) % self.window
        all_keys = torch.cat([self.key_buffer[:, order], keys], dim=1)
        all_values = torch.cat([self.value_buffer[:, order], values], dim=1)
        positions = torch.arange(first - held, first + q, device=keys.device)
        queries = positions[held:, None]
        mask = (positions[None, :] <= queries) & (positions[None, :] > queries - self.window)     # (q, held + q)
        self.write(keys, values, first)
        self.lengths = [min(first + q, self.window - 1)] * len(self.lengths)
        return HeldKeys(all_keys[None], mask[None, None].expand(all_keys.shape[0], 1, q, -1)), all_values[None]

    def compress(self, kept: list[torch.Tensor]) -> None:
        raise RuntimeError("a sliding-window layer keeps its window; eviction methods choose in full-attention layers")

    def held(self) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
        """The ring (position p in slot p % window) and its filled slots: what a decode pool's slot takes over."""
        if not self.is_buffered:
            self.settle()
        filled = min(self.n_positions, self.window)
        seen = torch.zeros(len(self.lengths), 1, self.window, dtype=torch.bool, device=self.key_buffer.device)
        seen[..., :filled] = True
        return self.key_buffer, self.value_buffer, [filled] * len(self.lengths), seen

    def entries_per_head(self) -> list[int]:
        if self.is_buffered:
            return list(self.lengths)
        return [min(self.keys.shape[-2], self.window - 1)] * self.keys.shape[1] if self.keys is not None else []

    def nbytes(self) -> int:
        """Bytes of the entries a query may still read: the window - 1 newest (all of them during the prefill)."""
        if not self.is_buffered:
            return super().nbytes()
        row = self.key_buffer.shape[-1] * self.key_buffer.element_size()
        return 2 * row * sum(self.lengths)

    def heads(self):
        raise RuntimeError("a sliding-window layer's ring is not in position order; read it with held()")

    def left_padded(self):
        raise RuntimeError("a sliding-window layer is never recompressed")


def cache_layer(window: int | None, room: int) -> CompressibleLayer:
    """The cache layer for a decoder layer of sliding window ``window`` (None: full attention)."""
    return CompressibleLayer(room) if window is None else SlidingWindowLayer(window)


class CompressedCache(Cache):
    """A cache of ``CompressibleLayer``s, one per decoder layer (``SlidingWindowLayer`` where the model attends
    through a window: ``windows``, per layer None or W); ``room``: entries reserved ahead per head (e.g. the tokens
    a generation may still add), so decoding appends without reallocating."""

    def __init__(self, n_layers: int, room: int = ROOM, windows: list[int | None] | None = None):
        self.windows = list(windows or [None] * n_layers)
        super().__init__(layers=[cache_layer(w, room) for w in self.windows])

    @classmethod
    def of(cls, config, room: int = ROOM) -> CompressedCache:
        """The cache for a model's config: its layers' kinds from ``pcs.hybrid.attention_windows``."""
        windows = attention_windows(config)
        return cls(len(windows), room, windows)

    def copy(self) -> CompressedCache:
        """The same cache, for another question to be fed on (``CompressibleLayer.copy``)."""
        twin = copy.copy(self)
        twin.layers = [layer.copy() for layer in self.layers]
        return twin

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def buffer_bytes(self) -> int:
        return sum(layer.buffer_bytes() for layer in self.layers)

    def entries_per_head(self) -> list[list[int]]:
        return [layer.entries_per_head() for layer in self.layers]

    def most_entries(self) -> int:
        """Most entries any KV head of a full-attention layer holds (what a decoding-time trigger bounds)."""
        return max([max(layer.entries_per_head(), default=0) for layer in self.layers if not layer.is_sliding],
                   default=0)


def held_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for the ``pcs`` implementation: dense layers (the prefill) go to transformers' SDPA; a
    buffered layer is one SDPA call (a pool's on CPU: one per span) whatever its heads' lengths and however many
    sequences decode together: the ``group`` query heads of each KV head become ``group x q_len`` rows against
    that head's keys, and the layer's mask hides the slots a row must not see (other heads' padding, room ahead, later new tokens,
    entries its query head did not choose).
    """
    if not isinstance(key, HeldKeys):
        window = attention_windows(module.config)[module.layer_idx]
        if window is not None and query.shape[2] > sliding_block(window):
            return sliding_prefill_attention(module, query, key, value, attention_mask, scaling, window, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    keys, mask, record, spans, lengths, bases = key
    batch, n_q_heads, q_len, d = query.shape
    n_kv_heads = keys.shape[1] if bases is None else lengths.shape[0] // batch
    group = n_q_heads // n_kv_heads
    if lengths is not None:      # a pool's step on CUDA: each (row, KV head) reads its own entries
        rows = query.reshape(batch, n_kv_heads, group, d)
        if bases is not None:    # each sequence at its own capacity: a mask where some chose per query head
            chosen = mask
        else:
            chosen = mask.reshape(batch, n_kv_heads, group, -1) if mask.shape[-2] > 1 else None   # per query head
        out = decode_attention(rows, keys, value, lengths, d ** -0.5 if scaling is None else scaling, chosen, bases)
        if record is not None:
            record(query, scaling)
        return out.reshape(batch, n_q_heads, 1, d).transpose(1, 2), None
    rows = query.reshape(batch, n_kv_heads, group * q_len, d)
    if mask is not None:
        if q_len == 1:      # one row pattern per KV head, or one per query head: (batch, H_kv, 1 or group, L)
            mask = mask.reshape(batch, n_kv_heads, -1, mask.shape[-1])
        else:
            mask = mask.expand(n_kv_heads, group, q_len, -1).reshape(1, n_kv_heads, group * q_len, -1)
    with sdpa_kernel(DECODE_BACKENDS) if rows.is_cuda else nullcontext():
        if spans is None:
            out = F.scaled_dot_product_attention(rows, keys, value, attn_mask=mask, scale=scaling)
        else:
            out = torch.cat([F.scaled_dot_product_attention(rows[a:b], keys[a:b, :, :w], value[a:b, :, :w],
                                                            attn_mask=mask[a:b, ..., :w], scale=scaling)
                             for a, b, w in spans])
    if record is not None:
        record(query, scaling)
    # reshape, not view: CUDA's kernels may return rows in another memory layout than (H_kv, rows, d).
    return out.reshape(batch, n_q_heads, q_len, d).transpose(1, 2).contiguous(), None


def sliding_block(window: int) -> int:
    """Queries per block of a sliding-window layer's prefill: a block's scores are block x (block + window - 1),
    so the layer costs about n x 2W instead of n x n, in few enough calls that their overhead stays small."""
    return max(window, 128)


def sliding_prefill_attention(module, query, key, value, attention_mask, scaling, window: int, **kwargs):
    """A sliding-window layer's multi-token forward, a block of queries at a time against only the keys their
    window reaches, with the layer's own mask cut to that band (a query at position i sees keys i - W < j <= i).
    The same attention as one call with the whole mask, summed in another order: equal up to rounding. Without
    this, every query of a 32K prompt would score all 32K keys in a layer that reads 512 of them."""
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    offset = k_len - q_len               # keys before the first query (a prefill after earlier tokens)
    block = sliding_block(window)
    outputs = []
    for start in range(0, q_len, block):
        stop = min(q_len, start + block)
        first = max(0, offset + start - window + 1)
        last = offset + stop
        if attention_mask is not None:
            mask = attention_mask[..., start:stop, first:last]
        else:
            position = torch.arange(offset + start, last, device=query.device)[:, None]
            seen = torch.arange(first, last, device=query.device)[None, :]
            mask = ((seen <= position) & (seen > position - window))[None, None]
        out, _ = sdpa_attention_forward(module, query[:, :, start:stop], key[:, :, first:last],
                                        value[:, :, first:last], mask, scaling=scaling, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def held_mask(*, q_length: int, local_size: int | None = None, attention_mask=None, **kwargs):
    """transformers' SDPA mask, except for a sliding-window layer's long multi-token forward without padding:
    ``sliding_prefill_attention`` builds each block's band itself, and the whole (q, kv) mask it would slice is
    what it must not hold (1 GiB at 32K tokens, 16 GiB at 128K). The bands are the mask's own entries, so the
    attention is the same to the bit."""
    if local_size is not None and attention_mask is None and q_length > sliding_block(local_size):
        return None
    return sdpa_mask(q_length=q_length, local_size=local_size, attention_mask=attention_mask, **kwargs)


def register_attention() -> None:
    """Make ``attn_implementation='pcs'`` available to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, held_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, held_mask)
