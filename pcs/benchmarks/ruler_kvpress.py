"""kvpress's RULER (benchmark=ruler_kvpress): the samples kvpress's leaderboard asks, read from its hub dataset
``simonjegou/ruler`` (RULER's 13 tasks generated once at 4K, 8K and 16K tokens with Llama-3.1-8B's tokenizer and no
template, 500 samples per task; kvpress's ``evaluation/benchmarks/ruler``), so that every model answers the very
prompts of kvpress's table rather than pcs's draw for its own tokenizer (``benchmark=ruler``).

Each row holds its ``context``, ``question``, ``answer_prefix``, references (``answer``), ``task`` and
``max_new_tokens``, split as kvpress's ``create_huggingface_dataset.py`` splits RULER's input. A sample's user turn is
the context and the question, as kvpress's pipeline writes it; with ``query_aware: false`` (kvpress's leaderboard) the
context alone is compressed and the question, the chat template's tail and the answer prefix are fed after, as
``evaluate.py`` does without ``--query_aware``; with ``true`` the context and the question are compressed and the
template's tail and the answer prefix are still fed after (``--query_aware``: the question joins the context, the
pipeline's split stays where the user's text ends), unlike ``benchmark=ruler``'s ``true``, which compresses it all.
Scoring is RULER's string match after kvpress's normalisation. The files are read from ``benchmark.data_dir``
(``<length>/*.parquet``, the hub repository's layout) or fetched once into the cache folder; where neither works,
the run stops before the model loads.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from ..paths import default_cache_dir
from ..provenance import sha256_files
from .base import Sample
from .ruler import Ruler

HUB_REPO = "simonjegou/ruler"
COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")


def fetch(folder: Path, length: int, revision: str | None = None) -> None:
    """The hub dataset's files of one length into ``folder/<length>/``."""
    from huggingface_hub import snapshot_download
    snapshot_download(HUB_REPO, repo_type="dataset", allow_patterns=[f"{length}/*"], local_dir=folder,
                      revision=revision)


def length_files(folder: Path, length: int) -> list[Path]:
    return sorted((folder / str(length)).glob("*.parquet"))


def check_files(files: list[Path], tasks) -> None:
    """One length's files hold kvpress's columns and rows of every task asked (their schema and task column read,
    not their rows: a dry run checks them in a second)."""
    import pyarrow.parquet as pq
    for path in files:
        missing = [c for c in COLUMNS if c not in pq.read_schema(path).names]
        if missing:
            raise ValueError(f"{path}: the file lacks columns {missing}; kvpress's RULER rows hold "
                             f"{', '.join(COLUMNS)}")
    held = {task for path in files for task in pq.read_table(path, columns=["task"]).column("task").to_pylist()}
    absent = [t for t in tasks if t not in held]
    if absent:
        raise ValueError(f"{files[0].parent} holds no rows of {absent}: it holds {sorted(held)}")


def read_rows(files: list[Path]) -> list[dict]:
    """The rows of one length's parquet files, in the dataset's order (``check_files`` has checked them)."""
    import pandas as pd
    frame = pd.concat([pd.read_parquet(path, columns=list(COLUMNS)) for path in files], ignore_index=True)
    return [{**row, "answer": [str(a) for a in row["answer"]]} for row in frame.to_dict("records")]


class KvpressRuler(Ruler):
    prompt_length_knob = None     # the dataset's prompts are what they are

    @cached_property
    def lengths(self) -> list[int]:
        return list(self.cfg.lengths)

    @cached_property
    def folder(self) -> Path:
        """``benchmark.data_dir``, else the cache folder, each length fetched from the hub on first use."""
        if self.cfg.data_dir:
            folder = Path(self.cfg.data_dir)
            for length in self.lengths:
                if not length_files(folder, length):
                    raise FileNotFoundError(
                        f"benchmark.data_dir={self.cfg.data_dir!r} has no {length}/*.parquet: it should hold "
                        f"{HUB_REPO}'s files as the hub does (hf download {HUB_REPO} --repo-type "
                        f"dataset --include '{length}/*' --local-dir DIR)")
            return folder
        folder = default_cache_dir() / "ruler_kvpress"
        for length in self.lengths:
            if not length_files(folder, length):
                try:
                    fetch(folder, length)
                except Exception as err:
                    raise FileNotFoundError(
                        f"kvpress's RULER at {length} tokens is not in {folder} and could not be fetched from the hub "
                        f"({type(err).__name__}); where the hub is reachable run hf download {HUB_REPO} "
                        f"--repo-type dataset --include '{length}/*' --local-dir DIR and pass "
                        f"benchmark.data_dir=DIR") from None
                if not length_files(folder, length):
                    raise FileNotFoundError(f"{HUB_REPO} has no {length}/*.parquet: choose benchmark.lengths among "
                                            f"the lengths it holds (4096, 8192, 16384)")
        return folder

    def check(self) -> None:
        self.check_tasks_and_lengths()
        if self.cfg.n_samples is not None and (not isinstance(self.cfg.n_samples, int) or self.cfg.n_samples < 1):
            raise ValueError(f"benchmark.n_samples={self.cfg.n_samples}: the first N samples of each task, or null "
                             "for all of them")
        for length in self.lengths:
            check_files(length_files(self.folder, length), self.cfg.tasks)

    def samples(self, tokenizer) -> list[Sample]:
        out = []
        for length in self.lengths:
            files = length_files(self.folder, length)
            self.digests[str(length)] = sha256_files(files)
            by_task: dict[str, list[dict]] = {}
            for row in read_rows(files):
                by_task.setdefault(row["task"], []).append(row)
            for task in self.cfg.tasks:
                rows = by_task[task][:self.cfg.n_samples]
                for index, row in enumerate(rows):
                    out.append(Sample(id=f"{task}_{length}_{index}", prompt=row["context"] + row["question"],
                                      question="" if self.cfg.query_aware else row["question"],
                                      answer_prefix=row["answer_prefix"], max_new_tokens=int(row["max_new_tokens"]),
                                      tail_after=True,
                                      meta={"task": task, "length": length, "stratum": f"{task}_{length}",
                                            "outputs": row["answer"]}))
        return out

    def data_hashes(self) -> dict:
        return {"ruler_kvpress_files": self.digests}
