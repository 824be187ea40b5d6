"""Hybrid attention (sliding-window and full-attention layers): the sliding layers hold exactly what the model's
own cache holds, methods choose in the full-attention layers only, and the bytes reported are those held.

The masked-full-attention tests of test_cache.py, test_pool.py, test_laprox.py and test_perturbation.py run on a
tiny Gemma 3 too (conftest's ``gemma3``); here: against transformers' own sliding cache, other hybrid
architectures, and the models pcs refuses."""
import pytest
import torch
from transformers import (AutoModelForCausalLM, DynamicCache, Gemma2Config, Gemma3TextConfig, MinistralConfig,
                          MistralConfig, Olmo3Config, Qwen2Config, Qwen3Config)

import pcs.cache
from pcs.cache import CompressedCache, sliding_block, sliding_prefill_attention
from pcs.compression import compress_after_prefill
from pcs.engine import Arrival, Cell, DecodePool, decode
from pcs.engine.prefill import full_kv_bytes
from pcs.eviction import build_method
from pcs.hybrid import UnsupportedModel, attention_windows, full_attention_layers, held_entries
from pcs.models import prepare

from conftest import TINY, compose_cfg, tiny_model
from oracles import Spy, compressed_logits, masked_reference_logits

HYBRIDS = {
    "gemma3": lambda: tiny_model("gemma3"),
    # Qwen2 with use_sliding_window: layers from max_window_layers on slide.
    "qwen2": lambda: hybrid(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=12, max_window_layers=2)),
    # Qwen3: Qwen2's layout with per-head query and key norms (model=qwen3_8b attends fully; its norms are tested here)
    "qwen3": lambda: hybrid(Qwen3Config(**TINY, head_dim=8, use_sliding_window=True, sliding_window=12,
                                        max_window_layers=2)),
    # Mistral-7B-v0.1's config: no layer_types, a window in every layer.
    "mistral": lambda: hybrid(MistralConfig(**TINY, sliding_window=12)),
    # OLMo 3: three sliding layers to one full; its query norm spans every head's dimensions at once.
    "olmo3": lambda: hybrid(Olmo3Config(**TINY, sliding_window=12,
                                        layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "ministral": lambda: hybrid(MinistralConfig(**TINY, head_dim=8, sliding_window=12,
                                                layer_types=["full_attention", "sliding_attention"] * 2)),
}


def hybrid(config):
    torch.manual_seed(0)
    return prepare(AutoModelForCausalLM.from_config(config))


@pytest.fixture(params=sorted(HYBRIDS))
def model(request):
    return HYBRIDS[request.param]()


def test_each_layer_kind_is_read_from_the_config(model):
    windows = attention_windows(model.config)
    kinds = getattr(model.config, "layer_types", None) or ["sliding_attention"] * model.config.num_hidden_layers
    assert [w is not None for w in windows] == [k == "sliding_attention" for k in kinds]
    assert any(w is not None for w in windows)
    assert all(w in (None, model.config.sliding_window) for w in windows)


@torch.no_grad()
def test_the_uncompressed_cache_equals_the_models_own(model):
    """No eviction: pcs's cache (sliding rings, the question fed at once, 40 steps that wrap each ring several
    times) gives the logits of transformers' own cache, which trims its sliding layers to window - 1 entries."""
    torch.manual_seed(1)
    ids, question = torch.randint(0, 256, (1, 50)), torch.randint(0, 256, (1, 7))
    tokens = torch.randint(0, 256, (40,)).tolist()
    full = build_method(compose_cfg("method=full"))
    got, cache = compressed_logits(model, ids, full, tokens, question)
    model.set_attn_implementation("sdpa")
    try:
        own = DynamicCache(config=model.config)
        want = [model(input_ids=ids, past_key_values=own).logits[0, -1:], model(input_ids=question, past_key_values=own).logits[0]]
        want += [model(input_ids=torch.tensor([[t]]), past_key_values=own).logits[0, -1:] for t in tokens]
    finally:
        model.set_attn_implementation("pcs")
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)
    # The same entries per layer as the model's own cache, and the bytes of them.
    assert cache.entries_per_head() == [[layer.keys.shape[-2]] * layer.keys.shape[1] for layer in own.layers]
    assert cache.nbytes() == sum(layer.keys.nbytes + layer.values.nbytes for layer in own.layers)


@torch.no_grad()
@pytest.mark.parametrize("cell", [("method=snapkv", "selection=perturbation"), ("method=adakv", "selection=attention"),
                                  ("method=pyramidkv", "selection=perturbation"), ("method=streamingllm",)])
