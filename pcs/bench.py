"""What each method and selection costs and saves: prefill-plus-compression time, decode speed on the
compressed cache against the memory-traffic bound, KV bytes and peak memory.

    python -m pcs.bench --model smollm2 --contexts 4096 8192 --methods snapkv adakv \\
        --selections attention perturbation --budgets 128 --repeats 3 [--decode-tokens 32] [--json]
    python -m pcs.bench --model llama31-shape --layers 32 --contexts 8192 32768 131072 --device cuda  # random weights
    python -m pcs.bench --perturbation-analysis --model llama31-shape --layers 32 --contexts 32768 --device cuda
    python -m pcs.bench --model smollm2 --contexts 2048 4096 --methods snapkv pyramidkv adakv streamingllm laprox \
        --budgets 128 1024 --pools 1 8 32 --repeats 1 --json        # decode pools: tokens/s and ms per step
    python -m pcs.bench --report results/bench/gpu_NVIDIA_H100_80GB_HBM3.jsonl    # its table and the targets
    python -m pcs.bench --project experiment=table1 --bench results/bench/gpu_NVIDIA_H100_80GB_HBM3.jsonl

One process, random prompt tokens, a warm-up of every configuration, then ``--repeats`` rounds that
each measure every configuration once (drift falls on all alike); medians. The full cache is always
measured first, as the baseline of ``decode_speedup`` and ``decode_bound``:
``decode_bound = (weight bytes + full KV bytes) / (weight bytes + kept KV bytes)``, the speed-up a
decoding step limited by memory traffic would get from the smaller cache.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import compression
from .compression import CompressionStats
from .config import compose, uses
from .engine import Cell, DecodePool, clock, prefill
from .eviction import build_method, scores
from .eviction.stage2_search import Stage2Work
from .hybrid import head_dim
from .kernels import value_norms as value_norm_kernel
from .generate import greedy_generate
from .models import load_model, prepare
from .options import EngineOptions, defaults
from .paths import read_jsonl

LLAMA31_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072)


def composed(**overrides):
    return compose([f"{k}={v}" for k, v in overrides.items()])


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


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


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
    on_cuda = next(model.parameters()).device.type == "cuda"      # the prompt may still be on the host
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        greedy_generate(model, ids, method, 1, set())
    averages = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in averages)
    compress = sum(e.cpu_time_total for e in averages if e.key == "pcs.compress")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=30)
                    + ("\n" + averages.table(sort_by="self_cuda_time_total", row_limit=30) if on_cuda else "")
                    + "\n" + compression_breakdown(prof.events()))
    return compress / total if total else 0.0


def compression_breakdown(events) -> str:
    """What the ops inside the ``pcs.compress`` spans did, per operator: calls, kernels they launched, those kernels'
    device time and the host's own time in the operator (the whole-prefill tables above mix them with the forward's),
    per compressed layer; the most device time first, then the most host time (on a CPU, where there is no device)."""
    totals: dict[str, list] = {}
    # The host's spans only: with CUDA activity the profiler also lists each span once more as a device-side
    # annotation, which has no operators under it and would halve the figures per layer.
    spans = [e for e in events if e.name == "pcs.compress" and e.device_type == torch.autograd.DeviceType.CPU]

    def walk(event):
        for child in event.cpu_children:
            calls_kernels_device_host = totals.setdefault(child.name, [0, 0, 0.0, 0.0])
            calls_kernels_device_host[0] += 1
            calls_kernels_device_host[1] += len(child.kernels)
            calls_kernels_device_host[2] += child.self_device_time_total / 1000
            calls_kernels_device_host[3] += child.self_cpu_time_total / 1000
            walk(child)
    for span in spans:
        walk(span)
    layers = max(1, len(spans))
    lines = [f"Inside pcs.compress, per compressed layer ({len(spans)} spans): operator, calls, kernels, device ms, "
             "host ms",
             *(f"{name:<48} {calls / layers:8.1f} {kernels / layers:8.1f} {device / layers:9.3f} {host / layers:9.3f}"
               for name, (calls, kernels, device, host) in sorted(totals.items(),
                                                                  key=lambda kv: (-kv[1][2], -kv[1][3], -kv[1][0])))]
    return "\n".join(lines) + "\n"


ATTENTION_OP = "aten::scaled_dot_product_attention"
CALLS_CONTEXT = 4096    # tokens of the prompt the attention calls are counted on: how many calls a decode step
                        # makes per layer does not depend on the prompt's length, and one more prefill of 128K
                        # tokens per configuration would cost a GPU session minutes


def attention_calls_per_token(model, method, ids, steps: int = 4) -> float:
    """Attention calls (all layers) per decoded token, counted by the profiler over ``steps`` decoding
    steps: the prefill's one call per layer is subtracted. CPU events only: tracing the GPU's kernels too
    (CUPTI) costs minutes per configuration at 128K and is not needed to count calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        greedy_generate(model, ids, method, steps + 1, set())
    calls = sum(e.count for e in prof.key_averages() if e.key == ATTENTION_OP)
    return (calls - model.config.num_hidden_layers) / steps


