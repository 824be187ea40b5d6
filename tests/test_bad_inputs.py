"""Every input a user can get wrong ends the same way: ``python run.py`` prints one line naming the value, exits 2,
writes nothing and loads no model. The inputs are generated from the config tree (a wrong type and each bound and
choice of every knob of every option, a misspelt option and an unknown key in every group) and added by hand where
the tree cannot say (run-level settings, Hydra's syntax, malformed data files, run folders that hold another run or a
corrupted line). ``run.py`` runs in this process (its ``main``, as ``python run.py`` calls it): about a third of a
second a case where a subprocess costs a second; ``test_runner`` times a subprocess and keeps torch out of it."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

import pcs.models
import pcs.runner
from pcs.config import allowed_types, group_file, is_declaration, options

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("model", "method", "selection", "profile", "benchmark", "logger")
# A value of each type, as a command line writes it: the first whose type a knob does not take is its wrong value.
WRONG = (("str", "abc"), ("list", "[1]"), ("bool", "true"))


def knob_cases() -> list[tuple[list[str], str]]:
    """(overrides, the text the error must name) for every knob of every option of the user's groups."""
    cases = []
    for group in GROUPS:
        for option in options(group):
            own = group_file(group, option)
            choose = [f"{group}={option}"]
            for key in [k for k in own if not is_declaration(k) and k not in ("name", "defaults")]:
                types = allowed_types(own, key)
                if types:
                    text = next(value for kind, value in WRONG if kind not in types and
                                not (kind == "bool" and "str" in types))
                    cases.append((choose + [f"{group}.{key}={text}"], f"{group}.{key}="))
            for key in own.get("_choices_") or {}:
                cases.append((choose + [f"{group}.{key}=bogus"], f"{group}.{key}='bogus'"))
            for key, (low, high) in (own.get("_range_") or {}).items():
                listed = "list" in (allowed_types(own, key) or [])
                for bad in [low - 1] + ([high + 1] if high is not None else []):
                    cases.append((choose + [f"{group}.{key}={[bad] if listed else bad}"], f"{group}.{key}="))
            if group == "profile":       # conventions: each checked by pcs.eviction.conventions
                for key in [k for k in own if not is_declaration(k) and k not in ("name", "defaults")]:
                    cases.append((choose + [f"profile.{key}=bogus"], f"profile.{key}='bogus'"))
        for option in options(group)[:2]:
            cases.append(([f"{group}={option}x"], f"{group}={option}x"))
        cases.append(([f"{group}.no_such_knob=1"], "no_such_knob"))
    return cases


BY_HAND = [
    (["budget=0"], "budget=0"), (["budget=-5"], "budget=-5"), (["budget=abc"], "budget='abc'"),
    (["budget=1.5"], "budget=1.5"), (["budget=true"], "budget=True"), (["compress.trigger=5"], "compress.trigger=5"),
    (["compress.trigger=abc"], "compress.trigger='abc'"), (["engine.pool=0"], "engine.pool=0"),
    (["engine.pool=abc"], "engine.pool='abc'"), (["engine.cuda_graphs=maybe"], "engine.cuda_graphs"),
    (["engine.stage2.search=everything"], "engine.stage2.search=everything"),
    (["engine.layers_behind=-1"], "engine.layers_behind=-1"), (["engine.pol=3"], "engine.pol=3"),
    # a selection named for a method that ranks by its own rule (a sweep over selections runs it once instead)
    (["method=streamingllm", "selection=perturbation"], "selection=perturbation: method=streamingllm ranks by its own"),
    (["method=layer_defensivekv", "selection.alpha=0.5"], "selection.alpha=0.5: method=layer_defensivekv"),
    (["method=chunkkv", "selection=attention"], "selection=attention: method=chunkkv"),
    (["method=kvzip", "preset=criticalkv"], "method=kvzip has none it wraps"),
    (["hydra/launcher=slurmm"], "hydra/launcher=slurmm"), (["experiment=nope"], "experiment=nope"),
    (["preset=nope"], "preset=nope"), (["ablation=nope"], "ablation=nope"), (["+method.window=3"], "+method.window=3"),
    (["method=[a"], "method=[a"), (["budget"], "'budget'"), (["foo=1"], "foo=1"), (["foo.bar=1"], "foo.bar=1"),
    (["method.floor=0.1"], "method.floor=0.1"), (["method=snapkv", "method.sinks=2"], "method.sinks=2"),
    (["method.mass=0.5"], "method.mass=0.5"), (["preset=criticalkv", "method=streamingllm"], "method=streamingllm"),
    (["benchmark/judge=nope"], "benchmark/judge=nope"), (["model.path=/no/such/weights"], "/no/such/weights"),
    (["model.max_length=9000"], "model.max_length=9000"), (["benchmark.context_lengths=[9000]"], "9000"),
    (["benchmark.context_lengths=[]"], "benchmark.context_lengths=[]"),
    (["selection=perturbation", "selection.epsilon=-1"], "selection.epsilon=-1"),
    (["logger=wandb", "logger.mode=bogus"], "logger.mode='bogus'"),
    (["benchmark=ruler", "benchmark.tasks=[niah]"], "niah"), (["benchmark=ruler", "benchmark.lengths=[100]"], "100"),
    (["benchmark=ruler", "benchmark.n_samples=[1,2]"], "benchmark.n_samples"),
    (["benchmark=longbench", "benchmark.tasks=[nope]"], "nope"),
    (["benchmark=longbench", "benchmark.data_dir=/nonexistent"], "/nonexistent/narrativeqa.jsonl"),
    (["-m", "method=snapkv,snapk"], "method=snapk"), (["-m", "budget=64,0"], "budget=0"),
    (["-m", "method=snapkv", "hydra.launcher.shards=0"], "hydra.launcher.shards=0"),
]