def test_compressed_hybrids_equal_masked_attention_and_hold_their_windows(model, cell):
    torch.manual_seed(2)
    ids, question = torch.randint(0, 256, (1, 90)), torch.randint(0, 256, (1, 5))
    tokens = torch.randint(0, 256, (20,)).tolist()
    knobs = [] if cell[0] == "method=streamingllm" else ["method.window=8"]
    spy = Spy(build_method(compose_cfg(*cell, "budget=40", *knobs)))
    got, cache = compressed_logits(model, ids, spy, tokens, question)
    want = masked_reference_logits(model, ids, spy.kept, len(tokens), tokens, question)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    windows = attention_windows(model.config)
    assert sorted(spy.kept) == full_attention_layers(windows)


@torch.no_grad()
def test_kv_bytes_of_a_compressed_hybrid_are_its_full_layers_kept_entries_plus_the_windows():
    """Gemma 3 shape: 2 full layers keep the budget per KV head, 2 sliding layers their window - 1 newest; the
    full cache's bytes are what transformers' own cache holds after the same prompt."""
    model = tiny_model("gemma3")
    cfg = model.config
    ids = torch.randint(0, 256, (1, 120))
    cache = CompressedCache.of(cfg)
    with compress_after_prefill(model, build_method(compose_cfg("method=snapkv", "budget=40", "method.window=8")), cache):
        model(input_ids=ids, past_key_values=cache)
    entry = 2 * cfg.head_dim * 4          # a key and a value, float32
    windows = attention_windows(cfg)
    full_layers = len(full_attention_layers(windows))
    want = (full_layers * 40 + (len(windows) - full_layers) * (cfg.sliding_window - 1)) * cfg.num_key_value_heads
    assert cache.nbytes() == want * entry
    own = DynamicCache(config=cfg)
    model.set_attn_implementation("sdpa")
    try:
        model(input_ids=ids, past_key_values=own)
    finally:
        model.set_attn_implementation("pcs")
    assert full_kv_bytes(cfg, 120, torch.float32) == sum(l.keys.nbytes + l.values.nbytes for l in own.layers)
    assert held_entries(cfg.sliding_window, 120) == cfg.sliding_window - 1 and held_entries(None, 120) == 120


@torch.no_grad()
def test_a_long_prefill_of_sliding_layers_block_by_block_equals_the_models_own(model, monkeypatch):
    """Prompts several sliding blocks long: the banded prefill (each block of queries against the keys its window
    reaches) gives the logits of transformers' own SDPA over the whole mask, and its cache the same entries."""
    blocks, masks = [], []
    original = pcs.cache.sliding_prefill_attention
    monkeypatch.setattr(pcs.cache, "sliding_prefill_attention",
                        lambda *a, **k: blocks.append(a[1].shape[2]) or masks.append(a[4]) or original(*a, **k))
    ids = torch.randint(0, 256, (1, 3 * sliding_block(model.config.sliding_window) + 37),
                        generator=torch.Generator().manual_seed(7))
    cache = CompressedCache.of(model.config)
    got = model(input_ids=ids, past_key_values=cache).logits
    n_sliding = sum(w is not None for w in attention_windows(model.config))
    assert blocks == [ids.shape[1]] * n_sliding          # every sliding layer went block by block
    assert masks == [None] * n_sliding                   # with no whole (q, kv) mask built for it to slice
    model.set_attn_implementation("sdpa")
    try:
        own = DynamicCache(config=model.config)
        want = model(input_ids=ids, past_key_values=own).logits
    finally:
        model.set_attn_implementation("pcs")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.entries_per_head() == [[layer.keys.shape[-2]] * layer.keys.shape[1] for layer in own.layers]


