"""Runs: resume or start each run folder, run every sample through the benchmark's step (once for a group of runs
that share their prefills), score, summarise. The only module that joins the stages:
config -> model + method -> samples -> step (generate or measure) -> predictions -> metrics.
A run's folder is ``pcs.run_folder.RunFolder``'s, which owns everything on disk: the runner computes the answers
and the metrics and hands them to it."""
from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import ExitStack
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from .benchmarks.base import checked_benchmark
from .cell import RunCell
from .engine import DoesNotFit, open_pool
from .eviction import build_method
from .generate import generate_rows
from .identity import PER_CELL, RunIdentity
from .models import Loaded, load
from .options import EngineOptions
from .output_perturbation import perturbation_row
from .provenance import now, provenance
from .run_folder import SAMPLE, RunFolder, in_shard, score_text
from .tracking import log_run


def each_cell(step):
    """A one-run step applied to every cell of each request in turn (the perturbation analysis has its own
    prefill and no decoding), in the streaming form of ``generate_rows``."""
    def answer(requests, pool, loaded):
        for sample, prompt, cells in requests:
            for index, cell in enumerate(cells):
                yield sample, index, step(sample, prompt, cell, loaded)
    return answer


# A benchmark's ``step`` -> what answers its requests (a sample, its encoded prompt, the cells still to answer
# it) with the group's pool and model, yielding ``(sample, index of the cell in the request, row fields)`` as each
# answer is done.
STEPS = {"generate": generate_rows, "output_perturbation": each_cell(perturbation_row)}


def run(cfg: DictConfig, benchmark=None) -> dict | None:
    """Run (or resume, or skip) the configured cell; returns its metrics. ``benchmark``: the run's benchmark as
    ``checked_benchmark`` gave it, where the caller has checked the config already (``run.py``)."""
    return run_cells([cfg], benchmarks=None if benchmark is None else [benchmark])[0]


def new_cell(cfg: DictConfig, benchmark, shard: tuple[int, int]) -> RunCell:
    """A run of a group, its methods built (each checks its own knobs: still before any model loads)."""
    methods = {key: build_method(variant) for key, variant in benchmark.variants().items()}
    identity = RunIdentity(cfg)
    if not identity.reads_selection and identity.declares("benchmark", "selection"):
        print(f"[pcs] method={cfg.method.name} has its own rule: selection={cfg.selection.name} is not used")
    folder = RunFolder(Path(cfg.results_dir) / identity.folder, shard, identity)
    return RunCell(cfg, identity, benchmark, methods, folder, EngineOptions.from_config(cfg.get("engine")))


def run_cells(cfgs: list[DictConfig], shard: tuple[int, int] = (0, 1), benchmarks: list | None = None,
              checked: bool = False) -> list[dict | None]:
    """Run (or resume, or skip) cells that differ only in what is chosen from a prefill (one
    ``RunIdentity.prefill_key``): the model loads once and each sample is prefilled once for every cell
    that still needs it. Each cell writes its own folder, as a run of its own would. ``shard=(index, count)``:
    only the samples of that shard (``pcs.run_folder``), written in the shard's own folder under its own lock;
    the run's predictions.jsonl and metrics.json are written once every sample of it is done, by whichever job
    finds it so. Returns each cell's metrics (None: another job holds its folder, or other shards are not done).
    The configs are validated here once (``checked_benchmark``: ConfigError before any model loads), unless the
    caller did: ``benchmarks``, the checked benchmarks, or ``checked``, configs validated when a sweep was submitted
    (their benchmarks' data is still checked and loaded here, where the job runs)."""
    if benchmarks is None:     # a benchmark's check also loads what its samples come from: always run it
        benchmarks = [checked_benchmark(cfg, validated=checked) for cfg in cfgs]
    cells = [new_cell(cfg, benchmark, shard) for cfg, benchmark in zip(cfgs, benchmarks)]
    if len({cell.identity.prefill_key for cell in cells}) > 1:
        raise ValueError("cells of one group must differ only in " + ", ".join(PER_CELL))
    for cell in cells:          # every cell's folder, before any is written to
        cell.folder.check()
    results: dict[int, dict | None] = {}
    with ExitStack() as held:
        todo: list[tuple[int, RunCell]] = []
        for i, c in enumerate(cells):
            folder = c.folder
            if folder.path in {t.run_dir for _, t in todo}:   # the same run twice (knobs it does not read)
                results[i] = None
                continue
            if folder.finished:
                results[i] = finished(folder)
                continue
            folder.create()
            if not held.enter_context(folder.claimed()):
                print(f"[pcs] another job is running {folder.out_dir}; leaving it to that job")
                results[i] = None
            elif folder.finished:
                results[i] = finished(folder)
            else:
                todo.append((i, c))
        if todo:
            for _, c in todo:
                held.enter_context(c.folder.working())
            results.update(zip([i for i, _ in todo], execute([c for _, c in todo], shard)))
    return [results[i] for i in range(len(cells))]


