"""Selection against a brute-force transcription of the paper's Algorithms 1 and 2; the bounded stage 2 against
the exhaustive one; the host reads of a layer's compression."""
import dataclasses
import functools
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.eviction.adakv import AdaKV
from pcs.eviction.base import LayerState
from pcs.eviction.snapkv import SnapKV
from pcs.eviction.conventions import Conventions
from pcs.eviction.scores import SharedScores, group_weights, norm_plan, projected_value_norms, \
    top_eigenvalue_bound
from pcs.eviction.selection import AttentionSelection, PerturbationSelection, WindowScores
from pcs.eviction.stage2_search import Stage2, Stage2Run, Stage2Work
from pcs.options import defaults

from conftest import compose_cfg
from oracles import MOST_HOST_READS, peak_allocated_bytes


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


def test_value_norms_equal_brute_force_whatever_the_tile():
    layer = random_layer(5, n=37)
    n_kv, _, d = layer.values.shape
    _, _, _, N = brute_force_scores(layer.keys, layer.values, layer.window_queries, layer.o_proj_weight, 8, 1, "max")
    group = layer.window_queries.shape[0] // n_kv
    for tile in (1, 5, 37, 64):
        norms = projected_value_norms(layer.values, group_weights(layer.o_proj_weight, n_kv, d), group,
                                      tile).flatten(0, 1)
        torch.testing.assert_close(norms[:, :29].double(), N, rtol=1e-5, atol=1e-4)


