"""Runs: resume or start each run folder, run every sample through the benchmark's step (once for a group of runs
that share their prefills), score, summarise. The only module that joins the stages:
config -> model + method -> samples -> step (generate or measure) -> predictions -> metrics.
A run's folder is ``pcs.run_folder.RunFolder``'s: the runner streams rows into it and asks it to merge."""
from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from .benchmarks.base import build_benchmark, checked_benchmark
from .engine import DoesNotFit, open_pool
from .eviction import build_method
from .generate import RunContext, generate_rows
from .identity import PER_CELL, RunIdentity
from .models import load_model, stop_token_ids, weights_location
from .options import EngineOptions
from .output_perturbation import perturbation_row
from .provenance import now, provenance
from .run_folder import (RunFolder, all_rows, answers_taken, in_shard, is_finished, left_alone,
                         same_but_for_the_samples, sample_choice, saved_config, weights_used)
from .tracking import log_run
from .weights import fingerprint


def each_cell(step):
    """A one-run step applied to every cell of each request in turn (the perturbation analysis has its own
    prefill and no decoding), in the streaming form of ``generate_rows``."""
    def answer(requests, pool):
        for sample, prompt, cells in requests:
            for index, cell in enumerate(cells):
                yield sample, index, step(sample, prompt, cell)
    return answer


# A benchmark's ``step`` -> what answers its requests (a sample, its encoded prompt, the cells still to answer
# it), yielding ``(sample, index of the cell in the request, row fields)`` as each answer is done.
STEPS = {"generate": generate_rows, "output_perturbation": each_cell(perturbation_row)}


@dataclass
class Cell:
    """One run of a group: its config, identity, benchmark, methods and its folder."""
    cfg: DictConfig
    identity: RunIdentity
    benchmark: object
    methods: dict
    folder: RunFolder
    context: RunContext | None = None

    @property
    def run_dir(self) -> Path:
        return self.folder.path


def run(cfg: DictConfig, benchmark=None) -> dict | None:
    """Run (or resume, or skip) the configured cell; returns its metrics. ``benchmark``: the run's benchmark as
    ``checked_benchmark`` gave it, where the caller has checked the config already (``run.py``)."""
    return run_cells([cfg], benchmarks=None if benchmark is None else [benchmark])[0]


def new_cell(cfg: DictConfig, benchmark, shard: tuple[int, int]) -> Cell:
    """A run of a group, its methods built (each checks its own knobs: still before any model loads)."""
    methods = {key: build_method(variant) for key, variant in benchmark.variants().items()}
    identity = RunIdentity(cfg)
    return Cell(cfg, identity, benchmark, methods, RunFolder(Path(cfg.results_dir) / identity.folder, shard))


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
        cell.folder.check(cell.identity.saved_config)
    results: dict[int, dict | None] = {}
    with ExitStack() as held:
        todo: list[tuple[int, Cell]] = []
        for i, c in enumerate(cells):
            folder = c.folder
            if folder.path in {t.run_dir for _, t in todo}:   # the same run twice (knobs it does not read)
                results[i] = None
                continue
            if folder.finished:
                results[i] = finished(folder)
                continue
            folder.create(c.identity.saved_config)
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


