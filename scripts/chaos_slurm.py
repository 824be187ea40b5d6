"""A sharded sweep on a SLURM cluster disturbed at random, then resubmitted until it is done: its predictions and
metrics must equal those of an undisturbed local run, row for row.

    python scripts/chaos_slurm.py --seed 7 --faults 20      # as root, after scripts/local_slurm.sh start

The sweep answers needle samples with the embedded model: two methods sharing each prefill, 3 shard jobs, its
results on a small tmpfs mounted for the run (16 MiB). From the seed it draws the order of the faults (each kind once
per round of seven, shuffled) and the pauses between them, and injects them while the sweep runs:

  kill        SIGKILL of a job's process while it answers
  torn        the same, then half a row written after its file's last line (a process killed mid-write)
  cancel      scancel of a running job
  requeue     scontrol requeue of a running job
  drain       the job's node drained, resumed some seconds later
  disk_full   the results filesystem filled to its last byte, freed some seconds later
  corrupt     a row in the middle of a shard's file overwritten in place with NUL bytes (a bad disk block)

Each fault is printed with its target. A sweep that ends with an error is resubmitted, as a user would; the faults
stop once all are injected, so the last submission completes the sweep. Faults land at times the cluster decides,
so the seed fixes what is done and in what order, not the instants. It drains a node and cancels jobs: run it on a
cluster of your own (``scripts/local_slurm.sh``). Exit 0: every run equals the reference; 1: a difference, listed."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pcs.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("kill", "torn", "cancel", "requeue", "drain", "disk_full", "corrupt")
METHODS = "snapkv,adakv"
TIMINGS = ("prefill_s", "decode_s")
# What differs between two invocations of one run, whatever they computed: when and how long, how many jobs.
INVOCATION = ("wall_time_s", "n_resumed", "shards", "started_at", "ended_at")
FS_SIZE = "16m"


def grid(faults: int) -> list[str]:
    """Enough samples that every fault finds a job answering: 2 lengths x (2 x faults + 4) depths."""
    depths = ",".join(str(round(100 * i / (2 * faults + 3))) for i in range(2 * faults + 4))
    return ["progress=false", "budget=64", "benchmark.context_lengths=[600,900]",
            f"benchmark.depth_percents=[{depths}]", "benchmark.max_new_tokens=24", "engine.pool=1",
            f"method={METHODS}"]


def sweep_command(work: Path, results: Path, faults: int) -> list[str]:
    return [sys.executable, "run.py", "-m", *grid(faults), f"results_dir={results}", "hydra/launcher=slurm",
            "hydra.launcher.shards=3", "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=30", f"hydra.sweep.dir={work}/multirun"]


def reference(work: Path, faults: int) -> Path:
    """The same sweep answered here, undisturbed, by the local launcher."""
    out = work / "reference"
    done = subprocess.run([sys.executable, "run.py", "-m", *grid(faults), f"results_dir={out}",
                           f"hydra.sweep.dir={work}/reference_multirun"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: the undisturbed run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return out


def slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True)


class Chaos:
    """The faults, their targets and the repairs due (a node to resume, a filesystem to free)."""

    def __init__(self, seed: int, faults: int, results: Path, disk_full: bool):
        self.rng = random.Random(seed)
        kinds = [k for k in KINDS if disk_full or k != "disk_full"]
        self.plan: list[str] = []
        while len(self.plan) < faults:
            self.plan += self.rng.sample(kinds, len(kinds))
        self.plan = self.plan[:faults]
        self.results = results
        self.done: list[str] = []
        self.next_at = time.time() + self.rng.uniform(3, 8)
        self.repairs: list[tuple[float, str, str]] = []       # (when, what, target)

    # Targets
    def answering(self) -> list[dict]:
        """Jobs at work whose file holds a row: their marker (host, pid, SLURM id) and folder."""
        jobs = []
        for marker in self.results.rglob("running.json"):
            try:
                job = json.loads(marker.read_text())
                rows = (marker.parent / "predictions.jsonl").read_bytes().count(b"\n")
                os.kill(job["pid"], 0)
            except (OSError, ValueError, KeyError):
                continue
            if rows and job.get("slurm_job"):
                jobs.append({**job, "dir": marker.parent})
        return sorted(jobs, key=lambda j: str(j["dir"]))

    def shard_files(self) -> list[Path]:
        """Shard files of unfinished runs with at least two whole rows."""
        return sorted(p for p in self.results.glob("*/*/*/shards/*/predictions.jsonl")
                      if not (p.parent.parent.parent / "metrics.json").exists() and p.read_bytes().count(b"\n") >= 2)

    # Faults
    def due(self) -> None:
        now = time.time()
        for when, what, target in [r for r in self.repairs if r[0] <= now]:
            self.repairs.remove((when, what, target))
            self.repair(what, target)
        if len(self.done) < len(self.plan) and now >= self.next_at:
            kind = self.plan[len(self.done)]
            said = getattr(self, kind)()
            if said:                                   # else no target yet: tried again shortly
                self.done.append(kind)
                print(f"[chaos] fault {len(self.done)}/{len(self.plan)} {kind}: {said}", flush=True)
                self.next_at = time.time() + self.rng.uniform(2, 7)

    def pick(self, items):
        return items[self.rng.randrange(len(items))] if items else None

    def kill(self):
        if (job := self.pick(self.answering())) is None:
            return None
        os.kill(job["pid"], signal.SIGKILL)
        return f"SIGKILL to pid {job['pid']} (SLURM job {job['slurm_job']}, {job['dir'].relative_to(self.results)})"

    def torn(self):
        if (job := self.pick(self.answering())) is None:
            return None
        os.kill(job["pid"], signal.SIGKILL)
        while Path(f"/proc/{job['pid']}").exists():        # dead before its file is touched
            time.sleep(0.05)
        path = job["dir"] / "predictions.jsonl"
        last = path.read_bytes().rstrip(b"\n").split(b"\n")[-1]
        with path.open("ab") as out:
            out.write(last[:len(last) // 2])
        return (f"SIGKILL to pid {job['pid']} (SLURM job {job['slurm_job']}), then {len(last) // 2} bytes of a row "
                f"after the last line of {path.relative_to(self.results)}")

    def cancel(self):
        if (job := self.pick(self.answering())) is None:
            return None
        slurm("scancel", job["slurm_job"])
        return f"scancel {job['slurm_job']}"

    def requeue(self):
        if (job := self.pick(self.answering())) is None:
            return None
        slurm("scontrol", "requeue", job["slurm_job"])
        return f"scontrol requeue {job['slurm_job']}"

    def drain(self):
        if (job := self.pick(self.answering())) is None:
            return None
        node = slurm("squeue", "-h", "-j", job["slurm_job"], "-o", "%N").stdout.strip()
        if not node:
            return None
        slurm("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=pcs chaos")
        delay = self.rng.uniform(3, 10)
        self.repairs.append((time.time() + delay, "resume", node))
        return f"node {node} drained for {delay:.0f} s"

    def disk_full(self):
        if not self.answering():                     # while a job writes rows
            return None
        ballast = self.results / ".chaos_ballast"
        with ballast.open("wb") as out:
            try:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
        delay = self.rng.uniform(3, 10)
        self.repairs.append((time.time() + delay, "free", str(ballast)))
        return f"{self.results} full ({ballast.stat().st_size >> 20} MiB of ballast) for {delay:.0f} s"

    def corrupt(self):
        if (path := self.pick(self.shard_files())) is None:
            return None
        lines = path.read_bytes().split(b"\n")
        k = self.rng.randrange(len(lines) - 2)             # a whole row that is not the last
        offset = sum(len(line) + 1 for line in lines[:k])
        with path.open("r+b") as out:                      # in place: the job's appends go on at the end
            out.seek(offset)
            out.write(b"\0" * len(lines[k]))
        return f"row {k + 1} of {path.relative_to(self.results)} overwritten with NUL bytes"

    def repair(self, what: str, target: str) -> None:
        if what == "resume":
            slurm("scontrol", "update", f"NodeName={target}", "State=RESUME")
        else:
            Path(target).unlink(missing_ok=True)
        print(f"[chaos] {'node ' + target + ' resumed' if what == 'resume' else 'filesystem freed'}", flush=True)

    def repair_all(self) -> None:
        for _, what, target in self.repairs:
            self.repair(what, target)
        self.repairs = []


def our_arrays(work: Path) -> set[str]:
    return {p.name.split("_")[0] for p in (work / "multirun" / ".submitit").glob("*") if p.is_dir()
            and p.name.split("_")[0].isdigit()}


def start_pending(work: Path) -> None:
    """A requeued job waits out SLURM's begin-time delay (minutes); this run's start at once."""
    for array in our_arrays(work):
        for job in slurm("squeue", "-h", "-r", "-t", "PENDING", "-j", array, "-o", "%i").stdout.split():
            slurm("scontrol", "update", f"JobId={job}", "StartTime=now")


def mount_results(path: Path) -> str | None:
    """A tmpfs of FS_SIZE at ``path``; None, or why it could not be mounted (then no disk_full faults)."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        return "not root"
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE}", "tmpfs", str(path)], capture_output=True,
                         text=True)
    return None if out.returncode == 0 else out.stderr.strip() or "mount failed"


