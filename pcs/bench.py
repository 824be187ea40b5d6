"""What each method and selection costs and saves: prefill-plus-compression time, decode speed on the
compressed cache against the memory-traffic bound, KV bytes and peak memory.

    python -m pcs.bench --model smollm2 --contexts 4096 8192 --methods snapkv adakv \\
        --selections attention perturbation --budgets 128 --repeats 3 [--decode-tokens 32] [--json]
    python -m pcs.bench --model llama31-shape --layers 4 --contexts 8192 32768 ...   # random weights, GPU

One process, random prompt tokens, a warm-up of every configuration, then ``--repeats`` rounds that
each measure every configuration once (drift falls on all alike); medians. The full cache is always
measured first, as the baseline of ``decode_speedup`` and ``decode_bound``:
``decode_bound = (weight bytes + full KV bytes) / (weight bytes + kept KV bytes)``, the speed-up a
decoding step limited by memory traffic would get from the smaller cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from .config import compose, uses
from .eviction import build_method
from .generate import greedy_generate
from .models import load_model, prepare

LLAMA31_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072)


def composed(**overrides):
    return compose([f"{k}={v}" for k, v in overrides.items()])


def build_model(name: str, layers: int, device: str, path: str | None = None):
    """The embedded/hub model of ``pcs/conf/model/<name>`` (or local weights at ``path``), or
    ``llama31-shape``: random weights with Llama-3.1-8B's layer shapes and ``layers`` layers."""
    if name == "llama31-shape":
        from transformers import AutoModelForCausalLM, LlamaConfig
        config = LlamaConfig(**LLAMA31_SHAPE, num_hidden_layers=layers, torch_dtype=torch.bfloat16)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).to(device).eval()
        return prepare(model)
    overrides = {"model": name, "model.device": device} | ({"model.path": path} if path else {})
    model, _ = load_model(composed(**overrides).model)
    return model


class PeakMemory:
    """Peak extra memory while active: CUDA's allocator statistics, or sampled RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self.base = device, 0, 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.peak = self.rss()
            self.running = True
            self.thread = threading.Thread(target=self.sample, daemon=True)
            self.thread.start()
        return self

    def sample(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.running = False
            self.thread.join()
        self.extra = max(0, self.peak - self.base)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_prompt(model, context: int) -> torch.Tensor:
    """The same ``context`` random token ids for every configuration."""
    generator = torch.Generator().manual_seed(context)
    return torch.randint(100, model.config.vocab_size - 100, (1, context), generator=generator)


def profile_prefill(model, method, ids, path: Path) -> float:
    """One prefill plus compression under torch.profiler; writes its op table to ``path`` and returns
    the share of the time spent compressing (ops under the ``pcs.compress`` label)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        greedy_generate(model, ids, method, 1, set())
    averages = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in averages)
    compress = sum(e.cpu_time_total for e in averages if e.key == "pcs.compress")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=30))
    return compress / total if total else 0.0


def measure_once(model, method, ids, decode_tokens: int) -> dict:
    with PeakMemory(next(model.parameters()).device) as mem:
        gen = greedy_generate(model, ids, method, decode_tokens, set())
    return {"prefill_s": gen.prefill_s, "decode_ms_per_token": 1000 * gen.decode_s / max(1, len(gen.token_ids) - 1),
            "kv_bytes": gen.kv_cache_bytes, "kv_bytes_full": gen.kv_cache_bytes_full, "peak_mem_bytes": mem.extra}


def summarize(samples: list[dict]) -> dict:
    """Medians of the timings, the most extra memory, and the (deterministic) cache sizes."""
    return {"prefill_s": statistics.median(s["prefill_s"] for s in samples),
            "decode_ms_per_token": statistics.median(s["decode_ms_per_token"] for s in samples),
            "kv_bytes": samples[-1]["kv_bytes"], "kv_bytes_full": samples[-1]["kv_bytes_full"],
            "peak_mem_bytes": max(s["peak_mem_bytes"] for s in samples)}


def configurations(args):
    yield "full", "none", None
    for method in args.methods:
        selections = args.selections if uses("method", method, "selection") else ["none"]
        for selection in selections:
            for budget in args.budgets:
                yield method, selection, budget


def build_configurations(args) -> list[tuple]:
    built = []
    for method_name, selection, budget in configurations(args):
        overrides = {"method": method_name, "budget": budget or 128}
        if selection != "none":
            overrides["selection"] = selection
        built.append((method_name, selection, budget, build_method(composed(**overrides))))
    return built


def run(args) -> list[dict]:
    """Per context: a warm-up of every configuration, then ``repeats`` rounds that each measure every
    configuration once, so that slow drift of the machine falls on all configurations alike."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, args.layers, device, args.model_path)
    weights = weight_bytes(model)
    built = build_configurations(args)
    rows = []
    for context in args.contexts:
        ids = random_prompt(model, context)
        for *_, method in built:
            greedy_generate(model, ids, method, 2, set())
        samples = [[] for _ in built]
        for _ in range(args.repeats):
            for i, (*_, method) in enumerate(built):
                samples[i].append(measure_once(model, method, ids, args.decode_tokens))
        base = None
        for (method_name, selection, budget, method), runs in zip(built, samples):
            result = summarize(runs)
            if args.profile:
                name = f"{context}_{method_name}_{selection}_{budget or 'all'}.txt"
                result["compress_share"] = profile_prefill(model, method, ids, Path(args.profile) / name)
            base = base or result
            row = {"model": args.model, "device": device, "method": method_name, "selection": selection,
                   "budget": budget, "context": context, "repeats": args.repeats, **result,
                   "decode_bound": (weights + result["kv_bytes_full"]) / (weights + result["kv_bytes"]),
                   "decode_speedup": base["decode_ms_per_token"] / result["decode_ms_per_token"]}
            rows.append(row)
            print(json.dumps(row) if args.json else format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    return (f"{row['context']:>7} {row['method']:<12} {row['selection']:<13} {str(row['budget'] or '-'):>6} "
            f"prefill {row['prefill_s']:8.3f} s  decode {row['decode_ms_per_token']:8.2f} ms/tok  "
            f"KV {row['kv_bytes'] / 2**20:8.1f}/{row['kv_bytes_full'] / 2**20:8.1f} MiB  "
            f"peak +{row['peak_mem_bytes'] / 2**20:7.1f} MiB  speed-up {row['decode_speedup']:5.2f} "
            f"(bound {row['decode_bound']:5.2f})"
            + (f"  compressing {100 * row['compress_share']:4.1f} %" if "compress_share" in row else ""))


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pcs.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an option of pcs/conf/model, or llama31-shape (random weights)")
    parser.add_argument("--model-path", help="local transformers weights for --model's config")
    parser.add_argument("--layers", type=int, default=4, help="llama31-shape: number of layers")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--methods", nargs="+", default=["snapkv", "adakv"])
    parser.add_argument("--selections", nargs="+", default=["attention", "perturbation"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--profile", metavar="DIR", help="also profile one prefill per configuration "
                        "(torch.profiler op table into DIR; compress_share = time under pcs.compress)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
