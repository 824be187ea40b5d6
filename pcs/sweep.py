"""How a sweep becomes jobs: runs that differ only in what is chosen from a prefill (``RunIdentity.prefill_key``:
method, selection, profile, budget, decoding-time compression) form one group, run as one job that loads the
model once and prefills each sample once for all of them. Torch-free: a SLURM submitter plans without it."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from .validation import validate
from .errors import ConfigError
from .identity import PER_CELL, RunIdentity


def plan(cfgs: list[DictConfig]) -> list[list[int]]:
    """Indices of ``cfgs`` grouped by prefill key, groups and members in sweep order. Every config is
    validated first, so a bad cell stops the sweep before anything runs or is submitted."""
    for cfg in cfgs:
        validate(cfg)
    one_model_per_path(cfgs)
    groups: dict[str, list[int]] = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault(RunIdentity(cfg).prefill_key, []).append(i)
    return list(groups.values())


def describe(cfgs: list[DictConfig], groups: list[list[int]], launcher: str, shards: int = 1) -> str:
    """The jobs a sweep launches, one line per group (its jobs: one per shard) and one per run folder in it
    (sweep cells that are the same run, e.g. the full cache at every budget, are one folder, run once)."""
    folders = [[RunIdentity(cfgs[i]).folder for i in group] for group in groups]
    n_runs = sum(len(set(f)) for f in folders)
    sharded = f" x {shards} shards" if shards > 1 else ""
    lines = [f"[pcs] {len(cfgs)} sweep cells, {n_runs} runs, in {len(groups) * shards} {launcher} job(s) "
             f"({len(groups)} group(s){sharded}); runs that differ only in {', '.join(PER_CELL)} share a job "
             f"and each sample's prefill" + (f"; shard k of a group answers samples k, k + {shards}, ..." if shards > 1
                                              else "") + ":"]
    for number, (group, names) in enumerate(zip(groups, folders)):
        first = cfgs[group[0]]
        unique = list(dict.fromkeys(names))
        jobs = (f"jobs {number * shards}-{number * shards + shards - 1} (shards 0-{shards - 1})" if shards > 1
                else f"job {number}")
        lines.append(f"  {jobs}: model={first.model.name} benchmark={first.benchmark.name}{job_samples([cfgs[i] for i in group])}, "
                     f"{len(unique)} run(s)")
        lines += [f"    {name}" for name in unique]
    return "\n".join(lines)


def job_samples(cfgs: list[DictConfig]) -> str:
    """What a job's runs answer, where its benchmark says: `` (13 tasks at 4096 tokens, question after compression;
    budgets 0.75, 0.5)``."""
    bench, identity = cfgs[0].benchmark, RunIdentity(cfgs[0])
    tasks = f"{len(bench.tasks)} task{'s' if len(bench.tasks) > 1 else ''}" if bench.get("tasks") else ""
    lengths = f"{', '.join(map(str, bench.lengths))} tokens" if bench.get("lengths") else ""
    what = [" at ".join(filter(None, [tasks, lengths]))] if tasks or lengths else []
    what += [identity.protocol] if identity.protocol else []
    budgets = list(dict.fromkeys(c.budget for c in cfgs if RunIdentity(c).reads_budget))
    out = ", ".join(what) + (f"; budgets {', '.join(f'{b:g}' for b in budgets)}" if budgets else "")
    return f" ({out})" if out else ""


def one_model_per_path(cfgs: list[DictConfig]) -> None:
    """A ``model.path`` given to a sweep over several models would load the same weights under each model's name:
    refused, naming the models (narrow the sweep with ``model=``, one sweep per model and path)."""
    names: dict[str, set[str]] = {}
    for cfg in cfgs:
        if cfg.model.get("path"):
            names.setdefault(str(cfg.model.path), set()).add(cfg.model.name)
    for path, models in names.items():
        if len(models) > 1:
            first = sorted(models)[0]
            raise ConfigError(f"model.path={path} would load one set of weights as model={', model='.join(sorted(models))}; "
                              f"sweep one model per path: add model={first} (and run the others with their own "
                              f"model.path)")


def check(cfg: DictConfig) -> None:
    """One cell as its job will check it before loading anything: its benchmark's knobs and data
    (``checked_benchmark``; the config itself was validated by ``plan``) and its run folder (another run's config,
    a corrupted line: ``RunFolder.check``). Torch-free."""
    from .benchmarks.base import checked_benchmark
    from .run_folder import RunFolder
    checked_benchmark(cfg, validated=True)
    identity = RunIdentity(cfg)
    RunFolder(Path(cfg.results_dir) / identity.folder, identity=identity).check()


def left_unfinished(cfg: DictConfig) -> str | None:
    """After every job of a sweep has ended without an error: why the cell's run is still not finished, where it
    is not and no job works in it (a shard's rows changed after its job ended, so no job saw every sample done).
    None where it is finished or another job holds it."""
    from .run_folder import is_finished, left_alone
    run_dir = Path(cfg.results_dir) / RunIdentity(cfg).folder
    if is_finished(run_dir):
        return None
    with left_alone(run_dir) as idle:
        if not idle:
            return None
    return (f"{run_dir}: every job ended, yet some samples have no answer on disk (a shard's file changed after its "
            f"job ended); resubmit the sweep: those samples are answered again")
