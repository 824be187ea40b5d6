"""pcs.needle_heads against independent recomputations on a tiny random model: the needle's tokens are where its
value is, the kept shares are what each run's cache (the engine's prefill) holds, and the full cache's attention
mass is what transformers' eager attention gives over the same greedy answer."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from pcs.benchmarks.base import build_benchmark
from pcs.engine import Cell, prefill as engine_prefill
from pcs.eviction import build_method
from pcs.identity import RunIdentity
from pcs.models import load_model, stop_token_ids
from pcs.needle_heads import MAX_STEPS, analyse, key_positions, value_positions
from pcs.report.needle_heads import needle_kept, summary
from pcs.run_folder import load_config
from pcs.runner import run

from conftest import compose_cfg

RULER = ["benchmark=ruler", "benchmark.lengths=[1024]", "benchmark.tasks=[niah_single_1,niah_single_2]",
         "benchmark.n_samples=2", "progress=false"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    results = tmp_path_factory.mktemp("heads")
    common = [f"model.path={tiny_model_dir}", f"results_dir={results}", *RULER]
    folders = []
    for overrides in (["method=full"], ["method=snapkv", "selection=attention", "budget=64", "method.window=8"],
                      ["method=adakv", "selection=perturbation", "budget=64", "method.window=8"]):
        cfg = compose_cfg(*common, *overrides)
        run(cfg)
        folders.append(results / RunIdentity(cfg).folder)
    return folders


def test_the_needle_positions_decode_to_the_value(embedded_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    text = "Some filler. One of the special magic numbers for quiet-owl is: 8204517. More filler 8204 here."
    ids = tokenizer(text).input_ids
    positions = value_positions(tokenizer, ids, ["8204517"])
    assert positions == list(range(positions[0], positions[-1] + 1))            # one contiguous span
    assert "8204517" in tokenizer.decode([ids[p] for p in positions])
    assert "8204517" not in tokenizer.decode([ids[p] for p in positions[1:]])   # no token more than needed
    assert "8204517" not in tokenizer.decode([ids[p] for p in positions[:-1]])


def test_the_key_positions_are_the_rest_of_the_needle_sentence(embedded_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    text = "Some filler. One of the special magic numbers for quiet-owl is: 8204517. More filler 8204 here."
    ids = tokenizer(text).input_ids
    key, value = key_positions(tokenizer, ids, ["8204517"]), value_positions(tokenizer, ids, ["8204517"])
    assert key == list(range(key[0], value[0]))                       # contiguous, up to the value
    assert tokenizer.decode([ids[p] for p in key]).strip() == "One of the special magic numbers for quiet-owl is:"
    assert key_positions(tokenizer, tokenizer("no needle 8204517 here").input_ids, ["8204517"]) == []


def eager_mass(model, context, positions, stops):
    """Reference: greedy decoding on a DynamicCache with eager attention; per step, each layer's attention of
    each query head on ``positions`` (output_attentions), averaged over the steps (up to a stop token)."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([context]), past_key_values=cache)
            token, masses = int(out.logits[0, -1].argmax()), []
            for _ in range(MAX_STEPS):
                out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, output_attentions=True)
                masses.append(torch.stack([a[0, :, -1, positions].sum(-1) for a in out.attentions]))
                token = int(out.logits[0, -1].argmax())
                if token in stops:
                    break
    finally:
        model.set_attn_implementation("pcs")
    return torch.stack(masses).mean(0)


def kept_by_cache(model, context, method, positions):
    """Reference: per layer and KV head, the share of ``positions`` whose key the engine's compressed cache holds
    (a full key row found among the held rows)."""
    (seq,) = engine_prefill(model, torch.tensor([context]), [Cell(method)], 1, set())
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), past_key_values=full)
    shares = []
    for layer, reference in zip(seq.cache.layers, full.layers):
        per_head = []
        for h, (keys, _) in enumerate(layer.heads()):
            held = {tuple(row.tolist()) for row in keys}
            per_head.append(sum(tuple(reference.keys[0, h, p].tolist()) in held for p in positions) / len(positions))
        shares.append(per_head)
    return shares


def test_the_analysis_matches_independent_recomputations(runs, tiny_model_dir):
    full_dir, snapkv_dir, adakv_dir = runs
    analysis = analyse([snapkv_dir, adakv_dir], n_samples=1)      # the full run is found beside them
    assert analysis["full_run"] == str(full_dir)
    assert [s["task"] for s in analysis["samples"]] == ["niah_single_1", "niah_single_2"]
    cfg = load_config(full_dir)
    model, tokenizer = load_model(cfg.model)
    stops = stop_token_ids(model, tokenizer, cfg.model.stop_tokens)
    benchmark = build_benchmark(cfg)
    samples = {s.id: s for s in benchmark.samples(tokenizer)}
    for row in analysis["samples"]:
        sample = samples[row["id"]]
        context = benchmark.encode(sample, tokenizer, cfg.model).context
        value = sample.meta["outputs"][0]
        assert value in tokenizer.decode([context[p] for p in row["needle_positions"]])
        reference = eager_mass(model, context, row["needle_positions"], stops)
        torch.testing.assert_close(torch.tensor(row["retrieval"]), reference, rtol=1e-4, atol=1e-5)
        for run_dir in (snapkv_dir, adakv_dir):
            method = build_method(load_config(run_dir))
            got = row["runs"][str(run_dir)]["kept"]
            np.testing.assert_allclose(got, kept_by_cache(model, context, method, row["needle_positions"]), atol=1e-12)
            assert value not in tokenizer.decode([context[p] for p in row["key_positions"]])
            np.testing.assert_allclose(row["runs"][str(run_dir)]["kept_key"],
                                       kept_by_cache(model, context, method, row["key_positions"]), atol=1e-12)
            scores = {json.loads(line)["id"]: json.loads(line)["score"]
                      for line in (run_dir / "predictions.jsonl").read_text().splitlines()}
            assert row["runs"][str(run_dir)]["score"] == scores[row["id"]]