def execute(cells: list[Cell], shard: tuple[int, int] = (0, 1)) -> list[dict | None]:
    """Answer the missing samples of a shard of locked run folders that share their samples, then the metrics of
    each run whose every sample is done. Answers are written as they finish (a decode pool finishes them out of
    sample order); each run's predictions are put back in sample order when it is summarised."""
    for cell in cells:
        if not cell.identity.reads_selection and cell.identity.declares("benchmark", "selection"):
            print(f"[pcs] method={cell.cfg.method.name} has its own rule: selection={cell.cfg.selection.name} "
                  f"is not used")
    first = cells[0]
    step = STEPS[first.benchmark.step]
    started, started_at = time.time(), now()
    options = EngineOptions.from_config(first.cfg.get("engine"))
    model, tokenizer = load_model(first.cfg.model)
    weights = fingerprint(weights_location(first.cfg.model))
    stops = stop_token_ids(model, tokenizer, first.cfg.model.stop_tokens)
    samples = first.benchmark.samples(tokenizer)
    mine = interleaved([sample for i, sample in enumerate(samples) if in_shard(i, *shard)])
    pool = open_pool(model, options)
    asked: dict[str, list[Cell]] = {}

    def requests():
        for sample in mine:
            asked[sample.id] = [cell for cell in cells if sample.id not in cell.folder.done]
            if asked[sample.id]:
                prompt = first.benchmark.encode(sample, tokenizer, first.cfg.model)
                yield sample, prompt, [cell.context for cell in asked[sample.id]]

    with ExitStack() as files:
        for cell in cells:
            cell.context = RunContext(model, tokenizer, cell.methods, stops, cell.cfg, cell.benchmark)
            cell.folder.note_samples(len(samples))
            cell.folder.note_weights(weights)
            grow(cell, samples, tokenizer, weights, shard, own={c.run_dir for c in cells})
            files.enter_context(cell.folder.appending(len(samples)))
        speed = Throughput(pool)
        name = first.identity.folder if len(cells) == 1 else f"{len(cells)} runs sharing each prefill"
        todo = sum(len({s.id for s in mine} - cell.folder.done) for cell in cells)
        bar = tqdm(total=todo, desc=name, disable=not first.cfg.progress, unit="answer", dynamic_ncols=True)
        try:
            for sample, index, output in step(requests(), pool):
                cell = asked[sample.id][index]
                scored = cell.benchmark.scored({**output, **sample.meta})
                row = {"id": sample.id, "prediction": scored.pop("prediction"), "score": scored.pop("score"),
                       **scored}
                cell.folder.append(row)
                bar.update(1)
                bar.set_postfix_str(speed.add(row), refresh=False)
        except DoesNotFit as err:
            raise SampleDoesNotFit(advice(err, first, pool)) from err
        finally:
            bar.close()
    wall_time_s = round(time.time() - started, 2)
    order = {sample.id: i for i, sample in enumerate(samples)}
    engine_used = {"pool": pool.size, "cuda_graphs": pool.graphs is not None, "compile_step": pool.compiled,
                   "layers_behind": pool.options.layers_behind, "stage2": dataclasses.asdict(pool.options.stage2)}

    def used_by(c: Cell) -> dict:     # the pool is the group's; when answers stop, each cell's own config says
        return {**engine_used, "stop_when_scored": EngineOptions.from_config(c.cfg.get("engine")).stop_when_scored}
    ids = {sample.id for sample in samples}
    own = {sample.id for sample in mine}
    return [cell.folder.merge(ids, lambda _, c=cell: summarize(c, model, weights, started_at, wall_time_s, len(cells),
                                                                 order, used_by(c), shard[1]), own)
            for cell in cells]


class SampleDoesNotFit(RuntimeError):
    """A sample that ran out of device memory alone; the message says what would make it fit."""


def advice(err: DoesNotFit, cell: Cell, pool) -> str:
    """What to change when a sample does not fit in device memory with nothing else in flight."""
    knob = cell.benchmark.prompt_length_knob
    fixes = ([f"shorter prompts ({knob}, now {OmegaConf.select(cell.cfg, knob)})"] if knob else []) + [
        f"model.device_map=auto, the model's layers spread over every visible GPU (now "
        f"{cell.cfg.model.get('device_map')})", "a device with more memory"]
    return (f"sample {err.name} ({err.tokens:,} prompt tokens) does not fit in {err.device} memory (out of memory "
            f"{err.stage}). Every answer finished before it is saved, and a rerun resumes from them. It was tried "
            f"alone (engine.pool={pool.size} had gone down to {pool.limit} in flight and its buffers were freed), so "
            f"a smaller pool will not make it fit; what would: " + "; ".join(fixes) + ".")


