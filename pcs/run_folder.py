"""A run folder on disk: ``config.yaml`` (the saved config), ``predictions.jsonl`` (one flushed line per
finished sample), ``metrics.json`` (written atomically, last: its presence means the run finished),
and the lock that keeps two jobs out of one folder."""
from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import socket
import tempfile
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import upgraded
from .errors import ConfigError
from .identity import RunIdentity, without_locations
from .paths import write_atomic


class CorruptRows(ConfigError):
    """A predictions file with a line that is not a row, other than a torn last one: nothing is resumed from it
    until the line is removed (its sample is then answered again)."""


def read_rows(path: Path, unreadable: list[bytes] | None = None) -> list[dict]:
    """Finished predictions. A torn last line (the process died mid-write: no newline after it) is dropped; any
    other line that is not a JSON row with an id is an error naming the file and line, since reading past it or
    stopping at it would lose rows silently. ``unreadable``: a list that collects such lines instead (a shard's
    file, which only its jobs write: its job sets them aside and answers their samples again)."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
            problem = None if isinstance(row, dict) and "id" in row else "is not a row of predictions (no id)"
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if number == len(lines):        # the last line, with no newline after it: torn
                break
            problem = f"is not a JSON row ({err.msg if isinstance(err, json.JSONDecodeError) else 'not UTF-8'})"
        if problem is None:
            rows.append(row)
        elif unreadable is not None:
            unreadable.append(line)
        else:
            raise CorruptRows(f"{path}:{number} {problem}; delete that line (its sample is answered again) and "
                              f"rerun")
    return rows


class LostRows(RuntimeError):
    """Answers a job wrote that its file no longer holds when the run is merged."""


def write_rows_atomic(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_json_atomic(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def is_finished(run_dir: Path) -> bool:
    return (run_dir / "metrics.json").exists()


def load_config(run_dir: Path) -> DictConfig:
    """The run folder's saved config, with knobs added since it was saved at its old behaviour."""
    return upgraded(OmegaConf.load(Path(run_dir) / "config.yaml"))


def saved_config(run_dir: Path) -> DictConfig:
    """``load_config``, read-only, read once per process while the file stays the same: the report and its plots
    ask for each run's config several times (YAML parsing was a third of a report's time)."""
    path = (Path(run_dir) / "config.yaml").resolve()
    stat = path.stat()
    return _read_only_config(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _read_only_config(path: Path, mtime_ns: int, size: int) -> DictConfig:
    cfg = load_config(path.parent)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def same_run(run_dir: Path, saved_config: str) -> bool:
    """Whether an existing folder's config is this run's (a config saved before a knob was added is the same run
    when it did what the knob's value does; one that differs only in where files are or which device ran,
    ``LOCATIONS``, is the same run too); ``ConfigError`` where it holds another run."""
    config_file = run_dir / "config.yaml"
    if not config_file.exists() or config_file.read_text() == saved_config:
        return True
    old, new = (without_locations(OmegaConf.to_container(c))
                for c in (load_config(run_dir), OmegaConf.create(saved_config)))
    if old != new:
        differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ConfigError(f"{run_dir} holds a run with another config (it differs in {', '.join(differ)}); "
                          f"remove that folder or choose another results_dir")
    return False


def prepare(run_dir: Path, saved_config: str) -> None:
    """Create the folder with its config, or check that an existing one holds the same run (``same_run``; a
    saved config written before a knob was added is rewritten as a run composed today saves it)."""
    if (run_dir / "config.yaml").exists():
        if not same_run(run_dir, saved_config):
            write_atomic(run_dir / "config.yaml", saved_config)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", saved_config)          # shards of a run may create it at once


def can_create(run_dir: Path) -> None:
    """``ConfigError`` where ``run_dir`` could not be created: its nearest existing folder takes no new entry
    (permissions, a read-only or virtual filesystem, a file in the way). Tried with an empty folder, removed at once:
    the check writes nothing."""
    existing = Path(run_dir)
    while not existing.exists():
        existing = existing.parent
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".pcs-probe-"))
    except OSError as err:
        raise ConfigError(f"cannot create the run folder {run_dir}: {existing} takes no new folder ({err.strerror}); "
                          f"set results_dir to a folder this process can write") from err


