"""What a sweep would cost on the device a bench file was measured on: hours per job (GPU-hours on a GPU's file),
with the decode pool and without it (one answer at a time). Torch-free: it reads a ``pcs.bench`` results file and the benchmark's lengths.

    python -m pcs.bench --project experiment=table1 --bench results/bench/gpu_NVIDIA_H100_80GB_HBM3.jsonl
    python -m pcs.bench --project experiment=table1 --bench results/bench/gpu_NVIDIA_H200.jsonl \
        --decode-bench results/bench/gpu_NVIDIA_H200_decode.jsonl

Per job (a group of runs sharing each sample's prefill, ``pcs.sweep.plan``) and sample of ``n`` prompt tokens:

- prefill: the full cache's measured ``prefill_s`` at ``n`` (interpolated on a log-log line between the bench's
  contexts, extrapolated from the nearest two), plus, per compressed cell, what its compression added at ``n``;
- decoding at each task's answer limit (an upper bound: answers that stop early cost less), for every cell:
  without the pool, the cell's configuration's ms per token at ``n`` (a pool of one where the file has pools,
  else ``decode_ms_per_token``); with a pool of ``P``, every
  sequence pays ``ms_per_step(P) / P`` of the widest configuration in the job (the pool pads every row to the
  longest one in flight: with the full cache in the job, the full cache's).

With ``--decode-bench`` (rows of ``python -m pcs.bench --decode``, whose steps are timed alone and captured in
graphs), decoding is priced from those instead (``DecodeCosts``): one at a time, the batch-1 step of the cell's
configuration (the full cache, or a compressed cache at the cell's budget: entries held, not the method, set a
step's cost, so budgets between two measured ones interpolate linearly); pooled, every sequence pays the mixed
pool's step over its rows (the full cache beside compressed rows, as a shared-prefill job holds them), in the
largest mixed pool timed at every context of the file, so that interpolating between contexts compares steps of
one pool size. Prompts shorter than the file's shortest context are priced at that context (a step's weights
make its floor); no decoding cost is extrapolated below it.

Prompt lengths: the data's own (LongBench rows carry their word count) where ``benchmark.data_dir`` holds it,
otherwise LongBench's published per-task averages (``LONGBENCH_WORDS``), in words, times ``tokens_per_word``.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

from .budget import is_share
from .config import compose, uses
from .identity import RunIdentity
from .paths import read_jsonl
from .sweep import plan

# LongBench v1 task statistics (THUDM/LongBench, README "Task statistics"): average length in words (Python's
# split) and number of samples, for the 16 English and code tasks of the paper's tables.
LONGBENCH_WORDS = {"narrativeqa": (18409, 200), "qasper": (3619, 200), "multifieldqa_en": (4559, 150),
                   "hotpotqa": (9151, 200), "2wikimqa": (4887, 200), "musique": (11214, 200),
                   "gov_report": (8734, 200), "qmsum": (10614, 200), "multi_news": (2113, 200), "trec": (5177, 200),
                   "triviaqa": (8209, 200), "samsum": (6258, 200), "passage_count": (11141, 200),
                   "passage_retrieval_en": (9289, 200), "lcc": (1235, 500), "repobench-p": (4206, 500)}
TOKENS_PER_WORD = 1.3   # English text under Llama-3's tokenizer, roughly; a knob of --project


def sweep_configs(overrides: list[str]) -> list:
    """The run configs a ``-m`` sweep of ``overrides`` would launch (the experiment's sweeper params expanded)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from .config import CONF_DIR
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        params = hydra_compose(config_name="config", overrides=overrides,
                               return_hydra_config=True).hydra.sweeper.params or {}
    axes = [[f"{key}={value}" for value in str(values).split(",")] for key, values in params.items()]
    return [compose(list(overrides) + list(cell)) for cell in itertools.product(*axes)]


RULER_SAMPLES = 500     # per task and length: RULER's count, and what kvpress's dataset holds


def task_lengths(cfg, tokens_per_word: float) -> list[tuple[int, int]]:
    """(prompt tokens, answer limit) per sample of a run: a LongBench run's from the data's word counts where at hand,
    a RULER run's at each length less the task's answer limit (RULER fits prompt and answer within the length)."""
    if cfg.benchmark.name in ("ruler", "ruler_kvpress"):
        return ruler_lengths(cfg)
    from .benchmarks.longbench_data import MAX_NEW_TOKENS
    data_dir = Path(cfg.benchmark.data_dir) if cfg.benchmark.get("data_dir") else None
    out = []
    for task in cfg.benchmark.tasks:
        path = data_dir / f"{task}.jsonl" if data_dir else None
        if path is not None and path.exists():
            words = [row["length"] for row in read_jsonl(path)]
        else:
            average, count = LONGBENCH_WORDS[task]
            words = [average] * count
        if cfg.benchmark.get("limit"):
            words = words[:cfg.benchmark.limit]
        out += [(min(round(w * tokens_per_word), cfg.model.max_length), MAX_NEW_TOKENS[task]) for w in words]
    return out


def ruler_lengths(cfg) -> list[tuple[int, int]]:
    from .benchmarks.ruler_data import TASKS, default_lengths
    bench = cfg.benchmark
    lengths = bench.lengths if bench.lengths is not None else default_lengths(cfg.model.context_window)
    counts = bench.n_samples if bench.n_samples is not None else RULER_SAMPLES
    out = []
    for length in lengths:
        for i, task in enumerate(bench.tasks):
            count = counts if isinstance(counts, int) else counts[i]
            out += [(length - TASKS[task].new_tokens, TASKS[task].new_tokens)] * count
    return out


def interpolate(points: dict[int, float], n: int) -> float:
    """A measured cost at ``n`` tokens from its values at the bench's contexts (log-log, nearest two)."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * n / xs[0]
    i = max(1, min(len(xs) - 1, next((j for j, x in enumerate(xs) if x >= n), len(xs) - 1)))
    x0, x1 = xs[i - 1], xs[i]
    slope = math.log(points[x1] / points[x0]) / math.log(x1 / x0)
    return points[x0] * (n / x0) ** slope


def as_the_engine_runs(timed: list[dict]) -> list[dict]:
    """Of timed ``pcs.bench --decode`` rows, those of the engine's default where the file has them: graph-captured,
    through the decode kernel, compiled (each where some rows are; else the rows without)."""
    for field in ("cuda_graphs", "decode_kernel", "compiled"):
        chosen = any(r.get(field) for r in timed)
        timed = [r for r in timed if bool(r.get(field)) == chosen]
    return timed


class DecodeCosts:
    """Decoding steps from ``pcs.bench --decode`` rows: the graph-captured ones, and of those the decode kernel's
    and the compiled step's where the file has them (what the engine runs by default)."""

    def __init__(self, rows: list[dict]):
        self.rows = as_the_engine_runs([r for r in rows if "ms_per_step" in r and r.get("cuda_graphs")])
        if not any(r["method"] == "full" and r["pool"] == 1 for r in self.rows):
            raise ValueError("--decode-bench: no graph-captured batch-1 full-cache rows (python -m pcs.bench "
                             "--decode on CUDA)")
        models = {(r.get("model"), r.get("layers")) for r in self.rows}
        if len(models) > 1:
            raise ValueError(f"--decode-bench: rows of {len(models)} models or depths; one file prices one")
        self.shortest = min(r["context"] for r in self.rows)

    def at(self, points: dict[int, float], n: int) -> float:
        """A step's cost at ``n`` tokens: interpolated between contexts, at the shortest context below it."""
        return interpolate(points, max(n, self.shortest))

    def alone(self, budget) -> dict[int, float]:
        """ms per token of one sequence by context: the full cache's (``budget`` None), or a compressed cache's at
        ``budget`` (linear in the budget between the nearest two measured, beyond them from the nearest two)."""
        if budget is None:
            return {r["context"]: r["ms_per_step"] for r in self.rows if r["method"] == "full" and r["pool"] == 1}
        out = {}
        for context in sorted({r["context"] for r in self.rows}):
            by_budget: dict[int, list[float]] = {}
            for r in self.rows:
                if r["context"] == context and r["pool"] == 1 and r.get("budget"):
                    by_budget.setdefault(r["budget"], []).append(r["ms_per_step"])
            points = {b: sum(v) / len(v) for b, v in by_budget.items()}     # methods at one budget: their mean
            if len(points) == 1:
                out[context] = next(iter(points.values()))
            elif points:
                xs = sorted(points)
                i = max(1, min(len(xs) - 1, next((j for j, x in enumerate(xs) if x >= budget), len(xs) - 1)))
                x0, x1 = xs[i - 1], xs[i]
                out[context] = points[x0] + (points[x1] - points[x0]) * (budget - x0) / (x1 - x0)
        return out

    def pooled(self) -> tuple[dict[int, float], int | None]:
        """ms per sequence and token by context in the largest mixed pool timed at every context, and its size
        (None, and no costs, where no mixed pool was timed)."""
        mixed = [r for r in self.rows if r["method"] == "mixed"]
        contexts = {r["context"] for r in self.rows}
        common = [p for p in {r["pool"] for r in mixed} if {r["context"] for r in mixed if r["pool"] == p} == contexts]
        if not common:
            return {}, None
        size = max(common)
        return {r["context"]: r["ms_per_step"] / size for r in mixed if r["pool"] == size}, size


class PrefillCosts:
    """A job's prefill at ``n`` tokens: the full cache's once, plus what each compressed cell's compression adds."""

    def __init__(self, costs: Costs, cells: list[tuple]):
        self.full = costs.of("full", "none", None, "prefill_s")
        self.extras = [extra for cell in cells if cell[2] is not None
                       for extra in [costs.of(*cell, "prefill_s")] if extra]

    def seconds(self, n: int) -> float:
        full = interpolate(self.full, n)
        return full + sum(max(0.0, interpolate(extra, n) - full) for extra in self.extras)


class Costs:
    """A bench file's measured costs by configuration (method, selection, budget) and context."""

    def __init__(self, rows: list[dict]):
        self.rows = [r for r in rows if "decode_ms_per_token" in r]

    def of(self, method: str, selection: str, budget, key: str, pool: int | None = None) -> dict[int, float]:
        """By context, ``key`` of the configuration; a share budget takes, per context, the row of the budget nearest
        its entries there (``share x context``)."""
        def value(r):
            return r[key] if pool is None else r.get("pools", {}).get(str(pool), {}).get(key)
        if is_share(budget):
            rows = [r for r in self.rows if r["method"] == method and r["selection"] in (selection, "none")
                    and r["budget"] and value(r) is not None]
            out = {}
            for context in {r["context"] for r in rows}:
                at = [r for r in rows if r["context"] == context]
                out[context] = value(min(at, key=lambda r: abs(r["budget"] - budget * context)))
            return out
        match = [r for r in self.rows if r["method"] == method and (budget is None or
                 (r["selection"] in (selection, "none") and r["budget"] == budget))]
        return {r["context"]: value(r) for r in match if value(r) is not None}

    def pools(self) -> list[int]:
        return sorted({int(p) for r in self.rows for p in r.get("pools", {})})


def project(overrides: list[str], bench_file: str, pool: int | None, tokens_per_word: float = TOKENS_PER_WORD,
            decode_file: str | None = None) -> str:
    """The projection's text: one line per job and totals."""
    costs = Costs(read_jsonl(Path(bench_file)))
    if decode_file:
        return project_with_steps(overrides, costs, bench_file, DecodeCosts(read_jsonl(Path(decode_file))),
                                  decode_file, tokens_per_word)
    cfgs = sweep_configs(overrides)
    groups = plan(cfgs)
    measured_pools = costs.pools()
    if pool is None and measured_pools:
        pool = max(measured_pools)
    elif pool is not None and pool not in measured_pools:
        pool = max([p for p in measured_pools if p <= pool], default=None)
    lines = [f"[pcs] projected hours of `{' '.join(overrides)}` on the device of {bench_file} (decoding at the answer "
             f"limits; {tokens_per_word} tokens per word where lengths are in words)",
             f"| job | model | runs | samples | prefill h | decode h, one at a time | decode h, {f'pool of {pool}' if pool else 'pooled'} | "
             f"total h, one at a time | total h, pooled |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    totals = [0.0] * 4
    for number, group in enumerate(groups):
        runs, cells = job_cells(cfgs, group)
        samples = task_lengths(runs[0], tokens_per_word)
        prefill = PrefillCosts(costs, cells)
        widest = next((c for c in cells if c[2] is None), None) or max(cells, key=lambda c: c[2])
        step = costs.of(*widest, "ms_per_step", pool) if pool else {}
        prefill_s = decode_alone_s = decode_pool_s = 0.0
        for n, limit in samples:
            prefill_s += prefill.seconds(n)
            for cell in cells:
                per_token = (costs.of(*cell, "ms_per_step", 1) or costs.of(*cell, "decode_ms_per_token")
                             or costs.of(*widest, "decode_ms_per_token"))
                decode_alone_s += limit * interpolate(per_token, n) / 1000
                if step:
                    decode_pool_s += limit * interpolate(step, n) / pool / 1000
        hours = [prefill_s / 3600, decode_alone_s / 3600, decode_pool_s / 3600]
        row = hours + [hours[0] + hours[1], hours[0] + hours[2]]
        totals = [t + h for t, h in zip(totals, [hours[0], hours[1], hours[2], 0])]
        pooled = f"{row[2]:.1f}" if step else "not measured"
        lines.append(f"| {number} | {runs[0].model.name} | {len(runs)} | {len(samples)} | {row[0]:.1f} | {row[1]:.1f} | "
                     f"{pooled} | {row[3]:.1f} | {row[4]:.1f} |" if step else
                     f"| {number} | {runs[0].model.name} | {len(runs)} | {len(samples)} | {row[0]:.1f} | {row[1]:.1f} | "
                     f"{pooled} | {row[3]:.1f} | - |")
    lines.append(f"total: prefill {totals[0]:.1f} h, decoding {totals[1]:.1f} h one at a time"
                 + (f", {totals[2]:.1f} h in pools of {pool}" if pool else ", pools not measured in this file"))
    return "\n".join(lines)


def job_cells(cfgs: list, group: list[int]) -> tuple[list, list[tuple]]:
    """A job's distinct runs and their (method, selection, budget) cells, the budget None for a method that reads
    none (the full cache)."""
    runs = list({RunIdentity(cfgs[i]).folder: cfgs[i] for i in group}.values())
    return runs, [(r.method.name, r.selection.name, r.budget if uses("method", r.method.name, "budget") else None)
                  for r in runs]


def project_with_steps(overrides: list[str], costs: Costs, bench_file: str, steps: DecodeCosts, decode_file: str,
                       tokens_per_word: float) -> str:
    """``project`` with decoding priced from ``--decode`` rows (``DecodeCosts``)."""
    cfgs = sweep_configs(overrides)
    per_row, size = steps.pooled()
    lines = [f"[pcs] projected hours of `{' '.join(overrides)}`: prefill from {bench_file}, decoding from "
             f"{decode_file} (at the answer limits; {tokens_per_word} tokens per word where lengths are in words; "
             f"pooled: " + (f"mixed pools of {size}" if size else "no mixed pool in the file") + ")",
             "| job | model | runs | samples | prefill h | decode h, one at a time | decode h, pooled | "
             "total h, one at a time | total h, pooled |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    totals = [0.0] * 3
    for number, group in enumerate(plan(cfgs)):
        runs, cells = job_cells(cfgs, group)
        samples = task_lengths(runs[0], tokens_per_word)
        prefill = PrefillCosts(costs, cells)
        by_entries = {None: steps.alone(None)}     # a step's cost by the entries a head holds (None: full)
        prefill_s = alone_s = pooled_s = 0.0
        for n, limit in samples:
            prefill_s += prefill.seconds(n)
            for cell in cells:
                held = cell[2] if not is_share(cell[2]) else int(cell[2] * n)   # a share: its entries at n
                # a prompt no longer than the budget is kept whole: it decodes as the full cache does
                held = held if held is not None and held < n else None
                if held not in by_entries:
                    by_entries[held] = steps.alone(held)
                alone_s += limit * steps.at(by_entries[held], n) / 1000
                if per_row:
                    pooled_s += limit * steps.at(per_row, n) / 1000
        hours = [prefill_s / 3600, alone_s / 3600, pooled_s / 3600]
        totals = [t + h for t, h in zip(totals, hours)]
        pooled = f"{hours[2]:.1f} | {hours[0] + hours[1]:.1f} | {hours[0] + hours[2]:.1f}" if per_row else \
            f"not measured | {hours[0] + hours[1]:.1f} | -"
        lines.append(f"| {number} | {runs[0].model.name} | {len(runs)} | {len(samples)} | {hours[0]:.1f} | "
                     f"{hours[1]:.1f} | {pooled} |")
    lines.append(f"total: prefill {totals[0]:.1f} h, decoding {totals[1]:.1f} h one at a time"
                 + (f", {totals[2]:.1f} h pooled" if per_row else ", no mixed pool in the decode file"))
    return "\n".join(lines)
