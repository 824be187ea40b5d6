"""The compressed cache: decoding on it equals full attention with the evicted entries masked out,
and the bytes it reports are the bytes it really holds."""
import pytest
import torch
from transformers import DynamicCache

from pcs.cache import CompressedCache
from pcs.compression import compress_after_prefill
from pcs.eviction import build_method
from pcs.engine.prefill import full_kv_bytes
from pcs.generate import greedy_generate
from pcs.hybrid import attention_windows, full_attention_layers

from conftest import compose_cfg, tiny_model
from oracles import Spy, compressed_logits, masked_reference_logits


def method_for(name, selection, budget, **knobs):
    cfg = compose_cfg(f"method={name}", f"selection={selection}", f"budget={budget}",
                      *[f"method.{k}={v}" for k, v in knobs.items()])
    return build_method(cfg)


def assert_windows_held(model, cache, spy):
    """The method chose in the full-attention layers only; each sliding layer holds its window's newest W - 1."""
    windows = attention_windows(model.config)
    assert sorted(spy.kept) == full_attention_layers(windows)
    for layer, window in zip(cache.layers, windows):
        if window is not None:
            assert layer.entries_per_head() == [window - 1] * model.config.num_key_value_heads


@pytest.mark.parametrize("cell", [("method=adakv", "selection=attention"), ("method=snapkv", "selection=attention"),
                                  ("method=adakv", "profile=adakv", "selection=attention")])
def test_buffers_that_grow_while_decoding_still_equal_masked_full_attention(cell):
    """Room for 1 entry: the question and the decoding steps outgrow every buffer several times."""
    model = tiny_model("llama")
    torch.manual_seed(2)
    input_ids, question = torch.randint(0, 256, (1, 90)), torch.randint(0, 256, (1, 4))
    tokens = torch.randint(0, 256, (9,)).tolist()
    spy = Spy(build_method(compose_cfg(*cell, "budget=30", "method.window=8")))
    with torch.no_grad():
        got, cache = compressed_logits(model, input_ids, spy, tokens, question, room=1)
        want = masked_reference_logits(model, input_ids, spy.kept, len(tokens), tokens, question)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer, kept in zip(cache.layers, spy.kept.values()):
        assert layer.key_buffer.shape[1] > 30 + 1     # grown past the first capacity
        if len(kept) == len(layer.lengths):             # per KV head: its kept entries, the question's, the steps'
            assert layer.entries_per_head() == [len(k) + 4 + 9 for k in kept]


@pytest.mark.parametrize("name,selection", [("snapkv", "perturbation"), ("pyramidkv", "attention"),
                                            ("adakv", "perturbation"), ("streamingllm", "attention")])
def test_decoding_on_compressed_cache_equals_masked_full_attention(arch, name, selection):
    model = tiny_model(arch)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 256, (1, 90))
    tokens = torch.randint(0, 256, (5,)).tolist()
    spy = Spy(method_for(name, selection, 40, **({} if name == "streamingllm" else {"window": 8})))
    with torch.no_grad():
        got, cache = compressed_logits(model, input_ids, spy, tokens)
        want = masked_reference_logits(model, input_ids, spy.kept, len(tokens), tokens)
    assert all(k is not None for k in spy.kept.values())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_windows_held(model, cache, spy)
    for l, kept in spy.kept.items():      # what was kept plus the decoded tokens
        assert cache.layers[l].entries_per_head() == [len(k) + len(tokens) for k in kept]


@pytest.mark.parametrize("name,profile", [("adakv", ["profile=adakv"]), ("snapkv", ["profile.gqa=per_query_head"])])
def test_decoding_where_query_heads_chose_apart_equals_masked_full_attention(arch, name, profile):
    """Official AdaKV's default GQA mode: every query head keeps its own entries; a KV head stores their
    union once and each query head attends to its own."""
    model = tiny_model(arch)
    torch.manual_seed(4)
    input_ids, question = torch.randint(0, 256, (1, 96)), torch.randint(0, 256, (1, 5))
    tokens = torch.randint(0, 256, (4,)).tolist()
    cfg = compose_cfg(f"method={name}", "selection=attention", "budget=40", "method.window=8", *profile)
    spy = Spy(build_method(cfg))
    with torch.no_grad():
        got, cache = compressed_logits(model, input_ids, spy, tokens, question)
        want = masked_reference_logits(model, input_ids, spy.kept, len(tokens), tokens, question)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cfg_m = model.config
    group = cfg_m.num_attention_heads // cfg_m.num_key_value_heads
    d = cfg_m.hidden_size // cfg_m.num_attention_heads
    assert_windows_held(model, cache, spy)
    for l, kept in spy.kept.items():
        layer = cache.layers[l]
        assert len(kept) == cfg_m.num_attention_heads                      # one choice per query head
        unions = [set().union(*(set(k.tolist()) for k in kept[g * group:(g + 1) * group]))
                  for g in range(cfg_m.num_key_value_heads)]
        new = 5 + len(tokens)
        assert layer.entries_per_head() == [len(u) + new for u in unions]  # shared entries stored once
        assert layer.nbytes() == sum(len(u) + new for u in unions) * 2 * d * 4
        assert sum(len(u) for u in unions) < sum(len(k) for k in kept)    # the union saves something here