def rows_of(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in (run / "predictions.jsonl").read_text().splitlines()]


def metrics_of(run: Path) -> dict:
    return {k: v for k, v in json.loads((run / "metrics.json").read_text()).items() if k not in INVOCATION}


def differences(want_dir: Path, got_dir: Path) -> tuple[list[str], int, int]:
    """Where the runs under ``got_dir`` differ from those under ``want_dir``; runs and rows compared."""
    found, runs, rows = [], 0, 0
    for metrics_path in sorted(want_dir.rglob("metrics.json")):
        want, run = metrics_path.parent, metrics_path.parent.relative_to(want_dir)
        got = got_dir / run
        runs += 1
        if not (got / "metrics.json").exists():
            found.append(f"{run}: not finished")
            continue
        want_rows, got_rows = rows_of(want), rows_of(got)
        rows += len(want_rows)
        if got_rows != want_rows:
            bad = [w["id"] for w, g in zip(want_rows, got_rows) if w != g]
            found.append(f"{run}: {len(got_rows)} rows against {len(want_rows)}; differing: {bad[:5]}")
        want_m, got_m = metrics_of(want), metrics_of(got)
        if got_m != want_m:
            keys = sorted(k for k in set(want_m) | set(got_m) if want_m.get(k) != got_m.get(k))
            found.append(f"{run}: metrics differ in {keys}")
    return found, runs, rows


