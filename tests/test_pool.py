"""The decode pool gives every sequence the tokens batch-1 decoding gives it.

The reference is the batch-1 loop the engine had before the pool (its ``decode`` and ``generate_on``,
transcribed below): one sequence, its own ``CompressedCache``, one forward per token, whose cache the
masked-full-attention tests of ``test_cache.py`` check. Every method x selection x profile, with the question
fed after compression, decoding-time recompression, per-row stops and minimum and maximum lengths, decodes in
pools of 1, 3 and 8 sequences that arrive in different orders. A row may differ only where batch 1's top two
logits at the first differing token are within ``NEAR_TIE`` (batched matrix products round differently).
"""
from pathlib import Path
import itertools
import random

import pytest
import torch

from pcs.cache import CompressedCache, CompressibleLayer
from pcs.compression import compress_after_prefill
from pcs.bench.instrument import StepKernels, StepOps
from pcs.engine import Arrival, Cell, DecodePool, decode, prefill
from pcs.engine.pool_cache import PoolCache

from conftest import ARCHITECTURES, compose_cfg, tiny_model
from oracles import (COMPILED_KERNELS_PER_LAYER, LENGTH_CELLS, TRIGGERED, WINDOWED, Spy, batch1, build, compare,
                     masked_reference_logits, samples)


CELLS = ([(f"method={m}", f"selection={s}", f"profile={p}") for m, s, p in itertools.product(
            WINDOWED, ("attention", "perturbation", "perturbation_released"), ("paper", "kvpress", "adakv",
                                                                            "kvcache_factory"))]
         + [("method=full",), ("method=streamingllm",), ("method=laprox",)])


def test_pooled_decoding_gives_batch_one_tokens(arch):
    model = tiny_model(arch)
    differ, _, compared = compare(model, samples(model), CELLS)
    assert compared == 3 * 4 * len(CELLS) and differ <= compared // 100


def test_pooled_decoding_time_compression_gives_batch_one_tokens(arch):
    """Triggers crossed many times over long answers, rows of different methods recompressing at different steps."""
    model = tiny_model(arch)
    sample_list = samples(model)
    for s in sample_list:
        s["max_new"], s["stops"] = 40, set()
    _, _, compared = compare(model, sample_list, TRIGGERED, triggers=[60] * len(TRIGGERED))
    assert compared == 3 * 4 * len(TRIGGERED)


def test_pooled_decoding_time_compression_with_other_windows_gives_batch_one_tokens():
    """Triggered cells reading windows of 16, 8 and 4 queries (and the full cache, whose trigger means nothing)
    join and leave in shuffled orders: the query rings never narrow under a sequence that reads more."""
    model = tiny_model("llama")
    sample_list = samples(model)
    for s in sample_list:
        s["max_new"], s["stops"] = 30, set()
    cells = [("method=snapkv", "method.window=16"), ("method=adakv", "selection=perturbation", "method.window=4"),
             ("method=snapkv", "selection=perturbation"), ("method=full",)]
    _, _, compared = compare(model, sample_list, cells, sizes=(2, 3), triggers=[50] * len(cells))
    assert compared == 2 * 4 * len(cells)


def prefilled(model, windows, trigger=60, max_new=8):
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    cells = [Cell(build(("method=snapkv", f"method.window={w}")), trigger) if w else Cell(build(("method=full",)))
             for w in windows]
    return prefill(model, ids, cells, max_new, set())


@pytest.mark.parametrize("trigger", [None, 50])
def test_a_trigger_bounds_the_room_a_long_answer_reserves(trigger):
    """2,000 tokens to come: without a trigger each head may grow by as many, with one it never holds more than
    the trigger + 1 entries, and the pool's buffers are sized for that."""
    model = tiny_model("llama")
    (seq,) = prefilled(model, [8], trigger=trigger, max_new=2000)
    pool = DecodePool(model, 2)
    with torch.inference_mode():
        pool.join(seq)
    capacity = pool.layers[0].capacity
    assert capacity >= 40 + 2000 if trigger is None else 40 + 51 <= capacity < 1000


