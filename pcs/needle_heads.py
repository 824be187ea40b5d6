"""Why a needle goes: which (layer, KV head) each run kept the needle's value tokens in, and which query heads the
full cache reads the needle with when it answers (retrieval heads).

    python -m pcs.needle_heads RUN_DIR [RUN_DIR ...] [--samples 20] --out FILE.json

The runs must share their samples and prefill (one sweep group: the same model and benchmark settings, the
needle tasks of RULER); the group's full-cache run is found beside them. For each of the first ``--samples``
samples of each task and length:

- the needle's value tokens: the context positions whose text overlaps an expected answer (``outputs``), and its
  key tokens: the rest of the needle's sentence ("One of the special magic numbers for <key> is:");
- per run and (layer, KV head): the share of each the run's method keeps, from the prefill a run does
  (``run_prefill``: each method's own kept entries; ``tests/test_perturbation.py`` holds them to the engine's);
- on the full cache, while it decodes its own answer (the question first, when the run feeds it after
  compression): per (layer, query head), the attention mass on those positions, averaged over the answer's
  steps (NaN in sliding-window layers, which hold only the model's window);
- each run's score on the sample, read from its ``predictions.jsonl``, and the full cache's.

The report relates them (``pcs.report.needle_heads``): the retrieval heads are the query heads with the highest
mean mass over the samples the full cache answers right; for each run, the share of the needle kept in those
heads' KV heads on the samples it answers right and on those it loses.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from .benchmarks.ruler_data import NEEDLE
from .cli import command

MAX_STEPS = 16          # answer steps the full cache's attention is recorded over
NEEDLE_START = NEEDLE.split("{")[0]     # how RULER's needle sentence begins: "One of the special magic "


def decoded(tokenizer, ids: list[int]) -> tuple[str, np.ndarray]:
    """The text of ``ids`` token by token, and where each token's piece starts in it (one more: the end)."""
    pieces = [tokenizer.decode([t]) for t in ids]
    return "".join(pieces), np.cumsum([0] + [len(p) for p in pieces])


def occurrences(text: str, value: str):
    at = text.find(value)
    while at >= 0:
        yield at
        at = text.find(value, at + 1)


def value_positions(tokenizer, ids: list[int], values: list[str]) -> list[int]:
    """Positions of the tokens whose decoded text overlaps an occurrence of any of ``values``."""
    text, starts = decoded(tokenizer, ids)
    found = set()
    for value in values:
        for at in occurrences(text, value):
            first = int(np.searchsorted(starts, at, side="right")) - 1
            last = int(np.searchsorted(starts, at + len(value), side="left")) - 1
            found.update(range(first, last + 1))
    return sorted(found)


def key_positions(tokenizer, ids: list[int], values: list[str]) -> list[int]:
    """Positions of the needle sentences' other tokens: from where the sentence of each occurrence of ``values``
    begins (RULER's needle template) up to the value, the value's own tokens left out."""
    text, starts = decoded(tokenizer, ids)
    found = set()
    for value in values:
        for at in occurrences(text, value):
            begin = text.rfind(NEEDLE_START, 0, at)
            if begin >= 0:
                first = int(np.searchsorted(starts, begin, side="right")) - 1
                last = int(np.searchsorted(starts, at, side="right")) - 1    # the token where the value starts
                found.update(range(first, last))
    return sorted(found - set(value_positions(tokenizer, ids, values)))


def kept_share(kept, positions: list[int], n_layers: int) -> list[list[float] | None]:
    """Per layer (None: kept whole), per head of its kept sets, the share of ``positions`` kept."""
    import torch
    wanted = torch.tensor(positions)
    out = []
    for layer in range(n_layers):
        heads = kept[layer]
        out.append(None if heads is None else
                   [float(torch.isin(wanted, h.cpu()).float().mean()) if len(positions) else float("nan") for h in heads])
    return out


def retrieval_mass(model, prefill, positions: list[int], question: list[int] | None, stops: set[int]) -> list[list[float]]:
    """(L, H_q) mean attention mass on ``positions`` over the full cache's answer steps (NaN: sliding layers)."""
    import torch
    from .compression import window_queries
    from .output_perturbation import decode_step, head_perturbation

    device = next(model.parameters()).device
    cache, n = prefill.cache, prefill.n_tokens
    token = prefill.first_token
    if question:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([question], device=device),
                           position_ids=torch.arange(n, n + len(question), device=device)[None],
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        n += len(question)
        token = int(logits[0, -1].argmax())
    wanted = torch.tensor(positions, device=device)
    steps: list[list[torch.Tensor]] = []

    def on_attention(module, hidden_states, position_embeddings):
        layer = cache.layers[module.layer_idx]
        query = window_queries(module, hidden_states, position_embeddings, 1)[:, 0]
        if layer.is_sliding:
            steps[-1].append(torch.full((query.shape[0],), float("nan")))
            return
        keys, values = layer.dense()
        attention = head_perturbation(query, keys, values, module.o_proj.weight, module.head_dim ** -0.5, None)[1]
        steps[-1].append(attention[:, wanted].sum(-1).cpu())

    for step in range(MAX_STEPS):
        steps.append([])
        _, logits = decode_step(model, cache, token, n + step, on_attention)
        token = int(logits.argmax())
        if token in stops:
            break
    return torch.stack([torch.stack(s) for s in steps]).mean(0).tolist()


