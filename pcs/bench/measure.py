"""Measuring every configuration: a warm-up of each, then ``--repeats`` rounds that each measure every
configuration once (drift falls on all alike); medians. The full cache is measured first, the baseline of
``decode_speedup`` and ``decode_bound = (weight bytes + full KV bytes) / (weight bytes + kept KV bytes)``, the
speed-up a decoding step limited by memory traffic would get from the smaller cache."""
from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .. import compression
from ..compression import CompressionStats
from ..config import compose, uses
from ..engine import Cell, DecodePool, clock, prefill
from ..eviction import build_method, scores
from ..eviction.stage2_search import Stage2Work
from ..generate import greedy_generate
from ..hybrid import head_dim
from ..kernels import value_norms as value_norm_kernel
from ..models import load_model, prepare, weights_location
from ..prompts import RepeatPrompt, repeat_prompt
from ..options import EngineOptions, defaults
from .instrument import CALLS_CONTEXT, CompressionClock, CompressionOps, PeakMemory, attention_calls_per_token, \
    profile_prefill
from .tables import format_row

LLAMA31_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072)


def composed(**overrides):
    return compose([f"{k}={v}" for k, v in overrides.items()])


def bench_repeat(name: str, path: str | None = None) -> RepeatPrompt:
    """KVzip's request to repeat a context on the bench's model: its tokenizer's (``llama31-shape``, which has none:
    the embedded SmolLM2's, the same English text in about as many tokens, every id inside Llama 3.1's vocabulary)."""
    from transformers import AutoTokenizer
    cfg = composed(model="smollm2" if name == "llama31-shape" else name,
                   **({"model.path": path} if path and name != "llama31-shape" else {})).model
    return repeat_prompt(AutoTokenizer.from_pretrained(weights_location(cfg)), cfg)


def build_model(name: str, layers: int, device: str, path: str | None = None):
    """The embedded/hub model of ``pcs/conf/model/<name>`` (or local weights at ``path``), or
    ``llama31-shape``: random weights with Llama-3.1-8B's layer shapes and ``layers`` layers."""
    if name == "llama31-shape":
        from transformers import AutoModelForCausalLM, LlamaConfig
        config = LlamaConfig(**LLAMA31_SHAPE, num_hidden_layers=layers)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        with torch.device(device):   # random init on the device itself: 8B parameters on a CPU core take minutes
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        return prepare(model)
    overrides = {"model": name, "model.device": device} | ({"model.path": path} if path else {})
    model, _ = load_model(composed(**overrides).model)
    return model



def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_prompt(model, context: int) -> torch.Tensor:
    """The same ``context`` random token ids for every configuration."""
    generator = torch.Generator().manual_seed(context)
    return torch.randint(100, model.config.vocab_size - 100, (1, context), generator=generator)


def measure_once(model, method, ids, decode_tokens: int, options: EngineOptions, repeat=None) -> dict:
    device = next(model.parameters()).device
    with PeakMemory(device) as mem, CompressionClock(method, device) as clock:
        gen = greedy_generate(model, ids, clock.method, decode_tokens, set(), options=options, repeat=repeat)
    return {"stage2": gen.stage2, "prefill_s": gen.prefill_s, "compress_s": clock.seconds, "decode_ms_per_token": 1000 * gen.decode_s / max(1, len(gen.token_ids) - 1),
            "kv_bytes": gen.kv_cache_bytes, "kv_bytes_full": gen.kv_cache_bytes_full, "peak_mem_bytes": mem.extra,
            "peak_mem_total_bytes": mem.peak if device.type == "cuda" else None}


def measure_pools(model, method, ids, sizes: list[int], decode_tokens: int, graphs: bool,
                  options: EngineOptions, repeat=None) -> dict:
    """Decoding with pools of ``sizes`` sequences, each a copy of one compressed prompt (one prefill for all):
    per size, milliseconds per step (one forward for the whole pool) and tokens per second. A warm-up of 3
    tokens per size first (on CUDA it captures the step's graph). A size whose buffers would not fit in the
    device's free memory is recorded as such (``fits``: the sequences that would)."""
    device = next(model.parameters()).device
    (seq,) = prefill(model, ids, [Cell(method)], decode_tokens, set(), options=options, repeat=repeat)
    out = {}
    for size in sizes:
        pool = DecodePool(model, size, graphs, options)
        for max_new in (3, decode_tokens):
            for _ in range(size):
                copied = dataclasses.replace(seq, cache=copy.deepcopy(seq.cache), logits=seq.logits.clone(),
                                             max_new_tokens=max_new, stats=CompressionStats(),
                                             result=dataclasses.replace(seq.result, token_ids=[]))
                if not pool.admits(copied):
                    break
                pool.join(copied)
            if len(pool.sequences) < size:
                out[size] = {"fits": len(pool.sequences)}
                break
            start = clock(device)
            while pool.sequences:
                pool.step()
            elapsed = clock(device) - start
        else:
            steps = decode_tokens - 1                      # the first token comes from the prefill's logits
            out[size] = {"ms_per_step": 1000 * elapsed / steps, "tokens_per_s": size * steps / elapsed}
        del pool
    return out


