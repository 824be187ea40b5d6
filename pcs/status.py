"""``python -m pcs.status <results_dir>``: every run under a results folder, how far it is, and what its jobs are
doing. Torch-free: it reads the run folders only (``pcs.run_folder``).

Per run: samples done of its total (its own rows and every shard's, counted once), finished or not, the jobs
working in it now (the run's own, or ``shard k/N``; a job whose process is gone, on this host, or whose SLURM job
is no longer running, as squeue says, is reported as stopped), and the last error of a job that failed (or ``interrupted``: stopped from outside, by a preemption, a
time limit or Ctrl-C; a requeued job or a rerun goes on).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from .run_folder import ERROR, INTERRUPTED, RUNNING, SAMPLES, SHARDS, all_rows, is_finished
from .slurm_queue import RUNNING_STATES, queue_states


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
    return {"run": str(run_dir), "done": len(all_rows(run_dir)), "total": total, "finished": is_finished(run_dir),
            "jobs": [f"{name}: {state}" for name, state in states if state],
            "errors": [f"{name}: {error}" for name, error in errors]}


def runs(results_dir: Path) -> list[Path]:
    return sorted(p.parent for p in results_dir.rglob("config.yaml") if SHARDS not in p.parts)


def report(results_dir: Path) -> str:
    lines = []
    for run_dir in runs(results_dir):
        status = run_status(run_dir)
        total = "?" if status["total"] is None else status["total"]
        failed = [e for e in status["errors"] if not e.split(": ", 1)[1].startswith(INTERRUPTED)]
        state = "finished" if status["finished"] else ("running" if any("running" in j for j in status["jobs"])
                                                        else "failed" if failed else
                                                        INTERRUPTED if status["errors"] else "not finished")
        lines.append(f"{run_dir.relative_to(results_dir)}  {status['done']}/{total}  {state}")
        lines += [f"    {job}" for job in status["jobs"]] + [f"    last error, {error}" for error in status["errors"]]
    return "\n".join(lines) if lines else f"no runs under {results_dir}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcs.status", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="results")
    args = parser.parse_args(argv)
    print(report(Path(args.results_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
