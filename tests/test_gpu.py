"""CUDA: the compressed cache decodes on the GPU as on the CPU (whose decoding the masked-full-attention
tests check), in at most 2 attention calls per layer and token, and one prefill shared by many cells gives
each what its own prefill gives. Run by scripts/gpu_check.sh; skipped where there is no CUDA."""
import pytest
import torch

from pcs.cache import CompressedCache
from pcs.compression import compress_after_prefill
from pcs.eviction import build_method
from pcs.generate import greedy_generate, greedy_generate_each

from conftest import compose_cfg, tiny_model

pytestmark = pytest.mark.gpu

# Official AdaKV breaks ties in torch.topk's order, which differs between CPU and CUDA (its max pooling makes
# ties common; on CPU, ties=earlier gives the very lengths CUDA gave with topk): the engine is compared here
# with ties broken the same way on both.
CELLS = [("method=snapkv", "selection=perturbation"), ("method=adakv", "selection=attention"),
         ("method=adakv", "profile=adakv", "profile.ties=earlier", "selection=attention"),
         ("method=pyramidkv", "selection=perturbation"),
         ("method=streamingllm",), ("method=laprox",), ("method=full",)]


def method(cell, budget=40):
    window = [] if cell[0] in ("method=full", "method=streamingllm", "method=laprox") else ["method.window=8"]
    return build_method(compose_cfg(*cell, f"budget={budget}", *window))


def logits(model, device, chosen, ids, tokens, question):
    """The prefill's last logits, the question's, then one per decoded token, on ``device``."""
    model = model.to(device)
    cache = CompressedCache.of(model.config)
    n = ids.shape[1]
    with torch.no_grad():
        with compress_after_prefill(model, chosen, cache):
            out = [model(input_ids=ids.to(device), past_key_values=cache).logits[0, -1:]]
        out.append(model(input_ids=question.to(device), position_ids=torch.arange(n, n + 5, device=device)[None],
                         past_key_values=cache).logits[0])
        for t, tok in enumerate(tokens):
            out.append(model(input_ids=torch.tensor([[tok]], device=device),
                             position_ids=torch.tensor([[n + 5 + t]], device=device), past_key_values=cache).logits[0])
    return torch.cat(out).cpu(), cache


@pytest.mark.parametrize("cell", CELLS)
def test_cuda_decoding_equals_cpu_decoding(arch, cell):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(0)
    ids, question = torch.randint(0, 256, (1, 150), generator=g), torch.randint(0, 256, (1, 5), generator=g)
    tokens = torch.randint(0, 256, (6,), generator=g).tolist()
    want, _ = logits(model, "cpu", method(cell), ids, tokens, question)
    got, cache = logits(model, "cuda", method(cell), ids, tokens, question)
    assert cache.layers[0].key_buffer.is_cuda
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cell", CELLS)
def test_cuda_decoding_takes_at_most_two_attention_calls_per_layer(cell):
    model = tiny_model("llama").cuda()
    ids = torch.randint(0, 256, (1, 200), device="cuda")
    with torch.profiler.profile() as prof:
        gen = greedy_generate(model, ids, method(cell), 9, set())
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
    layers = model.config.num_hidden_layers
    assert len(gen.token_ids) == 9 and calls - layers <= 2 * layers * 8


