"""``python -m pcs.status [FOLDER] [--only finished|unfinished|running|failed]``: every run under a folder (a
results folder, any folder inside it, or one run's), how far it is, its score once finished, and what its jobs
are doing; then a summary of the runs shown (finished, running, failed; samples done) and of their protocols (where the
questions come: inside the compressed prompt, after it, with follow-ups; ``RunIdentity.protocol``). Torch-free: it reads the
run folders only (``pcs.run_folder``).

Per run: samples done of its total (its own rows and every shard's, counted once), finished or not, the jobs
working in it now (the run's own, or ``shard k/N``; a job whose process is gone, on this host, or whose SLURM job
is no longer running, as squeue says, is reported as stopped), and the last error of a job that failed (or ``interrupted``: stopped from outside, by a preemption, a
time limit or Ctrl-C; a requeued job or a rerun goes on).
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from omegaconf.errors import OmegaConfBaseException

from .identity import RunIdentity
from .run_folder import (ERROR, INTERRUPTED, RUNNING, SAMPLES, SHARDS, CorruptRows, all_rows, is_finished,
                         saved_config)
from .slurm_queue import RUNNING_STATES, queue_states
from .cli import command


def job_state(folder: Path) -> str | None:
    """'running on host:pid', 'stopped (...)' for a job that is gone (a process of this host, or a SLURM job
    that SLURM says is not running), or None. A job killed outright leaves its running.json behind."""
    marker = folder / RUNNING
    if not marker.exists():
        return None
    job = json.loads(marker.read_text())
    states = queue_states([job["slurm_job"]]) if job.get("slurm_job") else None
    if states is not None and states.get(job["slurm_job"]) not in RUNNING_STATES:
        state = states.get(job["slurm_job"], "gone from the queue").lower()
        return f"stopped (SLURM job {job['slurm_job']} is {state}; it ran on {job['host']} since {job['since']})"
    if job["host"] == socket.gethostname():
        try:
            os.kill(job["pid"], 0)
        except ProcessLookupError:
            return f"stopped (pid {job['pid']} is gone, killed since {job['since']})"
        except PermissionError:
            pass
    slurm = f" (SLURM job {job['slurm_job']})" if job.get("slurm_job") else ""
    return f"running on {job['host']}:{job['pid']}{slurm} since {job['since']}"


def run_status(run_dir: Path) -> dict:
    jobs = [("run", run_dir)] + [(f"shard {d.name.replace('-of-', '/')}", d)
                                 for d in sorted((run_dir / SHARDS).glob("*-of-*"))]
    if (run_dir / SAMPLES).exists():
        total = json.loads((run_dir / SAMPLES).read_text())["samples"]
    else:                                  # folders from before samples.json: a finished run's count
        total = json.loads((run_dir / "metrics.json").read_text())["n_samples"] if is_finished(run_dir) else None
    states = [(name, job_state(folder)) for name, folder in jobs]
    errors = [(name, (folder / ERROR).read_text().strip()) for name, folder in jobs if (folder / ERROR).exists()]
    try:
        done = len(all_rows(run_dir))
    except CorruptRows as err:           # a job would refuse to resume it: say why, as a job's error
        done, errors = 0, errors + [("run", str(err))]
    return {"run": str(run_dir), "done": done, "total": total, "finished": is_finished(run_dir),
            "jobs": [f"{name}: {state}" for name, state in states if state],
            "errors": [f"{name}: {error}" for name, error in errors]}


def runs(results_dir: Path) -> list[Path]:
    return sorted(p.parent for p in results_dir.rglob("config.yaml") if SHARDS not in p.parts)


def state_of(status: dict) -> str:
    """finished, running, failed (a job's error), interrupted (stopped from outside), or not finished."""
    if status["finished"]:
        return "finished"
    if any("running" in job for job in status["jobs"]):
        return "running"
    failed = [e for e in status["errors"] if not e.split(": ", 1)[1].startswith(INTERRUPTED)]
    return "failed" if failed else INTERRUPTED if status["errors"] else "not finished"


def outcome(run_dir: Path) -> str:
    """A finished run's score and the share of the full cache it kept ("not scored" before AlpacaEval's judge)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    score = "not scored" if metrics.get("score") is None else f"score {metrics['score']:.2f}"
    full = metrics.get("kv_cache_bytes_full")
    kept = f", KV {100 * metrics['kv_cache_bytes'] / full:.1f} %" if full else ""
    return score + kept


def summary(states: list[str], done: int, total: int | None, protocols: list[str | None] = ()) -> str:
    counts = {state: states.count(state) for state in dict.fromkeys(states)}
    order = ["finished", "running", "failed", INTERRUPTED, "not finished"]
    parts = [f"{counts[state]} {state}" for state in order if state in counts]
    samples = f"{done} samples done" + ("" if total is None else f" of {total}")
    asked = [p for p in protocols if p]
    kinds = "; protocols: " + ", ".join(f"{p} ({asked.count(p)})" for p in sorted(set(asked))) if asked else ""
    return f"{len(states)} runs: " + ", ".join(parts) + f"; {samples}" + kinds


def protocol(run_dir: Path) -> str | None:
    """Where the run's questions come (``RunIdentity.protocol``), None where its config does not say."""
    try:
        return RunIdentity(saved_config(run_dir)).protocol
    except (OSError, ValueError, KeyError, OmegaConfBaseException):   # a foreign or broken config.yaml
        return None


# ``--only``: which runs a state answers to ("unfinished": every run not finished, whatever its jobs do).
FILTERS = {"finished": {"finished"}, "unfinished": {"running", "failed", INTERRUPTED, "not finished"},
           "running": {"running"}, "failed": {"failed"}}


def report(results_dir: Path, only: str | None = None) -> str:
    lines, states, done, total, protocols = [], [], 0, 0, []
    for run_dir in runs(results_dir):
        status = run_status(run_dir)
        state = state_of(status)
        if only is not None and state not in FILTERS[only]:
            continue
        states.append(state)
        protocols.append(protocol(run_dir))
        done += status["done"]
        total = None if total is None or status["total"] is None else total + status["total"]
        of = "?" if status["total"] is None else status["total"]
        result = f"  {outcome(run_dir)}" if status["finished"] else ""
        name = run_dir.relative_to(results_dir) if run_dir != results_dir else run_dir
        lines.append(f"{name}  {status['done']}/{of}  {state}{result}")
        lines += [f"    {job}" for job in status["jobs"]] + [f"    last error, {error}" for error in status["errors"]]
    if not lines:
        return f"no {only + ' ' if only else ''}runs under {results_dir}"
    return "\n".join(lines + ["", summary(states, done, total, protocols)])


def main(argv=None) -> int:
    parser = command("pcs.status", __doc__)
    parser.add_argument("results_dir", nargs="?", default="results",
                        help="the folder to read: a results folder, a folder in it, or one run's (default: results)")
    parser.add_argument("--only", choices=sorted(FILTERS),
                        help="show only runs in this state (unfinished: every run not finished)")
    args = parser.parse_args(argv)
    folder = Path(args.results_dir)
    if not folder.is_dir():
        print(f"error: {folder} is not a folder; give a results folder or a run's", file=sys.stderr)
        return 2
    print(report(folder, args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