# Operations that dispatch no work to a device: views, allocations, conjugation flags.
NO_WORK_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
               "resolve_conj", "resolve_neg", "alias"}


class CompressionOps:
    """Operations a method's compression (its ``keep``, layer by layer) dispatches while active, views and
    allocations aside. On a GPU each is at least one kernel launch or copy the host issues, so this counts what a
    prefill's host spends on compressing, deterministically where timings are noisy; a selection whose count grows
    with the prompt would cost launches per token on an accelerator. Only ``keep`` runs under the counting
    dispatch mode: the forward around it runs as it would."""

    def __init__(self, method):
        self.method, self.ops, self.layers = method, 0, 0

    @property
    def per_layer(self) -> float:
        return self.ops / max(1, self.layers)

    def __enter__(self):
        keep = type(self.method).keep

        def counted(layer):
            self.layers += 1
            with _OpCounter(self):
                return keep(self.method, layer)
        self.method.keep = counted
        return self

    def __exit__(self, *exc):
        del self.method.keep


class _OpCounter(TorchDispatchMode):
    def __init__(self, owner: CompressionOps):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._overloadpacket.__name__ not in NO_WORK_OPS:
            self.owner.ops += 1
        return func(*args, **(kwargs or {}))


class CompressionClock:
    """Seconds a method spends choosing what to keep (its ``keep``, layer by layer) while active: the part of the
    prefill in which selections differ, timed by CUDA events on a GPU so that nothing waits for it."""

    def __init__(self, method, device: torch.device):
        self.method, self.device, self.spans, self.seconds = method, device, [], 0.0

    def __enter__(self):
        keep = type(self.method).keep

        def timed(layer):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                kept = keep(self.method, layer)
                end.record()
                self.spans.append((start, end))
            else:
                start = time.perf_counter()
                kept = keep(self.method, layer)
                self.seconds += time.perf_counter() - start
            return kept
        self.method.keep = timed
        return self

    def __exit__(self, *exc):
        del self.method.keep
        if self.spans:
            torch.cuda.synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self.spans) / 1000


def measure_once(model, method, ids, decode_tokens: int, options: EngineOptions) -> dict:
    device = next(model.parameters()).device
    with PeakMemory(device) as mem, CompressionClock(method, device) as clock:
        gen = greedy_generate(model, ids, method, decode_tokens, set(), options=options)
    return {"stage2": gen.stage2, "prefill_s": gen.prefill_s, "compress_s": clock.seconds, "decode_ms_per_token": 1000 * gen.decode_s / max(1, len(gen.token_ids) - 1),
            "kv_bytes": gen.kv_cache_bytes, "kv_bytes_full": gen.kv_cache_bytes_full, "peak_mem_bytes": mem.extra,
            "peak_mem_total_bytes": mem.peak if device.type == "cuda" else None}


