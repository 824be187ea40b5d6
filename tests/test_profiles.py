"""Profiles: each convention against its reference's definition, and the official AdaKV allocation against a
transcription of FFY0/AdaKV (adaptive_snapkv/monkeypatch/snapkv_utils.py at efe4e2e). kvpress itself is
compared entry by entry by `make conformance` (scripts/conformance.py), in its own environment."""
import math

import pytest
import torch
import torch.nn.functional as F

from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.eviction.adakv import AdaKV
from pcs.eviction.base import LayerState
from pcs.eviction.conventions import Conventions, kvpress_ratio
from pcs.eviction.pyramidkv import PyramidKV
from pcs.eviction.scores import pool_scores
from pcs.eviction.selection import AttentionSelection, PerturbationSelection
from pcs.identity import RunIdentity

from conftest import compose_cfg


@pytest.mark.parametrize("n", [200, 1000, 1024, 2048, 3001, 8191])
def test_kvpress_ratio_keeps_exactly_the_budget(n):
    for budget in (1, 64, 128, 256, 640, n - 1):
        ratio = kvpress_ratio(budget, n)
        assert int(n * (1 - ratio)) == budget                      # kvpress's compute_n_kept
        assert ratio <= 1 - budget / n                              # nudged down only
        assert int(n * (1 - math.nextafter(ratio, math.inf))) < budget or ratio == 1 - budget / n


def test_average_pooling_pads_with_zeros_or_not():
    scores = torch.ones(1, 5)
    real = pool_scores(scores, 3, "avg", count_padding=False)
    zeros = pool_scores(scores, 3, "avg", count_padding=True)
    assert real.tolist() == [[1.0] * 5]
    assert zeros[0, 0] == pytest.approx(2 / 3) and zeros[0, 2] == 1.0 and zeros[0, 4] == pytest.approx(2 / 3)


def test_stage1_counts_the_window_in_the_budget_rule():
    # kvpress criticalkv_press.py: selection_budget = int(n_kept * first_stage_ratio), the window (max + 1) first.
    for alpha, prefix_rule, budget_rule in [(0.25, 24, 0), (0.5, 48, 32), (0.75, 72, 64)]:
        sel = PerturbationSelection(alpha=alpha)
        assert sel.stage1_size(96, 32, "prefix") == prefix_rule        # floor(alpha x (128 - 32))
        assert sel.stage1_size(96, 32, "budget") == budget_rule        # int(alpha x 128) - 32


def test_kvcache_factory_gives_short_prompts_uniform_budgets():
    """The conventions' measured example: b = 128, w = 32, a 2-layer model, an 182-token prompt: KVCache-Factory
    keeps [96, 96] prefix entries; the steps formula alone gives [150, 42]."""
    def budgets(rule):
        method = PyramidKV(128, AttentionSelection(), 32, 7, "max", Conventions(pyramid_budgets=rule))
        s1 = torch.rand(2, 150)
        return [int(method.prefix_budgets(LayerState(l, 2, torch.zeros(2, 182, 4), None, None, None), s1)[0])
                for l in range(2)]
    assert budgets("kvcache_factory") == [96, 96]
    assert budgets("steps") == [150, 42]


def test_kvpress_pyramid_falls_back_to_uniform_and_keeps_its_float_steps():
    def budget(layer, n, b=128, w=32, layers=30):
        method = PyramidKV(b, AttentionSelection(), w, 7, "avg", Conventions(pyramid_budgets="kvpress"))
        state = LayerState(layer, layers, torch.zeros(2, n, 4), None, None, None)
        return int(method.prefix_budgets(state, torch.rand(2, n - w))[0])
    # b = 128: min_num = 128 / 20 < w, so every layer keeps SnapKV's b (window inside): b - w prefix entries.
    assert {budget(l, 2000) for l in range(30)} == {96}
    # b = 640 on 2,048 tokens: max 1248, min 32, float steps; the window is inside each layer's total.
    got = [budget(l, 2048, b=640) for l in range(30)]
    want = [round(1248 - l * (1248 - 32) / 29) - 32 for l in range(30)]
    assert got == want and got[-1] == 0