def interleaved(samples: list) -> list:
    """The order samples are answered in: one of each stratum (RULER's task and length, LongBench's task) in turn,
    each stratum's in its own order, so that a long run stopped part way holds the first samples of every task
    alike. Each run's predictions are put back in sample order when it is summarised."""
    strata: dict[str, list] = {}
    for sample in samples:
        strata.setdefault(str(sample.meta.get("stratum", sample.meta.get("task", ""))), []).append(sample)
    return [s for turn in itertools.zip_longest(*strata.values()) for s in turn if s is not None]


def finished(folder: RunFolder) -> dict:
    metrics = folder.metrics()
    print(f"[pcs] already finished: {folder.path} (score {score_text(metrics['score'])}); nothing to do")
    return metrics


def execute(cells: list[RunCell], shard: tuple[int, int] = (0, 1)) -> list[dict | None]:
    """Answer the missing samples of a shard of locked run folders that share their samples, then the metrics of
    each run whose every sample is done. Answers are written as they finish (a decode pool finishes them out of
    sample order); each run's predictions are put back in sample order when it is summarised."""
    first = cells[0]
    started, started_at = time.time(), now()
    loaded = load(first.cfg.model)
    samples = first.benchmark.samples(loaded.tokenizer)
    mine = interleaved([sample for i, sample in enumerate(samples) if in_shard(i, *shard)])
    pool = open_pool(loaded.model, first.options)
    with ExitStack() as files:
        asked = {sample.id: sample.fingerprint for sample in mine}
        for cell in cells:
            files.enter_context(cell.folder.answering(len(samples), loaded.weights, asked, own={c.run_dir for c in cells}))
        answer(cells, mine, loaded, pool)
    run = Invocation(started_at, round(time.time() - started, 2), len(cells), shard[1], {
        "pool": pool.size, "cuda_graphs": pool.graphs is not None, "compile_step": pool.compiled,
        "layers_behind": pool.options.layers_behind, "stage2": dataclasses.asdict(pool.options.stage2)})
    return [settle(cell, samples, set(asked), loaded, run) for cell in cells]


def answer(cells: list[RunCell], mine: list, loaded: Loaded, pool) -> None:
    """Every cell's answer to each of ``mine`` it has not answered yet, scored and handed to its folder as it
    lands, with a progress bar of answers."""
    first = cells[0]
    asked: dict[str, list[RunCell]] = {}

    def requests():
        for sample in mine:
            asked[sample.id] = [cell for cell in cells if sample.id not in cell.folder.done]
            if asked[sample.id]:
                prompt = first.benchmark.encode(sample, loaded.tokenizer, first.cfg.model)
                yield sample, prompt, asked[sample.id]

    speed = Throughput(pool)
    name = first.identity.folder if len(cells) == 1 else f"{len(cells)} runs sharing each prefill"
    todo = sum(len({s.id for s in mine} - cell.folder.done) for cell in cells)
    bar = tqdm(total=todo, desc=name, disable=not first.cfg.progress, unit="answer", dynamic_ncols=True)
    try:
        for sample, index, output in STEPS[first.benchmark.step](requests(), pool, loaded):
            cell = asked[sample.id][index]
            scored = cell.benchmark.scored({**output, **sample.meta})
            row = {"id": sample.id, SAMPLE: sample.fingerprint, "prediction": scored.pop("prediction"),
                   "score": scored.pop("score"), **scored}
            cell.folder.append(row)
            bar.update(1)
            bar.set_postfix_str(speed.add(row), refresh=False)
    except DoesNotFit as err:
        raise SampleDoesNotFit(advice(err, first, pool)) from err
    finally:
        bar.close()