def kvpress_vwl1norm_per_query_head(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """kvpress 0.5.5's ``CriticalKVPress.vwl1norm`` (criticalkv_press.py lines 59-72) transcribed for one sequence,
    before its group mean: (H_kv, n, d) values, (hidden, H_q * d) weight -> (H_q, n), each query head's
    ``torch.norm(p=1)`` of its whole (n, hidden) product."""
    n_kv, n, d = values.shape
    hidden, qd = o_proj_weight.shape
    n_q = qd // d
    wo = o_proj_weight.transpose(0, 1).reshape(n_q, d, hidden)
    v = values.repeat_interleave(n_q // n_kv, dim=0)
    return torch.stack([torch.norm(v[head].matmul(wo[head]), p=1, dim=-1) for head in range(n_q)])


@pytest.mark.parametrize("tile", [32, 100, 512])
def test_one_reductions_value_norms_are_kvpress_bits_in_float32(tile):
    """In float32 on this CPU, every tile's norms taken in one reduction (``l1_norm=torch_norm``, kvpress's profile)
    are the bits kvpress's CriticalKVPress computes over the whole prompt at once (``make conformance`` compares
    whole selections; this pins the norms themselves), and the sum of the absolute values is not (the test can
    fail)."""
    g = torch.Generator().manual_seed(4)
    n_kv, n_q, n, d, hidden = 3, 9, 700, 64, 576        # SmolLM2's layer shapes
    values = torch.randn(n_kv, n, d, generator=g)
    weight = torch.randn(hidden, n_q * d, generator=g) / 8
    theirs = kvpress_vwl1norm_per_query_head(values, weight)
    weights = group_weights(weight, n_kv, d)
    assert torch.equal(projected_value_norms(values, weights, n_q // n_kv, tile, one_reduction=True).flatten(0, 1),
                       theirs)
    assert not torch.equal(projected_value_norms(values, weights, n_q // n_kv, tile).flatten(0, 1), theirs)


def test_the_l1_norm_convention_reaches_the_plan():
    cpu = torch.device("cpu")
    assert not norm_plan(3, 4096, 64, 3, 576, torch.float32, cpu).one_reduction
    assert norm_plan(3, 4096, 64, 3, 576, torch.float32, cpu, "torch_norm").one_reduction
    from pcs.eviction.conventions import Conventions
    with pytest.raises(ConfigError, match="l1_norm"):
        Conventions(l1_norm="pairwise")


def test_each_profiles_l1_norm_reaches_stage2_and_the_shared_norms(monkeypatch):
    """From the composed config to stage 2's plan: kvpress's profile (and so ``preset=criticalkv``) sums in one
    reduction, the paper's does not; shared norms are computed once per way of summing."""
    import pcs.eviction.scores as scores_module
    import pcs.eviction.stage2_search as search_module
    asked = []

    def recording_plan(*args, **kwargs):
        plan = scores_module.norm_plan(*args, **kwargs)
        asked.append(plan.one_reduction)
        return plan
    monkeypatch.setattr(search_module, "norm_plan", recording_plan)
    layer = long_layer(1)
    for overrides, one_reduction in ((["profile=kvpress"], True), (["preset=criticalkv"], True),
                                     (["profile=paper"], False)):
        asked.clear()
        build_method(compose_cfg("method=snapkv", "selection=perturbation", "budget=120", *overrides)).keep(
            layer, bounded())
        assert asked and set(asked) == {one_reduction}
    shared = SharedScores(layer.values, layer.o_proj_weight)
    summed, reduced = shared.value_norms(3, "abs_sum"), shared.value_norms(3, "torch_norm")
    assert shared.value_norms(3, "torch_norm") is reduced and not torch.equal(summed, reduced)
    torch.testing.assert_close(summed, reduced, rtol=1e-5, atol=0)


@pytest.mark.parametrize("one_reduction", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_value_norms_are_float32_sums_of_the_products_absolute_values(dtype, one_reduction):
    """The norm sums the product's absolute values in float32: by default the bits of converting the product first
    and summing (those the committed paper-profile results were computed with); in one reduction that upcasts as
    it reads (an accelerator's, and kvpress's profile on a CPU), to float32's rounding of that sum."""
    g = torch.Generator().manual_seed(4)
    r, c, d, group, hidden, tile = 3, 200, 32, 4, 96, 64
    values = torch.randn(r, c, d, generator=g).to(dtype)
    weights = (torch.randn(r, d, group * hidden, generator=g) / 8).to(dtype)
    padded = torch.cat([values, values.new_zeros(r, 256 - c, d)], 1)
    want = torch.cat([torch.bmm(padded[:, s:s + tile], weights).float().abs().view(r, tile, group, hidden).sum(-1)
                      for s in range(0, 256, tile)], 1)[:, :c].transpose(1, 2)
    got = projected_value_norms(values, weights, group, tile, one_reduction)
    assert got.dtype == torch.float32
    if one_reduction:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    else:
        assert torch.equal(got, want)


def test_an_entrys_norm_does_not_depend_on_the_rows_scored_with_it():
    """Bounded and exhaustive stage 2 score different sets of entries, one KV head at a time (CPU) or all at once
    (accelerators); each entry's norm must be the same bits."""
    layer = random_layer(9, n=300, d=16, hidden=96)
    n_kv = layer.values.shape[0]
    weights = group_weights(layer.o_proj_weight, n_kv, 16)
    for one_reduction in (False, True):
        every = projected_value_norms(layer.values[:1], weights[:1], 3, 32, one_reduction)
        some = torch.tensor([299, 3, 150, 151, 7, 64])
        assert torch.equal(projected_value_norms(layer.values[:1, some], weights[:1], 3, 32, one_reduction),
                           every[..., some])
        assert torch.equal(projected_value_norms(layer.values, weights, 3, 32, one_reduction)[:1], every)


def test_top_eigenvalue_bound_is_above_the_eigensolvers_and_close_to_it():
    """Against torch.linalg.eigvalsh: never below the largest eigenvalue, and within the d^(1/256) the repeated
    squaring promises, for full-rank, rank-one, equal-eigenvalue and zero Gram matrices."""
    g = torch.Generator().manual_seed(2)
    d = 32
    w = torch.randn(5, d, 3 * d, generator=g)
    grams = torch.cat([w @ w.transpose(1, 2),
                       (lambda v: v @ v.T)(torch.randn(d, 1, generator=g))[None],
                       7.5 * torch.eye(d)[None], torch.zeros(1, d, d)])
    bound = top_eigenvalue_bound(grams)
    largest = torch.linalg.eigvalsh(grams.double())[:, -1]
    assert (bound.double() >= largest * (1 - 1e-6)).all(), (bound, largest)
    assert (bound.double() <= largest * d ** (1 / 256) * (1 + 1e-5) + 1e-30).all(), (bound, largest)


def test_output_projection_is_computed_once_per_weight_and_again_after_a_change():
    from pcs.eviction.scores import output_projection
    weight = torch.randn(24, 4 * 8)
    first = output_projection(weight, 8)
    assert output_projection(weight, 8) is first
    torch.testing.assert_close(first.grams[1], weight[:, 8:16].T @ weight[:, 8:16])
    weight.mul_(2)                                             # in place: the tensor's version moves
    assert torch.allclose(output_projection(weight, 8).grams, 4 * first.grams)


def test_output_projection_follows_its_module_to_another_dtype():
    """``Module.to`` keeps the Parameter object and its version but replaces its storage (as a move to a GPU
    does): the projection must be the moved weight's, in its dtype, not the one cached before the move."""
    from pcs.eviction.scores import output_projection
    o_proj = torch.nn.Linear(4 * 8, 24, bias=False)
    weight = o_proj.weight
    before, version = output_projection(weight, 8), weight._version
    o_proj.to(torch.bfloat16)
    assert o_proj.weight is weight and weight._version == version
    after = output_projection(weight, 8)
    assert after.by_input.dtype == torch.bfloat16 and before.by_input.dtype == torch.float32
    torch.testing.assert_close(after.grams, before.grams, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", ["mean_of_products", "product_of_means"])
def test_the_bounds_hold_every_computed_score(dtype, gqa):
    """The d and d^2 upper bounds of stage 2 lie above, and the d^2 lower bound below, every entry's exact score as
    computed (in the values' dtype), including value vectors that nearly cancel in some output coordinates."""
    g = torch.Generator().manual_seed(4)
    n_kv, group, m, d, hidden = 2, 3, 500, 16, 48
    values = torch.randn(n_kv, m, d, generator=g)
    values[:, :50] *= 1e-3                                                   # tiny entries
    values[:, 50:100] = values[:, 100:150] * 1e4                              # large ones
    weight = torch.randn(hidden, n_kv * group * d, generator=g)
    weight[:, :d] = weight[:, :1]                                            # a rank-one head
    mean, pooled, stage1 = attention_like(n_kv, group, m, True, g)
    ws = WindowScores(mean, pooled, stage1, values.to(dtype), weight.to(dtype))
    stage2 = Stage2(PerturbationSelection(gqa=gqa), ws, torch.zeros(n_kv, m, dtype=torch.bool), [100, 100])
    exact = stage2.exhaustive()
    spectral = stage2.spectral_bounds()
    assert (spectral >= exact).all()
    every = torch.arange(m).expand(n_kv, m)
    gram, norms = stage2.gram_bounds(every, [m] * n_kv, lower=True)
    lower = stage2.lower_bounds(every, norms)
    assert (gram >= exact).all() and (lower <= exact).all()
    # Rows asking for unequal numbers of entries (a CPU computes only those): the same bounds where asked.
    sizes = [m, m // 3]
    ragged, ragged_norms = stage2.gram_bounds(every, sizes, lower=True)
    for r, size in enumerate(sizes):
        torch.testing.assert_close(ragged[r, :size], gram[r, :size])
        torch.testing.assert_close(ragged_norms[r, :, :size], norms[r, :, :size])
    assert (gram <= spectral * 1.01).all()    # the d^2 bound is the tighter, up to the eigenvalue bound's rounding
    # The lower bound is not vacuous: ||y||_1 >= ||y||_2 leaves a sqrt(hidden) gap, plus the rounding room, which
    # only the tiny entries and the rank-one head's near-null directions (KV head 0's group) feel.
    assert (lower > 0).all() and (lower * math.sqrt(hidden) * stage2.slack ** 2 * 1.01 >= gram)[1, 50:].all()


def test_the_sign_lower_bound_comes_close_to_the_norm_when_values_share_a_direction():
    """Value vectors around a common direction (as a layer's values are): the lower bound from the sign patterns
    of the mean's output is within a few percent of most entries' exact score, far above ||y||_2's sqrt(hidden)."""
    g = torch.Generator().manual_seed(8)
    n_kv, group, m, d, hidden = 1, 3, 400, 16, 96
    values = torch.randn(d, generator=g) * 3 + 0.5 * torch.randn(n_kv, m, d, generator=g)
    mean, pooled, stage1 = attention_like(n_kv, group, m, True, g)
    ws = WindowScores(mean, pooled, stage1, values, torch.randn(hidden, n_kv * group * d, generator=g))
    stage2 = Stage2(PerturbationSelection(), ws, torch.zeros(n_kv, m, dtype=torch.bool), [100])
    exact = stage2.exhaustive()[0]
    every = torch.arange(m)[None]
    lower = stage2.lower_bounds(every, stage2.gram_bounds(every, [m], lower=True)[1])[0]
    assert (lower <= exact).all()
    assert (lower / exact).median() > 0.9 and (lower / exact).min() > 1 / math.sqrt(hidden)


def attention_like(n_rows, group, m, peaked, generator):
    logits = torch.randn(n_rows * group, m, generator=generator) * (4.0 if peaked else 0.3)
    mean = logits.softmax(-1)
    pooled = torch.nn.functional.max_pool1d(mean[:, None], 7, 1, 3)[:, 0]
    return mean, pooled, pooled.view(n_rows, group, m).mean(1)


@pytest.mark.parametrize("ties", ["earlier", "topk"])
@pytest.mark.parametrize("gqa", ["mean_of_products", "product_of_means"])
def test_entries_kept_on_their_lower_bound_are_those_exhaustive_scoring_keeps(ties, gqa):
    """A one-dimensional output (hidden = 1): ||y||_1 = ||y||_2, so the d^2 bounds are tight from both sides and
    the certification decides at the cut itself. Every entry it keeps must be one exhaustive scoring keeps."""
    g = torch.Generator().manual_seed(12)
    n_kv, group, m, d = 2, 3, 900, 16
    mean, pooled, stage1 = attention_like(n_kv, group, m, True, g)
    ws = WindowScores(mean, pooled, stage1, torch.randn(n_kv, m, d, generator=g),
                      torch.randn(1, n_kv * group * d, generator=g), conventions=Conventions(ties=ties))
    sel, work = PerturbationSelection(gqa=gqa), Stage2Work()
    for budgets in ([40, 120], [300, 7]):
        fast, plain = sel.select(budgets, ws, stage2=Stage2Run(work=work)), sel.select(budgets, ws, exhaustive=True)
        assert [f.tolist() for f in fast] == [p.tolist() for p in plain], budgets
    assert work.certified > 0


@pytest.mark.parametrize("ties", ["earlier", "topk"])
@pytest.mark.parametrize("gqa", ["mean_of_products", "product_of_means"])
@pytest.mark.parametrize("source,epsilon", [("unpooled", 0.0), ("pooled", 1e-4)])
@pytest.mark.parametrize("peaked", [True, False])
def test_bounded_stage2_keeps_what_exhaustive_scoring_keeps(ties, gqa, source, epsilon, peaked):
    """Exact norms only for the candidates the bound leaves, against scoring every entry."""
    g = torch.Generator().manual_seed(7)
    n_kv, group, m, d, hidden = 2, 3, 900, 16, 48
    mean, pooled, stage1 = attention_like(n_kv, group, m, peaked, g)
    ws = WindowScores(mean, pooled, stage1, torch.randn(n_kv, m, d, generator=g),
                      torch.randn(hidden, n_kv * group * d, generator=g), conventions=Conventions(ties=ties))
    sel, work = PerturbationSelection(alpha=0.25, stage2_source=source, epsilon=epsilon, gqa=gqa), Stage2Work()
    fast, plain = sel.select([40, 120], ws, stage2=Stage2Run(work=work)), sel.select([40, 120], ws, exhaustive=True)
    assert [f.tolist() for f in fast] == [p.tolist() for p in plain]
    if peaked and source == "unpooled":   # the bounds rule most entries out, and keep some without exact norms
        assert work.exact_share < 0.2 and work.gram_share < 1 and work.certified > 0
    assert 1 <= work.host_reads <= Stage2.MOST_READS


@pytest.mark.parametrize("ties", ["earlier", "topk"])
def test_ties_at_the_cut_follow_the_profiles_rule(ties):
    """Entries with identical values and attention tie exactly at stage 2's cut; the bounded stage 2 keeps the ones
    the exhaustive one keeps, under the stable rule (earlier wins) and under torch.topk's."""
    g = torch.Generator().manual_seed(3)
    n_kv, group, m, d, hidden = 1, 2, 400, 8, 32
    mean, pooled, stage1 = attention_like(n_kv, group, m, True, g)
    values = torch.randn(n_kv, m, d, generator=g) * 0.1
    twins = torch.tensor([30, 90, 91, 200, 333, 350])             # the same value vector and attention: equal scores
    values[:, twins] = torch.randn(d, generator=g) * 5
    mean[:, twins] = mean.max() * 2
    pooled[:, twins] = 0.0                                        # stage 1 leaves them to stage 2
    stage1 = pooled.view(n_kv, group, m).mean(1)
    ws = WindowScores(mean, pooled, stage1, values, torch.randn(hidden, group * d, generator=g),
                      conventions=Conventions(ties=ties))
    sel = PerturbationSelection(alpha=0.5)
    budget = 2 * 4                                               # 4 by stage 1, 4 of the 6 twins by stage 2
    fast, plain = sel.select([budget], ws), sel.select([budget], ws, exhaustive=True)
    assert fast[0].tolist() == plain[0].tolist()
    assert len(set(fast[0].tolist()) & set(twins.tolist())) == 4
    if ties == "earlier":
        assert set(fast[0].tolist()) & set(twins.tolist()) == {30, 90, 91, 200}


def test_value_norms_need_no_more_memory_than_one_layers_keys_and_values():
    """The issue's memory target, on SmolLM2's shapes: computing ||v W^O_h||_1 for a layer, exhaustively
    or by the bounded stage 2, allocates at most the bytes of that layer's keys and values."""
    torch.manual_seed(0)
    n_kv, group, m, d, hidden = 3, 3, 2048, 64, 576
    values, weight = torch.randn(n_kv, m, d), torch.randn(hidden, n_kv * group * d) / 24
    layer_kv_bytes = 2 * values.nbytes
    mean = torch.randn(n_kv * group, m).softmax(-1)
    ws = WindowScores(mean, mean, mean.view(n_kv, group, m).mean(1), values, weight)
    budgets = [96] * n_kv
    selection = PerturbationSelection()
    weights = group_weights(weight, n_kv, d)
    tile = norm_plan(n_kv, m, d, group, hidden, values.dtype, values.device).tile
    for compute in (lambda: projected_value_norms(values[:1], weights[:1], group, tile),
                    lambda: projected_value_norms(values[:1], weights[:1], group, tile, one_reduction=True),
                    lambda: SharedScores(values, weight).value_norms(group, "abs_sum"),
                    lambda: selection.select(budgets, ws),
                    lambda: selection.select(budgets, ws, exhaustive=True)):
        assert 0 < peak_allocated_bytes(compute) <= layer_kv_bytes
    # The measurement can fail: one unchunked product for all heads is far larger.
    unchunked = lambda: torch.einsum("gmd,hd->gmh", values, weight[:, :d]).abs().sum(-1)
    assert peak_allocated_bytes(unchunked) > layer_kv_bytes


PROFILES = ["paper", "kvpress", "adakv", "kvcache_factory"]


def every_method(profile, gqa):
    """SnapKV, PyramidKV and AdaKV with both perturbation selections (and kvpress's preset), one profile and GQA mode."""
    cells = [(m, s) for m in ("snapkv", "pyramidkv", "adakv") for s in ("perturbation", "perturbation_released")]
    return [build_method(compose_cfg(f"method={m}", f"selection={s}", f"profile={profile}", f"profile.gqa={gqa}",
                                     "budget=120", "method.window=8", "method.kernel=5", "method.pooling=avg"))
            for m, s in cells] + [
        build_method(compose_cfg("preset=criticalkv", f"method={m}", f"profile.gqa={gqa}", "budget=120"))
        for m in ("snapkv", "adakv")]


def long_layer(seed, n=700, pad=None, sharpness=2.0):
    """A random layer."""
    g = torch.Generator().manual_seed(seed)
    h_kv, h_q, d, hidden = 2, 6, 16, 48
    K, V = torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d, generator=g)
    return LayerState(3, 8, K, V, torch.randn(h_q, 64, d, generator=g) * sharpness,
                      torch.randn(hidden, h_q * d, generator=g), pad)


def bounded(work: Stage2Work | None = None, search: str = "bounded", **knobs) -> Stage2Run:
    """Stage 2 by ``search``, bounded unless said (a CPU's only search; where a test forces an accelerator's plan,
    short layers would otherwise score every entry), counting what it computed in ``work``."""
    return Stage2Run(dataclasses.replace(defaults().stage2, search=search, **knobs),
                     work if work is not None else Stage2Work())


@pytest.fixture(params=["one row", "every row", "norms kernel"])
def rows_together(request, monkeypatch):
    """Exact norms computed one row at a time (a CPU's way), all rows in one batched product, padded to the row
    that asks for most (an accelerator's), or all rows in one launch of the norms kernel, each row computing what it
    asks for (CUDA's), on the CPU. The kernel runs in Triton's interpreter, which must be on before torch imports
    Triton: ``TRITON_INTERPRET=1 pytest tests/test_selection.py -k kernel`` where Triton is installed (CUDA's torch
    wheels ship it, this project's CPU venv does not; tests/test_gpu.py runs the compiled kernel)."""
    import pcs.eviction.scores as scores_module
    if request.param != "one row":      # stage 2 bounds: long_layer's layers and the WindowScores below say so
        monkeypatch.setattr(scores_module, "batches_rows", lambda device: True)
    if request.param == "norms kernel":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1, set before the run)")
        from pcs.kernels import value_norms as kernel
        monkeypatch.setattr(kernel, "available", lambda device, d: True)
        kernel._kernel.cache_clear()
        request.addfinalizer(kernel._kernel.cache_clear)
    return request.param


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("gqa", ["pool_then_mean", "mean_then_pool", "per_query_head"])
def test_every_method_profile_and_gqa_mode_keeps_what_exhaustive_stage2_keeps(profile, gqa, rows_together):
    """Whole methods (allocation, stage 1, stage 2) on full prompts and on heads padded at the front as decoding-time
    recompression gives them: the bounded stage 2 keeps exactly the exhaustive one's entries, whether the rows'
    exact norms are computed one at a time or together."""
    # The sharper the attention, the fewer entries the bounds leave after the first round.
    layers = [long_layer(1), long_layer(2, pad=torch.tensor([0, 137])), long_layer(5, sharpness=6.0)]
    # As a group of runs sharing a prefill sees them: one SharedScores per layer for every method (padded heads,
    # decoding-time recompression, never share).
    in_a_group = [dataclasses.replace(layer, shared=SharedScores(layer.values, layer.o_proj_weight))
                  for layer in layers]
    works = []
    for method in every_method(profile, gqa):
        works.append(Stage2Work())
        for layer, grouped in zip(layers, in_a_group):
            fast = method.keep(layer, bounded(works[-1]))
            exhaustive = functools.partial(type(method.selection).select, method.selection, exhaustive=True)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(method.selection, "select", exhaustive)
                plain = method.keep(layer, bounded())
            assert [f.tolist() for f in fast] == [p.tolist() for p in plain], (profile, gqa, method)
            assert [f.tolist() for f in fast] == [g.tolist() for g in method.keep(grouped, bounded())], (profile, gqa, method)
    # Both of stage 2's paths ran: heads the first round settled, and heads that needed the second.
    assert 0 < sum(w.widened for w in works) < sum(w.heads for w in works)


class HostReads(TorchDispatchMode):
    """Counts what makes the host wait for a device's values: scalar reads (item, int, bool), nonzero, masked_select,
    boolean indexing, bincount (CUDA's reads its input's min and max), an indexed assignment of a Python scalar
    (its value is copied from the host), and ``tolist`` (which does not dispatch, so it is counted by a wrapper). On a CPU nothing waits, but the same calls are the ones that synchronise with a
    GPU."""
    WAITING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.bincount.default}

    def __enter__(self):
        self.count, self.tolist = 0, torch.Tensor.tolist
        mode = self

        def counted(tensor):
            mode.count += 1
            return mode.tolist(tensor)
        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        # ``x[idx] = True``: the value is a host scalar that CUDA copies over and waits for, once per assignment
        scalar_put = func in (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default) and args[2].dim() == 0
        self.count += func in self.WAITING or boolean_index or scalar_put
        return func(*args, **(kwargs or {}))


def test_adakv_allocations_never_wait_for_the_device():
    """AdaKV's allocations read nothing back: the largest-remainder count and kvpress's window score stay on the
    device (a per-head count through bincount would add CUDA's two reads). The layer's one read is its budgets."""
    from pcs.eviction.adakv import adaptive_budgets, kvpress_budgets, official_budgets
    scores = torch.rand(4, 3000, generator=torch.Generator().manual_seed(0))
    for allocate in (lambda: adaptive_budgets(scores, 512, 32), lambda: kvpress_budgets(scores, 512, 32, 0.2),
                     lambda: official_budgets(scores, 512, 32, 0.2)):
        with HostReads() as reads:
            allocate()
        assert reads.count == 0


@pytest.mark.parametrize("profile", PROFILES)
def test_one_layers_compression_waits_for_the_device_a_constant_number_of_times(profile):
    """The reads that would synchronise with a GPU, counted on the CPU for every method with perturbation selection:
    at most MOST_HOST_READS at 600 and at 6,000 tokens (how many of stage 2's rounds a layer needs depends on its
    scores, not on its length; tests/test_gpu.py counts CUDA's own syncs)."""
    for method in every_method(profile, "pool_then_mean"):
        counts = []
        for n in (600, 6000):
            layer = long_layer(4, n=n)
            with HostReads() as reads:
                method.keep(layer, bounded())
            counts.append(reads.count)
        assert 1 <= min(counts) and max(counts) <= MOST_HOST_READS, (profile, method, counts)


def kvpress_heads_top(scores: torch.Tensor, ks: list[int]) -> list[list[int]]:
    """Each row's kept positions as kvpress 0.5.5's ``CriticalAdaKVPress.compress`` marks them (criticalkv_press.py
    lines 183-186, transcribed: one ``torch.topk`` with the largest budget, sorted, then each head's first budget)."""
    if not max(ks):
        return [[] for _ in ks]
    top_k_index = torch.topk(scores, max(ks), sorted=True, dim=-1).indices
    return [sorted(top_k_index[head, :budget].tolist()) for head, budget in enumerate(ks)]


@pytest.mark.parametrize("ties", ["earlier", "topk"])
def test_every_rows_top_at_once_is_each_rows_top(ties):
    """``Conventions.top_mask`` and ``positions`` pick for all rows at once what ``Conventions.top`` picks row by row
    (under ``topk``, where rows keep unequal counts, what kvpress's CriticalAdaKVPress marks), ties included (scores
    rounded to a few values, so ties at the cut are common), k from 0 to every entry."""
    from pcs.eviction.conventions import Conventions
    from pcs.eviction.scores import positions
    from pcs.upload import upload
    conventions = Conventions(ties=ties)
    g = torch.Generator().manual_seed(3)
    scores = (torch.rand(5, 300, generator=g) * 6).floor()
    scores[1, :40] = float("-inf")
    for ks in ([0, 1, 7, 150, 300], [64] * 5, [299, 3, 0, 260, 100], [0] * 5):
        got = [x.tolist() for x in positions(conventions.top_mask(scores, upload(ks, scores.device), ks), ks)]
        if ties == "topk" and len(set(ks)) > 1:
            assert got == kvpress_heads_top(scores, ks)
        else:
            assert got == [conventions.top(row, k).tolist() for row, k in zip(scores, ks)]


def test_a_tie_at_the_cut_under_torch_topks_rule_is_scored_in_full(rows_together, monkeypatch):
    """Stage-2 scores with few distinct values (values repeated, attention on a few levels): under ``ties=topk``,
    whose choice among tied entries depends on every entry, the rows with a tie at their cut are scored over
    every entry, and the bounded stage 2 keeps what the exhaustive one keeps."""
    g = torch.Generator().manual_seed(21)
    n_kv, group, m, d, hidden = 3, 2, 600, 8, 24
    values = torch.randn(n_kv, 5, d, generator=g)[:, torch.randint(0, 5, (m,), generator=g)]   # 5 distinct values
    mean = (torch.randint(1, 4, (n_kv * group, m), generator=g).float() / m)                   # 3 attention levels
    ws = WindowScores(mean, mean, mean.view(n_kv, group, m).mean(1), values,
                      torch.randn(hidden, n_kv * group * d, generator=g), conventions=Conventions(ties="topk"))
    search = dataclasses.replace(defaults().stage2, search="bounded")
    scored_in_full = []
    every_entry = Stage2.score_every_entry
    monkeypatch.setattr(Stage2, "score_every_entry",
                        lambda self, rows, scores, work: (scored_in_full.extend(rows),
                                                          every_entry(self, rows, scores, work)))
    selection = PerturbationSelection()
    for budgets in ([100, 100, 100], [40, 250, 7]):
        fast = selection.select(budgets, ws, stage2=Stage2Run(search))
        plain = selection.select(budgets, ws, exhaustive=True)
        assert [f.tolist() for f in fast] == [p.tolist() for p in plain]
    assert scored_in_full                  # the path ran


# Operations one layer's compression dispatches under an accelerator's plan, at most (pcs.bench.instrument's
# CompressionOps: on a GPU each is a kernel launch or a copy the host issues). On long_layer's shapes: 105-201 with
# perturbation selection across the profiles and methods (how many of stage 2's rounds a layer needs depends on its
# scores), 19-43 with attention selection.
MOST_OPS_ON_ACCELERATORS = 220


@pytest.mark.parametrize("profile", PROFILES)
def test_one_layers_compression_dispatches_a_bounded_number_of_operations_on_accelerators(profile, monkeypatch):
    """With the rows batched and the products sized as on an accelerator (forced here on the CPU), one layer's
    compression dispatches at most MOST_OPS_ON_ACCELERATORS operations at 600, 6,000 and 30,000 tokens (no loop over
    chunks of entries, nothing per entry or per head), attention selection at most 50 (AdaKV's allocation has branches
    that depend on the scores)."""
    from pcs.bench.instrument import CompressionOps
    import pcs.eviction.scores as scores_module
    monkeypatch.setattr(scores_module, "batches_rows", lambda device: True)

    def ops(method, n):
        layer = long_layer(4, n=n)
        method.keep(layer, bounded())          # the layer's output projection, computed once per weight
        with CompressionOps(method) as counted:
            counted.method.keep(layer, bounded())      # the search with the most operations
        assert counted.layers == 1
        return counted.ops

    for method in every_method(profile, "pool_then_mean"):
        counts = [ops(method, n) for n in (600, 6000, 30000)]
        assert max(counts) <= MOST_OPS_ON_ACCELERATORS, (profile, method, counts)
    for name in ("snapkv", "adakv"):
        method = build_method(compose_cfg(f"method={name}", "selection=attention", f"profile={profile}", "budget=120"))
        counts = [ops(method, n) for n in (600, 6000, 30000)]
        assert 0 < min(counts) and max(counts) <= 50, (profile, name, counts)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("gqa", ["pool_then_mean", "per_query_head"])
@pytest.mark.parametrize("pad", [None, torch.tensor([0, 137])])
def test_scoring_every_entry_on_accelerators_keeps_the_bounded_searchs_entries_in_few_operations(profile, gqa, pad,
                                                                                                 monkeypatch):
    """engine.stage2.search=exhaustive (forced here on the CPU with an accelerator's plan): every method keeps what the
    bounded search keeps, counts every live entry as scored, never reads the device in stage 2, and dispatches far
    fewer operations than the bounded search."""
    from pcs.bench.instrument import CompressionOps
    import pcs.eviction.scores as scores_module
    monkeypatch.setattr(scores_module, "batches_rows", lambda device: True)

    def kept_and_ops(method, layer, stage2):
        method.keep(layer, bounded())
        with CompressionOps(method) as counted:
            kept = counted.method.keep(layer, stage2)
        return [k.tolist() for k in kept], counted.ops

    for bounded_method, every in zip(every_method(profile, gqa), every_method(profile, gqa)):
        kept, ops = kept_and_ops(bounded_method, long_layer(3, n=3000, pad=pad), bounded())
        work = Stage2Work()
        reads = work.host_reads
        kept_every, ops_every = kept_and_ops(every, long_layer(3, n=3000, pad=pad), bounded(work, "exhaustive"))
        assert kept_every == kept and ops_every < ops / 2, (ops_every, ops)
        assert work.host_reads == reads and work.exact == work.entries > 0


def test_stage2_search_auto_scores_every_entry_in_short_layers_and_bounds_long_ones(monkeypatch):
    """engine.stage2.search=auto (the default) with an accelerator's plan, forced on the CPU: layers of fewer than
    exhaustive_below entries have every entry scored without a read of the device in stage 2, longer ones the
    bounded search (some entries left unscored, the device read); a CPU's plan bounds whatever the length."""
    import pcs.eviction.scores as scores_module
    assert defaults().stage2.search == "auto"

    def work(n, accelerator):
        monkeypatch.setattr(scores_module, "batches_rows", lambda device: accelerator)
        method = build_method(compose_cfg("method=snapkv", "selection=perturbation", "budget=128"))
        stage2 = bounded(search="auto", exhaustive_below=2000)      # the rule at 2,000 entries, on layers a CPU
        method.keep(long_layer(3, n=n), stage2)                     # runs quickly
        return stage2.work

    short, long = work(1999, True), work(2000, True)
    assert short.exact == short.entries > 0 and short.host_reads == 0
    assert 0 < long.exact < long.entries and long.host_reads >= 1
    on_cpu = work(1999, False)
    assert 0 < on_cpu.exact < on_cpu.entries and on_cpu.host_reads >= 1


@pytest.mark.parametrize("loose, evidence", [(True, 1), (False, 1), (True, 2)])
def test_stage2_search_auto_scores_every_entry_once_the_runs_bounds_prove_loose(loose, evidence, monkeypatch):
    """engine.stage2.search=auto with an accelerator's plan, forced on the CPU, in layers long enough to be bounded:
    a prompt whose bounded layers so far, at least loose_after of them, scored more than loose_share of their
    entries exactly scores every entry of its next layer, without a read of the device, and keeps what the bounded
    search keeps; at or below the share, or with fewer bounded layers, it keeps bounding. The share is set just
    below or at the first layer's own, so the test reads the rule, not how loose these random layers' bounds
    happen to be."""
    import pcs.eviction.scores as scores_module
    monkeypatch.setattr(scores_module, "batches_rows", lambda device: True)
    first, second = long_layer(3, n=3000), long_layer(4, n=3000)

    def method():
        return build_method(compose_cfg("method=snapkv", "selection=perturbation", "budget=128"))

    reference = method()
    reference.keep(first, bounded())
    expected = [k.tolist() for k in reference.keep(second, bounded())]

    run, work = method(), Stage2Work()
    auto = dataclasses.replace(defaults().stage2, search="auto", exhaustive_below=2000, loose_after=evidence)
    run.keep(first, Stage2Run(auto, work))
    share, reads, entries = work.bounded_share, work.host_reads, work.entries
    assert 0 < share < 1 and work.every_entry == 0 and reads >= 1
    auto = dataclasses.replace(auto, loose_share=share * (1 - 1e-6) if loose else share)
    assert [k.tolist() for k in run.keep(second, Stage2Run(auto, work))] == expected
    if loose and evidence == 1:
        assert work.every_entry == work.entries - entries > 0 and work.host_reads == reads
        assert work.bounded_share == share and 0 < work.every_entry_share < 1 and work.every_entry_layers == 1
    else:           # the second layer bounded too: the device read again, both layers counted as bounded
        assert work.every_entry == 0 and work.host_reads > reads and work.layers - work.every_entry_layers == 2


def test_a_prompts_search_and_kept_entries_do_not_depend_on_the_prompts_before_it(monkeypatch):
    """One prompt compressed on its own, after a prompt whose bounds prove loose, and after a prompt whose bounds
    stay tight, by the same method objects in one process, under ``auto`` with an accelerator's plan (forced on
    the CPU) and a loose-bounds rule that the first layers can trigger: the same entries, and the same stage-2 work
    (exact norms, bounds, device reads, layers scored in full), whatever came before."""
    from conftest import tiny_model
    from pcs.cache import CompressedCache
    from pcs.compression import compress_each_after_prefill
    import pcs.eviction.scores as scores_module
    monkeypatch.setattr(scores_module, "batches_rows", lambda device: True)
    model = tiny_model("llama")
    options = defaults().with_(stage2_search="auto", stage2_exhaustive_below=64, stage2_loose_after=1,
                               stage2_loose_share=0.3)
    methods = [build_method(compose_cfg(f"method={m}", "selection=perturbation", "budget=48", "method.window=8"))
               for m in ("snapkv", "adakv")]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (1, 400), generator=g)
    predecessors = {"loose": torch.randint(0, 4, (1, 500), generator=g),      # few distinct tokens: flat scores
                    "tight": torch.randint(0, 256, (1, 300), generator=g)}

    def compressed(method, ids):     # one method alone: a group shares every entry's norms and searches nothing
        cache = CompressedCache.of(model.config)
        with torch.no_grad(), compress_each_after_prefill(model, [method], [cache], options) as (cell,):
            model(input_ids=ids, past_key_values=cache)
        kept = [[x.tolist() if torch.is_tensor(x) else x for x in layer.held()] for layer in cache.layers]
        return kept, dataclasses.asdict(cell.stats.stage2)

    for method in methods:
        alone = compressed(method, prompt)
        assert alone[1]["layers"] > 0 and 0 < alone[1]["every_entry_layers"] < alone[1]["layers"]
        for name, before in predecessors.items():
            compressed(method, before)
            assert compressed(method, prompt) == alone, name
