"""``python -m pcs.bench --decode``: what one decoding step costs, against what it must cost.

A step of a pool of rows reads, at the least, the model's weights once (the input embedding aside, of which it reads
one row per sequence) and every row's own kept entries (sliding windows included). At the device's copy bandwidth,
measured in the same process, those bytes take the step's **bound**; each row of the results gives the measured
step as a multiple of it. Configurations: the full cache and every ``--methods`` x ``--budgets`` (attention
selection: a selection changes which entries a row holds, not how many), each as pools of ``--pools`` copies of one
compressed prompt, and a **mixed** pool: per sample the full cache beside the compressed rows of every configuration,
twice (as a sweep over two selections holds them), repeated up to the pool's size. On CUDA every pool is timed with
and without CUDA graphs; rows that would not fit in free memory say how many would (``fits``)."""
from __future__ import annotations

import copy
import dataclasses
import json

import torch

from ..compression import CompressionStats
from ..engine import Cell, DecodePool, clock, prefill
from ..hybrid import head_dim
from ..kernels import decode_attention
from ..eviction import build_method
from .instrument import StepKernels, StepOps
from .measure import build_model, composed, device_name, engine_options, random_prompt

WARM_STEPS = 3            # untimed steps first: on CUDA they capture the step's graph
POOLS = (1, 8, 64)        # pool sizes where --pools names none


def bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (a copy reads and writes ``nbytes`` each: 2 x nbytes moved),
    the fastest of ``repeats``; on a CPU, a copy in memory the same way."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        start = clock(device)
        target.copy_(source)
        best = min(best, clock(device) - start)
    del source, target
    return 2 * nbytes / best


def step_weight_bytes(model) -> int:
    """The weights a decoding step reads: all of them, but for an input embedding not tied to the output head (a
    step reads one of its rows per sequence)."""
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embedding.numel() * embedding.element_size()


def copy_of(seq, max_new: int):
    """An independent copy of a prefilled sequence, to decode ``max_new`` tokens."""
    return dataclasses.replace(seq, cache=copy.deepcopy(seq.cache), logits=seq.logits.clone(), max_new_tokens=max_new,
                               stats=CompressionStats(), result=dataclasses.replace(seq.result, token_ids=[]))


def timed_steps(model, templates: list, size: int, graphs: bool, steps: int, options) -> dict:
    """A pool of ``size`` slots holding a copy of each of ``templates`` (prefilled sequences), each copy made only
    once the pool admits it (a copy that cannot fit is never made): after ``WARM_STEPS`` untimed steps and one whose
    operations are counted (an eager, uncompiled step: ``ops_per_step``, ``ops_per_layer``; a compiled one, graph
    or not: ``kernels_per_step``, ``kernels_per_layer``, from a profile), the mean
    milliseconds of ``steps`` steps and the tokens per second; or ``fits``, the rows the device's free memory
    admitted, where it did not admit them all."""
    device = next(model.parameters()).device
    pool = DecodePool(model, size, graphs, options)
    for template in templates:
        if not pool.admits(template):
            return {"fits": len(pool.sequences)}
        pool.join(copy_of(template, WARM_STEPS + steps + 2))
    for _ in range(WARM_STEPS):
        pool.step()
    layers = model.config.num_hidden_layers
    counted = {"compiled": pool.compiled}
    if pool.compiled:
        kernels = StepKernels()
        with kernels.counting():
            pool.step()
        counted |= {"kernels_per_step": kernels.kernels, "kernels_per_layer": kernels.kernels / layers}
    elif not graphs:     # a replayed graph dispatches nothing to count: the eager step's operations stand for it
        ops = StepOps()
        with ops.counting():
            pool.step()
        counted |= {"ops_per_step": ops.ops, "ops_per_layer": ops.ops / layers}
    else:
        pool.step()
    start = clock(device)
    for _ in range(steps):
        pool.step()
    elapsed = clock(device) - start
    return {"ms_per_step": 1000 * elapsed / steps, "tokens_per_s": len(templates) * steps / elapsed, **counted}


def run(args) -> list[dict]:
    """Every configuration's rows, printed as each is measured (a command stopped at a time limit keeps them)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = engine_options(args)
    model = build_model(args.model, args.layers, device, args.model_path)
    per_second = bandwidth(torch.device(device))
    weights = step_weight_bytes(model)
    kernel = options.decode_kernel and decode_attention.available(torch.device(device), head_dim(model.config))
    steps = args.decode_tokens
    pools = args.pools or list(POOLS)
    modes = [True, False] if device == "cuda" and not args.eager else [False]
    configurations = [("full", None)] + [(m, b) for m in args.methods for b in args.budgets]
    built = {c: build_method(composed(method=c[0], selection="attention", budget=c[1] or 128)) for c in configurations}
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row) if args.json else format_decode_row(row), flush=True)

    for context in args.contexts:
        ids = random_prompt(model, context).to(device)
        tokens = WARM_STEPS + steps + 2
        prefilled = {c: prefill(model, ids, [Cell(method)], tokens, set(), options=options)[0]
                     for c, method in built.items()}
        common = {"model": args.model, "device": device, "device_name": device_name(device),
                  "layers": model.config.num_hidden_layers, "context": context, "steps": steps,
                  "bandwidth_gb_s": per_second / 1e9, "weight_bytes": weights, "decode_kernel": kernel}
        for (method, budget), seq in prefilled.items():
            for size in pools:
                for graphs in modes:
                    kv = size * seq.cache.nbytes()
                    result = timed_steps(model, [seq] * size, size, graphs, steps, options)
                    emit(common | bounded({"method": method, "budget": budget, "pool": size, "cuda_graphs": graphs,
                                           "kv_bytes": kv}, result, weights, per_second))
        compressed = [seq for c, seq in prefilled.items() if c[1] is not None]
        if compressed:
            sample = [prefilled[("full", None)]] + compressed * 2     # the full cache beside two selections' rows
            for size in pools:
                chosen = [sample[i % len(sample)] for i in range(size)]
                for graphs in modes:
                    kv = sum(seq.cache.nbytes() for seq in chosen)
                    result = timed_steps(model, chosen, size, graphs, steps, options)
                    emit(common | bounded({"method": "mixed", "budget": None, "pool": size, "cuda_graphs": graphs,
                                           "kv_bytes": kv, "rows_full": sum(seq is sample[0] for seq in chosen)},
                                          result, weights, per_second))
        del prefilled
    return rows


def bounded(row: dict, result: dict, weights: int, per_second: float) -> dict:
    """A row with its measurement and its bound: the bytes a step must read (weights, the rows' own entries) over
    the measured bandwidth, and the measured step as a multiple of that."""
    bound_ms = 1000 * (weights + row["kv_bytes"]) / per_second
    out = {**row, **result, "bound_ms": bound_ms}
    if "ms_per_step" in result:
        out["of_bound"] = result["ms_per_step"] / bound_ms
    return out


def format_decode_row(row: dict) -> str:
    what = f"{row['method']}" + (f" b{row['budget']}" if row["budget"] else "")
    graphs = "graphs" if row["cuda_graphs"] else "eager"
    if "ms_per_step" not in row:
        return f"{row['context']:>7} {what:<14} pool {row['pool']:>3} {graphs:<6} fits {row['fits']} of {row['pool']}"
    return (f"{row['context']:>7} {what:<14} pool {row['pool']:>3} {graphs:<6} {row['ms_per_step']:8.2f} ms/step  "
            f"{row['tokens_per_s']:9.1f} tok/s  bound {row['bound_ms']:7.2f} ms  x{row['of_bound']:.2f}")
