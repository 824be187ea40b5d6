"""Where a result came from, recorded in ``metrics.json``: code version, packages, hardware, data."""
from __future__ import annotations

import hashlib
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "datasets", "accelerate", "hydra-core", "rouge", "rouge-score", "fuzzywuzzy",
            "python-Levenshtein", "jieba", "alpaca-eval", "numpy")


# What makes a result: the package, its launchers, the entry point, the build and the scripts. Not results/ or docs/,
# which a sweep writing its own run folders would otherwise make "dirty" whatever the code.
CODE = ("pcs", "hydra_plugins", "run.py", "pyproject.toml", "Makefile", "scripts")


def git_state() -> dict:
    """Commit of the code, whether the code (``CODE``: tracked changes and untracked files, not results or docs)
    differs from it, and a digest of that difference (None where it does not, or outside a checkout)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None, "diff_sha256": None}
        diff = git("diff", "HEAD", "--binary", "--", *CODE).stdout
        untracked = git("ls-files", "--others", "--exclude-standard", "--", *CODE).stdout.split()
        digest = hashlib.sha256(diff.encode())
        for name in sorted(untracked):
            digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
        dirty = bool(diff or untracked)
        return {"commit": head.stdout.strip(), "dirty": dirty, "diff_sha256": digest.hexdigest() if dirty else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "diff_sha256": None}


def package_versions(names=PACKAGES) -> dict:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def sha256_files(paths) -> str:
    """One digest over the files' names and bytes, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def provenance(cfg, model, started_at: str, data_hashes: dict, weights: dict) -> dict:
    """``weights``: the loaded weights' fingerprint (``pcs.weights.fingerprint``)."""
    return {"git": git_state(), "packages": package_versions(), "python": platform.python_version(),
            "device": str(next(model.parameters()).device), "dtype": str(model.dtype).removeprefix("torch."),
            "gpu": gpu_name(model), "weights": weights, "data": data_hashes,
            "fuzzy_backend": cfg.benchmark.get("fuzzy_backend"), "started_at": started_at, "ended_at": now()}


def gpu_name(model) -> str | None:
    import torch
    device = next(model.parameters()).device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
