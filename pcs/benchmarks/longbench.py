"""LongBench v1 under the official protocol (THUDM/LongBench ``pred.py`` and ``eval.py``).

Per sample: the task's official template filled with the record's context and input; the tokenized
prompt, if longer than ``model.max_length``, keeps its first and last ``max_length // 2`` tokens
(decoded and re-tokenized: middle truncation); the chat template except on the few-shot and code
tasks; greedy decoding for the task's official ``max_new_tokens``; samsum also stops at a newline
(after at least one token). Scores are the official metrics (``pcs.metrics``), per task, per domain
(the paper's Table 4) and their mean over the tasks run (``score``; the paper's "Ave." on all 16).

With ``query_aware: false`` the text after the context (question, answer cue, chat suffix) is fed
after compression, so the cache is chosen without seeing the question.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..metrics import FUZZY_BACKENDS, longbench_e_scores, longbench_score, sample_score
from ..prompts import PromptIds, encode_prompt
from ..provenance import sha256_files, sha256_text
from .base import Benchmark, Sample
from .longbench_data import (ALL_TASKS, DOMAINS, E_TASKS, MAX_NEW_TOKENS, NO_CHAT_TASKS, PROMPTS,
                             default_data_dir, fetch, read_task, task_file)


def truncate_middle(tokenizer, prompt: str, max_length: int) -> str:
    """Official middle truncation: the first and last ``int(max_length/2)`` tokens, decoded and joined."""
    ids = tokenizer(prompt).input_ids        # with the BOS, as pred.py counts
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return (tokenizer.decode(ids[:half], skip_special_tokens=True)
            + tokenizer.decode(ids[-half:], skip_special_tokens=True))


class LongBench(Benchmark):
    prompt_length_knob = "model.max_length"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.records: dict[str, list[dict]] = {}

    @property
    def tasks(self) -> list[str]:
        return list(self.cfg.tasks)

    def data_dir(self) -> Path:
        """``benchmark.data_dir``, else the cache folder, fetched from the hub on first use."""
        if self.cfg.get("data_dir"):
            return Path(self.cfg.data_dir)
        folder = default_data_dir()
        if not all(task_file(folder, t, self.cfg.longbench_e).exists() for t in self.tasks):
            try:
                fetch(folder)
            except Exception as err:
                raise FileNotFoundError(
                    f"LongBench data is not in {folder} and could not be fetched from the hub ({err}); "
                    f"run `python scripts/fetch_longbench.py --out DIR` where the hub is reachable "
                    f"and pass benchmark.data_dir=DIR") from None
        return folder

    def check(self) -> None:
        unknown = [t for t in self.tasks if t not in ALL_TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"benchmark.tasks: unknown {unknown or 'empty list'}; choose from {', '.join(ALL_TASKS)}")
        if self.cfg.longbench_e:
            missing = [t for t in self.tasks if t not in E_TASKS]
            if missing:
                raise ValueError(f"LongBench-E has no {missing}; its tasks are {', '.join(E_TASKS)}")
        if self.cfg.fuzzy_backend not in FUZZY_BACKENDS:
            raise ValueError(f"benchmark.fuzzy_backend={self.cfg.fuzzy_backend!r}; choose {', '.join(FUZZY_BACKENDS)}")
        if self.cfg.fuzzy_backend == "levenshtein":
            try:
                import Levenshtein  # noqa: F401
            except ImportError:
                raise ValueError("benchmark.fuzzy_backend=levenshtein needs `pip install python-Levenshtein`") from None
        limit = self.cfg.limit
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"benchmark.limit={limit!r} must be a positive integer or null (all samples)")
        folder = self.data_dir()
        for task in self.tasks:
            self.records[task] = read_task(task_file(folder, task, self.cfg.longbench_e), task)[:limit]

    def samples(self, tokenizer=None) -> list[Sample]:
        if not self.records:
            self.check()
        out = []
        for task in self.tasks:
            template = PROMPTS[task]
            after_context = template.split("{context}", 1)[1]
            for record in self.records[task]:
                question = "" if self.cfg.query_aware else after_context.format(input=record["input"])
                out.append(Sample(
                    id=f"{task}/{record['_id']}",
                    prompt=template.format(context=record["context"], input=record["input"]),
                    max_new_tokens=MAX_NEW_TOKENS[task],
                    chat=task not in NO_CHAT_TASKS,
                    question=question,
                    stop_texts=("\n",) if task == "samsum" else (),
                    min_new_tokens=1 if task == "samsum" else 0,
                    meta={"task": task, "answers": record["answers"], "all_classes": record.get("all_classes"),
                          "length": record["length"]}))
        return out

    def encode(self, sample: Sample, tokenizer, model_cfg) -> PromptIds:
        prompt = truncate_middle(tokenizer, sample.prompt, model_cfg.max_length)
        return encode_prompt(tokenizer, prompt, model_cfg, use_chat=sample.chat, question=sample.question,
                             special_tokens_after_chat=self.cfg.tokenize_like_pred_py)

    def data_hashes(self) -> dict:
        folder = self.data_dir()
        hashes = {task: sha256_files([task_file(folder, task, self.cfg.longbench_e)]) for task in self.tasks}
        return {**hashes, "prompts": sha256_text(json.dumps(PROMPTS, sort_keys=True))}

    def score(self, row: dict) -> float:
        return 100 * sample_score(row["task"], row["prediction"], row["answers"], row["all_classes"],
                                  self.cfg.fuzzy_backend)

    def metrics(self, rows: list[dict]) -> dict:
        by_task: dict[str, list[dict]] = {}
        for row in rows:
            by_task.setdefault(row["task"], []).append(row)
        tasks = {}
        for task, task_rows in by_task.items():
            # eval.py uses the all_classes of the file's last line for every sample.
            tasks[task] = longbench_score(task, [r["prediction"] for r in task_rows],
                                          [r["answers"] for r in task_rows], task_rows[-1]["all_classes"],
                                          self.cfg.fuzzy_backend)
        domains = {}
        for domain, members in DOMAINS.items():
            present = [tasks[t] for t in members if t in tasks]
            if present:
                domains[domain] = round(sum(present) / len(present), 2)
        metrics = {"score": round(sum(tasks.values()) / len(tasks), 2), "tasks": tasks, "domains": domains,
                   "n_per_task": {t: len(r) for t, r in by_task.items()},
                   "fuzzy_backend": self.cfg.fuzzy_backend, "query_aware": self.cfg.query_aware}
        if self.cfg.longbench_e:
            metrics["length_buckets"] = {
                task: longbench_e_scores(task, [r["prediction"] for r in rs], [r["answers"] for r in rs],
                                         [r["length"] for r in rs], rs[-1]["all_classes"], self.cfg.fuzzy_backend)
                for task, rs in by_task.items()}
        return metrics