@dataclasses.dataclass
class Invocation:
    """What this job's metrics record of how it ran: when it started, its wall time over the whole group, the
    group's size, the shard count and how the pool decoded (execution: not part of any run's identity)."""
    started_at: str
    wall_time_s: float
    group_size: int
    shards: int
    engine: dict


def settle(cell: RunCell, samples: list, own: set[str], loaded: Loaded, run: Invocation) -> dict | None:
    """The run's metrics, computed and written once every sample of it is answered (its folder merges its shards'
    rows under the run's lock meanwhile); None while other shards' samples are missing."""
    with cell.folder.merge({sample.id for sample in samples}, own) as rows:
        if rows is not None:
            order = {sample.id: i for i, sample in enumerate(samples)}
            rows = sorted(rows, key=lambda row: order.get(row["id"], len(order)))
            metrics = summarize(cell, rows, loaded, run)
            cell.benchmark.finish(rows, metrics, cell.run_dir)
            log_run(cell.cfg, cell.identity.folder, cell.run_dir, cell.folder.finish(rows, metrics))
    return cell.folder.metrics() if cell.folder.finished else None


class SampleDoesNotFit(RuntimeError):
    """A sample that ran out of device memory alone; the message says what would make it fit."""


def advice(err: DoesNotFit, cell: RunCell, pool) -> str:
    """What to change when a sample does not fit in device memory with nothing else in flight."""
    knob = cell.benchmark.prompt_length_knob
    fixes = ([f"shorter prompts ({knob}, now {OmegaConf.select(cell.cfg, knob)})"] if knob else []) + [
        f"model.device_map=auto, the model's layers spread over every visible GPU (now "
        f"{cell.cfg.model.get('device_map')})", "a device with more memory"]
    return (f"sample {err.name} ({err.tokens:,} prompt tokens) does not fit in {err.device} memory (out of memory "
            f"{err.stage}). Every answer finished before it is saved, and a rerun resumes from them. It was tried "
            f"alone (engine.pool={pool.size} had gone down to {pool.limit} in flight and its buffers were freed), so "
            f"a smaller pool will not make it fit; what would: " + "; ".join(fixes) + ".")


def summarize(cell: RunCell, rows: list[dict], loaded: Loaded, run: Invocation) -> dict:
    """A finished run's metrics: its benchmark's over its rows in sample order, with what it cost and how it ran."""
    engine = {**run.engine, "stop_when_scored": cell.options.stop_when_scored}
    metrics = cell.benchmark.metrics(rows)
    metrics.update({
        "n_samples": len(rows),
        "kv_cache_bytes": sum(r["kv_cache_bytes"] for r in rows),
        "kv_cache_bytes_full": sum(r["kv_cache_bytes_full"] for r in rows),
        **({"peak_kv_bytes": max(r["peak_kv_bytes"] for r in rows)} if "peak_kv_bytes" in rows[0] else {}),
        **({"max_kv_entries": max(r["max_kv_entries"] for r in rows),
            "n_compressions": sum(r["n_compressions"] for r in rows)} if "max_kv_entries" in rows[0] else {}),
        "wall_time_s": run.wall_time_s,             # of the whole group, in this invocation
        "n_resumed": len(cell.folder.done),         # samples answered by earlier invocations (not in wall_time_s)
        "group_size": run.group_size,               # runs that shared the model and each sample's prefill
        "engine": engine,                           # how answers decoded (execution: not part of the run's identity)
        "shards": run.shards,                       # jobs the samples were split over (this invocation's count)
        **provenance(cell.cfg, loaded.model, run.started_at, cell.benchmark.data_hashes(), loaded.weights),
    })
    return metrics


class Throughput:
    """The progress bar's figures: sequences in flight, prefill and decode speeds."""

    def __init__(self, pool):
        self.pool = pool
        self.prefill_tokens = 0
        self.prefill_s = 0.0

    def add(self, row: dict) -> str:
        self.prefill_tokens += row["prompt_tokens"]
        self.prefill_s += row["prefill_s"]
        pool = self.pool
        return (f"{len(pool.sequences)} in flight, prefill {self.prefill_tokens / max(self.prefill_s, 1e-9):.0f} tok/s, "
                f"decode {pool.tokens / max(pool.busy_s, 1e-9):.1f} tok/s")