def summarize(samples: list[dict]) -> dict:
    """Medians of the timings (and each round's prefill), the most extra memory, and the (deterministic) cache
    sizes."""
    totals = [s["peak_mem_total_bytes"] for s in samples if s["peak_mem_total_bytes"] is not None]
    return {"prefill_s": statistics.median(s["prefill_s"] for s in samples),
            "prefill_rounds_s": [s["prefill_s"] for s in samples],
            "compress_s": statistics.median(s["compress_s"] for s in samples),
            "compress_rounds_s": [s["compress_s"] for s in samples],
            "decode_ms_per_token": statistics.median(s["decode_ms_per_token"] for s in samples),
            "kv_bytes": samples[-1]["kv_bytes"], "kv_bytes_full": samples[-1]["kv_bytes_full"],
            "peak_mem_bytes": max(s["peak_mem_bytes"] for s in samples),
            "peak_mem_total_bytes": max(totals) if totals else None}


@dataclasses.dataclass(frozen=True)
class Configuration:
    method: str
    selection: str                 # the selection's name in result rows; "none" for a method that takes none
    budget: int | None             # None: the full cache
    preset: str | None = None      # a preset= the cell runs under (its selection knobs and conventions)
    presets_selection: bool = False  # the preset's own selection, knobs included: no selection= override, which
                                     # would replace the preset's knobs with that option's defaults

    def overrides(self) -> dict:
        chosen = self.selection != "none" and not self.presets_selection
        return ({"preset": self.preset} if self.preset else {}) | {"method": self.method, "budget": self.budget or 128} \
            | ({"selection": self.selection} if chosen else {})


def configurations(args) -> list[Configuration]:
    """The full cache, every method x selection x budget, and under each ``--presets`` the methods that take a
    selection with attention selection and the preset's own (its baseline: the same conventions, attention)."""
    out = [Configuration("full", "none", None)]
    for method in args.methods:
        for selection in (args.selections if uses("method", method, "selection") else ["none"]):
            out += [Configuration(method, selection, budget) for budget in args.budgets]
    for preset in args.presets:
        for method in (m for m in args.methods if uses("method", m, "selection")):
            for budget in args.budgets:
                own = composed(**Configuration(method, "none", budget, preset).overrides()).selection.name
                out += [Configuration(method, "attention", budget, preset),
                        Configuration(method, own, budget, preset, presets_selection=True)]
    return out


def build_configurations(args) -> list[tuple[Configuration, object]]:
    return [(c, build_method(composed(**c.overrides()))) for c in configurations(args)]


def stage2_work(method, samples: list[dict]) -> dict:
    """What a two-stage selection's stage 2 computed over the bench's timed prompts: the share of its entries whose
    exact norm it computed (1.0: exhaustive), the share in layers whose search scored every entry, and the share of
    heads whose first candidates did not verify."""
    if not method.two_stage:
        return {}
    work = Stage2Work()
    for sample in samples:
        for name, value in dataclasses.asdict(sample["stage2"]).items():
            setattr(work, name, getattr(work, name) + value)
    return {"stage2_exact_share": work.exact_share, "stage2_gram_share": work.gram_share,
            "stage2_certified_share": work.certified_share, "stage2_every_entry_share": work.every_entry_share,
            "stage2_widened_share": work.widened / max(1, work.heads),
            "stage2_reads_per_layer": work.host_reads / max(1, work.layers)}


def analysis(args) -> list[dict]:
    """The perturbation analysis's work for one context per ``--contexts`` (``--methods[0]`` with every
    ``--selections`` at ``--budgets``): its full-cache prefill with every variant's choice, then the head-wise,
    layer-wise and Assumption-1 measurements; its time and peak memory."""
    from ..output_perturbation import measure, run_prefill
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, args.layers, device, args.model_path)
    method = args.methods[0]
    variants = {(selection, budget): build_method(composed(method=method, selection=selection, budget=budget))
                for selection in args.selections for budget in args.budgets}
    two_stage = next((m for m in variants.values() if m.two_stage), None)
    rows = []
    for context in args.contexts:
        ids = random_prompt(model, context).to(device)
        with PeakMemory(torch.device(device)) as mem:
            start = time.perf_counter()
            prefill = run_prefill(model, ids, variants, two_stage)
            prefill_s = time.perf_counter() - start
            measure(model, prefill, list(variants), list(variants))
            total_s = time.perf_counter() - start
            del prefill
        row = {"model": args.model, "device": device, "device_name": device_name(device),
               "layers": model.config.num_hidden_layers, "analysis": "perturbation", "method": method, "selections": args.selections, "budgets": args.budgets,
               "context": context, "prefill_s": prefill_s, "measure_s": total_s - prefill_s,
               "peak_mem_bytes": mem.extra, "peak_mem_total_bytes": mem.peak if device == "cuda" else None}
        rows.append(row)
        print(json.dumps(row) if args.json else
              f"{context:>7} perturbation analysis ({method}: {', '.join(args.selections)} x {args.budgets}): "
              f"prefill {prefill_s:.2f} s, measurements {total_s - prefill_s:.2f} s, peak +{mem.extra / 2**30:.2f} GiB",
              flush=True)
    return rows