@contextmanager
def exclusive(run_dir: Path, wait: bool = False):
    """Yields whether this process holds the run folder's lock (a POSIX lock, so it also works
    between cluster nodes sharing the folder over NFS); the lock goes when the process ends. ``wait``: until
    the holder lets go. A file system that cannot lock is an error, not a lock held by another job."""
    handle = open(run_dir / ".lock", "w")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        handle.close()
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            raise OSError(err.errno, f"cannot lock {run_dir / '.lock'} ({err.strerror}): pcs keeps two jobs out "
                                     "of one run folder with POSIX locks; put results_dir on a file system that "
                                     "supports them (e.g. NFS with lockd, Lustre mounted with flock)") from err
        yield False
        return
    try:
        yield True
    finally:
        fcntl.lockf(handle, fcntl.LOCK_UN)
        handle.close()


# Shards: a run's samples split into ``count`` fixed, disjoint parts (sample ``i`` goes to part ``i % count``, so
# each part sees every task alike), each written by its own job into ``shards/<index>-of-<count>/`` with its own
# predictions and lock. A run's rows are the union of its own predictions.jsonl and every shard's, so a run
# resumes from whatever any earlier job wrote, sharded or not, and another shard count on a started run only
# changes who answers the samples still missing.
SHARDS = "shards"


def shard_dir(run_dir: Path, index: int, count: int) -> Path:
    return Path(run_dir) / SHARDS / f"{index}-of-{count}"


def in_shard(position: int, index: int, count: int) -> bool:
    """Whether the sample at ``position`` of the run's samples belongs to shard ``index`` of ``count``."""
    return position % count == index


def all_rows(run_dir: Path) -> list[dict]:
    """Every finished row of a run: its predictions.jsonl, then each shard's; the first row of an id is kept. A
    shard's line that is not a row is passed over (``RunFolder.appending`` sets it aside); one in the run's own
    file is an error (``read_rows``)."""
    shards = sorted((Path(run_dir) / SHARDS).glob("*/predictions.jsonl"))
    rows, seen = [], set()
    for path in [Path(run_dir) / "predictions.jsonl", *shards]:
        for row in read_rows(path, None if path.parent == Path(run_dir) else []):
            if row["id"] not in seen:
                seen.add(row["id"])
                rows.append(row)
    return rows


# The benchmark knobs that only choose which samples a run holds: a run that differs from another only in these
# can take that run's answers to the samples both build alike (``RunFolder.adopt``).
SAMPLE_CHOICE = ("n_samples", "tasks")


def sample_choice(saved: dict) -> dict:
    """A saved config's ``SAMPLE_CHOICE`` knobs."""
    return {k: v for k, v in saved.get("benchmark", {}).items() if k in SAMPLE_CHOICE}


def but_for_the_samples(saved: dict) -> dict:
    """A saved config's data without its ``SAMPLE_CHOICE`` knobs."""
    benchmark = {k: v for k, v in saved.get("benchmark", {}).items() if k not in SAMPLE_CHOICE}
    return {**saved, "benchmark": benchmark}


def same_but_for_the_samples(run_dir: Path, saved: dict) -> list[Path]:
    """Runs beside ``run_dir``, finished or not, whose config is ``saved`` (a run's ``saved_data``) in everything
    but which samples they hold (another count, other tasks): the run with most rows first."""
    mine = but_for_the_samples(saved)
    found = [other for other in sorted(Path(run_dir).parent.iterdir())
             if other != Path(run_dir) and (other / "config.yaml").exists()
             and but_for_the_samples(OmegaConf.to_container(saved_config(other), resolve=True)) == mine]
    return sorted(found, key=lambda other: -len(all_rows(other)))


@contextmanager
def left_alone(run_dir: Path):
    """Yields whether no job works in the run (its folder's lock and each shard's are free), holding those locks
    meanwhile so that none starts while its rows are read."""
    with ExitStack() as held:
        folders = [Path(run_dir), *sorted(p for p in (Path(run_dir) / SHARDS).glob("*-of-*") if p.is_dir())]
        yield all(held.enter_context(exclusive(folder)) for folder in folders)


# A run grown from another's answers (``RunFolder.adopt``) names it here: {"run": folder name, "rows": count}.
ANSWERS_FROM = "answers_from.json"
# A row's key for the fingerprint of the sample it answers (``pcs.benchmarks.base.Sample.fingerprint``).
SAMPLE = "sample"