def test_a_ring_keeps_its_width_when_a_narrower_window_joins_past_its_rows():
    """A 16-query sequence and a 4-query one join, the first leaves, an untriggered one joins; another 4-query one
    then takes slot 2, past the rings' two rows: they grow their rows and keep 16 columns (the one in flight may
    have remembered more than 4), the newcomer's 4 queries at the end. Once no sequence in flight has a trigger,
    the rings go."""
    model = tiny_model("llama")
    wide, narrow, plain, other = prefilled(model, [16, 4, 0, 4])
    recent = [layer.recent_queries for layer in other.cache.layers]
    pool = DecodePool(model, 8)
    with torch.inference_mode():         # as decode() runs them
        pool.join(wide)
        pool.join(narrow)
        pool.leave(0)
        pool.join(plain)
        pool.join(other)
        assert other.n_queries == 4
        rings = pool.rings
        assert rings.slots >= 3 and rings.window == 16
        for i, queries in enumerate(recent):
            torch.testing.assert_close(rings.newest(i, 2, 4), queries[:, -4:])
            assert not rings.newest(i, 2, 16)[:, :-4].any()
        pool.leave(2)
        pool.leave(0)
    assert pool.rings is None and all(layer.recorder is None for layer in pool.layers)


def test_a_sequence_remembers_its_queries_when_the_last_layer_slides():
    """Gemma 3's larger models end in sliding layers, which remember nothing: the count comes from the layers
    that are compressed again."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    from conftest import TINY
    from pcs.models import prepare
    torch.manual_seed(0)
    model = prepare(AutoModelForCausalLM.from_config(Gemma3TextConfig(
        **TINY, head_dim=8, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["full_attention", "sliding_attention"] * 2)))
    (seq,) = prefilled(model, [8])
    pool = DecodePool(model, 4)
    pool.join(seq)
    assert seq.n_queries == 8
    assert pool.rings.layers == [0, 2] and sorted(pool.rings.rings) == [0, 2]    # sliding layers: no ring


def test_a_slot_whose_query_heads_chose_apart_is_refused_recompression_as_batch_one_refuses_it():
    """profile.gqa=per_query_head keeps a mask row per query head; recompressing would drop them. Config
    validation refuses a trigger with it; through the engine's own API the pool raises as batch 1 does."""
    model = tiny_model("llama")
    cell = ("method=snapkv", "selection=perturbation", "profile.gqa=per_query_head")
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match="chose apart"):
        batch1(model, ids, [build(cell)], 30, set(), triggers=[45])
    arrival = Arrival(model, ids, [Cell(build(cell), 45)], 30, set())
    with pytest.raises(RuntimeError, match="chose apart"):
        list(decode(DecodePool(model, 2), [arrival]))


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_what_a_join_would_allocate_is_counted_before_it_joins(layout, request):
    """``DecodePool.growth``, which decides whether a sequence is admitted, counts at least the bytes of the
    buffers its join then allocates (and not twice as many): a first sequence, a second past the slots, one
    whose query heads chose apart (a mask row each), and ones with a trigger (query rings of their windows); each
    slot at the longest's capacity, or (where attention reads each head's length) each at its own."""
    if layout == "jagged":
        request.getfixturevalue("through_lengths")
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    cells = [(("method=snapkv",), None), (("method=adakv", "selection=perturbation"), 60),
             (("method=snapkv", "selection=perturbation", "profile.gqa=per_query_head"), None),
             (("method=snapkv", "method.window=16"), 60), (("method=full",), None)]
    sequences = prefill(model, ids, [Cell(build(c), trigger) for c, trigger in cells], 20, set())
    pool = DecodePool(model, 8)

    def buffers():
        tensors = [t for layer in pool.layers for t in (layer.key_buffer, layer.value_buffer, layer.allowed)]
        tensors += list(pool.rings.rings.values()) if pool.rings is not None else []
        # the tensors themselves, held: a freed buffer's id could be taken by a new one and hide it
        return {id(t): t for t in tensors + [t for t in (pool.logits, pool.stop_mask) if t is not None]}
    with torch.inference_mode():
        for seq in sequences:
            before, counted = buffers(), pool.growth(seq)
            pool.join(seq)
            allocated = sum(t.nbytes for key, t in buffers().items() if key not in before)
            assert allocated <= counted <= 2 * allocated + 1, (seq.method, allocated, counted)


