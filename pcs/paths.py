"""Where pcs finds installed data packages and keeps its caches (no model code: reports and
rescoring use these too)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def default_cache_dir() -> Path:
    return Path(os.environ.get("PCS_CACHE_DIR", Path.home() / ".cache" / "pcs"))
