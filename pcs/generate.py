"""Prefill -> compress -> greedy decode on the compressed cache (batch size 1)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache import CompressedCache
from .compression import compress_after_prefill


@dataclass
class Generation:
    token_ids: list[int]
    prompt_tokens: int
    kv_cache_bytes: int        # held right after prefill compression
    kv_cache_bytes_full: int   # what the uncompressed cache of the prompt would hold
    prefill_s: float
    decode_s: float


def full_kv_bytes(config, n_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of an uncompressed K and V cache for ``n_tokens`` over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * n_tokens * torch.empty(0, dtype=dtype).element_size()


@torch.inference_mode()
def greedy_generate(model, input_ids: torch.Tensor, method, max_new_tokens: int,
                    stop_token_ids: set[int]) -> Generation:
    """Greedy decoding; stops at any of ``stop_token_ids`` (not included in the output)."""
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    n = input_ids.shape[1]
    cache = CompressedCache(model.config.num_hidden_layers)
    start = time.perf_counter()
    with compress_after_prefill(model, method, cache):
        logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    kv_bytes = cache.nbytes()
    prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    tokens: list[int] = []
    next_id = int(logits[0, -1].argmax())
    while next_id not in stop_token_ids and len(tokens) < max_new_tokens:
        tokens.append(next_id)
        if len(tokens) == max_new_tokens:
            break
        position = torch.tensor([[n + len(tokens) - 1]], device=device)
        logits = model(input_ids=torch.tensor([[next_id]], device=device), position_ids=position,
                       past_key_values=cache, use_cache=True).logits
        next_id = int(logits[0, -1].argmax())
    decode_s = time.perf_counter() - start
    return Generation(tokens, n, kv_bytes, full_kv_bytes(model.config, n, model.dtype), prefill_s, decode_s)
