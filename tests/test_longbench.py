"""LongBench protocol on a synthetic dataset in the official schema that the tests write:
data checks, prompts, middle truncation, the question split, per-task and domain scores."""
import json

import pytest
from transformers import AutoTokenizer

import pcs.models
import pcs.runner
from pcs.identity import RunIdentity
from pcs.benchmarks.base import build_benchmark
from pcs.errors import ConfigError
from pcs.runner import run

from conftest import compose_cfg

TREC_TEMPLATE = ("Please determine the type of the question below. Here are some examples of questions."
                 "\n\n{context}\n{input}")
TREC_CLASSES = ["Location", "Human being", "Number"]


def record(i, context="Some passage.", question="What?", answers=("Paris",), all_classes=None, length=100):
    return {"input": question, "context": context, "answers": list(answers), "length": length,
            "dataset": "x", "language": "en", "all_classes": all_classes, "_id": f"id{i}"}


def write_task(folder, task, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def data_dir(tmp_path):
    folder = tmp_path / "longbench"
    write_task(folder, "hotpotqa", [record(i, f"Passage {i}: The capital of France is Paris.",
                                           "What is the capital of France?") for i in range(3)])
    write_task(folder, "trec", [record(i, "Where is Rome?\nType: Location", "Who wrote Hamlet?",
                                       ["Human being"], TREC_CLASSES) for i in range(2)])
    write_task(folder, "samsum", [record(0, "Dialogue: A: hi\nSummary: A greets.", "Dialogue: B: bye\nSummary:")])
    return folder


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    return AutoTokenizer.from_pretrained(embedded_dir)


def bench(data_dir, *overrides, tasks="[hotpotqa,trec,samsum]"):
    cfg = compose_cfg("benchmark=longbench", f"benchmark.data_dir={data_dir}", f"benchmark.tasks={tasks}", *overrides)
    benchmark = build_benchmark(cfg)
    benchmark.check()
    return benchmark, cfg


def test_default_is_the_papers_sixteen_tasks():
    cfg = compose_cfg("benchmark=longbench")
    assert len(cfg.benchmark.tasks) == 16 and "multifieldqa_zh" not in cfg.benchmark.tasks
    assert cfg.benchmark.query_aware is True


def test_samples_use_the_official_templates_lengths_and_chat_rule(data_dir):
    benchmark, _ = bench(data_dir, "benchmark.limit=2")
    samples = benchmark.samples()
    assert [s.id for s in samples] == ["hotpotqa/id0", "hotpotqa/id1", "trec/id0", "trec/id1", "samsum/id0"]
    trec = samples[2]
    assert trec.prompt == TREC_TEMPLATE.format(context="Where is Rome?\nType: Location", input="Who wrote Hamlet?")
    assert (trec.max_new_tokens, trec.chat) == (64, False)
    assert (samples[0].max_new_tokens, samples[0].chat) == (32, True)
    assert samples[0].prompt.endswith("Question: What is the capital of France?\nAnswer:")
    samsum = samples[4]
    assert (samsum.chat, samsum.stop_texts, samsum.min_new_tokens, samsum.max_new_tokens) == (False, ("\n",), 1, 128)
    assert samples[0].stop_texts == () and samples[0].min_new_tokens == 0
    assert samples[2].meta == {"task": "trec", "answers": ["Human being"], "all_classes": TREC_CLASSES, "length": 100}


def test_long_prompts_are_cut_in_the_middle(data_dir, tokenizer):
    words = [f"w{i}" for i in range(3000)]
    write_task(data_dir, "hotpotqa", [record(0, " ".join(words), "Which word comes first?")])
    benchmark, cfg = bench(data_dir, "model.max_length=400", "model.chat_template=false", tasks="[hotpotqa]")
    sample = benchmark.samples()[0]
    assert len(tokenizer(sample.prompt).input_ids) > 400
    ids = benchmark.encode(sample, tokenizer, cfg.model).context
    text = tokenizer.decode(ids)
    assert abs(len(ids) - 400) <= 2                     # re-tokenizing the two halves may merge a token
    assert text.startswith("Answer the question based on the given passages.")
    assert text.endswith("Question: Which word comes first?\nAnswer:")
    assert "\nw0 w1 " in text and " w2999" in text and " w1500 " not in text
    # A prompt that fits is left alone.
    write_task(data_dir, "hotpotqa", [record(0, " ".join(words[:300]), "Which word comes first?")])
    benchmark, cfg = bench(data_dir, "model.max_length=7500", "model.chat_template=false", tasks="[hotpotqa]")
    sample = benchmark.samples()[0]
    assert tokenizer.decode(benchmark.encode(sample, tokenizer, cfg.model).context) == sample.prompt


def test_pred_py_tokenization_is_an_option(data_dir, embedded_dir):
    """pred.py (THUDM/LongBench, get_pred): ``input = tokenizer(build_chat(prompt))``, special tokens added to
    the already chat-formatted text; with a BOS-adding tokenizer the ids start with two BOS."""
    bos_adding = AutoTokenizer.from_pretrained(embedded_dir, add_bos_token=True)
    for literal in (False, True):
        benchmark, cfg = bench(data_dir, f"benchmark.tokenize_like_pred_py={literal}")
        by_task = {s.meta["task"]: s for s in benchmark.samples()}
        chat = bos_adding.apply_chat_template([{"role": "user", "content": by_task["hotpotqa"].prompt}],
                                              tokenize=False, add_generation_prompt=True)
        pred_py = bos_adding(chat).input_ids
        ids = benchmark.encode(by_task["hotpotqa"], bos_adding, cfg.model).context
        assert pred_py[:2] == [bos_adding.bos_token_id] * 2
        assert ids == (pred_py if literal else pred_py[1:])
        # Tasks without the chat template are encoded as pred.py does either way.
        plain = by_task["trec"]
        assert benchmark.encode(plain, bos_adding, cfg.model).context == bos_adding(plain.prompt).input_ids


def test_query_unaware_feeds_the_question_after_compression(data_dir, tokenizer):
    benchmark, cfg = bench(data_dir, "benchmark.query_aware=false", tasks="[hotpotqa]")
    sample = benchmark.samples()[0]
    prompt = benchmark.encode(sample, tokenizer, cfg.model)
    full = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    context, question = tokenizer.decode(prompt.context), tokenizer.decode(prompt.question)
    assert context + question == full
    assert context.endswith("The capital of France is Paris.")
    assert question.startswith("\n\nAnswer the question") and "What is the capital of France?" in question
    assert question.endswith("assistant\n")
    aware, cfg = bench(data_dir, tasks="[hotpotqa]")
    assert aware.encode(aware.samples()[0], tokenizer, cfg.model).question is None


def test_metrics_give_official_task_scores_domains_and_their_mean(data_dir):
    benchmark, _ = bench(data_dir)
    rows = [{"task": "hotpotqa", "prediction": "Paris", "answers": ["Paris"], "all_classes": None},
            {"task": "hotpotqa", "prediction": "Lyon", "answers": ["Paris"], "all_classes": None},
            {"task": "trec", "prediction": "Human being", "answers": ["Human being"], "all_classes": TREC_CLASSES},
            {"task": "samsum", "prediction": "", "answers": ["A greets."], "all_classes": None}]
    metrics = benchmark.metrics(rows)
    assert metrics["tasks"] == {"hotpotqa": 50.0, "trec": 100.0, "samsum": 0.0}
    assert metrics["domains"] == {"multi_doc_qa": 50.0, "few_shot": 50.0}
    assert metrics["score"] == 50.0
    assert metrics["n_per_task"] == {"hotpotqa": 2, "trec": 1, "samsum": 1}
    assert metrics["fuzzy_backend"] == "difflib"


@pytest.mark.parametrize("breakage,message", [
    (lambda f: (f / "trec.jsonl").unlink(), "trec.jsonl is missing"),
    (lambda f: (f / "trec.jsonl").write_text(json.dumps(record(0, all_classes=TREC_CLASSES)) + "\n{oops\n"),
     r"trec.jsonl:2: not valid JSON"),
    (lambda f: write_task(f, "hotpotqa", [record(0), {**record(1), "answers": "Paris"}]),
     r"hotpotqa.jsonl:2: field 'answers' must be a list"),
    (lambda f: write_task(f, "trec", [record(0)]), r"trec.jsonl:1: trec needs 'all_classes'"),
])
def test_data_errors_name_file_and_line_before_the_model_loads(data_dir, tmp_path, monkeypatch, breakage, message):
    breakage(data_dir)
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("model loaded before the data check"))
    cfg = compose_cfg("benchmark=longbench", f"benchmark.data_dir={data_dir}", "benchmark.tasks=[hotpotqa,trec]",
                      f"results_dir={tmp_path / 'results'}")
    with pytest.raises(ConfigError, match=message):
        run(cfg)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("override,message", [
    ("benchmark.tasks=[hotpotqa,nope]", "unknown"), ("benchmark.limit=0", "benchmark.limit=0"),
    ("benchmark.fuzzy_backend=jaro", "jaro"), ("benchmark.longbench_e=true", "LongBench-E has no"),
])
def test_bad_options_are_refused(data_dir, override, message):
    cfg = compose_cfg("benchmark=longbench", f"benchmark.data_dir={data_dir}", "benchmark.tasks=[musique]", override)
    with pytest.raises(ValueError, match=message):
        build_benchmark(cfg).check()


