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


def test_the_docs_give_commands_to_check():
    """The extraction finds the README's quickstart, a sweep and the SLURM launch (it would pass vacuously if it
    found nothing)."""
    readme = [c for p, c in DOCUMENTED if p == "README.md"]
    assert ".venv/bin/python run.py" in readme
    assert any(" -m " in c for c in readme) and any("hydra/launcher=slurm" in c for c in readme)
    assert len({p for p, _ in DOCUMENTED}) >= 5


@pytest.mark.parametrize("where, command", DOCUMENTED, ids=[f"{p}: {c[:80]}" for p, c in DOCUMENTED])
def test_a_documented_command_composes(where, command):
    args = shlex.split(command)[2:]
    if "-m" in args or "--multirun" in args:
        shown = args if any(a.startswith("--cfg") for a in args) else [*args, "--cfg", "job"]
        done = subprocess.run([sys.executable, "run.py", *shown], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"{where}: {command}\n{done.stderr[-2000:]}"
        return
    takes_value = ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp")
    overrides = [a for a, before in zip(args, [None, *args]) if not a.startswith("-") and before not in takes_value]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        compose(config_name="config", overrides=overrides, return_hydra_config=True)
