"""Cluster-scale use: experiment files, launchers, resume after a kill, one job per folder, W&B
offline files read back, provenance."""
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import pcs.models
import pcs.runner
from pcs.validation import validate
from pcs.identity import RunIdentity
from pcs.run_folder import exclusive
from pcs.runner import run

from conftest import CONF, compose_cfg, longbench_files
from oracles import hydra_cfg

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml"))
TIMING = ("prefill_s", "decode_s")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_resolves_and_sweeps(experiment):
    OmegaConf.to_container(compose_cfg(f"experiment={experiment}"), resolve=True)
    params = hydra_cfg(f"experiment={experiment}").hydra.sweeper.params
    assert params, f"{experiment} sweeps nothing"
    for key, values in params.items():   # every value of the sweep composes and validates
        for value in str(values).split(","):
            validate(compose_cfg(f"experiment={experiment}", f"{key}={value}"))


def test_paper_experiments_cover_the_tables():
    assert {"table1", "table2", "table3", "table5", "table6", "table7", "table8", "needle128k", "perturbation",
            "smoke"} <= set(EXPERIMENTS)
    assert str(hydra_cfg("experiment=table2").hydra.sweeper.params.method) == "full,pyramidkv"
    assert hydra_cfg("experiment=table7").compress.trigger == 256


def test_slurm_launcher_asks_one_gpu_per_job_and_more_for_big_models():
    launcher = hydra_cfg("experiment=table1", "hydra/launcher=slurm").hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.gpus_per_node == 1
    assert hydra_cfg("experiment=table8", "hydra/launcher=slurm").hydra.launcher.gpus_per_node == 2