def test_profiles_and_their_knobs_are_checked_before_the_model_loads():
    with pytest.raises(ConfigError, match="profile.ties='sometimes'"):
        build_method(compose_cfg("profile.ties=sometimes"))
    assert RunIdentity(compose_cfg("profile=adakv")).folder.endswith("_profile=adakv")
    assert RunIdentity(compose_cfg("profile=kvpress", "profile.ties=earlier")).folder.endswith("_profile=kvpress_ties=earlier")
    assert RunIdentity(compose_cfg()).folder == "needle/smollm2/snapkv_perturbation_b128"   # the default adds nothing
    assert RunIdentity(compose_cfg("method=streamingllm", "profile=kvpress")).folder == "needle/smollm2/streamingllm_none_b128"


# ---- official AdaKV, transcribed from FFY0/AdaKV adaptive_snapkv/monkeypatch/snapkv_utils.py ----

def official_adakv_gqa(keys, queries, window, kernel, pooling, budget, floor_alpha):
    """AdaptiveSnapKVCluster with gqa_support=True, gqa_func='mean' (calcul_attn_sore, lines 335-370;
    update_kv_gqa, lines 380-503; skip=0, normalize=False): kept prefix positions per KV head."""
    h_kv, n, d = keys.shape
    h_q = queries.shape[0]
    groups = h_q // h_kv
    key_states = keys[None].repeat_interleave(groups, dim=1)                       # repeat_kv
    query_states = queries[None]
    attn_weights = torch.matmul(query_states[..., -window:, :], key_states.transpose(2, 3)) / math.sqrt(d)
    mask = torch.full((window, window), torch.finfo(attn_weights.dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    attn_weights[:, :, -window:, -window:] += mask[None, None]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
    mean = attn_weights[:, :, -window:, :-window].mean(dim=-2)
    mean = mean.view(1, h_q // groups, groups, -1).mean(dim=-2)
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    attn_score = pool(mean, kernel_size=kernel, padding=kernel // 2, stride=1)
    base_capacity = budget - window
    floor_capacity = int(base_capacity * floor_alpha)
    sorted_score, sorted_idx = attn_score.sort(dim=-1, descending=True)
    length = sorted_score.size(-1)
    top = torch.topk(sorted_score.reshape(1, length * h_kv), k=h_kv * base_capacity, dim=-1).indices // length
    capacity = torch.zeros((1, h_kv), dtype=top.dtype).scatter_add_(-1, top, torch.ones_like(top))
    capacity = torch.round(capacity * (1 - floor_alpha) + floor_capacity).int()
    return [sorted(sorted_idx[0, h, :capacity[0, h]].tolist()) for h in range(h_kv)], attn_score[0]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_official_adakv_allocation_and_choice(seed, pooling):
    g = torch.Generator().manual_seed(seed)
    h_kv, h_q, n, d, window, budget = 2, 6, 160, 16, 8, 40
    keys, queries = torch.randn(h_kv, n, d, generator=g), torch.randn(h_q, window, d, generator=g) * 2
    layer = LayerState(0, 1, keys, torch.randn(h_kv, n, d, generator=g), queries, torch.randn(24, h_q * d, generator=g))
    full_queries = torch.cat([torch.zeros(h_q, n - window, d), queries], dim=1)
    want, score = official_adakv_gqa(keys, full_queries, window, 7, pooling, budget, 0.2)
    method = AdaKV(budget, AttentionSelection(), window, 7, pooling[:3], floor=0.2,
                   conventions=Conventions(avg_pool_padding="zeros", adakv_allocation="official", ties="topk",
                                           gqa="mean_then_pool"))
    got = [sorted(p.tolist()) for p in method.keep(layer)]
    window_positions = set(range(n - window, n))
    for h in range(h_kv):
        ours = set(got[h]) - window_positions
        assert window_positions <= set(got[h]) and len(ours) == len(want[h])
        # Exact up to ties: what differs scores exactly the official cut's value (max pooling repeats values).
        cut = score[h, want[h]].min()
        assert all(score[h, i] == cut for i in ours ^ set(want[h]))
        if pooling == "avgpool":
            assert ours == set(want[h])


def official_adakv_wo_gqa(keys, queries, window, kernel, budget, floor_alpha):
    """AdaptiveSnapKVCluster with gqa_support=False (update_kv_wo_gqa, lines 507-620: repeat_kv, every query
    head scored, pooled (max) and given its own budget): kept prefix positions per query head."""
    h_kv, n, d = keys.shape
    h_q = queries.shape[0]
    key_states = keys[None].repeat_interleave(h_q // h_kv, dim=1)
    attn_weights = torch.matmul(queries[None][..., -window:, :], key_states.transpose(2, 3)) / math.sqrt(d)
    mask = torch.full((window, window), torch.finfo(attn_weights.dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    attn_weights[:, :, -window:, -window:] += mask[None, None]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
    attn_score = F.max_pool1d(attn_weights[:, :, -window:, :-window].mean(dim=-2), kernel_size=kernel,
                              padding=kernel // 2, stride=1)
    base_capacity = budget - window
    sorted_score, sorted_idx = attn_score.sort(dim=-1, descending=True)
    length = sorted_score.size(-1)
    top = torch.topk(sorted_score.reshape(1, length * h_q), k=h_q * base_capacity, dim=-1).indices // length
    capacity = torch.zeros((1, h_q), dtype=top.dtype).scatter_add_(-1, top, torch.ones_like(top))
    capacity = torch.round(capacity * (1 - floor_alpha) + int(base_capacity * floor_alpha)).int()
    return [sorted(sorted_idx[0, h, :capacity[0, h]].tolist()) for h in range(h_q)], attn_score[0]


@pytest.mark.parametrize("seed", range(4))
def test_official_adakv_per_query_head(seed):
    g = torch.Generator().manual_seed(seed)
    h_kv, h_q, n, d, window, budget = 2, 6, 160, 16, 8, 40
    keys, queries = torch.randn(h_kv, n, d, generator=g), torch.randn(h_q, window, d, generator=g) * 2
    layer = LayerState(0, 1, keys, torch.randn(h_kv, n, d, generator=g), queries, torch.randn(24, h_q * d, generator=g))
    want, score = official_adakv_wo_gqa(keys, torch.cat([torch.zeros(h_q, n - window, d), queries], dim=1),
                                        window, 7, budget, 0.2)
    method = build_method(compose_cfg("method=adakv", "profile=adakv", "selection=attention", f"budget={budget}",
                                      f"method.window={window}"))
    got = method.keep(layer)
    assert len(got) == h_q
    for h in range(h_q):
        ours = set(got[h].tolist()) - set(range(n - window, n))
        assert len(ours) == len(want[h])
        cut = score[h, want[h]].min()   # exact up to ties of the max-pooled scores
        assert all(score[h, i] == cut for i in ours ^ set(want[h]))


@pytest.mark.embedded
def test_official_adakv_on_the_embedded_models_real_tensors(embedded_dir):
    """Both official GQA modes on real keys and window queries of the embedded model (an essay prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pcs.benchmarks.needle import Haystack, essay_files
    from pcs.cache import CompressedCache
    from pcs.compression import after_prefill
    from pcs.models import prepare
    model = prepare(AutoModelForCausalLM.from_pretrained(embedded_dir))
    ids = Haystack(AutoTokenizer.from_pretrained(embedded_dir), essay_files(None), "").tokens[:700]
    window, budget, states = 32, 128, {}
    cache = CompressedCache.of(model.config)
    with torch.no_grad(), after_prefill(model, cache, [window],
                                        lambda queries, state, layer: states.__setitem__(state.layer_idx, state)):
        model(input_ids=torch.tensor([ids]), use_cache=True, past_key_values=cache)
    n = len(ids)
    for gqa, official in (("per_query_head", official_adakv_wo_gqa), ("mean_then_pool", None)):
        method = build_method(compose_cfg("method=adakv", "profile=adakv", f"profile.gqa={gqa}", "selection=attention",
                                          f"budget={budget}"))
        for l in (0, 14, 29):
            state = states[l]
            queries = torch.cat([torch.zeros(state.window_queries.shape[0], n - window, 64), state.window_queries], 1)
            if official is None:
                want, score = official_adakv_gqa(state.keys, queries, window, 7, "maxpool", budget, 0.2)
            else:
                want, score = official(state.keys, queries, window, 7, budget, 0.2)
            got = method.keep(state)
            assert len(got) == len(want)
            for h, kept in enumerate(got):
                ours = set(kept.tolist()) - set(range(n - window, n))
                assert len(ours) == len(want[h])
                cut = score[h, want[h]].min()
                assert all(score[h, i] == cut for i in ours ^ set(want[h]))
