"""One run: validate, resume or start the run folder, run every sample through the benchmark's step,
score, summarise. The only module that joins the stages: config -> model + method -> samples ->
step (generate or measure) -> predictions -> metrics."""
from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from .benchmarks.base import build_benchmark
from .config import ConfigError, validate
from .eviction import build_method
from .generate import RunContext, generate_row
from .identity import RunIdentity
from .models import load_model, stop_token_ids
from .output_perturbation import perturbation_row
from .provenance import now, provenance
from .run_folder import exclusive, is_finished, prepare, read_rows, write_json_atomic
from .tracking import log_run

# A benchmark's ``step`` -> what answers one of its samples (an encoded prompt) on the model.
STEPS = {"generate": generate_row, "output_perturbation": perturbation_row}


def run(cfg: DictConfig) -> dict | None:
    """Run (or resume, or skip) the configured cell; returns its metrics."""
    validate(cfg)
    benchmark = build_benchmark(cfg)
    try:
        benchmark.check()
        variants = benchmark.variants()
    except (ValueError, FileNotFoundError) as err:   # missing data, a malformed line, a bad option
        raise ConfigError(str(err)) from err
    methods = {key: build_method(variant) for key, variant in variants.items()}   # checks their knobs
    identity = RunIdentity(cfg)
    run_dir = Path(cfg.results_dir) / identity.folder
    if is_finished(run_dir):
        return finished(run_dir)
    prepare(run_dir, identity.saved_config)
    with exclusive(run_dir) as mine:
        if not mine:   # e.g. a sweep whose cells differ only in knobs this method ignores
            print(f"[pcs] another job is running {run_dir}; leaving it to that job")
            return None
        if is_finished(run_dir):
            return finished(run_dir)
        return execute(cfg, identity, benchmark, methods, run_dir)


def finished(run_dir: Path) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(f"[pcs] already finished: {run_dir} (score {score_text(metrics['score'])}); nothing to do")
    return metrics


def execute(cfg: DictConfig, identity: RunIdentity, benchmark, methods: dict, run_dir: Path) -> dict:
    """Answer the missing samples of a locked run folder, then its metrics."""
    if not identity.reads_selection and identity.declares("benchmark", "selection"):
        print(f"[pcs] method={cfg.method.name} has its own rule: selection={cfg.selection.name} is not used")
    step = STEPS[benchmark.step]
    started, started_at = time.time(), now()
    model, tokenizer = load_model(cfg.model)
    ctx = RunContext(model, tokenizer, methods, stop_token_ids(model, tokenizer, cfg.model.stop_tokens), cfg)
    samples = benchmark.samples(tokenizer)
    predictions_file = run_dir / "predictions.jsonl"
    rows = read_rows(predictions_file)
    done = {row["id"] for row in rows}
    todo = [s for s in samples if s.id not in done]
    if done:
        print(f"[pcs] resuming {run_dir}: {len(done)} of {len(samples)} samples already done")
    # Rewrite what was read so that a torn last line does not stay in the file.
    with predictions_file.open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        speed = Throughput()
        bar = tqdm(todo, desc=identity.folder, disable=not cfg.progress, unit="sample", dynamic_ncols=True)
        for sample in bar:
            output = step(sample, benchmark.encode(sample, tokenizer, cfg.model), ctx)
            score = benchmark.score({**output, **sample.meta})
            row = {"id": sample.id, "prediction": output.pop("prediction"), "score": score, **output, **sample.meta}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
            rows.append(row)
            bar.set_postfix_str(speed.add(row), refresh=False)

    metrics = benchmark.metrics(rows)
    metrics.update({
        "n_samples": len(rows),
        "kv_cache_bytes": sum(r["kv_cache_bytes"] for r in rows),
        "kv_cache_bytes_full": sum(r["kv_cache_bytes_full"] for r in rows),
        **({"peak_kv_bytes": max(r["peak_kv_bytes"] for r in rows)} if "peak_kv_bytes" in rows[0] else {}),
        **({"max_kv_entries": max(r["max_kv_entries"] for r in rows),
            "n_compressions": sum(r["n_compressions"] for r in rows)} if "max_kv_entries" in rows[0] else {}),
        "wall_time_s": round(time.time() - started, 2),
        **provenance(cfg, model, started_at, benchmark.data_hashes()),
    })
    benchmark.finish(rows, metrics, run_dir)
    write_json_atomic(run_dir / "metrics.json", metrics)
    log_run(cfg, identity.folder, run_dir, metrics)
    print_summary(run_dir, metrics)
    return metrics


class Throughput:
    """Running prefill and decode speeds for the progress bar."""

    def __init__(self):
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_s = self.decode_s = 0.0

    def add(self, row: dict) -> str:
        self.prefill_tokens += row["prompt_tokens"]
        self.decode_tokens += row["new_tokens"]
        self.prefill_s += row["prefill_s"]
        self.decode_s += row["decode_s"]
        return (f"prefill {self.prefill_tokens / max(self.prefill_s, 1e-9):.0f} tok/s, "
                f"decode {self.decode_tokens / max(self.decode_s, 1e-9):.1f} tok/s")


def score_text(score) -> str:
    return "not scored yet" if score is None else f"{score:.2f}"


def print_summary(run_dir: Path, metrics: dict) -> None:
    kept, full = metrics["kv_cache_bytes"], metrics["kv_cache_bytes_full"]
    print(f"\n[pcs] {run_dir}\n"
          f"  score      {score_text(metrics['score'])}  ({metrics['n_samples']} samples)\n"
          f"  KV memory  {kept / 2**20:.1f} MiB kept of {full / 2**20:.1f} MiB full ({100 * kept / full:.1f} %)\n"
          f"  time       {metrics['wall_time_s']:.1f} s")
