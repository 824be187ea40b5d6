"""The run folder contract: files, fields, resume, skip, refusal, and fail-fast config errors."""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import pcs.models
import pcs.runner
from pcs.identity import RunIdentity
from pcs.errors import ConfigError
from pcs.runner import run

from conftest import compose_cfg

ROOT = Path(__file__).resolve().parent.parent


def small_cfg(model_dir, results, *extra):
    return compose_cfg(f"model.path={model_dir}", f"results_dir={results}", "progress=false",
                       "benchmark.context_lengths=[200,300]", "benchmark.depth_percents=[0,100]",
                       "benchmark.max_new_tokens=3", "budget=64", *extra)


def folder(results, cfg):
    return Path(results) / RunIdentity(cfg).folder


def test_run_writes_the_documented_folder(tiny_model_dir, tmp_path):
    cfg = small_cfg(tiny_model_dir, tmp_path)
    metrics = run(cfg)
    d = folder(tmp_path, cfg)
    assert d.name == "snapkv_perturbation_b64_context_lengths=200+300_depth_percents=0+100_max_new_tokens=3"
    assert (d / "config.yaml").exists()
    rows = [json.loads(l) for l in (d / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["len200_depth0", "len200_depth100", "len300_depth0", "len300_depth100"]
    for r in rows:
        assert {"id", "prediction", "prompt_tokens", "kv_cache_bytes", "kv_cache_bytes_full", "score"} <= set(r)
        assert abs(r["kv_cache_bytes"] / r["kv_cache_bytes_full"] - 64 / r["prompt_tokens"]) < 1e-9
    on_disk = json.loads((d / "metrics.json").read_text())
    assert on_disk == metrics
    assert on_disk["n_samples"] == 4
    assert on_disk["kv_cache_bytes"] == sum(r["kv_cache_bytes"] for r in rows)
    assert on_disk["score"] == pytest.approx(sum(r["score"] for r in rows) / 4)
    assert set(on_disk["grid"]) == {"200", "300"}
    assert (d / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for key in ("kv_cache_bytes_full", "wall_time_s"):
        assert key in on_disk


def test_finished_run_is_not_redone(tiny_model_dir, tmp_path, monkeypatch):
    cfg = small_cfg(tiny_model_dir, tmp_path)
    first = run(cfg)
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("a finished run loaded the model"))
    assert run(cfg) == first


def test_interrupted_run_resumes_at_first_missing_sample(tiny_model_dir, tmp_path):
    cfg = small_cfg(tiny_model_dir, tmp_path)
    run(cfg)
    d = folder(tmp_path, cfg)
    complete = (d / "predictions.jsonl").read_text().splitlines()
    assert json.loads((d / "metrics.json").read_text())["n_resumed"] == 0
    # Simulate a crash: two samples done, a third torn mid-write, no metrics.
    (d / "metrics.json").unlink()
    (d / "predictions.jsonl").write_text("\n".join(complete[:2]) + "\n" + complete[2][:25])
    run(cfg)
    resumed = (d / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(l)["id"] for l in resumed] == [json.loads(l)["id"] for l in complete]
    assert resumed[:2] == complete[:2]
    strip = lambda l: {k: v for k, v in json.loads(l).items() if k not in ("prefill_s", "decode_s")}
    assert [strip(l) for l in resumed] == [strip(l) for l in complete]   # greedy: same outputs
    assert json.loads((d / "metrics.json").read_text())["n_resumed"] == 2   # wall_time_s: the other samples'


def test_folder_with_another_config_is_refused(tiny_model_dir, tmp_path):
    cfg = small_cfg(tiny_model_dir, tmp_path)
    d = folder(tmp_path, cfg)
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("something: else\n")
    with pytest.raises(ConfigError, match="another config"):
        run(cfg)


@pytest.mark.parametrize("override,needle", [
    ("budget=16", "budget=16"), ("budget=0", "budget=0"), ("budget=-5", "budget=-5"),
    ("selection.alpha=1.5", "selection.alpha=1.5"), ("selection.alpha=-0.1", "selection.alpha=-0.1"),
    ("model.path=/no/such/weights", "/no/such/weights"), ("method.pooling=median", "median"),
    ("benchmark.context_lengths=[9000]", "9000"), ("model.max_length=9000", "model.max_length=9000"),
])
def test_bad_values_fail_before_the_model_loads(tmp_path, monkeypatch, override, needle):
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("model loaded before validation"))
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        run(compose_cfg(f"results_dir={tmp_path}", override))
    assert not any(tmp_path.iterdir())   # nothing half-written


@pytest.mark.parametrize("override,needle", [
    ("method.scope=global", "method.scope='global'"), ("method.gqa=max", "method.gqa='max'"),
    ("method.pool_on=values", "method.pool_on='values'"), ("method.sinks=100", "method.sinks=100"),
])
def test_bad_laprox_knobs_fail_before_the_model_loads(tmp_path, monkeypatch, override, needle):
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("model loaded before validation"))
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        run(compose_cfg(f"results_dir={tmp_path}", "method=laprox", override))