def test_a_full_cache_in_flight_leaves_the_compressed_rows_their_own_capacity(through_lengths):
    """A full cache of 600 entries per head beside seven rows of 40: where attention reads each head's length,
    each full-attention layer holds what the rows reserved (their own entries and room, rounded to ``ALIGN``; the
    growth of its buffer aside), not eight slots of the longest row's capacity."""
    from pcs.engine.jagged import ALIGN, JaggedPoolLayer
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 600), generator=torch.Generator().manual_seed(5))
    cells = [Cell(build(("method=full",)))] + [Cell(build(("method=snapkv",)))] * 7
    pool = DecodePool(model, 8)
    with torch.inference_mode():
        for seq in prefill(model, ids, cells, 20, set()):
            pool.join(seq)
    for layer in pool.layers:
        assert isinstance(layer, JaggedPoolLayer)
        own = layer.n_kv_heads * (1 + sum(-(-(max(n) + 20) // ALIGN) * ALIGN for n in layer.lengths[:8]))
        assert layer.total - layer.regions.total() == own
        assert own <= layer.total <= 1.5 * own
        assert layer.total < 8 * layer.n_kv_heads * (600 + 20) / 3


def test_a_method_that_keeps_everything_is_never_compressed_again():
    assert Cell(build(("method=full",)), 60).trigger is None
    assert Cell(build(("method=snapkv",)), 60).trigger == 60


# On the embedded model: each method x selection once, the four profiles taken in turn (the tiny models run every
# cell), and the methods without selections.
EMBEDDED_CELLS = ([(f"method={m}", f"selection={s}", f"profile={p}") for (m, s), p in zip(
                      itertools.product(WINDOWED, ("attention", "perturbation", "perturbation_released")),
                      itertools.cycle(("paper", "kvpress", "adakv", "kvcache_factory")))]
                  + [("method=full",), ("method=streamingllm",), ("method=laprox",)])


@pytest.mark.embedded
def test_pooled_decoding_on_the_embedded_model(embedded_dir):
    """Real weights (30 layers) on one 260-token prompt whose question is fed after compression."""
    from transformers import AutoModelForCausalLM
    from pcs.models import prepare
    model = prepare(AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32))
    g = torch.Generator().manual_seed(1)
    sample_list = [dict(ids=torch.randint(100, 40000, (1, 260), generator=g), max_new=8, min_new=0, stops=set(),
                        question=torch.randint(100, 40000, (1, 6), generator=g))]
    differ, _, compared = compare(model, sample_list, EMBEDDED_CELLS)
    assert compared == 3 * len(EMBEDDED_CELLS) and differ <= 1


@pytest.fixture
def through_lengths(monkeypatch):
    """Pools attend as on CUDA, through ``pcs.kernels.decode_attention``: each (slot, KV head) over its own
    entries, by the lengths the pool keeps on the device, the mask only for query heads that chose apart. On a CPU
    its torch reference computes it; under ``TRITON_INTERPRET=1`` (with Triton installed) the kernel itself."""
    from pcs.engine import pool_cache as pool_module
    monkeypatch.setattr(pool_module.decode_attention, "available", lambda device, d: True)


def test_pooled_decoding_through_head_lengths_gives_batch_one_tokens(arch, through_lengths):
    """Sequences joining, leaving and moving between slots, of per-head lengths, per-query-head choices and
    sliding windows, and rows recompressed while decoding: the device's lengths follow them all."""
    model = tiny_model(arch)
    sample_list = samples(model)
    differ, _, compared = compare(model, sample_list, LENGTH_CELLS)
    assert compared == 3 * 4 * len(LENGTH_CELLS) and differ <= compared // 100
    for s in sample_list:
        s["max_new"], s["stops"] = 30, set()
    _, _, compared = compare(model, sample_list, TRIGGERED, sizes=(3, 8), triggers=[60] * len(TRIGGERED))
    assert compared == 2 * 4 * len(TRIGGERED)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])    # Mistral's forward is Llama's here
