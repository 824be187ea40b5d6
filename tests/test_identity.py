"""One run identity: folder, saved config, labels, generator name and pairing key agree everywhere."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pcs.errors import ConfigError
from pcs.identity import RunIdentity
from pcs.run_folder import load_config, prepare

from conftest import compose_cfg

RESULTS = Path(__file__).resolve().parent.parent / "results"


@pytest.mark.parametrize("benchmark", ["needle", "longbench", "alpacaeval"])
@pytest.mark.parametrize("method", ["full", "streamingllm", "laprox"])
def test_methods_without_selection_carry_none_anywhere(benchmark, method):
    run = RunIdentity(compose_cfg(f"benchmark={benchmark}", f"method={method}", "selection=attention", "budget=64"))
    assert not run.reads_selection
    assert "selection" not in OmegaConf.create(run.saved_config)
    assert run.selection_label == "none"
    assert "attention" not in run.folder and "attention" not in run.generator
    if method == "full":
        assert run.folder == f"{benchmark}/smollm2/full" and run.generator == "smollm2-full" and run.table is None
        assert "budget" not in OmegaConf.create(run.saved_config)
    else:
        assert run.folder == f"{benchmark}/smollm2/{method}_none_b64"
        assert run.generator == f"smollm2-{method}-b64" and run.table == f"{benchmark}_{method}"


def test_an_alpacaeval_laprox_run_names_its_generator_without_a_selection():
    run = RunIdentity(compose_cfg("benchmark=alpacaeval", "method=laprox", "budget=128"))
    assert run.generator == "smollm2-laprox-b128"
    assert RunIdentity(compose_cfg("benchmark=alpacaeval", "budget=128")).generator == "smollm2-snapkv-perturbation-b128"


def test_the_perturbation_analysis_compares_selections_itself():
    run = RunIdentity(compose_cfg("benchmark=perturbation", "method=adakv", "selection=attention"))
    assert run.folder == "perturbation/smollm2/adakv_b128" and not run.reads_selection


def test_pairing_key_matches_runs_that_differ_only_in_selection():
    key = lambda *o: RunIdentity(compose_cfg(*o)).pairing_key
    assert key("selection=attention") == key("selection=perturbation") == key("selection.alpha=0")
    assert key("selection=attention") != key("selection=attention", "budget=64")
    assert key("selection=attention") != key("selection=attention", "method.kernel=5")
    # Where the results go and who watches are not part of a run.
    assert key("results_dir=/elsewhere", "progress=false", "logger=wandb") == key()


def test_saved_config_holds_knobs_only():
    saved = OmegaConf.create(RunIdentity(compose_cfg("benchmark=alpacaeval", "benchmark.annotate=true")).saved_config)
    assert "_target_" not in saved.method and "_uses_" not in saved.benchmark
    assert "annotate" not in saved.benchmark and "judge" not in saved.benchmark and "results_dir" not in saved


def committed_runs():
    return sorted(p.parent for p in RESULTS.rglob("config.yaml"))


def test_committed_runs_keep_their_folders_and_configs():
    runs = committed_runs()
    assert len(runs) >= 20
    for run_dir in runs:
        run = RunIdentity(load_config(run_dir))
        root = run_dir.parents[2]   # <results_dir>/<benchmark>/<model>/<leaf>
        assert run.folder == str(run_dir.relative_to(root))
        assert run.saved_config == (run_dir / "config.yaml").read_text()
        assert run.title == f"{run_dir.parent.name} / {run_dir.name}"


def test_a_config_saved_before_a_knob_existed_is_the_same_run(tmp_path):
    """needle's query_aware came after runs were saved without it: such a folder reads, names, pairs and
    resumes as the run that compresses the question with the context, and as no other."""
    committed = RESULTS / "embedded" / "needle" / "smollm2" / "snapkv_perturbation_b128"
    today = (committed / "config.yaml").read_text()
    assert "  query_aware: true\n" in today
    old = tmp_path / "needle" / "smollm2" / "snapkv_perturbation_b128"
    old.mkdir(parents=True)
    (old / "config.yaml").write_text(today.replace("  query_aware: true\n", ""))
    run = RunIdentity(load_config(old))
    assert run.saved_config == today and run.folder == "needle/smollm2/snapkv_perturbation_b128"
    assert run.pairing_key == RunIdentity(load_config(committed)).pairing_key
    with pytest.raises(ConfigError, match="another config"):
        prepare(old, today.replace("query_aware: true", "query_aware: false"))
    prepare(old, today)                                   # resumes: the folder now says what it did
    assert (old / "config.yaml").read_text() == today


def test_a_run_rerun_from_other_paths_or_devices_resumes_in_its_folder(tmp_path):
    """Where files are and which device runs are not in a run's name (``LOCATIONS``): a folder saved with one
    weights path and device map resumes under others (as the out-of-memory advice, model.device_map=auto, asks),
    and a changed knob of the run is still refused."""
    committed = RESULTS / "embedded" / "needle" / "smollm2" / "snapkv_perturbation_b128"
    today = (committed / "config.yaml").read_text()
    run_dir = tmp_path / "run"
    prepare(run_dir, today)
    moved = OmegaConf.create(today)
    moved.model.path, moved.model.device_map = "/scratch/node-local/smollm2", "auto"
    moved_text = OmegaConf.to_yaml(moved)
    assert RunIdentity(moved).folder == RunIdentity(OmegaConf.create(today)).folder
    prepare(run_dir, moved_text)
    assert (run_dir / "config.yaml").read_text() == moved_text
    moved.budget = 256
    with pytest.raises(ConfigError, match="another config"):
        prepare(run_dir, OmegaConf.to_yaml(moved))


def test_rows_are_lines_ending_in_newline_whatever_else_their_text_holds(tmp_path):
    """A prediction may hold U+2028, U+2029 or U+0085 (written as is, ensure_ascii=False), which str.splitlines()
    also breaks at: every row must read back, and a torn last line is still dropped."""
    from pcs.run_folder import read_rows, write_rows_atomic
    rows = [{"id": "0", "prediction": "a\u2028b"}, {"id": "1", "prediction": "c\u0085d\u2029"}, {"id": "2"}]
    path = tmp_path / "predictions.jsonl"
    write_rows_atomic(path, rows)
    assert read_rows(path) == rows
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"id": "3", "predic')
    assert read_rows(path) == rows


def test_a_file_system_that_cannot_lock_is_an_error_not_a_busy_run(tmp_path, monkeypatch):
    import errno
    import fcntl
    from pcs.run_folder import exclusive

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(OSError, match="POSIX locks"):
        with exclusive(tmp_path):
            pass
