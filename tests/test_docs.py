"""Every ``run.py`` command the README and docs/ give composes: a single run as ``--cfg job`` composes it (in
process, with Hydra's compose API), a sweep (``-m``) through ``run.py -m ... --cfg job``, which shows the config
every cell starts from and then the launcher's dry run. A documented command that no longer composes fails here."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from conftest import kvpress_ruler_files, longbench_files

ROOT = Path(__file__).resolve().parent.parent
CONF = str(ROOT / "pcs" / "conf")
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
INVOKES = re.compile(r"^(?:\S*python3?|\.venv/bin/python) run\.py(?:\s|$)")


def commands(path: Path) -> list[str]:
    """The ``run.py`` command lines of a Markdown file's ``bash`` blocks, continuation lines joined, comments
    dropped."""
    found, block, joined = [], False, ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            block, joined = line.strip() in ("```bash", "```sh", "```shell"), ""
            continue
        if not block:
            continue
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        words = shlex.split(joined, comments=True)
        joined = ""
        if words and INVOKES.match(" ".join(words[:2])):
            found.append(" ".join(shlex.quote(w) for w in words))
    return found


DOCUMENTED = [(str(path.relative_to(ROOT)), command) for path in DOCUMENTS for command in commands(path)]
# Each distinct command once, with every place that gives it (the same SLURM launch recurs across pages).
PLACES: dict[str, list[str]] = {}
for _where, _command in DOCUMENTED:
    PLACES.setdefault(_command, []).append(_where)


def test_the_docs_give_commands_to_check():
    """The extraction finds the README's quickstart, a sweep and the SLURM launch (it would pass vacuously if it
    found nothing)."""
    readme = [c for p, c in DOCUMENTED if p == "README.md"]
    assert ".venv/bin/python run.py" in readme
    assert any(" -m " in c for c in readme) and any("hydra/launcher=slurm" in c for c in readme)
    assert len({p for p, _ in DOCUMENTED}) >= 5


# Runs run.py's own entry point once per sweep command in one process (Hydra's global state cleared between), so
# the imports are paid once: each command prints its config and its launcher's dry run, and reports its exit code.
DRIVER = """
import contextlib, io, json, runpy, sys
from hydra.core.global_hydra import GlobalHydra
for argv in json.loads(sys.argv[1]):
    sys.argv, err, code = ["run.py", *argv], io.StringIO(), 0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_path("run.py", run_name="__main__")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except Exception as error:
            code, _ = 1, err.write(repr(error))
    GlobalHydra.instance().clear()
    print(json.dumps([code, err.getvalue()[-2000:]]), flush=True)
"""
SWEEPS = [c for c in PLACES if any(a in ("-m", "--multirun") for a in shlex.split(c))]


def shown(command: str) -> list[str]:
    args = shlex.split(command)[2:]
    return args if any(a.startswith("--cfg") for a in args) else [*args, "--cfg", "job"]


def test_every_documented_sweep_composes_and_dry_runs(tmp_path):
    """Each documented sweep through ``run.py -m ... --cfg job`` (its config, then its launcher's dry run), all in
    one process and one test, so that a parallel run composes them once: with the data folder the docs name
    (``/data/longbench``) and the default one (``$PCS_CACHE_DIR/longbench``) holding LongBench files, and kvpress's
    RULER in its default folder. Every sweep that fails is named with the pages that give it."""
    import json
    import os
    cache = tmp_path / "cache"
    data = longbench_files(cache / "longbench")
    kvpress_ruler_files(cache / "ruler_kvpress")
    argvs = [[a.replace("/data/longbench", str(data)) for a in shown(c)] for c in SWEEPS]
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PCS_CACHE_DIR": str(cache)})
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == len(SWEEPS) >= 10, done.stderr[-3000:]
    failed = [f"{', '.join(PLACES[c])}: {c}\n{errors}" for c, (code, errors) in zip(SWEEPS, lines) if code != 0]
    assert not failed, "\n\n".join(failed)


SINGLE = [c for c in PLACES if c not in SWEEPS]


@pytest.mark.parametrize("command", SINGLE, ids=[f"{PLACES[c][0]}: {c[:80]}" for c in SINGLE])
def test_a_documented_command_composes(command):
    args = shlex.split(command)[2:]
    takes_value = ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp")
    overrides = [a for a, before in zip(args, [None, *args]) if not a.startswith("-") and before not in takes_value]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_a_sweep_that_does_not_compose_fails_the_check():
    """The driver reports a sweep that names an option no group has (so a broken documented sweep cannot pass)."""
    import json
    bad = ["-m", "method=snapkv,no_such_method", "--cfg", "job"]
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([bad])], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    (line,) = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("[")]
    assert line[0] != 0