@pytest.mark.parametrize("name", ["snapkv", "adakv"])
def test_question_fed_after_compression_sees_only_kept_entries(arch, name):
    """benchmark.query_aware=false: the question (many tokens at once) attends causally among
    itself and to the kept prompt entries only; decoding continues from there."""
    model = tiny_model(arch)
    torch.manual_seed(2)
    input_ids, question = torch.randint(0, 256, (1, 80)), torch.randint(0, 256, (1, 7))
    tokens = torch.randint(0, 256, (3,)).tolist()
    spy = Spy(method_for(name, "perturbation", 32, window=8))
    with torch.no_grad():
        got, cache = compressed_logits(model, input_ids, spy, tokens, question)
        want = masked_reference_logits(model, input_ids, spy.kept, len(tokens), tokens, question)
    assert got.shape[0] == 1 + 7 + 3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_windows_held(model, cache, spy)
    for l, kept in spy.kept.items():
        assert cache.layers[l].entries_per_head() == [len(k) + 7 + len(tokens) for k in kept]


def test_stops_cannot_end_generation_before_min_new_tokens():
    model = tiny_model("llama")
    input_ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        first = model(input_ids=input_ids).logits[0, -1]
    best, runner_up = first.topk(2).indices.tolist()
    method = method_for("full", "attention", 64)
    assert greedy_generate(model, input_ids, method, 5, {best}).token_ids == []
    assert greedy_generate(model, input_ids, method, 5, {best}, min_new_tokens=1).token_ids[0] == runner_up


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "adakv"])
def test_kv_bytes_are_the_tensors_held_and_memory_is_freed(name):
    model = tiny_model("llama")
    input_ids = torch.randint(0, 256, (1, 120))
    spy = Spy(method_for(name, "perturbation", 48, window=8))
    gen = greedy_generate(model, input_ids, spy, 1, set())
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    expected = sum(len(k) for kept in spy.kept.values() for k in kept) * d * 2 * 4
    assert gen.kv_cache_bytes == expected
    dense = DynamicCache(config=cfg)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(input_ids=input_ids, past_key_values=dense)
    model.set_attn_implementation("pcs")
    assert gen.kv_cache_bytes_full == sum(l.keys.nbytes + l.values.nbytes for l in dense.layers)
    assert gen.kv_cache_bytes_full == full_kv_bytes(cfg, 120, torch.float32)


def test_compressed_heads_own_their_memory():
    """Kept entries are copied out: no buffer is a view into the freed full cache."""
    model = tiny_model("llama")
    cache = CompressedCache.of(model.config)
    with torch.no_grad(), compress_after_prefill(model, method_for("adakv", "perturbation", 40, window=8), cache):
        model(input_ids=torch.randint(0, 256, (1, 200)), past_key_values=cache)
    for layer in cache.layers:
        assert layer.keys is None and layer.values is None
        for t in (layer.key_buffer, layer.value_buffer):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            assert t.shape[1] == max(layer.lengths) + layer.room


@pytest.mark.parametrize("name,budget", [("snapkv", 64), ("snapkv", 128), ("adakv", 64), ("adakv", 128),
                                         ("pyramidkv", 64), ("pyramidkv", 128)])
def test_kept_fraction_is_budget_over_prompt(name, budget):
    model = tiny_model("llama")
    for n in (100, 300):
        gen = greedy_generate(model, torch.randint(0, 256, (1, n)), method_for(name, "perturbation", budget), 1, set())
        ratio = gen.kv_cache_bytes / gen.kv_cache_bytes_full
        tolerance = 0.05 if name == "pyramidkv" else 0.02
        assert abs(ratio / (min(budget, n) / n) - 1) <= tolerance


@pytest.mark.parametrize("cell", [("method=snapkv", "selection=perturbation"), ("method=adakv", "selection=attention"),
                                  ("method=adakv", "profile=adakv", "selection=attention"),
                                  ("method=pyramidkv", "selection=attention"), ("method=full",)])
def test_decoding_takes_at_most_two_attention_calls_per_layer_whatever_the_kv_heads(cell):
    """Llama-3.1's 8 KV heads (4 query heads each), heads of different lengths: the profiler counts the
    attention calls of 4 decoding steps and of a 3-token question fed after compression."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from pcs.models import prepare
    from conftest import TINY
    torch.manual_seed(0)
    model = prepare(AutoModelForCausalLM.from_config(
        LlamaConfig(**{**TINY, "hidden_size": 128, "num_attention_heads": 32, "num_key_value_heads": 8})))
    method = build_method(compose_cfg(*cell, "budget=24", *([] if cell == ("method=full",) else ["method.window=4"])))
    n_layers = model.config.num_hidden_layers
    cache = CompressedCache(n_layers)
    with torch.no_grad():
        with compress_after_prefill(model, method, cache):
            model(input_ids=torch.randint(0, 256, (1, 100)), past_key_values=cache)
        if cell != ("method=full",):
            assert len({n for layer in cache.entries_per_head() for n in layer}) > 1 or "snapkv" in cell[0]
        with torch.profiler.profile() as prof:
            model(input_ids=torch.randint(0, 256, (1, 3)), position_ids=torch.arange(100, 103)[None],
                  past_key_values=cache)
            for t in range(4):
                model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[103 + t]]), past_key_values=cache)
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
    assert n_layers * 5 <= calls <= 2 * n_layers * 5
