"""Decoding steps of a pool that mixes cache lengths, as a shared-prefill sweep's does: per sample one full cache
and ten compressed to a share of the prompt (the Gemma ablations' pool: 4,096- and 8,192-token samples, 33
sequences). Times one forward of the whole pool with attention split into runs of slots reading their own key
blocks (``pcs.engine.pool.read_spans``, the CPU default) against one call over every slot's keys (what the pool
did before), alternating the two. The caches hold zeros: a step's cost depends on the shapes, not the values.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/pool_mixed_lengths.py --model gemma3_270m --share 0.25 0.75
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def pool_of(model, lengths: list[int]):
    """A PoolCache whose slot s holds ``lengths[s]`` entries per head in every full-attention layer and a full
    window in every sliding one, every entry visible."""
    from pcs.engine.pool import PoolCache
    pool = PoolCache(model.config, model.dtype, "cpu")
    b = len(lengths)
    for layer in pool.layers:
        held = np.full(b, layer.window) if layer.is_sliding else np.array(lengths)
        layer.reserve(b, 1 if layer.is_sliding else int(held.max()) + 64, 1)
        layer.lengths[:b] = held[:, None]
        for slot, n in enumerate(held):
            layer.allowed[slot, :, :, :n] = True
        layer.advance[:b] = 1
        if layer.is_sliding:
            layer.positions[:b] = held
        layer.index(range(b))
    return pool


def seconds_per_step(model, pool, lengths: list[int], steps: int) -> float:
    b = len(lengths)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            pool.prepare_step(b)
            model(input_ids=torch.zeros(b, 1, dtype=torch.long), position_ids=torch.tensor([[n] for n in lengths]),
                  past_key_values=pool)
            pool.stepped(b)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3_270m")
    parser.add_argument("--share", type=float, nargs="+", default=[0.25, 0.75], help="compressed share of a prompt")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 4096, 8192], help="the pool's samples")
    parser.add_argument("--compressed", type=int, default=10, help="compressed caches per sample")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    import pcs.engine.pool as pool_module
    from pcs.config import compose
    from pcs.models import converted_gguf, prepare
    cfg = compose([f"model={args.model}"])
    model = prepare(AutoModelForCausalLM.from_pretrained(converted_gguf(cfg.model.gguf, None), dtype=torch.float32))
    split = pool_module.read_spans
    ways = {"split": split, "one_call": lambda *args: None}
    for share in args.share:
        lengths = [n for c in args.contexts for n in [c] + [int(share * c)] * args.compressed]
        pool = pool_of(model, lengths)
        times = {way: [] for way in ways}
        for r in range(args.rounds + 1):            # round 0 warms up
            for way in (ways if r % 2 else reversed(list(ways))):
                pool_module.read_spans = ways[way]
                t = seconds_per_step(model, pool, lengths, args.steps)
                if r:
                    times[way].append(t)
        pool_module.read_spans = split
        row = {"model": args.model, "share": share, "sequences": len(lengths), "contexts": args.contexts,
               "threads": torch.get_num_threads(), "ms_per_step": {w: [round(t * 1e3, 1) for t in ts]
                                                                   for w, ts in times.items()},
               "one_call_over_split": round(statistics.median(times["one_call"]) / statistics.median(times["split"]), 3)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
