"""kvpress's leaderboard (experiment=kvpress_leaderboard): its RULER rows read as kvpress's evaluation reads them
(benchmark=ruler_kvpress), its prompts split as kvpress's pipeline splits them in both of its loops, its presses by
their names there (conf/press/), and the whole sweep composed, dry-run and priced before anything runs."""
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

from pcs.benchmarks.base import build_benchmark
from pcs.config import compose
from pcs.identity import RunIdentity
from pcs.projection import project, sweep_configs
from pcs.sweep import plan

from conftest import compose_cfg, kvpress_ruler_files

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["niah_single_1", "niah_multikey_1", "vt", "cwe", "fwe"]

# kvpress evaluation/benchmarks/ruler/create_huggingface_dataset.py, QUESTION_PATTERNS, ANSWER_PATTERNS and
# split_context_question: the input cut at the last question match, the question at the first answer-pattern match.
QUESTION_PATTERNS = {"niah": r"What (?:is|are all) the special magic",
                     "vt": r"Question: Find all variables that are assigned the value",
                     "cwe": r"Question: What are the 10 most common words in the above list\?",
                     "fwe": r"Question: Do not provide any explanation\."}
ANSWER_PATTERNS = {"niah": r"The special magic", "vt": r"Answer:", "cwe": r"Answer:", "fwe": r"Answer:"}
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}


def kvpress_row(text: str, outputs: list[str], task: str) -> dict:
    kind = task.split("_")[0]
    at = list(re.finditer(QUESTION_PATTERNS[kind], text))[-1].start()
    context, qa = text[:at], text[at:]
    at = re.search(ANSWER_PATTERNS[kind], qa).start()
    return {"context": context, "question": qa[:at], "answer_prefix": qa[at:], "answer": outputs, "task": task,
            "max_new_tokens": MAX_NEW_TOKENS[kind]}


@pytest.fixture(scope="module")
def dataset(embedded_dir, tmp_path_factory):
    """A folder laid out as the hub dataset (``1024/test-00000-of-00001.parquet``): RULER inputs drawn by pcs for
    the embedded tokenizer (3 per task), split into kvpress's columns by a transcription of its script."""
    folder = tmp_path_factory.mktemp("ruler_kvpress")
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    cfg = compose_cfg("benchmark=ruler", "benchmark.n_samples=3", "benchmark.lengths=[1024]",
                      f"benchmark.tasks=[{','.join(TASKS)}]", f"benchmark.cache_dir={folder / 'drawn'}")
    ruler = build_benchmark(cfg)
    sources = ruler.sources_digest(tokenizer)
    rows = [kvpress_row(r["input"], r["outputs"], task) for task in TASKS
            for r in ruler.generated(task, 1024, tokenizer, sources)]
    (folder / "1024").mkdir()
    pd.DataFrame(rows).to_parquet(folder / "1024" / "test-00000-of-00001.parquet")
    return folder, rows, tokenizer


def kvpress_ids(tokenizer, context: str, question: str, answer_prefix: str, query_aware: bool):
    """kvpress 0.5.5 evaluation/evaluate.py lines 352-355 (--query_aware: the question joins the context, an empty
    question remains) and pipeline.py ``preprocess`` lines 139-162 (the template rendered over the context and a
    separator, split there; the question, the template's tail and the answer prefix tokenized apart)."""
    if query_aware:
        context, question = context + question, ""
    separator = "#" * (len(context) + 10)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
    context, suffix = rendered.split(separator)
    return (tokenizer.encode(context, add_special_tokens=False),
            tokenizer.encode(question + suffix + answer_prefix, add_special_tokens=False))


@pytest.mark.parametrize("query_aware", [False, True])
def test_samples_are_kvpresss_rows_split_as_its_pipeline_splits_them(dataset, query_aware):
    folder, rows, tokenizer = dataset
    cfg = compose_cfg("benchmark=ruler_kvpress", f"benchmark.data_dir={folder}", "benchmark.lengths=[1024]",
                      f"benchmark.tasks=[{','.join(TASKS)}]", f"benchmark.query_aware={str(query_aware).lower()}")
    bench = build_benchmark(cfg)
    bench.check()
    samples = bench.samples(tokenizer)
    assert [s.id for s in samples] == [f"{t}_1024_{i}" for t in TASKS for i in range(3)]
    for sample, row in zip(samples, rows):
        assert sample.meta["outputs"] == row["answer"] and sample.max_new_tokens == row["max_new_tokens"]
        ids = bench.encode(sample, tokenizer, cfg.model)
        context, question = kvpress_ids(tokenizer, row["context"], row["question"], row["answer_prefix"],
                                        query_aware)
        assert (ids.context, ids.question) == (context, question), sample.id
    assert bench.data_hashes()["ruler_kvpress_files"]["1024"]


def test_n_samples_takes_each_tasks_first_rows_and_bad_data_stops_before_the_model_loads(dataset, tmp_path):
    folder, _, tokenizer = dataset
    settings = ("benchmark=ruler_kvpress", "benchmark.lengths=[1024]", "benchmark.tasks=[vt,niah_single_1]")
    bench = build_benchmark(compose_cfg(*settings, f"benchmark.data_dir={folder}", "benchmark.n_samples=2"))
    bench.check()
    assert [s.id for s in bench.samples(tokenizer)] == ["vt_1024_0", "vt_1024_1", "niah_single_1_1024_0",
                                                        "niah_single_1_1024_1"]
    with pytest.raises(FileNotFoundError, match=r"has no 1024/\*\.parquet.*hf download simonjegou/ruler"):
        build_benchmark(compose_cfg(*settings, f"benchmark.data_dir={tmp_path}")).check()
    (tmp_path / "1024").mkdir()
    pd.DataFrame([{"context": "c", "question": "q"}]).to_parquet(tmp_path / "1024" / "test.parquet")
    with pytest.raises(ValueError, match="lacks columns"):
        build_benchmark(compose_cfg(*settings, f"benchmark.data_dir={tmp_path}")).check()
    one = tmp_path / "one_task"
    (one / "1024").mkdir(parents=True)
    pd.DataFrame([{"context": "c", "question": "q", "answer_prefix": "a", "answer": ["x"], "task": "niah_single_1",
                   "max_new_tokens": 32}]).to_parquet(one / "1024" / "test.parquet")
    with pytest.raises(ValueError, match=r"holds no rows of \['vt'\]"):
        build_benchmark(compose_cfg(*settings, f"benchmark.data_dir={one}")).check()