def measure_pools(model, method, ids, sizes: list[int], decode_tokens: int, graphs: bool,
                  options: EngineOptions) -> dict:
    """Decoding with pools of ``sizes`` sequences, each a copy of one compressed prompt (one prefill for all):
    per size, milliseconds per step (one forward for the whole pool) and tokens per second. A warm-up of 3
    tokens per size first (on CUDA it captures the step's graph). A size whose buffers would not fit in the
    device's free memory is recorded as such (``fits``: the sequences that would)."""
    device = next(model.parameters()).device
    (seq,) = prefill(model, ids, [Cell(method)], decode_tokens, set(), options=options)
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
    from .output_perturbation import measure, run_prefill
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
    --stage2-search)."""
    changes = {"layers_behind": args.layers_behind, "stage2_value_norm_kernel": args.value_norm_kernel,
               "stage2_search": args.stage2_search}
    return defaults().with_(**{k: v for k, v in changes.items() if v is not None})


def run(args) -> list[dict]:
    """Per context: a warm-up of every configuration, then ``repeats`` rounds that each measure every
    configuration once, so that slow drift of the machine falls on all configurations alike. Each row is printed
    as soon as its last round is measured, so a run stopped at a time limit keeps the rows before it."""
    options = engine_options(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    behind = compression.layers_behind(torch.device(device), options)
    model = build_model(args.model, args.layers, device, args.model_path)
    kernel = options.stage2.value_norm_kernel and value_norm_kernel.available(torch.device(device),
                                                                              head_dim(model.config))
    weights = weight_bytes(model)
    built = build_configurations(args)
    rows = []
    for context in args.contexts:
        ids = random_prompt(model, context)
        search = scores.stage2_search(context, torch.device(device), options.stage2)
        for _, method in built:
            greedy_generate(model, ids, method, 2, set(), options=options)
        samples = [[] for _ in built]
        for _ in range(args.repeats - 1):
            for i, (_, method) in enumerate(built):
                samples[i].append(measure_once(model, method, ids, args.decode_tokens, options))
        base = None
        for (config, method), runs in zip(built, samples):
            runs.append(measure_once(model, method, ids, args.decode_tokens, options))     # the last round
            result = summarize(runs) | stage2_work(method, runs)
            with CompressionOps(method) as ops:   # its prefill's compression: ops per layer, at up to CALLS_CONTEXT
                result["attention_calls_per_token"] = attention_calls_per_token(model, method, ids[:, :CALLS_CONTEXT])
            result["compress_ops_per_layer"] = ops.per_layer
            if args.profile:
                name = f"{context}_{config.method}_{config.selection}_{config.budget or 'all'}" \
                       f"{'_' + config.preset if config.preset else ''}.txt"
                result["compress_share"] = profile_prefill(model, method, ids, Path(args.profile) / name)
            if args.pools:
                graphs = device == "cuda" and not args.eager
                result["pools"] = measure_pools(model, method, ids.to(device), args.pools, args.decode_tokens, graphs,
                                                options)
                result["cuda_graphs"] = graphs
            base = base or result
            row = {"model": args.model, "device": device, "device_name": device_name(device),
                   "layers": model.config.num_hidden_layers, "method": config.method, "selection": config.selection,
                   "budget": config.budget, "preset": config.preset, "context": context, "repeats": args.repeats,
                   "decode_tokens": args.decode_tokens,
                   "compression_layers_behind": behind, "value_norm_kernel": kernel,
                   **({"value_norm_blocks": value_norm_kernel.configuration()} if kernel else {}),
                   "stage2_search": search, **result,
                   "decode_bound": (weights + result["kv_bytes_full"]) / (weights + result["kv_bytes"]),
                   "decode_speedup": base["decode_ms_per_token"] / result["decode_ms_per_token"]}
            rows.append(row)
            print(json.dumps(row) if args.json else format_row(row), flush=True)
    return rows


def selection_label(row: dict) -> str:
    return row["selection"] + (f" ({row['preset']})" if row.get("preset") else "")


def format_row(row: dict) -> str:
    return (f"{row['context']:>7} {row['method']:<12} {selection_label(row):<13} {str(row['budget'] or '-'):>6} "
            f"prefill {row['prefill_s']:8.3f} s  decode {row['decode_ms_per_token']:8.2f} ms/tok  "
            f"KV {row['kv_bytes'] / 2**20:8.1f}/{row['kv_bytes_full'] / 2**20:8.1f} MiB  "
            f"peak +{row['peak_mem_bytes'] / 2**20:7.1f} MiB  speed-up {row['decode_speedup']:5.2f} "
            f"(bound {row['decode_bound']:5.2f})  {row['attention_calls_per_token']:g} attention calls/token"
            + (f"  compressing {100 * row['compress_share']:4.1f} %" if "compress_share" in row else "")
            + (f"  stage 2 exact {100 * row['stage2_exact_share']:.1f} % of entries, "
               f"{100 * row['stage2_widened_share']:.0f} % of heads widened" if "stage2_exact_share" in row else "")
            + "".join(f"  pool {size}: {p['tokens_per_s']:.1f} tok/s ({p['ms_per_step']:.1f} ms/step)"
                      if "tokens_per_s" in p else f"  pool {size}: only {p['fits']} fit"
                      for size, p in row.get("pools", {}).items()))


def pool_table(rows: list[dict]) -> str:
    """Decoding throughput by pool size: tokens per second (ms per step), and each pool's speed-up over one."""
    rows = [r for r in rows if r.get("pools")]
    if not rows:
        return ""
    sizes = sorted({int(size) for r in rows for size in r["pools"]})
    head = "| context | method | selection | budget | " + " | ".join(f"pool {n}: tok/s (ms/step)" for n in sizes) \
        + " | " + " | ".join(f"pool {n} / pool {sizes[0]}" for n in sizes[1:]) + " |"
    lines = [head, "|---:|---|---|---:|" + "---:|" * (2 * len(sizes) - 1)]
    for r in rows:
        pools = {int(k): v for k, v in r["pools"].items()}
        measured = {n: p for n, p in pools.items() if "tokens_per_s" in p}
        cells = [f"{measured[n]['tokens_per_s']:.1f} ({measured[n]['ms_per_step']:.1f})" if n in measured
                 else f"{pools[n]['fits']} fit" if n in pools else "-" for n in sizes]
        ratios = [f"{measured[n]['tokens_per_s'] / measured[sizes[0]]['tokens_per_s']:.2f}"
                  if n in measured and sizes[0] in measured else "-" for n in sizes[1:]]
        lines.append(f"| {r['context']} | {r['method']} | {r['selection']} | {r['budget'] or '-'} | "
                     + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """A results file as the table of results/bench/README.md (peak: the allocator's total on CUDA, the
    growth of resident memory on CPU; compressing: ``--profile``'s share, where measured)."""
    profiled = any("compress_share" in r for r in rows)
    worked = any("stage2_exact_share" in r for r in rows)
    lines = ["| context | method | selection | budget | prefill+compress s | decode ms/token | KV MiB kept / full "
             "| peak GiB | decode speed-up | bound | attention calls/token |" + (" compressing |" if profiled else "")
             + (" stage-2 exact norms / entries | heads widened |" if worked else ""),
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if profiled else "")
             + ("---:|---:|" if worked else "")]
    for r in rows:
        peak = r.get("peak_mem_total_bytes") or r["peak_mem_bytes"]
        work = (f" {100 * r['stage2_exact_share']:.1f} % | {100 * r['stage2_widened_share']:.0f} % |"
                if "stage2_exact_share" in r else " - | - |")
        lines.append(f"| {r['context']} | {r['method']} | {selection_label(r)} | {r['budget'] or '-'} | {r['prefill_s']:.3f} "
                     f"| {r['decode_ms_per_token']:.2f} | {r['kv_bytes'] / 2**20:.1f} / {r['kv_bytes_full'] / 2**20:.1f} "
                     f"| {peak / 2**30:.2f} | {r['decode_speedup']:.2f} | {r['decode_bound']:.2f} "
                     f"| {r.get('attention_calls_per_token', float('nan')):g} |"
                     + (f" {100 * r['compress_share']:.1f} % |" if profiled else "") + (work if worked else ""))
    return "\n".join(lines)