def test_show_a_sweeps_launcher_config_from_the_command_line(tmp_path):
    """The dry run that follows checks each cell's data as its job will: the default LongBench folder holds it."""
    longbench_files(tmp_path / "cache" / "longbench")
    proc = subprocess.run([sys.executable, "run.py", "-m", "experiment=table1", "hydra/launcher=slurm",
                           f"hydra.sweep.dir={tmp_path}/sweep", "--cfg", "hydra"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PCS_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    config, jobs = proc.stdout.split("[pcs] ")
    launcher = OmegaConf.create(config).hydra.launcher
    assert launcher.gpus_per_node == 1 and launcher._target_.endswith("GroupedSlurmLauncher")
    # Then the jobs: one per model, each with the full cache once and the 8 compressed runs.
    assert jobs.startswith("32 sweep cells, 18 runs, in 2 slurm job(s)")
    assert jobs.count("  job ") == 2 and jobs.count("longbench/llama31/") == 9 and jobs.count("/full\n") == 2


def test_show_a_command_line_sweeps_config_and_its_cells(tmp_path):
    """Values swept on the command line (which Hydra accepts only in a sweep) are left out of the config shown,
    as an experiment's sweeper params are, and each cell appears among the jobs."""
    proc = subprocess.run([sys.executable, "run.py", "-m", "method=snapkv,adakv", "budget=64,128", "model=llama31",
                           f"hydra.sweep.dir={tmp_path}", "--cfg", "job"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    config, jobs = proc.stdout.split("[pcs] ")
    shown = OmegaConf.create(config)
    assert shown.model.name == "llama31" and shown.method.name == hydra_cfg().method.name
    assert jobs.startswith("4 sweep cells, 4 runs")
    assert all(f"/{m}_perturbation_b{b}\n" in jobs for m in ("snapkv", "adakv") for b in (64, 128)), jobs


@pytest.mark.embedded
def test_smoke_multirun_as_one_submitit_job(embedded_dir, tmp_path):
    proc = subprocess.run([sys.executable, "run.py", "-m", "experiment=smoke", "hydra/launcher=local_jobs",
                           f"results_dir={tmp_path / 'results'}", f"hydra.sweep.dir={tmp_path / 'multirun'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    finished = sorted(p.parent.name for p in (tmp_path / "results").rglob("metrics.json"))
    assert finished == ["snapkv_perturbation_b128_context_lengths=600_depth_percents=50_max_new_tokens=24",
                        "snapkv_perturbation_b64_context_lengths=600_depth_percents=50_max_new_tokens=24"]
    assert "2 sweep cells, 2 runs, in 1 local job(s)" in proc.stdout
    assert len(list((tmp_path / "multirun").rglob("*_result.pkl"))) == 1     # one submitit job for the group


def test_a_submitted_job_runs_the_configs_checked_at_submission(tiny_model_dir, tmp_path):
    """A task that starts or is requeued after the checkout's config files changed still runs what was
    submitted: its submitted pickle, run again after the experiment's file is edited, makes no other run."""
    experiments = tmp_path / "conf" / "experiment"
    experiments.mkdir(parents=True)
    edited = experiments / "edited_later.yaml"
    edited.write_text("# @package _global_\nbudget: 64\n")
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "run.py", "-m", "hydra/launcher=local_jobs",
                           f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=edited_later",
                           *needle_args(tiny_model_dir, results)[:1], f"results_dir={results}", "progress=false",
                           "benchmark.context_lengths=[200]", "benchmark.depth_percents=[50]",
                           "benchmark.max_new_tokens=6", "method=snapkv,adakv", f"hydra.sweep.dir={tmp_path / 'm'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    finished = sorted(p.parent.name for p in results.rglob("metrics.json"))
    assert len(finished) == 2 and all("_b64_" in name for name in finished)
    (submitted,) = (tmp_path / "m").rglob("*_submitted.pkl")        # one job for the group

    edited.write_text("# @package _global_\nbudget: 48\n")
    again = subprocess.run([sys.executable, "-c", (
        "import sys; from submitit.core.utils import DelayedSubmission; "
        "rets = DelayedSubmission.load(sys.argv[1]).result(); print(sorted(r.cfg.budget for r in rets))"),
        str(submitted)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == "[64, 64]"
    assert sorted(p.parent.name for p in results.rglob("metrics.json")) == finished


def needle_args(model_dir, results):
    return [f"model.path={model_dir}", f"results_dir={results}", "progress=false", "budget=64",
            "benchmark.context_lengths=[200,300,400]", "benchmark.depth_percents=[0,50,100]",
            "benchmark.max_new_tokens=12"]


def rows_of(results, cfg):
    lines = (Path(results) / RunIdentity(cfg).folder / "predictions.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_a_killed_run_resumes_to_the_same_predictions(tiny_model_dir, tmp_path):
    """Killed between answers of a pool of 2 (a larger pool finishes these 9 equal-length answers at once)."""
    args = needle_args(tiny_model_dir, tmp_path / "killed") + ["engine.pool=2"]
    cfg = compose_cfg(*args)
    predictions = tmp_path / "killed" / RunIdentity(cfg).folder / "predictions.jsonl"
    proc = subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not predictions.exists() or len(predictions.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not predictions.with_name("metrics.json").exists()
    assert 3 <= len(predictions.read_text().splitlines()) < 9
    resumed = run(cfg)
    reference = run(compose_cfg(*needle_args(tiny_model_dir, tmp_path / "whole")))
    got, want = rows_of(tmp_path / "killed", cfg), rows_of(tmp_path / "whole", cfg)
    assert len({r["id"] for r in got}) == len(got) == 9
    assert got == want
    assert resumed["score"] == reference["score"] and resumed["grid"] == reference["grid"]


def test_a_folder_another_job_holds_is_left_alone(tiny_model_dir, tmp_path, monkeypatch):
    cfg = compose_cfg(*needle_args(tiny_model_dir, tmp_path))
    folder = tmp_path / RunIdentity(cfg).folder
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.lockf(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(60)"), str(folder / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail("a held folder was worked on"))
        assert run(cfg) is None
    finally:
        holder.kill()
        holder.wait()
    with exclusive(folder) as mine:
        assert mine


def read_wandb_summary(run_file: Path) -> dict:
    """The summary records of a W&B run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2
    data, pos, block, records, part = run_file.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        part += data[pos:pos + length]
        pos += length
        if kind in (1, 4):            # a full record, or the last piece of one
            records.append(part)
            part = b""
    summary = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "summary":
            summary.update({i.key: json.loads(i.value_json) for i in record.summary.update if i.key})
    return summary


def test_wandb_offline_keeps_the_runs_metrics(tiny_model_dir, tmp_path):
    cfg = compose_cfg(*needle_args(tiny_model_dir, tmp_path / "results"), "logger=wandb", "logger.mode=offline",
                      f"logger.dir={tmp_path}", "logger.group=tests")
    metrics = run(cfg)
    run_files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 1
    summary = read_wandb_summary(Path(run_files[0]))
    assert summary["score"] == pytest.approx(metrics["score"])
    assert summary["grid/200/0"] == pytest.approx(metrics["grid"]["200"]["0"])
    assert summary["n_samples"] == 9
    assert b"plots/heatmap" in Path(run_files[0]).read_bytes()   # the run's plot was logged too


def test_wandb_failure_never_loses_results(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import wandb

    def unreachable(**kwargs):
        raise ConnectionError("W&B is unreachable")
    monkeypatch.setattr(wandb, "init", unreachable)
    cfg = compose_cfg(*needle_args(tiny_model_dir, tmp_path / "results"), "logger=wandb", "logger.mode=offline")
    metrics = run(cfg)
    assert "W&B logging failed" in capsys.readouterr().out
    assert json.loads((tmp_path / "results" / RunIdentity(cfg).folder / "metrics.json").read_text()) == metrics


def test_metrics_carry_provenance(tiny_model_dir, tmp_path):
    metrics = run(compose_cfg(*needle_args(tiny_model_dir, tmp_path)))
    assert len(metrics["git"]["commit"]) == 40 and isinstance(metrics["git"]["dirty"], bool)
    assert metrics["packages"]["torch"] and metrics["packages"]["transformers"] and metrics["packages"]["rouge"]
    assert metrics["device"] == "cpu" and metrics["dtype"] == "float32"
    assert len(metrics["data"]["haystack"]) == 64 and len(metrics["data"]["prompt"]) == 64
    assert metrics["started_at"] <= metrics["ended_at"]


def test_a_result_hidden_by_a_cached_listing_is_looked_for_again_before_a_job_is_failed(tmp_path):
    """After the grace period the launcher asks once more, with the folder's attributes set to what they are (an
    NFS client then asks the server): the file is found if it exists, the folder's mode is unchanged."""
    from hydra_plugins.pcs_launcher.pcs_launcher import refreshed
    folder = tmp_path / "job"
    folder.mkdir(mode=0o750)
    mode = folder.stat().st_mode
    assert not refreshed(folder / "0_result.pkl")
    (folder / "0_result.pkl").write_bytes(b"x")
    assert refreshed(folder / "0_result.pkl") and folder.stat().st_mode == mode


# Sweeps whose cells choose the same options and differ in plain values (budgets, lists, knobs), one of them
# with its values before its choices and a launcher override on the command line.
SHARED_CHOICES = [
    (["experiment=leaderboard_question_after", "results_dir=elsewhere"],
     [["method=kvzip", "selection=perturbation", f"budget={b}"] for b in (512, 1024)]),
    (["experiment=kvpress_leaderboard", "hydra/launcher=pcs_slurm", "hydra.launcher.shards=8"],
     [["press=snapkv", f"budget={b}"] for b in (0.75, 0.125)]),
    (["benchmark=ruler"], [[f"budget={b}", "benchmark.lengths=[2048]", "method=snapkv", "ablation=epsilon"]
                           for b in (256, 512)] + [["method=full"]]),
]


@pytest.mark.parametrize("command, cells", SHARED_CHOICES, ids=[c[0] for c, _ in SHARED_CHOICES])
def test_a_sweeps_cells_sharing_their_choices_are_what_hydras_loader_composes(command, cells):
    """The launcher's loader (``ComposedOnce``) composes a cell's option choices once and sets its values on a
    copy: each cell, ``hydra`` node included (its recorded overrides and directory name), equals what Hydra's own
    loader composes for it, and the sweeper's composition is the launcher's."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode
    from hydra_plugins.pcs_launcher.pcs_launcher import ComposedOnce
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONF))
    hydra_side = [o for o in command if o.startswith("hydra")]
    master = loader.load_configuration("config", overrides=command, run_mode=RunMode.MULTIRUN)
    once = ComposedOnce(loader)
    for cell in cells:
        overrides = [o for o in command if o not in hydra_side] + cell
        plain = loader.load_sweep_config(master, overrides)
        shared = once(master, overrides)
        assert OmegaConf.to_yaml(shared) == OmegaConf.to_yaml(plain)
        assert once(master, overrides) is shared                      # the launcher takes what the sweeper checked
    assert len(once.choices) == 1                                   # one composition of the choices