def engine_options(args) -> EngineOptions:
    """The engine's defaults, changed where the bench's flags say (--layers-behind, --value-norm-kernel,
    --decode-kernel, --compile-step, --stage2-search)."""
    changes = {"layers_behind": args.layers_behind, "stage2_value_norm_kernel": args.value_norm_kernel,
               "decode_kernel": getattr(args, "decode_kernel", None),
               "compile_step": getattr(args, "compile_step", None), "stage2_search": args.stage2_search}
    return defaults().with_(**{k: v for k, v in changes.items() if v is not None})


def run(args) -> list[dict]:
    """Per context: a warm-up of every configuration, then ``repeats`` rounds that each measure every
    configuration once, so that slow drift of the machine falls on all configurations alike. Each row is printed
    as soon as its last round is measured, so a run stopped at a time limit keeps the rows before it; a bar on
    stderr counts the measurements (warm-ups included)."""
    options = engine_options(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    behind = compression.layers_behind(torch.device(device), options)
    model = build_model(args.model, args.layers, device, args.model_path)
    kernel = options.stage2.value_norm_kernel and value_norm_kernel.available(torch.device(device),
                                                                              head_dim(model.config))
    weights = weight_bytes(model)
    built = build_configurations(args)
    repeat = bench_repeat(args.model, args.model_path) if any(m.reconstruction for _, m in built) else None
    rows = []
    bar = tqdm(total=len(args.contexts) * len(built) * (1 + args.repeats), desc="bench", unit="measurement",
               dynamic_ncols=True)
    for context in args.contexts:
        ids = random_prompt(model, context)
        search = scores.stage2_search(context, torch.device(device), options.stage2)
        for _, method in built:
            greedy_generate(model, ids, method, 2, set(), options=options, repeat=repeat)
            bar.update()
        samples = [[] for _ in built]
        for _ in range(args.repeats - 1):
            for i, (_, method) in enumerate(built):
                samples[i].append(measure_once(model, method, ids, args.decode_tokens, options, repeat))
                bar.update()
        base = None
        for (config, method), runs in zip(built, samples):
            runs.append(measure_once(model, method, ids, args.decode_tokens, options, repeat))     # the last round
            bar.update()
            result = summarize(runs) | stage2_work(method, runs)
            with CompressionOps(method) as ops:   # its prefill's compression: ops per layer, at up to CALLS_CONTEXT
                result["attention_calls_per_token"] = attention_calls_per_token(
                    model, ops.method, ids[:, :CALLS_CONTEXT], options=options, repeat=repeat)
            result["compress_ops_per_layer"] = ops.per_layer
            if args.profile:
                name = f"{context}_{config.method}_{config.selection}_{config.budget or 'all'}" \
                       f"{'_' + config.preset if config.preset else ''}.txt"
                result["compress_share"] = profile_prefill(model, method, ids, Path(args.profile) / name, options,
                                                           repeat)
            if args.pools:
                graphs = device == "cuda" and not args.eager
                result["pools"] = measure_pools(model, method, ids.to(device), args.pools, args.decode_tokens, graphs,
                                                options, repeat)
                result["cuda_graphs"] = graphs
            base = base or result
            row = {"model": args.model, "device": device, "device_name": device_name(device),
                   "layers": model.config.num_hidden_layers, "method": config.method, "selection": config.selection,
                   "budget": config.budget, "preset": config.preset, "context": context, "repeats": args.repeats,
                   "decode_tokens": args.decode_tokens,
                   "compression_layers_behind": behind, "value_norm_kernel": kernel,
                   **({"value_norm_blocks": value_norm_kernel.configuration()} if kernel else {}),
                   "stage2_search": "exhaustive" if method.exhaustive_stage2 else search, **result,
                   "decode_bound": (weights + result["kv_bytes_full"]) / (weights + result["kv_bytes"]),
                   "decode_speedup": base["decode_ms_per_token"] / result["decode_ms_per_token"]}
            rows.append(row)
            with bar.external_write_mode():
                print(json.dumps(row) if args.json else format_row(row), flush=True)
    bar.close()
    return rows