def answers_taken(run_dir: Path) -> dict | None:
    """The run a grown run took answers from and how many (``RunFolder.adopt``), summed over its shards."""
    notes = [json.loads(path.read_text()) for path in [Path(run_dir) / ANSWERS_FROM,
                                                       *sorted((Path(run_dir) / SHARDS).glob(f"*/{ANSWERS_FROM}"))]
             if path.exists()]
    if not notes:
        return None
    return {"run": ", ".join(sorted({note["run"] for note in notes})), "rows": sum(note["rows"] for note in notes)}


# Which weights answered a job folder's rows (``pcs.weights.fingerprint``), written when the job starts.
WEIGHTS = "weights.json"


class OtherWeights(ConfigError):
    """A run folder answered with other weights than the job's: its rows are not mixed with this job's."""


def weights_used(run_dir: Path) -> dict[str, dict]:
    """Each job folder's recorded weights (the run's own and every shard's), by fingerprint id."""
    found = {}
    for path in [Path(run_dir) / WEIGHTS, *sorted((Path(run_dir) / SHARDS).glob(f"*/{WEIGHTS}"))]:
        if path.exists():
            weights = json.loads(path.read_text())
            found.setdefault(weights.get("id"), weights)
    found.pop(None, None)        # weights whose files were not found say nothing
    return found


def refuse_other_weights(run_dir: Path, weights: dict) -> None:
    from .weights import described
    others = [w for key, w in weights_used(run_dir).items() if key != weights.get("id")]
    if others and weights.get("id") is not None:
        raise OtherWeights(f"{run_dir} holds answers of {described(others[0])}, and this job loaded "
                           f"{described(weights)}: its rows are not mixed with another model's; give model.path the "
                           f"weights that run used, or choose another results_dir")


# What ``python -m pcs.status`` reads besides the rows: the run's sample count, and per job folder (the run's or a
# shard's) who is working in it and how its last job failed.
SAMPLES, RUNNING, ERROR = "samples.json", "running.json", "error.txt"
SET_ASIDE = "unreadable_lines.txt"   # a shard's lines that were not rows, kept for a look (``RunFolder.appending``)
INTERRUPTED = "interrupted"      # how error.txt starts for a job stopped from outside (not a failure of its own)


def note_samples(run_dir: Path, n_samples: int) -> None:
    """The run's sample count, for ``pcs.status`` while the run is not finished."""
    write_json_atomic(Path(run_dir) / SAMPLES, {"samples": n_samples})