def test_compiled_pooled_decoding_gives_batch_one_tokens(arch, through_lengths):
    """The step's forward compiled, as on CUDA (``engine.compile_step``), attending through the device's lengths,
    each sequence at its own capacity, traced by torch.compile and run by torch's own kernels (``aot_eager``: the
    graph the CUDA path compiles, without generating its code): one graph without a break, not compiled again as
    the batch and the capacity change (batch 1, a mask row per query head and a query ring are variants of their
    own); batch 1's tokens, rows recompressed while decoding included."""
    from torch._dynamo.utils import counters
    counters.clear()
    model = tiny_model(arch, layers=2)     # tracing costs each layer again; two hold every layer type
    sample_list = samples(model)
    differ, _, compared = compare(model, sample_list, LENGTH_CELLS, compiled="aot_eager")
    assert compared == 3 * 4 * len(LENGTH_CELLS) and differ <= compared // 100
    for s in sample_list:
        s["max_new"], s["stops"] = 30, set()
    _, _, compared = compare(model, sample_list, TRIGGERED, sizes=(3, 8), triggers=[60] * len(TRIGGERED),
                             compiled="aot_eager")
    assert compared == 2 * 4 * len(TRIGGERED)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 8, dict(counters["stats"])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_compiled_step_runs_few_kernels_per_layer(arch, through_lengths):
    """Compiled by inductor, as on CUDA: batch 1's tokens, and a step's kernels (counted from a profile: the matrix
    products, the attention operator and the fused norms, rotary, activations and cache writes) per layer at most
    ``COMPILED_KERNELS_PER_LAYER``, against the eager step's operations."""
    model = tiny_model(arch)
    sample_list = samples(model)[:2]
    differ, _, compared = compare(model, sample_list, [("method=adakv",), ("method=full",)], sizes=(4,),
                                  compiled=True)
    assert compared == 4 and differ == 0
    pool = DecodePool(model, 4, compiled=True)
    for s in sample_list:
        (seq,) = prefill(model, s["ids"], [Cell(build(("method=adakv",)))], 8, set())
        pool.join(seq)
    pool.step()
    eager, kernels = StepOps(), StepKernels()
    with kernels.counting():
        pool.step()
    pool.forward_step = model
    with eager.counting():
        pool.step()
    layers = model.config.num_hidden_layers
    print(f"\n[{arch}] per layer: {eager.ops / layers:.1f} operations eager, {kernels.kernels / layers:.1f} kernels "
          f"compiled")
    assert 0 < kernels.kernels <= COMPILED_KERNELS_PER_LAYER * layers < eager.ops


@pytest.mark.parametrize("attend", ["mask", "lengths"])
def test_pooled_rows_equal_masked_full_attention(arch, attend, request):
    """Independent of batch-1 decoding: sequences of different methods (per-head lengths, per-query-head masks)
    and prompt lengths share a pool; each row's logits at every step equal dense attention with that sequence's
    evicted entries masked, whether the pool attends through its mask or (as on CUDA) through each head's
    length kept on the device, which must equal the host's after every step."""
    if attend == "lengths":
        request.getfixturevalue("through_lengths")
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    cells = [("method=adakv", "selection=perturbation"), ("method=snapkv", "profile=adakv", "profile.gqa=per_query_head"),
             ("method=pyramidkv", "selection=attention"), ("method=full",)]
    rows = []
    for cell, n in zip(cells, (100, 80, 130, 60)):
        spy = Spy(build(cell))
        ids, tokens = torch.randint(0, 256, (1, n), generator=g), torch.randint(0, 256, (6,), generator=g).tolist()
        cache = CompressedCache.of(model.config, 0)
        with torch.no_grad(), compress_after_prefill(model, spy, cache):
            model(input_ids=ids, past_key_values=cache)
        rows.append((ids, tokens, spy, cache))
    pool = PoolCache(model.config, model.dtype, "cpu", kernel=True)
    assert all(layer.kernel == (attend == "lengths") for layer in pool.layers)
    for slot, (_, _, _, cache) in enumerate(rows):
        for layer, held in zip(pool.layers, cache.layers):
            layer.load(slot, held, 6)
    got = []
    with torch.no_grad():
        for t in range(6):
            ids = torch.tensor([[r[1][t]] for r in rows])
            positions = torch.tensor([[r[0].shape[1] + t] for r in rows])
            pool.prepare_step(len(rows))
            got.append(model(input_ids=ids, position_ids=positions, past_key_values=pool).logits[:, -1])
            pool.stepped(len(rows))
            for layer in pool.layers:
                held = layer.held[:len(rows) * layer.n_kv_heads].view(len(rows), -1)
                assert torch.equal(held, torch.from_numpy(layer.lengths[:len(rows)])), (t, layer)
    got = torch.stack(got, dim=1)                                 # (rows, steps, vocab)
    for row, (ids, tokens, spy, _) in enumerate(rows):
        with torch.no_grad():
            want = masked_reference_logits(model, ids, spy.kept, 6, tokens)[1:]
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)


