"""The scorers of ``pcs.eviction.scorers`` (kvpress 0.5.5's KNorm, KeyDiff, TOVA, Expected Attention, observed
attention, LagKV and CUR presses) and the methods over
them: each score against a brute-force reading of its press's ``score`` (file and line cited per test), the kept
entries against kvpress's selections written out (``ScorerPress.compress``, ``AdaKVPress.compress``,
``CriticalKVPress.score``), pooled decoding against batch 1, and the configs that cannot mean anything refused
before a model loads."""
import math
import statistics
import subprocess
import sys
import time

import pytest
import torch

from pcs.config import compose
from pcs.validation import validate
from pcs.errors import ConfigError
from pcs.eviction import build_method, scorers
from pcs.eviction.base import LayerState

from conftest import tiny_model


def random_layer(seed, h_kv=2, h_q=6, n=60, d=8, hidden=24, window=1):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d, generator=g)
    keys[:, ::7] *= 3          # norms and directions far apart, so that no two scores tie
    queries = torch.randn(h_q, window, d, generator=g) * 2
    return LayerState(0, 1, keys, values, queries, torch.randn(hidden, h_q * d, generator=g))


def test_knorm_is_minus_each_keys_norm():
    """kvpress 0.5.5 presses/knorm_press.py lines 45-46: -||k||_2 per entry, in float32."""
    layer = random_layer(0)
    want = torch.tensor([[-math.sqrt(sum(float(x) ** 2 for x in k)) for k in head] for head in layer.keys])
    torch.testing.assert_close(scorers.knorm(layer), want, rtol=1e-6, atol=1e-6)