@contextmanager
def working(out_dir: Path):
    """While a job works in ``out_dir`` (the run's folder or a shard's): its host and pid in running.json, and a
    failure's last line in error.txt (cleared when a job starts)."""
    (Path(out_dir) / ERROR).unlink(missing_ok=True)
    array = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    slurm = f"{array[0]}_{array[1]}" if all(array) else os.environ.get("SLURM_JOB_ID")
    write_json_atomic(Path(out_dir) / RUNNING, {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": slurm,
                                                "since": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    try:
        yield
    except Exception as err:
        write_atomic(Path(out_dir) / ERROR, f"{type(err).__name__}: {err}".strip() + "\n")
        raise
    except BaseException as err:     # submitit's exit after a preemption or time-limit signal, Ctrl-C
        write_atomic(Path(out_dir) / ERROR, f"{INTERRUPTED} ({type(err).__name__}): a requeued or rerun job "
                                                 f"resumes from the rows on disk\n")
        raise
    finally:
        (Path(out_dir) / RUNNING).unlink(missing_ok=True)


class RunFolder:
    """One run's folder as a job sees it, and every read and write the job makes there: its config (created or
    checked), the lock that keeps a second job out of the part this job writes (the run's folder, or its shard's),
    the markers ``pcs.status`` reads, answers adopted from a run beside it, resuming, each finished row streamed to
    disk as it lands, the merge of every shard's rows under the run's lock once all samples are answered, and the
    predictions and metrics written last. It calls nothing above it: what it writes is handed to it.
    ``identity``: the run's ``RunIdentity`` (its config.yaml, and what a run beside it must equal but for its
    samples to give its answers). ``shard=(index, count)``: the part of the samples this job answers."""

    def __init__(self, path: Path, shard: tuple[int, int] = (0, 1), identity: RunIdentity | None = None):
        self.path = Path(path)
        self.identity = identity
        self.index, self.count = shard
        self.out_dir = self.path if self.count == 1 else shard_dir(self.path, self.index, self.count)
        self.rows: list[dict] = []     # every finished row of the run: this job's and any other's
        self.done: set[str] = set()   # their ids as this job resumed
        self._out = None

    @property
    def finished(self) -> bool:
        return is_finished(self.path)

    def metrics(self) -> dict:
        return json.loads((self.path / "metrics.json").read_text())

    def check(self) -> None:
        """What a job would find here, checked before anything loads or is written: the folder can be created
        (``can_create``), holds this run (``same_run``) and its rows read (``CorruptRows``). A finished run is not resumed: nothing to check."""
        if not self.path.exists():
            can_create(self.path)
        if self.finished:
            return
        same_run(self.path, self.identity.saved_config)
        all_rows(self.path)

    def create(self) -> None:
        """The folder with its config, or a check that it holds this run (``prepare``)."""
        prepare(self.path, self.identity.saved_config)

    @contextmanager
    def claimed(self):
        """Yields whether this job holds its part of the folder (its lock); while it does, the part says who
        works in it (``working``) once ``work`` is entered."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with exclusive(self.out_dir) as mine:
            yield mine

    def working(self):
        return working(self.out_dir)

    def note_weights(self, weights: dict) -> None:
        """The weights this job loaded, refused where the run's rows came from others (``OtherWeights``), then
        recorded in this job's folder."""
        refuse_other_weights(self.path, weights)
        write_json_atomic(self.out_dir / WEIGHTS, weights)

    @contextmanager
    def answering(self, n_samples: int, weights: dict, asked: dict[str, str], own: set[Path] = frozenset()):
        """This job's predictions file open for new rows (``append``), after the run's sample count and the job's
        weights are noted and, where the run has none of ``asked`` (this job's samples: id -> fingerprint)
        answered yet, a run beside it has given its answers to them (``adopt``); every row the run holds (its own
        and its shards') is read into ``rows`` and ``done``."""
        note_samples(self.path, n_samples)
        self.note_weights(weights)
        self.adopt(asked, weights, own)
        with self.appending(n_samples):
            yield self

    def adopt(self, asked: dict[str, str], weights: dict, own: set[Path] = frozenset()) -> None:
        """A new run that is a run beside it but for which samples it holds (``benchmark.n_samples``,
        ``benchmark.tasks``) starts from that run's answers to
        the samples both hold, so that more samples, or a narrower set of tasks, cost only the samples not answered
        yet. A sample counts as the same only where the row stored the fingerprint of the sample it answered and
        it equals the one asked (``asked``: id -> ``Sample.fingerprint``), every field alike (prompt, question,
        references), since a generator may draw another count's samples differently; a row without one is not
        taken. The other run may be finished or stopped part way, not worked in by a job (its rows would not be
        settled), nor one of this job's own runs (``own``, whose locks this process holds), nor answered by other
        weights than this job's (``weights``). A shard takes the answers to its own share, into its own file,
        while none of its share is answered."""
        if any(row["id"] in asked for row in all_rows(self.path)):
            return
        for other in same_but_for_the_samples(self.path, self.identity.saved_data()):
            if other in own or set(weights_used(other)) - {weights.get("id")}:
                continue
            with left_alone(other) as idle:
                if not (idle or is_finished(other)):
                    continue
                rows = [row for row in all_rows(other) if row.get(SAMPLE) and asked.get(row["id"]) == row[SAMPLE]]
            if rows:
                write_rows_atomic(self.out_dir / "predictions.jsonl", rows)
                write_json_atomic(self.out_dir / ANSWERS_FROM, {"run": other.name, "rows": len(rows)})
                choice = sample_choice(OmegaConf.to_container(saved_config(other), resolve=True))
                knobs = " ".join(f"{k}={v}" for k, v in choice.items())
                print(f"[pcs] {self.out_dir}: {len(rows)} of {len(asked)} samples answered by {other.name} (the same "
                      f"run on {knobs}); the rest is new")
                return

    @contextmanager
    def appending(self, n_samples: int):
        """This job's predictions file open for new rows (``append``), with every row the run holds (its own and
        its shards') read into ``rows`` and ``done``."""
        predictions_file = self.out_dir / "predictions.jsonl"
        self.rows = all_rows(self.path)
        self.done = {row["id"] for row in self.rows}
        if self.done:
            print(f"[pcs] resuming {self.path}: {len(self.done)} of {n_samples} samples already done")
        # Drop a torn last line before appending. The rewrite is on disk before the first new row: rewritten
        # through the appending handle, rows past its buffer would stay in memory until the run's next row, and a
        # kill before that (the run already had them) would lose them.
        unreadable: list[bytes] = []
        kept = read_rows(predictions_file, unreadable if self.count > 1 else None)
        if unreadable:            # a shard's line that no longer reads: kept aside, its sample answered again
            with (self.out_dir / SET_ASIDE).open("ab") as aside:
                aside.write(b"".join(line + b"\n" for line in unreadable))
            print(f"[pcs] {predictions_file}: {len(unreadable)} line(s) that are not rows moved to {SET_ASIDE}; "
                  f"their samples are answered again")
        write_rows_atomic(predictions_file, kept)
        with predictions_file.open("a", encoding="utf-8") as self._out:
            yield self
        self._out = None

    def append(self, row: dict) -> None:
        """A finished answer, on disk before the next one (a kill loses none already written)."""
        self._out.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._out.flush()
        self.rows.append(row)

    @contextmanager
    def merge(self, sample_ids: set[str], own: set[str] = frozenset()):
        """Yields every row of the run once all its samples are answered (its shards' included), for the caller to
        compute the metrics and ``finish`` the run while it is held; None
        where the run is finished already or samples are missing (other shards' to answer). ``LostRows`` where an
        answer of ``own`` (this job's samples) is not on disk, which a rerun answers again. With shards each
        finishing job waits for the run-level lock and reads the rows again under it, so whichever sees them all
        writes the metrics: a shard that found the lock taken and left could leave a finished run unmerged (the
        holder read before its last row landed)."""
        with ExitStack() as held:
            if self.count > 1:
                held.enter_context(exclusive(self.path, wait=True))
            if self.finished:
                yield None
                return
            self.rows = all_rows(self.path)
            if len(used := weights_used(self.path)) > 1:
                from .weights import described
                raise OtherWeights(f"{self.path}: its shards were answered by "
                                   f"{' and '.join(described(w) for w in used.values())}; rerun the shards of one "
                                   f"of them in another results_dir")
            missing = set(sample_ids) - {row["id"] for row in self.rows}
            if lost := missing & set(own):
                raise LostRows(f"{self.out_dir / 'predictions.jsonl'} no longer holds {len(lost)} of the answers "
                               f"this job wrote (a line of it was changed while the job ran); rerun: they are "
                               f"answered again")
            if missing:
                print(f"[pcs] shard {self.index} of {self.count} of {self.path} is done; "
                      f"{len(sample_ids) - len(missing)} of {len(sample_ids)} samples are, the rest is other shards'")
                yield None
                return
            yield self.rows

    def finish(self, rows: list[dict], metrics: dict) -> dict:
        """The run's rows (every shard's, in sample order) in its own predictions.jsonl, then metrics.json, written
        last and atomically: its presence is what says the run is finished. The metrics name the run answers were
        adopted from (``adopt``); they are returned as written, and summed up on the console."""
        self.rows = rows
        write_rows_atomic(self.path / "predictions.jsonl", rows)
        if taken := answers_taken(self.path):
            metrics["answers_from"] = taken
        write_json_atomic(self.path / "metrics.json", metrics)
        kept, full = metrics["kv_cache_bytes"], metrics["kv_cache_bytes_full"]
        print(f"\n[pcs] {self.path}\n"
              f"  score      {score_text(metrics['score'])}  ({metrics['n_samples']} samples)\n"
              f"  KV memory  {kept / 2**20:.1f} MiB kept of {full / 2**20:.1f} MiB full ({100 * kept / full:.1f} %)\n"
              f"  time       {metrics['wall_time_s']:.1f} s")
        return metrics


def score_text(score) -> str:
    return "not scored yet" if score is None else f"{score:.2f}"
