"""How fast the norms kernel (``pcs.kernels.value_norms``) runs under other block shapes, on a CUDA machine.

On an H200 (2026-11-26, ninth session, results/bench/value_norm_blocks_NVIDIA_H200.jsonl) the kernel's configuration
of then (64 x 128, 4 warps, 3 stages) ran at 392 TFLOP/s on 8,192 entries, and 128 x 64 with 8 warps at 552: the
module's configuration since. This times each configuration of a small grid (entries per program, ``W^O_h``
columns per step, warps, pipeline stages) on one layer's shapes: 8 KV heads of 4 query heads, d = 128, hidden
4,096, every entry of an 8K and of a 2K layer
(the bounded stage 2's typical round), and the batched products' path for reference. Each row: median milliseconds
of 20 launches after 3, TFLOP/s (2 d hidden multiply-adds per entry and query head), and the largest relative
distance from the float64 norms. The kernel keeps one configuration whatever the call (an entry's bits may depend on
it): a faster one found here replaces the module's constants, then the GPU tests run again.

    python scripts/value_norm_blocks.py [--out results/bench/value_norm_blocks_<device>.jsonl]
"""
import argparse
import itertools
import json
import re
import statistics

import torch

from pcs.eviction.scores import group_weights, projected_value_norms
from pcs.kernels import value_norms as kernel

ROWS, GROUP, D, HIDDEN = 8, 4, 128, 4096


def timed(run, repeats: int = 20) -> float:
    """Median milliseconds of ``run()`` over ``repeats`` launches (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_kernel(values, weights, block_m: int, block_n: int, warps: int, stages: int) -> torch.Tensor:
    """The kernel under one configuration, every entry of every row."""
    r, c, _ = values.shape
    out = torch.empty(r, GROUP, c, dtype=torch.float32, device=values.device)
    sizes = torch.full((r,), c, dtype=torch.long, device=values.device)
    kernel.launch(values, weights, GROUP, sizes, out, block_m, block_n, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON lines file (default: results/bench/value_norm_blocks_<device>.jsonl)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a CUDA machine's script"
    name = torch.cuda.get_device_name(0)
    out = args.out or f"results/bench/value_norm_blocks_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}.jsonl"
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(HIDDEN, ROWS * GROUP * D, generator=g, device="cuda", dtype=torch.bfloat16) / 64
    weights = group_weights(weight, ROWS, D)
    rows = []
    for entries in (8192, 2048):
        values = torch.randn(ROWS, entries, D, generator=g, device="cuda", dtype=torch.bfloat16)
        exact = (values.double() @ weights.double()).view(ROWS, entries, GROUP, -1).abs().sum(-1).transpose(1, 2)
        flop = 2 * ROWS * GROUP * entries * D * HIDDEN

        def row(config: dict, run) -> None:
            got = run()
            error = ((got.double() - exact).abs() / exact).max().item()
            ms = timed(run)
            rows.append({"device_name": name, "entries": entries, **config, "ms": round(ms, 4),
                         "tflops": round(flop / ms / 1e9, 1), "max_relative_error": error})
            print(json.dumps(rows[-1]), flush=True)
        row({"path": "batched products", "tile": 1024},
            lambda: projected_value_norms(values, weights, GROUP, 1024, one_reduction=True))
        for block_m, block_n, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)):
            current = (kernel.BLOCK_ENTRIES, kernel.BLOCK_OUTPUTS, kernel.NUM_WARPS, kernel.NUM_STAGES)
            config = {"path": "kernel", "block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages,
                      "current": (block_m, block_n, warps, stages) == current}
            try:
                row(config, lambda: run_kernel(values, weights, block_m, block_n, warps, stages))
            except Exception as err:          # a configuration out of the card's shared memory or registers
                print(json.dumps({**config, "entries": entries, "error": repr(err)[:200]}), flush=True)
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    best = {e: min((r for r in rows if r["entries"] == e), key=lambda r: r["ms"]) for e in (8192, 2048)}
    for e, r in best.items():
        print(f"fastest at {e} entries: {r}")


if __name__ == "__main__":
    main()