def test_the_summary_relates_lost_answers_to_the_retrieval_heads():
    """A hand-made analysis: heads (0, 1) and (1, 0) carry the needle; the run keeps it there when it answers right."""
    def sample(full, score, kept):
        return {"full_score": full, "retrieval": [[0.1, 0.9], [0.8, 0.0]], "runs": {"r": {"score": score, "kept": kept}}}
    analysis = {"runs": ["r"], "labels": {"r": "snapkv"}, "n_query_heads": 2, "samples": [
        sample(100, 100, [[1.0], [1.0]]),            # one KV head per layer: its query heads share it
        sample(100, 0, [[0.0], [0.5]]),
        sample(0, 0, [[0.0], [0.0]])]}               # the full cache is wrong: not counted
    got = summary(analysis, top=2)
    assert got["retrieval_heads"] == [(0, 1), (1, 0)]
    r = got["runs"]["r"]
    assert (r["n_right"], r["n_lost"]) == (1, 1)
    assert r["kept_retrieval_right"] == 1.0 and r["kept_retrieval_lost"] == 0.25
    assert needle_kept([[0.2, 0.6], None], [(0, 3), (1, 0)], 4) == pytest.approx((0.6 + 1.0) / 2)   # head 3: KV head 1


def test_the_report_draws_each_analysis(tmp_path):
    from pcs.report.document import needle_heads_section
    analysis = {"model": "tiny", "runs": ["a", "b"], "labels": {"a": "snapkv_attention_b64", "b": "snapkv_perturbation_b64"},
                "n_query_heads": 4, "samples": [
                    {"id": f"s{i}", "task": "niah_single_1", "full_score": 100,
                     "retrieval": [[0.1, 0.2, 0.6, 0.0], [float("nan")] * 4, [0.3, 0.1, 0.0, 0.2]],   # layer 1 slides
                     "runs": {"a": {"score": 100, "kept": [[1.0, 0.5], None, [1.0, 1.0]]},
                              "b": {"score": 100 * (i % 2), "kept": [[0.0, 0.5 * (i % 2)], None, [1.0, 0.0]],
                                    "kept_key": [[1.0, 1.0], None, [1.0, (i % 2) * 1.0]]}}}
                    for i in range(4)]}
    folder = tmp_path / "results" / "ruler" / "tiny"
    folder.mkdir(parents=True)
    (folder / "needle_heads_b64.json").write_text(json.dumps(analysis))
    lines = needle_heads_section(tmp_path / "results", tmp_path / "report")
    assert "## Why the needle goes" in lines
    # retrieval heads: the 6 of layers 0 and 2 with mass >= 0.1 (not (0, 3) nor (2, 2), at 0.0); query heads 2h,
    # 2h + 1 share KV head h. In them, right (odd samples) (0 + 0 + .5 + 1 + 1 + 0) / 6, lost (even) (1 + 1) / 6;
    # in every compressed head (its 4 KV heads): right (0 + .5 + 1 + 0) / 4, lost 1 / 4.
    # Its key sentence: right 6 of 6 heads whole, lost 5 of 6 (KV head 1 of layer 2 keeps none)
    assert "| snapkv_perturbation_b64 | 2 | 2 | 42 % / 33 % | 38 % / 25 % | 100 % / 83 % |" in lines
    assert "| snapkv_attention_b64 | 4 | 0 | 92 % / - | 88 % / - | - / - |" in lines       # an older file: no key
    figure = tmp_path / "report" / "needle_heads" / "ruler__tiny__needle_heads_b64.png"
    assert figure.stat().st_size > 10_000


def test_panel_titles_keep_what_tells_the_runs_apart():
    """Runs differing only by a selection knob after the setting (stage2_source=pooled) get different titles; what
    every run shares (setting, budget) is dropped, the method kept."""
    from pcs.plots.needle_heads import panel_names
    setting = "b512_lengths=2048_tasks=niah_single_1+niah_single_2"
    labels = [f"snapkv_perturbation_{setting}", f"snapkv_perturbation_{setting}_stage2_source=pooled",
              f"snapkv_attention_{setting}"]
    names = panel_names(labels)
    assert names == ["snapkv_perturbation", "snapkv_perturbation_stage2_source=pooled", "snapkv_attention"]
    assert panel_names([labels[0]]) == [labels[0]]
