"""benchmark=ruler: samples that fit their length with the model's tokenizer, cached and identical across runs,
the question where benchmark.query_aware puts it, the answer prefix after the chat template, and metrics that an
independent string-match scorer reproduces."""
import json

import pytest
from transformers import AutoTokenizer

from pcs.benchmarks.base import build_benchmark

from conftest import compose_cfg
from oracles import hotpot_like, squad_like


TASKS = "[niah_single_1,niah_multikey_3,niah_multiquery,vt,cwe,fwe,qa_1,qa_2]"


def ruler(tmp_path, *extra):
    """Three samples of a task of each kind at 1,024 tokens; qa from small SQuAD- and HotpotQA-shaped files."""
    qa_dir = tmp_path / "qa"
    if not qa_dir.exists():
        qa_dir.mkdir()
        (qa_dir / "squad.json").write_text(json.dumps(squad_like(n_articles=60, words=4)))
        (qa_dir / "hotpotqa.json").write_text(json.dumps(hotpot_like(n=40, titles=300)))
    cfg = compose_cfg("benchmark=ruler", "benchmark.n_samples=3", "benchmark.lengths=[1024]", f"benchmark.tasks={TASKS}",
                      f"benchmark.cache_dir={tmp_path}", f"benchmark.qa_dir={qa_dir}", *extra)
    bench = build_benchmark(cfg)
    bench.check()
    return bench, cfg


def test_samples_fit_are_cached_and_identical(embedded_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    bench, cfg = ruler(tmp_path)
    first = bench.samples(tokenizer)
    assert len(first) == 24 and len(list(tmp_path.glob("*.jsonl"))) == 8
    again, _ = ruler(tmp_path)
    assert again.samples(tokenizer) == first and again.digests == bench.digests
    for s in first:
        # RULER's fitting: prompt and new tokens within the length; fwe (as in RULER) fits the prompt alone
        reserved = 0 if s.meta["task"] == "fwe" else s.max_new_tokens
        assert len(tokenizer.tokenize(s.prompt + s.answer_prefix)) + reserved <= 1024
        ids = bench.encode(s, tokenizer, cfg.model)
        text = tokenizer.decode(ids.context)
        assert text.endswith("<|im_start|>assistant\n" + s.answer_prefix) and ids.question is None
        found = [answer in s.prompt for answer in s.meta["outputs"]]
        assert any(found) if s.meta["task"].startswith("qa") else all(found)   # qa: one annotator's answer will do


def test_a_list_of_counts_gives_each_task_the_first_samples_of_a_larger_count(embedded_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    settings = ("benchmark=ruler", "benchmark.lengths=[1024]", "benchmark.tasks=[niah_single_1,niah_single_3]")
    def samples(counts, folder):
        bench = build_benchmark(compose_cfg(*settings, f"benchmark.n_samples={counts}", f"benchmark.cache_dir={folder}"))
        bench.check()
        return bench.samples(tokenizer)
    each = samples("[3,1]", tmp_path / "each")
    more = samples("3", tmp_path / "more")
    assert [s.id for s in each] == [s.id for s in more][:4]
    assert each == more[:4]      # RULER draws a task's samples one after another: the first 1 of 3 is the 1
    with pytest.raises(ValueError, match="one per task"):
        build_benchmark(compose_cfg(*settings, "benchmark.n_samples=[3]")).check()


def test_the_question_is_fed_after_compression_when_not_query_aware(embedded_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    bench, cfg = ruler(tmp_path, "benchmark.query_aware=false")
    for s in bench.samples(tokenizer):
        ids = bench.encode(s, tokenizer, cfg.model)
        question = tokenizer.decode(ids.question)
        assert question.startswith(("What is the special magic", "What are all the special",
                                    "Question: Find all variables that are assigned the value",
                                    "Question: What are the 10 most common words in the above list?",
                                    "Question: Do not provide any explanation.",
                                    "Answer the question based on the given documents."))
        assert question.endswith(s.answer_prefix) and "One of the special magic" not in question
        assert "VAR" not in question                  # vt: the chain and the one-shot example stay in the context
        assert "Document" not in question and " 1. " not in question   # qa's documents, cwe's list: context


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


def test_missing_qa_data_is_a_clear_error_before_the_model_loads(tmp_path, monkeypatch):
    def unreachable(url, timeout):
        raise OSError("Could not resolve host")
    monkeypatch.setattr("urllib.request.urlopen", unreachable)
    cfg = compose_cfg("benchmark=ruler", "benchmark.tasks=[niah_single_1,qa_2]", f"benchmark.qa_dir={tmp_path}")
    with pytest.raises(FileNotFoundError, match=r"qa_2.*hotpotqa.json.*Could not resolve host.*benchmark.qa_dir"):
        build_benchmark(cfg).check()


def test_default_lengths_follow_the_models_window():
    """null lengths: RULER's 4K-128K within a paper model's window; 2K and 4K for the 8K embedded model."""
    assert build_benchmark(compose_cfg("benchmark=ruler")).lengths == [2048, 4096]
    assert build_benchmark(compose_cfg("benchmark=ruler", "model=llama31")).lengths == [4096, 8192, 16384, 32768,
                                                                                          65536, 131072]
    assert build_benchmark(compose_cfg("benchmark=ruler", "model=llama31", "benchmark.lengths=[1024]")).lengths == [1024]
    with pytest.raises(ValueError, match="8192 positions"):
        build_benchmark(compose_cfg("benchmark=ruler", "benchmark.lengths=[4096,16384]",
                                    "benchmark.tasks=[niah_single_1]")).check()


def test_an_answer_is_settled_once_its_score_is_100_and_no_longer_text_lowers_it(tmp_path):
    """``Benchmark.settled`` for RULER (declared ``_settles_``): decided once every reference is in the answer
    (one, for qa), under either normalization; a score found at 100 stays 100 on every longer text, while a
    score of a benchmark without the declaration may fall (LongBench: none)."""
    import random
    from pcs.benchmarks.base import Sample
    rng = random.Random(0)
    pieces = ["1111111", "2222222", " ", "\n", "\x00", ".", "The special magic number", "is:", "2222", "111"]
    for normalize in ("ruler", "kvpress"):
        bench, _ = ruler(tmp_path, f"benchmark.normalize={normalize}")
        for task, outputs in (("niah_multiquery", ["1111111", "2222222"]), ("qa_1", ["1111111", "2222222"]),
                              ("niah_single_1", ["2222222"])):
            sample = Sample(id="x", prompt="", max_new_tokens=8, meta={"task": task, "length": 1024,
                                                                       "outputs": outputs})
            settled = bench.settled(sample)
            decided = 0
            for _ in range(300):
                text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8)))
                longer = text + "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 8)))
                score = bench.score({"prediction": text, "task": task, "outputs": outputs})
                assert settled(text) == (score == 100.0)
                if settled(text):
                    decided += 1
                    assert bench.score({"prediction": longer, "task": task, "outputs": outputs}) == 100.0
            assert decided > 20
    longbench = build_benchmark(compose_cfg("benchmark=longbench"))
    assert longbench.settled(Sample(id="x", prompt="", max_new_tokens=8)) is None