@pytest.mark.parametrize("cell", [CELLS[1], CELLS[-1]])
def test_cuda_decoding_stays_off_cudnn_attention(cell):
    """cuDNN's attention builds an execution plan for every new key length, and decoding meets one per step
    (on an H100: 24 ms of CPU per call, a second per token for 32 layers): decoding must not reach it. The
    prefill may; so, with cuDNN ranked first everywhere (torch's own order may not rank it first, and then the
    comparison below would hold with no cuDNN call at all), the prefill must reach it and the cuDNN events of a
    6-token generation must equal those of a 1-token one (prefill only), whatever number of profiler events one
    cuDNN call shows as."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 300), device="cuda")
    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]

    def cudnn_events(new_tokens):
        with sdpa_kernel(cudnn_first, set_priority=True), \
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            gen = greedy_generate(model, ids, method(cell), new_tokens, set())
        assert len(gen.token_ids) == new_tokens
        return sum(e.count for e in prof.key_averages() if "cudnn_attention" in e.key)

    prefill_only = cudnn_events(1)
    if prefill_only == 0:
        pytest.skip("cuDNN attention does not take this prefill on this GPU and torch: nothing to keep decoding from")
    assert cudnn_events(6) == prefill_only


def test_cuda_shared_prefill_gives_each_cell_its_own_result():
    model = tiny_model("llama").cuda()
    ids = torch.randint(0, 256, (1, 300), device="cuda")
    built = [method(cell) for cell in CELLS]
    shared = greedy_generate_each(model, ids, built, 10, set())
    for chosen, got in zip(built, shared):
        alone = greedy_generate(model, ids, chosen, 10, set())
        assert got.token_ids == alone.token_ids and got.kv_cache_bytes == alone.kv_cache_bytes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_compression_behind_the_forward_keeps_what_compression_after_each_layer_keeps(arch):
    """On CUDA each layer is compressed on a second stream, behind the forward, while the next layers' forward runs;
    every cell's cache (entries, lengths, masks) is bit for bit what compressing each layer right after its forward,
    on the forward's stream, gives."""
    import pcs.compression
    from pcs.compression import compress_each_after_prefill
    model = tiny_model(arch).cuda()
    ids = torch.randint(0, 256, (1, 900), generator=torch.Generator().manual_seed(7)).cuda()
    built = [method(cell) for cell in CELLS]

    from pcs.options import defaults

    def held(options):
        caches = [CompressedCache.of(model.config) for _ in built]
        with torch.no_grad(), compress_each_after_prefill(model, built, caches, options):
            model(input_ids=ids, past_key_values=caches[0])
        return [[[x.cpu() if torch.is_tensor(x) else x for x in layer.held()] for layer in cache.layers]
                for cache in caches]

    assert pcs.compression.layers_behind(torch.device("cuda"), defaults()) > 0
    beside = held(defaults())
    after = held(defaults().with_(layers_behind=0))
    for cell_beside, cell_after in zip(beside, after):
        for layer_beside, layer_after in zip(cell_beside, cell_after):
            for x, y in zip(layer_beside, layer_after):
                assert torch.equal(x, y) if torch.is_tensor(x) else x == y


def test_bench_runs_long_contexts_in_bfloat16():
    from pcs.bench.__main__ import main
    assert main(["--model", "llama31-shape", "--layers", "2", "--contexts", "8192", "--device", "cuda",
                 "--methods", "snapkv", "adakv", "--budgets", "128", "--repeats", "1", "--decode-tokens", "4"]) == 0


@pytest.mark.parametrize("graph_arch", ["llama", "gemma3"])
def test_cuda_graph_decoding_gives_eager_tokens_and_never_syncs_inside_a_step(graph_arch):
    """The decode pool replaying captured graphs (pool-size buckets 1 to 8, sequences joining and leaving) gives the
    tokens of eager steps; a replayed forward makes no host synchronisation (the step's one is reading its tokens).
    Gemma 3's sliding-window layers decode from rings whose write slot advances on the device inside the graph."""
    from pcs.engine import Arrival, Cell, DecodePool, decode, prefill
    model = tiny_model(graph_arch).cuda()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (1, n), generator=g).cuda() for n in (120, 200, 90)]
    cells = [CELLS[0], CELLS[1], CELLS[2], CELLS[3], CELLS[-1]]

    def answers(graphs):
        pool = DecodePool(model, 8, graphs)
        arrivals = (Arrival(model, ids, [Cell(method(c)) for c in cells], 10 + 3 * i, set(),
                            owners=[(i, j) for j in range(len(cells))]) for i, ids in enumerate(prompts))
        return {seq.owner: seq.result.token_ids for seq in decode(pool, arrivals)}, pool

    eager, _ = answers(False)
    graphed, pool = answers(True)
    assert graphed == eager and pool.graphs.graphs
    (seq,) = prefill(model, prompts[0], [Cell(method(CELLS[0]))], 6, set())
    pool.join(seq)
    pool.step()                                   # captures this layout's bucket
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.sequences[0].result.token_ids.append(1)
        with torch.inference_mode():          # as in step(): the pool's buffers are inference tensors
            pool.forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("graph_arch", ["llama", "gemma3"])