@pytest.mark.embedded
def test_embedded_model_runs_a_few_tasks_end_to_end_and_rescoring_agrees(data_dir, tmp_path, embedded_dir):
    from pcs.rescore import main as rescore_main, rescore
    cfg = compose_cfg("benchmark=longbench", f"benchmark.data_dir={data_dir}", "benchmark.tasks=[hotpotqa,trec]",
                      "benchmark.limit=2", "model.max_length=600", "budget=64", "method=snapkv",
                      f"results_dir={tmp_path / 'results'}", "progress=false")
    metrics = run(cfg)
    run_dir = tmp_path / "results" / RunIdentity(cfg).folder
    assert run_dir.name == "snapkv_perturbation_b64_max_length=600_limit=2_tasks=hotpotqa+trec"
    rows = [json.loads(l) for l in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["hotpotqa/id0", "hotpotqa/id1", "trec/id0", "trec/id1"]
    assert all(r["new_tokens"] <= (32 if r["task"] == "hotpotqa" else 64) for r in rows)
    assert rows[0]["answers"] == ["Paris"] and rows[2]["all_classes"] == TREC_CLASSES
    assert set(metrics["tasks"]) == {"hotpotqa", "trec"}
    assert set(metrics["domains"]) == {"multi_doc_qa", "few_shot"}
    assert metrics["score"] == round((metrics["tasks"]["hotpotqa"] + metrics["tasks"]["trec"]) / 2, 2)
    _, rescored = rescore(run_dir)
    assert {k: metrics[k] for k in rescored} == rescored
    assert rescore_main([str(tmp_path / "results"), "--write"]) == 0
    assert json.loads((run_dir / "metrics.json").read_text()) == metrics


def test_longbench_e_reads_its_files_and_scores_length_buckets(data_dir):
    write_task(data_dir, "hotpotqa_e", [record(0, length=1000), record(1, length=5000), record(2, length=9000)])
    benchmark, _ = bench(data_dir, "benchmark.longbench_e=true", tasks="[hotpotqa]")
    samples = benchmark.samples()
    assert [s.meta["length"] for s in samples] == [1000, 5000, 9000]
    rows = [{**s.meta, "prediction": p} for s, p in zip(samples, ["Paris", "Lyon", "Paris"])]
    assert benchmark.metrics(rows)["length_buckets"] == {"hotpotqa": {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}}


def test_without_data_dir_the_official_zip_is_fetched_into_the_cache(tmp_path, monkeypatch):
    """The hub route: data.zip (files under data/) unpacked flat into $PCS_CACHE_DIR/longbench."""
    import zipfile
    import huggingface_hub
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/trec.jsonl", json.dumps(record(0, all_classes=TREC_CLASSES, answers=["Number"])) + "\n")
    calls = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name, **kw: calls.append((repo, name, kw["repo_type"])) or str(archive))
    monkeypatch.setenv("PCS_CACHE_DIR", str(tmp_path / "cache"))
    benchmark = build_benchmark(compose_cfg("benchmark=longbench", "benchmark.tasks=[trec]"))
    benchmark.check()
    assert calls == [("THUDM/LongBench", "data.zip", "dataset")]
    assert (tmp_path / "cache" / "longbench" / "trec.jsonl").exists()
    assert [s.id for s in benchmark.samples()] == ["trec/id0"]
    benchmark.check()                 # already there: no second download
    assert len(calls) == 1