def test_stop_when_scored_is_refused_where_a_score_can_still_change():
    from pcs.validation import validate
    from pcs.errors import ConfigError
    validate(compose_cfg("benchmark=ruler", "engine.stop_when_scored=true"))
    for bad, match in ((("benchmark=longbench", "engine.stop_when_scored=true"), "benchmark=longbench"),
                       (("benchmark=needle", "engine.stop_when_scored=true"), "benchmark=needle"),
                       (("benchmark=ruler", "engine.stop_when_scored=1"), "true or false")):
        with pytest.raises(ConfigError, match=match):
            validate(compose_cfg(*bad))


@pytest.mark.embedded
def test_answers_stopped_when_scored_keep_every_score(embedded_dir, tmp_path):
    """engine.stop_when_scored on the embedded model: the same scores as decoding every answer to its end, each
    stopped answer the start of the whole one, fewer tokens decoded where an answer was decided early. The two
    runs share each prefill (one group), each decoding by its own config."""
    from pcs.runner import run_cells
    cfgs = [compose_cfg("benchmark=ruler", "benchmark.lengths=[1024]", "benchmark.tasks=[niah_single_1]",
                        "benchmark.n_samples=3", f"benchmark.cache_dir={tmp_path}", f"results_dir={tmp_path / flag}",
                        "method=snapkv", "budget=256", f"engine.stop_when_scored={flag}", "progress=false")
            for flag in ("false", "true")]
    rows = {}
    for flag, metrics in zip(("false", "true"), run_cells(cfgs)):
        assert metrics["engine"]["stop_when_scored"] == (flag == "true")
        (predictions,) = (tmp_path / flag).rglob("predictions.jsonl")
        rows[flag] = {r["id"]: r for r in map(json.loads, predictions.read_text().splitlines())}
    whole, stopped = rows["false"], rows["true"]
    assert set(whole) == set(stopped) and any(r["score"] == 100.0 for r in whole.values())
    assert any(stopped[key]["new_tokens"] < row["new_tokens"] for key, row in whole.items())
    for key, row in whole.items():
        assert stopped[key]["score"] == row["score"], key
        assert row["prediction"].startswith(stopped[key]["prediction"].rstrip()), key
        assert stopped[key]["new_tokens"] <= row["new_tokens"]
    print("\n[stop_when_scored] tokens decoded:", sum(r["new_tokens"] for r in stopped.values()), "of",
          sum(r["new_tokens"] for r in whole.values()))
