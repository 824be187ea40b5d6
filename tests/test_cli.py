"""Help is help: ``python run.py --help`` describes the groups a user chooses without the config's internal keys,
and every ``python -m pcs.<command> --help`` answers at once (nothing heavy loads before the arguments are read)
with its whole description and a line for every option."""
import argparse
import importlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["pcs.annotate", "pcs.bench", "pcs.needle_heads", "pcs.report", "pcs.report.interim", "pcs.report.rerun",
            "pcs.rescore", "pcs.status"]
MAIN = {"pcs.report": "pcs.report.__main__", "pcs.bench": "pcs.bench.__main__"}


def parser_of(command: str) -> argparse.ArgumentParser:
    """The parser a command's ``main`` builds, caught as it parses ``--help``."""
    module = importlib.import_module(MAIN.get(command, command))
    caught = []

    def catch(self, args=None, namespace=None):
        caught.append(self)
        raise SystemExit(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(SystemExit):
            module.main(["--help"])
    return caught[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_commands_help_is_its_whole_description_and_explains_every_option(command):
    parser = parser_of(command)
    doc = importlib.import_module(MAIN.get(command, command)).__doc__
    assert parser.description == doc and parser.prog == f"python -m {command}"
    unexplained = [a.option_strings or [a.dest] for a in parser._actions
                   if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not unexplained, f"{command}: options without help: {unexplained}"
    assert doc.strip().split("\n\n")[0].replace("\n", " ") in " ".join(parser.format_help().split("\n"))


@pytest.mark.parametrize("command", COMMANDS)
def test_a_commands_help_answers_in_under_two_seconds(command):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", command, "--help"], cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0 and done.stdout.startswith(f"usage: python -m {command}"), done.stderr
    assert elapsed < 2.0, f"{command} --help took {elapsed:.2f} s"


def test_run_help_describes_the_groups_without_internal_keys():
    done = subprocess.run([sys.executable, "run.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for key in ("_target_", "_uses_", "_choices_", "_settles_"):
        assert key not in done.stdout
    for group in ("model=", "method=", "selection=", "budget=", "benchmark=", "profile=", "preset=", "ablation=",
                  "experiment=", "logger="):
        assert f"\n  {group}" in done.stdout, group
    from pcs.config import options
    for group in ("model", "method", "selection", "benchmark", "profile", "experiment", "logger"):
        assert ", ".join(options(group)) in done.stdout, group      # every option, from the config tree
    for internal in ("preset_press", "sweep:", "hydra/job_logging"):
        assert internal not in done.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_a_commands_bad_argument_is_one_line_and_exit_2(command):
    done = subprocess.run([sys.executable, "-m", command, "--no-such-option"], cwd=ROOT, capture_output=True,
                          text=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    # the first problem argparse finds: the unknown option, or a required argument missing before it
    assert lines[0].startswith(f"error: python -m {command}: ") and f"{command} --help" in lines[0], done.stderr