def test_a_pooled_run_resumes_an_unpooled_one_and_pairs_with_it(tiny_model_dir, tmp_path):
    """``engine.*`` is provenance: a run started with pool 1 and finished with pool 3 is the same run folder,
    with the predictions (in sample order) an unpooled run writes, and pairs with runs of other selections."""
    import json
    from pcs.identity import RunIdentity
    from pcs.runner import run

    def needle(results, *extra):
        return compose_cfg(f"model.path={tiny_model_dir}", f"results_dir={results}", "progress=false",
                           "benchmark.context_lengths=[200,300,400]", "benchmark.depth_percents=[0,50,100]",
                           "benchmark.max_new_tokens=6", "method=adakv", "budget=64", *extra)

    def rows(cfg):
        path = Path(cfg.results_dir) / RunIdentity(cfg).folder / "predictions.jsonl"
        return [{k: v for k, v in json.loads(line).items() if k not in ("prefill_s", "decode_s")}
                for line in path.read_text().splitlines()]

    alone = needle(tmp_path / "unpooled", "engine.pool=1")
    unpooled = run(alone)
    resumed = needle(tmp_path / "resumed", "engine.pool=1")
    run(resumed)
    folder = Path(resumed.results_dir) / RunIdentity(resumed).folder
    (folder / "metrics.json").unlink()
    lines = (folder / "predictions.jsonl").read_text().splitlines()
    (folder / "predictions.jsonl").write_text("\n".join(lines[:4]) + "\n")
    pooled = needle(tmp_path / "resumed", "engine.pool=3")
    assert RunIdentity(pooled).folder == RunIdentity(alone).folder
    assert RunIdentity(pooled).pairing_key == RunIdentity(needle(tmp_path / "resumed", "engine.pool=3",
                                                                 "selection=attention")).pairing_key
    metrics = run(pooled)
    assert metrics["n_resumed"] == 4 and metrics["engine"]["pool"] == 3 and unpooled["engine"]["pool"] == 1
    assert rows(pooled) == rows(alone)
    assert metrics["score"] == unpooled["score"]
    assert "engine" not in (folder / "config.yaml").read_text()


