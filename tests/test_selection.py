"""Selection against a brute-force transcription of the paper's Algorithms 1 and 2."""
import math

import pytest
import torch

from pcs.eviction.adakv import AdaKV
from pcs.eviction.base import LayerState
from pcs.eviction.snapkv import SnapKV
from pcs.eviction.scores import projected_value_norms
from pcs.eviction.selection import AttentionSelection, PerturbationSelection


def brute_force_scores(K, V, Q, Wo, window, kernel, pooling):
    """Loops over heads, window queries and tokens; returns A (H_q,m), pooled s1 (H_kv,m), N (H_q,m)."""
    h_kv, n, d = K.shape
    h_q = Q.shape[0]
    g, m = h_q // h_kv, n - window
    A = torch.zeros(h_q, m, dtype=torch.float64)
    for h in range(h_q):
        for j in range(window):
            pos = n - window + j
            logits = torch.tensor([float(Q[h, j] @ K[h // g, i]) / math.sqrt(d) for i in range(pos + 1)],
                                  dtype=torch.float64)
            p = torch.softmax(logits, 0)
            A[h] += p[:m] / window
    P = torch.zeros_like(A)
    for h in range(h_q):
        for i in range(m):
            nb = A[h, max(0, i - kernel // 2): i + kernel // 2 + 1]
            P[h, i] = nb.max() if pooling == "max" else nb.mean()
    s1 = torch.stack([P[k * g:(k + 1) * g].mean(0) for k in range(h_kv)])
    N = torch.zeros(h_q, m, dtype=torch.float64)
    for h in range(h_q):
        for i in range(m):
            N[h, i] = (Wo[:, h * d:(h + 1) * d].double() @ V[h // g, i].double()).abs().sum()
    return A, P, s1, N


def ranked(scores, exclude=()):
    return [i for i in sorted(range(len(scores)), key=lambda i: -float(scores[i])) if i not in exclude]


def random_layer(seed, h_kv=2, h_q=6, n=48, d=8, hidden=24):
    g = torch.Generator().manual_seed(seed)
    K, V = torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d, generator=g)
    Q = torch.randn(h_q, 8, d, generator=g) * 2
    Wo = torch.randn(hidden, h_q * d, generator=g)
    return LayerState(0, 1, K, V, Q, Wo)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_perturbation_selection_equals_brute_force(seed, pooling):
    layer, budget, window, alpha = random_layer(seed), 24, 8, 0.25
    method = SnapKV(budget, PerturbationSelection(alpha=alpha), window, 3, pooling)
    kept = method.keep(layer)
    A, _, s1, N = brute_force_scores(layer.keys, layer.values, layer.window_queries, layer.o_proj_weight,
                                     window, 3, pooling)
    m, b = layer.n_tokens - window, budget - window
    g = A.shape[0] // s1.shape[0]
    for k in range(s1.shape[0]):
        stage1 = ranked(s1[k])[: int(alpha * b)]
        s2 = (A[k * g:(k + 1) * g] * N[k * g:(k + 1) * g]).mean(0)
        stage2 = ranked(s2, exclude=set(stage1))[: b - len(stage1)]
        expected = set(stage1) | set(stage2) | set(range(m, layer.n_tokens))
        assert set(kept[k].tolist()) == expected
        assert len(kept[k]) == budget
        assert set(stage1) <= set(kept[k].tolist())


@pytest.mark.parametrize("seed", range(4))
def test_attention_selection_equals_brute_force(seed):
    layer, budget, window = random_layer(seed), 20, 8
    method = SnapKV(budget, AttentionSelection(), window, 3, "max")
    kept = method.keep(layer)
    _, _, s1, _ = brute_force_scores(layer.keys, layer.values, layer.window_queries, layer.o_proj_weight,
                                     window, 3, "max")
    for k in range(s1.shape[0]):
        expected = set(ranked(s1[k])[: budget - window]) | set(range(layer.n_tokens - window, layer.n_tokens))
        assert set(kept[k].tolist()) == expected


def test_released_code_stage2_is_pooled_plus_epsilon_times_group_mean_norms():
    layer, budget, window = random_layer(11), 24, 8
    sel = PerturbationSelection(alpha=0.5, stage2_source="pooled", epsilon=1e-4, gqa="product_of_means")
    kept = SnapKV(budget, sel, window, 3, "avg").keep(layer)
    A, P, s1, N = brute_force_scores(layer.keys, layer.values, layer.window_queries, layer.o_proj_weight,
                                     window, 3, "avg")
    g, b = A.shape[0] // s1.shape[0], budget - window
    for k in range(s1.shape[0]):
        stage1 = ranked(s1[k])[: b // 2]
        s2 = (P[k * g:(k + 1) * g].mean(0) + 1e-4) * N[k * g:(k + 1) * g].mean(0)
        stage2 = ranked(s2, exclude=set(stage1))[: b - len(stage1)]
        assert set(kept[k].tolist()) - set(range(layer.n_tokens - window, layer.n_tokens)) == set(stage1) | set(stage2)


def test_alpha_one_is_attention_selection_and_adakv_heads_vary():
    layer, budget, window = random_layer(3), 24, 8
    a = AdaKV(budget, AttentionSelection(), window, 3, "max", floor=0.2).keep(layer)
    p = AdaKV(budget, PerturbationSelection(alpha=1.0), window, 3, "max", floor=0.2).keep(layer)
    assert all(torch.equal(x, y) for x, y in zip(a, p))
    assert sum(len(x) for x in a) == 2 * budget


def test_short_prompt_is_left_whole():
    layer = random_layer(0, n=20)
    method = SnapKV(24, PerturbationSelection(), 8, 3, "max")
    assert method.keep(layer) is None


def test_value_norms_chunked_equal_unchunked():
    layer = random_layer(5, n=37)
    full = projected_value_norms(layer.values, layer.o_proj_weight, max_bytes=10**12)
    chunked = projected_value_norms(layer.values, layer.o_proj_weight, max_bytes=24 * 5 * 4)
    _, _, _, N = brute_force_scores(layer.keys, layer.values, layer.window_queries, layer.o_proj_weight, 8, 1, "max")
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(full[:, :29].double(), N, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gqa", ["mean_of_products", "product_of_means"])
@pytest.mark.parametrize("source,epsilon", [("unpooled", 0.0), ("pooled", 1e-4)])
@pytest.mark.parametrize("peaked", [True, False])
def test_bounded_stage2_keeps_what_exhaustive_scoring_keeps(gqa, source, epsilon, peaked):
    """The branch-and-bound stage 2 (exact norms only where they could matter) against scoring every entry."""
    from pcs.eviction.selection import PerturbationSelection, WindowScores
    torch.manual_seed(7)
    n_kv, group, m, d, hidden = 2, 3, 900, 16, 48
    logits = torch.randn(n_kv * group, m) * (4.0 if peaked else 0.3)
    mean = logits.softmax(-1)
    pooled = torch.nn.functional.max_pool1d(mean[:, None], 7, 1, 3)[:, 0]
    ws = WindowScores(mean, pooled, pooled.view(n_kv, group, m).mean(1), torch.randn(n_kv, m, d),
                      torch.randn(hidden, n_kv * group * d))
    sel = PerturbationSelection(alpha=0.25, stage2_source=source, epsilon=epsilon, gqa=gqa)
    budgets = torch.tensor([40, 120])
    fast, plain = sel.select(budgets, ws), sel.select(budgets, ws, exhaustive=True)
    assert [f.tolist() for f in fast] == [p.tolist() for p in plain]


def peak_allocated_bytes(fn) -> int:
    """Peak of the bytes allocated and not yet freed while ``fn`` runs, from the profiler's record of
    every CPU allocation and free (independent of how the code under test chunks its work)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_value_norms_need_no_more_memory_than_one_layers_keys_and_values():
    """The issue's memory target, on SmolLM2's shapes: computing ||v W^O_h||_1 for a layer, exhaustively
    or by the bounded stage 2, allocates at most the bytes of that layer's keys and values."""
    from pcs.eviction.selection import WindowScores
    torch.manual_seed(0)
    n_kv, group, m, d, hidden = 3, 3, 2048, 64, 576
    values, weight = torch.randn(n_kv, m, d), torch.randn(hidden, n_kv * group * d) / 24
    layer_kv_bytes = 2 * values.nbytes
    mean = torch.randn(n_kv * group, m).softmax(-1)
    ws = WindowScores(mean, mean, mean.view(n_kv, group, m).mean(1), values, weight)
    budgets = torch.full((n_kv,), 96)
    selection = PerturbationSelection()
    for compute in (lambda: projected_value_norms(values, weight),
                    lambda: selection.select(budgets, ws),
                    lambda: selection.select(budgets, ws, exhaustive=True)):
        assert 0 < peak_allocated_bytes(compute) <= layer_kv_bytes
    # The measurement can fail: one unchunked product for all heads is far larger.
    unchunked = lambda: torch.einsum("gmd,hd->gmh", values, weight[:, :d]).abs().sum(-1)
    assert peak_allocated_bytes(unchunked) > layer_kv_bytes
