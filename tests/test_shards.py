"""Shards: a run's samples split over jobs that each write their own part, merged once all are done, give what an
unsharded run gives; a merge lost to a crash is done by the next job; another shard count on a started run
completes it without a duplicate; a finished run is left alone."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pcs.run_folder
import pcs.models
import pcs.runner
from pcs.identity import RunIdentity
from pcs.runner import run, run_cells

from conftest import compose_cfg

TIMINGS = ("prefill_s", "decode_s")
CELLS = [("method=snapkv",), ("method=adakv",)]
ROOT = Path(__file__).resolve().parent.parent


def needle(model_dir, results, *extra):
    return compose_cfg(f"model.path={model_dir}", f"results_dir={results}", "progress=false", "budget=64",
                       "benchmark.context_lengths=[200,300,400]", "benchmark.depth_percents=[0,50,100]",
                       "benchmark.max_new_tokens=6", *extra)


def folder(cfg) -> Path:
    return Path(cfg.results_dir) / RunIdentity(cfg).folder


def rows(cfg) -> list[dict]:
    lines = (folder(cfg) / "predictions.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


SAME = ("score", "grid", "n_samples", "kv_cache_bytes", "kv_cache_bytes_full", "peak_kv_bytes", "max_kv_entries")


@pytest.fixture
def unsharded(tiny_model_dir, tmp_path):
    cfgs = [needle(tiny_model_dir, tmp_path / "whole", *cell) for cell in CELLS]
    return cfgs, run_cells(cfgs)


def test_three_shards_merge_into_what_one_job_writes(tiny_model_dir, tmp_path, unsharded):
    whole, want = unsharded
    cfgs = [needle(tiny_model_dir, tmp_path / "sharded", *cell) for cell in CELLS]
    assert run_cells(cfgs, shard=(0, 3)) == [None, None]            # the others are not done
    assert run_cells(cfgs, shard=(2, 3)) == [None, None]
    got = run_cells(cfgs, shard=(1, 3))                                 # the last to finish merges
    for cfg, ref, metrics, expected in zip(cfgs, whole, got, want):
        assert rows(cfg) == rows(ref)
        assert {k: metrics[k] for k in SAME} == {k: expected[k] for k in SAME}
        assert metrics["shards"] == 3 and expected["shards"] == 1
        shards = folder(cfg) / "shards"
        assert sorted(p.name for p in shards.iterdir()) == ["0-of-3", "1-of-3", "2-of-3"]
        assert [len((shards / f"{k}-of-3" / "predictions.jsonl").read_text().splitlines()) for k in range(3)] == [3] * 3


def test_a_merge_lost_to_a_crash_is_done_by_the_next_job(tiny_model_dir, tmp_path, unsharded, monkeypatch):
    whole, want = unsharded
    cfgs = [needle(tiny_model_dir, tmp_path / "crashed", *cell) for cell in CELLS]
    run_cells(cfgs, shard=(0, 3))
    run_cells(cfgs, shard=(1, 3))
    original = pcs.runner.summarize
    monkeypatch.setattr(pcs.runner, "summarize", lambda *a, **k: (_ for _ in ()).throw(SystemExit("killed")))
    with pytest.raises(SystemExit):
        run_cells(cfgs, shard=(2, 3))
    assert not (folder(cfgs[0]) / "metrics.json").exists()
    monkeypatch.setattr(pcs.runner, "summarize", original)
    asked = []
    step = pcs.runner.STEPS["generate"]
    monkeypatch.setitem(pcs.runner.STEPS, "generate", lambda requests, pool, loaded: step(
        ((s, p, asked.append(s.id) or c) for s, p, c in requests), pool, loaded))
    got = run_cells(cfgs, shard=(0, 3))            # any job of the run: nothing left to answer, it merges
    assert asked == []
    for cfg, ref, metrics, expected in zip(cfgs, whole, got, want):
        assert rows(cfg) == rows(ref) and metrics["score"] == expected["score"]


def test_a_shard_line_that_is_not_a_row_is_set_aside_and_its_sample_answered_again(tiny_model_dir, tmp_path,
                                                                                     unsharded):
    """Bytes changed inside a shard's file (a bad disk, a node lost mid-flush): the job that resumes the shard keeps
    every line that reads, moves the others aside and answers their samples again; the run equals one job's."""
    whole, want = unsharded
    cfgs = [needle(tiny_model_dir, tmp_path / "corrupt", *cell) for cell in CELLS]
    run_cells(cfgs, shard=(0, 3))
    run_cells(cfgs, shard=(1, 3))
    shard = folder(cfgs[0]) / "shards" / "1-of-3" / "predictions.jsonl"
    lines = shard.read_bytes().split(b"\n")
    lines[1] = b"\x00\xff" * (len(lines[1]) // 2)            # the middle row of three, same length, not text
    shard.write_bytes(b"\n".join(lines))
    assert pcs.run_folder.all_rows(folder(cfgs[0])) and "unread" not in "".join(
        p.name for p in shard.parent.iterdir())              # read past (a dry run's check passes), not moved yet
    merged = run_cells(cfgs, shard=(2, 3))
    assert merged[0] is None and merged[1] is not None          # the first run's shard 1 misses a row: not merged
    got = [run_cells(cfgs, shard=(1, 3))[0], merged[1]]         # answers it again, then merges
    assert (shard.parent / pcs.run_folder.SET_ASIDE).read_bytes() == lines[1] + b"\n"
    for cfg, ref, metrics, expected in zip(cfgs, whole, got, want):
        assert rows(cfg) == rows(ref) and metrics["score"] == expected["score"]


def test_a_job_whose_answers_vanish_from_its_file_fails_and_a_rerun_answers_them(tiny_model_dir, tmp_path,
                                                                                   unsharded, monkeypatch):
    """A row of this job's shard changed while the job ran: the merge would wait for it forever, so the job fails
    naming the file (the sweep reports it and a resubmission answers the row again)."""
    whole, want = unsharded
    cfgs = [needle(tiny_model_dir, tmp_path / "vanished", *cell) for cell in CELLS[:1]]
    run_cells(cfgs, shard=(0, 2))
    original = pcs.run_folder.RunFolder.merge
    shard = folder(cfgs[0]) / "shards" / "1-of-2" / "predictions.jsonl"

    def corrupting(self, *args):
        shard.write_text("".join(["not a row\n", *shard.read_text().splitlines(keepends=True)[1:]]))
        return original(self, *args)
    monkeypatch.setattr(pcs.run_folder.RunFolder, "merge", corrupting)
    with pytest.raises(pcs.run_folder.LostRows, match="1-of-2/predictions.jsonl no longer holds 1 of the answers"):
        run_cells(cfgs, shard=(1, 2))
    monkeypatch.setattr(pcs.run_folder.RunFolder, "merge", original)
    got = run_cells(cfgs, shard=(1, 2))
    assert rows(cfgs[0]) == rows(whole[0]) and got[0]["score"] == want[0]["score"]


def test_a_sweep_whose_jobs_all_ended_without_finishing_a_run_fails_it(tiny_model_dir, tmp_path):
    """Every shard's job returned without error, but none merged (a row went missing after its job ended): the
    launcher fails the cell, naming the run, where a finished run, or one another job holds, passes."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra_plugins.pcs_launcher.pcs_launcher import per_run
    cfg = needle(tiny_model_dir, tmp_path / "unmerged", "method=snapkv")
    run_cells([cfg], shard=(0, 2))                           # shard 1 never answered: the run is not finished

    def outcome():
        ended = [[JobReturn(overrides=[], cfg=cfg, status=JobStatus.COMPLETED, _return_value=None)]] * 2
        return per_run([cfg], [[0]], ended, 2)[0]
    assert outcome().status == JobStatus.FAILED
    assert f"{folder(cfg)}: every job ended, yet some samples have no answer" in str(outcome()._return_value)
    (folder(cfg) / "shards" / "1-of-2").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print(flush=True); time.sleep(120)",
                               str(folder(cfg) / "shards" / "1-of-2" / ".lock")], stdout=subprocess.PIPE, text=True)
    try:                                 # another process (a job at work in shard 1) holds its lock: no failure
        holder.stdout.readline()
        assert outcome().status == JobStatus.COMPLETED
    finally:
        holder.kill()
    run_cells([cfg], shard=(1, 2))
    assert outcome().status == JobStatus.COMPLETED


def test_another_shard_count_completes_a_started_run_without_duplicates(tiny_model_dir, tmp_path, unsharded):
    whole, _ = unsharded
    cfgs = [needle(tiny_model_dir, tmp_path / "changed", *cell) for cell in CELLS]
    run_cells(cfgs, shard=(0, 2))                  # 5 of 9 samples
    for index in range(3):
        got = run_cells(cfgs, shard=(index, 3))
    assert all(metrics is not None for metrics in got)
    for cfg, ref in zip(cfgs, whole):
        assert rows(cfg) == rows(ref) and len({r["id"] for r in rows(cfg)}) == 9


def test_an_unsharded_rerun_finishes_a_sharded_run_and_a_finished_run_is_left_alone(tiny_model_dir, tmp_path,
                                                                                     unsharded, monkeypatch):
    whole, want = unsharded
    cfg = needle(tiny_model_dir, tmp_path / "mixed", *CELLS[0])
    run_cells([cfg], shard=(1, 3))
    metrics = run(cfg)
    assert rows(cfg) == rows(whole[0]) and metrics["score"] == want[0]["score"] and metrics["n_resumed"] == 3
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("a finished run was worked on"))
    assert run_cells([cfg], shard=(2, 3)) == [metrics]


def sweep(model_dir, results, *extra):
    return subprocess.run([sys.executable, "run.py", "-m", f"model.path={model_dir}", f"results_dir={results}",
                           "progress=false", "budget=64", "benchmark.context_lengths=[200,300,400]",
                           "benchmark.depth_percents=[0,50,100]", "benchmark.max_new_tokens=6",
                           "method=snapkv,adakv", f"hydra.sweep.dir={results}/multirun", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("launcher", ["local", "local_jobs"])
def test_a_sharded_sweep_through_the_launchers_writes_what_one_job_writes(tiny_model_dir, tmp_path, launcher,
                                                                           unsharded):
    """``hydra.launcher.shards=3``: the local launcher runs the 3 shards one after another, local_jobs as 3
    submitit processes (the SLURM launcher's path); the dry run names the jobs and shards."""
    whole, want = unsharded
    dry = sweep(tiny_model_dir, tmp_path / "dry", f"hydra/launcher={launcher}", "hydra.launcher.shards=3",
                "hydra.launcher.dry_run=true")
    assert "in 3 " in dry.stdout and "(1 group(s) x 3 shards)" in dry.stdout and "jobs 0-2 (shards 0-2)" in dry.stdout
    assert not (tmp_path / "dry" / "needle").exists()
    proc = sweep(tiny_model_dir, tmp_path / launcher, f"hydra/launcher={launcher}", "hydra.launcher.shards=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for ref, expected in zip(whole, want):
        cfg = compose_cfg(f"model.path={tiny_model_dir}", f"results_dir={tmp_path / launcher}", "progress=false",
                          "budget=64", "benchmark.context_lengths=[200,300,400]", "benchmark.depth_percents=[0,50,100]",
                          "benchmark.max_new_tokens=6", f"method={ref.method.name}")
        assert rows(cfg) == rows(ref)
        metrics = json.loads((folder(cfg) / "metrics.json").read_text())
        assert metrics["shards"] == 3 and metrics["score"] == expected["score"]
    if launcher == "local_jobs":
        assert len(list((tmp_path / launcher / "multirun").rglob("*_result.pkl"))) == 3


def test_a_bad_shard_count_is_refused_before_anything_runs(tiny_model_dir, tmp_path):
    proc = sweep(tiny_model_dir, tmp_path, "hydra.launcher.shards=0")
    assert proc.returncode == 2 and "hydra.launcher.shards=0 must be a positive integer" in proc.stderr


def test_status_counts_samples_over_shards_and_names_running_stopped_and_failed_jobs(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    import os
    from pcs.status import report, run_status
    cfgs = [needle(tiny_model_dir, tmp_path, *cell) for cell in CELLS]
    run_cells(cfgs, shard=(0, 3))
    status = run_status(folder(cfgs[0]))
    assert (status["done"], status["total"], status["finished"], status["jobs"], status["errors"]) == (3, 9, False, [], [])
    monkeypatch.setattr(pcs.runner, "summarize", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room")))
    run_cells(cfgs, shard=(1, 3))
    with pytest.raises(MemoryError):
        run_cells(cfgs, shard=(2, 3))
    text = report(tmp_path)
    assert f"{RunIdentity(cfgs[0]).folder}  9/9  failed" in text and "last error, shard 2/3: MemoryError: no room" in text
    shard = folder(cfgs[1]) / "shards" / "0-of-3"
    (shard / "running.json").write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": os.getpid(),
                                                    "since": "now"}))
    assert run_status(folder(cfgs[1]))["jobs"] == [f"shard 0/3: running on {__import__('socket').gethostname()}:"
                                                   f"{os.getpid()} since now"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (shard / "running.json").write_text(json.dumps({"host": __import__("socket").gethostname(),
                                                    "pid": int(dead.stdout), "since": "then"}))
    assert "stopped" in run_status(folder(cfgs[1]))["jobs"][0]
    proc = subprocess.run([sys.executable, "-m", "pcs.status", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "9/9  failed" in proc.stdout


def test_status_tells_a_job_stopped_from_outside_from_a_failure(tiny_model_dir, tmp_path, monkeypatch):
    """submitit leaves a preempted or timed-out job by SystemExit (after requeueing it): not a failure."""
    from pcs.status import report
    cfgs = [needle(tiny_model_dir, tmp_path, *cell) for cell in CELLS]

    def preempted(*_):
        raise SystemExit(-1)

    monkeypatch.setattr(pcs.models, "load_model", preempted)
    with pytest.raises(SystemExit):
        run_cells(cfgs, shard=(1, 3))
    text = report(tmp_path)
    assert f"{RunIdentity(cfgs[0]).folder}  0/?  interrupted" in text        # stopped before it counted samples
    assert "last error, shard 1/3: interrupted (SystemExit)" in text and "failed" not in text


def test_shards_writing_one_file_at_once_each_replace_it_whole(tmp_path):
    """Shards of a run write its config.yaml and samples.json at once (found on the SLURM cluster: with one
    shared temporary name, one job's replace took the other's file and that job failed)."""
    from concurrent.futures import ThreadPoolExecutor
    from pcs.paths import write_atomic
    path = tmp_path / "samples.json"
    texts = [json.dumps({"samples": n, "pad": "x" * 5000}) for n in range(4)]

    def write_many(text):
        for _ in range(200):
            write_atomic(path, text)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write_many, texts))                 # raises if any write failed
    assert path.read_text() in texts and sorted(p.name for p in tmp_path.iterdir()) == ["samples.json"]


def merged_rows(folder, samples: set[str]) -> int | None:
    """How many rows a shard's merge hands over (None: it found samples missing)."""
    with folder.merge(samples) as rows:
        return None if rows is None else len(rows)


def test_two_shards_finishing_at_once_leave_the_run_merged(tmp_path):
    """Shard A holds the run lock and has read the rows before shard B's last row landed; B, finishing a moment
    later, must wait for the lock and merge (were B to leave on finding the lock taken, the run would hold every
    row and no metrics: A found B's sample missing)."""
    import multiprocessing
    import pcs.run_folder
    from pcs.run_folder import RunFolder
    run_dir = tmp_path / "run"
    samples = {str(i) for i in range(4)}

    def write(k, ids):
        (run_dir / "shards" / f"{k}-of-2").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "shards" / f"{k}-of-2" / "predictions.jsonl", "a") as f:
            f.writelines(json.dumps({"id": str(i)}) + "\n" for i in ids)

    write(0, [0, 2])
    write(1, [1])
    context = multiprocessing.get_context("fork")
    read, results = context.Event(), context.Queue()

    def shard_a():
        import time
        original = pcs.run_folder.all_rows

        def slow(path):
            rows = original(path)
            read.set()
            time.sleep(1.0)               # still under the lock when B finishes
            return rows
        pcs.run_folder.all_rows = slow
        results.put(("A", merged_rows(RunFolder(run_dir, (0, 2)), samples)))

    a = context.Process(target=shard_a)
    a.start()
    assert read.wait(30)
    write(1, [3])                         # B's last row lands after A read the rows
    got_b = merged_rows(RunFolder(run_dir, (1, 2)), samples)
    a.join(30)
    assert results.get(timeout=5) == ("A", None) and got_b == 4


def test_status_shows_each_finished_runs_score_and_ends_with_a_summary(tmp_path):
    """Three hand-made run folders: one finished (its score and the KV share it kept printed on its line), one
    part way with a job's error (failed), one part way with no job (not finished); the last line counts them and
    the samples done of their totals."""
    from pcs.run_folder import write_json_atomic, write_rows_atomic
    from pcs.status import report

    def make(cells, done, total, metrics=None, error=None):
        cfg = needle("unused", tmp_path, *cells)
        path = folder(cfg)
        path.mkdir(parents=True)
        (path / "config.yaml").write_text(RunIdentity(cfg).saved_config)
        write_json_atomic(path / "samples.json", {"samples": total})
        write_rows_atomic(path / "predictions.jsonl", [{"id": str(i), "score": 50.0} for i in range(done)])
        if metrics:
            write_json_atomic(path / "metrics.json", metrics)
        if error:
            (path / "error.txt").write_text(error)
        return RunIdentity(cfg).folder

    finished = make(("method=snapkv",), 9, 9, {"score": 61.25, "n_samples": 9, "kv_cache_bytes": 25,
                                               "kv_cache_bytes_full": 100})
    failed = make(("method=adakv",), 4, 9, error="MemoryError: no room")
    stopped = make(("method=pyramidkv",), 2, 9)
    lines = report(tmp_path).splitlines()
    assert f"{finished}  9/9  finished  score 61.25, KV 25.0 %" in lines
    assert f"{failed}  4/9  failed" in lines and f"{stopped}  2/9  not finished" in lines
    assert lines[-1] == ("3 runs: 1 finished, 1 failed, 1 not finished; 15 samples done of 27; "
                         "protocols: question inside (3)")
    # Narrowed: by state (the summary counts the runs shown), and to one folder of the results or one run's.
    assert report(tmp_path, "unfinished").splitlines()[-1] == ("2 runs: 1 failed, 1 not finished; 6 samples done of "
                                                               "18; protocols: question inside (2)")
    assert report(tmp_path, "failed").splitlines()[0] == f"{failed}  4/9  failed"
    assert report(tmp_path, "running") == f"no running runs under {tmp_path}"
    one = report(tmp_path / finished).splitlines()
    assert one[0].endswith("9/9  finished  score 61.25, KV 25.0 %") and one[-1].startswith("1 runs: 1 finished")
    corrupted = tmp_path / stopped / "predictions.jsonl"
    corrupted.write_text('{"id": "0"}\n{"id": \n{"id": "1"}\n')
    assert any(":2 is not a JSON row" in line for line in report(tmp_path, "failed").splitlines())