def compression_label(row: dict) -> str:
    """How a row's prefill compressed: when, with which exact norms (``--value-norm-kernel``) and whether stage 2
    scored every entry (``--stage2-search``; under auto, in which share of the entries)."""
    layers = row.get("compression_layers_behind", 0)
    when = "after each layer" if not layers else f"{layers} layer{'s' if layers > 1 else ''} behind"
    search = {"exhaustive": ", every entry scored", "auto": ", bounded (auto)"}.get(row.get("stage2_search"), "")
    every = row.get("stage2_every_entry_share", 0.0)
    if row.get("stage2_search") == "auto" and every:
        search = f", bounded, then every entry in {100 * every:.1f} % of the entries (loose bounds)"
    return when + (", norms kernel" if row.get("value_norm_kernel") else "") + search


def selection_table(rows: list[dict]) -> str:
    """Perturbation over attention selection per (context, method, budget, conventions): the compressions' seconds,
    the ratio of prefill plus compression (``selection_overheads``) and of the whole prefills, and stage 2's work."""
    pairs = selection_overheads(rows)
    if not pairs:
        return ""
    lines = ["| context | method | budget | conventions | compression | compression s: attention, perturbation | "
             "perturbation / attention | by round, lowest-highest | whole prefills | exact norms / entries | "
             "d^2 bounds / entries | kept on the lower bound / entries | heads with a second round | "
             "ops per layer: attention, perturbation | median over fastest round: attention, perturbation |",
             "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for o in pairs:
        r = o.row
        times = f"{o.base['compress_s']:.3f}, {r['compress_s']:.3f}" if "compress_s" in r else "-"
        share = lambda key: f"{100 * r[key]:.1f} %" if key in r else "-"
        rounds = o.round_ratios
        by_round = f"{min(rounds):.3f}-{max(rounds):.3f} ({len(rounds)})" if rounds else "-"
        ops = f"{o.base['compress_ops_per_layer']:.0f}, {r['compress_ops_per_layer']:.0f}" \
            if "compress_ops_per_layer" in r and "compress_ops_per_layer" in o.base else "-"
        lines.append(f"| {r['context']} | {r['method']} | {r['budget']} | "
                     f"{'preset=' + r['preset'] if r.get('preset') else 'paper'} | "
                     f"{compression_label(r)} | "
                     f"{times} | {o.ratio:.3f} | {by_round} | "
                     f"{o.wall_ratio:.3f} | {share('stage2_exact_share')} | {share('stage2_gram_share')} | "
                     f"{share('stage2_certified_share')} | {share('stage2_widened_share')} | {ops} | "
                     f"{spread(o.base)}, {spread(r)}{' (void)' if o.void else ''} |")
    return "\n".join(lines)


def rounds_spread(row: dict) -> float | None:
    """How far a row's median prefill lies above its fastest round (0.1: 10 %), where the row kept its rounds: with
    3 rounds or more one outlier leaves the median where the others are, with 2 it moves it halfway."""
    rounds = row.get("prefill_rounds_s")
    return statistics.median(rounds) / min(rounds) - 1 if rounds and len(rounds) > 1 else None


def spread(row: dict) -> str:
    value = rounds_spread(row)
    return "-" if value is None else f"{100 * value:.0f} %"


# A pair is void where a row's median lies more than this above its fastest round: an outlier round (another
# process, a clock change) moved the median by more than the overheads measured.
VOID_SPREAD = 0.10

# Perturbation selection's prefill plus compression over attention selection's, at most, by context.
SELECTION_OVERHEAD = {8192: 1.10, 32768: 1.03}
CPU_SELECTION_OVERHEAD = {4096: 1.03}


@dataclasses.dataclass(frozen=True)
class Overhead:
    """A perturbation row against the attention row with the same context, method, budget and preset."""
    row: dict
    base: dict

    @property
    def outliers(self) -> list[str]:
        """The pair's rows (attention, perturbation) whose median lies more than ``VOID_SPREAD`` above their fastest
        round, where the ratio is the whole prefills' (the compressions' difference is measured apart from the
        forward's rounds)."""
        if not self.whole_prefills:
            return []
        return [name for name, r in (("attention", self.base), ("perturbation", self.row))
                if (rounds_spread(r) or 0) > VOID_SPREAD]

    @property
    def void(self) -> bool:
        """Whether an outlier round moved a row's median: the ratio says nothing."""
        return bool(self.outliers)

    @property
    def whole_prefills(self) -> bool:
        """Whether ``ratio`` is the whole prefills' ratio."""
        return "compress_s" not in self.row or "compress_s" not in self.base \
            or bool(self.row.get("compression_layers_behind"))

    @property
    def wall_ratio(self) -> float:
        """The whole prefills' ratio."""
        return self.row["prefill_s"] / self.base["prefill_s"]

    @property
    def ratio(self) -> float:
        """Prefill plus compression over the attention row's. Where both rows timed their compression
        (``compress_s``) it is ``(P_a - C_a + C_p) / P_a``: the forward is the same work under both selections, so
        the difference of the compressions' medians measures the overhead without the forward's noise, which on a
        busy CPU is larger than the overhead itself. Where the compression ran behind the forward, beside it (CUDA's
        ``compression_layers_behind``), its seconds are not added to the prefill's: the whole prefills' ratio."""
        if self.whole_prefills:
            return self.wall_ratio
        return (self.base["prefill_s"] - self.base["compress_s"] + self.row["compress_s"]) / self.base["prefill_s"]

    @property
    def round_ratios(self) -> list[float]:
        """``ratio`` per round, each row's i-th round against the other's i-th: the bench measures every
        configuration once a round, in turn, so a round's rows ran within one pass over the configurations, closer
        in time than rounds apart. Empty where a row kept no rounds (older files) or the rows kept unequal numbers."""
        a, p = self.base, self.row
        keys = ("prefill_rounds_s",) if self.whole_prefills else ("prefill_rounds_s", "compress_rounds_s")
        if not all(k in r for k in keys for r in (a, p)) or len({len(r[k]) for k in keys for r in (a, p)}) != 1:
            return []
        if self.whole_prefills:
            return [x / y for x, y in zip(p["prefill_rounds_s"], a["prefill_rounds_s"])]
        return [(pa - ca + cp) / pa for pa, ca, cp in zip(a["prefill_rounds_s"], a["compress_rounds_s"],
                                                          p["compress_rounds_s"])]

    def verdict(self, limit: float) -> str:
        """Against a target ratio ``limit``: met or missed in every round (``round_ratios``), else undecided (some
        rounds on either side: the target lies within the rounds' spread); by the medians' ratio alone where the
        rows kept no rounds."""
        rounds = self.round_ratios or [self.ratio]
        return "met" if max(rounds) <= limit else "missed" if min(rounds) > limit else "undecided"


def selection_overheads(rows: list[dict]) -> list[Overhead]:
    """Each perturbation row paired with the attention row under the same conventions."""
    def key(r):
        return (r["context"], r["method"], r["budget"], r.get("preset"), r.get("compression_layers_behind", 0),
                r.get("value_norm_kernel", False), r.get("value_norm_blocks"), r.get("stage2_search", "bounded"))
    attention = {key(r): r for r in rows if r["selection"] == "attention"}
    return [Overhead(r, attention[key(r)]) for r in rows if r["selection"] == "perturbation" and key(r) in attention]


# The decode targets read only rows that decoded at least this many tokens: a row decoding 2 (issue 28's prefill
# runs) times one step after the prefill's token, too short a sample of the cache's speed to judge it by.
LEAST_DECODED_TOKENS = 8


def targets(rows: list[dict]) -> list[str]:
    """The engine's targets, read off a results file: perturbation selection's prefill + compression at most
    1.10x attention selection's at 8K and 1.03x at 32K on a GPU, 1.03x at 4K on a CPU (met or missed in every round
    of every pair, else undecided: ``Overhead.verdict``); decoding on a budget-128 cache reaches 80 % of the
    memory-traffic bound at 32K and 128K; decoding on every compressed cache beats the full cache from 8K tokens
    up; at most 2 attention calls per layer and decoded token."""
    out = []
    overheads = selection_overheads(rows)
    for context in sorted({o.row["context"] for o in overheads}):
        void = [o for o in overheads if o.row["context"] == context and o.void]
        here = [o for o in overheads if o.row["context"] == context and not o.void]
        voided = (f"; {len(void)} void, a row's median more than {100 * VOID_SPREAD:.0f} % above its fastest round: "
                  + ", ".join(f"{o.row['method']} {selection_label(o.row)} b{o.row['budget']} (its "
                              f"{' and '.join(o.outliers)} row)" for o in void)) \
            if void else ""
        if not here:
            out.append(f"perturbation over attention selection, prefill + compression at {context}: no pair"
                       f"{voided}")
            continue
        worst = max(here, key=lambda o: o.ratio)
        r = worst.row
        limit = (CPU_SELECTION_OVERHEAD if r["device"] == "cpu" else SELECTION_OVERHEAD).get(context)
        walls = [o.wall_ratio for o in here]
        verdict = ""
        if limit:      # the context's verdict is its worst pair's: missed over undecided over met
            verdicts = [o.verdict(limit) for o in here]
            overall = next(v for v in ("missed", "undecided", "met") if v in verdicts)
            open_ = [f"{o.row['method']} {selection_label(o.row)} b{o.row['budget']} {v} "
                     f"({min(o.round_ratios):.3f}x-{max(o.round_ratios):.3f}x)" if o.round_ratios else
                     f"{o.row['method']} {selection_label(o.row)} b{o.row['budget']} {v}"
                     for o, v in zip(here, verdicts) if v != "met"]
            verdict = f" [target <= {limit:.2f}x: {overall}]" + (f" (by round: {'; '.join(open_)})" if open_ else "")
        out.append(f"perturbation over attention selection, prefill + compression at {context}: "
                   f"{min(o.ratio for o in here):.3f}x to {worst.ratio:.3f}x over {len(here)} pairs (most: {r['method']} "
                   f"{selection_label(r)} b{r['budget']}; whole prefills' ratios {min(walls):.3f}x to {max(walls):.3f}x"
                   f"{voided})" + verdict)
    decoded = [r for r in rows if r.get("decode_tokens", LEAST_DECODED_TOKENS) >= LEAST_DECODED_TOKENS]
    if len(decoded) < len(rows):
        out.append(f"decode targets: {len(rows) - len(decoded)} rows not read, which decoded fewer than "
                   f"{LEAST_DECODED_TOKENS} tokens")
    for r in decoded:
        if r["budget"] == 128 and r["context"] in (32768, 131072):
            share = r["decode_speedup"] / r["decode_bound"]
            out.append(f"decode at {r['context']}, {r['method']}/{r['selection']} b128: {100 * share:.0f} % of the "
                       f"bound {r['decode_bound']:.2f} [target >= 80 %: {'met' if share >= 0.8 else 'missed'}]")
    slower = [r for r in decoded if r["budget"] is not None and r["context"] >= 8192 and r["decode_speedup"] <= 1]
    if decoded:
        out.append(f"compressed caches decoding no faster than the full cache from 8K up: {len(slower)}"
                   + "".join(f"; {r['context']} {r['method']}/{r['selection']} b{r['budget']} "
                             f"{r['decode_speedup']:.2f}x" for r in slower)
                   + f" [target 0: {'met' if not slower else 'missed'}]")
    for size, need, context in ((8, 1.8, None), (64, 20.0, 32768)):
        gains = [(pools[size] / pools[1], r) for r in rows
                 for pools in [{int(k): v["tokens_per_s"] for k, v in r.get("pools", {}).items() if "tokens_per_s" in v}]
                 if 1 in pools and size in pools and (context is None or r["context"] == context)]
        if gains:
            worst, r = min(gains, key=lambda g: g[0])
            out.append(f"pool of {size}{f' at {context}' if context else ''}: {worst:.2f}x to "
                       f"{max(g for g, _ in gains):.2f}x the tokens per second of one sequence over {len(gains)} rows "
                       f"(least: {r['context']} {r['method']}/{r['selection']} b{r['budget']}) [target >= {need:g}x: "
                       f"{'met' if worst >= need else 'missed'}]")
    most = max((r.get("attention_calls_per_token", 0) / r["layers"] for r in rows if r.get("layers")), default=None)
    if most is not None:
        out.append(f"attention calls per layer and decoded token: at most {most:g} [target <= 2: "
                   f"{'met' if most <= 2 else 'missed'}]")
    return out


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pcs.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an option of pcs/conf/model, or llama31-shape (random weights)")
    parser.add_argument("--model-path", help="local transformers weights for --model's config")
    parser.add_argument("--layers", type=int, default=4, help="llama31-shape: number of layers")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--methods", nargs="+", default=["snapkv", "adakv"])
    parser.add_argument("--selections", nargs="+", default=["attention", "perturbation"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[128])
    parser.add_argument("--presets", nargs="+", default=[], help="also each method under these presets (e.g. "
                        "criticalkv), with attention selection and the preset's own")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--pools", type=int, nargs="+", default=[], help="also decode with pools of these many "
                        "sequences (copies of the prompt's compressed cache): ms per step and tokens per second")
    parser.add_argument("--eager", action="store_true", help="on CUDA, pools decode without CUDA graphs")
    parser.add_argument("--layers-behind", type=int, help="on CUDA, how many layers behind the forward each layer is "
                        "compressed, on a stream of its own (0: right after its own forward, on the forward's stream; "
                        "default: engine.layers_behind in pcs/conf/config.yaml)")
    parser.add_argument("--value-norm-kernel", action=argparse.BooleanOptionalAction, help="on CUDA, stage 2's "
                        "exact norms from pcs.kernels.value_norms's one kernel, or (--no-value-norm-kernel) from "
                        "batched products (default: engine.stage2.value_norm_kernel); rows say which in "
                        "value_norm_kernel, and the report pairs only rows alike")
    parser.add_argument("--stage2-search", choices=["auto", "bounded", "exhaustive"], help="on an accelerator, "
                        "stage 2 bounds its norms and scores the entries the bounds leave (bounded), scores every "
                        "entry (exhaustive; the same entries are kept), or (auto) scores every entry in layers "
                        "shorter than engine.stage2.exhaustive_below and bounds longer ones until a prompt's bounds "
                        "prove loose (pcs/options.py). Default: engine.stage2.search; rows say which search they "
                        "started with in stage2_search and, under auto, how much of it scored every entry in "
                        "stage2_every_entry_share")
    parser.add_argument("--project", metavar="OVERRIDE", nargs="+", help="print the GPU-hours a sweep would take "
                        "(e.g. experiment=table1), from --bench's measured costs; measures nothing")
    parser.add_argument("--bench", metavar="JSONL", help="--project: the bench results to project from")
    parser.add_argument("--tokens-per-word", type=float, default=1.3, help="--project: prompt tokens per word "
                        "where the benchmark gives lengths in words")
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--perturbation-analysis", action="store_true", help="time the perturbation analysis "
                        "(benchmark=perturbation) instead: --methods[0] with --selections at --budgets")
    parser.add_argument("--report", metavar="JSONL", help="print a results file's markdown table and the engine's "
                        "targets read off it, and measure nothing")
    parser.add_argument("--profile", metavar="DIR", help="also profile one prefill per configuration "
                        "(torch.profiler op table into DIR; compress_share = time under pcs.compress)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.report:
        rows = read_jsonl(Path(args.report))
        pools, selections = pool_table(rows), selection_table(rows)
        print(markdown(rows) + "\n\n" + (pools + "\n\n" if pools else "") + (selections + "\n\n" if selections else "")
              + "\n".join(f"- {line}" for line in targets(rows)))
        return 0
    if args.project:
        from .projection import project
        if not args.bench:
            raise SystemExit("--project needs --bench JSONL: the measured costs to project from")
        print(project(args.project, args.bench, max(args.pools) if args.pools else None, args.tokens_per_word))
        return 0
    analysis(args) if args.perturbation_analysis else run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
