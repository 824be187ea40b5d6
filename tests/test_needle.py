"""Needle-in-a-Haystack's prompt split: benchmark.query_aware=false feeds the instruction and question after
the compressed context; true (the default) compresses them with it."""
from transformers import AutoTokenizer

from pcs.benchmarks.base import build_benchmark

from conftest import compose_cfg


def needle(*overrides):
    cfg = compose_cfg("benchmark=needle", "benchmark.context_lengths=[600]", "benchmark.depth_percents=[50]",
                      *overrides)
    return build_benchmark(cfg), cfg


def test_the_question_is_fed_after_compression_when_not_query_aware(embedded_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    aware, cfg = needle()
    blind, _ = needle("benchmark.query_aware=false")
    [a], [b] = aware.samples(tokenizer), blind.samples(tokenizer)
    assert a.prompt == b.prompt                       # the same text, split in two places
    assert aware.encode(a, tokenizer, cfg.model).question is None
    ids = blind.encode(b, tokenizer, cfg.model)
    context, question = tokenizer.decode(ids.context), tokenizer.decode(ids.question)
    assert question.startswith("Answer the question using only the document above.\nQuestion: What is the best")
    assert "Dolores Park" in context and "Answer the question" not in context
    assert context + question == tokenizer.decode(aware.encode(a, tokenizer, cfg.model).context)
