"""KVzip and KVzip+: the reconstruction's scores against a brute-force forward of the prompt and each repetition
from scratch, the choice against a plain ranking, and a shared prefill against each method's own. (Entry for entry
against kvpress's KVzipPress: ``make conformance``.)"""
import pytest
import torch
from transformers import DynamicCache

from pcs.compression import attention_modules
from pcs.eviction import build_method
from pcs.eviction.base import Reconstruction
from pcs.eviction.conventions import Conventions, kvpress_ratio
from pcs.eviction.kvzip import KVzip
from pcs.generate import greedy_generate, greedy_generate_each
from pcs.hybrid import full_attention_layers, attention_windows
from pcs.prompts import REPEAT_QUOTED, RepeatPrompt
from pcs.reconstruction import reconstruct
from pcs.cache import CompressedCache

from conftest import ARCHITECTURES, compose_cfg, tiny_model

# A prompt of 3 template tokens and 37 of context; requests and tail of made-up ids.
REPEAT = RepeatPrompt(head=3, first=[11, 12, 13], later=[21, 22], tail=[31, 32])
N = 40


def rotated(module, hidden, cos, sin):
    """(H_q, t, d) the module's queries of ``hidden`` (t, hidden) at the rotary ``cos``, ``sin`` (t, d)."""
    d = module.head_dim
    q = module.q_proj(hidden).view(hidden.shape[0], -1, d).transpose(0, 1)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    half = torch.cat([-q[..., d // 2:], q[..., :d // 2]], dim=-1)
    return q * cos + half * sin


def brute_force(model, prompt: list[int], size: int, sinks: int, normalised: bool) -> dict[int, torch.Tensor]:
    """Per full-attention layer, (H_kv, n) scores: for each chunk, the prompt and its request fed from scratch into
    the model's own cache, then every query of the request, head by head and token by token, softmaxed over the
    entries KVzip lets it read (the model's own attention scale), the chunk's maximum kept."""
    n, cfg = len(prompt), model.config
    layers = full_attention_layers(attention_windows(cfg))
    scores = {l: torch.zeros(cfg.num_key_value_heads, n) for l in layers}
    context = prompt[REPEAT.head:]
    chunks = [context[i:i + size] for i in range(0, len(context), size)]
    start = REPEAT.head
    for i, chunk in enumerate(chunks):
        asked = (REPEAT.first if i == 0 else REPEAT.later + chunks[i - 1][-REPEAT_QUOTED:]) + REPEAT.tail + chunk
        end = start + len(chunk)
        seen = {}
        hooks = [m.register_forward_hook(lambda m, a, kw, out: seen.__setitem__(m.layer_idx, (
                     kw["hidden_states"][0, n:], kw["position_embeddings"][0][0, n:], kw["position_embeddings"][1][0, n:])),
                 with_kwargs=True) for m in attention_modules(model)]
        model.set_attn_implementation("sdpa")
        try:
            cache = DynamicCache(config=cfg)
            model(input_ids=torch.tensor([prompt + asked]), past_key_values=cache)
        finally:
            model.set_attn_implementation("pcs")
            for h in hooks:
                h.remove()
        for l in layers:
            module = attention_modules(model)[l]
            keys, values = cache.layers[l].keys[0], cache.layers[l].values[0]
            hidden, cos, sin = seen[l]
            queries = rotated(module, hidden, cos, sin)
            n_q, d = queries.shape[0], module.head_dim
            group = n_q // keys.shape[0]
            o_proj = module.o_proj.weight
            for h in range(n_q):
                kv = h // group
                for t in range(len(asked)):
                    read = list(range(min(sinks, start))) + list(range(start, end)) + list(range(n, n + t + 1))
                    weights = torch.softmax(keys[kv, read] @ queries[h, t] * module.scaling, dim=-1)
                    if normalised:
                        out = values[kv, read] @ o_proj[:, h * d:(h + 1) * d].T
                        weights = weights / hidden[t].norm() * out.norm(dim=-1)
                    got = weights[min(sinks, start):min(sinks, start) + end - start]
                    scores[l][kv, start:end] = torch.maximum(scores[l][kv, start:end], got)
        start = end
    return scores


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("size,sinks,normalised", [(37, 4, False), (16, 4, True), (10, 2, False)])
@torch.inference_mode()
def test_the_reconstruction_scores_each_entry_as_a_forward_from_scratch(arch, size, sinks, normalised):
    """In one chunk or several (10: 4 chunks, the last of 7), KVzip's and KVzip+'s scores equal those of the
    brute-force forward; on the hybrid model the repetition reads its sliding layers' windows as a fresh forward
    does, and the prefill's cache is left as it was. Queries and keys scaled by 8: attention far from uniform, so
    that an entry read or skipped moves the scores."""
    model = tiny_model(arch)
    for module in attention_modules(model):
        module.q_proj.weight *= 8
        module.k_proj.weight *= 8
    torch.manual_seed(5)
    prompt = torch.randint(0, 256, (N,)).tolist()
    cache = CompressedCache.of(model.config)
    model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    before = [[t.clone() for t in layer.dense()] if not layer.is_sliding else None for layer in cache.layers]
    request = Reconstruction(size, sinks, normalised)
    layers = tuple(full_attention_layers(cache.windows))
    got = reconstruct(model, cache, torch.tensor([prompt]), REPEAT, {request}, layers)[request]
    want = brute_force(model, prompt, size, sinks, normalised)
    assert sorted(got) == sorted(want)
    for l in want:
        assert (got[l][:, :REPEAT.head] == 0).all()          # the template's head is never repeated
        torch.testing.assert_close(got[l], want[l], rtol=1e-5, atol=1e-6)
    for layer, old in zip(cache.layers, before):
        if old is not None:
            assert all(torch.equal(a, b) for a, b in zip(layer.dense(), old))


def ranked(scores: dict[int, torch.Tensor], sinks: int) -> dict[int, torch.Tensor]:
    top = max(s.max() for s in scores.values()) + 1
    out = {l: s.clone() for l, s in scores.items()}
    for s in out.values():
        s[:, :sinks] = top
    return out


@pytest.mark.parametrize("scope", ["model", "layer"])
@pytest.mark.parametrize("budget", [6, 0.3])
def test_kvzip_keeps_the_highest_scores_of_its_scope(scope, budget):
    """Model scope: the L x H x B highest scores of every layer and head, sinks first; layer scope: each layer's
    H x B highest. Plain sorting of every (layer, head, position) triple is the reference."""
    torch.manual_seed(0)
    n, heads, layers = 30, 3, [0, 2, 5]
    scores = {l: torch.rand(heads, n) for l in layers}
    method = KVzip(budget=budget, scope=scope, sinks=4)
    per_head = int(budget * n) if isinstance(budget, float) else budget
    kept = method.choose(scores, n)
    boosted = ranked(scores, 4)
    triples = [(float(boosted[l][h, p]), l, h, p) for l in layers for h in range(heads) for p in range(n)]
    if scope == "model":
        winners = sorted(triples, reverse=True)[:len(layers) * heads * per_head]
    else:
        winners = [t for l in layers for t in sorted([t for t in triples if t[1] == l], reverse=True)[:heads * per_head]]
    for l in layers:
        for h in range(heads):
            assert kept[l][h].tolist() == sorted(p for _, ll, hh, p in winners if (ll, hh) == (l, h))
            assert set(range(4)) <= set(kept[l][h].tolist())
    if scope == "model":
        assert len({sum(len(k) for k in kept[l]) for l in layers}) > 1     # layers keep uneven shares


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_kvpress_counts_its_evictions_from_a_ratio(scope):
    """``profile.kvzip_count=ratio``: int(entries x compression ratio) evicted, as KVzipPress counts them: at
    (n, budget) = (1000, 100) that float product rounds one entry down, so one entry more than budget x heads stays."""
    n, heads, layers = 1000, 3, [0, 1, 2, 3]
    scores = {l: torch.rand(heads, n, generator=torch.Generator().manual_seed(l)) for l in layers}
    ratio = kvpress_ratio(100, n)
    entries = len(layers) * heads * n if scope == "model" else heads * n
    evicted = int(entries * ratio)
    assert evicted == entries - entries // n * 100 - 1
    exact = KVzip(budget=100, scope=scope).choose(scores, n)
    kvpress = KVzip(budget=100, scope=scope, conventions=Conventions(ties="topk", kvzip_count="ratio")).choose(scores, n)
    held = lambda kept: sum(len(h) for l in layers for h in kept[l])
    assert held(exact) == len(layers) * heads * 100
    assert held(kvpress) - held(exact) == (1 if scope == "model" else len(layers))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kvzip_in_a_shared_prefill_answers_as_in_its_own(arch):
    """KVzip, KVzip+ (layer scope), KVzip under perturbation selection (its second stage reads the layers' values)
    and two methods that need no reconstruction, prefilled once: each answers as its own prefill does, and the
    reconstruction leaves the others' caches as they were."""
    model = tiny_model(arch)
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (1, 48))
    methods = [build_method(compose_cfg(*o)) for o in (["method=kvzip", "budget=12", "method.chunk=20",
                                                        "selection=attention"],
                                                       ["method=kvzip_plus", "budget=12", "method.scope=layer",
                                                        "selection=attention"],
                                                       ["method=kvzip", "budget=12", "selection=perturbation"],
                                                       ["method=snapkv", "budget=12", "method.window=4"],
                                                       ["method=full"])]
    shared = greedy_generate_each(model, ids, methods, 8, set(), repeat=REPEAT)
    for method, got in zip(methods, shared):
        alone = greedy_generate(model, ids, method, 8, set(), repeat=REPEAT)
        assert got.token_ids == alone.token_ids
        assert got.kv_cache_bytes == alone.kv_cache_bytes
    assert shared[0].kv_cache_bytes < shared[4].kv_cache_bytes


def two_stages_by_hand(scores: torch.Tensor, counts: list[int], values: torch.Tensor, o_proj: torch.Tensor,
                      alpha: float = 0.25, sinks: int = 4) -> list[list[int]]:
    """The paper's Algorithm 1 in each KV head, one entry at a time: the top ``floor(alpha x count)`` by the score,
    at least the ``sinks`` (which score highest), the earlier first among equal ones; then the rest of the count by the
    score times the mean over the head's query heads of ``||v W^O_g||_1`` (``W^O_g``: query head g's columns of the
    output projection)."""
    h_kv, n, d = values.shape
    group = o_proj.shape[1] // d // h_kv
    kept = []
    for h, count in enumerate(counts):
        norms = [sum(float((values[h, p] @ o_proj[:, g * d:(g + 1) * d].T).abs().sum())
                     for g in range(h * group, (h + 1) * group)) / group for p in range(n)]
        first = sorted(range(n), key=lambda p: (-float(scores[h, p]), p))[:max(int(alpha * count), min(sinks, count))]
        rest = sorted((p for p in range(n) if p not in first), key=lambda p: (-float(scores[h, p]) * norms[p], p))
        kept.append(sorted(first + rest[:count - len(first)]))
    return kept


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_perturbation_selection_over_kvzip_fills_each_heads_count_by_the_papers_two_stages(scope):
    """KVzip's ranking gives each (layer, KV head) its count; under ``selection=perturbation`` the paper's two stages
    fill it (stage 1 by KVzip's score, sinks first, stage 2 by the score times the value norm through W^O)."""
    from pcs.eviction.base import LayerState
    from pcs.eviction.selection import PerturbationSelection
    g = torch.Generator().manual_seed(0)
    n, heads, d, layers = 30, 3, 8, [0, 2, 5]
    scores = {l: torch.rand(heads, n, generator=g) for l in layers}
    # value norms spread over two orders of magnitude, so that stage 1 keeps entries stage 2 alone would not
    states = {l: LayerState(l, 6, torch.randn(heads, n, d, generator=g),
                            torch.randn(heads, n, d, generator=g) * torch.exp(2 * torch.randn(1, n, 1, generator=g)),
                            torch.randn(2 * heads, 1, d, generator=g), torch.randn(24, 2 * heads * d, generator=g))
              for l in layers}
    attention = KVzip(budget=8, scope=scope).choose(scores, n)
    perturbation = KVzip(budget=8, scope=scope, selection=PerturbationSelection()).choose(scores, n, states)
    boosted, stage_one_decides = ranked(scores, 4), []
    for l in layers:
        counts = [len(h) for h in attention[l]]
        want = two_stages_by_hand(boosted[l], counts, states[l].values, states[l].o_proj_weight)
        assert [h.tolist() for h in perturbation[l]] == want
        stage_one_decides.append(want != two_stages_by_hand(boosted[l], counts, states[l].values,
                                                            states[l].o_proj_weight, alpha=0, sinks=0))
        assert all(set(range(4)) <= set(h) for h in want)      # the sinks always kept
    assert any(stage_one_decides)
    assert any(a.tolist() != p.tolist() for l in layers for a, p in zip(attention[l], perturbation[l]))


def test_kvzip_without_a_repeat_request_says_what_it_needs():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="repeat request"):
        greedy_generate(model, torch.randint(0, 256, (1, 30)), build_method(compose_cfg("method=kvzip", "budget=8")),
                        2, set())
