"""Decoding-time compression: bounded caches over long generations, no change when it never
triggers, and recompression of heads of different lengths equal to compressing each head alone."""
import pytest
import torch
import torch.nn.functional as F

from pcs.cache import CompressibleLayer
from pcs.compression import recompress
from pcs.validation import validate
from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.eviction.base import LayerState
from pcs.generate import greedy_generate

from conftest import compose_cfg, tiny_model


def method_for(name, budget, selection="perturbation", window=8):
    overrides = [f"method={name}", f"selection={selection}", f"budget={budget}"]
    if name != "streamingllm":
        overrides.append(f"method.window={window}")
    return build_method(compose_cfg(*overrides))


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "adakv", "streamingllm", "laprox"])
def test_cache_stays_bounded_over_a_long_generation(name):
    model = tiny_model("llama")
    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (1, 20))
    gen = greedy_generate(model, prompt, method_for(name, 24), 160, set(), trigger=40)
    assert len(gen.token_ids) == 160
    assert gen.max_kv_entries == 41                     # trigger + the step that crossed it
    # 180 tokens seen, compressed to at most the budget each time: at least (180 - 40) / (41 - 24) events.
    assert gen.n_compressions >= (180 - 40) // 17


@pytest.mark.parametrize("name", ["snapkv", "adakv"])
def test_a_trigger_never_reached_changes_nothing(arch, name):
    model = tiny_model(arch)
    torch.manual_seed(1)
    prompt = torch.randint(0, 256, (1, 60))
    method = method_for(name, 32)
    plain = greedy_generate(model, prompt, method, 40, set())
    watched = greedy_generate(model, prompt, method, 40, set(), trigger=200)
    assert watched.token_ids == plain.token_ids
    assert watched.n_compressions == 0 and watched.max_kv_entries == plain.max_kv_entries
    if name == "snapkv":       # every head: the budget, then one entry per decoded token but the last
        assert plain.max_kv_entries == 32 + 39


def ragged_layer(lengths, n_q_heads, d=16, seed=0):
    torch.manual_seed(seed)
    layer = CompressibleLayer()
    layer.lazy_initialization(torch.empty(0), torch.empty(0))
    keys = torch.stack([F.pad(torch.randn(n, d), (0, 0, 0, max(lengths) - n)) for n in lengths])
    values = torch.stack([F.pad(torch.randn(n, d), (0, 0, 0, max(lengths) - n)) for n in lengths])
    layer.fill(keys, values, lengths)
    layer.recent_queries = torch.randn(n_q_heads, 8, d)
    return layer


def test_recompressing_heads_of_different_lengths_equals_compressing_each_alone():
    """SnapKV scores each head on its own, so the padded joint scoring must give what each
    unpadded head gives by itself."""
    lengths, n_q, d = [50, 73, 96], 6, 16
    layer = ragged_layer(lengths, n_q, d)
    o_proj = torch.randn(32, n_q * d)
    method = method_for("snapkv", 24)
    before = [k.clone() for k, _ in layer.heads()]
    expected = []
    for h, n in enumerate(lengths):
        alone = LayerState(0, 4, before[h][None], layer.heads()[h][1][None], layer.recent_queries[2 * h:2 * h + 2],
                           o_proj[:, 2 * h * d:(2 * h + 2) * d])
        expected.append(before[h][method.keep(alone)[0]])
    assert recompress(layer, method, 0, 4, o_proj)
    for h in range(3):
        torch.testing.assert_close(layer.heads()[h][0], expected[h])


def test_adakv_recompression_keeps_the_layer_total_and_only_real_entries():
    lengths = [40, 90, 120]
    layer = ragged_layer(lengths, 6)
    before = [k.clone() for k, _ in layer.heads()]
    assert recompress(layer, method_for("adakv", 24), 1, 4, torch.randn(32, 96))
    assert sum(layer.entries_per_head()) == 3 * 24
    for h, (keys, _) in enumerate(layer.heads()):
        # Every kept row is one of the head's own rows (no padding), and its newest 8 are kept.
        matches = (keys[:, None, :] == before[h][None, :, :]).all(-1)
        assert matches.any(1).all()
        torch.testing.assert_close(keys[-8:], before[h][-8:])


def test_trigger_must_exceed_the_budget():
    with pytest.raises(ConfigError, match="compress.trigger=64"):
        validate(compose_cfg("budget=64", "compress.trigger=64"))
    validate(compose_cfg("budget=64", "compress.trigger=256"))