def test_keydiff_is_minus_the_cosine_to_the_mean_unit_key():
    """kvpress 0.5.5 presses/keydiff_press.py lines 36-46: the anchor is the mean of the unit keys, not
    renormalised; the score minus each key's cosine similarity to it."""
    layer = random_layer(1)
    for head, got in zip(layer.keys, scorers.keydiff(layer)):
        units = [k / k.norm() for k in head]
        anchor = sum(units) / len(units)
        want = [-float(k @ anchor) / (float(k.norm()) * float(anchor.norm())) for k in head]
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_tova_is_the_newest_querys_attention_averaged_over_every_query_head():
    """kvpress 0.5.5 presses/tova_press.py lines 35-61: softmax(q k / sqrt(d)) of the newest query over every
    entry, the newest dropped, the mean over all query heads, the same for every KV head; the newest entry scores
    the maximum plus one."""
    layer = random_layer(2)
    h_q, _, d = layer.window_queries.shape
    h_kv, n, _ = layer.keys.shape
    rows = []
    for h in range(h_q):
        logits = [float(layer.window_queries[h, -1] @ k) / math.sqrt(d) for k in layer.keys[h // (h_q // h_kv)]]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        rows.append([w / sum(weights) for w in weights[:-1]])
    mean = [sum(r[j] for r in rows) / h_q for j in range(n - 1)]
    want = torch.tensor(mean + [max(mean) + 1]).expand(h_kv, n)
    torch.testing.assert_close(scorers.tova(layer), want, rtol=1e-5, atol=1e-7)


def lagkv_by_hand(layer, sinks=4, lag=128):
    """kvpress 0.5.5 presses/lagkv_press.py lines 45-97, one entry at a time in float64: after the sinks, whole
    partitions of ``lag``; in each but the last, every key's (and value's) features scaled by the next partition's
    per-feature min and max, their sample standard deviation softmaxed over the partition, keys' and values' averaged,
    and the entry's rank in its partition (0 the lowest) over ``lag``; sinks and the rest score 1."""
    h, n, _ = layer.keys.shape
    parts = (n - sinks) // lag
    rows = []
    for head in range(h):
        row = [1.0] * sinks
        for p in range(parts - 1):
            start = sinks + p * lag
            softmaxed = []
            for states in (layer.keys[head].double(), layer.values[head].double()):
                reference = states[start + lag:start + 2 * lag]
                low, high = reference.min(dim=0).values, reference.max(dim=0).values
                spread = [statistics.stdev(((states[start + i] - low) / (high - low)).tolist()) for i in range(lag)]
                weights = [math.exp(x - max(spread)) for x in spread]
                softmaxed.append([w / sum(weights) for w in weights])
            score = [(a + b) / 2 for a, b in zip(*softmaxed)]
            rank = {i: r for r, i in enumerate(sorted(range(lag), key=score.__getitem__))}
            row += [rank[i] / lag for i in range(lag)]
        rows.append(row + [1.0] * (n - len(row)))
    return torch.tensor(rows, dtype=torch.float64)


def test_lagkv_ranks_each_entry_against_the_next_partitions_range():
    """600 entries: 4 sinks, partitions at 4, 132, 260 and 388 (the last, 388-515, and the 84 after it score 1)."""
    layer = random_layer(7, n=600)
    scores = scorers.lagkv(layer)
    assert scores.dtype == layer.keys.dtype
    assert torch.equal(scores.double(), lagkv_by_hand(layer))
    assert (scores[:, 388:] == 1).all() and (scores[:, 4:388] < 1).all()


def test_lagkv_on_a_sequence_shorter_than_two_partitions_keeps_its_sinks_then_its_newest_entries():
    """kvpress 0.5.5 presses/lagkv_press.py lines 56-63: below 4 + 2 x 128 entries the sinks score 1 and the others
    ``i / (n - 4)`` in order."""
    layer = random_layer(8, n=259)
    want = torch.cat([torch.ones(4), torch.arange(255) / 255]).expand(2, -1)
    assert torch.equal(scorers.lagkv(layer), want)


def test_cur_is_the_product_of_local_key_and_value_leverages_normalised():
    """kvpress 0.5.5 presses/cur_press.py lines 34-67 with its defaults, one entry at a time in float64: each squared
    key norm over its block of 16's sum (the 70 entries' last block holds 6), likewise the values', their product over
    the head's sum, the first 4 entries at 1."""
    layer = random_layer(9, n=70)
    rows = []
    for keys, values in zip(layer.keys.double(), layer.values.double()):
        def local(squares):
            return [x / sum(squares[i // 16 * 16:i // 16 * 16 + 16]) for i, x in enumerate(squares)]
        product = [a * b for a, b in zip(local((keys ** 2).sum(-1).tolist()), local((values ** 2).sum(-1).tolist()))]
        rows.append([1.0] * 4 + [x / sum(product) for x in product[4:]])
    torch.testing.assert_close(scorers.cur(layer).double(), torch.tensor(rows, dtype=torch.float64), rtol=1e-5, atol=0)


def test_a_positional_scorer_scores_a_padded_head_on_its_own_entries():
    """Decoding-time compression pads heads at the front: LagKV and CUR, which read entries by their place, score
    each head as if its entries were alone (the padding never kept), and a position-free scorer needs no such care."""
    from pcs.eviction.window import each_head_unpadded
    layer = random_layer(10, n=300)
    layer.pad = torch.tensor([0, 37])
    for name in ("lagkv", "cur"):
        score = getattr(scorers, name)
        padded = each_head_unpadded(score)(layer)
        alone = score(LayerState(0, 1, layer.keys[1:, 37:], layer.values[1:, 37:], layer.window_queries,
                                 layer.o_proj_weight))
        assert torch.equal(padded[1, 37:], alone[0]) and torch.isinf(padded[1, :37]).all()
        assert torch.equal(padded[0], score(LayerState(0, 1, layer.keys[:1], layer.values[:1], layer.window_queries,
                                                       layer.o_proj_weight))[0])
        assert not torch.equal(padded[1, 37:], score(layer)[1, 37:])     # the padding would have moved its scores
        kept = build_method(compose([f"method={name}", "budget=40", "selection=attention"])).keep(layer)
        first = sorted(range(len(alone[0])), key=lambda p: (-float(alone[0, p]), p))[:40]   # the earlier among equals
        assert kept[1].tolist() == [37 + p for p in sorted(first)] and len(kept[0]) == 40


class RandomPrompt:
    """A prompt's queries for a random layer (``pcs.compression.PromptQueries``' interface), rotated by the standard
    rotary embedding at base 10,000: each pair of dimensions (i, i + d/2) turned by position x 10000^(-2i/d)."""

    def __init__(self, unrotated):
        self.unrotated, self.n_tokens = unrotated, unrotated.shape[1]
        cos, sin = self.rotation(torch.arange(self.n_tokens))
        half = unrotated.shape[-1] // 2
        turned = torch.cat([-unrotated[..., half:], unrotated[..., :half]], dim=-1)
        self.rotated = unrotated * cos + turned * sin

    def rotation(self, positions):
        d = self.unrotated.shape[-1]
        angles = positions[:, None].double() * 10000.0 ** (-torch.arange(0, d, 2).double() / d)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().float(), angles.sin().float()


def prompt_layer(seed, h_kv=2, h_q=6, n=40, d=8):
    """A random layer whose keys are its prompt's own (the prompt's rotated queries, another projection)."""
    layer = random_layer(seed, h_kv, h_q, n, d)
    g = torch.Generator().manual_seed(seed + 100)
    layer.prompt = RandomPrompt(torch.randn(h_q, n, d, generator=g) + torch.randn(h_q, 1, d, generator=g))
    return layer


@pytest.mark.parametrize("epsilon", [0.0, 1e-2])
def test_expected_attention_is_the_expected_attention_of_a_gaussian_future_query_times_the_value_norm(epsilon):
    """kvpress 0.5.5 presses/expected_attention_press.py: the mean and (biased) covariance of the queries after the
    first 4 (lines 62-86), rotated by the mean of the next 512 positions' rotary matrices (lines 88-124; built here
    from the rotation of each pair of dimensions, not from kvpress's matrix formula), then per query head
    exp(mu k / sqrt(d) + k Sigma k / 2d) normalised over the entries after the sinks, the group's mean, plus
    epsilon (line 160; kvpress's leaderboard: 1e-2), times ||v||, the sinks at the maximum plus one (lines 126-165).
    In float64."""
    layer = prompt_layer(6)
    q = layer.prompt.unrotated[:, 4:].double()
    h_q, s, d = q.shape
    h_kv, n, _ = layer.keys.shape
    mean = q.mean(dim=1)
    cov = torch.stack([sum(torch.outer(x - mean[h], x - mean[h]) for x in q[h]) / s for h in range(h_q)])
    rotation = torch.zeros(d, d, dtype=torch.float64)
    for t in range(n, n + 512):
        for i in range(d // 2):
            angle = t * 10000.0 ** (-2 * i / d)
            c, si = math.cos(angle), math.sin(angle)
            rotation[i, i] += c / 512
            rotation[i + d // 2, i + d // 2] += c / 512
            rotation[i, i + d // 2] += -si / 512
            rotation[i + d // 2, i] += si / 512
    mean, cov = mean @ rotation.T, rotation @ cov @ rotation.T
    keys, values = layer.keys[:, 4:].double(), layer.values[:, 4:].double()
    group = h_q // h_kv
    want = torch.zeros(h_kv, n - 4, dtype=torch.float64)
    for h in range(h_q):
        k = keys[h // group]
        logits = torch.tensor([float(mean[h] @ kj) / math.sqrt(d) + float(kj @ cov[h] @ kj) / (2 * d) for kj in k])
        want[h // group] += torch.softmax(logits.double(), dim=0) / group
    want = (want + epsilon) * values.norm(dim=-1)
    want = torch.cat([torch.full((h_kv, 4), float(want.max()) + 1, dtype=torch.float64), want], dim=1)
    torch.testing.assert_close(scorers.expected_attention(layer, epsilon).double(), want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("head_bytes", [scorers.OBSERVED_HEAD_BYTES, 40 * 4 * 6])
def test_observed_attention_is_each_entrys_mean_attention_over_the_queries_that_see_it(head_bytes):
    """kvpress 0.5.5 presses/observed_attention_press.py lines 45-49: the prefill's attention weights summed over
    the queries, divided by the number of queries that see each entry (n - j), the group's mean. Brute force over
    the causal attention of every prompt query, in float64; a head's weights at once, and in blocks of queries
    (a cap of 6 rows of 40: blocks of one query, as the longest prompts are computed)."""
    layer = prompt_layer(7)
    q, keys = layer.prompt.rotated.double(), layer.keys.double()
    h_q, n, d = q.shape
    h_kv = keys.shape[0]
    group = h_q // h_kv
    want = torch.zeros(h_kv, n, dtype=torch.float64)
    for h in range(h_q):
        for i in range(n):
            weights = torch.softmax(keys[h // group, :i + 1] @ q[h, i] / math.sqrt(d), dim=0)
            want[h // group, :i + 1] += weights / torch.arange(n, n - i - 1, -1, dtype=torch.float64) / group
    torch.testing.assert_close(scorers.observed_attention(layer, head_bytes).double(), want, rtol=1e-5, atol=1e-7)


class Recording:
    """A method that keeps everything and records a scorer's scores of every layer its prefill passes."""
    window, model_wide, two_stage, evicts = 0, False, False, True

    def __init__(self, scorer):
        self.scorer, self.scores = scorer, {}

    def for_prompt(self, n_tokens):
        return self

    def keep(self, layer, stage2=None):
        self.scores[layer.layer_idx] = self.scorer(layer)
        return None


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_observed_attention_in_a_prefill_is_kvpresss_reading_of_the_eager_attention_weights(arch):
    """The prompt's queries a prefill hands a scorer (``PromptQueries``) are the model's own: observed attention
    computed from them equals kvpress's formula over the eager attention weights the model returns (the full-attention
    layers of a hybrid model), bit for bit where the model's scale is ``d^-1/2``."""
    from pcs.output_perturbation import run_prefill
    model = tiny_model(arch)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    recording = Recording(scorers.observed_attention)
    with torch.no_grad():
        run_prefill(model, ids, {"r": recording})
        weights = model(input_ids=ids, output_attentions=True).attentions
    assert recording.scores
    h_kv = model.config.num_key_value_heads
    for layer_idx, got in recording.scores.items():      # kvpress's lines 45-49 on the eager weights
        received = weights[layer_idx].sum(2) / torch.arange(48, 0, -1).to(weights[layer_idx].dtype)
        want = received.view(1, h_kv, -1, 48).mean(2)[0]
        if arch == "llama":
            assert torch.equal(got, want)
        else:       # the tiny Gemma's scale is not d^-1/2: its queries are rescaled, and round otherwise
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_expected_attention_in_a_prefill_reads_the_queries_before_rotary_and_the_layers_rotary(arch):
    """What a prefill hands Expected Attention: the queries before rotary are the module's projection (and query
    norm), and rotating them at the prompt's positions gives the queries the module attends with; the rotary at any
    position is the one the layer applies (a hybrid model's full-attention layers: their own base)."""
    from pcs.output_perturbation import run_prefill
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    prompts = {}
    recording = Recording(lambda layer: prompts.setdefault(layer.layer_idx, layer.prompt))
    with torch.no_grad():
        run_prefill(model, ids, {"r": recording})
        for layer_idx, prompt in prompts.items():
            attn = model.model.layers[layer_idx].self_attn
            scale = attn.scaling * math.sqrt(attn.head_dim)
            cos, sin = prompt.rotation(torch.arange(32))
            half = attn.head_dim // 2
            q = prompt.unrotated
            turned = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
            torch.testing.assert_close((q * cos + turned * sin) * scale, prompt.rotated, rtol=1e-5, atol=1e-6)
            layer_type = getattr(model.config, "layer_types", [None] * 99)[layer_idx]
            if layer_type is not None:
                assert layer_type == "full_attention"
            # Far past the prompt, the angles grow as the layer's at position 1 (checked above) times the position.
            cos1, sin1 = prompt.rotation(torch.arange(1, 2))
            angles = torch.arange(1000, 1003).double()[:, None] * torch.atan2(sin1[0].double(), cos1[0].double())
            far_cos, far_sin = prompt.rotation(torch.arange(1000, 1003))
            torch.testing.assert_close(far_cos.double(), angles.cos(), rtol=0, atol=1e-3)
            torch.testing.assert_close(far_sin.double(), angles.sin(), rtol=0, atol=1e-3)
    assert prompts


def method(*overrides):
    return build_method(compose(["profile=kvpress", *overrides]))     # its selection: attention


SCORED = ["knorm", "keydiff", "tova", "expected_attention", "observed_attention", "lagkv", "cur"]


@pytest.mark.parametrize("name,ties", [(name, False) for name in SCORED] + [("tova", True)])
def test_a_scorer_method_keeps_the_top_of_its_scores_per_head(name, ties):
    """kvpress 0.5.5 presses/scorer_press.py lines 94-101 (compression_ratio from the budget,
    ``conventions.kvpress_ratio``): each KV head keeps the ``budget`` entries its press's scores rank highest; with
    a repeated token, TOVA's one torch.topk over the row, its newest entry padded in, decides which copies stay
    (a top-k of the prefix alone, one fewer, keeps others at budget 28 for seed 0), and pcs's does the same."""
    layer, budget = (repeated(prompt_layer(0)), 28) if ties else (prompt_layer(3), 20)
    assert not ties or tie_at_cut(getattr(scorers, name)(layer)[:1], budget)
    kept = method(f"method={name}", f"budget={budget}").keep(layer)
    scores = getattr(scorers, name)(layer)
    for head, got in zip(scores, kept):
        assert got.tolist() == sorted(head.topk(budget).indices.tolist())
    assert all(layer.n_tokens - 1 in got.tolist() for got in kept) or name != "tova"


def test_a_windowed_cut_breaks_ties_in_the_row_or_in_the_prefix_as_its_profile_says():
    """TOVA (window: the newest entry) on a repeated token at budget 28 (seed 0), where the two cuts keep other
    copies: ``window_cut=in_row`` keeps what one torch.topk of ``budget`` over the row keeps (kvpress's
    ScorerPress.compress), ``apart`` what torch.topk of ``budget - 1`` over the prefix keeps beside the newest entry
    (KVCache-Factory's and official AdaKV's ``attn_cache.topk(max_capacity_prompt - window_size)``, their profiles'
    reading)."""
    layer, budget = repeated(prompt_layer(0)), 28
    scores = scorers.tova(layer)
    row = [sorted(head.topk(budget).indices.tolist()) for head in scores]
    prefix = [sorted(head[:-1].topk(budget - 1).indices.tolist() + [layer.n_tokens - 1]) for head in scores]
    assert row != prefix
    for cut, expected in (("in_row", row), ("apart", prefix)):
        got = method("method=tova", f"budget={budget}", f"profile.window_cut={cut}").keep(layer)
        assert [g.tolist() for g in got] == expected, cut
    assert [compose([f"profile={p}"]).profile.window_cut for p in ("kvpress", "kvcache_factory", "adakv")] == \
        ["in_row", "apart", "apart"]


def vwl1norm(layer):
    """kvpress 0.5.5 presses/criticalkv_press.py lines 58-77: per query head ||v W^O_h||_1, the group mean."""
    h_kv, n, d = layer.values.shape
    h_q = layer.o_proj_weight.shape[1] // d
    wo = layer.o_proj_weight.T.reshape(h_q, d, -1)
    norms = torch.stack([(layer.values[h // (h_q // h_kv)] @ wo[h]).abs().sum(-1) for h in range(h_q)])
    return norms.view(h_kv, h_q // h_kv, n).mean(1)


def repeated(layer):
    """The layer with a token repeated: entries 3, 8, 13, ... hold entry 1's key and value, so scores tie (at the
    cut of budget 20 for seed 0: there, stage 2's own top-k after stage 1 keeps other copies than kvpress's)."""
    layer.keys[:, 3::5], layer.values[:, 3::5] = layer.keys[:, 1:2], layer.values[:, 1:2]
    return layer


def tie_at_cut(scores: torch.Tensor, k: int) -> bool:
    """Whether the k-th and (k+1)-th largest of the flattened scores are equal: which copies stay is then up to the
    order in which a top-k meets them."""
    top = scores.flatten().topk(k + 1).values
    return bool(top[k - 1] == top[k])


# With a repeated token, budgets at which a tie falls at the cut (observed attention has none: each copy is seen
# by a different number of queries).
TIED_CRITICAL = {"knorm": 20, "keydiff": 32, "tova": 24, "expected_attention": 12}
# LagKV's ranks repeat in every partition of every head, so AdaKV's one cut over the layer falls inside a tie (on 400
# entries, past the 144 that score 1, each rank held by 8 entries: budget 199 prunes 804).
TIED_ADAKV = {"knorm": 12, "keydiff": 30, "expected_attention": 12, "lagkv": 199}


@pytest.mark.parametrize("name,ties", [(name, False) for name in SCORED] + [(name, True) for name in TIED_CRITICAL])
def test_criticalkv_over_a_scorer_keeps_what_criticalkvpress_keeps(name, ties):
    """kvpress 0.5.5 presses/criticalkv_press.py lines 79-97 with ScorerPress.compress: the top
    ``max(1, int(budget x 0.5))`` by the press's scores, then the rest of the budget by
    ``(score + 1e-4) x vwl1norm``; with a repeated token (ties at the cut) its one torch.topk over the row
    decides which copies stay, and pcs's does the same."""
    layer, budget = (repeated(prompt_layer(0)), TIED_CRITICAL[name]) if ties else (prompt_layer(4), 20)
    kept = method(f"method={name}", f"budget={budget}", "selection=perturbation_released").keep(layer)
    scores = getattr(scorers, name)(layer).clone()
    first = scores.topk(max(1, int(budget * 0.5)), dim=-1).indices
    scores = (scores + 1e-4) * vwl1norm(layer)
    scores.scatter_(-1, first, torch.finfo(scores.dtype).max)
    for head, got in zip(scores, kept):
        assert got.tolist() == sorted(head.topk(budget).indices.tolist())
    assert any(tie_at_cut(head, budget) for head in scores) == ties


@pytest.mark.parametrize("name,ties", [(name, False) for name in ["knorm", "keydiff", "expected_attention",
                                                                   "observed_attention", "cur"]]
                         + [(name, True) for name in TIED_ADAKV])
def test_adakv_over_a_scorer_keeps_what_adakvpress_keeps(name, ties):
    """kvpress 0.5.5 presses/adakv_press.py lines 54-81: the top ``max(1, int(budget x 0.2))`` of each head
    protected, the layer's lowest ``H_kv x (n - budget)`` entries pruned together (with a repeated token, its one
    bottom-k decides which copies go, and pcs's does the same)."""
    layer, budget = prompt_layer(5, h_kv=4, h_q=8, n=400 if name == "lagkv" else 40), (TIED_ADAKV[name] if ties else 20)
    if ties:
        layer = repeated(layer)
    kept = method("method=adakv", f"method.scorer={name}", "method.window=0", f"budget={budget}").keep(layer)
    scores = getattr(scorers, name)(layer).clone()
    h_kv, n = scores.shape
    top = scores.topk(max(1, int(budget * 0.2)), dim=-1).indices
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    assert tie_at_cut(-scores, h_kv * (n - budget)) == ties
    pruned = (-scores).reshape(-1).topk(h_kv * (n - budget)).indices
    held = torch.ones(h_kv * n, dtype=torch.bool)
    held[pruned] = False
    for head, got in zip(held.view(h_kv, n), kept):
        assert got.tolist() == head.nonzero().flatten().tolist()
    assert sum(len(got) for got in kept) == h_kv * budget and (ties or len({len(got) for got in kept}) > 1)


def test_adakv_over_expected_attention_with_an_epsilon_keeps_what_kvpresss_leaderboard_press_keeps():
    """kvpress's leaderboard runs ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`` (evaluation/evaluate_registry.py):
    ``method.scorer_epsilon`` reaches the scores, AdaKVPress's cut (lines 54-81) runs over them, and the epsilon
    changes what is kept on this layer (the knob is not inert)."""
    layer, budget = prompt_layer(5, h_kv=4, h_q=8), 20

    def adakvpress(scores):
        scores = scores.clone()
        h_kv, n = scores.shape
        scores.scatter_(-1, scores.topk(max(1, int(budget * 0.2)), dim=-1).indices, torch.finfo(scores.dtype).max)
        held = torch.ones(h_kv * n, dtype=torch.bool)
        held[(-scores).reshape(-1).topk(h_kv * (n - budget)).indices] = False
        return [head.nonzero().flatten().tolist() for head in held.view(h_kv, n)]

    kept = {}
    for epsilon in (0.0, 1.0):
        got = method("method=adakv", "method.scorer=expected_attention", "method.window=0",
                     f"method.scorer_epsilon={epsilon}", f"budget={budget}").keep(layer)
        kept[epsilon] = [g.tolist() for g in got]
        assert kept[epsilon] == adakvpress(scorers.expected_attention(layer, epsilon))
    assert kept[0.0] != kept[1.0]


def test_the_criticalkv_preset_gives_every_scorer_its_own_window():
    """``preset_press/criticalkv_snapkv.yaml`` sets SnapKVPress's window 64 over the window's attention and each
    scorer's own window over a scorer (``scorers.SCORERS``: none, TOVA's newest entry), for SnapKV, PyramidKV and
    AdaKV alike; a scorer added without its window there would fail to compose."""
    from pcs.config import group_file
    assert set(group_file("preset_press", "criticalkv_snapkv")._press_window_) == set(scorers.SCORERS)
    for method_name in ("snapkv", "pyramidkv", "adakv"):
        for name, scorer in scorers.SCORERS.items():
            cfg = compose(["preset=criticalkv", f"method={method_name}", f"method.scorer={name}"])
            assert cfg.method.window == (64 if name == "window_attention" else scorer.window or 0)


def kvpress_criticaladakv_kept(scores: torch.Tensor, norms: torch.Tensor, budget: int) -> list[list[int]]:
    """kvpress 0.5.5 presses/criticalkv_press.py lines 150-200 (``CriticalAdaKVPress.compress``, alpha_safeguard 0.2,
    first_stage_ratio 0.5, epsilon 1e-4), transcribed for one sequence: the kept positions per KV head."""
    largest = torch.finfo(scores.dtype).max
    scores, norms = scores.clone()[None], norms[None]
    bsz, h_kv, k_len = scores.shape
    top = torch.topk(scores, max(1, int(budget * 0.2)), dim=-1).indices
    scores.scatter_(-1, top, largest)
    budget_scores = scores.scatter(-1, top, largest).reshape(bsz, -1)
    heads = torch.topk(budget_scores, budget * h_kv, dim=-1).indices // k_len
    heads = heads.flatten()
    head_budgets = torch.zeros(h_kv, dtype=torch.int64).scatter_add_(0, heads, torch.ones_like(heads))
    first = (head_budgets * 0.5).to(torch.int64).tolist()
    order = torch.topk(scores, max(first), sorted=True, dim=-1).indices
    for h in range(h_kv):
        scores[:, h, :].scatter_(-1, order[:, h, :first[h]], largest)
    scores = (scores + 1e-4) * norms
    order = torch.topk(scores, max(head_budgets), sorted=True, dim=-1).indices
    for h in range(h_kv):
        scores[:, h, :].scatter_(-1, order[:, h, :head_budgets[h]], largest)
    pruned = torch.topk(-scores.reshape(bsz, -1), h_kv * (k_len - budget), dim=1).indices.flatten()
    held = torch.ones(h_kv * k_len, dtype=torch.bool)
    held[pruned] = False
    return [head.nonzero().flatten().tolist() for head in held.view(h_kv, k_len)]


# With a repeated token, budgets at which stage 2's own top-k after stage 1 (pcs before it replayed kvpress's
# safeguard, stage-1 and stage-2 top-k) keeps other copies than CriticalAdaKVPress.
TIED_CRITICAL_ADAKV = {"knorm": 12, "keydiff": 30, "tova": 22, "expected_attention": 22}


@pytest.mark.parametrize("name,ties", [(name, False) for name in SCORED]
                         + [(name, True) for name in TIED_CRITICAL_ADAKV])
def test_criticaladakv_over_a_scorer_keeps_what_criticaladakvpress_keeps(name, ties):
    """``preset=criticalkv method=adakv method.scorer=<scorer>``: no window but the scorer's own (CriticalAdaKVPress
    over the scorer's press has no SnapKVPress window), and the entries kvpress 0.5.5's CriticalAdaKVPress keeps, its
    safeguard's, stage 1's and stage 2's top-k each called as there, so that with a repeated token (ties at a cut)
    the same copies stay."""
    layer, budget = prompt_layer(5, h_kv=4, h_q=8), (TIED_CRITICAL_ADAKV[name] if ties else 20)
    if ties:
        layer = repeated(layer)
    cfg = compose(["preset=criticalkv", "method=adakv", f"method.scorer={name}", f"budget={budget}"])
    validate(cfg)
    assert cfg.method.window == (1 if name == "tova" else 0)
    kept = build_method(cfg).keep(layer)
    assert [got.tolist() for got in kept] == kvpress_criticaladakv_kept(getattr(scorers, name)(layer), vwl1norm(layer),
                                                                         budget)


def test_pooled_decoding_over_scorers_gives_batch_one_tokens():
    """Scorers under each allocation and selection, on a hybrid model and a full-attention one, in pools beside
    the window's attention: batch 1's tokens (``tests/test_pool.py``'s comparison)."""
    from oracles import compare, samples
    cells = [("method=knorm", "selection=attention"), ("method=keydiff", "selection=perturbation_released"),
             ("method=tova", "selection=perturbation"), ("method=adakv", "method.scorer=knorm", "method.window=0"),
             ("method=pyramidkv", "method.scorer=keydiff", "method.window=0", "selection=attention"),
             ("method=expected_attention", "selection=perturbation_released"),
             ("method=adakv", "method.scorer=observed_attention", "method.window=0"), ("method=snapkv",)]
    for arch in ("llama", "gemma3"):
        model = tiny_model(arch)
        differ, _, compared = compare(model, samples(model), cells, sizes=(3,))
        assert compared == 4 * len(cells) and differ == 0


def test_pooled_decoding_time_compression_over_positional_scorers_gives_batch_one_tokens():
    """LagKV and CUR recompressing while decoding (a trigger of 50), under AdaKV's uneven heads, so that pooled heads
    are padded at the front: each head scored on its own entries gives batch 1's tokens."""
    from oracles import compare, samples
    cells = [("method=lagkv", "selection=attention"), ("method=adakv", "method.scorer=lagkv", "method.window=0"),
             ("method=cur", "selection=perturbation"), ("method=adakv", "method.scorer=cur", "method.window=0")]
    model = tiny_model("llama")
    sample_list = samples(model)
    for s in sample_list:
        s["max_new"], s["stops"] = 30, set()
    differ, _, compared = compare(model, sample_list, cells, sizes=(3,), triggers=[50] * len(cells))
    assert compared == 4 * len(cells) and differ == 0


@pytest.mark.parametrize("name", SCORED)
def test_the_criticalkv_preset_over_a_scorer_is_criticalkvpress_over_its_press(name):
    """``preset=criticalkv method=<scorer>``: kvpress's conventions and the released selection around the scorer's
    own defaults (its press has no window, kernel or pooling), the config ``make conformance`` holds to
    CriticalKVPress(press); over SnapKV the preset sets SnapKVPress's window 64, kernel 5 and average pooling."""
    from pcs.identity import RunIdentity
    preset = compose([f"method={name}", "preset=criticalkv", "budget=256"])
    validate(preset)
    plain = compose([f"method={name}", "profile=kvpress", "selection=perturbation_released", "budget=256"])
    assert RunIdentity(preset).saved_config == RunIdentity(plain).saved_config
    assert build_method(preset) == build_method(plain)
    snapkv = compose(["method=snapkv", "preset=criticalkv"]).method
    assert (snapkv.window, snapkv.kernel, snapkv.pooling) == (64, 5, "avg")
    assert compose(["method=snapkv", "preset=criticalkv", "method.window=32"]).method.window == 32


@pytest.mark.parametrize("overrides, message", [
    (["method=tova", "method.window=4"], "method.scorer=tova reads the newest 1 entry"),
    (["method=knorm", "profile.gqa=per_query_head"], "scores per KV head"),
    (["method=snapkv", "method.window=0"], "must be at least 1"),
    (["method=expected_attention", "compress.trigger=300", "budget=256"], "only the prefill has"),
    (["method=adakv", "method.scorer=observed_attention", "method.window=0", "compress.trigger=300", "budget=256"],
     "only the prefill has"),
    (["method=expected_attention", "budget=3"], "always keeps the first 4 entries"),
    (["method=adakv", "method.scorer=knorm", "method.window=0", "method.scorer_epsilon=0.01"],
     "method.scorer=knorm adds no epsilon"),
    (["method=expected_attention", "method.scorer_epsilon=-1.0"], "scorer_epsilon"),
])
def test_a_scorer_config_without_meaning_is_refused_before_torch_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides))


def test_the_refusal_takes_under_two_seconds_without_torch():
    code = ("import sys, time; t = time.time(); from pcs.config import compose; from pcs.validation import validate; "
            "from pcs.errors import ConfigError\ntry: validate(compose(['method=knorm', 'profile.gqa=per_query_head']))\nexcept ConfigError: "
            "print(time.time() - t, 'torch' in sys.modules)")
    start = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 2 and out[1] == "False", out
    assert time.time() - start < 20


def test_a_share_budget_holds_expected_attentions_sinks():
    """A share of a short prompt is never fewer entries than the 4 sinks Expected Attention always keeps (as a
    window method's share is never fewer than its window)."""
    assert build_method(compose(["method=expected_attention", "budget=0.01"])).for_prompt(100).budget == 4
    assert build_method(compose(["method=knorm", "budget=0.01"])).for_prompt(100).budget == 1
    assert build_method(compose(["method=tova", "budget=0.01"])).for_prompt(100).budget == 1
