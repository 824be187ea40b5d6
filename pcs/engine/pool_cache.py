"""The decode pool's cache: one pool layer per decoder layer (``pcs.engine.pool``, ``pcs.engine.jagged``), called by
transformers' models as any cache, and what a step asks of all of them at once."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..hybrid import attention_windows, head_dim
from ..kernels import decode_attention
from .jagged import JaggedPoolLayer
from .pool import PoolLayer, SlidingPoolLayer, read_spans


def pool_layer(window: int | None, n_kv_heads: int, head_dim: int, dtype, device, max_slots: int,
               kernel: bool = False) -> PoolLayer:
    """A layer of the pool: a sliding window's ring; else, where attention reads each head's own entries (the decode
    kernel), each sequence at its own capacity (``JaggedPoolLayer``), or every slot at the longest's capacity."""
    if window is None and kernel and decode_attention.available(torch.device(device), head_dim):
        return JaggedPoolLayer(n_kv_heads, head_dim, dtype, device, max_slots)
    if window is None:
        return PoolLayer(n_kv_heads, head_dim, dtype, device, max_slots, kernel)
    return SlidingPoolLayer(window, n_kv_heads, head_dim, dtype, device, max_slots, kernel)


class PoolCache(Cache):
    """The pool's layers, one per decoder layer, called by transformers' models as any cache. ``kernel``: on CUDA,
    attention through ``pcs.kernels.decode_attention`` (``EngineOptions.decode_kernel``)."""

    def __init__(self, config, dtype, device, max_slots: int = 1 << 30, kernel: bool = False):
        super().__init__(layers=[pool_layer(w, config.num_key_value_heads, head_dim(config), dtype, device, max_slots,
                                            kernel)
                                 for w in attention_windows(config)])

    def prepare_step(self, batch: int, whole_capacity: bool = False) -> None:
        """Before a forward of slots ``[0, batch)``: attention reads each layer's longest head plus the step's
        entry (a sliding layer's ring at most; on CPU each run of slots its own, ``read_spans``), or the layer's
        whole capacity, a shape that stays the same from step to step (what a captured graph needs). Whole, nothing
        is computed per layer: a sequence reserved its room for every token it may still take when it joined
        (``load``), so no buffer grows between joins."""
        if whole_capacity:
            for layer in self.layers:
                layer.width, layer.spans = layer.capacity, None
            return
        split = self.layers[0].device.type == "cpu"
        threads = torch.get_num_threads()
        for layer in self.layers:
            layer.reserve(batch, int(layer.lengths[:batch].max()) + 1, layer.rows)
            needed = layer.lengths[:batch].max(axis=1) + 1
            layer.width = min(int(needed.max()), layer.capacity)
            layer.spans = read_spans(needed, layer.width, layer.n_kv_heads, threads) if split else None

    def stepped(self, batch: int) -> None:
        """After a forward: the host's lengths follow the device's (one entry more per head in flight)."""
        for layer in self.layers:
            if layer.is_sliding:
                layer.stepped(batch)
            else:
                layer.lengths[:batch] += 1

    def longest(self, slot: int) -> int:
        """Most entries any head of the slot holds in a full-attention layer."""
        return max([int(layer.lengths[slot].max()) for layer in self.layers if not layer.is_sliding], default=0)
