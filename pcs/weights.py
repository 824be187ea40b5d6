"""Which weights answered a run: a fingerprint of the files a model loads, cheap enough for every job (an 8B
checkpoint in milliseconds), recorded in ``metrics.json`` and in each job's folder (``weights.json``), so that a run
resumed, sharded or merged with other weights is refused instead of mixing two models' answers under one name.

The fingerprint reads the model folder's top-level files that loading reads (configs, tokenizer, weights): their
names and sizes, each safetensors file's header (tensor names, shapes, dtypes), and the bytes of every file up to
16 MiB whole and of larger ones at 17 fixed places (16 evenly spaced blocks of 1 MiB and the last). Two checkpoints
that differ in a config, a tokenizer, a tensor's shape or any sampled block differ in ``id``; a change confined to
the unsampled bytes of a large file is not seen (hashing 16 GB whole would take a minute a job). Torch-free.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

READ = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".tiktoken")   # what loading a model reads
WHOLE = 16 << 20        # files up to this size are hashed whole
BLOCK = 1 << 20
BLOCKS = 16


def model_folder(location: str) -> tuple[Path | None, str | None]:
    """The folder a model loaded from and its hub revision: a local folder as it is; a hub id, the cached snapshot
    transformers loaded (its folder is named by the commit); (None, None) where neither is found."""
    path = Path(location)
    if path.is_dir():
        revision = path.name if path.parent.name == "snapshots" else None
        return path, revision
    try:
        from huggingface_hub import try_to_load_from_cache
        config = try_to_load_from_cache(location, "config.json")
    except Exception:  # noqa: BLE001 - no hub library or a malformed id: nothing to fingerprint
        return None, None
    if not isinstance(config, str):
        return None, None
    folder = Path(config).parent
    return folder, folder.name


def safetensors_header(path: Path) -> bytes:
    """A safetensors file's JSON header (tensor names, dtypes, shapes, offsets) as stored."""
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        return handle.read(size)


def sampled_bytes(path: Path, digest) -> None:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if size <= WHOLE:
            digest.update(handle.read())
            return
        for k in range(BLOCKS):
            handle.seek(k * (size - BLOCK) // (BLOCKS - 1))
            digest.update(handle.read(BLOCK))
        handle.seek(size - BLOCK)
        digest.update(handle.read(BLOCK))


def fingerprint(location: str) -> dict:
    """``{"id", "source", "revision", "files", "bytes", "tensors"}`` for the model loaded from ``location`` (a
    folder or a hub id); ``id`` None where its files are not found."""
    folder, revision = model_folder(location)
    if folder is None:
        return {"id": None, "source": location, "revision": None}
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in READ)
    digest, tensors = hashlib.sha256(), hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        if path.suffix == ".safetensors":
            tensors.update(path.name.encode() + safetensors_header(path))
        sampled_bytes(path, digest)
    digest.update(tensors.digest())
    return {"id": digest.hexdigest()[:16], "source": str(location), "revision": revision, "files": len(files),
            "bytes": sum(p.stat().st_size for p in files), "tensors": tensors.hexdigest()[:16]}


def described(weights: dict) -> str:
    revision = f", revision {weights['revision']}" if weights.get("revision") else ""
    return f"weights {weights.get('id')} ({weights.get('source')}{revision})"


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None
