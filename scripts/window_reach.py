"""Does a run lose the needle where its observation window reaches past the question into the haystack?

    python scripts/window_reach.py QUESTION_AFTER_RUN RUN [RUN ...] --split 40

RULER with the question inside the compressed prompt: the observation window (the prompt's last ``window``
tokens) holds the question and the answer's start, and, where those are shorter than the window, the haystack's
last tokens too. How long they are per sample is read from a run of the same samples with the question fed after
compression (QUESTION_AFTER_RUN's ``question_tokens``: that tail, tokenized on its own, so within a token of the
question-inside prompt's tail). For each RUN (its ``method.window`` from its config) and task, the score on the
samples whose window stays within the question and on those where it reaches 1-8 or more haystack tokens; then,
with ``--split N``, every run's score on the samples whose tail is shorter than N tokens and on the others
(the same samples in every run: whether the split itself matters shows in a run whose window reaches no haystack).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines() if line]


def reach(haystack_tokens: int) -> str:
    return "within the question" if haystack_tokens <= 0 else ("1-8 haystack" if haystack_tokens <= 8 else ">8 haystack")


def table(groups: dict, title: str) -> list[str]:
    lines = [f"| run | task | {title} | n | score |", "|---|---|---|---:|---:|"]
    for (run, task, group), scores in sorted(groups.items()):
        lines.append(f"| {run} | {task} | {group} | {len(scores)} | {sum(scores) / len(scores):.0f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question_after_run", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--split", type=int, help="also split every run's samples at this many question tokens")
    args = parser.parse_args(argv)
    tail = {r["id"]: r["question_tokens"] for r in rows(args.question_after_run)}
    by_reach, by_split = defaultdict(list), defaultdict(list)
    for run in args.runs:
        window = OmegaConf.load(run / "config.yaml").method.window
        name = f"window {window}"
        for r in rows(run):
            by_reach[(name, r["task"], reach(window - tail[r["id"]]))].append(r["score"])
            if args.split:
                side = f"tail < {args.split}" if tail[r["id"]] < args.split else f"tail >= {args.split}"
                by_split[(name, r["task"], side)].append(r["score"])
    print(f"question and answer-start tokens per sample: {min(tail.values())}-{max(tail.values())}\n")
    print("\n".join(table(by_reach, "the window")))
    if by_split:
        print("\n" + "\n".join(table(by_split, "samples")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