def grow(cell: Cell, samples: list, tokenizer, weights: dict, shard: tuple[int, int] = (0, 1),
         own: set[Path] = frozenset()) -> None:
    """A new run that is a run beside it but for which samples it holds (``benchmark.n_samples``,
    ``benchmark.tasks``) starts from that run's answers to the samples both have, so that more samples, or a
    narrower set of tasks, cost only the samples not answered yet. The other run may be finished or stopped part
    way, not worked in by a job (its rows would not be settled), nor one of this job's own runs (``own``, whose
    locks this process holds). A sample counts as the same only if the other run's benchmark builds it equal in
    every field (prompt, question, references), since a generator may draw another count's samples differently.
    Its rows then are what this run would write: the same config and sample, answered one at a time or in a pool
    alike. A shard takes the answers to its own share, into its own file, while none of its share is answered. A
    run answered by other weights (``weights``: this job's) gives none."""
    mine = {sample.id: sample for i, sample in enumerate(samples) if in_shard(i, *shard)}
    if any(row["id"] in mine for row in all_rows(cell.run_dir)):
        return
    for other in same_but_for_the_samples(cell.run_dir, cell.identity.saved_data()):
        if other in own or set(weights_used(other)) - {weights.get("id")}:
            continue
        with left_alone(other) as idle:
            if not (idle or is_finished(other)):
                continue
            choice = sample_choice(OmegaConf.to_container(saved_config(other), resolve=True))
            theirs = build_benchmark(OmegaConf.merge(cell.cfg, {"benchmark": choice})).samples(tokenizer)
            same = {sample.id for sample in theirs if mine.get(sample.id) == sample}
            rows = [row for row in all_rows(other) if row["id"] in same]
        if rows:
            cell.folder.take_answers(rows, other)
            knobs = " ".join(f"{k}={v}" for k, v in choice.items())
            print(f"[pcs] {cell.folder.out_dir}: {len(rows)} of {len(mine)} samples answered by {other.name} (the same "
                  f"run on {knobs}); the rest is new")
            return


def summarize(cell: Cell, model, weights: dict, started_at: str, wall_time_s: float, group_size: int, order: dict,
              engine: dict, shards: int = 1) -> dict:
    """A finished cell's predictions in sample order, its metrics.json (written last), its per-run outputs, its
    tracker entry."""
    rows = sorted(cell.folder.rows, key=lambda row: order.get(row["id"], len(order)))
    cell.folder.write_predictions(rows)
    metrics = cell.benchmark.metrics(rows)
    metrics.update({
        "n_samples": len(rows),
        "kv_cache_bytes": sum(r["kv_cache_bytes"] for r in rows),
        "kv_cache_bytes_full": sum(r["kv_cache_bytes_full"] for r in rows),
        **({"peak_kv_bytes": max(r["peak_kv_bytes"] for r in rows)} if "peak_kv_bytes" in rows[0] else {}),
        **({"max_kv_entries": max(r["max_kv_entries"] for r in rows),
            "n_compressions": sum(r["n_compressions"] for r in rows)} if "max_kv_entries" in rows[0] else {}),
        "wall_time_s": wall_time_s,                 # of the whole group, in this invocation
        "n_resumed": len(cell.folder.done),                # samples answered by earlier invocations (not in wall_time_s)
        "group_size": group_size,                   # runs that shared the model and each sample's prefill
        "engine": engine,                           # how answers decoded (execution: not part of the run's identity)
        "shards": shards,                           # jobs the samples were split over (this invocation's count)
        **({"answers_from": taken} if (taken := answers_taken(cell.run_dir)) else {}),   # ``grow``'s source
        **provenance(cell.cfg, model, started_at, cell.benchmark.data_hashes(), weights),
    })
    cell.benchmark.finish(rows, metrics, cell.run_dir)
    cell.folder.write_metrics(metrics)
    log_run(cell.cfg, cell.identity.folder, cell.run_dir, metrics)
    print_summary(cell.run_dir, metrics)
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


def score_text(score) -> str:
    return "not scored yet" if score is None else f"{score:.2f}"


def print_summary(run_dir: Path, metrics: dict) -> None:
    kept, full = metrics["kv_cache_bytes"], metrics["kv_cache_bytes_full"]
    print(f"\n[pcs] {run_dir}\n"
          f"  score      {score_text(metrics['score'])}  ({metrics['n_samples']} samples)\n"
          f"  KV memory  {kept / 2**20:.1f} MiB kept of {full / 2**20:.1f} MiB full ({100 * kept / full:.1f} %)\n"
          f"  time       {metrics['wall_time_s']:.1f} s")
