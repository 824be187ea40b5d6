"""A KV cache that really holds only the kept entries, with a per-head (ragged) layout.

Before compression a layer is dense, (1, H_kv, n, d), like transformers' ``DynamicLayer``. After
``compress`` each KV head owns its own (n_h, d) tensors, so heads may keep different numbers of
entries (AdaKV, PyramidKV) and the evicted ones are freed, not masked. Decoding then appends one
entry per head and attends head by head (``ragged_attention``, registered as the ``pcs`` attention
implementation). Batch size is 1, as in the evaluation protocols this harness follows.

A method may also choose per query head (official AdaKV's default GQA mode): a KV head then stores the
union of its query heads' entries once, with a (group, n_h) mask of the entries each query head sees.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_IMPLEMENTATION = "pcs"


class HeadKeys(list):
    """A compressed layer's per-KV-head (n_h, d) keys, and for each head None (its query heads see every
    entry) or the (group, n_h) boolean mask of the entries each of its query heads sees."""

    def __init__(self, keys, masks):
        super().__init__(keys)
        self.masks = masks


class CompressibleLayer(CacheLayerMixin):
    """One layer's cache: dense until ``compress``, then a list of per-KV-head tensors."""
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.head_keys: list[torch.Tensor] | None = None    # ragged storage, once compressed
        self.head_values: list[torch.Tensor] | None = None
        self.head_masks: list[torch.Tensor | None] | None = None   # per KV head, when query heads choose apart
        self.n_positions = 0   # tokens seen, i.e. the next position id (not the number held)
        self.recent_queries: torch.Tensor | None = None   # (H_q, <=w, d), kept for recompression

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    @property
    def is_ragged(self) -> bool:
        return self.head_keys is not None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError("the compressed cache supports batch size 1")
        self.n_positions += key_states.shape[-2]
        if self.is_ragged:
            new, masks = key_states.shape[-2], self.query_head_masks()
            for h in range(len(self.head_keys)):
                self.head_keys[h] = torch.cat([self.head_keys[h], key_states[0, h]])
                self.head_values[h] = torch.cat([self.head_values[h], value_states[0, h]])
                if masks[h] is not None:   # new tokens are seen by every query head
                    masks[h] = torch.cat([masks[h], masks[h].new_ones(masks[h].shape[0], new)], dim=1)
            return HeadKeys(self.head_keys, masks), self.head_values
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def compress(self, kept: list[torch.Tensor]) -> None:
        """Keep, for KV head h, the entries at ``kept[h]`` (indices into what the head holds now);
        everything else is released. Works on a dense layer and again on a compressed one. With one
        list per query head (more lists than KV heads), each KV head keeps the union of its query heads'
        entries and masks, per query head, the ones that head did not choose."""
        if self.is_ragged:
            if any(m is not None for m in self.query_head_masks()):
                raise RuntimeError("a layer whose query heads chose apart cannot be compressed again")
            keys, values = self.head_keys, self.head_values
        else:
            keys, values = self.dense()
        n_kv_heads = len(keys)
        masks = [None] * n_kv_heads
        if len(kept) > n_kv_heads:
            group = len(kept) // n_kv_heads
            per_query_head, kept = kept, []
            for g in range(n_kv_heads):
                mine = per_query_head[g * group:(g + 1) * group]
                union = torch.unique(torch.cat(mine))                    # sorted
                masks[g] = torch.stack([torch.isin(union, idx) for idx in mine])
                kept.append(union)
        self.head_keys = [keys[h].index_select(0, idx).contiguous() for h, idx in enumerate(kept)]
        self.head_values = [values[h].index_select(0, idx).contiguous() for h, idx in enumerate(kept)]
        self.head_masks = masks
        self.keys = self.values = None

    def query_head_masks(self) -> list[torch.Tensor | None]:
        """Per KV head of a compressed layer: None, or the (group, n_h) mask of the entries each query head sees."""
        if self.head_masks is None:
            self.head_masks = [None] * len(self.head_keys)
        return self.head_masks

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(H_kv, n, d) keys and values of a layer that has not been compressed."""
        if self.is_ragged:
            raise RuntimeError("layer is already compressed")
        return self.keys[0], self.values[0]

    def left_padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(H_kv, n_max, d) keys and values with shorter heads padded with zeros at the front, and
        each head's padding length. Every head's most recent entries line up at the end."""
        if not self.is_ragged:
            keys, values = self.dense()
            return keys, values, torch.zeros(keys.shape[0], dtype=torch.long, device=keys.device)
        n_max = max(k.shape[0] for k in self.head_keys)
        pad = torch.tensor([n_max - k.shape[0] for k in self.head_keys], device=self.head_keys[0].device)
        stack = lambda ts: torch.stack([F.pad(t, (0, 0, n_max - t.shape[0], 0)) for t in ts])
        return stack(self.head_keys), stack(self.head_values), pad

    def entries_per_head(self) -> list[int]:
        if self.is_ragged:
            return [k.shape[0] for k in self.head_keys]
        return [self.keys.shape[-2]] * self.keys.shape[1] if self.keys is not None else []

    def nbytes(self) -> int:
        """Bytes of key and value tensors this layer holds right now."""
        tensors = (self.head_keys + self.head_values) if self.is_ragged else [self.keys, self.values]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def get_seq_length(self) -> int:
        return self.n_positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_positions + query_length, 0

    def get_max_length(self) -> int:
        return -1


class CompressedCache(Cache):
    """A cache of ``CompressibleLayer``s, one per decoder layer."""

    def __init__(self, n_layers: int):
        super().__init__(layers=[CompressibleLayer() for _ in range(n_layers)])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def entries_per_head(self) -> list[list[int]]:
        return [layer.entries_per_head() for layer in self.layers]


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for the ``pcs`` implementation: dense layers go to SDPA; ragged ones head by head.

    For a ragged layer ``key``/``value`` are lists of (n_h, d) tensors whose last ``q_len`` rows are
    the new tokens; each new query sees every held entry of its KV head (or, where the layer's query heads
    chose apart, the entries its own mask shows) and the new tokens up to itself.
    """
    if not isinstance(key, list):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    _, n_q_heads, q_len, d = query.shape
    group = n_q_heads // len(key)
    out = torch.empty_like(query)
    for h, (k, v) in enumerate(zip(key, value)):
        mask = None
        if q_len > 1:
            n_h = k.shape[0]
            mask = torch.ones(q_len, n_h, dtype=torch.bool, device=k.device)
            mask[:, n_h - q_len:] = torch.ones(q_len, q_len, dtype=torch.bool, device=k.device).tril()
        if key.masks[h] is not None:   # (group, n_h): each query head sees its own entries
            seen = key.masks[h][:, None, :]
            mask = seen if mask is None else seen & mask[None]
        q = query[:, h * group:(h + 1) * group]                      # (1, group, q_len, d)
        out[:, h * group:(h + 1) * group] = F.scaled_dot_product_attention(
            q, k[None, None], v[None, None], attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``attn_implementation='pcs'`` available to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, ragged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
