"""CAKE (``pcs.eviction.cake``) against a transcription of the DefensiveKV authors' code, FFY0/DefensiveKV at 9251b95:
``kvpress/presses/cake_global_press.py`` (the window attention, lines 41-80; each layer's scores and preference,
lines 82-125) and ``kvpress/presses/cake_scorer_press.py`` (the layer budgets, ``compress`` lines 181-196 and
``adjust_budgets`` lines 42-88; one layer's cut, ``layer_compress`` lines 91-134). The transcription keeps the code's
batch axis, numpy budgets and order of operations; it reads nothing from pcs. pcs must keep the same entries on random
layers and on the embedded model's layers of a real prompt."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pcs.config import compose
from pcs.validation import validate
from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.eviction.base import LayerState
from pcs.eviction.cake import layer_budgets
from pcs.eviction.conventions import kvpress_ratio

from conftest import embedded_essay_layers


# ---- the transcription (FFY0/DefensiveKV @ 9251b95) ----

def reference_attention(queries, keys, w):
    """``compute_window_attention`` lines 41-80 from queries already rotated: q k / sqrt(d) over the group's KV head,
    the window's causal mask (lines 74-76), a float32 softmax (line 77), the window's columns dropped (line 78)."""
    b, h, _, d = queries.shape
    n_kv, n = keys.shape[1], keys.shape[2]
    repeated = keys[:, :, None].expand(b, n_kv, h // n_kv, n, d).reshape(b, h, n, d)
    attn = queries @ repeated.transpose(2, 3) / math.sqrt(d)
    attn += torch.triu(torch.ones_like(attn) * float("-inf"), diagonal=n - w + 1)
    return F.softmax(attn, dim=-1, dtype=torch.float32).to(queries.dtype)[..., :-w]


def reference_score(queries, keys, w=32, gamma=200.0, tau1=1.6, tau2=0.6):
    """``CakeGlobalPress.score`` lines 112-125: the preference (entropy and variance, lines 112-114) and the scores
    (mean + gamma x var over the window, average-pooled by 5 counting the padding, the group mean)."""
    attn = reference_attention(queries, keys, w)
    b, h, _, m = attn.shape
    n_kv = keys.shape[1]
    window = attn[:, :, -w:, :]
    disp = -torch.sum(window.to(torch.float32) * torch.log(window.to(torch.float32) + 1e-10))
    var = torch.var(window, dim=-2).sum(0).sum(0).sum(0)
    preference = (disp ** (1 / tau1) * var ** (1 / tau2)).cpu().numpy()
    scores = window.mean(dim=-2) + gamma * window.var(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=5, padding=2, stride=1)
    return scores.reshape(b, n_kv, h // n_kv, -1).mean(dim=-2), preference


def reference_adjust_budgets(budget_list, total_budget, seq_len):
    """``CakeScorerPress.adjust_budgets`` lines 42-88, in numpy as there."""
    budget_list = np.array(budget_list, dtype=int)
    excess = np.maximum(budget_list - seq_len, 0)
    budget_list = np.minimum(budget_list, seq_len)
    if np.sum(excess) > 0:
        valid = budget_list < seq_len
        if np.sum(valid) > 0:
            budget_list[valid] += np.sum(excess) // np.sum(valid)
            budget_list[np.where(valid)[0][:np.sum(excess) % np.sum(valid)]] += 1
    diff = total_budget - np.sum(budget_list)
    if diff != 0:
        valid = budget_list < seq_len if diff > 0 else budget_list > 1
        count = np.sum(valid)
        if count > 0:
            sign = 1 if diff > 0 else -1
            budget_list[valid] += sign * (abs(diff) // count)
            budget_list[np.where(valid)[0][:abs(diff) % count]] += sign
    return budget_list.tolist()


def reference_kept(layers, n, compression_ratio, w=32):
    """``CakeScorerPress.compress`` lines 181-196 and ``layer_compress`` lines 116-128: the layers' budgets from their
    preferences, each layer's top-k per KV head of the prefix, then its window; kept positions per layer and head."""
    scored = [reference_score(queries[None], keys[None], w) for queries, keys in layers]
    n_kept = int((n * (1 - compression_ratio) - w) * len(layers))
    preferences = [p for _, p in scored]
    budgets = reference_adjust_budgets([p / sum(preferences) * n_kept for p in preferences], n_kept, n - w)
    kept = []
    for (hh, _), budget in zip(scored, budgets):
        budget = min(int(budget), n - w, hh.shape[-1])
        top = hh.topk(budget, dim=-1).indices[0]
        kept.append([sorted(row.tolist()) + list(range(n - w, n)) for row in top])
    return kept, budgets