def test_cuda_graph_decoding_with_triggers_gives_eager_tokens(graph_arch):
    """Decoding-time recompression under captured graphs: every step's queries go into the rings inside the
    replayed forward, rows cross their triggers at different steps (recompressed between forwards, a new layout
    each time) and rows without a trigger share the pool; the tokens are the eager steps'."""
    from pcs.engine import Arrival, Cell, DecodePool, decode
    model = tiny_model(graph_arch).cuda()
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (1, n), generator=g).cuda() for n in (120, 200, 90)]
    cells = [(CELLS[0], 60), (CELLS[1], 52), (CELLS[3], None), (CELLS[4], 48), (CELLS[5], 60)]

    def answers(graphs):
        pool = DecodePool(model, 8, graphs)
        arrivals = (Arrival(model, ids, [Cell(method(c), trigger) for c, trigger in cells], 30 + 5 * i, set(),
                            owners=[(i, j) for j in range(len(cells))]) for i, ids in enumerate(prompts))
        return {seq.owner: (seq.result.token_ids, seq.result.n_compressions)
                for seq in decode(pool, arrivals)}, pool

    eager, _ = answers(False)
    graphed, pool = answers(True)
    assert graphed == eager and pool.graphs.graphs
    assert all(n > 0 for (i, j), (_, n) in eager.items() if cells[j][1] is not None)   # every trigger was crossed


def test_cuda_pooled_decoding_through_the_kernel_gives_batch_one_tokens(arch):
    """Pools of 1, 3 and 8 replaying captured graphs of the compiled step (the defaults), every row attending through
    pcs.kernels.decode_attention over its own entries (per-head lengths, per-query-head choices, sliding windows, the
    full cache beside compressed rows), against each sequence decoded alone, eagerly, on its batch-1 cache: the same
    tokens but at near-ties (tests/test_pool.py's ``compare``); then rows recompressed while decoding. A replayed
    step runs at most ``COMPILED_KERNELS_PER_LAYER`` kernels per layer, as CUDA's profiler counts them."""
    from pcs.bench.instrument import StepKernels
    from pcs.engine import Cell, DecodePool, prefill
    from oracles import COMPILED_KERNELS_PER_LAYER, LENGTH_CELLS, TRIGGERED, build, compare, samples
    model = tiny_model(arch).cuda()
    pool = DecodePool(model, 4, graphs=True)
    assert pool.compiled and all(layer.kernel for layer in pool.cache.layers)
    sample_list = samples(model)
    differ, _, compared = compare(model, sample_list, LENGTH_CELLS, graphs=True)
    assert compared == 3 * 4 * len(LENGTH_CELLS) and differ <= compared // 100
    for s in sample_list[:2]:
        (seq,) = prefill(model, s["ids"], [Cell(build(("method=adakv",)))], 8, set())
        pool.join(seq)
    pool.step()
    kernels = StepKernels()
    with kernels.counting():
        pool.step()
    layers = model.config.num_hidden_layers
    print(f"\n[{arch}] {kernels.kernels / layers:.1f} kernels per layer in a replayed step")
    assert 0 < kernels.kernels <= COMPILED_KERNELS_PER_LAYER * layers
    for s in sample_list:
        s["max_new"], s["stops"] = 30, set()
    differ, _, compared = compare(model, sample_list, TRIGGERED, sizes=(3, 8), triggers=[60] * len(TRIGGERED),
                                  graphs=True)
    assert compared == 2 * 4 * len(TRIGGERED) and differ <= compared // 100


def cuda_layer(n, seed=0, dtype=torch.bfloat16, h_kv=8, h_q=32, d=128, hidden=4096):
    """One layer of Llama-3.1-8B's shapes with random bfloat16 values, on the GPU."""
    from pcs.eviction.base import LayerState
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=dtype)   # noqa: E731
    return LayerState(10, 32, rand(h_kv, n, d), rand(h_kv, n, d), rand(h_q, 64, d) * 2, rand(hidden, h_q * d) / 64)


def stage2_of(**search):
    """Stage 2 with its options changed from the defaults (``pcs.options.Stage2Search``)."""
    import dataclasses
    from pcs.eviction.stage2_search import Stage2Run
    from pcs.options import defaults
    return Stage2Run(dataclasses.replace(defaults().stage2, **search))


STAGE2_CELLS = [("method=snapkv", "selection=perturbation"), ("method=pyramidkv", "selection=perturbation"),
                ("method=adakv", "selection=perturbation"), ("preset=criticalkv", "method=snapkv"),
                ("preset=criticalkv", "method=adakv"), ("method=adakv", "profile=adakv", "selection=perturbation")]


@pytest.mark.parametrize("cell", STAGE2_CELLS)
def test_cuda_layer_compression_syncs_a_constant_number_of_times(cell):
    """CUDA's own count of host synchronisations (set_sync_debug_mode warns at each) in one layer's compression is at
    most test_selection.MOST_HOST_READS at 4K and at 32K tokens (the budgets, stage 2's rounds), with the bounded
    search at both (the search that reads the device)."""
    from oracles import MOST_HOST_READS
    chosen = build_method(compose_cfg(*cell, "budget=1024"))
    counts = [cuda_syncs(chosen, cuda_layer(n), stage2_of(search="bounded")) for n in (4096, 32768)]
    assert 1 <= min(counts) and max(counts) <= MOST_HOST_READS, counts


