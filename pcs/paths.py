"""Where pcs finds installed data packages and keeps its caches, and how it replaces a file (no model code:
reports and rescoring use these too)."""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def default_cache_dir() -> Path:
    return Path(os.environ.get("PCS_CACHE_DIR", Path.home() / ".cache" / "pcs"))


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace a file's contents in one step: a process killed meanwhile leaves the old file or the new one, never
    a part of either, and jobs writing the same file at once (shards of a run, on any node) each replace it
    whole (each writes its own temporary file beside it)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text: split at "\n" only, since a row written with ``ensure_ascii=False`` may
    hold characters that ``str.splitlines()`` also breaks at (U+2028, U+2029, U+0085); blank lines left out."""
    return [line for line in text.split("\n") if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """Every row of a JSON Lines file (a torn line is an error here: ``run_folder.read_rows`` drops one)."""
    return [json.loads(line) for line in jsonl_lines(Path(path).read_text(encoding="utf-8"))]