def data_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """Malformed data files, each in a folder of its own under ``tmp``."""
    longbench = tmp / "longbench"
    longbench.mkdir()
    (longbench / "qasper.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"], "length": 1}\n'
                                            '{"input": "q", "context": \n')
    essays = tmp / "no_essays"
    essays.mkdir()
    alpaca = tmp / "alpaca.json"
    alpaca.write_text('[{"instruction": "hi"}, ')
    not_a_list = tmp / "alpaca_object.json"
    not_a_list.write_text('{"instruction": "hi"}')
    return [
        (["benchmark=longbench", "benchmark.tasks=[qasper]", f"benchmark.data_dir={longbench}"], "qasper.jsonl"),
        ([f"benchmark.haystack_dir={essays}"], str(essays)),
        ([f"benchmark.haystack_dir={tmp / 'missing'}"], str(tmp / "missing")),
        (["benchmark=alpacaeval", f"benchmark.data_file={alpaca}"], str(alpaca)),
        (["benchmark=alpacaeval", f"benchmark.data_file={not_a_list}"], str(not_a_list)),
        (["benchmark=alpacaeval", f"benchmark.data_file={tmp / 'missing.json'}"], "missing.json"),
    ]


def folder_cases(results: Path) -> list[tuple[list[str], str]]:
    """Run folders a job cannot resume: another run's config, a corrupted line, a row without an id."""
    from conftest import compose_cfg
    from pcs.identity import RunIdentity
    cases = []
    for budget, damage in ((64, "config"), (96, "corrupted"), (112, "no id")):
        cfg = compose_cfg(f"budget={budget}")
        run_dir = results / RunIdentity(cfg).folder
        run_dir.mkdir(parents=True)
        saved = RunIdentity(cfg).saved_config
        good = json.dumps({"id": "len1000_depth0", "prediction": "x", "score": 1.0})
        if damage == "config":
            (run_dir / "config.yaml").write_text(saved.replace("window: 32", "window: 16"))
            cases.append(([f"budget={budget}"], str(run_dir)))
        else:
            (run_dir / "config.yaml").write_text(saved)
            bad = '{"id": "len1000_depth25", "predic' if damage == "corrupted" else '{"prediction": "x"}'
            (run_dir / "predictions.jsonl").write_text(f"{good}\n{bad}\n{good}\n")
            cases.append(([f"budget={budget}"], f"{run_dir / 'predictions.jsonl'}:2"))
    return cases


def load_run_py():
    spec = importlib.util.spec_from_file_location("pcs_run_entry", ROOT / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUN = load_run_py()
CASES = knob_cases() + BY_HAND


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(argv: list[str], tmp_path: Path, results: Path, monkeypatch, capsys) -> tuple[int, str]:
    """``python run.py argv``'s exit status and standard error, in this process, with no model allowed to load."""
    monkeypatch.setattr(pcs.models, "load_model", lambda *a: pytest.fail(f"{argv}: the model loaded"))
    # Hydra's logging left as pytest set it: configuring it (logging.config.dictConfig) closes every handler,
    # pytest's own log file among them, and the next test's capture fails on the closed file.
    monkeypatch.setattr(sys, "argv", ["run.py", *argv, f"results_dir={results}", f"hydra.sweep.dir={tmp_path}/sweep",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    GlobalHydra.instance().clear()
    try:
        with pytest.raises(SystemExit) as stop:
            RUN.main()
    finally:
        GlobalHydra.instance().clear()
    return stop.value.code, capsys.readouterr().err


def assert_one_line(code: int, err: str, names: str, argv) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    assert "Traceback" not in err and names in lines[0], (argv, names, err)


def test_the_cases_are_many_and_cover_every_group():
    assert len(CASES) >= 100
    for group in GROUPS:
        assert any(any(o.startswith(f"{group}.") for o in argv) for argv, _ in CASES), group


@pytest.mark.parametrize("argv,names", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_a_bad_value_is_one_line_exit_2_and_nothing_written(argv, names, tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    code, err = refused(argv, tmp_path, results, monkeypatch, capsys)
    assert_one_line(code, err, names, argv)
    assert not results.exists() and not (tmp_path / "sweep").exists(), argv


def test_malformed_data_files_are_one_line_exit_2(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    for argv, names in data_cases(tmp_path):
        code, err = refused(argv, tmp_path, results, monkeypatch, capsys)
        assert_one_line(code, err, names, argv)
        assert not results.exists(), argv


def test_run_folders_that_cannot_be_resumed_are_one_line_exit_2_and_left_as_they_were(tmp_path, monkeypatch,
                                                                                       capsys):
    results = tmp_path / "results"
    cases = folder_cases(results)
    before = tree(results)
    for argv, names in cases:
        code, err = refused(argv, tmp_path, results, monkeypatch, capsys)
        assert_one_line(code, err, names, argv)
    assert tree(results) == before


def test_a_results_dir_that_cannot_be_created_and_a_misplaced_flag_are_one_line_exit_2(tmp_path, monkeypatch,
                                                                                        capsys):
    blocker = tmp_path / "a_file"                   # a file where results_dir needs a folder
    blocker.write_text("")
    code, err = refused([], tmp_path, blocker / "results", monkeypatch, capsys)
    assert_one_line(code, err, f"{blocker} takes no new folder (Not a directory)", "results_dir under a file")
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == ""     # the probe left nothing
    code, err = refused(["method=snapkv", "-m"], tmp_path, tmp_path / "results", monkeypatch, capsys)
    assert_one_line(code, err, "unrecognized arguments: ", "-m after an override")
    assert "flags (-m, --cfg, --help) go before the overrides" in err
