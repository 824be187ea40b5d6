"""One run: validate, resume or start the run folder, generate sample by sample, score, summarise.

Run folder (DESIGN.md): ``config.yaml`` (resolved), ``predictions.jsonl`` (one flushed line per
finished sample), ``metrics.json`` (written atomically, last: its presence means the run finished).
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from .benchmarks import RunContext, build_benchmark
from .config import ConfigError, run_name, saved_config, validate
from .eviction import build_method
from .models import load_model, stop_token_ids
from .provenance import now, provenance
from .tracking import log_run


def read_rows(path: Path) -> list[dict]:
    """Finished predictions; a torn last line (the process died mid-write) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def prepare_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Create the folder with its config, or check that an existing one holds the same config."""
    wanted = saved_config(cfg)
    config_file = run_dir / "config.yaml"
    if config_file.exists():
        if config_file.read_text() != wanted:
            raise RuntimeError(f"{run_dir} holds a run with a different config; "
                               f"remove it or choose another results_dir")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file.write_text(wanted)


def run(cfg: DictConfig) -> dict:
    """Run (or resume, or skip) the configured cell; returns its metrics."""
    validate(cfg)
    benchmark = build_benchmark(cfg)
    try:
        benchmark.check()
    except (ValueError, FileNotFoundError) as err:   # missing data, a malformed line, a bad option
        raise ConfigError(str(err)) from err
    run_dir = Path(cfg.results_dir) / run_name(cfg)
    if (run_dir / "metrics.json").exists():
        return finished(run_dir)
    prepare_run_dir(cfg, run_dir)
    with exclusive(run_dir) as mine:
        if not mine:   # e.g. a sweep whose cells differ only in knobs this method ignores
            print(f"[pcs] another job is running {run_dir}; leaving it to that job")
            return None
        if (run_dir / "metrics.json").exists():
            return finished(run_dir)
        return execute(cfg, benchmark, run_dir)


def finished(run_dir: Path) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(f"[pcs] already finished: {run_dir} (score {score_text(metrics['score'])}); nothing to do")
    return metrics


@contextmanager
def exclusive(run_dir: Path):
    """Yields whether this process holds the run folder's lock (a POSIX lock, so it also works
    between cluster nodes sharing the folder over NFS); the lock goes when the process ends."""
    handle = open(run_dir / ".lock", "w")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        yield False
        return
    try:
        yield True
    finally:
        fcntl.lockf(handle, fcntl.LOCK_UN)
        handle.close()


def execute(cfg: DictConfig, benchmark, run_dir: Path) -> dict:
    """Generate the missing samples of a locked run folder, then its metrics."""
    method = build_method(cfg)
    if not method.uses_selection:
        print(f"[pcs] method={cfg.method.name} has its own rule: selection={cfg.selection.name} is not used")

    started, started_at = time.time(), now()
    model, tokenizer = load_model(cfg.model)
    stops = stop_token_ids(model, tokenizer, cfg.model.stop_tokens)
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
        ctx = RunContext(model, tokenizer, method, stops, cfg)
        bar = tqdm(todo, desc=run_name(cfg), disable=not cfg.progress, unit="sample", dynamic_ncols=True)
        for sample in bar:
            row = {"id": sample.id, **benchmark.run_sample(sample, ctx), **sample.meta}
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
    log_run(cfg, run_name(cfg), run_dir, metrics)
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
