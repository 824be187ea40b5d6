"""A wheel installed with pip (not editable) finds its config tree from any folder: it names every
committed run folder, rescores one and rebuilds the committed report's tables."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "embedded"

NAMES = """
import sys
from pathlib import Path
from omegaconf import OmegaConf
import pcs
from pcs.identity import RunIdentity
assert Path(pcs.__file__).is_relative_to(Path(sys.argv[2])), pcs.__file__
root = Path(sys.argv[1])
for config in sorted(root.rglob("config.yaml")):
    assert RunIdentity(OmegaConf.load(config)).folder == str(config.parent.relative_to(root)), config
print(len(list(root.rglob("config.yaml"))))
"""


def test_an_installed_wheel_names_rescores_and_reports_the_committed_runs(tmp_path):
    source = tmp_path / "source"   # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT / "pcs", source / "pcs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("pcs-*.whl"))
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def python(*args):
        out = subprocess.run([sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert int(python("-c", NAMES, str(RESULTS), str(site))) >= 20
    run_dir = RESULTS / "needle" / "smollm2" / "snapkv_perturbation_b128"
    score = json.loads((run_dir / "metrics.json").read_text())["score"]
    assert f"score {score:.2f}" in python("-m", "pcs.rescore", str(run_dir))
    python("-m", "pcs.report", "--results", str(RESULTS), "--out", str(tmp_path / "report"))
    for table in (RESULTS / "report" / "tables").glob("*.md"):
        assert (tmp_path / "report" / "tables" / table.name).read_text() == table.read_text()
