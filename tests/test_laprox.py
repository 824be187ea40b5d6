"""LaProx against brute force: Gram-form value norms, layer scores computed by loops, the model-wide
top-k against a global sort, budget totals, the ablations, and decoding on the resulting cache."""
import math

import pytest
import torch

from pcs.hybrid import attention_windows, full_attention_layers

from pcs.eviction.base import LayerState
from pcs.eviction.laprox import LaProx
from pcs.eviction.laprox import value_output_norms
from pcs.engine.prefill import full_kv_bytes
from pcs.generate import greedy_generate

from conftest import tiny_model
from oracles import compressed_logits, masked_reference_logits


def random_state(seed, h_kv=2, h_q=6, n=60, d=8, hidden=24, layer_idx=0, n_layers=1):
    g = torch.Generator().manual_seed(seed)
    return LayerState(layer_idx, n_layers, torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d, generator=g),
                      torch.randn(h_q, 8, d, generator=g), torch.randn(hidden, h_q * d, generator=g))


def brute_force_layer_scores(state: LayerState, window: int, kernel: int, gqa: str, pool_on: str) -> torch.Tensor:
    """Loops in float64: attention of each window query, column L2 norms, ||v W^O_h||_2 by the explicit
    product, group mean, average pooling over the available neighbours, divided by the layer's sum."""
    K, V, Q, W = (t.double() for t in (state.keys, state.values, state.window_queries, state.o_proj_weight))
    h_kv, n, d = K.shape
    h_q, g, m = Q.shape[0], Q.shape[0] // h_kv, n - window
    A = torch.zeros(h_q, window, m, dtype=torch.float64)
    for h in range(h_q):
        for j in range(window):
            pos = n - window + j
            logits = torch.tensor([float(Q[h, j] @ K[h // g, i]) / math.sqrt(d) for i in range(pos + 1)])
            A[h, j] = torch.softmax(logits, 0)[:m]
    N = torch.tensor([[float((W[:, h * d:(h + 1) * d] @ V[h // g, i]).norm()) for i in range(m)] for h in range(h_q)])

    def pool(rows):
        return torch.stack([torch.stack([r[max(0, i - kernel // 2): i + kernel // 2 + 1].mean() for i in range(m)])
                            for r in rows])

    if gqa == "mean_of_scores":
        column = A.norm(dim=1)
        column = pool(column) if pool_on == "attention" else column
        scores = torch.stack([(column * N)[k * g:(k + 1) * g].mean(0) for k in range(h_kv)])
    else:
        column = torch.stack([A[k * g:(k + 1) * g].mean(0).norm(dim=0) for k in range(h_kv)])
        column = pool(column) if pool_on == "attention" else column
        scores = column * torch.stack([N[k * g:(k + 1) * g].mean(0) for k in range(h_kv)])
    scores = pool(scores) if pool_on == "score" else scores
    return scores / scores.sum()


def test_gram_form_value_norm_equals_the_projected_value_norm():
    state = random_state(0)
    d = state.keys.shape[2]
    direct = torch.stack([torch.linalg.vector_norm(state.values[h // 3] @ state.o_proj_weight[:, h * d:(h + 1) * d].T,
                                                   dim=-1) for h in range(6)])
    torch.testing.assert_close(value_output_norms(state.values, state.o_proj_weight), direct, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gqa", ["mean_of_scores", "attention_first"])
@pytest.mark.parametrize("pool_on", ["score", "attention"])
def test_layer_scores_equal_a_direct_computation(gqa, pool_on):
    state = random_state(1)
    got = LaProx(budget=24, window=8, kernel=5, gqa=gqa, pool_on=pool_on).score(state)
    want = brute_force_layer_scores(state, 8, 5, gqa, pool_on)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-7)
    assert abs(float(got.sum()) - 1) < 1e-5


def prefix_sets(kept, n_tokens, window):
    return {(l, h, int(i)) for l, heads in kept.items() for h, idx in enumerate(heads) for i in idx
            if i < n_tokens - window}


def test_model_wide_selection_is_a_global_sort_and_spends_the_budget():
    method = LaProx(budget=20, window=4)
    torch.manual_seed(3)
    n, h_kv, layers = 54, 2, 3
    scores = {l: torch.rand(h_kv, n - 4) ** (l + 1) for l in range(layers)}   # layers on different scales
    kept = method.choose(scores, n)
    total = layers * h_kv * (20 - 4)
    ranked = sorted(((float(s[h, i]), l, h, i) for l, s in scores.items() for h in range(h_kv) for i in range(n - 4)),
                    key=lambda t: -t[0])
    assert prefix_sets(kept, n, 4) == {(l, h, i) for _, l, h, i in ranked[:total]}
    assert sum(len(idx) for heads in kept.values() for idx in heads) == total + layers * h_kv * 4
    for heads in kept.values():
        for idx in heads:
            assert idx[-4:].tolist() == list(range(n - 4, n)) and bool((idx.diff() > 0).all())
    # Budgets come out uneven across layers (the third layer's scores are the most peaked).
    per_layer = [sum(len(i) for i in kept[l]) for l in range(layers)]
    assert len(set(per_layer)) > 1


def test_layer_and_head_ablations_reduce_to_their_definitions():
    torch.manual_seed(4)
    n, h_kv = 54, 2
    scores = {l: torch.rand(h_kv, n - 4) for l in range(3)}
    by_layer = LaProx(budget=20, window=4, scope="layer").choose(scores, n)
    by_head = LaProx(budget=20, window=4, scope="head").choose(scores, n)
    for l, s in scores.items():
        flat = sorted(((float(s[h, i]), h, i) for h in range(h_kv) for i in range(n - 4)), key=lambda t: -t[0])
        assert prefix_sets({l: by_layer[l]}, n, 4) == {(l, h, i) for _, h, i in flat[:h_kv * 16]}
        for h in range(h_kv):
            top = set(s[h].argsort(descending=True)[:16].tolist())
            assert set(by_head[l][h][:-4].tolist()) == top


def test_sinks_are_kept_in_every_head_and_counted_in_the_budget():
    state = random_state(5, n=60)
    method = LaProx(budget=24, window=8, sinks=3, scope="layer")
    kept = method.keep(state)
    assert all(k[:3].tolist() == [0, 1, 2] for k in kept)
    assert sum(len(k) for k in kept) == 2 * 24


class RecordingLaProx(LaProx):
    def choose(self, scores, n_tokens):
        self.kept = super().choose(scores, n_tokens)
        return self.kept


def test_decoding_on_the_laprox_cache_equals_masked_full_attention(arch):
    model = tiny_model(arch)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 256, (1, 90))
    tokens = torch.randint(0, 256, (5,)).tolist()
    method = RecordingLaProx(budget=40, window=8)
    with torch.no_grad():
        got, cache = compressed_logits(model, input_ids, method, tokens)
        want = masked_reference_logits(model, input_ids, method.kept, len(tokens), tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    windows = attention_windows(model.config)
    # The model-wide choice spans the full-attention layers only: their budget, all of it.
    assert sorted(method.kept) == full_attention_layers(windows)
    assert sum(len(k) for kept in method.kept.values() for k in kept) == \
        len(method.kept) * model.config.num_key_value_heads * 40
    for l, kept in method.kept.items():
        assert cache.layers[l].entries_per_head() == [len(k) + len(tokens) for k in kept]


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_the_cache_holds_the_budget_and_the_peak_is_reported(scope):
    model = tiny_model("llama")
    config = model.config
    torch.manual_seed(2)
    prompt = torch.randint(0, 256, (1, 100))
    gen = greedy_generate(model, prompt, LaProx(budget=24, window=8, scope=scope), 3, set())
    full = full_kv_bytes(config, 100, model.dtype)
    assert gen.kv_cache_bytes == full * 24 // 100            # every layer and head: 24 entries on average
    if scope == "model":
        assert gen.peak_kv_bytes == full                      # the whole prefill cache lives until the choice
    else:                     # layer by layer: the last layer full beside the others compressed
        layer_full = full // config.num_hidden_layers
        assert gen.peak_kv_bytes == (config.num_hidden_layers - 1) * layer_full * 24 // 100 + layer_full