@pytest.mark.parametrize("overrides,expected", [
    (["budget=8"], ["budget=8", "window"]),
    (["budget=0"], ["budget=0", "positive integer"]),
    (["preset=criticalkv", "method=streamingllm"], ["method=streamingllm has none", "adakv, cur, expected_attention"]),
    (["engine.pool=0"], ["engine.pool=0"]),
    (["engine.stage2.search=everything"], ["engine.stage2.search=everything", "auto, bounded, exhaustive"]),
    (["engine.stage2.loose_share=2"], ["engine.stage2.loose_share=2 must lie in [0, 1]"]),
    (["engine.layers_behind=true"], ["engine.layers_behind=True must be a whole number"]),
    (["engine.stop_when_scored=true"], ["engine.stop_when_scored=true", "benchmark=needle"]),
    (["selection.alpha=2"], ["selection.alpha=2 must lie in [0, 1]"]),
    (["method=adakv", "method.pooling=mean"], ["method.pooling='mean'", "max, avg"]),
    (["profile.ties=first"], ["profile.ties='first'", "earlier, topk"]),
    (["benchmark=longbench", "benchmark.data_dir=/nonexistent"], ["/nonexistent/narrativeqa.jsonl is missing",
                                                                   "scripts/fetch_longbench.py"]),
    (["benchmark=ruler", "benchmark.tasks=[niah]"], ["['niah'] are not RULER tasks"]),
    (["benchmark.depth_percents=[120]"], ["depth_percents must lie in [0, 100]"]),
    (["-m", "method=snapkv,adakv", "benchmark=longbench", "benchmark.data_dir=/nonexistent"],
     ["narrativeqa.jsonl is missing"]),
    (["-m", "method=snapkv", "hydra.launcher.shards=0"], ["hydra.launcher.shards=0"]),
    (["method=snapk"], ["method=snapk is not an option", "did you mean snapkv"]),
    (["method.floor=0.1"], ["method=snapkv has no knob floor", "adakv"]),
    (["-m", "model=llama31,mistral7b", "model.path=/tmp"], ["model.path=/tmp", "model=llama31, model=mistral7b"]),
    (["-m", "method=snapkv", "hydra/launcher=slurm", "hydra.launcher.shards=2", "selection.alpha=-1"],
     ["selection.alpha=-1"])])