def cuda_syncs(method, layer, stage2) -> int:
    """Host synchronisations CUDA counts (set_sync_debug_mode warns at each) in one ``keep`` of ``layer``, warm."""
    import warnings
    method.keep(layer, stage2)                                # warm-up: kernels, allocator
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            method.keep(layer, stage2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("cell", STAGE2_CELLS)
def test_cuda_scoring_every_entry_keeps_the_same_entries_with_fewer_syncs(cell):
    """engine.stage2.search=exhaustive (the bench's --stage2-search exhaustive) on the GPU: the entries the bounded
    search keeps, with fewer host synchronisations (stage 2 reads nothing)."""
    runs = {}
    for every in (False, True):
        layer, stage2 = cuda_layer(4096), stage2_of(search="exhaustive" if every else "bounded")
        method = build_method(compose_cfg(*cell, "budget=1024"))
        runs[every] = [k.tolist() for k in method.keep(layer, stage2)], cuda_syncs(method, layer, stage2)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1], runs


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("cell", STAGE2_CELLS)
def test_cuda_bounded_stage2_keeps_what_exhaustive_stage2_keeps(cell, kernel):
    """On the GPU, in bfloat16, with Llama-3.1-8B's shapes: the bounded stage 2 keeps the exhaustive one's entries,
    with the batched products' norms and with the norms kernel's (``kernel``)."""
    import functools
    chosen = build_method(compose_cfg(*cell, "budget=512"))
    for seed, n in ((0, 4096), (1, 9000)):   # bounded: short layers would score every entry
        layer, stage2 = cuda_layer(n, seed), stage2_of(search="bounded", value_norm_kernel=kernel)
        fast = chosen.keep(layer, stage2)
        selection = chosen.selection
        selection.select = functools.partial(type(selection).select, selection, exhaustive=True)
        try:
            plain = chosen.keep(layer, stage2)
        finally:
            del selection.select
        assert [f.tolist() for f in fast] == [p.tolist() for p in plain]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_value_norm_kernel_gives_the_norms_and_each_entry_the_same_bits_in_any_set(dtype):
    """``pcs.kernels.value_norms`` on Llama-3.1-8B's shapes (a KV head's 4 query heads, d = 128, hidden 4,096): within
    float32's accumulation of the float64 norms of the same inputs, at most the torch path's distance from them; and an
    entry's norm is the same bits scored alone, in a subset, in every entry or in a row asking for fewer than the others
    (what the bounded stage 2 relies on)."""
    from pcs.eviction.scores import group_weights, projected_value_norms
    from pcs.kernels.value_norms import available, value_norms
    assert available(torch.device("cuda"), 128)
    layer = cuda_layer(3000, seed=4, dtype=dtype)
    rows, group = 8, 4
    weights = group_weights(layer.o_proj_weight, rows, 128)
    got = value_norms(layer.values, weights, group)
    exact = (layer.values.double() @ weights.double()).view(rows, 3000, group, -1).abs().sum(-1).transpose(1, 2)
    torch_path = projected_value_norms(layer.values, weights, group, 1024, one_reduction=True)
    error = ((got.double() - exact).abs() / exact).max().item()
    assert error <= 1e-5 and error <= ((torch_path.double() - exact).abs() / exact).max().item() + 1e-6
    g = torch.Generator(device="cuda").manual_seed(5)
    some = torch.randperm(3000, generator=g, device="cuda")[:777].sort().values
    assert torch.equal(value_norms(layer.values[:, some], weights, group), got[..., some])
    assert torch.equal(value_norms(layer.values[:, some[:768]], weights, group), got[..., some[:768]])
    assert torch.equal(value_norms(layer.values[:, 1234:1235], weights, group), got[..., 1234:1235])
    assert torch.equal(value_norms(layer.values[2:5], weights[2:5], group), got[2:5])
    # Rows asking for unequal numbers of entries (none, part of a block, whole blocks, all): those entries' bits, zeros
    # past them.
    sizes = [0, 1, 63, 64, 65, 1000, 2999, 3000]
    ragged = value_norms(layer.values, weights, group, torch.tensor(sizes, device="cuda"))
    for r, n in enumerate(sizes):
        assert torch.equal(ragged[r, :, :n], got[r, :, :n]) and not ragged[r, :, n:].any(), (r, n)
