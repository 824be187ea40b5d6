"""Which decoder layers attend to every earlier token and which through a sliding window, read from a model's
transformers config, and the architectures pcs refuses (torch-free: it runs before any weights load).

A sliding-window layer's query at position p sees positions p - W + 1 .. p; between steps such a layer holds the
W - 1 newest entries, as transformers' own cache does, whatever the method: eviction methods choose only in
full-attention layers. Gemma 3 and Qwen2 with ``use_sliding_window`` declare the kind of each layer
(``layer_types``); a Mistral config without ``layer_types`` slides in every layer when it sets a window.
"""
from __future__ import annotations

from .errors import ConfigError

FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedModel(ConfigError):
    """A model whose attention pcs's cache cannot reproduce; the message names what and why."""


def attention_windows(config) -> list[int | None]:
    """Per decoder layer: None for full attention, else its sliding window W (positions a query sees, itself
    included). Raises ``UnsupportedModel`` for attention pcs's compressed cache would compute differently."""
    refuse_unsupported(config)
    n_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return [window] * n_layers
    return [window if kind == SLIDING else None for kind in kinds]


# Architectures whose attention pcs's cache or the methods' window queries would compute differently: model type ->
# (whether a config has the trait, the trait).
NO_ROPE = "full-attention layers without rotary positions, which the methods' window queries assume"
REFUSED = {
    "gpt_oss": (lambda c: True, "learned attention sinks (an extra logit per head) that scaled_dot_product_attention "
                                "cannot add"),
    "cohere2": (lambda c: True, NO_ROPE),
    "exaone4": (lambda c: "sliding_attention" in (c.layer_types or []), NO_ROPE),
    "gemma3n_text": (lambda c: True, "layers that share other layers' keys and values"),
}


def refuse_unsupported(config) -> None:
    name = getattr(config, "model_type", type(config).__name__)
    if name in REFUSED and REFUSED[name][0](config):
        raise UnsupportedModel(f"{name}: {REFUSED[name][1]}")
    if 0 in (getattr(config, "no_rope_layers", None) or []):     # SmolLM3
        raise UnsupportedModel(f"{name}: layers without rotary positions (no_rope_layers), which the methods' window "
                               f"queries assume")
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        other = sorted(set(kinds) - {FULL, SLIDING})
        if other:
            raise UnsupportedModel(f"{name}: layers of kind {', '.join(other)}; pcs's cache holds full-attention and "
                                   f"sliding-window layers only")
        if SLIDING in kinds and not getattr(config, "sliding_window", None):
            raise UnsupportedModel(f"{name}: sliding-window layers without a sliding_window in the config")
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModel(f"{name}: attention logits soft-capped at {config.attn_logit_softcapping}; pcs attends "
                               f"through scaled_dot_product_attention, which cannot soft-cap (Gemma 2)")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{name}: bidirectional attention; pcs evicts from causal decoders' caches")


def head_dim(config) -> int:
    """Each attention head's width: the config's ``head_dim`` where it sets one (Gemma 3), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def full_attention_layers(windows: list[int | None]) -> list[int]:
    """The layers an eviction method chooses in."""
    return [i for i, w in enumerate(windows) if w is None]


def held_entries(window: int | None, n_tokens: int) -> int:
    """Entries a layer's uncompressed cache holds per KV head after ``n_tokens``: all of them, or a sliding
    window's newest W - 1."""
    return n_tokens if window is None else min(n_tokens, window - 1)
