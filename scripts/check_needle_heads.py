"""Reproduce part of a ``python -m pcs.needle_heads`` file from first principles, on a few of its samples.

    python scripts/check_needle_heads.py results/embedded/ruler/smollm2/needle_heads_b512.json --samples 2

Only the prompts come from pcs (its RULER builder, so the token ids are the run's). Everything measured is
recomputed here from transformers' eager attention (``output_attentions=True``) and the equations, without
pcs's engine, caches, methods or ``run_prefill``:

- **retrieval mass**: the full cache answers greedily (its prompt the context, then the question where the run
  feeds it after compression, in one forward here); at each fed answer token (at most 16, the stop token not
  fed) the attention each (layer, query head) puts on the needle's positions, averaged over the steps;
- **SnapKV's kept needle share** under the paper profile with attention selection: the last ``window`` queries'
  softmax attention summed over those queries, max-pooled with ``kernel`` over positions, averaged over each KV
  head's query group, the top ``budget - window`` prefix positions (a tie to the earlier one) plus the window;
  the share of the needle's positions kept, per (layer, KV head). The window is the context's last queries:
  with the question after compression it is not in them;
- **the needle's positions**: the tokens whose decoded text overlaps an expected answer, found by a regular
  expression over the decoded prompt; **its key's positions** (files that have them): the tokens overlapping the
  needle sentence before the value ("One of the special magic ... is: "), the value's own left out, and SnapKV's
  kept share of those too.

A hybrid model's sliding-window layers (transformers' ``layer_types``) hold only the model's window: nothing is
measured there, on either side (NaN masses, no kept sets), and a layer measured on one side only fails the check.
A fractional budget keeps ``int(share x n)`` entries of an n-token context, as the config documents.

It prints the largest difference from the file for each quantity and exits non-zero if any exceeds the tolerance.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

TOLERANCE_MASS = 1e-4   # float32 attention through two code paths (eager here, pcs's own softmax there)
MAX_STEPS = 16


def token_spans(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text and each token's (start, end) in it."""
    spans, offset = [], 0
    for token in ids:
        piece = tokenizer.decode([token])
        spans.append((offset, offset + len(piece)))
        offset += len(piece)
    return "".join(tokenizer.decode([t]) for t in ids), spans


def overlapping(spans: list[tuple[int, int]], hits: list[tuple[int, int]]) -> set[int]:
    return {i for i, (a, b) in enumerate(spans) for s, e in hits if a < e and s < b}


def needle_positions(tokenizer, ids: list[int], values: list[str]) -> list[int]:
    text, spans = token_spans(tokenizer, ids)
    return sorted(overlapping(spans, [(m.start(), m.end()) for v in values for m in re.finditer(re.escape(v), text)]))


def key_positions(tokenizer, ids: list[int], values: list[str], value_tokens: list[int]) -> list[int]:
    text, spans = token_spans(tokenizer, ids)
    hits = [(m.start(), m.start(1)) for v in values
            for m in re.finditer(r"One of the special magic \w+ for [^.\n]+? is: (" + re.escape(v) + ")", text)]
    return sorted(overlapping(spans, hits) - set(value_tokens))