@pytest.mark.parametrize("size", [1, 3])
def test_a_settled_answer_ends_early_as_a_prefix_of_its_whole_answer(size):
    """``Sequence.settled``: an answer whose tokens decide it leaves the pool at the next multiple of
    SETTLE_EVERY; its tokens are the whole answer's first ones, and answers without the test run to the end."""
    from pcs.engine.decode import SETTLE_EVERY
    model = tiny_model("llama")
    sample_list = samples(model)
    cells = [("method=full",), ("method=snapkv", "selection=perturbation")]
    for s in sample_list:
        s["max_new"], s["stops"] = 16, set()
    whole = {}
    for i, s in enumerate(sample_list):
        for j, answer in enumerate(batch1(model, s["ids"], [build(c) for c in cells], 16, set(), s["question"])):
            whole[(i, j)] = answer["tokens"]
    # the answer is decided once it holds its own 3rd token (seen at token 3 or later): a test that knows it
    marks = {key: tokens[2] for key, tokens in whole.items()}

    def arrivals():
        for i, s in enumerate(sample_list):
            tests = [(lambda ids, m=marks[(i, j)]: m in ids) if j == 0 else None for j in range(len(cells))]
            yield Arrival(model, s["ids"], [Cell(build(c), None, (t,)) for c, t in zip(cells, tests)], 16, set(),
                          s["question"], owners=[(i, j) for j in range(len(cells))])

    got = {seq.owner: seq.result.token_ids for seq in decode(DecodePool(model, size), arrivals())}
    for (i, j), tokens in got.items():
        if j == 1:
            assert tokens == whole[(i, j)]                    # no test: decoded to its maximum
            continue
        first = whole[(i, j)].index(marks[(i, j)]) + 1        # the answer holds its mark from this many tokens on
        end = -(-first // SETTLE_EVERY) * SETTLE_EVERY         # asked every SETTLE_EVERY tokens
        assert tokens == whole[(i, j)][:end] and len(tokens) < 16


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cpu_attention_split_by_slot_keeps_every_bit(arch, monkeypatch):
    """On CPU a step's attention reads each run of slots' own whole key blocks (``read_spans``): a full cache of
    ~1,000 entries among compressed ones of 40. Every row's logits at every step are the bits of one call over
    every slot's keys, which on one thread is what keeps answers independent of the rest of the pool (on more
    threads CPU attention's bits depend on the batch at some head shapes, split or not: pcs/engine/pool.py). Heads
    of Gemma 3's size (256): at the tiny models' 8 a split inside a block keeps the bits too, and the test could
    not fail."""
    import pcs.engine.pool as pool_module
    from transformers import AutoModelForCausalLM
    from pcs.models import prepare
    torch.manual_seed(0)
    config = ARCHITECTURES[arch]()
    config.head_dim = 256
    model = prepare(AutoModelForCausalLM.from_config(config))
    g = torch.Generator().manual_seed(5)
    cells = [("method=snapkv", "selection=perturbation"), ("method=full",), ("method=adakv", "selection=attention"),
             ("method=snapkv", "selection=attention"), ("method=full",)]
    rows = []
    for cell, n in zip(cells, (300, 1000, 700, 120, 200)):
        ids, tokens = torch.randint(0, 256, (1, n), generator=g), torch.randint(0, 256, (6,), generator=g).tolist()
        cache = CompressedCache.of(model.config, 0)
        with torch.no_grad(), compress_after_prefill(model, build(cell), cache):
            model(input_ids=ids, past_key_values=cache)
        rows.append((ids, tokens, cache))

    def decode_steps():
        pool = PoolCache(model.config, model.dtype, "cpu")
        for slot, (_, _, cache) in enumerate(rows):
            for layer, held in zip(pool.layers, cache.layers):
                layer.load(slot, held, 6)
        logits, spans = [], []
        with torch.no_grad():
            for t in range(6):
                pool.prepare_step(len(rows))
                spans += [layer.spans for layer in pool.layers]
                logits.append(model(input_ids=torch.tensor([[r[1][t]] for r in rows]),
                                    position_ids=torch.tensor([[r[0].shape[1] + t] for r in rows]),
                                    past_key_values=pool).logits[:, -1])
                pool.stepped(len(rows))
        return torch.stack(logits), spans

    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # the split is taken (read_spans) whatever threads the suite runs with
    try:
        split, spans = decode_steps()
    finally:
        torch.set_num_threads(threads)
    full_layers = [s for s, layer in zip(spans, PoolCache(model.config, model.dtype, "cpu").layers * 6)
                   if not layer.is_sliding]
    assert all(s is not None and len(s) >= 3 for s in full_layers)      # the 1,000-entry slot reads two blocks
    monkeypatch.setattr(pool_module, "read_spans", lambda *args: None)
    whole, _ = decode_steps()
    assert torch.equal(split, whole)


def test_read_spans_are_runs_of_slots_reading_whole_blocks():
    import numpy as np
    from pcs.engine.pool import CPU_KEY_BLOCK as B, read_spans
    assert read_spans(np.array([3, 40, B]), B, 1, 1) is None                 # one block: every slot reads it whole
    assert read_spans(np.array([3, 2 * B + 5, 2 * B + 9]), 2 * B + 9, 1, 1) == ((0, 1, B), (1, 3, 2 * B + 9))
    assert read_spans(np.array([B + 1, 7, 9, B + 1]), 2 * B, 3, 1) == ((0, 1, 2 * B), (1, 3, B), (3, 4, 2 * B))
    assert read_spans(np.array([100, 100]), 60, 1, 1) is None                # never past the step's width
    # The Gemma ablations' pool: per sample a full cache of 8,193 entries and ten of 2,048, one KV head. On 2
    # threads the split reads 3 x (8,193 + 5 x 2,048) keys on the busiest thread against 17 x 8,193 in one call;
    # on 16 the three long slots, each alone in its call, would keep one thread busy three times over (3 x (8,193
    # + 2,048) against 3 x 8,193): one call.
    pool = np.array(([8193] + [2048] * 10) * 3)
    assert len(read_spans(pool, 8193, 1, 2)) == 6 and read_spans(pool, 8193, 1, 1) == read_spans(pool, 8193, 1, 2)
    assert read_spans(pool, 8193, 1, 16) is None


def test_query_rings_read_as_shifted_windows():
    """``QueryRings`` writes one column per step where the pool shifted a whole window: over random joins, steps,
    wider windows, leaves and rows added, every row in flight reads the newest queries of a window shifted by one
    query at every step (the newest last, zeros before a row's first), as the pool uses them (rows in flight are
    slots ``[0, live)`` and every one is written at every step)."""
    from pcs.engine.rings import QueryRings
    g = torch.Generator().manual_seed(11)
    draw = lambda n: int(torch.randint(0, n, (1,), generator=g))          # noqa: E731
    rings = QueryRings([0, 2], 3, 4, torch.float32, "cpu")
    shifted = {}                                     # layer -> (slots, H_q, window, d), the reference

    def reserve(slots, window):
        rings.reserve(slots, window)
        for i in rings.layers:
            old = shifted.get(i, torch.zeros(0, 3, 0, 4))
            new = torch.zeros(max(slots, old.shape[0]), 3, max(window, old.shape[2]), 4)
            new[:old.shape[0], :, new.shape[2] - old.shape[2]:] = old
            shifted[i] = new

    reserve(2, 3)
    live, seen = 0, set()
    for t in range(200):
        action = draw(5)
        if action == 0:                                              # a sequence joins the next slot
            reserve(live + 1, 1)
            recent = torch.randn(3, 1 + draw(8), 4, generator=g)
            for i in rings.layers:
                n = rings.remember(live, i, recent)
                shifted[i][live] = 0
                shifted[i][live, :, shifted[i].shape[2] - n:] = recent[:, recent.shape[1] - n:]
            live += 1
        elif action == 1:                                            # a wider window
            reserve(rings.slots, rings.window + draw(3))
        elif action == 2 and live:                                   # a sequence leaves; the last takes its slot
            slot, live = draw(live), live - 1
            if slot != live:
                rings.move(live, slot)
                for i in rings.layers:
                    shifted[i][slot] = shifted[i][live]
        elif live:                                                   # a step
            for i in rings.layers:
                queries = torch.randn(live, 3, 1, 4, generator=g)
                rings.record(i, queries)
                shifted[i][:live] = torch.cat([shifted[i][:live, :, 1:], queries], dim=2)
            rings.stepped()
        seen.add(action)
        for i in rings.layers:
            for slot in range(live):
                assert torch.equal(rings.newest(i, slot, rings.window), shifted[i][slot]), (t, action, i, slot)
    assert seen == set(range(5)) and rings.window > 3


def test_query_rings_out_of_memory_while_growing_stay_as_they_were(monkeypatch):
    """Out of memory part way through growing (the second layer's ring), every ring keeps its shape and queries:
    the pool goes on with fewer answers (pcs.engine.decode), reading them as before."""
    import pcs.engine.rings as rings_module
    rings = rings_module.QueryRings([0, 1], 2, 4, torch.float32, "cpu")
    rings.reserve(2, 3)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        for i in rings.layers:
            rings.record(i, torch.randn(2, 2, 1, 4, generator=g))
        rings.stepped()
    before = {(i, slot): rings.newest(i, slot, 3) for i in rings.layers for slot in range(2)}
    calls, allocate = [], torch.zeros

    def zeros(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("out of memory")
        return allocate(*args, **kwargs)
    monkeypatch.setattr(rings_module.torch, "zeros", zeros)
    with pytest.raises(torch.OutOfMemoryError):
        rings.reserve(4, 5)
    monkeypatch.undo()
    assert len(calls) == 2                               # the first layer's ring was allocated
    assert (rings.slots, rings.window) == (2, 3) and all(r.shape == (2, 2, 3, 4) for r in rings.rings.values())
    assert all(torch.equal(rings.newest(i, slot, 3), q) for (i, slot), q in before.items())
    rings.reserve(4, 5)                                  # and grows once memory allows
    assert all(torch.equal(rings.newest(i, slot, 3), q) for (i, slot), q in before.items())


@pytest.mark.parametrize("slots, window", [(4, 3), (2, 6), (4, 6)])
def test_query_rings_growth_counts_its_peak(slots, window):
    """``bytes_for``, what admission counts for the rings, covers the most ``reserve`` holds at once beyond the old
    rings (every new ring before any old one goes, and a widening window's rolled copy), from the profiler's record
    of every allocation, and is not more than that peak."""
    from oracles import peak_allocated_bytes
    from pcs.engine.rings import QueryRings
    rings = QueryRings([0, 1, 2], 2, 4, torch.float32, "cpu")
    rings.reserve(2, 3)
    for _ in range(2):
        for i in rings.layers:
            rings.record(i, torch.randn(2, 2, 1, 4))
        rings.stepped()
    counted = rings.bytes_for(slots, window)
    peak = peak_allocated_bytes(lambda: rings.reserve(slots, window))
    assert peak <= counted <= peak + 64


def test_a_graph_warm_up_leaves_the_pool_as_one_step_leaves_it(arch):
    """Before capturing a bucket, ``StepGraphs`` runs the step once outside the graph and puts back what that step
    advanced: every tensor a step updates in place (write indices, the device's lengths, masks, entries) must then
    be as after one step alone, or the captured replays would start one entry off."""
    from types import SimpleNamespace

    from pcs.engine.graphs import StepGraphs
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(4)
    rows = []
    for cell, n in zip([("method=adakv", "selection=attention"), ("method=full",)], (90, 60)):
        cache = CompressedCache.of(model.config, 0)
        with torch.no_grad(), compress_after_prefill(model, build(cell), cache):
            model(input_ids=torch.randint(0, 256, (1, n), generator=g), past_key_values=cache)
        rows.append((n, cache))
    pools = []
    for warm_up in (False, True):
        pool = PoolCache(model.config, model.dtype, "cpu")
        for slot, (_, cache) in enumerate(rows):
            for layer, held in zip(pool.layers, cache.layers):
                layer.load(slot, held, 4)
        ids, positions = torch.tensor([[5], [7]]), torch.tensor([[n] for n, _ in rows])
        pool.prepare_step(len(rows), whole_capacity=True)
        with torch.no_grad():
            if warm_up:
                graphs = StepGraphs.__new__(StepGraphs)
                graphs.pool = SimpleNamespace(layers=pool.layers, rings=None)
                saved = graphs.state()
                model(input_ids=torch.tensor([[1], [2]]), position_ids=positions, past_key_values=pool)
                graphs.restore(saved)
            model(input_ids=ids, position_ids=positions, past_key_values=pool)
        pools.append(pool)
    for alone, warmed in zip(*(p.layers for p in pools)):
        for name in ("next_slot", "next_allowed", "held", "advance", "allowed", "key_buffer", "value_buffer"):
            assert torch.equal(getattr(alone, name), getattr(warmed, name)), name


def test_jagged_regions_keep_every_sequences_entries_through_leaves_packing_and_growth(monkeypatch):
    """The store of ``pcs.engine.jagged`` against a dictionary of what each slot loaded: 300 random joins (per-head
    lengths, room), leaves (the last slot moving in, or freed) and reloads (recompression), until its regions were
    both packed in place and moved into a larger buffer. After each, every slot reads back its own entries and
    mask, the offsets and write indices on the device follow, and the sink, the regions and the free ranges cover
    the buffer once."""
    from pcs.engine.jagged import ALIGN, JaggedPoolLayer
    repacks = []
    original = JaggedPoolLayer.repack
    monkeypatch.setattr(JaggedPoolLayer, "repack",
                        lambda self, total: (repacks.append(total == self.total), original(self, total))[1])
    h, d, rng = 2, 4, random.Random(0)
    g = torch.Generator().manual_seed(0)
    layer, want, live = JaggedPoolLayer(h, d, torch.float32, "cpu", 8), {}, 0

    def batch_one(longest):
        lengths = [rng.randint(1, longest) for _ in range(h)]
        row = CompressibleLayer(room=0)
        keys, values = torch.randn(h, longest, d, generator=g), torch.randn(h, longest, d, generator=g)
        row.lazy_initialization(keys, values)
        row.fill(keys, values, lengths)
        return row, [(keys[i, :n], values[i, :n]) for i, n in enumerate(lengths)]

    for _ in range(300):
        action = rng.random()
        if live < 8 and (action < 0.45 or not live):
            row, want[live] = batch_one(rng.choice([5, 40, 300]))
            layer.load(live, row, rng.randint(0, 60))
            live += 1
        elif action < 0.85:
            slot, live = rng.randrange(live), live - 1
            layer.move(live, slot) if slot != live else layer.free(slot)
            want[slot] = want.pop(live)
        else:
            slot = rng.randrange(live)
            row, want[slot] = batch_one(rng.choice([5, 40]))
            layer.load(slot, row, 0)
        covered = torch.zeros(layer.total, dtype=torch.long)
        covered[:h] += 1
        for start, n in layer.regions.free:
            covered[start:start + n] += 1
        for slot in range(layer.slots):
            if slot < live:
                assert layer.cap[slot] % ALIGN == 0 and layer.cap[slot] >= max(len(k) for k, _ in want[slot])
                covered[layer.base[slot]:layer.base[slot] + h * layer.cap[slot]] += 1
                mask = layer.region(slot, layer.allowed)[..., 0]             # (H_kv, cap): one row, none apart
                for (k, v), (got_k, got_v), seen in zip(want[slot], layer.row_layer(slot).heads(), mask):
                    assert torch.equal(k, got_k) and torch.equal(v, got_v)
                    assert seen[:len(k)].all() and not seen[len(k):].any()
            else:
                assert layer.base[slot] == -1 and not layer.lengths[slot].any()
        assert (covered == 1).all()
        lengths = torch.from_numpy(layer.lengths.reshape(-1))
        bases = torch.tensor([layer.base[s] + i * layer.cap[s] if layer.base[s] >= 0 else i
                              for s in range(layer.slots) for i in range(h)])
        assert torch.equal(layer.bases, bases) and torch.equal(layer.held, lengths)
        assert torch.equal(layer.next_slot, bases + lengths)
    assert True in repacks and False in repacks, repacks
