"""Oracles and helpers more than one test module uses: batch-1 references, masked full-attention logits, sample
builders, run folders written by hand. Tests import them from here; no test imports another test module."""
import functools
import json
import random

import torch
from hydra import compose, initialize_config_dir
from transformers import AttentionInterface, DynamicCache

from pcs.cache import CompressedCache
from pcs.compression import CompressionStats, compress_after_prefill, compress_each_after_prefill, recompress_when_full
from pcs.engine import Arrival, Cell, DecodePool, decode
from pcs.eviction import build_method
from pcs.eviction.base import Method
from pcs.eviction.stage2_search import Stage2
from pcs.identity import RunIdentity

from conftest import CONF, compose_cfg


def hydra_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def write_run(results, *overrides, metrics):
    cfg = compose_cfg(*overrides)
    folder = results / RunIdentity(cfg).folder
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(RunIdentity(cfg).saved_config)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def needle_metrics(score):
    return {"score": score, "grid": {"1000": {"0": score, "50": 100.0}, "2000": {"0": 0.0, "50": score}}}


NEAR_TIE = 1e-3   # logits; float32 rounding of batched against one-row products is ~1e-6 here


WINDOWED = ("snapkv", "pyramidkv", "adakv")


TRIGGERED = [("method=snapkv", "selection=perturbation"), ("method=adakv", "selection=attention"),
             ("method=pyramidkv", "selection=perturbation_released", "profile=kvpress"),
             ("method=streamingllm",), ("method=laprox",)]


@functools.lru_cache(maxsize=None)
def build(cell, budget=40, window=8):
    knobs = [f"method.window={window}"] if cell[0].removeprefix("method=") in WINDOWED + ("laprox",) \
        and not any(knob.startswith("method.window=") for knob in cell) else []
    return build_method(compose_cfg(*cell, f"budget={budget}", *knobs))


@torch.inference_mode()
def batch1(model, ids, methods, max_new, stops, question=None, min_new=0, triggers=None):
    """The pre-pool engine's decoding of one prompt for each method, one sequence at a time on its own cache
    (the prefill shared, as ``test_shared_prefill.py`` checks it may be): per method its tokens, batch 1's
    top-two margin at each choice, and its cache statistics."""
    caches = [CompressedCache.of(model.config) for _ in methods]
    with compress_each_after_prefill(model, methods, caches):
        prompt_logits = model(input_ids=ids, past_key_values=caches[0], use_cache=True, logits_to_keep=1).logits
    return [decode_alone(model, cache, method, prompt_logits, ids.shape[1], max_new, stops, question, min_new, trigger)
            for cache, method, trigger in zip(caches, methods, triggers or [None] * len(methods))]