def main() -> int:
    parser = Parser(prog="scripts/chaos_slurm.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="draws the faults, their order and pauses")
    parser.add_argument("--faults", type=int, default=20, help="faults to inject (default 20)")
    parser.add_argument("--work", type=Path, help="a new folder for the run (default: a new temporary one)")
    args = parser.parse_args()
    if args.faults < 1:
        parser.error(f"--faults={args.faults} must be at least 1")
    if args.work is not None and args.work.exists() and any(args.work.iterdir()):
        parser.error(f"--work={args.work} is not empty: give a new folder (the run mounts its results there)")
    if shutil.which("sbatch") is None or slurm("sinfo", "-h", "-o", "%T").returncode != 0:
        print("error: no SLURM cluster answers: run scripts/local_slurm.sh start", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="pcs-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[chaos] seed {args.seed}, {args.faults} faults, in {work}", flush=True)
    started = time.time()
    want = reference(work, args.faults)
    print(f"[chaos] undisturbed local run: {time.time() - started:.0f} s", flush=True)
    results = work / "results"
    why = mount_results(results)
    if why:
        print(f"[chaos] no tmpfs for the results ({why}): disk_full faults left out", flush=True)
    chaos = Chaos(args.seed, args.faults, results, disk_full=why is None)
    print(f"[chaos] faults in order: {' '.join(chaos.plan)}", flush=True)
    submissions = 0
    try:
        while True:
            submissions += 1
            log = work / f"submission_{submissions}.log"
            with log.open("w") as out:
                sweep = subprocess.Popen(sweep_command(work, results, args.faults), cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT)
                while sweep.poll() is None:
                    chaos.due()
                    start_pending(work)
                    time.sleep(0.3)
            last = log.read_text().strip().splitlines()[-1:] or [""]
            print(f"[chaos] submission {submissions}: exit {sweep.returncode} after {time.time() - started:.0f} s"
                  f"{'' if sweep.returncode == 0 else ': ' + last[0][:200]}", flush=True)
            if sweep.returncode == 0 and len(chaos.done) == len(chaos.plan):
                break
            if submissions > 2 * args.faults + 5:
                print(f"[chaos] still not done after {submissions} submissions; see {work}", flush=True)
                return 1
            chaos.repair_all()        # a resubmission starts on a node that is up, with space on the filesystem
    finally:
        chaos.repair_all()
        for array in our_arrays(work):
            slurm("scancel", array)
        if why is None:
            shutil.copytree(results, work / "chaos", ignore=shutil.ignore_patterns(".chaos_ballast"))
            subprocess.run(["umount", str(results)], capture_output=True)
    logs = "".join(p.read_text(errors="replace") for p in (work / "multirun" / ".submitit").rglob("*_log.*"))
    print(f"[chaos] in the jobs' logs: {logs.count('[Errno 28]')} write(s) refused for want of space, "
          f"{logs.count('samples already done')} resumption(s), {logs.count('that are not rows moved to')} shard "
          f"file(s) with lines set aside, {logs.count('no longer holds')} job(s) that found their answers gone",
          flush=True)
    found, runs, rows = differences(want, work / "chaos" if why is None else results)
    for line in found:
        print(f"[chaos] DIFFERS {line}", flush=True)
    print(f"[chaos] {len(chaos.done)} faults, {submissions} submissions, {time.time() - started:.0f} s: "
          f"{runs - len(found) if not found else 'not all'} of {runs} runs ({rows} rows) equal the undisturbed run's",
          flush=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
