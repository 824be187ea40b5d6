"""One prefill for many cells: each cell's generation equals what a prefill of its own gives, the shared
prefill never holds more full layers beside the cells' compressed ones than the one computed and those it has yet
to compress (CUDA compresses behind the forward), and a group of runs writes the same folders as separate runs."""
import json

import pytest
import torch

from pcs.cache import CompressedCache
from pcs.compression import compress_each_after_prefill
from pcs.eviction import build_method
from pcs.generate import greedy_generate, greedy_generate_each
from pcs.hybrid import head_dim
from pcs.identity import RunIdentity
from pcs.runner import run, run_cells

from conftest import compose_cfg, tiny_model

CELLS = [("method=snapkv", "selection=attention", "budget=40", "method.window=8"),
         ("method=snapkv", "selection=perturbation", "budget=40", "method.window=8"),
         ("method=adakv", "selection=perturbation", "budget=32", "method.window=4"),
         ("method=pyramidkv", "selection=attention", "budget=48", "method.window=8"),
         ("method=adakv", "profile=adakv", "selection=attention", "budget=40", "method.window=8"),
         ("method=streamingllm", "budget=40"),
         ("method=laprox", "budget=40"),
         ("method=full",)]


def methods():
    return [build_method(compose_cfg(*cell)) for cell in CELLS]


def comparable(gen):
    return {k: v for k, v in vars(gen).items() if k not in ("prefill_s", "decode_s", "stage2")}   # costs, not answers


@pytest.mark.parametrize("question,trigger", [(False, None), (True, None), (False, 60)])
def test_each_cell_gets_what_its_own_prefill_gives(arch, question, trigger):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(3))
    q = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(4)) if question else None
    built = methods()
    if trigger is not None:       # decoding-time recompression: layer-by-layer methods without per-query-head masks
        built = [m for m, cell in zip(built, CELLS) if "method=laprox" not in cell and "profile=adakv" not in cell
                 and "method=full" not in cell]
    shared = greedy_generate_each(model, ids, built, 12, set(), question_ids=q, triggers=[trigger] * len(built))
    for method, got in zip(built, shared):
        alone = greedy_generate(model, ids, method, 12, set(), question_ids=q, trigger=trigger)
        assert comparable(got) == comparable(alone)
    if trigger is not None:
        assert any(gen.n_compressions for gen in shared)


@pytest.mark.parametrize("behind", [0, 1, 2])
def test_the_shared_prefill_holds_whole_only_the_layers_it_has_yet_to_compress(behind, monkeypatch):
    """At every layer's hook, the bytes alive are that layer's full K/V plus what each cell keeps of the earlier
    layers (a model-wide cell: all of them whole), and, compressing ``behind`` layers behind the forward (CUDA's
    overlap, reordered here on one stream), the prefill cache's ``behind`` layers before it, whole: no other."""
    import pcs.compression
    monkeypatch.setattr(pcs.compression, "layers_behind", lambda device, options: behind)
    model = tiny_model("llama")
    built = methods()[:5]                      # layer-by-layer methods only
    caches = [CompressedCache.of(model.config) for _ in built]
    seen = []

    def watch(module, args, kwargs, output):
        layer = module.layer_idx
        seen.append([(c, l) for c, cache in enumerate(caches) for l, held in enumerate(cache.layers)
                     if held.keys is not None and l < layer])

    handles = [l.self_attn.register_forward_hook(watch, with_kwargs=True) for l in model.model.layers]
    try:
        with torch.no_grad(), compress_each_after_prefill(model, built, caches):
            model(input_ids=torch.randint(0, 256, (1, 150)), past_key_values=caches[0])
    finally:
        for h in handles:
            h.remove()
    assert seen == [[(0, l) for l in range(max(0, layer - behind), layer)] for layer in range(len(seen))]
    for cache in caches:
        for layer in cache.layers:
            assert layer.keys is None and layer.is_buffered