def test_cli_reports_config_errors_before_torch_loads_in_under_two_cpu_seconds(tmp_path, overrides, expected):
    """A torch that cannot be imported sits first on the path: the error must come without it, and fast, in a
    run and in a sweep (before any job is submitted). Fast is the child's CPU time, which a busy machine does not
    stretch as it stretches wall time, though a shared one still can (a sweep of two cells took 1.3-2.1 s here,
    four compositions of the config by Hydra): the best of up to three tries must stay under two seconds, so a
    lasting regression fails every try and a neighbour's burst fails one."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('torch imported before the config was checked')")
    env = {**os.environ, "PYTHONPATH": str(fake)}
    tries = []
    while len(tries) < 3 and (not tries or tries[-1] >= 2.0):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run([sys.executable, "run.py", *overrides, f"results_dir={tmp_path}",
                               f"hydra.sweep.dir={tmp_path}/multirun"], cwd=ROOT, capture_output=True, text=True,
                              env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        tries.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        assert proc.returncode == 2, proc.stderr
        assert all(text in proc.stderr for text in expected), proc.stderr
    assert min(tries) < 2.0, (tries, proc.stderr)


def test_full_cache_runs_share_one_folder_whatever_budget_or_selection(tiny_model_dir, tmp_path, monkeypatch):
    first = run(small_cfg(tiny_model_dir, tmp_path, "method=full", "budget=64", "selection=attention"))
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("the same full-cache run was redone"))
    assert run(small_cfg(tiny_model_dir, tmp_path / ".." / tmp_path.name, "method=full", "budget=256")) == first


def test_resuming_puts_every_done_row_on_disk_before_the_first_new_one(tmp_path):
    """A resumed run with more done rows than a file buffer holds (here 60 of ~500 bytes), and a torn line: once
    the file is open for the new rows, the disk holds every done row, so a kill before the next row loses none."""
    rows = [{"id": f"s{i}", "prediction": "x" * 450, "score": 100.0} for i in range(60)]
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "s60", "predic')
    from pcs.run_folder import RunFolder
    folder = RunFolder(tmp_path)
    with folder.appending(100) as out:
        on_disk = [json.loads(line) for line in path.read_text().splitlines()]
        assert on_disk == rows and folder.done == {r["id"] for r in rows}
        out.append({"id": "s60"})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [f"s{i}" for i in range(61)]


def test_samples_are_answered_one_task_at_a_time_in_turn():
    """A run stopped part way holds the first samples of every task alike (RULER lists a task's samples together)."""
    from pcs.benchmarks.base import Sample
    from pcs.runner import interleaved
    samples = [Sample(f"{task}{i}", "", 1, meta={"task": task, "stratum": f"{task}_1024"})
               for task, n in (("a", 3), ("b", 2), ("c", 1)) for i in range(n)]
    assert [s.id for s in interleaved(samples)] == ["a0", "b0", "c0", "a1", "b1", "a2"]
    longbench = [Sample(f"{task}{i}", "", 1, meta={"task": task}) for task in "xy" for i in range(2)]
    assert [s.id for s in interleaved(longbench)] == ["x0", "y0", "x1", "y1"]


def ruler_cfg(model_dir, tmp_path, results, *extra):
    return compose_cfg("benchmark=ruler", "benchmark.lengths=[1024]", "benchmark.tasks=[niah_single_1]",
                       f"benchmark.cache_dir={tmp_path / 'samples'}", f"model.path={model_dir}", f"results_dir={results}",
                       "method=snapkv", "budget=256", "engine.stop_when_scored=true", "progress=false", *extra)


def rows_of(results, cfg) -> list[dict]:
    return [json.loads(line) for line in (folder(results, cfg) / "predictions.jsonl").read_text().splitlines()]


def test_a_run_on_more_samples_answers_only_the_new_ones(tiny_model_dir, tmp_path):
    """The same run on 3 samples beside its finished 2-sample run: the 2 answers are taken (timings and all),
    not recomputed, and the run is what a fresh 3-sample run writes. A run that differs in another knob (budget
    128, first by name) is not taken from."""
    results = tmp_path / "results"
    small = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=2")
    run(ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=2", "budget=128"))
    run(small)
    grown_cfg = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=3")
    grown = run(grown_cfg)
    assert grown["n_resumed"] == 2 and grown["n_samples"] == 3
    assert grown["answers_from"] == {"run": folder(results, small).name, "rows": 2}
    assert rows_of(results, grown_cfg)[:2] == rows_of(results, small)
    fresh_cfg = ruler_cfg(tiny_model_dir, tmp_path, tmp_path / "fresh", "benchmark.n_samples=3")
    fresh = run(fresh_cfg)
    assert fresh["n_resumed"] == 0 and "answers_from" not in fresh
    strip = lambda row: {k: v for k, v in row.items() if k not in ("prefill_s", "decode_s")}
    assert [strip(r) for r in rows_of(results, grown_cfg)] == [strip(r) for r in rows_of(tmp_path / "fresh", fresh_cfg)]
    assert grown["score"] == fresh["score"]


def test_shards_of_a_grown_run_each_take_their_share_of_the_answers(tiny_model_dir, tmp_path):
    """The 3-sample run in 2 shards beside the finished 2-sample run: shard 0 (samples 0 and 2) takes sample 0's
    answer and answers sample 2, shard 1 takes sample 1's; the merged run names its source once with both rows."""
    from pcs.runner import run_cells
    results = tmp_path / "results"
    small = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=2")
    run(small)
    grown_cfg = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=3")
    assert run_cells([grown_cfg], shard=(0, 2)) == [None]
    shards = folder(results, grown_cfg) / "shards"
    assert json.loads((shards / "0-of-2" / "answers_from.json").read_text())["rows"] == 1
    (grown,) = run_cells([grown_cfg], shard=(1, 2))
    assert grown["answers_from"] == {"run": folder(results, small).name, "rows": 2} and grown["n_samples"] == 3
    assert rows_of(results, grown_cfg)[:2] == rows_of(results, small)


def test_a_run_on_fewer_tasks_takes_the_answers_of_a_stopped_run(tiny_model_dir, tmp_path):
    """A two-task run stopped part way (killed: its last rows and metrics gone) gives a run of one of its tasks, on
    more samples, the answers it holds to that task; the run ends as a fresh one-task run does."""
    results = tmp_path / "results"
    both = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.tasks=[niah_single_1,niah_single_2]",
                     "benchmark.n_samples=2")
    run(both)
    stopped = folder(results, both)
    answered = ["niah_single_1_1024_0", "niah_single_2_1024_0", "niah_single_1_1024_1"]   # killed after these 3
    rows = [r for r in (stopped / "predictions.jsonl").read_text().splitlines() if json.loads(r)["id"] in answered]
    assert len(rows) == 3
    (stopped / "predictions.jsonl").write_text("\n".join(rows) + "\n")
    (stopped / "metrics.json").unlink()
    one_cfg = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.tasks=[niah_single_2]", "benchmark.n_samples=3")
    one = run(one_cfg)
    assert one["answers_from"] == {"run": stopped.name, "rows": 1} and one["n_resumed"] == 1
    assert rows_of(results, one_cfg)[0] == next(json.loads(r) for r in rows if "single_2" in r)
    fresh_cfg = ruler_cfg(tiny_model_dir, tmp_path, tmp_path / "fresh", "benchmark.tasks=[niah_single_2]",
                          "benchmark.n_samples=3")
    fresh = run(fresh_cfg)
    strip = lambda row: {k: v for k, v in row.items() if k not in ("prefill_s", "decode_s")}
    assert [strip(r) for r in rows_of(results, one_cfg)] == [strip(r) for r in rows_of(tmp_path / "fresh", fresh_cfg)]
    assert one["score"] == fresh["score"]


def test_answers_are_not_taken_from_a_run_a_job_is_working_in(tiny_model_dir, tmp_path):
    """A run part way whose folder another job holds (its rows not settled) gives no answers."""
    results = tmp_path / "results"
    small = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=2")
    run(small)
    (folder(results, small) / "metrics.json").unlink()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.lockf(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(60)"), str(folder(results, small) / ".lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        grown = run(ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=3"))
    finally:
        holder.kill()
        holder.wait()
    assert grown["n_resumed"] == 0 and "answers_from" not in grown


def test_growing_a_run_takes_only_the_samples_the_other_count_builds_alike(tiny_model_dir, tmp_path, monkeypatch):
    """Where the smaller count's benchmark built a sample with the same id but another prompt, the row stored the
    fingerprint of that sample: it is answered anew."""
    import dataclasses
    from pcs.benchmarks.ruler import Ruler
    results = tmp_path / "results"
    built = Ruler.samples

    def other_second_sample(self, tokenizer):
        samples = built(self, tokenizer)
        if self.cfg.n_samples == 2:
            samples[1] = dataclasses.replace(samples[1], prompt=samples[1].prompt + " Another prompt.")
        return samples
    monkeypatch.setattr(Ruler, "samples", other_second_sample)
    run(ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=2"))
    grown = run(ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=3"))
    assert grown["n_resumed"] == 1 and grown["answers_from"]["rows"] == 1


def test_a_row_without_its_samples_fingerprint_is_not_adopted(tiny_model_dir, tmp_path):
    """Rows that do not say which sample they answered (no ``sample`` fingerprint) cannot be matched to the samples
    a new run asks: the grown run answers every sample itself."""
    from pcs.run_folder import SAMPLE
    results = tmp_path / "results"
    small = ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=2")
    run(small)
    predictions = results / RunIdentity(small).folder / "predictions.jsonl"
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert all(row[SAMPLE] for row in rows)
    predictions.write_text("".join(json.dumps({k: v for k, v in row.items() if k != SAMPLE}) + "\n" for row in rows))
    grown = run(ruler_cfg(tiny_model_dir, tmp_path, results, "benchmark.n_samples=3"))
    assert grown["n_resumed"] == 0 and "answers_from" not in grown