def analyse(run_dirs: list[Path], n_samples: int) -> dict:
    """The per-sample measurements of a group of runs of one needle benchmark (see the module docstring)."""
    import torch
    from .benchmarks.base import build_benchmark
    from .eviction import build_method
    from .identity import RunIdentity
    from .models import load_model, stop_token_ids
    from .output_perturbation import run_prefill
    from .run_folder import load_config, read_rows

    runs = {Path(r): load_config(r) for r in run_dirs}
    keys = {RunIdentity(cfg).prefill_key for cfg in runs.values()}
    if len(keys) != 1:
        raise ValueError("the runs must share their samples and prefill (one sweep group)")
    full = [r for r, cfg in runs.items() if not RunIdentity(cfg).reads_budget] or full_run_beside(runs)
    compressed = {r: cfg for r, cfg in runs.items() if RunIdentity(cfg).reads_budget}
    full_dir = Path(full[0])
    first = load_config(full_dir)
    model, tokenizer = load_model(first.model)
    stops = stop_token_ids(model, tokenizer, first.model.stop_tokens)
    benchmark = build_benchmark(first)
    scores = {r: {row["id"]: row["score"] for row in read_rows(r / "predictions.jsonl")} for r in [full_dir, *compressed]}
    methods = {str(r): build_method(cfg) for r, cfg in compressed.items()}
    per_task: dict[str, int] = {}
    rows = []
    for sample in benchmark.samples(tokenizer):
        task = sample.meta.get("task", "")
        stratum = sample.meta.get("stratum", task)      # RULER's task x length: every length alike
        if per_task.get(stratum, 0) >= n_samples or not all(sample.id in s for s in scores.values()):
            continue
        per_task[stratum] = per_task.get(stratum, 0) + 1
        prompt = benchmark.encode(sample, tokenizer, first.model)
        positions = value_positions(tokenizer, prompt.context, list(sample.meta["outputs"]))
        key = key_positions(tokenizer, prompt.context, list(sample.meta["outputs"]))
        prefill = run_prefill(model, torch.tensor([prompt.context]), methods)
        n_layers = model.config.num_hidden_layers
        rows.append({
            "id": sample.id, "task": task, "needle_positions": positions, "key_positions": key,
            "full_score": scores[full_dir][sample.id],
            "retrieval": retrieval_mass(model, prefill, positions, prompt.question, stops),
            "runs": {str(r): {"score": scores[r][sample.id], "kept": kept_share(prefill.kept[str(r)], positions, n_layers),
                              "kept_key": kept_share(prefill.kept[str(r)], key, n_layers)}
                     for r in compressed}})
        print(f"[pcs] {sample.id}: needle at {positions[:1]}..{positions[-1:]} ({len(positions)} tokens)", flush=True)
    return {"model": first.model.name, "full_run": str(full_dir), "runs": [str(r) for r in compressed],
            "labels": {str(r): RunIdentity(cfg).leaf for r, cfg in compressed.items()},
            "n_query_heads": model.config.num_attention_heads, "samples": rows}


def full_run_beside(runs: dict) -> list[Path]:
    """The full-cache run of the same samples, in the folder beside the first run."""
    from .identity import RunIdentity
    from .run_folder import load_config
    some = next(iter(runs))
    key = RunIdentity(runs[some]).prefill_key
    for candidate in sorted(Path(some).parent.iterdir()):
        if (candidate / "config.yaml").exists() and (candidate / "predictions.jsonl").exists():
            cfg = load_config(candidate)
            if not RunIdentity(cfg).reads_budget and RunIdentity(cfg).prefill_key == key:
                return [candidate]
    raise FileNotFoundError(f"no full-cache run of the same samples beside {some}")


def main(argv=None) -> int:
    parser = command("pcs.needle_heads", __doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders of one sweep group (a needle task)")
    parser.add_argument("--samples", type=int, default=20, help="first samples of each task and length (default 20)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file written")
    args = parser.parse_args(argv)
    analysis = analyse(args.runs, args.samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(analysis) + "\n")
    print(f"[pcs] wrote {args.out} ({len(analysis['samples'])} samples); python -m pcs.report draws it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