@pytest.mark.parametrize("behind", [1, 2])
@pytest.mark.parametrize("question", [False, True])
def test_compressing_layers_behind_the_forward_changes_nothing_but_the_peak(arch, question, behind, monkeypatch):
    """What CUDA's overlapped compression does, in order and on one stream: layer l chosen once layer l + behind's
    forward ran. Every cell's answer, logits, cache and sizes are those of compressing at once; only the peak may
    grow, by at most ``behind`` full layers (the next ones, whole while layer l is chosen)."""
    import pcs.compression
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(5))
    q = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(6)) if question else None
    built = methods()
    at_once = greedy_generate_each(model, ids, built, 10, set(), question_ids=q)
    monkeypatch.setattr(pcs.compression, "layers_behind", lambda device, options: behind)
    late = greedy_generate_each(model, ids, built, 10, set(), question_ids=q)
    full = 2 * model.config.num_key_value_heads * ids.shape[1] * head_dim(model.config) * model.dtype.itemsize
    for now, then in zip(at_once, late):
        assert {k: v for k, v in comparable(then).items() if k != "peak_kv_bytes"} == \
            {k: v for k, v in comparable(now).items() if k != "peak_kv_bytes"}
        assert now.peak_kv_bytes <= then.peak_kv_bytes <= now.peak_kv_bytes + behind * full
    assert any(then.peak_kv_bytes > now.peak_kv_bytes for now, then in zip(at_once, late))


def needle(model_dir, results, *extra):
    return compose_cfg(f"model.path={model_dir}", f"results_dir={results}", "progress=false",
                       "benchmark.context_lengths=[200,300]", "benchmark.depth_percents=[0,100]",
                       "benchmark.max_new_tokens=6", *extra)


def rows(results, cfg):
    path = results / RunIdentity(cfg).folder / "predictions.jsonl"
    return [{k: v for k, v in json.loads(line).items() if k not in ("prefill_s", "decode_s")}
            for line in path.read_text().splitlines()]


def test_a_group_writes_what_separate_runs_write(tiny_model_dir, tmp_path):
    cells = [("method=snapkv", "selection=attention", "budget=64"), ("method=adakv", "selection=perturbation", "budget=48"),
             ("method=full",), ("method=laprox", "budget=64"), ("method=full", "budget=256")]
    grouped = run_cells([needle(tiny_model_dir, tmp_path / "group", *c) for c in cells])
    for cell, metrics in zip(cells[:4], grouped):
        alone = run(needle(tiny_model_dir, tmp_path / "alone", *cell))
        cfg = needle(tiny_model_dir, tmp_path, *cell)
        assert rows(tmp_path / "group", cfg) == rows(tmp_path / "alone", cfg)
        assert metrics["group_size"] == 4 and alone["group_size"] == 1
        for key in ("score", "grid", "kv_cache_bytes", "kv_cache_bytes_full", "peak_kv_bytes", "max_kv_entries"):
            assert metrics[key] == alone[key]
        folder = RunIdentity(cfg).folder
        assert ((tmp_path / "group" / folder / "config.yaml").read_text()
                == (tmp_path / "alone" / folder / "config.yaml").read_text())
    assert grouped[4] is None          # the full cache at another budget is the same run: done once


def test_a_group_resumes_each_run_where_it_stopped(tiny_model_dir, tmp_path, monkeypatch):
    cells = [needle(tiny_model_dir, tmp_path, "method=snapkv", "budget=64"),
             needle(tiny_model_dir, tmp_path, "method=adakv", "budget=64")]
    run(cells[0])
    path = tmp_path / RunIdentity(cells[0]).folder
    (path / "metrics.json").unlink()
    lines = (path / "predictions.jsonl").read_text().splitlines()
    (path / "predictions.jsonl").write_text("\n".join(lines[:2]) + "\n")
    asked = []
    import pcs.runner
    original = pcs.runner.STEPS["generate"]

    def counting(requests, pool, loaded):
        return original(((sample, prompt, asked.append(len(cells)) or cells) for sample, prompt, cells in requests),
                        pool, loaded)
    monkeypatch.setitem(pcs.runner.STEPS, "generate", counting)
    run_cells(cells)
    assert asked == [1, 1, 2, 2]        # the first run's two missing samples shared with the second run
    assert [json.loads(l)["id"] for l in (path / "predictions.jsonl").read_text().splitlines()] == \
        ["len200_depth0", "len200_depth100", "len300_depth0", "len300_depth100"]


def test_cells_that_cannot_share_a_prefill_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="differ only in"):
        run_cells([needle(tiny_model_dir, tmp_path), needle(tiny_model_dir, tmp_path, "benchmark.max_new_tokens=7")])