# ---- pcs against it ----

def cake(budget, *overrides):
    """CAKE as the code keeps it: kvpress's conventions (torch.topk's ties), whose selection is attention."""
    return build_method(compose(["method=cake", f"budget={budget}", "profile=kvpress", *overrides]))


def chosen(method, states, n):
    picked = method.choose({s.layer_idx: method.score(s) for s in states}, n)
    return [[row.tolist() for row in picked[s.layer_idx]] for s in states]


def random_layers(n=300, count=4, h_kv=2, h_q=6, d=16):
    """Layers whose window attends more sharply the deeper they are, so that their preferences differ."""
    states = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        keys = torch.randn(h_kv, n, d, generator=g)
        keys[:, torch.randperm(n, generator=g)[:20]] *= 3
        queries = torch.randn(h_q, 32, d, generator=g) * (0.3 + 0.6 * i)
        states.append(LayerState(i, count, keys, torch.randn(h_kv, n, d, generator=g), queries,
                                 torch.randn(48, h_q * d, generator=g)))
    return states


@pytest.mark.parametrize("budget", [40, 64, 120, 0.2])
def test_cake_keeps_the_entries_of_the_authors_code_on_random_layers(budget):
    states, n = random_layers(), 300
    ratio = 1 - budget if isinstance(budget, float) else kvpress_ratio(budget, n)
    want, budgets = reference_kept([(s.window_queries, s.keys) for s in states], n, ratio)
    assert chosen(cake(budget), states, n) == want
    assert len(set(budgets)) > 1                                # the layers' preferences split the budget unevenly


def test_a_layers_scores_and_preference_are_the_codes():
    state = random_layers(count=1)[0]
    hh, preference = reference_score(state.window_queries[None], state.keys[None])
    got = cake(64).score(state)
    torch.testing.assert_close(got.scores, hh[0], rtol=1e-6, atol=0)
    assert got.preference.dtype == torch.float32 and math.isclose(float(got.preference), float(preference), rel_tol=1e-6)


@pytest.mark.parametrize("shares, total, cap, want", [
    # ``adjust_budgets`` run as the repository has it, on these inputs
    ([10.9, 10.9, 10.2], 32, 100, [11, 11, 10]),
    ([900.7, 10.2, 10.1, 10.0], 931, 300, [300, 211, 210, 210]),
    ([1000, 290, 5, 5], 1300, 300, [300, 524, 238, 238]),      # one pass: a layer handed the excess passes the cap
    ([50, 50, 0, 0], 100, 40, [40, 40, 10, 10]),
    ([0.4] * 5, 2, 10, [1, 1, 0, 0, 0]),
    ([3, 3, 3], 6, 10, [2, 2, 2]),                              # above the total: taken back from layers above 1
])
def test_layer_budgets_are_adjust_budgets(shares, total, cap, want):
    assert layer_budgets(shares, total, cap) == want == reference_adjust_budgets(shares, total, cap)


def test_layer_budgets_equal_adjust_budgets_on_random_shares():
    g = np.random.default_rng(0)
    for _ in range(500):
        layers, cap = int(g.integers(2, 10)), int(g.integers(5, 400))
        total = int(g.integers(0, layers * cap))
        shares = (g.lognormal(size=layers) / g.lognormal(size=layers).sum() * total * g.uniform(0.5, 1.5)).tolist()
        assert layer_budgets(shares, total, cap) == reference_adjust_budgets(shares, total, cap)