@pytest.mark.parametrize("given_mask", [True, False])
@pytest.mark.parametrize("offset", [0, 45])
def test_banded_sliding_attention_equals_attention_under_the_whole_mask(given_mask, offset):
    """Against one SDPA call with the dense sliding mask (a query at i sees keys i - W < j <= i), queries after
    ``offset`` earlier keys, with the model's mask given or built from the window."""
    g = torch.Generator().manual_seed(11)
    window, q_len, heads, kv_heads, d = 20, 300, 4, 2, 8
    k_len = offset + q_len
    query = torch.randn(1, heads, q_len, d, generator=g)
    key, value = torch.randn(1, kv_heads, k_len, d, generator=g), torch.randn(1, kv_heads, k_len, d, generator=g)
    position = torch.arange(offset, k_len)[:, None]
    seen = torch.arange(k_len)[None, :]
    mask = ((seen <= position) & (seen > position - window))[None, None]
    module = type("Attention", (), {"num_key_value_groups": heads // kv_heads, "is_causal": True,
                                    "training": False})()
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask, scale=0.3).transpose(1, 2)
    got, _ = sliding_prefill_attention(module, query, key, value, mask if given_mask else None, 0.3, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    other, _ = sliding_prefill_attention(module, query, key, value, None if given_mask else mask, 0.3, window)
    assert torch.equal(got, other)        # the bands built are the given mask's: the same to the bit


@torch.no_grad()
def test_a_pool_of_hybrid_sequences_gives_batch_one_tokens_and_bytes():
    """Prompts shorter and longer than the window, decoded past it, in pools of 1 and 3."""
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(5)
    cells = [Cell(build_method(compose_cfg("method=snapkv", "budget=24", "method.window=4"))),
             Cell(build_method(compose_cfg("method=full")))]
    prompts = [torch.randint(0, 256, (1, n), generator=g) for n in (9, 15, 40, 70)]

    def arrivals():
        return [Arrival(model, ids, cells, 30, set(), min_new_tokens=30, owners=[(i, 0), (i, 1)])
                for i, ids in enumerate(prompts)]

    runs = [{seq.owner: seq.result for seq in decode(DecodePool(model, size), arrivals())} for size in (1, 3)]
    for key, alone in runs[0].items():
        assert runs[1][key].token_ids == alone.token_ids and len(alone.token_ids) == 30
        assert runs[1][key].kv_cache_bytes == alone.kv_cache_bytes


@pytest.mark.parametrize("config,why", [
    (lambda: Gemma2Config(**TINY, head_dim=8), "soft-capped"),
    (lambda: Gemma3TextConfig(**TINY, head_dim=8, layer_types=["sliding_attention", "chunked_attention"] * 2),
     "chunked_attention"),
    (lambda: Gemma3TextConfig(**TINY, head_dim=8, use_bidirectional_attention=True), "bidirectional"),
])
def test_models_pcs_cannot_compress_are_refused_naming_why(config, why):
    with pytest.raises(UnsupportedModel, match=why):
        attention_windows(config())


@pytest.mark.parametrize("name,why", [("gpt_oss", "sinks"), ("cohere2", "rotary"), ("exaone4", "rotary"),
                                      ("smollm3", "rotary"), ("gemma3n_text", "share")])
def test_architectures_pcs_cannot_reproduce_are_refused(name, why):
    from transformers import AutoConfig
    with pytest.raises(UnsupportedModel, match=why):
        attention_windows(AutoConfig.for_model(name))


def test_a_refused_model_fails_before_its_weights_load(tmp_path, monkeypatch):
    """model.path to a Gemma 2 checkpoint: the config is read, the weights never are."""
    import pcs.models
    hybrid(Gemma2Config(**TINY, head_dim=8)).save_pretrained(tmp_path)
    monkeypatch.setattr(pcs.models.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(UnsupportedModel, match="soft-capped"):
        pcs.models.load_model(compose_cfg(f"model.path={tmp_path}").model)


@torch.no_grad()
def test_window_queries_are_the_queries_the_model_attends_with(model):
    """What the methods score with: the last w queries as each attention module computes them (its query norm
    and rotary), scaled so that q k / sqrt(d) is the module's logit."""
    from transformers import AttentionInterface

    from pcs.compression import attention_modules, window_queries
    seen, rebuilt = {}, {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        seen[module.layer_idx] = query[0, :, -6:] * scaling * query.shape[-1] ** 0.5
        return torch.zeros_like(query).transpose(1, 2), None

    def rebuild(module, args, kwargs, output):
        rebuilt[module.layer_idx] = window_queries(module, kwargs["hidden_states"], kwargs["position_embeddings"], 6)

    AttentionInterface.register("capture_queries", capture)
    model.set_attn_implementation("capture_queries")
    handles = [m.register_forward_hook(rebuild, with_kwargs=True) for m in attention_modules(model)]
    try:
        model(input_ids=torch.randint(0, 256, (1, 30)))
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation("pcs")
    assert sorted(seen) == sorted(rebuilt) == list(range(model.config.num_hidden_layers))
    for layer in seen:
        torch.testing.assert_close(rebuilt[layer], seen[layer], rtol=1e-5, atol=1e-5)


def test_a_question_longer_than_the_window_leaves_its_newest_entries_in_the_ring():
    """Fed at once after compression, a question of 2.5 windows: each ring slot ends with the one position of the
    newest window that maps to it (positions repeat slots within the write; none may win by chance)."""
    from pcs.cache import SlidingWindowLayer
    layer = SlidingWindowLayer(window=8)
    layer.key_buffer, layer.value_buffer = torch.zeros(2, 8, 4), torch.zeros(2, 8, 4)
    first, q = 13, 20
    keys = torch.arange(first, first + q, dtype=torch.float)[None, :, None].expand(2, q, 4).contiguous()
    layer.write(keys, -keys, first)
    newest = list(range(first + q - 8, first + q))
    want = torch.tensor([next(p for p in newest if p % 8 == slot) for slot in range(8)], dtype=torch.float)
    torch.testing.assert_close(layer.key_buffer[:, :, 0], want.expand(2, 8))
    torch.testing.assert_close(layer.value_buffer[:, :, 0], -want.expand(2, 8))
