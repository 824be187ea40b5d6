"""DefensiveKV and Layer-DefensiveKV (``pcs.eviction.defensivekv``) against a transcription of the authors' code,
FFY0/DefensiveKV at 9251b95: ``kvpress/presses/efficient_defensivekv_press.py`` (scores, lines 116-227, the value
norms of ``vwl1norm`` lines 32-75, whose Triton twin ``vwl1norm_triton`` lines 78-112 computes the same),
``efficient_ada_scorer_press.py`` (one top-k per layer, lines 73-94) and ``efficient_ada_global_scorer_press.py``
(one top-k over every layer, lines 172-190, then ``layer_compress`` lines 44-120). The transcription keeps the
code's batch axis, its ``compression_ratio`` and its order of operations; it reads nothing from pcs. pcs must keep
the same entries on random layers and on the embedded model's layers of a real prompt."""
import math

import pytest
import torch
import torch.nn.functional as F

from pcs.config import compose
from pcs.validation import validate
from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.eviction.base import LayerState

from conftest import embedded_essay_layers


# ---- the transcription (FFY0/DefensiveKV @ 9251b95) ----

def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def reference_window_attention(queries, keys, w):
    """``compute_window_attention`` lines 116-156, from queries already rotated (so no rotary here): softmax of
    q k / sqrt(d) with the causal mask of the window (line 147), in float32; the window's columns dropped (line
    152), and ``window_bias`` read on the last w columns left (line 154)."""
    b, h, _, d = queries.shape
    k_len = keys.shape[2]
    attn = queries @ repeat_kv(keys, h // keys.shape[1]).transpose(2, 3) / math.sqrt(d)
    mask = torch.triu(torch.ones_like(attn) * float("-inf"), diagonal=k_len - w + 1)
    attn = F.softmax(attn + mask, dim=-1, dtype=torch.float32).to(queries.dtype)[..., :-w]
    return attn, attn[..., -w:].sum(dim=-1).mean().item()


def reference_scores(queries, keys, values, o_proj_weight, compression_ratio, w=32, kernel_size=5):
    """``EfficientDefensiveKVPress.score`` (lines 158-227) with ``vwl1norm`` (lines 32-75): (b, H_kv, k_len)."""
    bsz, n_kv, q_len, _ = keys.shape
    n_heads = queries.shape[1]
    groups = n_heads // n_kv
    attn, window_bias = reference_window_attention(queries, keys, w)
    scores = attn.view(bsz, n_kv, groups, w, q_len - w)
    ave = scores.mean(dim=2).mean(dim=-2)
    base = scores.sum(dim=-1, keepdim=True)
    scores = F.avg_pool1d(scores.view(bsz * n_kv * groups, w, q_len - w), kernel_size=kernel_size,
                          padding=kernel_size // 2, stride=1).view(bsz, n_kv, groups, w, q_len - w)
    scores = (scores / scores.sum(dim=-1, keepdim=True)) * base
    max_scores = scores.max(dim=2).values.max(dim=-2).values
    scores = max_scores.clamp(min=max_scores.mean(dim=-1, keepdim=True))
    # vwl1norm (lines 32-75) over values[..., :-w, :]
    v = values[..., :-w, :]
    n = v.shape[2]
    wo = o_proj_weight.transpose(0, 1).view(n_heads, keys.shape[-1], -1)
    rep = repeat_kv(v, groups)
    norms = torch.stack([torch.norm(rep[:, head].matmul(wo[head].unsqueeze(0)), p=1, dim=-1)
                         for head in range(n_heads)], dim=1)
    norms = norms.view(bsz, n_kv, groups, n).mean(dim=2)
    scores = scores * (norms / norms.sum(dim=-2, keepdim=True))
    threshold = 0.9 - window_bias
    normalised = ave / ave.sum(dim=-1, keepdim=True)
    chosen = torch.zeros_like(normalised, dtype=torch.bool)
    ordered, order = torch.sort(normalised, dim=-1, descending=True)
    count = torch.argmax((torch.cumsum(ordered, dim=-1) >= threshold).to(torch.int32), dim=-1)
    count.clamp_(max=int(n * (1 - compression_ratio) - w))
    for b in range(bsz):
        for h in range(n_kv):
            chosen[b, h, order[b, h, :count[b, h].item()]] = True
    scores = torch.where(chosen, scores.max().item(), scores)
    scores = F.pad(scores, (0, w), value=scores.max().item())
    return scores.view(bsz, n_kv * q_len)


def reference_layer_kept(flat_scores, n_kv, compression_ratio):
    """``EfficientAdaScorerPress.compress`` lines 86-94: one top-k of ``int(q_len (1 - cr) H_kv)`` over the
    flattened layer; kept positions per head."""
    q_len = flat_scores.shape[1] // n_kv
    top = flat_scores.topk(int(q_len * (1 - compression_ratio) * n_kv), dim=-1).indices[0]
    return [sorted((top[top // q_len == h] % q_len).tolist()) for h in range(n_kv)]


def reference_model_kept(layer_scores, n_kv, compression_ratio):
    """``EfficientAdaGlobalScorerPress.compress`` lines 172-190, then ``layer_compress`` lines 89-118 per layer."""
    q_len = layer_scores[0].shape[1] // n_kv
    n_layers = len(layer_scores)
    everything = torch.stack(layer_scores).view(-1)
    top = everything.topk(int(q_len * (1 - compression_ratio) * n_kv * n_layers), dim=-1).indices
    lens = torch.zeros(n_layers, dtype=torch.int32).scatter_add_(0, top // (q_len * n_kv),
                                                                  torch.ones_like(top, dtype=torch.int32))
    kept = []
    for scores, budget in zip(layer_scores, lens.tolist()):
        chosen = scores.view(-1).topk(budget, dim=-1).indices
        kept.append([sorted((chosen[chosen // q_len == h] % q_len).tolist()) for h in range(n_kv)])
    return kept


# ---- pcs against it ----

def defensive(budget, *overrides):
    return build_method(compose(["method=defensivekv", f"budget={budget}", *overrides]))


def ratio(budget, n, n_kv):
    """The code's compression ratio that keeps ``budget`` of ``n`` per head (``1 - budget / n`` nudged so that its
    products round to the budget: ``conventions.kvpress_ratio``), checked to round as pcs's budget."""
    from pcs.eviction.conventions import kvpress_ratio
    cr = kvpress_ratio(budget, n)
    assert int(n * (1 - cr) * n_kv) == n_kv * budget
    return cr


def random_layer(seed, n=200, h_kv=2, h_q=6, d=16, hidden=48):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(h_kv, n, d, generator=g)
    keys[:, torch.randperm(n, generator=g)[:12]] *= 3          # a few entries that draw attention
    queries = torch.randn(h_q, 32, d, generator=g) * 1.5
    return LayerState(seed, 4, keys, torch.randn(h_kv, n, d, generator=g), queries,
                      torch.randn(hidden, h_q * d, generator=g))


def reference_of(layer, budget):
    cr = ratio(budget, layer.n_tokens, layer.keys.shape[0])
    return reference_scores(layer.window_queries[None], layer.keys[None], layer.values[None], layer.o_proj_weight,
                            cr), cr


@pytest.mark.parametrize("seed, budget", [(0, 40), (1, 64), (2, 100), (3, 160)])
def test_defensivekv_keeps_the_entries_of_the_authors_code_on_random_layers(seed, budget):
    layer = random_layer(seed)
    flat, cr = reference_of(layer, budget)
    want = reference_layer_kept(flat, layer.keys.shape[0], cr)
    got = [h.tolist() for h in defensive(budget).keep(layer)]
    assert got == want
    assert sum(map(len, got)) == layer.keys.shape[0] * budget
    torch.testing.assert_close(defensive(budget).score(layer), flat.view(layer.keys.shape[0], -1))


def test_the_cap_on_stage_one_is_the_codes_even_where_it_is_negative():
    """At n = 100, budget 40, window 32 the code's cap is int(68 x 0.4 - 32) = -4, and its slice
    ``order[:-4]`` protects all but 4 entries per head, more than the budget (its quirk, reproduced)."""
    layer = random_layer(4, n=100)
    method = defensive(40)
    picks = method.scored(layer)[1]
    assert picks.sum(dim=1).tolist() == [68 - 4] * 2
    flat, cr = reference_of(layer, 40)
    assert [h.tolist() for h in method.keep(layer)] == reference_layer_kept(flat, 2, cr)


def test_layer_defensivekv_keeps_the_entries_of_the_authors_code_across_layers():
    layers = [random_layer(seed) for seed in (5, 6, 7, 8)]
    for i, layer in enumerate(layers):      # layers of unlike attention, so their shares differ
        layer.window_queries *= 0.5 + i
    budget = 48
    refs = [reference_of(layer, budget) for layer in layers]
    want = reference_model_kept([flat for flat, _ in refs], 2, refs[0][1])
    method = build_method(compose(["method=layer_defensivekv", f"budget={budget}"]))
    chosen = method.choose({i: method.score(layer) for i, layer in enumerate(layers)}, 200)
    got = [[h.tolist() for h in chosen[i]] for i in range(len(layers))]
    assert got == want
    assert len({sum(map(len, kept)) for kept in got}) > 1       # the layers' shares differ


def test_defensivekv_keeps_the_entries_of_the_authors_code_on_the_embedded_models_layers(embedded_dir):
    """The embedded SmolLM2 (30 layers, 3 KV heads of 3 query heads) on 600 tokens of an essay: every layer."""
    _, _, states = embedded_essay_layers(embedded_dir)
    budget, differ = 120, []
    with torch.inference_mode():        # the prefill's tensors
        for layer in states:
            flat, cr = reference_of(layer, budget)
            if [h.tolist() for h in defensive(budget).keep(layer)] != reference_layer_kept(flat, 3, cr):
                differ.append(layer.layer_idx)
    assert len(states) == 30 and differ == []


def test_defensivekv_takes_no_selection_and_a_budget_that_holds_its_window():
    """A selection does not enter its run (one folder whatever selection= says), and a window it cannot read or
    a budget that cannot hold it is refused before any model loads."""
    from pcs.identity import RunIdentity
    a = compose(["method=defensivekv", "budget=128", "selection=attention"])
    b = compose(["method=defensivekv", "budget=128", "selection=perturbation"])
    assert RunIdentity(a).folder == RunIdentity(b).folder
    with pytest.raises(ConfigError, match="observation window"):
        validate(compose(["method=defensivekv", "budget=16"]))
    for name in ("defensivekv", "layer_defensivekv", "laprox"):
        with pytest.raises(ConfigError, match="at least 1"):
            build_method(compose([f"method={name}", "budget=128", "method.window=0"]))
    with pytest.raises(ConfigError, match="chooses from a prefill only"):
        validate(compose(["method=layer_defensivekv", "budget=128", "compress.trigger=300"]))


def test_pooled_decoding_over_defensivekv_gives_batch_one_tokens():
    """DefensiveKV and Layer-DefensiveKV in pools beside SnapKV, on a hybrid model and a full-attention one
    (uneven heads, and uneven layers under one top-k of the model): batch 1's tokens (``tests/test_pool.py``)."""
    from conftest import tiny_model
    from oracles import compare, samples
    cells = [("method=defensivekv", "method.window=8"),
             ("method=layer_defensivekv", "method.window=8"),
             ("method=snapkv", "method.window=8")]
    for arch in ("llama", "gemma3"):
        model = tiny_model(arch)
        differ, _, compared = compare(model, samples(model), cells, sizes=(3,))
        assert compared == 4 * len(cells) and differ == 0