PRESSES = {   # kvpress's leaderboard name -> (method, knobs that make it that press under profile=kvpress)
    "no_press": ("full", {}),
    "knorm": ("knorm", {}), "keydiff": ("keydiff", {}), "tova": ("tova", {"window": 1}),
    "observed_attention": ("observed_attention", {}), "streaming_llm": ("streamingllm", {"sinks": 4}),
    "snapkv": ("snapkv", {"window": 64, "kernel": 5, "pooling": "avg"}),
    "pyramidkv": ("pyramidkv", {"window": 64, "kernel": 5, "pooling": "avg", "beta": 20}),
    "expected_attention": ("adakv", {"scorer": "expected_attention", "window": 0, "scorer_epsilon": 0.01,
                                     "floor": 0.2}),
    "lagkv": ("lagkv", {}), "cur": ("cur", {}), "kvzip": ("kvzip", {"scope": "model", "chunk": 2048, "sinks": 4}),
    "chunkkv": ("chunkkv", {"window": 64, "kernel": 5, "pooling": "avg", "chunk": 20, "scorer": "window_attention"}),
    "query_aware_snapkv": ("snapkv", {"window": 64, "kernel": 5, "pooling": "avg"}),
    "query_aware_adakv_snapkv": ("adakv", {"window": 64, "kernel": 5, "pooling": "avg", "floor": 0.2}),
}


def test_the_leaderboard_sweeps_kvpresss_presses_ratios_and_protocols():
    """evaluation/leaderboard.sh: RULER 4096 with every task, ratios 0.25 ... 0.875 (budgets of 1 - ratio), the
    presses pcs shares with it with the question kept out, then SnapKV and AdaKV-SnapKV with it inside."""
    cfgs = sweep_configs(["experiment=kvpress_leaderboard"])
    runs = {RunIdentity(c).folder: c for c in cfgs}
    assert len(runs) == 1 + 14 * 4
    for cfg in runs.values():
        assert cfg.model.name == "qwen3_8b" and cfg.benchmark.name == "ruler_kvpress"
        assert list(cfg.benchmark.lengths) == [4096] and len(cfg.benchmark.tasks) == 13
        assert cfg.benchmark.n_samples is None and cfg.profile.name == "kvpress"
    budgets = {c.budget for c in runs.values() if c.method.name != "full"}
    assert budgets == {1 - r for r in (0.25, 0.5, 0.75, 0.875)}
    for press, (method, knobs) in PRESSES.items():
        cfg = compose([f"press={press}", "model=qwen3_8b", "benchmark=ruler_kvpress", "budget=0.5"])
        assert cfg.method.name == method and cfg.profile.name == "kvpress"
        assert {k: cfg.method[k] for k in knobs} == knobs, press
        assert cfg.benchmark.query_aware == press.startswith("query_aware"), press
        assert RunIdentity(cfg).folder in runs or method == "full"
    groups = plan(cfgs)
    assert sorted(tuple({RunIdentity(cfgs[i]).protocol for i in g}) for g in groups) == [
        ("question after compression",), ("question inside",)]
    assert sorted(len({RunIdentity(cfgs[i]).folder for i in g}) for g in groups) == [8, 49]


def test_the_leaderboard_dry_runs_and_is_priced(tmp_path):
    kvpress_ruler_files(tmp_path)
    out = subprocess.run([sys.executable, "run.py", "-m", "experiment=kvpress_leaderboard",
                          f"benchmark.data_dir={tmp_path}", "hydra.launcher.dry_run=true"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "57 runs, in 2 local job(s)" in out.stdout and out.stdout.count("ruler_kvpress/qwen3_8b/") == 57
    for protocol, runs in (("question after compression", 49), ("question inside", 8)):
        assert (f"model=qwen3_8b benchmark=ruler_kvpress (13 tasks at 4096 tokens, {protocol}; budgets 0.75, 0.5, "
                f"0.25, 0.125), {runs} run(s)") in out.stdout
    absent = subprocess.run([sys.executable, "run.py", "-m", "experiment=kvpress_leaderboard",
                             f"benchmark.data_dir={tmp_path / 'none'}", "hydra.launcher.dry_run=true"],
                            cwd=ROOT, capture_output=True, text=True)
    assert absent.returncode == 2 and "has no 4096/*.parquet" in absent.stderr + absent.stdout
    text = project(["experiment=kvpress_leaderboard"], str(ROOT / "results/bench/gpu_NVIDIA_H200.jsonl"), None,
                   decode_file=str(ROOT / "results/bench/gpu_NVIDIA_H200_decode.jsonl"))
    jobs = [line.split("|") for line in text.splitlines() if re.match(r"\| \d+ \| qwen3_8b", line)]
    assert sorted(int(j[3]) for j in jobs) == [8, 49] and all(int(j[4]) == 13 * 500 for j in jobs)
    assert all(float(j[5]) > 0 and float(j[7]) > 0 for j in jobs)