def sliding_layers(config) -> list[bool]:
    """Which layers attend through a sliding window (transformers' ``layer_types``; none where a config has none):
    they hold only the model's window, so nothing is chosen there and no mass on an old needle is read."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [kind == "sliding_attention" for kind in types]


def snapkv_kept(attentions, n_kv: int, budget: int, window: int, kernel: int,
                sliding: list[bool]) -> list[list[torch.Tensor] | None]:
    """Per layer, per KV head: the kept positions (SnapKV, paper profile, attention selection); None for a sliding
    layer."""
    kept = []
    for layer_attention, is_sliding in zip(attentions, sliding):   # (1, H_q, n, n)
        if is_sliding:
            kept.append(None)
            continue
        a = layer_attention[0, :, -window:, :-window].sum(1)  # (H_q, n - window)
        pooled = torch.nn.functional.max_pool1d(a[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
        group = pooled.shape[0] // n_kv
        score = pooled.view(n_kv, group, -1).mean(1)         # (H_kv, n - window)
        n_prefix = score.shape[1]
        heads = []
        for s in score:
            # the top (budget - window), a tie going to the earlier position: sort by (-score, position)
            order = sorted(range(n_prefix), key=lambda i: (-float(s[i]), i))[: budget - window]
            heads.append(torch.tensor(sorted(order) + list(range(n_prefix, n_prefix + window))))
        kept.append(heads)
    return kept


def entries(budget, n_tokens: int, window: int) -> int:
    """Entries per KV head as the project's config documents ``budget`` (pcs/budget.py's docstring, the user's
    contract): an integer as it is, a fraction in (0, 1) ``int(share x n)`` for a prompt of n tokens, never fewer
    than the window."""
    return max(int(budget * n_tokens), window) if isinstance(budget, float) else int(budget)


def share_gap(kept: list, wanted: list[int], recorded: list) -> float:
    """The largest difference between the share of ``wanted`` each (layer, KV head) keeps and the file's; a layer
    one side measured and the other did not (sliding: None) is an infinite difference."""
    wanted, gap = torch.tensor(wanted), 0.0
    for heads, theirs in zip(kept, recorded, strict=True):
        if heads is None or theirs is None:
            gap = max(gap, 0.0 if heads is None and theirs is None else float("inf"))
            continue
        share = torch.tensor([float(torch.isin(wanted, h).float().mean()) for h in heads])
        gap = max(gap, float((share - torch.tensor(theirs)).abs().max()))
    return gap


def retrieval_masses(model, ids: list[int], positions: list[int], stops: set[int]) -> torch.Tensor:
    """(L, H_q): mean attention mass on ``positions`` over the fed answer tokens of the greedy full cache (NaN in a
    sliding layer)."""
    sliding = sliding_layers(model.config)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        cache, token, steps = out.past_key_values, int(out.logits[0, -1].argmax()), []
        for _ in range(MAX_STEPS):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                        output_attentions=True)
            cache = out.past_key_values
            steps.append(torch.stack([torch.full((a.shape[1],), float("nan")) if is_sliding
                                      else a[0, :, -1, positions].sum(-1)
                                      for a, is_sliding in zip(out.attentions, sliding)]))
            token = int(out.logits[0, -1].argmax())
            if token in stops:
                break
    return torch.stack(steps).mean(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("analysis", type=Path, help="a pcs.needle_heads JSON file")
    parser.add_argument("--samples", type=int, default=2, help="first samples of each task to check")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pcs.benchmarks.base import build_benchmark
    from pcs.models import load_model, stop_token_ids
    from pcs.run_folder import load_config

    analysis = json.loads(args.analysis.read_text())
    root = args.analysis.parent
    full_cfg = load_config(root / analysis["full_run"])
    snapkv_runs = [r for r in analysis["runs"]
                   if (cfg := load_config(root / r)).method.name == "snapkv" and cfg.selection.name == "attention"
                   and cfg.profile.name == "paper"]
    if not snapkv_runs:
        raise SystemExit("no SnapKV run with attention selection under the paper profile in the file")
    model, tokenizer = load_model(full_cfg.model)
    model.set_attn_implementation("eager")
    stops = stop_token_ids(model, tokenizer, full_cfg.model.stop_tokens)
    n_kv = model.config.num_key_value_heads
    sliding = sliding_layers(model.config)
    benchmark = build_benchmark(full_cfg)
    prompts = {s.id: benchmark.encode(s, tokenizer, full_cfg.model) for s in benchmark.samples(tokenizer)}

    per_task: dict[str, int] = {}
    worst = {"positions": 0, "mass": 0.0, "kept": 0.0, "key": 0.0}
    for row in analysis["samples"]:
        if per_task.get(row["task"], 0) >= args.samples:
            continue
        per_task[row["task"]] = per_task.get(row["task"], 0) + 1
        prompt = prompts[row["id"]]
        ids = prompt.context
        sample = next(s for s in benchmark.samples(tokenizer) if s.id == row["id"])
        positions = needle_positions(tokenizer, ids, list(sample.meta["outputs"]))
        worst["positions"] = max(worst["positions"], int(positions != row["needle_positions"]))
        key = key_positions(tokenizer, ids, list(sample.meta["outputs"]), positions) if "key_positions" in row else None
        if key is not None:
            worst["positions"] = max(worst["positions"], int(key != row["key_positions"]))
        mass = retrieval_masses(model, ids + list(prompt.question or []), positions, stops)
        recorded = torch.tensor(row["retrieval"], dtype=mass.dtype)
        # the same layers unmeasured (sliding), then the largest difference where both measured
        mass_gap = float("inf") if not torch.equal(mass.isnan(), recorded.isnan()) else \
            float((mass - recorded).abs().nan_to_num(0.0).max())
        with torch.inference_mode():
            attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        line = f"{row['id']}: needle {positions[0]}..{positions[-1]}, retrieval mass |diff| {mass_gap:.2e}"
        for run in snapkv_runs:
            cfg = load_config(root / run)
            kept = snapkv_kept(attentions, n_kv, entries(cfg.budget, len(ids), cfg.method.window),
                               cfg.method.window, cfg.method.kernel, sliding)
            kept_gap = share_gap(kept, positions, row["runs"][run]["kept"])
            worst["kept"] = max(worst["kept"], kept_gap)
            line += f"; {cfg.method.name} b{cfg.budget} kept share |diff| {kept_gap:.3f}"
            if key is not None:
                key_gap = share_gap(kept, key, row["runs"][run]["kept_key"])
                worst["key"] = max(worst["key"], key_gap)
                line += f", key {key_gap:.3f}"
        worst["mass"] = max(worst["mass"], mass_gap)
        print(line, flush=True)
    print(f"largest differences: needle positions {worst['positions']} samples differ, retrieval mass "
          f"{worst['mass']:.2e} (tolerance {TOLERANCE_MASS:g}), kept share {worst['kept']:.3f}, key's kept share "
          f"{worst['key']:.3f} (both must be 0)")
    return int(worst["positions"] > 0 or worst["mass"] > TOLERANCE_MASS or worst["kept"] > 0 or worst["key"] > 0)


if __name__ == "__main__":
    sys.exit(main())
