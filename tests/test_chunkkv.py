"""ChunkKV (``method=chunkkv``): the kept entries against kvpress 0.5.5's ``ChunkKVPress.compress`` written out
(presses/chunkkv_press.py lines 51-125) over its press's scores (SnapKVPress's written out from snapkv_press.py lines
42-99, and the scorers', which tests/test_scorers.py holds to their presses), and the configs it refuses."""
import math

import pytest
import torch
import torch.nn.functional as F

from pcs.config import compose
from pcs.validation import validate
from pcs.errors import ConfigError
from pcs.eviction import build_method, scorers
from pcs.eviction.base import LayerState
from pcs.eviction.conventions import kvpress_ratio
from pcs.generate import greedy_generate, greedy_generate_each

from conftest import tiny_model


def layer(seed, n=203, h_kv=2, h_q=6, d=8, w=64):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d, generator=g)
    keys[:, ::7] *= 3
    return LayerState(0, 1, keys, values, torch.randn(h_q, w, d, generator=g) * 2, torch.randn(24, h_q * d, generator=g))


def snapkvpress_scores(layer, window=64, kernel=5):
    """SnapKVPress.score (snapkv_press.py lines 42-99): the window's causal softmax attention over the prefix, its
    mean over the window, average pooling counting the padding, the group mean, the window padded at the maximum + 1."""
    h_q, w, d = layer.window_queries.shape
    h_kv, n, _ = layer.keys.shape
    keys = layer.keys.repeat_interleave(h_q // h_kv, dim=0)
    logits = layer.window_queries @ keys.transpose(1, 2) / math.sqrt(d)
    logits += torch.triu(torch.full_like(logits, float("-inf")), diagonal=n - window + 1)
    scores = logits.softmax(dim=-1)[..., :-window].mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(h_kv, h_q // h_kv, n - window).mean(1)
    return F.pad(scores, (0, window), value=scores.max().item() + 1)


def chunkkvpress_kept(scores, ratio, chunk=20):
    """ChunkKVPress.compress (chunkkv_press.py lines 79-125) for one sequence: per-chunk means of the scores summed
    over heads, the entries after the last whole chunk one more chunk, the top ``max(1, int(chunks x (1 - ratio)))``
    chunks kept whole in every head."""
    n = scores.shape[-1]
    whole, rest = n // chunk, n % chunk
    means = scores[None, :, :whole * chunk].sum(dim=1).view(-1, whole, chunk).mean(dim=-1)
    if rest:
        means = torch.cat([means, scores[None, :, -rest:].sum(dim=1).mean(dim=-1, keepdim=True)], dim=-1)
    top = means.topk(max(1, int((whole + (rest > 0)) * (1 - ratio))), dim=-1).indices[0]
    kept = [torch.arange(c * chunk, min(c * chunk + chunk, n)) for c in top.tolist()]
    return torch.cat(kept).sort().values.tolist()


@pytest.mark.parametrize("scorer", ["window_attention", "knorm", "keydiff", "tova"])
@pytest.mark.parametrize("budget", [70, 150, 0.25])
def test_chunkkv_keeps_what_chunkkvpress_keeps_over_its_press(scorer, budget):
    """203 entries: 10 chunks of 20 and one of 3; under kvpress's conventions, with SnapKVPress's window of 64 or
    each scorer's own (TOVA: the newest entry), every head keeps ChunkKVPress's chunks, a budget's share of them."""
    window = {"window_attention": 64, "tova": 1}.get(scorer, 0)
    one = layer(0)
    one.window_queries = one.window_queries[:, -max(window, 1):]
    overrides = ["method=chunkkv", f"budget={budget}", "profile=kvpress", f"method.scorer={scorer}",
                 f"method.window={window}"]
    cfg = compose(overrides)
    validate(cfg)
    kept = build_method(cfg).for_prompt(one.n_tokens).keep(one)
    scores = snapkvpress_scores(one) if scorer == "window_attention" else getattr(scorers, scorer)(one)
    ratio = 1 - budget if isinstance(budget, float) else kvpress_ratio(budget, one.n_tokens)
    want = chunkkvpress_kept(scores, ratio)
    assert [k.tolist() for k in kept] == [want] * 2
    assert len({k // 20 for k in want}) == max(1, int(11 * (1 - ratio)))     # 3, 7 and 2 chunks


def test_chunks_follow_the_heads_summed_scores_not_one_heads():
    """Two heads that rank the chunks oppositely: the chunk kept is the one whose summed score is highest."""
    one = layer(1, n=60)
    scores = torch.tensor([[5.0] * 20 + [0.0] * 20 + [1.0] * 20, [0.0] * 20 + [4.0] * 20 + [3.0] * 20])
    method = build_method(compose(["method=chunkkv", "budget=20", "method.scorer=knorm", "method.window=0"]))
    original = scorers.SCORERS["knorm"]
    scorers.SCORERS["knorm"] = scorers.Scorer(window=None, signed=True, score=lambda layer: scores)
    try:
        kept = method.keep(one)
    finally:
        scorers.SCORERS["knorm"] = original
    assert [k.tolist() for k in kept] == [list(range(20))] * 2      # 5 + 0 against 0 + 4 and 1 + 3


def test_a_prompt_shorter_than_a_chunk_is_cut_as_the_scorers_own_method_cuts_it():
    """chunkkv_press.py lines 82-84: no whole chunk, the press's own compress (here KnormPress's top-k per head)."""
    one = layer(2, n=15)
    kept = build_method(compose(["method=chunkkv", "budget=6", "method.scorer=knorm", "method.window=0"])).keep(one)
    assert [k.tolist() for k in kept] == [sorted(h.topk(6).indices.tolist()) for h in scorers.knorm(one)]


@pytest.mark.parametrize("overrides, message", [
    (["method.chunk=0"], "method.chunk=0"),
    (["compress.trigger=300"], "chooses from a prefill only"),
    (["preset=criticalkv"], "method=chunkkv has none"),
    (["method.scorer=tova"], "method.window=64 must be 1"),
])
def test_a_chunkkv_config_without_meaning_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(["method=chunkkv", "budget=128", *overrides]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("question", [False, True])
def test_new_baselines_in_a_shared_prefill_answer_as_in_their_own(arch, question):
    """ChunkKV, CAKE, LagKV and CUR (each selection where it takes one), prefilled once with the full cache, the
    question inside the prompt or fed after compression: each answers, token for token and byte for byte, as its own
    prefill does (batch 1), on a model of full-attention layers and on a hybrid of sliding-window ones."""
    model = tiny_model(arch)
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (1, 64))
    asked = torch.randint(0, 256, (1, 6)) if question else None
    overrides = [["method=chunkkv", "budget=24", "method.window=8", "method.chunk=6"],
                 ["method=chunkkv", "budget=0.5", "method.window=0", "method.scorer=knorm", "method.chunk=5"],
                 ["method=cake", "budget=24", "method.window=8", "selection=attention"],
                 ["method=cake", "budget=24", "method.window=8", "selection=perturbation"],
                 ["method=lagkv", "budget=24", "selection=perturbation"],
                 ["method=cur", "budget=0.5", "selection=attention"],
                 ["method=full"]]
    methods = [build_method(compose(o)) for o in overrides]
    shared = greedy_generate_each(model, ids, methods, 8, set(), question_ids=asked)
    for o, method, got in zip(overrides, methods, shared):
        alone = greedy_generate(model, ids, method, 8, set(), question_ids=asked)
        assert got.token_ids == alone.token_ids, o
        assert got.kv_cache_bytes == alone.kv_cache_bytes, o
    assert all(got.kv_cache_bytes < shared[-1].kv_cache_bytes for got in shared[:-1])