def test_perturbation_selection_over_cake_fills_each_layers_count_by_the_papers_two_stages():
    """CAKE's preferences give each layer its count; under ``selection=perturbation`` every KV head fills it by the
    paper's two stages (stage 1 by CAKE's score, stage 2 by the score times the mean over the head's query heads of
    ``||v W^O_g||_1``), the window on top; ``selection=attention`` is CAKE as published."""
    states, n = random_layers(), 300
    for s in states:        # value norms spread over two orders of magnitude, so that stage 1 keeps what stage 2 would not
        s.values *= torch.exp(2 * torch.randn(1, n, 1, generator=torch.Generator().manual_seed(s.layer_idx)))
    attention = cake(64, "selection=attention")
    perturbation = build_method(compose(["method=cake", "budget=64", "selection=perturbation"]))   # the paper's
    assert perturbation.choice_reads_layers and not attention.choice_reads_layers
    scored = {s.layer_idx: attention.score(s) for s in states}
    plain = attention.choose(scored, n)
    two = perturbation.choose(scored, n, {s.layer_idx: s for s in states})
    stage_one_decides = []
    for s in states:
        count = len(plain[s.layer_idx][0]) - 32
        values, o_proj, scores = s.values[:, :n - 32], s.o_proj_weight, scored[s.layer_idx].scores
        group = o_proj.shape[1] // values.shape[-1] // values.shape[0]
        for h, got in enumerate(two[s.layer_idx]):
            norms = torch.stack([(values[h] @ o_proj[:, g * 16:(g + 1) * 16].T).abs().sum(-1)
                                 for g in range(h * group, (h + 1) * group)]).mean(0)
            first = scores[h].topk(int(0.25 * count)).indices.tolist()
            second = (scores[h] * norms).index_fill(0, torch.tensor(first, dtype=torch.long), -1).topk(
                count - len(first)).indices.tolist()
            assert got.tolist() == sorted(first + second) + list(range(n - 32, n))
            by_norm_alone = sorted((scores[h] * norms).topk(count).indices.tolist()) + list(range(n - 32, n))
            stage_one_decides.append(got.tolist() != by_norm_alone)
    assert any(stage_one_decides)
    assert any(a.tolist() != b.tolist() for s in states for a, b in zip(plain[s.layer_idx], two[s.layer_idx]))


def test_cake_in_a_shared_prefill_answers_as_in_its_own():
    """CAKE under both selections beside SnapKV, prefilled once on a hybrid model: each answers as its own prefill."""
    from pcs.generate import greedy_generate, greedy_generate_each
    from conftest import tiny_model
    model = tiny_model("gemma3")
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(1))
    methods = [build_method(compose(o)) for o in (["method=cake", "budget=20", "method.window=4", "selection=attention"],
                                                  ["method=cake", "budget=0.4", "method.window=4"],
                                                  ["method=snapkv", "budget=20", "method.window=4"])]
    for method, got in zip(methods, greedy_generate_each(model, ids, methods, 8, set())):
        assert got.token_ids == greedy_generate(model, ids, method, 8, set()).token_ids


def test_cake_keeps_the_entries_of_the_authors_code_on_the_embedded_models_layers(embedded_dir):
    """The embedded SmolLM2 (30 layers, 3 KV heads of 3 query heads) on 600 tokens of an essay, at 0.2 of it, chosen
    from the layers a prefill hands a method and in a prefill of its own."""
    from pcs.output_perturbation import run_prefill
    model, ids, states = embedded_essay_layers(embedded_dir)
    with torch.inference_mode():
        want, budgets = reference_kept([(s.window_queries, s.keys) for s in states], 600, 1 - 0.2)
        got = chosen(cake(0.2), states, 600)
        through_a_prefill = run_prefill(model, ids, {"c": cake(0.2)}).kept["c"]
    assert len(states) == 30 and got == want and len(set(budgets)) > 10
    assert [[row.tolist() for row in layer] for layer in through_a_prefill] == want


@pytest.mark.parametrize("overrides, message", [
    (["method.window=0"], "method.window=0"),
    (["budget=16"], "cannot hold the observation window"),
    (["compress.trigger=300", "budget=64"], "chooses from a prefill only"),
    (["method.tau1=-1"], "method.tau1"),
])
def test_a_cake_config_without_meaning_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(["method=cake", *overrides]))
