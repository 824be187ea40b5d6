"""Perturbation analysis against direct recomputations on random-weight tiny models."""
import json

import pytest
import torch
from transformers import DynamicCache

import pcs.models
import pcs.runner
from pcs.identity import RunIdentity
from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.eviction.base import Method
from pcs.output_perturbation import measure, run_prefill
from pcs.runner import run

from conftest import compose_cfg, tiny_model

WINDOW = 8


def method(selection, budget, name="snapkv", *overrides):
    return build_method(compose_cfg(f"method={name}", f"selection={selection}", f"budget={budget}",
                                    f"method.window={WINDOW}", *overrides))


def eager_first_step(model, input_ids, token):
    """Reference: the first decoding step on a plain DynamicCache with eager attention, returning
    each layer's attention probabilities (H_q, N) and values (H_kv, N, d)."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids=input_ids, past_key_values=cache)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, output_attentions=True)
    finally:
        model.set_attn_implementation("pcs")
    return [a[0, :, 0] for a in out.attentions], [layer.values[0] for layer in cache.layers]


@pytest.mark.parametrize("name,profile", [("snapkv", []), ("adakv", []), ("adakv", ["profile=adakv"])])
def test_headwise_perturbation_is_the_projected_attention_difference(arch, name, profile):
    """||(A - A') V W^O_h||_1 with A from eager attention and A' = A restricted to the kept entries
    (and the new token), renormalised; per query head where query heads choose apart (profile=adakv)."""
    model = tiny_model(arch)
    torch.manual_seed(3)
    input_ids = torch.randint(0, 256, (1, 120))
    methods = {"attention": method("attention", 40, name, *profile),
               "perturbation": method("perturbation", 40, name, *profile)}
    prefill = run_prefill(model, input_ids, methods, methods["perturbation"])
    got = measure(model, prefill, list(methods), [])
    attentions, values = eager_first_step(model, input_ids, prefill.first_token)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    n = input_ids.shape[1]
    for key in methods:
        for l, (A, V) in enumerate(zip(attentions, values)):
            W = model.model.layers[l].self_attn.o_proj.weight
            heads = prefill.kept[key][l]
            if heads is None:      # a hybrid's sliding-window layer: every cache keeps the window, nothing moves
                assert model.config.layer_types[l] == "sliding_attention" and not got.headwise[key][l].any()
                continue
            for h in range(cfg.num_attention_heads):
                keep = torch.zeros(n + 1, dtype=torch.bool)
                keep[heads[h if len(heads) == cfg.num_attention_heads else h // group]] = True
                keep[n] = True
                A_kept = torch.where(keep, A[h], 0.0)
                A_kept = A_kept / A_kept.sum()
                want = ((A[h] - A_kept) @ V[h // group] @ W[:, h * d:(h + 1) * d].T).abs().sum()
                torch.testing.assert_close(got.headwise[key][l, h], want, rtol=1e-3, atol=1e-5)


def test_assumption1_mass_is_the_attention_on_stage1_entries():
    model = tiny_model("llama")
    torch.manual_seed(4)
    input_ids = torch.randint(0, 256, (1, 150))
    methods = {"attention": method("attention", 48), "perturbation": method("perturbation", 48)}
    prefill = run_prefill(model, input_ids, methods, methods["perturbation"])
    got = measure(model, prefill, ["perturbation"], [])
    attentions, _ = eager_first_step(model, input_ids, prefill.first_token)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    stage1_size = int(0.25 * (48 - WINDOW))
    window = torch.arange(150 - WINDOW, 150)
    for l, A in enumerate(attentions):
        for g, picks in enumerate(prefill.stage1_prefix[l]):
            assert len(picks) == stage1_size
            # Stage 1 takes the top of the same ranking that attention-only selection uses.
            assert set(picks.tolist()) <= set(prefill.kept["attention"][l][g].tolist())
            assert set(picks.tolist()) <= set(prefill.kept["perturbation"][l][g].tolist())
        for h in range(A.shape[0]):
            picks = prefill.stage1_prefix[l][h // group]
            torch.testing.assert_close(got.assumption1_prefix[l, h], A[h, picks].sum(), rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(got.assumption1[l, h], A[h, torch.cat([picks, window])].sum(),
                                       rtol=1e-4, atol=1e-6)


def test_no_perturbation_without_eviction():
    model = tiny_model("qwen2")
    input_ids = torch.randint(0, 256, (1, 100))
    every = type("KeepAll", (Method,), {
        "window": WINDOW, "keep": lambda self, s, stage2=None: [torch.arange(s.n_tokens)] * s.keys.shape[0]})()
    methods = {"kept_all": every, "budget_over_prompt": method("perturbation", 128), "compressed": method("attention", 32)}
    prefill = run_prefill(model, input_ids, methods)
    assert all(k is None for k in prefill.kept["budget_over_prompt"])
    got = measure(model, prefill, list(methods), list(methods))
    for key in ("kept_all", "budget_over_prompt"):
        assert got.headwise[key].abs().max() < 1e-4
        assert got.layerwise[key].abs().max() < 1e-3
        assert got.next_tokens[key] == got.next_token_full
    assert got.headwise["compressed"].sum() > 0 and got.layerwise["compressed"][-1] > 0


def test_layerwise_perturbation_grows_as_the_budget_shrinks():
    model = tiny_model("mistral")
    input_ids = torch.randint(0, 256, (1, 200))
    methods = {b: method("attention", b) for b in (16, 64, 150)}
    got = measure(model, run_prefill(model, input_ids, methods), [], list(methods))
    final = [float(got.layerwise[b][-1]) for b in (16, 64, 150)]
    assert final[0] > final[1] > final[2] > 0


def test_run_writes_metrics_and_figures(tiny_model_dir, tmp_path):
    cfg = compose_cfg("benchmark=perturbation", f"model.path={tiny_model_dir}", f"results_dir={tmp_path}",
                      "progress=false", "benchmark.n_samples=2", "benchmark.context_length=300",
                      "benchmark.budgets=[32,64]", "budget=48", f"method.window={WINDOW}",
                      'benchmark.selections=[attention,perturbation,"perturbation:alpha=0.0",adakv/perturbation,'
                      '"laprox:window=8"]')
    metrics = run(cfg)
    run_dir = tmp_path / RunIdentity(cfg).folder
    assert run_dir.name.startswith("snapkv_b48_")
    assert metrics["score"] == pytest.approx(100 * metrics["heads_improved_frac"])
    assert metrics["n_heads"] == 4 * 8 and set(metrics["comparisons"]) == {
        "perturbation", "perturbation:alpha=0.0", "adakv/perturbation", "laprox:window=8"}
    for label in ("attention", "adakv/perturbation", "laprox:window=8"):
        assert set(metrics["final_layer_by_budget"][label]) == {"32", "48", "64"}
    assert len(metrics["layerwise"]["perturbation"]) == 4
    assert len(metrics["final_layer_per_sample"]["attention"]) == 2
    assert 0 <= metrics["assumption1_frac"] <= 1
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["haystack0", "haystack1"]
    for name in ("headwise_scatter", "layerwise", "final_layer_per_sample", "final_layer_vs_budget", "assumption1"):
        assert (run_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("override,message", [
    ("method=full", "method=full does not"), ("benchmark.selections=[attention]", "at least two"),
    ("benchmark.selections=[attention,nope]", "'nope' names no selection or method"),
    ('benchmark.selections=[attention,"perturbation:beta=1"]', "not a knob of selection perturbation"),
    ('benchmark.selections=[attention,"laprox:alpha=1"]', "not a knob of method laprox"),
    ("benchmark.selections=[attention,streamingllm/attention]", "streamingllm, which takes no selection"),
    ("benchmark.selections=[attention,full]", "full, which keeps every entry"),
    ("benchmark.budgets=[16]", "budget=16 cannot hold the observation window"),
    ("benchmark.haystack_dir=/no/such/essays", "/no/such/essays"),
])
def test_bad_analysis_options_fail_before_the_model_loads(tmp_path, monkeypatch, override, message):
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=message):
        run(compose_cfg("benchmark=perturbation", f"results_dir={tmp_path}", override))


def test_longbench_contexts_can_be_analysed(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    words = " ".join(f"word{i}" for i in range(200))
    (data / "qasper.jsonl").write_text("".join(json.dumps(
        {"input": "Which word?", "context": words, "answers": ["word1"], "length": 200, "all_classes": None,
         "_id": f"q{i}"}) + "\n" for i in range(3)))
    cfg = compose_cfg("benchmark=perturbation", f"model.path={tiny_model_dir}", f"results_dir={tmp_path / 'out'}",
                      "progress=false", "benchmark.source=longbench", f"benchmark.data_dir={data}",
                      "benchmark.n_samples=2", "benchmark.budgets=[32]", "budget=32", f"method.window={WINDOW}")
    metrics = run(cfg)
    rows = (tmp_path / "out" / RunIdentity(cfg).folder / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(r)["id"] for r in rows] == ["qasper/q0", "qasper/q1"]
    assert metrics["n_samples"] == 2 and 0 <= metrics["score"] <= 100


def test_laprox_chooses_in_the_analysis_what_it_keeps_in_generation():
    """The analysis's prefill and the generation path reach the same model-wide choice."""
    from pcs.eviction.laprox import LaProx
    from pcs.generate import greedy_generate

    class Recording(LaProx):
        def choose(self, scores, n_tokens):
            self.kept = super().choose(scores, n_tokens)
            return self.kept

    model = tiny_model("llama")
    input_ids = torch.randint(0, 256, (1, 120))
    recording = Recording(budget=32, window=WINDOW)
    greedy_generate(model, input_ids, recording, 1, set())
    analysed = run_prefill(model, input_ids, {"laprox": LaProx(budget=32, window=WINDOW)}).kept["laprox"]
    for layer, heads in recording.kept.items():
        assert [h.tolist() for h in analysed[layer]] == [h.tolist() for h in heads]


def test_the_analysis_keeps_what_each_method_keeps_in_a_run(arch):
    """Methods with different observation windows in one prefill: the entries ``run_prefill`` reports kept are
    the entries each method's cache holds after the engine's shared prefill (the path a run takes)."""
    from pcs.engine import Cell, prefill as engine_prefill
    model = tiny_model(arch)
    torch.manual_seed(5)
    input_ids = torch.randint(0, 256, (1, 120))
    methods = {"short": method("perturbation", 40),
               "long": build_method(compose_cfg("method=snapkv", "selection=attention", "budget=40",
                                                "method.window=16")),
               "adakv": method("perturbation", 40, "adakv")}
    prefill = run_prefill(model, input_ids, methods, methods["short"])
    sequences = engine_prefill(model, input_ids, [Cell(m) for m in methods.values()], 1, set())
    compared = 0
    for key, seq in zip(methods, sequences):
        for l, layer in enumerate(seq.cache.layers):
            kept = prefill.kept[key][l]
            if kept is None:                      # a sliding-window layer
                assert layer.is_sliding
                continue
            for h, (keys, _) in enumerate(layer.heads()):
                torch.testing.assert_close(keys, prefill.keys[l][h, kept[h]], rtol=0, atol=0)
                compared += 1
    assert compared >= 3 * model.config.num_key_value_heads
    # the windows differ, so the two SnapKV readings keep different entries somewhere
    assert any(not torch.equal(a, b) for la, lb in zip(prefill.kept["short"], prefill.kept["long"])
               if la is not None for a, b in zip(la, lb))
