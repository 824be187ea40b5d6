"""benchmark=ruler: samples that fit their length with the model's tokenizer, cached and identical across runs,
the question where benchmark.query_aware puts it, the answer prefix after the chat template, and metrics that an
independent string-match scorer reproduces."""
import json

import pytest
from transformers import AutoTokenizer

from pcs.benchmarks.base import build_benchmark

from conftest import compose_cfg


def ruler(tmp_path, *extra):
    cfg = compose_cfg("benchmark=ruler", "benchmark.n_samples=3", "benchmark.lengths=[1024]",
                      "benchmark.tasks=[niah_single_1,niah_multikey_3,niah_multiquery,vt]",
                      f"benchmark.cache_dir={tmp_path}", *extra)
    bench = build_benchmark(cfg)
    bench.check()
    return bench, cfg


def test_samples_fit_are_cached_and_identical(embedded_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    bench, cfg = ruler(tmp_path)
    first = bench.samples(tokenizer)
    assert len(first) == 12 and len(list(tmp_path.glob("*.jsonl"))) == 4
    again, _ = ruler(tmp_path)
    assert again.samples(tokenizer) == first and again.digests == bench.digests
    for s in first:
        assert len(tokenizer.tokenize(s.prompt + s.answer_prefix)) + s.max_new_tokens <= 1024
        ids = bench.encode(s, tokenizer, cfg.model)
        text = tokenizer.decode(ids.context)
        assert text.endswith("<|im_start|>assistant\n" + s.answer_prefix) and ids.question is None
        for answer in s.meta["outputs"]:
            assert answer in s.prompt


def test_the_question_is_fed_after_compression_when_not_query_aware(embedded_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    bench, cfg = ruler(tmp_path, "benchmark.query_aware=false")
    for s in bench.samples(tokenizer):
        ids = bench.encode(s, tokenizer, cfg.model)
        question = tokenizer.decode(ids.question)
        assert question.startswith(("What is the special magic", "What are all the special",
                                    "Question: Find all variables that are assigned the value"))
        assert question.endswith(s.answer_prefix) and "One of the special magic" not in question
        assert "VAR" not in question                  # vt: the chain and the one-shot example stay in the context


def test_metrics_are_rulers_string_match(tmp_path):
    bench, _ = ruler(tmp_path)
    rows = [{"task": "niah_multiquery", "length": 1024, "outputs": ["1111111", "2222222", "3333333", "4444444"],
             "prediction": " 1111111, 2222222\x00and 3333333"},
            {"task": "niah_multiquery", "length": 1024, "outputs": ["5555555"], "prediction": "none"},
            {"task": "niah_single_1", "length": 1024, "outputs": ["7654321"], "prediction": " 7654321."}]
    for row in rows:
        row["score"] = bench.score(row)
    assert [r["score"] for r in rows] == [75.0, 0.0, 100.0]
    metrics = bench.metrics(rows)
    assert metrics["lengths"]["1024"]["tasks"] == {"niah_multiquery": 37.5, "niah_single_1": 100.0}
    assert metrics["lengths"]["1024"]["groups"] == {"retrieval": 68.75}
    assert metrics["score"] == 68.75


def test_unknown_tasks_fail_before_the_model_loads(tmp_path):
    cfg = compose_cfg("benchmark=ruler", "benchmark.tasks=[niah_single_1,vt_missing]")
    with pytest.raises(ValueError, match="vt_missing"):
        build_benchmark(cfg).check()
