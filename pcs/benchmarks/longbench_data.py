"""LongBench v1 data: the task lists, the paper's domains, the official prompts and output lengths,
and the official ``<task>.jsonl`` files (read with checks, or fetched from the hub).

The hub dataset ``THUDM/LongBench`` is defined by a loading script, which ``datasets`` 4 and later
refuse to run. Its repository also holds ``data.zip`` (one ``<task>.jsonl`` per task, and
``<task>_e.jsonl`` for LongBench-E), which ``huggingface_hub`` downloads with any ``datasets`` version:
that is the route used here.
"""
from __future__ import annotations

import json
import zipfile
from importlib import resources
from pathlib import Path

from ..paths import default_cache_dir

PAPER_TASKS = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
               "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
               "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
CHINESE_TASKS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
ALL_TASKS = PAPER_TASKS + CHINESE_TASKS
# LongBench-E: the tasks with a length-balanced ``<task>_e.jsonl`` version.
E_TASKS = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
           "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
# The paper's Table 4 grouping (LongBench's own categories; the Chinese tasks join theirs).
DOMAINS = {
    "single_doc_qa": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "multi_doc_qa": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "few_shot": ("trec", "triviaqa", "samsum", "lsht"),
    "synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "code": ("lcc", "repobench-p"),
}
# Chat models do better on these without the chat template (official pred.py).
NO_CHAT_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
CLASSIFICATION_TASKS = ("trec", "lsht")
ANSWER_PATTERNS = {"passage_retrieval_en": "Paragraph ", "passage_retrieval_zh": "段落"}

_DATA = resources.files("pcs") / "data"
PROMPTS: dict[str, str] = json.loads((_DATA / "longbench_prompts.json").read_text(encoding="utf-8"))
MAX_NEW_TOKENS: dict[str, int] = json.loads((_DATA / "longbench_maxlen.json").read_text())

HUB_REPO, HUB_FILE = "THUDM/LongBench", "data.zip"
FIELDS = {"input": str, "context": str, "answers": list, "length": int, "_id": str}


def default_data_dir() -> Path:
    return default_cache_dir() / "longbench"


def task_file(data_dir: Path, task: str, longbench_e: bool = False) -> Path:
    return Path(data_dir) / f"{task}{'_e' if longbench_e else ''}.jsonl"


def read_task(path: Path, task: str) -> list[dict]:
    """All records of one official jsonl file; any malformed line raises naming file and line."""
    if not path.exists():
        raise FileNotFoundError(f"LongBench file {path} is missing; fetch the official data with "
                                f"`python scripts/fetch_longbench.py --out {path.parent}`")
    records, seen = [], set()
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
            check_record(record, task, where)
            if record["_id"] in seen:
                raise ValueError(f"{where}: duplicate _id {record['_id']!r}")
            seen.add(record["_id"])
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no samples")
    return records


def check_record(record, task: str, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for field, kind in FIELDS.items():
        if not isinstance(record.get(field), kind) or isinstance(record.get(field), bool):
            raise ValueError(f"{where}: field {field!r} must be a {kind.__name__}, got {record.get(field)!r:.60}")
    if not record["answers"] or not all(isinstance(a, str) for a in record["answers"]):
        raise ValueError(f"{where}: 'answers' must be a non-empty list of strings")
    if task in CLASSIFICATION_TASKS and not isinstance(record.get("all_classes"), list):
        raise ValueError(f"{where}: {task} needs 'all_classes', a list of class names")
    pattern = ANSWER_PATTERNS.get(task)
    if pattern and not all(pattern in a for a in record["answers"]):
        raise ValueError(f"{where}: {task} answers must name the paragraph as {pattern!r}<number>")


def fetch(out_dir: Path, revision: str | None = None) -> Path:
    """Download the official ``data.zip`` from the hub and unpack its jsonl files into ``out_dir``."""
    from huggingface_hub import hf_hub_download
    archive = hf_hub_download(HUB_REPO, HUB_FILE, repo_type="dataset", revision=revision)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as zipped:
        for member in zipped.infolist():
            if member.filename.endswith(".jsonl"):
                target = out_dir / Path(member.filename).name
                tmp = target.with_suffix(".part")
                tmp.write_bytes(zipped.read(member))
                tmp.replace(target)
    return out_dir