def decode_alone(model, cache, method, logits, n, max_new, stops, question, min_new, trigger):
    stats = CompressionStats(max_kv_entries=cache.most_entries())
    device = logits.device
    stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=device)
    tokens, margins = [], []
    with recompress_when_full(model, method, cache, trigger, stats):
        if question is not None:
            q = question.shape[1]
            logits = model(input_ids=question, position_ids=torch.arange(n, n + q, device=device)[None],
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            n += q
        kv_bytes = cache.nbytes()
        while len(tokens) < max_new:
            last = logits[0, -1]
            if len(tokens) < min_new and len(stop_ids):
                last = last.index_fill(0, stop_ids, float("-inf"))
            top = last.topk(2).values
            margins.append(float(top[0] - top[1]))
            next_id = int(last.argmax())
            if next_id in stops:
                break
            tokens.append(next_id)
            if len(tokens) == max_new:
                break
            logits = model(input_ids=torch.tensor([[next_id]], device=device),
                           position_ids=torch.tensor([[n + len(tokens) - 1]], device=device),
                           past_key_values=cache, use_cache=True).logits
    return {"tokens": tokens, "margins": margins, "kv_bytes": kv_bytes, "max_kv_entries": stats.max_kv_entries,
            "n_compressions": stats.n_compressions}


def samples(model, vocab=256):
    """Prompts of different lengths (one shorter than the budget: kept whole), a question fed after compression,
    and per-sample limits and stops; a stop is a token the full cache's answer reaches, so rows end early."""
    g = torch.Generator().manual_seed(7)
    device = next(model.parameters()).device
    out = [dict(ids=torch.randint(0, vocab, (1, n), generator=g).to(device), max_new=m, min_new=lo, question=None)
           for n, m, lo in ((90, 12, 0), (150, 7, 3), (30, 16, 0), (120, 9, 2))]
    out[3]["question"] = torch.randint(0, vocab, (1, 5), generator=g).to(device)
    for s in out:
        (full,) = batch1(model, s["ids"], [build(("method=full",))], s["max_new"], set(), s["question"])
        answer = full["tokens"]
        s["stops"] = {answer[len(answer) // 2]}
    return out


def compare(model, sample_list, cells, sizes=(1, 3, 8), triggers=None, graphs=False, compiled=False):
    """Pooled tokens against batch 1's for every (sample, cell) and pool size, each size with its own order of
    arrival (samples and each sample's cells shuffled): (rows that differ, largest margin at a differing row,
    rows compared). ``graphs``: the pools replay captured CUDA graphs; ``compiled``: of a compiled forward."""
    triggers = triggers or [None] * len(cells)
    want = {}
    for i, s in enumerate(sample_list):
        answers = batch1(model, s["ids"], [build(cell) for cell in cells], s["max_new"], s["stops"], s["question"],
                         s["min_new"], triggers)
        want.update({(i, j): answer for j, answer in enumerate(answers)})
    differ, widest, compared = 0, 0.0, 0
    for order, size in enumerate(sizes):
        rng = random.Random(order)
        sample_order = list(range(len(sample_list)))
        rng.shuffle(sample_order)

        def arrivals():
            for i in sample_order:
                s = sample_list[i]
                cell_order = list(range(len(cells)))
                rng.shuffle(cell_order)
                yield Arrival(model, s["ids"], [Cell(build(cells[j]), triggers[j]) for j in cell_order], s["max_new"],
                              s["stops"], s["question"], s["min_new"], owners=[(i, j) for j in cell_order])

        got = {seq.owner: seq.result for seq in decode(DecodePool(model, size, graphs, compiled=compiled),
                                                                 arrivals())}
        assert set(got) == set(want)
        for key, ref in want.items():
            compared += 1
            tokens = got[key].token_ids
            if tokens == ref["tokens"]:
                assert (got[key].kv_cache_bytes, got[key].max_kv_entries, got[key].n_compressions) == \
                    (ref["kv_bytes"], ref["max_kv_entries"], ref["n_compressions"]), key
                continue
            first = next(t for t in range(len(ref["margins"])) if t >= len(tokens) or t >= len(ref["tokens"])
                         or tokens[t] != ref["tokens"][t])
            differ += 1
            widest = max(widest, ref["margins"][first])
            assert ref["margins"][first] <= NEAR_TIE, (key, size, order, tokens, ref)
    print(f"\n[pool] {differ} of {compared} pooled rows differ from batch 1"
          + (f"; largest top-two margin at the first difference {widest:.2e}" if differ else ""))
    return differ, widest, compared


LENGTH_CELLS = [("method=adakv", "selection=perturbation"), ("method=snapkv", "profile=adakv",
                                                            "profile.gqa=per_query_head"),
                ("method=pyramidkv", "selection=attention", "profile=kvpress"), ("method=full",),
                ("method=streamingllm",), ("method=laprox",)]


# The count of an eager step's kernels per layer was about 48; a compiled step runs at most a third of that.
COMPILED_KERNELS_PER_LAYER = 16


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


# Host reads of one layer's compression, at most: the budgets (1), stage 2's checks (one per round of candidates).
MOST_HOST_READS = 1 + Stage2.MOST_READS


class Spy(Method):
    """Wraps a layer-by-layer method and records what each layer kept."""
    def __init__(self, method):
        assert not method.model_wide
        self.method, self.kept, self.window = method, {}, method.window

    def keep(self, layer, stage2=None):
        kept = self.method.keep(layer, stage2)
        self.kept[layer.layer_idx] = kept
        return kept


def masked_reference_logits(model, input_ids, kept, n_steps, tokens, question=None):
    """Dense cache, eager attention, evicted positions masked per layer and KV head.

    The prompt is prefilled with plain causal attention; every later forward (the question, if
    any, then one token per step) sees only the kept prompt entries and the tokens added since."""
    n = input_ids.shape[1]
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def masked_eager(module, query, key, value, attention_mask, scaling=None, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        window = kwargs.get("sliding_window")        # what the model passes its attention: a sliding layer's window
        if window:
            causal &= torch.arange(kv_len)[None, :] > torch.arange(kv_len - q_len, kv_len)[:, None] - window
        allowed = causal[None].repeat(query.shape[1], 1, 1)
        heads = kept.get(module.layer_idx)
        if kv_len > q_len and heads is not None:
            for h in range(query.shape[1]):
                held = torch.zeros(n, dtype=torch.bool)
                held[heads[h if len(heads) == query.shape[1] else h // group]] = True   # per query head, or KV head
                allowed[h, :, :n] &= held
        k = key.repeat_interleave(group, dim=1)
        v = value.repeat_interleave(group, dim=1)
        scores = (query @ k.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register("masked_ref", masked_eager)
    model.set_attn_implementation("masked_ref")
    try:
        cache = DynamicCache()        # every entry of every layer: the sliding windows are masked above
        out = [model(input_ids=input_ids, past_key_values=cache).logits[0, -1:]]
        if question is not None:
            out.append(model(input_ids=question, past_key_values=cache).logits[0])
        for t in range(n_steps):
            out.append(model(input_ids=torch.tensor([[tokens[t]]]), past_key_values=cache).logits[0, -1:])
        return torch.cat(out)
    finally:
        model.set_attn_implementation("pcs")


def compressed_logits(model, input_ids, method, tokens, question=None, room=256):
    cache = CompressedCache.of(model.config, room)
    n = input_ids.shape[1]
    with compress_after_prefill(model, method, cache):
        out = [model(input_ids=input_ids, past_key_values=cache).logits[0, -1:]]
    if question is not None:
        q = question.shape[1]
        out.append(model(input_ids=question, position_ids=torch.arange(n, n + q)[None],
                         past_key_values=cache).logits[0])
        n += q
    for t, tok in enumerate(tokens):
        out.append(model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[n + t]]),
                         past_key_values=cache).logits[0, -1:])
    return torch.cat(out), cache


def squad_like(n_articles=20, paragraphs=4, questions=3, words=15):
    """A SQuAD 2.0-shaped dev set: articles of paragraphs, answerable and impossible questions."""
    data = []
    for a in range(n_articles):
        paras = []
        for p in range(paragraphs):
            qas = [{"question": f"q{a}.{p}.{q}?", "is_impossible": q == 1,
                    "answers": [] if q == 1 else [{"text": f"ans{a}{p}{q}"}, {"text": f"alt{a}{p}{q}"}]}
                   for q in range(questions)]
            answers = [a["text"] for qa in qas for a in qa["answers"][:1]]    # each paragraph holds its answers
            paras.append({"context": " ".join([f"word{a}{p}{i}" for i in range(words + 5 * p)] + answers), "qas": qas})
        data.append({"title": f"t{a}", "paragraphs": paras})
    return {"data": data}


def hotpot_like(n=40, titles=100):
    """A HotpotQA-shaped distractor set: each question with 4 titled paragraphs of sentences, shared across questions."""
    return [{"question": f"which {i}?", "answer": f"a{i}",
             "context": [[f"title{(i * 7 + j) % titles}",
                          [f"s{(i * 7 + j) % titles}.{k} x y z " for k in range(3 + j % 4)] + [f"a{i} " if j == 0 else ""]]
                         for j in range(4)]}
            for i in range(n)]
