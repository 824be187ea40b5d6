"""Prefill compression: forward hooks on every attention module that shrink its cache layer.

The hook runs right after a layer's prefill forward, so the full cache of a layer lives only while
that layer is being computed (peak memory of one layer's full KV, as in SnapKV's and kvpress's
pipelines). It rebuilds the last ``w`` queries from the layer input, because the attention module
does not expose them, and asks the method which entries each KV head keeps.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .cache import CompressedCache
from .eviction import LayerState


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def window_queries(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings,
                   window: int) -> torch.Tensor:
    """Rotary-embedded queries of the last ``window`` tokens, (H_q, w, d), recomputed from the layer input."""
    d = attn.head_dim
    h = hidden_states[:, -window:]
    q = attn.q_proj(h).view(1, h.shape[1], -1, d).transpose(1, 2)       # (1, H_q, w, d)
    cos, sin = position_embeddings
    cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
    return (q * cos + rotate_half(q) * sin)[0]


def attention_modules(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


@contextmanager
def after_prefill(model, cache: CompressedCache, window: int, on_layer):
    """While active, ``on_layer(state, cache_layer)`` runs right after each attention module's
    multi-token forward, with the layer's full keys and values and its last ``window`` queries."""
    modules = attention_modules(model)

    def hook(module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden.shape[1] <= 1:
            return
        layer = cache.layers[module.layer_idx]
        keys, values = layer.dense()
        queries = (window_queries(module, hidden, kwargs["position_embeddings"], window)
                   if window else keys.new_empty(0))
        on_layer(LayerState(module.layer_idx, len(modules), keys, values, queries, module.o_proj.weight), layer)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield cache
    finally:
        for handle in handles:
            handle.remove()


def compress_after_prefill(model, method, cache: CompressedCache):
    """While active, each attention module compresses its layer of ``cache`` after a multi-token forward."""
    def compress(state: LayerState, layer) -> None:
        kept = method.keep(state)
        if kept is not None:
            layer.compress(kept)
    return after_prefill(model, cache, getattr(method, "window", 0), compress)
