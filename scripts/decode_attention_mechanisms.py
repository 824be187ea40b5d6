"""Which attention a pooled decoding step should use on CUDA, by measurement: one step's attention over 32 layers
(Llama-3.1-8B shapes: 32 query heads, 8 KV heads, d 128, bfloat16), each layer its own buffers, captured in one CUDA
graph and replayed, for pools shaped as a sweep holds them. Mechanisms:

- ``sdpa_mask``: what the pool does today, one SDPA call over the padded capacity with a boolean mask;
- ``kernel``: pcs.kernels.decode_attention, each (row, KV head) reading its own entries, split among programs;
- ``flex``: FlexAttention (compiled) over the padded capacity with a block mask from the lengths.

Each row: ms per step (32 layers), the bound (the entries' bytes over the copy bandwidth measured here), the
largest difference from the float32 reference on one layer. Prints JSON lines.

    python scripts/decode_attention_mechanisms.py [--flex] > mechanisms.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from pcs.kernels import decode_attention as da

LAYERS, HQ, HKV, D = 32, 32, 8, 128
GROUP = HQ // HKV


def cases(generator: torch.Generator) -> dict[str, list[list[int]]]:
    """Per row, per KV head, the entries held."""
    def adakv(total_per_head: int, rows: int) -> list[list[int]]:     # head-wise budgets: skewed, mean as SnapKV's
        out = []
        for _ in range(rows):
            w = torch.rand(HKV, generator=generator) ** 3 + 0.02
            out.append([max(8, int(x)) for x in (w / w.sum() * total_per_head * HKV).tolist()])
        return out
    compressed = [[160] * HKV] * 4 + adakv(160, 2) + [[1056] * HKV] + adakv(1056, 1)
    return {
        "full 8K, batch 1": [[8192] * HKV],
        "full 32K, batch 1": [[32768] * HKV],
        "b128 (160 held), batch 1": [[160] * HKV],
        "full 8K, pool 8": [[8192] * HKV] * 8,
        "b128 (160 held), pool 64": [[160] * HKV] * 64,
        "adakv b128, pool 64": adakv(160, 64),
        "adakv b1024, pool 64": adakv(1056, 64),
        "mixed 32K: full + 8 compressed": [[32768] * HKV] + compressed,
    }


def bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1000)
    return 2 * a.numel() / best


def timed(step, replays: int = 20) -> float:
    """ms per call of ``step`` (32 layers' attention), captured in a CUDA graph."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(replays):
        graph.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flex", action="store_true", help="also FlexAttention (compiles per case)")
    parser.add_argument("--cases", nargs="*", help="only these cases (names as printed)")
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    per_second = bandwidth()
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "bandwidth_gb_s": per_second / 1e9}), flush=True)
    scale = D ** -0.5
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    for name, lengths in cases(generator).items():
        if args.cases and name not in args.cases:
            continue
        rows = len(lengths)
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda").reshape(-1)
        longest = int(lens.max())
        capacity = -(-(longest + 1) // 256) * 256
        q = [torch.randn(rows, HKV, GROUP, D, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        k = [torch.randn(rows, HKV, capacity, D, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        v = [torch.randn(rows, HKV, capacity, D, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        bound_ms = 1000 * int(lens.sum()) * D * 2 * 2 * LAYERS / per_second
        reference = da.reference(q[0], k[0], v[0], lens, scale).float()
        seen = (torch.arange(capacity, device="cuda") < lens.reshape(rows, HKV, 1, 1)).expand(rows, HKV, 1, capacity)
        mechanisms = {
            "sdpa_mask": lambda i: torch.nn.functional.scaled_dot_product_attention(q[i], k[i], v[i], attn_mask=seen,
                                                                                    scale=scale),
            "kernel": lambda i: da.decode_attention(q[i], k[i], v[i], lens, scale),
        }
        for splits in (16, 64):
            mechanisms[f"kernel {splits} parts"] = (lambda s: lambda i: da.decode_attention(q[i], k[i], v[i], lens,
                                                                                            scale, splits=s))(splits)
        if flex is not None:
            per_row = lens.reshape(rows, HKV)

            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx < per_row[b, h // GROUP]
            block_mask = create_block_mask(mask_mod, rows, HQ, 1, capacity, device="cuda")
            mechanisms["flex"] = lambda i: flex(q[i].reshape(rows, HQ, 1, D), k[i], v[i], block_mask=block_mask,
                                                scale=scale, enable_gqa=True)
        for mechanism, attend in mechanisms.items():
            row = {"case": name, "mechanism": mechanism, "rows": rows, "capacity": capacity,
                   "entries": int(lens.sum()), "bound_ms": bound_ms}
            try:
                out = attend(0).float().reshape(rows, HKV, GROUP, D)
                row["max_diff"] = (out - reference).abs().max().item()
                row["ms"] = timed(lambda: [attend(i) for i in range(LAYERS)])
                row["of_bound"] = row["ms"] / bound_ms
            except Exception as err:       # a mechanism that cannot run this case says why, and the rest go on
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(json.dumps(row), flush=True)
        q = k = v = seen = None      # this case's buffers are freed before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
